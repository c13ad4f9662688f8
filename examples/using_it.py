"""The README's "Using it" example, runnable (docs/getting-started.md shows this file):
torchrun --nproc-per-node 2 examples/using_it.py"""

import torch

import zeropp
from zeropp.app.models.gpt import GPT, GPTConfig


def train(topology: zeropp.Topology) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=16))
    config = zeropp.ZeroConfig(stage=3, max_grad_norm=1.0)
    engine = zeropp.ZeroEngine(model, torch.optim.AdamW, dict(lr=3e-4), config, topology)
    for _ in range(3):
        x = torch.randint(0, 256, (2, 16))
        loss = engine(x, x)  # the model's own forward
        engine.backward(loss)  # averaged over ranks and accumulation micro-batches
        engine.step()  # optimizer step at each accumulation boundary
    state = engine.full_state_dict()  # consolidated fp32 model.state_dict(), on every rank
    if topology.rank == 0:
        print(f"loss {loss.item():.4f}, {len(state)} tensors")


if __name__ == "__main__":
    with zeropp.init_topology() as topology:  # reads torchrun's environment; groups are destroyed at the end
        train(topology)
