"""Link bandwidths as text: the one parser behind ``zeropp estimate`` and ``zeropp cluster``; and
:func:`si`, the one way byte counts and rates are printed (decimal prefixes, ``zeropp train`` and
``zeropp estimate`` alike).

Units (case-insensitive, decimal prefixes, an optional ``/s``), accepted everywhere:

- bits per second: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` (tc's spelling: ``200mbit``);
- bytes per second: ``B``, ``KB``, ``MB``, ``GB``, ``TB`` (``25MB`` = 200 Mbit/s).

tc's syntax adds two spellings that read differently elsewhere, so they are accepted only where the
rate is tc's (``zeropp cluster --inter-node-bandwidth``, ``tc_syntax=True``): ``bps``, ``kbps``,
``mbps``, ``gbps``, ``tbps`` are *bytes* per second (``25mbps`` = 200 Mbit/s; commonly read as bits),
and a bare number is bits per second. ``zeropp estimate`` refuses both as ambiguous.
"""

from __future__ import annotations

import re

from zeropp.errors import ZeroppError

RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
RATE_UNITS |= {"b": 8, "kb": 8e3, "mb": 8e6, "gb": 8e9, "tb": 8e12}  # bytes per second
TC_RATE_UNITS = RATE_UNITS | {"bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12, "": 1}
ALLOWED = "bit, kbit, mbit, gbit, tbit (bits/s) or B, KB, MB, GB, TB (bytes/s)"
TC_ALLOWED = f"{ALLOWED}, tc's bps, kbps, mbps, gbps, tbps (bytes/s) or a bare number (bits/s)"


class RateError(ZeroppError, ValueError):
    """A rate that is not allowed; the message is one line naming the value and what is allowed."""


def parse_bandwidth(text: str, *, tc_syntax: bool = False) -> float:
    """Bits per second from '200mbit', '100Gbit', '25GB', '1.5kbit/s', ...; with `tc_syntax` also
    from '25mbps' (bytes/s) and '1e6' (bits/s). Raises RateError."""
    units = TC_RATE_UNITS if tc_syntax else RATE_UNITS
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([a-z]*)(?:/s)?\s*", text.lower())
    if not match or match[2] not in units or float(match[1]) <= 0:
        allowed = TC_ALLOWED if tc_syntax else ALLOWED
        raise RateError(f"{text!r} is not allowed; expected a rate > 0 with a unit: {allowed}, e.g. 200mbit")
    return float(match[1]) * units[match[2]]


def si(n: float, unit: str = "B") -> str:
    """3 significant digits with a decimal prefix (GB = 1e9 bytes, as the papers count)."""
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(n) < 999.5 or prefix == "P":
            return f"{n:.3g} {prefix}{unit}" if prefix or unit != "B" else f"{n:,.0f} B"
        n /= 1000
    raise AssertionError
