"""``ResponseJournalMiddleware``: a response that arrived is not downloaded again after a crash.

Between the moment a response arrives and the moment its request is done (the callback ran,
its items went through the pipelines, its children reached the scheduler), a kill would make
the next run fetch the page again. This downloader middleware sits next to the download
handler (priority 950, after ``HttpCacheMiddleware``'s 900), keeps each raw response of a
leased request in the store as it arrives, and on a later attempt of the same request serves
the kept response instead of downloading it. The completion transaction deletes it, so the
journal only ever holds the responses of unfinished requests. What a kill can repeat is then
only what was on the wire: at most ``CONCURRENT_REQUESTS`` requests.

The raw response is stored (before every other downloader middleware's ``process_response``),
so decompression, cookies, redirects and retries run again on the replay just as they did the
first time. The response goes on to its callback once its journal row is written (the
scheduler's writer sends it with the next batch of writes, usually another page's
completion). Disable with ``IDEMPOTENT_RESPONSE_JOURNAL = False`` (no response bodies
written; a kill then also repeats the pages being processed).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from scrapy.exceptions import NotConfigured

from .codec import describe, dumps, encode_value, loads, ordered_json
from .config import config_for
from .crawl import frontier_store, inflight_tracker
from .scrapy_compat import (
    response_from_dict,
    response_to_dict,
    start_failure_exits_nonzero,
    stat_counter,
)
from .store.base import observation_clock

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from typing_extensions import Self

    from .inflight import InflightTracker
    from .store.base import FrontierStore

__all__ = ["ResponseJournalMiddleware", "decode_response", "encode_response", "received_at_of"]

logger = logging.getLogger(__name__)

_RESPONSE_CLASSES = "scrapy.http.response."


#: the key of the journaled data holding when the response was received
_RECEIVED_AT = "_received_at"
#: the key of the journaled data holding the headers as latin-1 text (``[[name, [value,
#: ...]], ...]``); an entry of an earlier release has ``headers`` in tagged JSON instead
_HEADERS = "_headers_latin1"


def encode_response(response: Response,
                    received_at: float | None = None) -> tuple[str, bytes]:
    """``(JSON text, body)`` of a response (:meth:`scrapy.http.Response.to_dict`) received at
    ``received_at`` (unix seconds); the peer IP address and TLS certificate are not kept."""
    data = response_to_dict(response)
    body = data.pop("body")
    data.pop("ip_address", None)
    if not str(data.get("_class", _RESPONSE_CLASSES)).startswith(_RESPONSE_CLASSES):
        del data["_class"]  # a custom class: let responsetypes pick a built-in one
    if received_at is not None:
        data[_RECEIVED_AT] = received_at
    headers = _latin1_headers(data.get("headers"))
    if headers is None:
        return dumps(data), body
    del data["headers"]
    encoded = encode_value(data)
    encoded[_HEADERS] = headers  # (plain JSON already: no tagged form to make)
    return ordered_json(encoded), body


def _latin1_headers(headers: Any) -> list[list[Any]] | None:
    """Headers (names and values as bytes) as latin-1 text, one character per byte: their
    tagged form (base64 in an object for each name and each value) took most of a journal
    entry's encoding. None for headers of any other form (kept as tagged JSON)."""
    if not isinstance(headers, dict):
        return None
    try:
        return [[name.decode("latin-1"), [value.decode("latin-1") for value in values]]
                for name, values in headers.items()]
    except (AttributeError, TypeError):  # text where bytes are expected
        return None


def received_at_of(data: str) -> float | None:
    """When the response journaled as ``data`` was received (None: not known, a journal
    entry written by an earlier release)."""
    value = loads(data).get(_RECEIVED_AT)
    return float(value) if isinstance(value, (int, float)) else None


def decode_response(data: str, body: bytes) -> Response:
    """Inverse of :func:`encode_response`; only Scrapy's own response classes are loaded."""
    d = loads(data)
    d.pop(_RECEIVED_AT, None)
    headers = d.pop(_HEADERS, None)
    if headers is not None:
        d["headers"] = {name.encode("latin-1"): [value.encode("latin-1") for value in values]
                        for name, values in headers}
    if not str(d.get("_class", _RESPONSE_CLASSES)).startswith(_RESPONSE_CLASSES):
        raise ValueError(f"stored response class {d['_class']!r} is not allowed")
    d["body"] = body
    return response_from_dict(d)


class ResponseJournalMiddleware:
    """Downloader middleware: journal raw responses of leased requests, replay them."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        self._count = stat_counter(crawler.stats)  # (for every page)
        self._tracker: InflightTracker | None = None
        self._store: FrontierStore | None = None

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        with start_failure_exits_nonzero(crawler):
            journal = config_for(crawler).response_journal
        if not journal:
            raise NotConfigured("IDEMPOTENT_RESPONSE_JOURNAL is off")
        return cls(crawler)

    @property
    def tracker(self) -> InflightTracker | None:
        """The crawl's in-flight tracker; None outside a crawl (see :mod:`.crawl`)."""
        if self._tracker is None:
            self._tracker = inflight_tracker(self.crawler, type(self).__name__)
        return self._tracker

    @property
    def store(self) -> FrontierStore | None:
        """The crawl's store (journaled responses are read from it)."""
        if self._store is None:
            self._store = frontier_store(self.crawler, type(self).__name__)
        return self._store

    # ``spider``: Scrapy 2.13 passes it; later releases do not (see :mod:`.scrapy_compat`).
    def process_request(self, request: Request, spider: Spider | None = None) -> Response | None:
        tracker = self.tracker
        entry = tracker.for_request(request) if tracker is not None else None
        store = self.store
        if tracker is None or store is None or entry is None or entry.attempts <= 1:
            return None  # a first attempt has nothing journaled
        try:
            stored = store.journaled_response(entry.key)
            if stored is None:
                return None
            response = decode_response(*stored)
            received_at = received_at_of(stored[0])
        except Exception as exc:  # the journal is a saving, never a reason to fail
            logger.warning("scrapy_idempotent: cannot replay the journaled response of %s: %s",
                           describe(request), exc)
            return None
        # its items were observed when it was first received, not now
        tracker.mark_replayed(entry, received_at=received_at)
        response.flags.append("journal")
        self.crawler.stats.inc_value("idempotent/responses/replayed")
        return response

    def process_response(self, request: Request, response: Response,
                         spider: Spider | None = None) -> Any:
        tracker = self.tracker
        entry = tracker.for_request(request) if tracker is not None else None
        if tracker is None or entry is None or entry.replayed:
            return response
        try:
            tracker.keep_response(entry, *encode_response(
                response, entry.received_at if entry.received_at is not None
                else observation_clock()))
        except Exception as exc:
            logger.warning("scrapy_idempotent: cannot journal the response of %s: %s",
                           describe(request), exc)
            return response
        self._count("idempotent/responses/journaled")
        return response
