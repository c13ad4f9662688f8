"""The disk tier (offload_optimizer = "nvme"): the masters and optimizer states in files, streamed
unit by unit through a ring of host buffers, train bit for bit like the run without offload, resume
exactly, hold at most depth + 1 units' states in memory, and refuse a bad folder in one line; the
parameters' disk tier (offload_params = "nvme", zero/offload/disk_params.py) the same for the compute shards,
read ahead of their gathers."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, global_batch, loss_of, make_model, rows

from zeropp.config.sections import LossScaleConfig, ZeroConfig
from zeropp.costs.memory import (
    analytic_model_state_bytes,
    disk_gradients_ring_bytes,
    disk_gradients_step_bytes,
    disk_params_ring_bytes,
    disk_params_step_bytes,
    disk_tier_ring_bytes,
    disk_tier_step_bytes,
)
from zeropp.errors import ConfigError
from zeropp.zero.offload.disk import ALIGN, STAGING_BYTES, DiskFiles, DiskTier, rank_folder

STEPS = 3


def train(
    stage: int, offload: dict, *, simulated_nodes: int = 1, resume_at: int | None = None, checkpoints: str = ""
) -> dict:
    from zeropp import ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=simulated_nodes))
    world, rank = topology.world_size, topology.rank
    config = ZeroConfig(stage=stage, gradient_accumulation_steps=2, max_grad_norm=0.05, **offload)
    held_gradients = []  # with the gradients on disk, their bytes in memory at each write and read

    def build():
        torch.manual_seed(0)
        return ZeroEngine(make_model("gpt"), torch.optim.AdamW, dict(lr=1e-2, eps=ADAM_EPS), config, topology)

    engine, held = build(), []  # held: with the parameters on disk, the shard bytes in memory at each read
    _watch_shards(engine, held)
    _watch_gradients(engine, held_gradients)
    io = []
    for step in range(STEPS):
        if step == resume_at:  # saved, and a new engine resumed from the checkpoint
            from zeropp.checkpoint import load_checkpoint, save_checkpoint

            saved = save_checkpoint(engine, checkpoints, step)
            engine = build()
            _watch_shards(engine, held)
            load_checkpoint(engine, saved)
            _watch_gradients(engine, held_gradients)
        gradients = engine.disk.gradients if engine.disk is not None else None
        tiers = [t for t in (engine.disk, gradients, engine.param_disk) if t is not None]
        before = [(t.bytes_read, t.bytes_written) for t in tiers]
        held.clear()
        for micro in range(2):
            x, y = rows(global_batch("gpt", step, micro, world), rank)
            engine.backward(loss_of("gpt", engine, x, y))
        engine.step()
        io.append([(t.bytes_read - r, t.bytes_written - w) for t, (r, w) in zip(tiers, before, strict=True)])
        io[-1].append(max(held, default=0))
    files = engine.param_disk
    return dict(state=engine.full_state_dict(), io=io, psi_shard=sum(u.master.numel() for u in engine.units),
                resident_bytes=engine.measured_model_state_bytes, psi=engine.param_count,
                on_disk=[u.master.numel() for u in files.units] if files else [], window=files.window if files else 0,
                largest_shard=max(u.master.numel() for u in engine.units), held_gradients=max(held_gradients, default=0),
                skipped=engine.scaler.enabled and engine.scaler.scale < config.loss_scale.initial_scale)  # fmt: skip


def _watch_shards(engine, held: list) -> None:
    """Record, at every shard read, the shard bytes in host memory (the ring's bound is asserted on them)."""
    files = engine.param_disk
    if files is None:
        return
    read_in = files._read_in

    def counted(index: int) -> None:
        read_in(index)
        held.append(sum(u.compute_shard.untyped_storage().nbytes() for u in files.units))

    files._read_in = counted


def _watch_gradients(engine, held: list) -> None:
    """Record the gradient bytes the disk tier holds in memory after each park (the shards waiting to be
    written) and at each read (those read back), for the ring's bound."""
    files = engine.disk.gradients if engine.disk is not None else None
    if files is None:
        return
    park, read_in = files.park, files._read_in
    largest = max(u.master.numel() for u in files.units) * files.units[0].grad_dtype.itemsize

    def parked(*args) -> None:
        park(*args)
        held.append(len(files._writes) * largest + sum(t.untyped_storage().nbytes() for t in files._gradients))

    def read(index: int) -> None:
        read_in(index)
        held.append(sum(t.untyped_storage().nbytes() for t in files._gradients))

    files.park, files._read_in = parked, read


def nvme(path, **more) -> dict:
    return dict(offload_optimizer="nvme", offload_path=str(path), **more)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2])
