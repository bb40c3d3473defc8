"""``retry_after_seconds``: the one reading of an HTTP ``Retry-After`` header, for the
download slots' pauses (:mod:`.politeness`) and the outbox's webhooks (:mod:`.outbox`)."""

from __future__ import annotations

import email.utils
import math
import time
from datetime import timezone

__all__ = ["retry_after_seconds"]


def retry_after_seconds(value: bytes | str | None, now: float | None = None) -> float | None:
    """The seconds a ``Retry-After`` header value asks for (RFC 9110, 10.2.3: a number of
    seconds, or an HTTP date, read as UTC when it names no zone); never negative (a date in
    the past asks for none); None when absent or not understood. ``now`` is the time the
    date is measured from (``time.time()`` if not given)."""
    if value is None:
        return None
    text = (value.decode("latin-1") if isinstance(value, bytes) else value).strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return max(seconds, 0.0)
