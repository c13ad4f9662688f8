"""Error feedback for qgZ, LoCo's variant (Xie et al. 2024, "LoCo: Low-Bit Communication Adaptor
for Large-scale Model Training"; DeepSpeed's ``zeropp_loco_param``).

Every quantization qgZ does on this rank keeps a residual ``e`` of the values it quantizes, in fp32,
and compensates the next quantization of the same values (same unit, hop, rows and columns)::

    c     = x + e                       what is quantized instead of x
    e_new = c - dequantize(quantize(c)) what this quantization dropped (exact in fp32: |c - q| <= |q| / 2
                                        where q != 0, so the subtraction is exact by Sterbenz's lemma)
    e     = beta * e + (1 - beta) * e_new

as DeepSpeed's LoCo kernels update ``err_beta`` (``quant_reduce.cu``: ``err = err_beta * err +
(1 - err_beta) * (compensated - dequantized)``). beta = 0 is plain error feedback (EF-SGD).
Each product and the sum round once to fp32. With the Triton kernels the update after quantizing is
one pass over memory (:mod:`zeropp.quant.triton.feedback`), bit for bit the torch ops' result.

Invariant (e_0 = 0, no reset in between): with t_k the values transmitted (dequantized) at the k-th
quantization and x_k its inputs, ``sum_k t_k + e_T / (1 - beta) = sum_k x_k``, exact in real
arithmetic (the fp32 roundings are those of the additions ``x + e`` and of the moving average; for
beta = 0 each step's ``t_k + e_k = c_k`` holds bit for bit). What quantization drops is therefore
delayed, not lost, except what a reset (every ``gradient_error_reset_steps`` steps) zeroes.

Where residuals live (per unit): hop 1 quantizes this rank's own gradient of the whole unit, so its
residual has the unit's padded size (rows in qgZ's send order); hop 2 quantizes the node's partial
sums this rank forwards, Y of the W slices, so its residual is sharded over the node's X ranks like
those partial sums are. They are freed when qgZ is switched off (``quantized_gradients_until``'s
schedule). Both are rank-specific: a checkpoint keeps them per rank, and a run on
another world size or node count starts them from zero.
"""

from __future__ import annotations

import torch

from zeropp.quant.backends import backend_of
from zeropp.quant.spec import Quantized, QuantKernels, QuantSpec

HOPS = ("intra", "inter")


class ErrorFeedback:
    """One unit's qgZ residuals (fp32, created at first use) and the LoCo update."""

    def __init__(self, beta: float) -> None:
        self.beta = beta
        self.residuals: dict[str, torch.Tensor] = {}

    def quantize(
        self, kernels: QuantKernels, hop: str, values: torch.Tensor, spec: QuantSpec, start: int, width: int
    ) -> Quantized:
        """Quantize `values` [rows, c] (columns start..start+c of rows `width` wide) plus the hop's
        residual; update the residual by the rule above."""
        rows, columns = values.shape
        residual = self.residuals.get(hop)
        if residual is None:
            residual = self.residuals[hop] = torch.zeros(rows, width, dtype=torch.float32, device=values.device)
        residual = residual[:, start : start + columns]
        compensated = torch.add(residual, values)  # one pass: bf16/fp16 values widen exactly to fp32
        quantized = kernels.quantize(compensated, spec)
        fused = backend_of(kernels).update_residual
        if fused is not None:
            fused(residual, compensated, quantized, self.beta)
            return quantized
        dropped = compensated.sub_(kernels.dequantize(quantized, torch.float32))
        if self.beta == 0:
            residual.copy_(dropped)
        else:  # two roundings, as the Triton kernel does (add's alpha would be a fused multiply-add on CPU)
            residual.mul_(self.beta).add_(dropped.mul_(1 - self.beta))
        return quantized

    def reset(self) -> None:
        for residual in self.residuals.values():
            residual.zero_()

    def free(self) -> None:
        """Drop the residuals (qgZ is off for the rest of the run: nothing will be compensated). What
        they still held is lost, one quantization's error; a later qgZ reduction starts from zero."""
        self.residuals.clear()

    def scale(self, factor: float) -> None:
        """Follow a change of the fp16 loss scale (residuals are in scaled gradient units)."""
        for residual in self.residuals.values():
            residual.mul_(factor)

    def numel(self) -> int:
        return sum(r.numel() for r in self.residuals.values())
