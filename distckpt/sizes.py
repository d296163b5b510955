"""Sizes: the one convention distckpt reads and prints byte counts in.

Binary (IEC) units everywhere: ``60G`` means 60 GiB = 60 * 2**30 bytes, and sizes are printed as
``60.0 GiB``. The same parser reads the CLI flags (``preflight --expected-bytes 60G``) and the
DISTCKPT_* variables that take sizes (``DISTCKPT_BLOCK_SIZE=4M``).

Accepted: a plain byte count (``4096``), or a number with ``K``, ``M``, ``G``, ``T``, ``P``
(optionally followed by ``iB``: ``512MiB``) or ``B``. Decimal suffixes (``kB``, ``MB``, ``GB``...)
are refused rather than guessed: ``60GB`` is 60 * 10**9 to some tools and 60 * 2**30 to others,
and a 7% error in a free-space check is the kind that bites.

This module imports nothing (distckpt.errors uses it for its messages).
"""

from __future__ import annotations

import re

__all__ = ["parse_size", "format_bytes", "size_arg", "CONVENTION"]

#: One sentence for help texts and error messages.
CONVENTION = "binary units: K, M, G, T = KiB, MiB, GiB, TiB (powers of 1024)"

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgtp]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Parse ``text`` as a byte count in binary units (``10G`` = 10 GiB); ints pass through.

    Fractions are allowed with a unit (``1.5G``) and rounded down to a whole byte.

    Raises:
        ValueError: not a size, a negative number, or a decimal suffix such as ``GB`` (the
            message says what to write instead).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if m is None:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512M, 10G, 1.5TiB; {CONVENTION})")
    number, unit, suffix = m.group(1), m.group(2).lower(), (m.group(3) or "").lower()
    if suffix == "b" and unit:
        raise ValueError(
            f"{text!r} is ambiguous (decimal {unit.upper()}B or binary {unit.upper()}iB?): write "
            f"{number}{unit.upper()} or {number}{unit.upper()}iB for powers of 1024, or the exact "
            f"number of bytes")
    if suffix == "ib" and not unit:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512M, 10G, 1.5TiB; {CONVENTION})")
    if "." in number and not unit:
        raise ValueError(f"a byte count must be a whole number: {text!r}")
    if "." in number:
        value = float(number) * _UNITS[unit]
        if value == float("inf"):  # more digits than a float holds: int() would raise OverflowError
            raise ValueError(f"not a size: {text!r} is too large")
        return int(value)
    return int(number) * _UNITS[unit]


def size_arg(text: str) -> int:
    """``type=`` of a size option of the command line: :func:`parse_size`, whose ValueError becomes
    an ``argparse.ArgumentTypeError``, so that argparse prints the reason (``'5GB' is ambiguous
    ...``) instead of its generic "invalid value", and exits 2 (bad usage) without a traceback."""
    import argparse
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_bytes(n: int | float) -> str:
    """Human-readable binary size: ``57.0 GiB``, ``4.0 KiB``; exact bytes below 1 KiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    raise AssertionError("unreachable")
