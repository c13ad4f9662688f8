"""Config keys as command-line flags, for ``zeropp train`` and ``zeropp estimate``.

Every key is a flag of its own leaf name (``zero.stage`` -> ``--stage``, ``zero.quantized_weights``
-> ``--quantized-weights`` / ``--no-quantized-weights``) whose value lands under the dotted key, as
``load_config``'s overrides take it. A key's other names (a section's ``ALIASES``: DeepSpeed's, Megatron's,
former ones) are flags too, left out of the help. A flag's help is its field's meaning
(``config.setting``) and default.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from zeropp.config.keys import Key, key_aliases, leaf_keys

METAVARS = {
    "checkpoint.resume": "auto|PATH",
    "checkpoint.checkpoint_dir": "DIR",
    "model.hf_model": "DIR",
    "model.hf_config": "FILE",
    "train.data": "PATH",
    "train.tokenizer": "DIR",
}


def add_config_flags(
    group: argparse._ActionsContainer,
    names: Iterable[str] | None = None,
    stage3_defaults: Mapping[str, Any] | None = None,
) -> None:
    """One flag per config key in `names` (leaf names; all keys when None), and one per alias (left out
    of the help). Help: the key's meaning and default; `stage3_defaults` (dotted keys) are the
    command's own defaults at stage 3."""
    keys = leaf_keys()
    names = list(keys if names is None else names)
    for name in names:
        _add_flag(group, name, keys[name], _help(keys[name], stage3_defaults or {}))
    for alias, name in key_aliases().items():
        if name in names:
            _add_flag(group, alias, keys[name], argparse.SUPPRESS)


def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)


def _help(key: Key, stage3_defaults: Mapping[str, Any]) -> str:
    default = f"default: {_shown(key.default)}"
    if key.dotted in stage3_defaults:
        default = f"default: {_shown(stage3_defaults[key.dotted])} at stage 3, else {_shown(key.default)}"
    # argparse expands % in help
    return f"{key.meaning} ({default}; {key.dotted})".replace("%", "%%")


def _add_flag(group: argparse._ActionsContainer, name: str, key: Key, help_text: str) -> None:
    flag = "--" + name.replace("_", "-")
    dotted, hint = key.dotted, key.hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is typing.Literal:
        choices = typing.get_args(hint)
        group.add_argument(flag, dest=dotted, choices=choices, type=type(choices[0]), help=help_text)
    elif hint is bool:
        group.add_argument(flag, dest=dotted, action=argparse.BooleanOptionalAction, help=help_text)
    else:
        metavar = METAVARS.get(dotted, hint.__name__.upper())
        group.add_argument(flag, dest=dotted, type=hint, help=help_text, metavar=metavar)


def as_flags(values: Mapping[str, Any]) -> list[str]:
    """The flags that set these keys (leaf names): {'quantized_weights': False, 'hpz_partition_size': 1}
    -> ['--no-quantized-weights', '--hpz-partition-size', '1']."""
    out: list[str] = []
    for name, value in values.items():
        flag = name.replace("_", "-")
        out += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return out
