"""Adam and AdamW with their two moments stored in bf16 (``optimizer_state_dtype = "bf16"``).

torch's optimizers keep their state in the parameter's dtype, here the fp32 master: 8 bytes per
parameter for Adam's two moments, half of Table 1's 16. Stored in bf16 they take 4, and a
parameter's model states 12 bytes. The update is torch's (the same operations in the same order, in
fp32): each step reads the moments into fp32, updates them there, steps the master and rounds the
moments back to bf16 (to nearest). With ``state_dtype = torch.float32`` it is torch's single-tensor
implementation bit for bit, which the tests check; the bf16 rounding is the only difference.

Masters in bf16 (``master_dtype = "bf16"``): a parameter that is not fp32 gets a compensation of its
own dtype (Kahan summation), and the master the update reads and writes is their sum in fp32,
``param + compensation``; after the update the parameter takes the sum rounded to nearest and the
compensation what that rounding lost. A plain bf16 master drops every update below half its ulp
(2^-9 of the weight): with lr 1e-4 Adam's steps of about lr stall every weight above 0.05; the
compensation carries them until they add up. Kahan rather than stochastic rounding: deterministic, so
a run gives the same weights at any world size and after a resume (stochastic rounding needs a random
stream per element that follows the shards), at 2 bytes per parameter.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from zeropp.errors import ConfigError


class LowPrecisionAdam(torch.optim.Optimizer):
    """Adam (`decoupled` False: weight decay added to the gradient) or AdamW (True: decoupled decay,
    torch's ``p *= 1 - lr * wd``), moments stored in `state_dtype`. No amsgrad, maximize, capturable."""

    elementwise = True  # exact on flat shards (zeropp.zero.optim.stepping)

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        decoupled: bool,
        state_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.decoupled = decoupled
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch's signature)
        loss = None if closure is None else closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                compensated = param.dtype != torch.float32  # a bf16 master: Kahan summation
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.state_dtype)
                    if compensated:
                        state["compensation"] = torch.zeros_like(param)
                grad = param.grad.to(torch.float32)  # itself where it is fp32
                state["step"] += 1
                step = state["step"].item()
                master = param.to(torch.float32).add_(state["compensation"]) if compensated else param
                if decay and self.decoupled:
                    master.mul_(1 - lr * decay)
                elif decay:
                    grad = grad.add(master, alpha=decay)
                exp_avg = state["exp_avg"].to(torch.float32).lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].to(torch.float32).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr / (1 - beta1**step)
                denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
                master.addcdiv_(exp_avg, denom, value=-step_size)
                if compensated:  # the parameter rounded to nearest, the compensation what the rounding lost
                    param.copy_(master)
                    state["compensation"].copy_(master.sub_(param))
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
        return loss


ADAMS = {torch.optim.Adam: False, torch.optim.AdamW: True}  # the class -> decoupled weight decay
UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")


def low_precision_adam(optimizer: type, kwargs: dict, state_dtype: torch.dtype, key: str):
    """A factory building `optimizer` (torch's Adam or AdamW class, with `kwargs`) with its moments in
    `state_dtype` (and Kahan-compensated low-precision masters); anything else is refused in one line
    naming the config `key` that asked for it (``zero.optimizer_state_dtype = 'bf16'``)."""
    if optimizer not in ADAMS:
        name = getattr(optimizer, "__name__", repr(optimizer))
        raise ConfigError(f"{key} needs torch.optim.Adam or torch.optim.AdamW (given as the class), not {name}")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("foreach", "fused")}  # one implementation here
    asked = [k for k in UNSUPPORTED if kwargs.pop(k, False)]
    if asked:
        raise ConfigError(f"{key} does not support {', '.join(asked)} of {optimizer.__name__}")
    if optimizer is torch.optim.AdamW:
        kwargs.setdefault("weight_decay", 1e-2)  # torch's AdamW default
    return lambda masters: LowPrecisionAdam(masters, **kwargs, decoupled=ADAMS[optimizer], state_dtype=state_dtype)