def test_disk_tier_trains_bit_for_bit_like_no_offload(stage, world, tmp_path):
    off = run_ranks(train, world, stage=stage, offload={})
    disk = run_ranks(train, world, stage=stage, offload=nvme(tmp_path))
    for plain, streamed in zip(off, disk, strict=True):
        for key, tensor in plain["state"].items():
            assert torch.equal(tensor, streamed["state"][key]), key
        per_step, _ = disk_tier_step_bytes(streamed["psi_shard"])  # fp32 master + Adam's moments, every unit
        assert per_step == 12 * streamed["psi_shard"]
        assert [io[0] for io in streamed["io"][1:]] == [(per_step, per_step)] * (STEPS - 1)
        assert streamed["io"][0][0] == (4 * streamed["psi_shard"], per_step)  # the first step creates the moments
        if stage >= 2:  # the reduced gradients on disk: written at each micro-batch, read back at the next and the step
            gradients_io = disk_gradients_step_bytes(streamed["psi_shard"], "fp32", micro_batches=2)
            assert [io[1] for io in streamed["io"]] == [gradients_io] * STEPS
            assert gradients_io == (8 * streamed["psi_shard"], 8 * streamed["psi_shard"])
            ring = disk_gradients_ring_bytes(streamed["largest_shard"], "fp32", depth=2)
            assert 0 < streamed["held_gradients"] <= ring
        if stage == 3:  # in memory when the step starts: the fp32 parameters' shard alone (the gradients are on disk)
            kept = analytic_model_state_bytes(streamed["psi"], world, 3, "fp32", optimizer_on_disk=True, where="device")
            assert streamed["resident_bytes"] == pytest.approx(kept, rel=0.02)
            assert kept == pytest.approx(4 * streamed["psi"] / world)
            disk = analytic_model_state_bytes(streamed["psi"], world, 3, "fp32", optimizer_on_disk=True, where="disk")
            assert per_step + gradients_io[1] // 2 == pytest.approx(disk, rel=0.02)  # states and one gradient shard
    assert not any((tmp_path / "zeropp-offload").glob("rank-*/*.bin"))  # removed with the engine


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_on_disk_keep_fp16s_overflow_check_and_loss_scale_bit_for_bit(stage, tmp_path):
    """fp16: each parked gradient's statistics divide out the loss scale of its backward; a step
    skipped for overflow forgets its parked gradients (the next accumulates from nothing)."""
    fp16 = dict(precision="fp16", loss_scale=LossScaleConfig(initial_scale=2.0**30, backoff_factor=2.0**-14))
    off = run_ranks(train, 2, stage=stage, offload=fp16)
    disk = run_ranks(train, 2, stage=stage, offload=nvme(tmp_path, **fp16))
    assert off[0]["skipped"] and disk[0]["skipped"]  # the first step overflowed, the scale fell to 2**16
    for plain, streamed in zip(off, disk, strict=True):
        for key, tensor in plain["state"].items():
            assert torch.equal(tensor, streamed["state"][key]), key


def test_disk_tier_world4_two_nodes_with_depth_1_and_resume(tmp_path):
    off = run_ranks(train, 4, nodes=2, simulated_nodes=2, stage=3, offload={})
    disk = run_ranks(
        train, 4, nodes=2, simulated_nodes=2, stage=3, offload=nvme(tmp_path, offload_buffer_count=1), resume_at=1,
        checkpoints=str(tmp_path / "checkpoints"),
    )  # fmt: skip
    for plain, streamed in zip(off, disk, strict=True):
        for key, tensor in plain["state"].items():
            assert torch.equal(tensor, streamed["state"][key]), key


