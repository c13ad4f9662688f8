"""LoRA fine-tuning of a Hugging Face model for ``zeropp train --lora-rank R`` (peft).

The model built from its config.json is wrapped by ``peft.get_peft_model`` with a ``LoraConfig`` of
the run's ``model.lora_*`` keys: its own weights frozen (sharded at stage 3, stored quantized with
``quantized_nontrainable_weights``), the adapters trained. Built on the meta device, the adapters are
initialized as peft initializes them (A Kaiming-uniform, B zero: the adapted model starts as the
base) after the model's own initializer (:func:`initializer`), and a ``--hf-model`` folder's weights
are read into the frozen base under the base model's names (``load_pretrained(..., base_only=True)``).
Checkpoints record the adapter's peft config; ``zeropp train --adapter-out DIR`` writes the last one's
adapter as a peft folder (``zeropp export --adapter-only``'s :func:`zeropp.app.hf.export_adapter_folder`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zeropp.config.model import ModelConfig
from zeropp.errors import ConfigError


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError(
            "LoRA (model.lora_rank) needs the optional package peft, which is not installed: "
            "pip install -e '.[hf]' (or pip install peft)"
        ) from None
    return peft


def add_adapters(model: nn.Module, config: ModelConfig) -> nn.Module:
    """`model` with LoRA adapters of `config`'s keys; a target that names no module of it is refused in
    one line naming the modules with weights it has."""
    peft = _peft()
    targets = None
    if config.lora_targets is not None:
        targets = [t.strip() for t in config.lora_targets.split(",")]
        names = [name for name, _ in model.named_modules()]
        missing = [t for t in targets if not t or not any(n == t or n.endswith(f".{t}") for n in names)]
        if missing:
            weighted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if next(m.children(), None) is None
                        and next(m.parameters(), None) is not None}  # fmt: skip
            raise ConfigError(
                f"model.lora_targets = {config.lora_targets!r}: the model has no module named "
                f"{', '.join(map(repr, missing))}; its modules with weights are {', '.join(sorted(weighted))}"
            )
    alpha = {} if config.lora_alpha is None else {"lora_alpha": config.lora_alpha}
    lora = peft.LoraConfig(r=config.lora_rank, target_modules=targets, lora_dropout=config.lora_dropout, **alpha)
    try:
        return peft.get_peft_model(model, lora)
    except ValueError as error:  # e.g. a target peft cannot adapt, or no default targets for the model type
        raise ConfigError(f"model.lora_targets = {config.lora_targets!r}: {str(error).splitlines()[0]}") from None
