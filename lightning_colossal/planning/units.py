"""Byte sizes and parameter counts as people type them, and bytes as people read them (pure Python)."""

from __future__ import annotations

import math
import re

__all__ = ["MIB", "format_bytes", "parse_bytes", "parse_count"]

MIB = 2**20

# "G", "T", ... without an "i" or a "B" mean binary units, as ``free -g`` and ``nvidia-smi`` print them; "GB" is 10**9.
_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gib": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"


def parse_bytes(text: str, what: str, allow_zero: bool = False) -> int:
    """``"80GiB"``, ``"80GB"``, ``"80G"`` (binary), ``"512MiB"`` or a plain number of bytes, as bytes.

    Raises:
        ValueError: naming ``what`` (the option) and the accepted forms.
    """
    match = re.fullmatch(_NUMBER + r"\s*([a-z]*)", text.strip().lower())
    if match is None or match.group(2) not in _BYTE_UNITS:
        raise ValueError(
            f"{what}={text!r} is not a size: pass a number with a unit, e.g. 80GiB (2**30 bytes), 80GB (10**9 bytes),"
            " 80G (same as GiB) or 512MiB."
        )
    value = float(match.group(1)) * _BYTE_UNITS[match.group(2)]
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{what}={text!r}: pass a positive size, e.g. 80GiB.")
    return int(value)


def parse_count(text: str, what: str) -> int:
    """``"7e9"``, ``"7B"``, ``"1.3b"``, ``"125M"`` or ``"350000"`` as a number of parameters.

    Raises:
        ValueError: naming ``what`` and the accepted forms.
    """
    match = re.fullmatch(_NUMBER + r"\s*([a-z]?)", text.strip().lower())
    if match is None or match.group(2) not in _COUNT_SUFFIXES:
        raise ValueError(f"{what}={text!r} is not a count: pass e.g. 7e9, 7B, 1.3B or 125M.")
    value = float(match.group(1)) * _COUNT_SUFFIXES[match.group(2)]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"{what}={text!r}: pass a positive count, e.g. 7e9.")
    return round(value)


def format_bytes(value: int) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (``"23.4 GiB"``, ``"512 B"``)."""
    magnitude = abs(value)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if magnitude >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value} B"
