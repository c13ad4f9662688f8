"""qwZ's blocks and the frozen weights' blocks hold one parameter each: a unit's parameters start on a
block boundary of its flat buffer, so a norm's weights of 1.0 no longer set the scale of the small
weights beside them. Each parameter's gathered error is within half a step of its own blocks, where
a flat buffer laid end to end (as before) gives the small weights the norm's step."""

from __future__ import annotations

import torch
from launcher import run_ranks
from models import GPT, GPT_TEST

from zeropp.index.flat import FlatLayout

BLOCK, SMALL = 256, 1e-3  # zeropp's default block


def small_gpt() -> torch.nn.Module:
    """The test GPT with every matrix scaled to about 1e-3 (its norms' weights stay 1.0)."""
    torch.manual_seed(0)
    model = GPT(GPT_TEST)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(SMALL / p.abs().max())
    return model


def half_steps(values: torch.Tensor, bits: int) -> float:
    """Half a quantization step of `values`' largest block, cut from its own start."""
    blocks = torch.nn.functional.pad(values.reshape(-1), (0, -values.numel() % BLOCK)).view(-1, BLOCK)
    return 0.5 * blocks.abs().amax(1).max().item() / ((1 << (bits - 1)) - 1)


def gathered_errors(bits: int) -> dict[str, tuple[float, float, int]]:
    """{parameter: (its largest error once gathered by qwZ, half a step of its own blocks, its dims)}."""
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.topology import init_topology

    topology = init_topology()
    config = ZeroConfig(
        stage=3, quantized_weights=True, weight_bits=bits, weight_block_size=BLOCK, persistence_threshold=0
    )
    engine = ZeroEngine(small_gpt(), torch.optim.AdamW, dict(lr=1e-3), config, topology)
    masters = engine.full_state_dict()
    errors = {}
    for unit in engine.units:
        unit.unshard()
        for name, param in zip(unit.names, unit.params, strict=True):
            error = (param.detach().float() - masters[name]).abs().max().item()
            errors[name] = (error, half_steps(masters[name], bits), masters[name].dim())
        unit.reshard()
    return errors


def end_to_end_errors(bits: int) -> dict[str, tuple[float, float]]:
    """The same for a flat buffer laid end to end and cut into blocks from its shards' starts (before)."""
    from zeropp.quant.backends import kernels_for
    from zeropp.quant.spec import QuantSpec
    from zeropp.zero.grouping import group_parameters, repeated_blocks

    model, kernels, errors = small_gpt(), kernels_for(torch.device("cpu")), {}
    names = {id(p): n for n, p in model.named_parameters()}
    for _, params in group_parameters(model, repeated_blocks(model)):
        tensors = [p.detach() for _, p in params]
        layout = FlatLayout(tuple(tuple(t.shape) for t in tensors), 2, 32)
        full = layout.join(tensors, torch.float32, torch.device("cpu")).view(2, -1)
        values = kernels.dequantize(kernels.quantize(full, QuantSpec(bits, BLOCK)), torch.float32).reshape(-1)
        for (_, p), got in zip(params, layout.split(values), strict=True):
            errors[names[id(p)]] = ((got - p.detach()).abs().max().item(), half_steps(p.detach(), bits))
    return errors


def test_each_parameters_gathered_error_is_half_a_step_of_its_own_blocks():
    for bits in (8, 4):
        before = end_to_end_errors(bits)
        worst = max(error / bound for name, (error, bound) in before.items() if "attn" in name and bound)
        assert worst > 5, worst  # the small matrices beside a norm took its step, laid end to end
        for errors in run_ranks(gathered_errors, 2, bits=bits):
            assert errors.keys() == before.keys()
            for name, (error, bound, _) in errors.items():
                assert error <= bound * (1 + 1e-5) + 1e-9, (bits, name, error, bound)
            assert all(error > 0.1 * bound for error, bound, dims in errors.values() if dims == 2)  # quantized


def test_a_layout_aligned_to_blocks_starts_every_parameter_on_one():
    layout = FlatLayout(((3, 5), (16,), (7,)), world=2, alignment=32, param_alignment=64)
    assert layout.offsets == (0, 64, 128) and layout.end == 135 and layout.padded_numel == 256
    assert layout.gaps() == [(15, 64), (80, 128), (135, 256)] and layout.numel == 38
    flat = layout.join([torch.ones(3, 5), torch.ones(16), torch.ones(7)], torch.float32, torch.device("cpu"))
    assert flat.sum() == 38 and all(not flat[a:b].any() for a, b in layout.gaps())


def test_aligned_blocks_cost_real_blocks_a_hundredth_of_a_percent():
    """GPT-2 small's block (d 768) and a Llama-7B block (d 4096): the aligned buffer against the one laid
    end to end, at world 8 with zeropp's default block (256) and shard alignment (32)."""
    d, f = 768, 3072
    gpt2 = ((d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, f), (f,), (f, d), (d,))
    llama = ((4096,), *[(4096, 4096)] * 4, (4096,), (11008, 4096), (11008, 4096), (4096, 11008))
    for shapes, most in ((gpt2, 1.0001), (llama, 1.0001)):  # GPT-2: 1.000036; Llama: 1
        aligned, plain = FlatLayout(shapes, 8, 32, 256), FlatLayout(shapes, 8, 32)
        assert 1 <= aligned.padded_numel / plain.padded_numel <= most, aligned.padded_numel / plain.padded_numel
