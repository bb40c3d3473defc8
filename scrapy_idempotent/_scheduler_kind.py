"""Which scheduler a crawl has: the mark of the package's scheduler, and the test for it.

The components that find their crawl's collaborators through the engine (:mod:`.crawl`, the
progress line, the queue input, the middleware's check at start) import the test from here,
not from :mod:`.scheduler`, which imports most of the package.
"""

from __future__ import annotations

__all__ = ["IdempotentSchedulerMark", "is_idempotent_scheduler"]


class IdempotentSchedulerMark:
    """Derived from by :class:`~.IdempotentScheduler` only: its presence in a class's MRO is
    what :func:`is_idempotent_scheduler` tests."""

    __slots__ = ()


def is_idempotent_scheduler(obj: object) -> bool:
    """Whether ``obj`` (a scheduler or a scheduler class) is an :class:`~.IdempotentScheduler`.

    ``isinstance``/``issubclass`` cannot tell: Scrapy's ``BaseScheduler`` metaclass answers
    True for any class with the scheduler methods (scrapy/core/scheduler.py).
    """
    cls = obj if isinstance(obj, type) else type(obj)
    return IdempotentSchedulerMark in cls.__mro__
