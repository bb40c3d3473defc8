"""Scrapy's queue order for the frontier: which queue a request joins, and in which direction.

Scrapy's default scheduler (scrapy/core/scheduler.py, scrapy/pqueues.py in Scrapy 2.13+) keeps
one queue per priority for start requests (``SCHEDULER_START_MEMORY_QUEUE``, first-in-first-out
by default) and one for the other requests (``SCHEDULER_MEMORY_QUEUE``, last-in-first-out by
default); it takes the highest priority first and, at equal priority, other requests before
start requests. A start request is one whose ``meta["is_start_request"]`` is set (by Scrapy's
``StartSpiderMiddleware``). With ``SCHEDULER_START_MEMORY_QUEUE`` unset (None or empty), start
requests share the queue of the others. The frontier stores, per request, the queue
(``is_start``) and the direction (``fifo``), and claims in that order.

:func:`queue_position` is the one definition of that order: the store's claim (its index and
its ``ORDER BY``) and the scheduler's requests fetched from memory follow it, and a test
checks the store's claims against it. Importable without Scrapy (the store may use it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.settings import BaseSettings

__all__ = ["QueueOrder", "queue_position"]

logger = logging.getLogger(__name__)


def queue_position(priority: int, is_start: bool, fifo: bool,
                   sequence: int) -> tuple[int, int, int]:
    """Where a request stands in Scrapy's order: the smallest is taken first. The highest
    ``priority`` first; at equal priority other requests before start requests (``is_start``:
    it is in the start requests' queue); within a queue, by ``sequence`` (the order requests
    joined the frontier) ascending for a FIFO queue, descending for a LIFO one."""
    return (-priority, int(is_start), sequence if fifo else -sequence)


def _is_fifo(setting: str, value: Any, default: bool) -> bool:
    """Whether the queue class ``value`` of ``setting`` takes requests first-in-first-out,
    from the queuelib class it derives from (``FifoMemoryQueue``, ``LifoDiskQueue``, ...)."""
    from scrapy.utils.misc import load_object

    try:
        cls = load_object(value) if isinstance(value, str) else value
    except (ImportError, NameError, ValueError):
        cls = None
    for klass in getattr(cls, "__mro__", ()):
        if klass.__name__.startswith("Lifo"):
            return False
        if klass.__name__.startswith("Fifo"):
            return True
    logger.warning("scrapy_idempotent: %s = %r is neither a FIFO nor a LIFO queue of "
                   "queuelib/scrapy.squeues; the frontier takes those requests %s",
                   setting, value, "first-in-first-out" if default else "last-in-first-out")
    return default


@dataclass(frozen=True)
class QueueOrder:
    """The order settings of one crawl, read once."""

    start_queue: bool  #: start requests have their own queue
    start_fifo: bool
    other_fifo: bool

    @classmethod
    def from_settings(cls, settings: BaseSettings) -> QueueOrder:
        start = settings.get("SCHEDULER_START_MEMORY_QUEUE")
        other_fifo = _is_fifo("SCHEDULER_MEMORY_QUEUE",
                              settings.get("SCHEDULER_MEMORY_QUEUE"), default=False)
        return cls(
            start_queue=bool(start),
            start_fifo=_is_fifo("SCHEDULER_START_MEMORY_QUEUE", start, default=True)
            if start else other_fifo,
            other_fifo=other_fifo,
        )

    def place(self, request: Request) -> tuple[bool, bool]:
        """``(is_start, fifo)``: the queue ``request`` joins (the start requests' own queue or
        the other one) and whether it is taken first-in-first-out within it."""
        if self.start_queue and request.meta.get("is_start_request", False):
            return True, self.start_fifo
        return False, self.other_fifo
