"""qgZ's Hadamard rotation on its Triton kernel (zeropp.quant.triton.hadamard) against the torch
butterflies (zeropp.quant.hadamard), bit for bit; on CPU under Triton's interpreter (tests/triton_setup.py)."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from triton_setup import DEVICE, NEEDS_GPU_OR_INTERPRETER, import_kernels, tk

from zeropp.quant import hadamard, reference
from zeropp.quant.backends import backend_of

hadamard_triton = import_kernels("zeropp.quant.triton.hadamard")
pytestmark = [pytest.mark.kernels, NEEDS_GPU_OR_INTERPRETER]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The fp32 bits, every NaN as one (a GPU's NaN payloads are not the CPU's)."""
    t = t.cpu()
    return torch.where(t.isnan(), torch.tensor(float("nan")), t).view(torch.int32)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize(
    ("rows", "columns", "block", "dtype"),
    [(3, 70, 16, torch.float32), (2, 600, 256, torch.float32), (5, 9, 2, torch.bfloat16), (4, 33, 1, torch.float16),
     (1, 100, 128, torch.float32), (2, 5, 8, torch.float32)],
)  # fmt: skip
def test_triton_rotation_is_the_torch_butterflies_bit_for_bit(rows, columns, block, dtype, inverse):
    g = torch.Generator().manual_seed(columns)
    x = (torch.randn(rows, columns, generator=g) * 10.0 ** torch.randint(-3, 3, (rows, 1), generator=g)).to(dtype)
    x[0, :3] = torch.tensor([float("inf"), float("nan"), -0.0])  # non-finite values spread as in torch
    expected = hadamard.rotate(x, block, inverse=inverse)
    rotated = hadamard_triton.rotate(x.to(DEVICE), block, inverse=inverse)
    assert rotated.dtype == torch.float32 and rotated.shape == x.shape
    assert torch.equal(_bits(rotated), _bits(expected))


def test_triton_rotation_reads_strided_rows_and_leaves_the_input_alone():
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(1))
    view = x.to(DEVICE)[:, 16:80]  # a column chunk, as qgZ rotates them
    before = view.clone()
    rotated = hadamard_triton.rotate(view, 32)
    assert torch.equal(view, before)
    assert torch.equal(_bits(rotated), _bits(hadamard.rotate(x[:, 16:80], 32)))


def test_the_backend_pairs_the_rotation_with_its_kernels():
    assert backend_of(tk).rotate is hadamard_triton.rotate
    assert backend_of(reference).rotate is hadamard.rotate


def qgz_backends_worker(simulated_nodes: int) -> list[str]:
    """Two-level qgZ with the rotation on the Triton kernels and on the torch reference: the same bits."""
    from zeropp.comm.communicator import Communicator
    from zeropp.comm.quantized import reduce_scatter_quantized
    from zeropp.config.sections import TopologyConfig
    from zeropp.quant.backends import kernels_for
    from zeropp.quant.spec import QuantSpec
    from zeropp.topology import init_topology

    topo = init_topology(TopologyConfig(nodes=simulated_nodes))
    comm, world = Communicator(topo), topo.world_size
    g = torch.Generator().manual_seed(topo.rank)
    x = torch.randn(world * 80, generator=g) * torch.logspace(-2, 1, world * 80)  # 80: two blocks of 32 and a short one
    results = {}
    for backend in ("torch", "triton"):
        out = torch.empty(80)
        reduce_scatter_quantized(
            comm, out, x.clone(), QuantSpec(4, 32), kernels_for(topo.device, backend), topo.shard_groups(),
            chunks=2, bucket_numel=128, intra_spec=QuantSpec(8, 32), hadamard_rotation=True,
        ).wait()  # fmt: skip
        results[backend] = out
    return [] if torch.equal(_bits(results["torch"]), _bits(results["triton"])) else ["backends differ"]


def test_qgz_with_rotation_on_triton_is_the_torch_path_bit_for_bit():
    if DEVICE != "cpu":
        pytest.skip("the ranks run on CPU tensors: the interpreter case")
    for rank, failures in enumerate(run_ranks(qgz_backends_worker, 4, nodes=2, simulated_nodes=2)):
        assert not failures, (rank, failures)
