"""Byte sizes as users type them (``--max-shard-size 5GB``) and as g4 prints them.

Decimal units (kB, MB, GB = 10**3, 10**6, 10**9 bytes) and binary ones (KiB, MiB, GiB).
"""

from __future__ import annotations

import re

from g4.core.errors import OptionError

_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def format_bytes(n: int | float) -> str:
    """``n`` bytes in the largest decimal unit it reaches (GB = 10**9 bytes, MB, kB), three
    decimals, or whole bytes below 1 kB: ``"3.547 GB"``, ``"1.000 kB"``, ``"512 B"``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{int(n)} B"


def parse_size(text: str | int) -> int:
    """Parse a byte size: ``"5GB"`` is 5*10**9 (decimal), ``"5GiB"`` is 5*2**30 (binary).

    An int is a number of bytes; a string needs its unit (``"80"`` is refused, not taken
    as 80 bytes; ``"80B"`` is 80 bytes).

    Raises:
        OptionError: not a positive number with one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
        unit = m.group(2).upper() if m else None
        if not m or (unit and unit not in _SIZE_UNITS):
            raise OptionError(f"cannot parse size {text!r}: use e.g. 5GB (10**9 bytes) or 4GiB (2**30 bytes)")
        value = int(float(m.group(1)) * _SIZE_UNITS.get(unit, 1))
        if value > 0 and not unit:
            raise OptionError(f"size {text!r} has no unit: write e.g. {m.group(1)}GB (10**9 bytes), "
                             f"{m.group(1)}GiB (2**30 bytes) or {m.group(1)}B (bytes)")
    if value <= 0:
        raise OptionError(f"size must be positive, got {text!r}")
    return value
