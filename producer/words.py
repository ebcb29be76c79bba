"""Counting words for messages: ``1 batch``, ``2 batches``, ``1,024 samples``; sizes: ``687.6 MB``."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` and ``word``, in the plural unless ``n`` is 1: ``plural(1, "batch")`` is ``"1 batch"``,
    ``plural(3, "batch")`` ``"3 batches"`` (thousands separated). ``many``: an irregular plural."""
    if n == 1:
        return f"1 {word}"
    if many is None:
        many = word + ("es" if word.endswith(("s", "sh", "ch", "x", "z")) else "s")
    return f"{n:,} {many}"


def noun(n: int, word: str, many: str | None = None) -> str:
    """``word`` alone, in the plural unless ``n`` is 1 (for ``3 / 1 batch`` style fractions)."""
    return plural(n, word, many).split(" ", 1)[1]


def fmt_bytes(n: float | None) -> str:
    """A size as every CLI message prints it: decimal units (1 MB = 10^6 bytes) with one decimal,
    MB below 1 GB (``0.4 MB``, ``687.6 MB``), then GB and TB (``1.6 GB``); below 0.05 MB the byte count
    (``12,345 bytes``), so a small size never reads as 0; ``-`` for None."""
    if n is None:
        return "-"
    if abs(n) < 50_000:
        return f"{int(n):,} bytes"
    for unit, scale in (("MB", 1e6), ("GB", 1e9)):
        if round(abs(n) / scale, 1) < 1000:  # by the printed value: 999,999,999 bytes is 1.0 GB, not 1,000.0 MB
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e12:,.1f} TB"
