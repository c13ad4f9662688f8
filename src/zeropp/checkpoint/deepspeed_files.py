"""A DeepSpeed ZeRO checkpoint read into whole per-parameter tensors, without DeepSpeed and without
unpickling code.

A DeepSpeed checkpoint folder holds a ``latest`` file naming its newest tag and one folder per tag
(``global_step120``) with

- the model states: ``mp_rank_00_model_states.pt`` (stages 1 and 2), or one
  ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per data-parallel rank (stage 3): parameter names
  and shapes (``param_shapes``, one ordered dict per optimizer group), buffers, frozen parameters,
  tied names (``shared_params``), the step, the lr scheduler's state, the DeepSpeed config;
- the optimizer states: one ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank
  (``bf16_`` in front under bf16): the rank's partition of the fp32 masters and of the wrapped
  optimizer's state, the loss scaler.

How a partition maps to parameters (DeepSpeed's ``zero_to_fp32.py``): at stages 1 and 2 the ranks'
partitions of a group, end to end, are the group's flat buffer, its parameters one after another,
each followed by ``param_alignment_paddings`` elements (the tail padded to the world); at stage 3
each rank's groups, end to end, hold its ``ceil(numel / world)`` elements of every parameter in
``param_shapes`` order, and a parameter is its ranks' pieces end to end, cut to its size. The
optimizer's per-element states (Adam's moments, SGD's momentum) follow the masters element for
element; scalar states (Adam's ``step``) are per group.

Files are read with ``torch.load(weights_only=True)``: the few DeepSpeed classes the files name
(the loss scalers, a fragment address, the stage enum) are allow-listed as stand-ins that only hold
their saved attributes, so nothing DeepSpeed defines runs, and DeepSpeed need not be installed.
Every refusal is a one-line :class:`DeepSpeedCheckpointError`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeropp.errors import ZeroppError

OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}  # DeepSpeed's optimizer.type (lower) -> torch's
_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


class DeepSpeedCheckpointError(ZeroppError, RuntimeError):
    """A DeepSpeed checkpoint zeropp cannot import. One line: what is wrong, what is accepted."""


class _Saved:
    """A DeepSpeed object in a checkpoint, read as its saved attributes only."""


SAFE_GLOBALS = [
    (_Saved, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Saved, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_Saved, "deepspeed.utils.tensor_fragment.fragment_address"),
    (int, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


@dataclass
class DeepSpeedState:
    """What a DeepSpeed checkpoint holds, per parameter and whole (fp32 masters, optimizer states)."""

    folder: Path
    stage: int
    world_size: int
    precision: str  # fp32, bf16 or fp16
    step: int
    optimizer: str  # torch.optim class name: Adam, AdamW or SGD
    param_groups: list[dict[str, Any]]
    masters: dict[str, torch.Tensor]
    optimizer_state: dict[str, dict[str, torch.Tensor]]  # name -> key -> tensor (per element, or 0-d)
    fixed: dict[str, torch.Tensor]  # buffers and frozen parameters
    aliases: dict[str, str]  # tied name -> parameter name
    loss_scaler: dict[str, Any]
    lr_scheduler: Any
    untied: list[str] = field(default_factory=list)  # tied names stage-3 files do not resolve
    ds_version: str | None = None


def resolve_folder(path: str | Path) -> Path:
    """The tag folder to read: `path` itself when it holds model states, else the tag its ``latest`` names."""
    path = Path(path)
    if not path.is_dir():
        raise DeepSpeedCheckpointError(f"DeepSpeed checkpoint {str(path)!r} does not exist or is not a folder")
    if any(path.glob("*model_states.pt")):
        return path
    latest = path / "latest"
    if not latest.is_file():
        raise DeepSpeedCheckpointError(
            f"{str(path)!r} is not a DeepSpeed checkpoint: no 'latest' tag file and no *_model_states.pt; "
            "expected the save_checkpoint folder or one of its global_stepN folders"
        )
    tag = latest.read_text().strip()
    folder = path / tag
    if not tag or "/" in tag or not any(folder.glob("*model_states.pt")):
        raise DeepSpeedCheckpointError(
            f"{str(latest)!r} names tag {tag!r}, but {str(folder)!r} holds no *_model_states.pt; "
            f"expected one of the tag folders there: {_tags(path)}"
        )
    return folder


def _tags(path: Path) -> str:
    tags = sorted(p.name for p in path.iterdir() if p.is_dir() and any(p.glob("*model_states.pt")))
    return ", ".join(tags) or "(none)"


def load_file(path: Path) -> dict[str, Any]:
    """One DeepSpeed file, unpickled with weights_only and the allow-list above."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        text = str(error).strip().splitlines()
        unsafe = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        if unsafe:
            reason = f"it holds a {unsafe.group(1)} object, which zeropp does not unpickle (weights_only)"
        elif "zip archive" in str(error) or isinstance(error, EOFError):
            reason = "it is truncated or not a torch.save file"
        else:
            reason = f"{type(error).__name__}: {text[0] if text else ''}"
        raise DeepSpeedCheckpointError(f"cannot read {str(path)!r}: {reason}") from None


