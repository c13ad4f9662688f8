"""The errors zeropp raises to its users, under one base class.

An entry point (``zeropp train``, a user's script) catches :class:`ZeroppError` to tell zeropp's
own refusals, whose messages are one line naming what is wrong and what is allowed, from any other
failure. Each layer defines its errors next to the code that raises them, on top of this base;
the base also keeps the built-in class each error was before (``ValueError``, ``RuntimeError``), so
existing ``except`` clauses still catch them.
"""

from __future__ import annotations


class ZeroppError(Exception):
    """Base of every error zeropp raises to a user."""


class ConfigError(ZeroppError, ValueError):
    """A configuration value is not allowed. The message is one line: key, value, what is allowed."""
