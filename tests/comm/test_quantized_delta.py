"""qWD's all-gather on real gloo ranks (2 nodes x 2, the reference gathered inside each node): every rank
lands the same bits, reference + the dequantized changes; each value within half a step of its block;
two gathers in flight at once; the ledger's bytes."""

from __future__ import annotations

import torch
from launcher import run_ranks


def delta_worker() -> dict:
    from zeropp.comm.communicator import Communicator
    from zeropp.comm.ledger import ring_bytes
    from zeropp.comm.quantized_delta import all_gather_delta
    from zeropp.config.sections import TopologyConfig
    from zeropp.index.flat import secondary_range
    from zeropp.quant.backends import kernels_for
    from zeropp.quant.spec import QuantSpec
    from zeropp.topology import init_topology

    topo = init_topology(TopologyConfig(nodes=2))
    comm, kernels = Communicator(topo), kernels_for(topo.device, "torch")
    groups = topo.shard_groups(0)
    n, rank, inner = groups.shard.size, groups.shard.rank, groups.secondary
    failures, cases = [], 0
    for dtype in (torch.float32, torch.bfloat16):
        for bits in (4, 8):
            spec = QuantSpec(bits, 16)
            started = []
            for width in (1, 37, 301):  # all three in flight before any is waited for
                g = torch.Generator().manual_seed(width)
                reference = torch.randn(n * width, generator=g).to(dtype)
                changed = (
                    reference.float() + 3e-2 * torch.randn(n * width, generator=g) * torch.rand(1, generator=g)
                ).to(dtype)
                out = torch.full((n * width,), float("nan"), dtype=dtype)
                start, stop = secondary_range(n * width, inner.size, inner.rank)
                comm.ledger.reset()
                base = comm.all_gather(out, reference[start:stop].clone(), inner, bucket_numel=64, async_op=True)
                mine = slice(rank * width, (rank + 1) * width)
                pending = all_gather_delta(
                    comm, out, changed[mine].clone(), reference[mine].clone(), base, spec, groups.shard, kernels,
                    bucket_numel=64, async_op=True,
                )  # fmt: skip
                sent = {link: comm.ledger.total(op="all_gather", link=link) for link in ("intra", "inter")}
                started.append((width, reference, changed, out, pending, sent))
            for width, reference, changed, out, pending, sent in reversed(started):
                pending.wait()
                key = f"{dtype}-int{bits}-w{width}"
                change = (changed.float() - reference.float()).view(n, width)
                q = kernels.quantize(change, spec)
                expected = (reference.float().view(n, width) + kernels.dequantize(q, torch.float32)).to(dtype)
                if not torch.equal(out.view(n, width), expected):
                    failures.append(f"{key}: not reference + dequantized changes")
                scales = q.scales.repeat_interleave(16, dim=1)[:, :width]
                ulp = torch.finfo(dtype).eps * changed.float().abs().view(n, width)
                if not bool(((out.float() - changed.float()).view(n, width).abs() <= 0.5 * scales + ulp).all()):
                    failures.append(f"{key}: beyond half a step of the change's block")
                message = spec.row_bytes(width) + 4 * spec.blocks(width)
                expected_bytes = ring_bytes(n * message, n) + ring_bytes(n * width * out.element_size(), inner.size)
                if sent["intra"] + sent["inter"] != expected_bytes:
                    failures.append(f"{key}: {sent} sent, expected {expected_bytes} in all")
                cases += 1
    return dict(failures=failures, cases=cases, out=out)


def test_delta_gather_lands_reference_plus_changes_identically_on_every_rank():
    per_rank = run_ranks(delta_worker, 4, nodes=2)
    for rank, result in enumerate(per_rank):
        assert result["cases"] == 12 and result["failures"] == [], (rank, result["failures"])
        assert torch.equal(result["out"], per_rank[0]["out"]), rank