def read_checkpoint(path: str | Path) -> DeepSpeedState:
    """Read and check a DeepSpeed ZeRO checkpoint (a save_checkpoint folder or a tag folder)."""
    folder = resolve_folder(path)
    _refuse_model_parallel(folder)
    optim_files = _optimizer_files(folder)
    first = load_file(optim_files[0])["optimizer_state_dict"]
    stage, world = int(first.get("zero_stage", -1)), _partition_count(first)
    if stage not in (1, 2, 3):
        raise DeepSpeedCheckpointError(
            f"{str(optim_files[0])!r} is not a ZeRO checkpoint (zero_stage {stage}); expected stage 1, 2 or 3"
        )
    if len(optim_files) != world:
        missing = sorted(set(range(world)) - {int(_RANK_FILE.match(f.name).group(2)) for f in optim_files})
        raise DeepSpeedCheckpointError(
            f"{str(folder)!r} was saved by {world} data-parallel ranks, but the optimizer states of rank "
            f"{', '.join(map(str, missing)) or '?'} are missing ({_optim_name(optim_files[0], missing)})"
        )
    model_files = _model_files(folder, stage, world)
    model = load_file(model_files[0])
    for key in ("module", "param_shapes", "buffer_names"):
        if key not in model:
            raise DeepSpeedCheckpointError(f"{str(model_files[0])!r} is not a DeepSpeed model-states file (no {key!r})")
    ranks = [first] + [load_file(f)["optimizer_state_dict"] for f in optim_files[1:]]
    config = model.get("ds_config") or {}
    optimizer, groups = _optimizer(ranks[0], config, optim_files[0])
    shapes = [dict(group) for group in model["param_shapes"]]
    if stage == 3:
        flat = _stage3_params(ranks, shapes, world)
    else:
        paddings = ranks[0].get("param_alignment_paddings")
        flat = _stage12_params(ranks, shapes, paddings)
    masters = {name: states.pop("master") for name, states in flat.items()}
    fixed, untied = _fixed(model, stage, [load_file(f) for f in model_files[1:]], masters)
    return DeepSpeedState(
        folder=folder, stage=stage, world_size=world, precision=_precision(config), step=int(model.get("global_steps", 0)),
        optimizer=optimizer, param_groups=groups, masters=masters, optimizer_state=flat, fixed=fixed,
        aliases=dict(model.get("shared_params") or {}), loss_scaler=_loss_scaler(ranks[0]),
        lr_scheduler=model.get("lr_scheduler"), untied=untied, ds_version=model.get("ds_version"),
    )  # fmt: skip


