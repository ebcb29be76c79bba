"""Counting words for messages: ``1 batch``, ``2 batches``, ``1,024 samples``."""

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
