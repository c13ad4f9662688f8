"""Adapter runs: a frozen base referenced by path and hash instead of copied, and PEFT's adapter names.

A run that trains adapters on a frozen base (LoRA: ``requires_grad`` False on every base weight)
passes the base's path to ``save_checkpoint(..., frozen_base=PATH)``: its checkpoints then hold the
trainable parameters' masters and optimizer states and the buffers, not the frozen parameters.
zeropp.json's ``frozen_base`` holds the path, the frozen parameters' names and shapes and the sha256
of their values (:func:`digest`). Loading checks the engine's frozen parameters against that hash;
a full export reads them from the path (peft's names for base weights mapped to the base's own:
:func:`base_name`) and checks them the same way. Where the engine stores its frozen weights
quantized (``quantized_nontrainable_weights``) its values are not the path's, and depend on the
shard layout: the hash is then the path's own values' (``hashed: "files"``, read at every save),
and loading checks the path against it.

A PEFT model (the engine's module has ``peft_config``) records its active adapter's config in
zeropp.json (``adapter``, :func:`adapter_meta`), which ``zeropp export --adapter-only`` writes as
``adapter_config.json`` beside the trainable tensors under peft's saved names (:func:`peft_key`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropp.checkpoint.per_parameter import CheckpointError, fixed_tensors
from zeropp.checkpoint.pretrained import PretrainedError, base_name, open_safetensors, weight_files
from zeropp.zero.precision import DTYPES
from zeropp.zero.unit import FlatUnit


def frozen_parameters(units: list[FlatUnit], module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's frozen parameters, whole, by name (at stage 3 gathered from the units: collective)."""
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    return {n: t for n, t in fixed_tensors(units, module).items() if n in frozen}


def digest(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> str:
    """sha256 of names, shapes and values (in `dtype`, the run's compute dtype, then fp32), by name."""
    sha = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors[name].detach().to("cpu", dtype).float().contiguous()
        sha.update(f"{name}{list(value.shape)}".encode())
        sha.update(value.numpy().tobytes())
    return sha.hexdigest()


def base_reference(
    units: list[FlatUnit], module: nn.Module, path: str | Path, precision: str, quantized: bool = False
) -> dict[str, Any]:
    """zeropp.json's ``frozen_base``: the path, the frozen parameters' shapes and their sha256 (with
    `quantized` frozen weights, of the values at the path)."""
    frozen = frozen_parameters(units, module)
    if not frozen:
        raise CheckpointError(
            "frozen_base is given but the model has no frozen parameters; train it with full checkpoints"
        )
    if not Path(path).exists():
        raise CheckpointError(
            f"frozen_base {str(path)!r} does not exist; expected the base model's safetensors file or folder"
        )
    reference = {"path": str(Path(path).resolve()), "params": {name: list(t.shape) for name, t in frozen.items()}}
    if not quantized:
        return {**reference, "sha256": digest(frozen, DTYPES[precision])}
    return {**reference, "hashed": "files", "sha256": digest(_read_frozen(reference, precision), torch.float32)}


def check_base(units: list[FlatUnit], module: nn.Module, meta: dict[str, Any], checkpoint: str | Path) -> None:
    """Refuse (one line) an engine whose frozen parameters are not the checkpoint's base (a base hashed
    from its files: the files are checked)."""
    reference = meta["frozen_base"]
    if reference.get("hashed") == "files":
        read_base(meta)
        return
    if digest(frozen_parameters(units, module), DTYPES[meta["precision"]]) != reference["sha256"]:
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r} was trained on the frozen base {reference['path']!r}; "
            "this model's frozen parameters differ from it (sha256)"
        )


def read_base(meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The frozen parameters of a checkpoint's ``frozen_base`` read from its path, in fp32, checked
    against its sha256."""
    reference = meta["frozen_base"]
    tensors = _read_frozen(reference, meta["precision"])
    if digest(tensors, torch.float32) != reference["sha256"]:
        raise CheckpointError(f"the frozen base {reference['path']!r} changed since the checkpoint was saved (sha256)")
    return tensors


def _read_frozen(reference: dict[str, Any], precision: str) -> dict[str, torch.Tensor]:
    """The referenced frozen parameters as stored at the path, rounded to `precision`, in fp32."""
    try:
        files = weight_files(reference["path"])
    except PretrainedError as error:
        raise CheckpointError(f"the checkpoint's frozen base cannot be read: {error}") from None
    tensors = {}
    for name in reference["params"]:
        key = next((k for k in (name, base_name(name)) if k in files), None)
        if key is None:
            raise CheckpointError(f"the checkpoint's frozen base {reference['path']!r} holds no {base_name(name)!r}")
        with open_safetensors(files[key]) as handle:
            tensors[name] = handle.get_tensor(key).to(DTYPES[precision]).float()
    return tensors


def adapter_meta(module: nn.Module) -> dict[str, Any] | None:
    """zeropp.json's ``adapter`` of a peft model: the active adapter's name and config; None otherwise."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict):
        return None
    name = module.active_adapter
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in configs[name].to_dict().items()}
    return {"name": name, "config": config}


def peft_key(name: str, adapter: str) -> str:
    """peft's saved name of a trainable parameter (``get_peft_model_state_dict``: the adapter name dropped)."""
    return name.replace(f".{adapter}", "")
