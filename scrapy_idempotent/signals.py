"""Signals of the package, sent through ``crawler.signals`` as Scrapy's own signals are.

Connect a handler as for any Scrapy signal::

    from scrapy_idempotent import signals

    crawler.signals.connect(handler, signal=signals.request_done)

Handlers run on the reactor thread; an exception in a handler is logged by Scrapy's signal
manager (``send_catch_log``) and does not reach the crawl.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# Scrapy's signal dispatcher (PyDispatcher, or PyPyDispatcher on PyPy: Scrapy requires one)
from pydispatch.dispatcher import getAllReceivers  # type: ignore[import-untyped]

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler

__all__ = ["ALREADY_DONE", "request_done", "send_request_done"]

#: Sent when a request of the frontier has reached its final state and that state is durable:
#: its page's transaction (the records its items became, the child requests it yielded and its
#: completion) has been committed to the frontier database, never before. Sent once per final
#: state written by this crawl process, and once per request refused as a known request
#: already finished in the current recrawl window (a harmless repetition: nothing is fetched).
#:
#: Arguments (a handler takes any subset, by name):
#:
#: * ``request``: the :class:`~scrapy.Request` handed to the engine (for ``already_done``, the
#:   request that was refused); ``None`` only for a stored request that could not be loaded
#:   (state ``failed``, error kind ``unloadable``);
#: * ``key``: its frontier key (the fingerprint, in hex, for a request the duplicate filter
#:   applies to; a derived key for ``dont_filter`` requests). For ``already_done``, the key
#:   the refused request was looked up by: a filtered request is refused when any entry has
#:   its fingerprint, whose own key may differ (a ``dont_filter`` start request to that URL);
#: * ``fingerprint``: the request fingerprint in hex (Scrapy's ``REQUEST_FINGERPRINTER_CLASS``);
#: * ``state``: ``"done"``, ``"failed"`` (visible in ``scrapy idempotent failed``),
#:   ``"redirected"`` (its target is a request of its own, with a ``request_done`` of its
#:   own), or ``"already_done"``;
#: * ``spider``: the spider.
#:
#: Not sent for a request that is still to be processed: a retry (the same entry continues), a
#: request left pending by a ``CloseSpider`` in its callback, a lease lost to another worker
#: (nothing of its work was written), nor for requests in flight at a stop or a kill (they are
#: fetched again). At-least-once inputs acknowledge their messages on this signal.
request_done = object()

#: The ``state`` of a ``request_done`` sent for a known request refused as already finished.
ALREADY_DONE = "already_done"


def send_request_done(crawler: Crawler, spider: Spider | None, request: Request | None,
                      key: str, fingerprint: str, state: str) -> None:
    """Send :data:`request_done` (handler errors are logged, never raised). Sent for every
    known link refused as already done: when nothing is connected, it is not sent at all."""
    manager = crawler.signals
    if next(iter(getAllReceivers(manager.sender, request_done)), None) is None:
        return
    manager.send_catch_log(
        request_done, request=request, key=key, fingerprint=fingerprint, state=state,
        spider=spider)
