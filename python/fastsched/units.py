"""Numbers with units on the command line: ``--max-model-len 32k``, ``--kv-cache-memory-bytes 8MiB``.

One parser for every flag that takes a count or a byte size. Suffixes with ``i``
(``Ki``, ``KiB``, ``MiB``…) are binary and those with ``B`` (``KB``, ``MB``…) decimal,
everywhere. A bare letter follows the field's habit: for counts vLLM's (``k``/``m``/``g``
decimal, ``K``/``M``/``G`` binary: ``32k`` = 32000, ``32K`` = 32768); for bytes,
memory's (binary in either case: ``40G`` = 40 GiB). Fractions and exponents are allowed
(``1.5GiB``, ``1e9``) as long as the result is a whole number.
"""

from __future__ import annotations

import argparse
import re

_NUMBER = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*([a-zA-Z]*)\s*$")
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def _multiplier(unit: str, bare_binary: bool) -> int | None:
    if unit in ("", "b", "B"):
        return 1
    letter, rest = unit[0].lower(), unit[1:].lower()
    if letter not in _POWERS:
        return None
    power = _POWERS[letter]
    if rest in ("i", "ib"):
        return 1024**power
    if rest == "b":
        return 1000**power
    if rest:
        return None
    return 1024**power if bare_binary or unit[0].isupper() else 1000**power


def _parse(text: str, what: str, bare_binary: bool, examples: str) -> int:
    match = _NUMBER.match(str(text))
    multiplier = _multiplier(match.group(3), bare_binary) if match else None
    if match is None or multiplier is None:
        raise argparse.ArgumentTypeError(
            f"expected {what}, optionally with a unit such as {examples}; got {text!r}"
        )
    value = float(match.group(1) + (f"e{match.group(2)}" if match.group(2) else "")) * multiplier
    if value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole number of {what}, got {text!r} = {value:g}")
    return int(value)


def parse_count(text: str) -> int:
    """``"32k"`` → 32000, ``"32K"`` → 32768, ``"2Ki"`` → 2048, ``"100"`` → 100."""
    return _parse(text, "a count", bare_binary=False, examples="32k (32000), 32K or 32Ki (32768)")


def parse_bytes(text: str) -> int:
    """``"40GiB"`` and ``"40G"`` → 40 × 2**30, ``"80GB"`` → 80 × 10**9, ``"1024"`` → 1024."""
    return _parse(text, "bytes", bare_binary=True, examples="40GiB, 512MiB or 80GB")
