"""The leaf config keys as the command line and the help show them: every section's keys, its policies'
fields by their flat keys (``zero.weight_bits``), and the other names (``ALIASES``) each key accepts."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from zeropp.config.sections import Config


class Key(typing.NamedTuple):
    """A leaf config key as the command line shows it."""

    dotted: str  # zero.stage
    hint: Any  # its type
    meaning: str  # one line
    default: Any


def key_aliases(cls: type = Config) -> dict[str, str]:
    """Every section's other names for its keys (``ALIASES``): alias -> leaf name."""
    out: dict[str, str] = dict(getattr(cls, "ALIASES", {}))
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            out.update(key_aliases(hint))
    return out


def leaf_keys(cls: type = Config, prefix: str = "") -> dict[str, Key]:
    """Map each leaf field name to its Key: the CLI's flags mirror these names."""
    out: dict[str, Key] = {}
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if hasattr(hint, "FLAT"):  # a policy: its fields by their flat keys, in the section (zero.weight_bits)
            hints = typing.get_type_hints(hint)
            for g in dataclasses.fields(hint):
                flat = hint.FLAT[g.name]
                out[flat] = Key(f"{prefix}{flat}", hints[g.name], g.metadata.get("help", ""), g.default)
        elif dataclasses.is_dataclass(hint):
            out.update(leaf_keys(hint, f"{prefix}{f.name}."))
        else:
            out[f.name] = Key(f"{prefix}{f.name}", hint, f.metadata.get("help", ""), f.default)
    return out
