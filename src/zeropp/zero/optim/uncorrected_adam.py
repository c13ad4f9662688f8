"""Adam without bias correction: DeepSpeed's Adam with ``bias_correction: false``, which torch.optim
has no switch for.

Each step updates ``m = b1 m + (1 - b1) g`` and ``v = b2 v + (1 - b2) g²`` and moves the parameter by
``lr m / (sqrt(v) + eps)``, where torch's Adam divides m by ``1 - b1^t`` and v by ``1 - b2^t``
first. Weight decay is decoupled (``p *= 1 - lr wd``, DeepSpeed's ``adam_w_mode``, the default) or
added to the gradient (L2). Its state is torch's Adam's (``step``, ``exp_avg``, ``exp_avg_sq``), so
checkpoints read and write it as they do Adam's; it is element-wise, so it steps on the flat shards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class UncorrectedAdam(torch.optim.Optimizer):
    elementwise = True  # every element from its own gradient and state alone (zero.optim.stepping)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled: bool = True,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled=decoupled)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                grad = p.grad if group["decoupled"] or not decay else p.grad.add(p, alpha=decay)
                state["step"] += 1
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if decay and group["decoupled"]:
                    p.mul_(1 - lr * decay)
                p.addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt().add_(group["eps"]), value=-lr)
        return loss
