"""How typed config sections are declared, read and checked, whatever the sections are
(:mod:`zeropp.config` declares them): a key with its meaning, a nested mapping read into dataclasses
with every key and type checked, Literal choices and finite floats refused otherwise, config files
read. Every error is a one-line :class:`ConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

from zeropp.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def setting(default: Any, meaning: str) -> Any:
    """A config key: its default and its one-line meaning (the flag's help, ``leaf_keys``)."""
    return field(default=default, metadata={"help": meaning})


def check_choices(section: Any, prefix: str, name: Callable[[str], str] | None = None) -> None:
    """Refuse a value outside its Literal type, also for configs built in code rather than loaded. An error
    names ``prefix.field``, or ``name(field)`` where the section says how its keys were written."""
    for key, hint in typing.get_type_hints(type(section)).items():
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        for option in options:
            if typing.get_origin(option) is Literal:
                value = getattr(section, key)
                allowed = typing.get_args(option)
                if value not in allowed and not (value is None and type(None) in options):
                    expected = f"one of {', '.join(map(repr, allowed))}"
                    require(False, name_key(prefix, key, name), value, expected)


def check_finite(section: Any, prefix: str, name: Callable[[str], str] | None = None) -> None:
    """Refuse inf and nan in every float key (``--lr inf`` parses, and would train to nan)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            require(False, name_key(prefix, f.name, name), value, "a finite number")


def name_key(prefix: str, key: str, name: Callable[[str], str] | None) -> str:
    return name(key) if name is not None else f"{prefix}.{key}"


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r} is not allowed; expected {allowed}", key, value)


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a (nested) mapping, checking every key and type; does not validate ranges."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} = {data!r} is not allowed; expected a table")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    # a section's other spellings of its policies' fields (zeropp.config.policies): flat key -> (field, its field)
    flat = getattr(cls, "FLAT_KEYS", {})
    kwargs = {}
    aliases = getattr(cls, "ALIASES", {})
    for key, value in data.items():
        key = aliases.get(key, key)
        if key in flat:
            group, name = flat[key]
            kwargs[key] = coerce(f"{prefix}{key}", value, typing.get_type_hints(hints[group])[name])
            continue
        if key not in names:
            raise unknown_key(f"{prefix}{key}", [*names, *flat, *aliases], prefix)
        kwargs[key] = coerce(f"{prefix}{key}", value, hints[key])
    return cls(**kwargs)


def unknown_key(key: str, known: list[str], prefix: str = "") -> ConfigError:
    """An unknown key's error: the closest known key when one is close (a typo), else every allowed key."""
    close = difflib.get_close_matches(key.removeprefix(prefix), known, n=1, cutoff=0.75)
    if close:
        return ConfigError(f"unknown key '{key}'; did you mean '{prefix}{close[0]}'?")
    return ConfigError(f"unknown key '{key}'; allowed keys: {', '.join(known)}")


def coerce(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, prefix=f"{key}.")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return coerce(key, value, option)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] + (", or unset" if type(None) in options else ""))
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{key} = {value!r} is not allowed; expected one of {', '.join(map(repr, allowed))}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, bool, str) and (type(value) is not hint):
        raise ConfigError(f"{key} = {value!r} has type {type(value).__name__}; expected {hint.__name__}")
    return value


def read_config_file(path: Path) -> dict[str, Any]:
    """A TOML or JSON config file's contents; every way it can be unreadable is one ConfigError."""
    where = f"config file {str(path)!r}"
    if path.suffix not in (".toml", ".json"):
        raise ConfigError(f"{where} is not allowed; expected a .toml or .json file")
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"{where} {what}; expected a .toml or .json file")
    try:
        text = path.read_text(encoding="utf-8")
        return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except OSError as error:
        raise ConfigError(f"{where} cannot be read ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{where} is not UTF-8 text (byte {error.start}); expected UTF-8") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{where} does not parse: {error}") from None


def deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}
