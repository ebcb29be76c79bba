"""Timestamps as the run's records write them (``finished_at``, ``updated_at``)."""

from __future__ import annotations

from datetime import datetime, timezone


def unix_seconds(value) -> float | None:
    """Seconds since the epoch from an ISO 8601 string (naive = UTC) or a number; None if neither."""
    if value in (None, ""):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        dt = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()
