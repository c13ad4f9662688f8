"""Ulysses context parallelism on a Hugging Face Llama (docs/long-sequences.md shows this file):
torchrun --nproc-per-node 2 examples/long_sequences.py

Both ranks hold half of every sequence; attention trades sequence halves for head halves by
all-to-all, and the loss is the mean over every token of the sequence."""

import torch
import transformers

import zeropp


def train(topology: zeropp.Topology) -> list[float]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    engine = zeropp.ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), zeropp.ZeroConfig(stage=3), topology)
    reader, readers = topology.layout.reader(topology.rank)  # the ranks of one context-parallel run read the same rows
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(3):
        rows = torch.randint(0, 256, (readers, 2, 512), generator=generator)[reader]  # 2 sequences of 512 tokens
        inputs = zeropp.causal_lm_inputs(topology, rows)  # this rank's 256 tokens of each, shifted labels
        loss = engine(**inputs).loss
        engine.backward(loss)
        engine.step()
        torch.distributed.all_reduce(mean := loss.detach() / topology.world_size)  # the sequences' loss
        losses.append(mean.item())
    return losses


if __name__ == "__main__":
    with zeropp.init_topology(zeropp.TopologyConfig(context_parallel_size=2)) as topology:
        losses = train(topology)
        if topology.rank == 0:
            print(f"context parallel {topology.context_parallel.size}: losses {', '.join(f'{x:.4f}' for x in losses)}")
