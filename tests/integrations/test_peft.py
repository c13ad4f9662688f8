"""PEFT (LoRA) through ZeroTrainer: a ``peft.get_peft_model`` Llama at stage 3 on 2 ranks trains as one
plain ``transformers.Trainer`` process does, its frozen base is sharded in the units (each rank keeps half of
it, in the compute dtype) and carries no master, gradient or optimizer state, and
``save_model()`` writes the adapter folder the Trainer writes for a PeftModel (``PeftModel.from_pretrained``
loads it)."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from trainer_runs import PROBE, STEPS, TOLERANCE, max_difference, rows, tiny_llama, training_args

pytest.importorskip("transformers")
pytest.importorskip("peft")

START = "forkserver"  # see test_transformers


def lora_model():
    import peft

    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    base = tiny_llama()
    torch.manual_seed(1)  # the adapters' initialization
    return peft.get_peft_model(base, config)


def _trained(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _plain(out: str) -> dict:
    import transformers

    model = lora_model()
    trainer = transformers.Trainer(model, training_args(out, 1), train_dataset=rows())
    trainer.train()
    trainer.save_model(f"{out}/adapter")
    return {"state": _trained(model), "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}


def _zero(out: str) -> dict:
    import zeropp
    from zeropp.integrations.transformers import ZeroTrainer

    model = lora_model()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainer = ZeroTrainer(model, training_args(out, 2), train_dataset=rows(), zero_config=zeropp.ZeroConfig(stage=3))
    trainer.train()
    engine = trainer.engine
    state_numel = sum(b.numel() for buffers in engine.stepper.buffers for b in buffers.values())
    frozen_shards = sum(u.frozen.shard.numel() for u in engine.units if u.frozen is not None)
    trainer.save_model(f"{out}/adapter")
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=PROBE).logits
    return {
        "state": engine.full_state_dict(), "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "managed": engine.param_count, "trainable": trainable, "state_numel": state_numel, "logits": logits,
        "base": base, "frozen_shards": frozen_shards,
    }  # fmt: skip


def test_lora_at_stage_3_equals_plain_trainer_lora_and_saves_its_adapter(tmp_path):
    import peft

    (plain,) = run_ranks(_plain, 1, start=START, out=str(tmp_path / "plain"))
    zero = run_ranks(_zero, 2, start=START, out=str(tmp_path / "zero"))
    for rank in zero:
        assert max_difference(rank["state"], plain["state"]) < TOLERANCE
        assert len(rank["losses"]) == STEPS and rank["losses"] == pytest.approx(plain["losses"], abs=TOLERANCE)
        # only the adapters have masters and optimizer state: AdamW's two moments over this rank's half
        assert rank["managed"] == rank["trainable"]
        assert rank["state_numel"] <= 2 * (rank["trainable"] // 2 + 64)
        # the frozen base is sharded too: this rank's half of it (padding aside)
        assert rank["base"] // 2 <= rank["frozen_shards"] <= rank["base"] // 2 + 3 * 64
    start = lora_model().state_dict()
    lora = [k for k in start if "lora_B" in k]
    assert (
        lora and max_difference({k: plain["state"][k] for k in lora}, {k: start[k] for k in lora}) > 1e-3
    )  # it trained
    base = [k for k in start if "lora" not in k]
    assert max_difference({k: zero[0]["state"][k] for k in base}, {k: start[k] for k in base}) == 0  # frozen
    # save_model(): the Trainer's PeftModel folder (adapter weights and config), which peft loads
    ours = sorted(p.name for p in (tmp_path / "zero" / "adapter").iterdir())
    assert ours == sorted(p.name for p in (tmp_path / "plain" / "adapter").iterdir())
    assert "adapter_model.safetensors" in ours and "model.safetensors" not in ours
    model = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "zero" / "adapter").eval()
    with torch.no_grad():
        assert (model(input_ids=PROBE).logits - zero[0]["logits"]).abs().max().item() < TOLERANCE
