"""No host-device synchronization on the step's hot path: every ``.item()``, ``bool(tensor)``,
``.tolist()`` and ``torch.equal`` reached during a step is recorded (a dispatch mode sees the
``aten._local_scalar_dense`` they all end in) and attributed to the line of zeropp that reached it.

What remains, and why (on CUDA):
- fp16's overflow check, once a step for all units (``ZeroEngine._any_overflow``): skipping the step
  is a decision the host takes;
- which parameters some rank gave a gradient (``parameters_given_a_gradient``: a byte per parameter,
  all-reduced and read with ``.tolist()``, which on CUDA copies to the host without passing through
  ``_local_scalar_dense``, so this count does not see it): the segments skip a parameter without one
  as torch does, a decision the host takes (See [Note: segments]);
- the optimizer's own step counters (torch's Adam reads ``step`` tensors that live on the host: no
  device synchronization);
- the torch reference's check for blocks it can quantize in one pass (``quant/reference.py``, on CPU
  tensors only: on CUDA the condition stops before it).
The gradient norm stays a device tensor; ``last_grad_norm`` synchronizes only when read.
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from launcher import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

SCALAR_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default}
CPU_ONLY = "quant/reference.py"  # its `.all()` is behind `x.device.type != "cpu" or`: never reached on CUDA
OPTIMIZER_STEP = "zero/optim/stepping.py:optimizer.step()"  # torch's own host-side step counters


class HostReads(TorchDispatchMode):
    """Counts scalar reads by the innermost line of zeropp's source that reached them."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SCALAR_READS:
            frames = [f for f in traceback.extract_stack() if "/zeropp/" in f.filename]
            where = frames[-1] if frames else None
            self.sites[f"{where.filename.split('/zeropp/')[-1]}:{where.line}" if where else "outside zeropp"] += 1
        return func(*args, **(kwargs or {}))


def reads_per_step(zero: dict, steps: int = 3) -> dict[str, float]:
    import zeropp
    from zeropp.app.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    topology = zeropp.init_topology()
    model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32, vocab_size=64))
    engine = zeropp.ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), zeropp.ZeroConfig(**zero), topology)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(topology.rank))
    for _ in range(2):  # the first step records the order and allocates the optimizer state
        engine.backward(engine(x, x))
        engine.step()
    reads = HostReads()
    with reads:
        for _ in range(steps):
            engine.backward(engine(x, x))
            engine.step()
    norm = engine.last_grad_norm
    zeropp.shutdown()
    assert norm is None or norm > 0
    return {site: n / steps for site, n in reads.sites.items()}


CASES = {
    "stage3": (dict(stage=3), {}),
    "stage3-clipped": (dict(stage=3, max_grad_norm=0.5), {}),
    "zeropp": (dict(stage=3, quantized_weights=True, hpz_partition_size=0, quantized_gradients=True), {}),
    "fp16-clipped": (
        dict(stage=3, precision="fp16", max_grad_norm=0.5),
        {'engine.py:return bool(self._reduce_over_shards(local, "max").item())': 1.0},
    ),
    "stage2-accumulation": (dict(stage=2, gradient_accumulation_steps=2), {}),
}


@pytest.mark.parametrize("case", CASES)
def test_a_step_reads_the_device_only_where_the_host_must_decide(case):
    zero, expected = CASES[case]
    for sites in run_ranks(reads_per_step, 4, nodes=2, zero=zero):
        ours = {s: n for s, n in sites.items() if CPU_ONLY not in s and OPTIMIZER_STEP not in s}
        assert ours == expected, sites