def test_the_ring_holds_at_most_depth_plus_one_units(tmp_path):
    for depth in (1, 2, 3):
        masters = [torch.nn.Parameter(torch.randn(1000 + i)) for i in range(6)]
        tier = DiskTier(rank_folder(str(tmp_path), depth), depth)
        for master in masters:
            tier.add(master)
        optimizer = tier.optimizer = torch.optim.AdamW(masters, lr=0.1)
        assert all(m.untyped_storage().nbytes() == 0 for m in masters)
        seen = []
        ring = disk_tier_ring_bytes(max(m.numel() for m in masters), depth)
        for [index] in tier.streamed([[i] for i in range(6)]):
            seen.append(index)
            assert masters[index].untyped_storage().nbytes() == 4 * masters[index].numel()
            resident = sum(m.untyped_storage().nbytes() > 0 for m in masters)
            assert 1 <= resident <= depth + 1, (depth, index, resident)
            held = sum(t.untyped_storage().nbytes() for i in range(6) for t in tier.tensors(i))
            assert held <= ring, (depth, index, held, ring)
            masters[index].grad = torch.ones_like(masters[index])
            optimizer.step()
            masters[index].grad = None
        assert seen == list(range(6))
        assert all(m.untyped_storage().nbytes() == 0 for m in masters)
        with tier.resident():
            assert all(optimizer.state[m]["exp_avg"].untyped_storage().nbytes() > 0 for m in masters)
        tier.close()
        assert not (tmp_path / "zeropp-offload" / f"rank-{depth}").exists()


def test_a_crashed_runs_files_are_cleared_at_the_next_start(tmp_path):
    stale = tmp_path / "zeropp-offload" / "rank-0"
    stale.mkdir(parents=True)
    (stale / "unit-0000.bin").write_bytes(b"left by a run that died")
    assert rank_folder(str(tmp_path), 0) == stale and not any(stale.iterdir())


def test_bad_folders_and_settings_are_one_line(tmp_path):
    with pytest.raises(
        ConfigError, match=r"zero.offload_path = '.*missing' is not allowed; expected an existing folder"
    ):
        ZeroConfig(**nvme(tmp_path / "missing")).validate()
    with pytest.raises(
        ConfigError,
        match="zero.offload_path = None is not allowed; expected a folder when zero.offload_optimizer or zero.offload_params is 'nvme'",
    ):
        ZeroConfig(offload_optimizer="nvme").validate()
    with pytest.raises(
        ConfigError,
        match="zero.offload_path = .* expected unset unless zero.offload_optimizer or zero.offload_params is 'nvme'",
    ):
        ZeroConfig(offload_optimizer="cpu", offload_path=str(tmp_path)).validate()
    with pytest.raises(ConfigError, match="zero.offload_buffer_count = 0"):
        ZeroConfig(offload_optimizer="nvme", offload_path=str(tmp_path), offload_buffer_count=0).validate()


def test_a_folder_too_small_is_one_line_before_training(small_disk):
    assert run_ranks(_build_on, 1, path=str(small_disk("64k"))) == ["zero.offload_path:"]


def _build_on(path: str, **offload) -> str:
    from zeropp import ZeroEngine
    from zeropp.topology import init_topology

    offload = offload or dict(offload_optimizer="nvme")
    needs = "optimizer states and gradients" if offload["offload_optimizer"] == "nvme" else "parameters"
    try:
        config = ZeroConfig(stage=3, offload_path=path, **offload)
        ZeroEngine(make_model("gpt"), torch.optim.AdamW, {}, config, init_topology())
    except ConfigError as error:
        message = str(error)
        assert "\n" not in message and f"GiB free, this rank's {needs} need" in message, message
        return message.split(" ")[0]
    return "trained"


# -- the parameters' disk tier (offload_params = "nvme") -----------------------------------------------


def params_nvme(path, optimizer: str = "cpu", **more) -> dict:
    return dict(offload_optimizer=optimizer, offload_params="nvme", offload_path=str(path), **more)


@pytest.mark.parametrize(
    "world, optimizer", [(w, o) for o in ("cpu", "nvme") for w in (1, 2, 4)] + [(2, "none")]
)  # "none": DeepSpeed's offload_param alone, the optimizer on the device
def test_parameters_on_disk_train_bit_for_bit_like_no_offload(world, optimizer, tmp_path):
    off = run_ranks(train, world, stage=3, offload={})
    disk = run_ranks(train, world, stage=3, offload=params_nvme(tmp_path, optimizer))
    for plain, streamed in zip(off, disk, strict=True):
        for key, tensor in plain["state"].items():
            assert torch.equal(tensor, streamed["state"][key]), key
        shards = streamed["on_disk"]
        assert sum(shards) == streamed["psi_shard"]  # world 1 too: offloaded units are gathered, not resident
        # per step: each shard read at every gather (forward and backward of 2 micro-batches), written once
        read, written = disk_params_step_bytes(sum(shards), "fp32", micro_batches=2)
        params_io = [io[-2] for io in streamed["io"]]
        assert params_io == [(read, written)] * STEPS, params_io
        assert (read, written) == (16 * sum(shards), 4 * sum(shards))
        ring = disk_params_ring_bytes(max(shards), "fp32", streamed["window"])
        assert streamed["window"] == 2 and 0 < max(io[-1] for io in streamed["io"]) <= ring
    assert not any((tmp_path / "zeropp-offload").glob("rank-*/*.bin"))


