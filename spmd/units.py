"""Byte counts as a person reads them: one format for tables, messages and mesh files."""

from __future__ import annotations

__all__ = ["readable_bytes"]

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def readable_bytes(n: float, exact: bool = False) -> str:
    """``1.5 MiB``: in the largest binary unit ``n`` reaches, to two decimals less trailing
    zeros; ``exact``: with the count in bytes beside it, as a message states a budget a
    person may have typed in bytes.

    >>> readable_bytes(512), readable_bytes(1.5 * 2**20), readable_bytes(4e10, exact=True)
    ('512 B', '1.5 MiB', '37.25 GiB (40000000000 bytes)')
    """
    text = next((f"{n / size:.2f}".rstrip("0").rstrip(".") + f" {unit}"
                 for unit, size in _UNITS if n >= size), f"{n:.0f} B")
    return f"{text} ({n:.0f} bytes)" if exact and n >= _UNITS[-1][1] else text