def _refuse_model_parallel(folder: Path) -> None:
    names = [p.name for p in folder.iterdir()]
    layers = [n for n in names if n.startswith("layer_") and n.endswith("model_states.pt")]
    if layers:
        raise DeepSpeedCheckpointError(
            f"{str(folder)!r} is a pipeline-parallel checkpoint ({layers[0]}, ...); zeropp imports "
            "data-parallel ZeRO checkpoints only (mp_rank_00, no pipeline stages)"
        )
    other = sorted(n for n in names if re.search(r"mp_rank_(?!00_)\d+_", n))
    if other:
        raise DeepSpeedCheckpointError(
            f"{str(folder)!r} is a tensor-parallel checkpoint ({other[0]}); zeropp imports "
            "data-parallel ZeRO checkpoints only (mp_rank_00 alone)"
        )


def _optimizer_files(folder: Path) -> list[Path]:
    files = [p for p in folder.iterdir() if _RANK_FILE.match(p.name)]
    if not files:
        raise DeepSpeedCheckpointError(
            f"{str(folder)!r} holds no ZeRO optimizer states (zero_pp_rank_<r>_mp_rank_00_optim_states.pt); "
            "zeropp imports checkpoints of ZeRO stages 1, 2 and 3"
        )
    return sorted(files, key=lambda p: int(_RANK_FILE.match(p.name).group(2)))


def _optim_name(example: Path, missing: list[int]) -> str:
    return re.sub(r"zero_pp_rank_\d+_", f"zero_pp_rank_{missing[0] if missing else '?'}_", example.name)


def _partition_count(state: dict[str, Any]) -> int:
    count = state.get("partition_count", 1)
    return int(max(count) if isinstance(count, (list, tuple)) else count)


def _model_files(folder: Path, stage: int, world: int) -> list[Path]:
    names = (
        ["mp_rank_00_model_states.pt"]
        if stage < 3
        else [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    )
    for name in names:
        if not (folder / name).is_file():
            raise DeepSpeedCheckpointError(
                f"{str(folder)!r} lacks {name} (a stage-{stage} checkpoint of {world} data-parallel ranks)"
            )
    return [folder / name for name in names]


def _optimizer(state: dict[str, Any], config: dict[str, Any], path: Path) -> tuple[str, list[dict[str, Any]]]:
    """The torch optimizer class name and the saved param groups (without their params)."""
    base = state.get("base_optimizer_state", state.get("optimizer_state_dict"))
    if not isinstance(base, dict) or "param_groups" not in base:
        raise DeepSpeedCheckpointError(f"{str(path)!r} holds no optimizer state (saved without it?)")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]]
    declared = (config.get("optimizer") or {}).get("type")
    if declared is not None:
        name = OPTIMIZERS.get(str(declared).lower())
        if name == "Adam" and (config["optimizer"].get("params") or {}).get("adam_w_mode", True):
            name = "AdamW"  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
    elif "decoupled_weight_decay" in groups[0]:
        name = "AdamW" if groups[0]["decoupled_weight_decay"] else "Adam"
    elif "dampening" in groups[0]:
        name = "SGD"
    else:
        name = None
    if name is None:
        what = declared or f"one with param-group keys {sorted(groups[0])}"
        raise DeepSpeedCheckpointError(
            f"{str(path)!r} was saved with optimizer {what}; zeropp imports Adam, AdamW and SGD states only"
        )
    return name, groups


def _base_state(rank: dict[str, Any]) -> dict[int, dict[str, Any]]:
    base = rank.get("base_optimizer_state", rank.get("optimizer_state_dict"))
    state = base["state"]
    return dict(enumerate(state)) if isinstance(state, list) else state