def test_parameters_on_disk_resume_exactly_with_hpz_reading_nothing_in_backward(tmp_path):
    base = dict(hpz_partition_size=2)
    off = run_ranks(train, 4, nodes=2, simulated_nodes=2, stage=3, offload=base)
    disk = run_ranks(
        train, 4, nodes=2, simulated_nodes=2, stage=3, offload=params_nvme(tmp_path, "nvme", offload_buffer_count=1, **base),
        resume_at=1, checkpoints=str(tmp_path / "checkpoints"),
    )  # fmt: skip
    for plain, streamed in zip(off, disk, strict=True):
        for key, tensor in plain["state"].items():
            assert torch.equal(tensor, streamed["state"][key]), key
        shards = sum(streamed["on_disk"])
        read, written = disk_params_step_bytes(shards, "fp32", micro_batches=2, hpz=True)
        assert (read, written) == (4 * shards, 4 * shards)  # later gathers read hpZ's copy, until the step
        assert [io[-2] for io in streamed["io"]] == [(read, written)] * STEPS


def test_a_folder_too_small_for_the_parameters_is_one_line(small_disk):
    message = run_ranks(_build_on, 1, path=str(small_disk("64k")), offload_params="nvme", offload_optimizer="cpu")
    assert message == ["zero.offload_path:"]


# -- direct I/O: the files' pages never enter the page cache -------------------------------------------


class _Files(DiskFiles):
    """Files of given tensors, one tensor list per file."""

    def __init__(self, folder, files: list[list[torch.Tensor]]) -> None:
        super().__init__(folder, depth=1)
        self.files = files
        for _ in files:
            self._open()

    def tensors(self, index: int) -> list[torch.Tensor]:
        return self.files[index]


def cached_pages(path) -> int:
    """How many of the file's pages are in the page cache (mincore over a private mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        window = (ctypes.c_char * size).from_buffer(mapped)
        vector = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        status = libc.mincore(ctypes.c_void_p(ctypes.addressof(window)), ctypes.c_size_t(size), vector)
        del window
    assert status == 0, ctypes.get_errno()
    return sum(v & 1 for v in vector)


def _roundtrip(folder) -> tuple[_Files, list[torch.Tensor]]:
    sizes = [[1, 1025], [(STAGING_BYTES // 4) + 3], [12345]]  # odd sizes, one over the staging buffer
    files = [[torch.randn(n) for n in group] for group in sizes]
    files[2][0] = files[2][0].bfloat16()
    expected = [t.clone() for group in files for t in group]
    return _Files(folder, files), expected


@pytest.mark.unit
def test_the_files_are_read_and_written_past_the_page_cache_bit_for_bit(tmp_path):
    disk, expected = _roundtrip(tmp_path)
    assert all(t.untyped_storage().nbytes() == 0 for group in disk.files for t in group)  # written out, freed
    paths = sorted(tmp_path.glob("unit-*.bin"))
    assert [cached_pages(p) for p in paths] == [0, 0, 0]
    assert os.path.getsize(paths[0]) == ALIGN + 2 * ALIGN  # 4 bytes, then 4,100 bytes, each from a page boundary
    for index in range(3):
        disk._read_in(index)
    assert all(torch.equal(a, b) for a, b in zip([t for g in disk.files for t in g], expected, strict=True))
    assert [cached_pages(p) for p in paths] == [0, 0, 0]
    disk.close()


@pytest.mark.unit
def test_a_file_system_without_direct_io_gets_buffered_files_said_once(tmp_path, monkeypatch, capsys):
    real_open = os.open

    def refusing(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing)
    disk, expected = _roundtrip(tmp_path)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"zeropp: {tmp_path} does not take direct I/O (O_DIRECT): the offload files go through the page cache"
    ]
    assert sum(cached_pages(p) for p in tmp_path.glob("unit-*.bin")) > 0  # the check above can tell
    for index in range(3):
        disk._read_in(index)
    assert all(torch.equal(a, b) for a, b in zip([t for g in disk.files for t in g], expected, strict=True))
    disk.close()
