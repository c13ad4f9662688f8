"""Tiny Hugging Face architectures built from configs (no download), their batches and the
single-process reference that averages the ranks' chunks' mean losses (some losses, OPT's, are not
separable over the batch)."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

VOCAB, SEQ, PER_RANK = 128, 8, 2
LLAMA_LIKE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
OPTIM = dict(lr=1e-2, eps=1e-3, weight_decay=0.01)  # eps: models.ADAM_EPS, larger: some gradients here are ~1e-4
MOE = dict(num_experts_per_tok=2, router_jitter_noise=0.0)

# architecture -> (config class, causal LM class, config keywords)
ZOO: dict[str, tuple[str, str, dict]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(LLAMA_LIKE, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", LLAMA_LIKE),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(LLAMA_LIKE, head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(LLAMA_LIKE, head_dim=8, query_pre_attn_scalar=8)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(LLAMA_LIKE, head_dim=8, query_pre_attn_scalar=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(LLAMA_LIKE, pad_token_id=0)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                                word_embed_proj_dim=32, pad_token_id=1)),
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                             num_attention_heads=4)),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=32, n_layer=2, n_head=4)),
    "gpt-j": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_inner=64)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", LLAMA_LIKE),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(LLAMA_LIKE, pad_token_id=0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(LLAMA_LIKE, num_local_experts=4, **MOE)),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(LLAMA_LIKE, num_experts=4, moe_intermediate_size=32,
                                                              shared_expert_intermediate_size=32, **MOE)),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                          decoder_start_token_id=0)),
}  # fmt: skip


# mixture-of-experts architectures beyond the zoo's two, for expert parallelism (tests/expert_parallel)
MORE_MOE: dict[str, tuple[str, str, dict]] = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(LLAMA_LIKE, head_dim=8, num_experts=4,
                                                             moe_intermediate_size=32, **MOE)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(LLAMA_LIKE, num_experts=4, pad_token_id=0, eos_token_id=1,
                                                     **MOE)),
    # DeepSeek-V3's layout: multi-head latent attention, a shared expert beside 4 routed ones in every layer
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        LLAMA_LIKE, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)),
}  # fmt: skip


def zoo_model(name: str, seed: int = 0) -> nn.Module:
    """`name`'s tiny model, every dropout off (exactness needs no randomness after initialization)."""
    import transformers

    config_class, model_class, keywords = ZOO.get(name) or MORE_MOE[name]
    config = getattr(transformers, config_class)(vocab_size=VOCAB, max_position_embeddings=4 * SEQ, **keywords)
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(config)


def zoo_batch(step: int, world: int) -> torch.Tensor:
    """The global batch of `step`: PER_RANK sequences per data-parallel rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(2, VOCAB, (world * PER_RANK, SEQ), generator=g)


def zoo_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def zoo_reference(
    name: str, steps: int, world: int, model: nn.Module | None = None, batch=None
) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """One process: each step the mean of the `world` chunks' mean losses; the final state and each
    step's chunk losses (rank r's is chunk r's). `model`, `batch`: other than `name`'s and :func:`zoo_batch`."""
    model = zoo_model(name) if model is None else model
    batch = zoo_batch if batch is None else batch
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIM)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        chunks = batch(step, world).chunk(world)
        chunk_losses = [zoo_loss(model, chunk) for chunk in chunks]
        (sum(chunk_losses) / world).backward()
        optimizer.step()
        losses.append([loss.item() for loss in chunk_losses])
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}, losses


def train_zoo(
    names: list[str],
    references: dict,
    steps: int,
    stages: tuple[int, ...] = (3,),
    tp: int = 1,
    zero: dict | None = None,
    folders: dict[str, str] | None = None,
) -> dict[str, dict]:
    """On each rank: every architecture of `names` trained `steps` steps at each of `stages` (dp x `tp`,
    `zero`: more ZeroConfig keys), compared with `references` ({name: state}, :func:`zoo_reference`'s);
    the first step's tensor-parallel ledger and :func:`~zeropp.costs.tensor_parallel.plan_step_transfers`'s
    bytes. `folders`: {name: a safetensors folder}: the model built on the meta device and its weights
    loaded with ``load_pretrained`` instead (what this rank read, against its shards)."""
    import zeropp.checkpoint.pretrained as pretrained
    from zeropp import ZeroConfig, ZeroEngine, load_pretrained
    from zeropp.config.sections import TopologyConfig
    from zeropp.costs.tensor_parallel import plan_step_transfers
    from zeropp.tensor_parallel.apply import parallelize, plan_for
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(tensor_parallel_size=tp))
    dp = topology.data_parallel
    read, counted = pretrained._read_elements, []
    pretrained._read_elements = lambda *args: counted.append(read(*args).numel()) or read(*args)
    out = {}
    for name in names:
        for stage in stages:
            folder = (folders or {}).get(name)
            with torch.device("meta") if folder else torch.device("cpu"):
                model = zoo_model(name)
            config = ZeroConfig(stage=stage, **(zero or {}))
            engine = ZeroEngine(parallelize(model, topology), torch.optim.AdamW, OPTIM, config, topology)
            if folder:
                counted.clear()
                load_pretrained(engine, folder)
            result = dict(read=sum(counted), shards=sum(unit.master.numel() for unit in engine.units), losses=[])
            for step in range(steps):
                engine.comm.ledger.reset()
                loss = zoo_loss(engine, zoo_batch(step, dp.size).chunk(dp.size)[dp.rank])
                engine.backward(loss)
                assert engine.step()
                result["losses"].append(loss.item())
                if step == 0 and tp > 1:
                    whole = zoo_model(name)
                    priced = plan_step_transfers(whole, plan_for(whole, tp), PER_RANK * SEQ, 4, tp)
                    result["ledger"], result["priced"] = Counter(), Counter()
                    for (op, phase, _), sent in engine.comm.ledger.bytes.items():
                        result["ledger"][op, phase] += sent if op.startswith("tp.") else 0
                    for t in priced:
                        result["priced"][t.op, t.phase] += t.sent
            if references:
                ours, ref = engine.full_state_dict(), references[name]
                result["error"] = max((ours[k] - ref[k]).abs().max().item() for k in ref)
            out[f"{name}/stage{stage}"] = result
    return out
