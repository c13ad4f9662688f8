"""Config keys as command-line flags, for ``zeropp train`` and ``zeropp estimate``.

Every key is a flag of its own leaf name (``zero.stage`` -> ``--stage``, ``zero.quantized_weights``
-> ``--quantized-weights`` / ``--no-quantized-weights``) whose value lands under the dotted key, as
``load_config``'s overrides take it. A key's other names (``ZeroConfig.ALIASES``: DeepSpeed's, and
former ones) are flags too, left out of the help.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from zeropp.config import ZeroConfig, leaf_keys


def add_config_flags(group: argparse._ActionsContainer, names: Iterable[str] | None = None) -> None:
    """One flag per config key in `names` (leaf names; all keys when None), and one per alias;
    help: the dotted key."""
    keys = leaf_keys()
    names = list(keys if names is None else names)
    for name in names:
        _add_flag(group, name, *keys[name], help_text=keys[name][0])
    for alias, name in ZeroConfig.ALIASES.items():
        if name in names:
            _add_flag(group, alias, *keys[name], help_text=argparse.SUPPRESS)


def _add_flag(group: argparse._ActionsContainer, name: str, dotted: str, hint: Any, help_text: str) -> None:
    flag = "--" + name.replace("_", "-")
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is typing.Literal:
        choices = typing.get_args(hint)
        group.add_argument(flag, dest=dotted, choices=choices, type=type(choices[0]), help=help_text)
    elif hint is bool:
        group.add_argument(flag, dest=dotted, action=argparse.BooleanOptionalAction, help=help_text)
    else:
        group.add_argument(flag, dest=dotted, type=hint, help=help_text, metavar=hint.__name__.upper())


def as_flags(values: Mapping[str, Any]) -> list[str]:
    """The flags that set these keys (leaf names): {'quantized_weights': False, 'hpz_partition_size': 1}
    -> ['--no-quantized-weights', '--hpz-partition-size', '1']."""
    out: list[str] = []
    for name, value in values.items():
        flag = name.replace("_", "-")
        out += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return out
