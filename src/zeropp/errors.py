"""The errors zeropp raises to its users, under one base class.

An entry point (``zeropp train``, a user's script) catches :class:`ZeroppError` to tell zeropp's
own refusals, whose messages are one line naming what is wrong and what is allowed, from any other
failure. Each layer defines its errors next to the code that raises them, on top of this base;
the base also keeps the built-in class each error was before (``ValueError``, ``RuntimeError``), so
existing ``except`` clauses still catch them.
"""

from __future__ import annotations

from typing import Any


class ZeroppError(Exception):
    """Base of every error zeropp raises to a user."""


class ConfigError(ZeroppError, ValueError):
    """A configuration value is not allowed. The message is one line: key, value, what is allowed;
    `key` and `value` name them where one key's value is at fault (a DeepSpeed config's reader
    rewords such an error in the file's own key)."""

    def __init__(self, message: str, key: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.key, self.value = key, value
