"""``RecentRequests``: the requests this process took into the frontier last, kept so that
the hand-out gives the engine the request object the callback yielded (as Scrapy does)
instead of a copy decoded from its stored text (see :mod:`.handout`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scrapy import Request

__all__ = ["RECENT_REQUESTS", "RecentRequests"]

#: How many of the requests taken into the frontier last :class:`RecentRequests` keeps.
RECENT_REQUESTS = 4096


class RecentRequests:
    """The requests this process took into the frontier last, by key, with their stored
    text; at most ``limit`` (the oldest forgotten first). Bounded: the frontier itself keeps
    nothing in memory per request."""

    def __init__(self, limit: int = RECENT_REQUESTS) -> None:
        self.limit = limit
        self._requests: dict[str, tuple[str, Request]] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def keep(self, key: str, data: str, request: Request) -> None:
        """``request``, stored as ``data`` under ``key``, was taken into the frontier."""
        requests = self._requests
        requests.pop(key, None)  # (a replayed page's request: the newest object, at the end)
        requests[key] = (data, request)
        if len(requests) > self.limit:
            del requests[next(iter(requests))]

    def take(self, key: str, data: str) -> Request | None:
        """The request kept under ``key`` if it was stored as ``data`` (forgotten here
        either way), else None."""
        kept = self._requests.pop(key, None)
        if kept is None or kept[0] != data:
            return None
        return kept[1]

    def clear(self) -> None:
        self._requests.clear()