def _per_group_states(rank: dict[str, Any], masters: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """A rank's flat states per group: its fp32 master partition and the optimizer's states."""
    base = _base_state(rank)
    out = []
    for index, master in enumerate(masters):
        states = {"master": master.detach()}
        for key, value in base.get(index, {}).items():
            states[key] = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        out.append(states)
    return out


def _split(flat: dict[str, torch.Tensor], start: int, numel: int, shape: torch.Size) -> dict[str, torch.Tensor]:
    """One parameter's states from a group's whole flat states: per-element ones cut, scalars copied."""
    return {
        key: value.narrow(0, start, numel).view(shape).clone() if value.dim() else value.clone().float()
        for key, value in flat.items()
    }


def _stage12_params(
    ranks: list[dict[str, Any]], shapes: list[dict[str, torch.Size]], paddings: list[list[int]] | None
) -> dict[str, dict[str, torch.Tensor]]:
    per_rank = [_per_group_states(r, r["single_partition_of_fp32_groups"]) for r in ranks]
    params: dict[str, dict[str, torch.Tensor]] = {}
    for index, group in enumerate(shapes):
        whole = {
            key: torch.cat([rank[index][key] for rank in per_rank]) if value.dim() else value
            for key, value in per_rank[0][index].items()
        }
        offset = 0
        for position, (name, shape) in enumerate(group.items()):
            numel = math.prod(shape)
            if offset + numel > whole["master"].numel():
                raise DeepSpeedCheckpointError(f"parameter {name!r} lies past the end of its group's saved partitions")
            params[name] = _split(whole, offset, numel, torch.Size(shape))
            offset += numel + (paddings[index][position] if paddings else 0)
    return params


def _stage3_params(
    ranks: list[dict[str, Any]], shapes: list[dict[str, torch.Size]], world: int
) -> dict[str, dict[str, torch.Tensor]]:
    per_rank = []
    for rank in ranks:
        groups = _per_group_states(rank, rank["fp32_flat_groups"])
        per_rank.append(
            {key: torch.cat([g[key] for g in groups]) if value.dim() else value for key, value in groups[0].items()}
        )
    params: dict[str, dict[str, torch.Tensor]] = {}
    offset = 0
    for name, shape in ((n, s) for group in shapes for n, s in group.items()):
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        if offset + part > per_rank[0]["master"].numel():
            raise DeepSpeedCheckpointError(f"parameter {name!r} lies past the end of the saved partitions")
        whole = {
            key: torch.cat([rank[key].narrow(0, offset, part) for rank in per_rank]) if value.dim() else value
            for key, value in per_rank[0].items()
        }
        params[name] = _split(whole, 0, numel, torch.Size(shape))
        offset += part
    return params


def _fixed(
    model: dict[str, Any], stage: int, others: list[dict[str, Any]], masters: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Buffers and frozen parameters, whole (floating ones in fp32); and the module's names that
    stage-3 files do not resolve."""
    module, buffers = model["module"], set(model["buffer_names"])
    fixed = {name: t.clone() for name, t in module.items() if name in buffers}
    frozen = model.get("frozen_param_shapes") or {}
    fragments = [model.get("frozen_param_fragments") or {}] + [m.get("frozen_param_fragments") or {} for m in others]
    for name, shape in frozen.items():
        pieces = [f[name].reshape(-1) for f in fragments] if stage == 3 else [fragments[0][name].reshape(-1)]
        fixed[name] = torch.cat(pieces)[: math.prod(shape)].view(shape).clone()
    known = set(masters) | set(fixed) | set(model.get("shared_params") or {})
    if stage < 3:  # frozen parameters DeepSpeed did not list (stage 1): the module's own values, whole
        fixed.update({name: t.clone() for name, t in module.items() if name not in known})
    untied = sorted(name for name in module if name not in known | set(fixed))
    return {
        name: t.float() if t.is_floating_point() else t for name, t in fixed.items()
    }, untied  # fp32, as zero_to_fp32


def _precision(config: dict[str, Any]) -> str:
    for name in ("bf16", "fp16"):
        if (config.get(name) or {}).get("enabled") is True:
            return name
    return "bf16" if (config.get("bfloat16") or {}).get("enabled") is True else "fp32"


def _loss_scaler(state: dict[str, Any]) -> dict[str, Any]:
    """The loss scaler's attributes as DeepSpeed saved them (cur_scale, cur_iter, ...)."""
    scaler = state.get("loss_scaler")
    return dict(vars(scaler)) if isinstance(scaler, _Saved) else {}
