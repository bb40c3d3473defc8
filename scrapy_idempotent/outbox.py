"""Delivery of the outbox: record changes announced to webhooks and other targets.

The store writes an outbox entry per record change and target in the transaction that stores
the change (see :class:`~.store.base.OutboxEntry`). This module sends them, at least once and
never before that commit:

* :class:`OutboxDelivery`, a Scrapy extension (the add-on enables it; it is off unless
  ``IDEMPOTENT_OUTBOX_TARGETS`` names a target), delivers while the crawl runs and drains
  what is left at close, for at most ``IDEMPOTENT_OUTBOX_DRAIN_SECONDS``;
* ``scrapy idempotent deliver`` delivers what a crawl left (killed, receiver down) without
  crawling;
* both run a :class:`Deliverer`: claim due entries with a hold (no other deliverer takes
  them meanwhile), hand each to its target, record the outcome. An entry is marked delivered
  only after its target acknowledged it; a deliverer killed in between leaves the entry
  pending, and it is sent again once its hold ends.

Targets: a webhook URL (:class:`WebhookTarget`: POST of the JSON announcement with the
idempotency key in an ``Idempotency-Key`` header, through Twisted's HTTP client, so the
spider's downloader middlewares, robots.txt, offsite filtering and download slots do not
apply to it, and delivery also runs after the downloader closed), or the import path of an
:class:`OutboxTarget` class (a message broker).
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from io import BytesIO
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

from ._retry_after import retry_after_seconds
from ._version import __version__
from .exceptions import DeliveryRefused, DeliveryRetry, StoreError
from .store.base import (
    CrawlIdentity,
    FrontierStore,
    OutboxEntry,
    OutboxOutcome,
    OutboxState,
)
from .store.registry import redacted

if TYPE_CHECKING:
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred
    from typing_extensions import Self

    from .config import IdempotentConfig

__all__ = [
    "Announcement",
    "Deliverer",
    "OutboxTarget",
    "WebhookTarget",
    "build_targets",
    "open_outbox_store",
    "payload_of",
    "target_label",
    "webhook_retry_after",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Statuses of a webhook answer that are tried again (with 5xx): timeout, conflict (the
#: receiver is busy with the same key), too many requests.
RETRIED_STATUSES = frozenset({408, 409, 429})
#: The longest ``Retry-After`` honoured (a day); a longer one is cut to this.
MAX_RETRY_AFTER_SECONDS = 86400.0
#: Characters of a refusing answer's body kept with the failed entry.
DETAIL_CHARS = 2000
#: How often a running crawl looks for new or due entries.
POLL_SECONDS = 0.5
#: A claimed entry is held this long beyond the delivery timeout (a deliverer killed
#: meanwhile: its entries are due again when the hold ends).
HOLD_MARGIN_SECONDS = 5.0


@dataclass(frozen=True)
class Announcement:
    """What a target delivers: the outbox ``entry``, its idempotency ``key`` and the JSON
    document ``payload`` (see :func:`payload_of`)."""

    key: str
    payload: dict[str, Any]
    entry: OutboxEntry

    def body(self) -> bytes:
        return json.dumps(self.payload, ensure_ascii=False, separators=(",", ":")).encode()


def payload_of(entry: OutboxEntry) -> dict[str, Any]:
    """The announcement of one change, as every target gets it."""
    return {
        "idempotency_key": entry.key,
        "kind": entry.kind,
        "record_id": entry.record_id,
        "content_hash": entry.content_hash,
        "item_type": entry.item_type,
        "source": entry.source,
        "natural_key": json.loads(entry.natural_key),
        "record": json.loads(entry.data),
        "run_id": entry.run_id,
        "changed_at": datetime.fromtimestamp(entry.created_at, timezone.utc).isoformat(),
        "sequence": entry.entry_id,
    }


class OutboxTarget(ABC):
    """A destination of announcements. Subclass it, implement :meth:`deliver`, and name the
    class in ``IDEMPOTENT_OUTBOX_TARGETS`` by its import path.

    Built with :meth:`from_crawler` (during ``scrapy idempotent deliver`` the crawler has
    settings and signals, but no engine, spider or stats). One delivery at a time per
    announcement; up to ``IDEMPOTENT_OUTBOX_CONCURRENCY`` at once per target.
    """

    #: the target as written in the setting (set by :func:`build_targets`)
    name: str = ""

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        return cls()

    @abstractmethod
    async def deliver(self, announcement: Announcement) -> str:
        """Send ``announcement`` and return once the receiver acknowledged it (the returned
        text is kept as the answer). Raise :class:`~.DeliveryRefused` when it refuses it for
        good, :class:`~.DeliveryRetry` (optionally with ``retry_after_seconds``) when it
        asks to try later; any other exception is tried again later too. Must not block the
        reactor: run a blocking client in a thread (``twisted.internet.threads``), and await
        Deferreds with ``scrapy.utils.defer.maybe_deferred_to_future``."""

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections (called once, when delivery stops)."""


class WebhookTarget(OutboxTarget):
    """POST of the announcement as JSON to ``url``, with headers ``Content-Type:
    application/json``, ``Idempotency-Key: <key>``, ``User-Agent: scrapy_idempotent/<v>``
    and those of ``IDEMPOTENT_OUTBOX_HEADERS``. A 2xx answer acknowledges it; 5xx, 408, 409,
    429 and network errors are tried again (``Retry-After`` honoured); any other answer
    (4xx, a redirect) refuses it for good, kept with the entry. ``timeout_seconds`` bounds
    the whole exchange (connecting, sending, the answer's headers and body)."""

    def __init__(self, url: str, headers: Sequence[tuple[str, str]] = (),
                 timeout_seconds: float = 30.0) -> None:
        from twisted.internet import reactor
        from twisted.web.client import Agent, HTTPConnectionPool

        parts = urlsplit(url)
        self.headers = tuple(headers)
        if parts.username is not None or parts.password is not None:
            # credentials in the URL go as HTTP Basic auth, as HTTP clients send them; the
            # URL sent (and shown) has none
            secret = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
            token = base64.b64encode(secret.encode()).decode("ascii")
            self.headers = (("Authorization", f"Basic {token}"), *self.headers)
            host = parts.netloc.rpartition("@")[2]
            url = urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
        self.url = url
        self.name = target_name(url)
        self.timeout_seconds = timeout_seconds
        self._pool = HTTPConnectionPool(reactor, persistent=True)  # type: ignore[no-untyped-call]
        self._agent = Agent(reactor, pool=self._pool,  # type: ignore[no-untyped-call]
                            connectTimeout=timeout_seconds)

    async def deliver(self, announcement: Announcement) -> str:
        from scrapy.utils.defer import maybe_deferred_to_future
        from twisted.internet import reactor
        from twisted.web.client import FileBodyProducer
        from twisted.web.http_headers import Headers

        headers = Headers({
            "Content-Type": ["application/json"],
            "Idempotency-Key": [announcement.key],
            "User-Agent": [f"scrapy_idempotent/{__version__}"],
        })
        for name, value in self.headers:
            headers.setRawHeaders(name, [value])
        body: Any = FileBodyProducer(BytesIO(announcement.body()))  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + self.timeout_seconds  # one for the whole exchange
        request: Deferred[Any] = self._agent.request(b"POST", self.url.encode(), headers, body)
        request.addTimeout(self.timeout_seconds, reactor)
        response = await maybe_deferred_to_future(request)
        reading = _read_body(response)
        reading.addTimeout(max(deadline - time.monotonic(), 0.0), reactor)
        text = (await maybe_deferred_to_future(reading)).decode("utf-8", "replace")
        status = int(response.code)
        answer = f"HTTP {status}" + (f": {text[:DETAIL_CHARS]}" if text.strip() else "")
        if 200 <= status < 300:
            return answer
        if status >= 500 or status in RETRIED_STATUSES:
            raise DeliveryRetry(answer, retry_after_seconds=webhook_retry_after(
                response.headers.getRawHeaders(b"retry-after", [b""])[0]))
        raise DeliveryRefused(answer)

    async def close(self) -> None:
        from scrapy.utils.defer import maybe_deferred_to_future

        closing: Deferred[Any] = self._pool.closeCachedConnections()  # type: ignore[no-untyped-call]
        await maybe_deferred_to_future(closing)


def _read_body(response: Any) -> Deferred[bytes]:
    """The body of a Twisted ``IResponse``; cancelling the Deferred (a timeout) stops the
    transfer. (``twisted.web.client.readBody`` warns on the proxy transport it is given.)"""
    from twisted.internet.defer import Deferred
    from twisted.internet.protocol import Protocol
    from twisted.web.client import ResponseDone
    from twisted.web.http import PotentialDataLoss

    class Collect(Protocol):
        def __init__(self) -> None:
            self.chunks: list[bytes] = []

        def dataReceived(self, data: bytes) -> None:
            self.chunks.append(data)

        def connectionLost(self, reason: Any = None) -> None:
            if done.called:
                return
            if reason is None or reason.check(ResponseDone, PotentialDataLoss):
                done.callback(b"".join(self.chunks))
            else:
                done.errback(reason)

    def cancel(_: Deferred[bytes]) -> None:
        transport = getattr(collect, "transport", None)
        if transport is not None:
            transport.stopProducing()

    done: Deferred[bytes] = Deferred(cancel)
    collect = Collect()
    response.deliverBody(collect)
    return done


def webhook_retry_after(value: bytes | str | None) -> float | None:
    """The seconds a webhook's ``Retry-After`` asks for (:func:`.retry_after_seconds`), at
    most :data:`MAX_RETRY_AFTER_SECONDS`."""
    seconds = retry_after_seconds(value)
    return None if seconds is None else min(seconds, MAX_RETRY_AFTER_SECONDS)


def target_name(spec: str) -> str:
    """How target ``spec`` of ``IDEMPOTENT_OUTBOX_TARGETS`` is named in the outbox, logs and
    reports: a URL's password replaced by ``***``."""
    return redacted(spec)


def build_targets(config: IdempotentConfig, crawler: Crawler) -> list[OutboxTarget]:
    """The targets of ``IDEMPOTENT_OUTBOX_TARGETS``, in order."""
    from scrapy.utils.misc import build_from_crawler, load_object

    targets: list[OutboxTarget] = []
    for spec in config.outbox_targets:
        if spec.startswith(("http://", "https://")):
            target: OutboxTarget = WebhookTarget(spec, config.outbox_headers,
                                                 config.outbox_timeout_seconds)
        else:
            target = build_from_crawler(load_object(spec), crawler)
            if not callable(getattr(target, "deliver", None)):
                from .exceptions import ConfigError

                raise ConfigError("IDEMPOTENT_OUTBOX_TARGETS", spec,
                                  "a class with an async deliver(announcement) method "
                                  "(see scrapy_idempotent.outbox.OutboxTarget)")
        target.name = target_name(spec)
        targets.append(target)
    return targets


#: Runs a store call somewhere and gives its result as a Deferred (see
#: :class:`~._serial_thread.SerialThread`).
StoreRunner = Callable[[Callable[[], Any]], "Deferred[Any]"]


def run_inline(action: Callable[[], Any]) -> Deferred[Any]:
    """A :data:`StoreRunner` calling the store on the reactor thread itself."""
    from twisted.internet.defer import maybeDeferred

    return maybeDeferred(action)


def _bounded(deferred: Deferred[_T], seconds: float) -> Deferred[_T]:
    """``deferred``'s result, or a :class:`TimeoutError` once ``seconds`` have passed
    without one. ``deferred`` is then cancelled, and the result is given whether or not the
    cancellation ends it (a target that ignores it cannot hold anything up). Cancelling the
    result cancels ``deferred`` the same way."""
    from twisted.internet import reactor as installed
    from twisted.internet.defer import Deferred
    from twisted.python.failure import Failure

    reactor: Any = installed

    def cancel(_: Deferred[_T]) -> None:
        if timer.active():
            timer.cancel()
        deferred.cancel()

    result: Deferred[_T] = Deferred(cancel)

    def give(outcome: Any) -> None:
        if timer.active():
            timer.cancel()
        if result.called:  # timed out or cancelled: the late outcome is dropped
            return
        if isinstance(outcome, Failure):
            result.errback(outcome)
        else:
            result.callback(outcome)

    def expire() -> None:
        if not result.called:
            result.errback(TimeoutError(f"no answer within {seconds:g} s"))
        deferred.cancel()

    timer = reactor.callLater(seconds, expire)
    deferred.addBoth(give)
    return result


class Deliverer:
    """Claims due outbox entries of ``targets`` from ``store`` and delivers them, at most
    ``concurrency`` at once per target; records each outcome as it comes (one transaction
    each). Runs on the reactor and never blocks it on a target; store calls run through
    ``run_store`` (the crawl's extension gives a :class:`~._serial_thread.SerialThread`).

    One delivery at a time per entry: an attempt ends after ``timeout_seconds`` at the
    latest (the target is cancelled and the entry tried again later), and a claim holds the
    entry :data:`HOLD_MARGIN_SECONDS` longer than that; an entry whose delivery is still in
    flight here, or whose cut-off call to a target ignoring the cancellation has not ended,
    is never claimed again by this deliverer (such a call also keeps its place in the
    target's concurrency until it ends), and an outcome is recorded only
    while the claim that sent it still holds the entry (:attr:`OutboxEntry.held_until`).

    Retries: attempt n (0 for the first) failing with a retryable error is tried again after
    ``min(retry_max, retry * 2**n)`` seconds times a random factor in [0.5, 1] (jitter), or
    after the ``Retry-After`` the receiver asked for when that is longer.
    """

    def __init__(self, store: FrontierStore, targets: Sequence[OutboxTarget], *,
                 concurrency: int, timeout_seconds: float, retry_seconds: float,
                 retry_max_seconds: float, clock: Callable[[], float] = time.time,
                 on_outcome: Callable[[OutboxOutcome], None] | None = None,
                 run_store: StoreRunner = run_inline) -> None:
        self.store = store
        self.targets = {target.name: target for target in targets}
        self.concurrency = concurrency
        self.timeout_seconds = timeout_seconds
        self.hold_seconds = timeout_seconds + HOLD_MARGIN_SECONDS
        self.retry_seconds = retry_seconds
        self.retry_max_seconds = retry_max_seconds
        self.clock = clock
        self.on_outcome = on_outcome
        self.run_store = run_store
        self.inflight: dict[str, int] = dict.fromkeys(self.targets, 0)
        self.counts = {state.value: 0 for state in OutboxState}  #: outcomes of this process
        self.stopped = False
        #: no delivery starts after this (``time.monotonic()``); set by :meth:`drain`
        self.start_until: float | None = None
        self._claimed: set[int] = set()  # entry ids from their claim until their settle
        self._running: dict[int, Deferred[Any]] = {}  # entry id -> its attempt
        #: entry id -> target name of every target call not ended yet, those cut off at the
        #: timeout included (a call ignoring its cancellation): such an entry is not claimed
        #: again, and the call takes a place of its target's concurrency, until it ends
        self._calls: dict[int, str] = {}
        self._cancelled: set[int] = set()  # attempts cancelled because delivery stopped
        self._idle: list[Deferred[None]] = []
        self._pumping = False
        self._pump_again = False
        self._pump_waiters: list[Deferred[int]] = []

    def may_start(self) -> bool:
        """Whether a new delivery may start: not stopped, and the drain's time not over."""
        return not self.stopped and (self.start_until is None
                                     or time.monotonic() < self.start_until)

    async def _store(self, action: Callable[[], _T]) -> _T:
        from scrapy.utils.defer import maybe_deferred_to_future

        result: _T = await maybe_deferred_to_future(self.run_store(action))
        return result

    def pump(self) -> Deferred[int]:
        """Start deliveries of due entries up to the concurrency; fires with how many
        started, once their claims are done. A pump asked for while one runs makes that one
        look again, and fires when it ends. A store error is logged and ends nothing: the
        next pump tries again. Starts nothing once :meth:`may_start` says no."""
        from scrapy.utils.defer import deferred_from_coro
        from twisted.internet.defer import Deferred

        if self._pumping:
            self._pump_again = True
            waiter: Deferred[int] = Deferred()
            self._pump_waiters.append(waiter)
            return waiter
        self._pumping = True  # at once: a second call in this turn waits for this pump
        return deferred_from_coro(self._pump())

    def _claim(self, name: str, limit: int, busy: frozenset[int]) -> list[OutboxEntry]:
        """The claim, on the store's thread: nothing once no delivery may start."""
        if not self.may_start():
            return []
        return self.store.claim_outbox([name], limit, self.hold_seconds, exclude=busy)

    async def _pump(self) -> int:
        started = 0
        try:
            while True:
                self._pump_again = False
                for name, target in self.targets.items():
                    free = self.concurrency - self.inflight[name] - self._abandoned(name)
                    if free <= 0 or not self.may_start():
                        continue
                    try:
                        entries = await self._store(functools.partial(
                            self._claim, name, free,
                            frozenset(self._claimed.union(self._calls))))
                    except StoreError as exc:
                        logger.warning("scrapy_idempotent: outbox: cannot claim entries "
                                       "(%s); trying again", exc)
                        return started
                    for entry in entries:
                        send = self.may_start()  # else claimed as delivery stopped
                        self._start(target, entry, send=send)
                        started += send
                if not self._pump_again:
                    return started
        finally:
            self._pumping = False
            waiters, self._pump_waiters = self._pump_waiters, []
            for waiter in waiters:
                waiter.callback(0)

    def _abandoned(self, name: str) -> int:
        """How many calls to target ``name`` were cut off and have not ended yet."""
        return sum(1 for entry_id, target in self._calls.items()
                   if target == name and entry_id not in self._claimed)

    def _start(self, target: OutboxTarget, entry: OutboxEntry, *, send: bool = True) -> None:
        from scrapy.utils.defer import deferred_from_coro

        self.inflight[target.name] += 1
        self._claimed.add(entry.entry_id)
        deferred_from_coro(self._deliver(target, entry, send))

    async def _deliver(self, target: OutboxTarget, entry: OutboxEntry, send: bool) -> None:
        try:
            outcome = (await self._attempt(target, entry) if send else OutboxOutcome(
                entry.entry_id, OutboxState.PENDING, "not sent: delivery stopped",
                retry_at=self.clock(), held_until=entry.held_until))
            try:
                settled = await self._store(functools.partial(self.store.settle_outbox,
                                                              [outcome]))
            except StoreError as exc:  # the hold ends, and the entry is sent again
                logger.warning("scrapy_idempotent: outbox: cannot record the delivery of %s "
                               "(%s); it will be sent again", entry.key, exc)
                return
            if not settled:
                logger.warning("scrapy_idempotent: outbox: the outcome of %s came after its "
                               "hold ended and was not recorded (%s)", entry.key,
                               outcome.detail)
                return
            if send:
                self.counts[outcome.state.value] += 1
                if self.on_outcome is not None:
                    self.on_outcome(outcome)
        finally:
            self._claimed.discard(entry.entry_id)
            self._running.pop(entry.entry_id, None)
            self._cancelled.discard(entry.entry_id)
            self.inflight[target.name] -= 1
            if self.may_start():
                self.pump()
            if not any(self.inflight.values()):
                idle, self._idle = self._idle, []
                for waiter in idle:
                    if not waiter.called:
                        waiter.callback(None)

    async def _attempt(self, target: OutboxTarget, entry: OutboxEntry) -> OutboxOutcome:
        from scrapy.utils.defer import deferred_from_coro, maybe_deferred_to_future
        from twisted.internet.defer import CancelledError, maybeDeferred

        announcement = Announcement(key=entry.key, payload=payload_of(entry), entry=entry)
        token = entry.held_until
        def ended(result: Any) -> Any:
            self._calls.pop(entry.entry_id, None)
            if entry.entry_id not in self._claimed and self.may_start():
                self.pump()  # a cut-off call ended: its entry may be claimed again
            return result

        try:
            self._calls[entry.entry_id] = target.name
            call = maybeDeferred(lambda: deferred_from_coro(target.deliver(announcement)))
            running = _bounded(call.addBoth(ended), self.timeout_seconds)
            self._running[entry.entry_id] = running
            answer = await maybe_deferred_to_future(running)
        except DeliveryRefused as exc:
            logger.error("scrapy_idempotent: outbox: %s refused %s for good: %s",
                         target_label(target.name), entry.key, exc)
            return OutboxOutcome(entry.entry_id, OutboxState.FAILED, str(exc)[:DETAIL_CHARS],
                                 held_until=token)
        except Exception as exc:
            if isinstance(exc, CancelledError) and entry.entry_id in self._cancelled:
                logger.info("scrapy_idempotent: outbox: %s to %s cut off as delivery stopped; "
                            "due again at once", entry.key, target_label(target.name))
                return OutboxOutcome(entry.entry_id, OutboxState.PENDING,
                                     "not acknowledged before delivery stopped",
                                     retry_at=self.clock(), held_until=token)
            retry_after = exc.retry_after_seconds if isinstance(exc, DeliveryRetry) else None
            detail = str(exc) if isinstance(exc, DeliveryRetry) else (
                f"{type(exc).__name__}: {exc}")
            delay = self.backoff(entry.attempts, retry_after)
            logger.info("scrapy_idempotent: outbox: %s to %s not acknowledged (%s); "
                        "again in %.1f s", entry.key, target_label(target.name), detail, delay)
            return OutboxOutcome(entry.entry_id, OutboxState.PENDING, detail[:DETAIL_CHARS],
                                 retry_at=self.clock() + delay, held_until=token)
        return OutboxOutcome(entry.entry_id, OutboxState.DELIVERED,
                             str(answer or "")[:DETAIL_CHARS], held_until=token)

    def backoff(self, attempts: int, retry_after: float | None = None) -> float:
        """Seconds before the next try of an entry tried ``attempts`` times before."""
        delay: float = min(self.retry_max_seconds, self.retry_seconds * 2.0 ** min(attempts, 30))
        delay *= random.uniform(0.5, 1.0)
        if retry_after is not None:
            delay = max(delay, retry_after)
        return delay

    def wait_idle(self, seconds: float | None = None) -> Deferred[None]:
        """Fires when no delivery is in flight, or after ``seconds`` when given."""
        from twisted.internet import reactor as installed
        from twisted.internet.defer import Deferred, succeed

        reactor: Any = installed
        if not any(self.inflight.values()):
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._idle.append(waiter)
        if seconds is not None:
            timer = reactor.callLater(max(seconds, 0.0), lambda: (
                None if waiter.called else waiter.callback(None)))

            def stop_timer(result: None) -> None:
                if timer.active():
                    timer.cancel()
                return result

            waiter.addBoth(stop_timer)
        return waiter

    async def drain(self, seconds: float) -> int:
        """Deliver until nothing of the targets is pending, or until ``seconds`` have gone
        by (entries whose next try falls later are left for later), then stop: no delivery
        starts after that time, and those still in flight then are cancelled and left
        pending, due at once. ``0`` delivers nothing more. Returns the entries left
        pending."""
        from scrapy.utils.defer import maybe_deferred_to_future
        from twisted.internet import reactor
        from twisted.internet.task import deferLater

        until = time.monotonic() + max(seconds, 0.0)
        self.start_until = until
        names = list(self.targets)
        try:
            while self.may_start():
                await maybe_deferred_to_future(self.pump())
                if any(self.inflight.values()):
                    await maybe_deferred_to_future(self.wait_idle(until - time.monotonic()))
                    continue
                try:
                    due = await self._store(functools.partial(self.store.outbox_next_due,
                                                              names))
                except StoreError as exc:
                    logger.warning("scrapy_idempotent: outbox: %s", exc)
                    due = None
                now, left = self.clock(), until - time.monotonic()
                if due is None or due - now >= left:
                    break
                if due > now:
                    await maybe_deferred_to_future(deferLater(
                        reactor, min(due - now, POLL_SECONDS, left), lambda: None))
        finally:
            await self.stop()
        return await self.pending()

    async def pending(self) -> int:
        """Entries of the targets still pending (read through the store runner)."""
        counts = await self._store(self.store.outbox_counts)
        return sum(counts.get(name, {}).get("pending", 0) for name in self.targets)

    async def stop(self) -> None:
        """Start no more deliveries; cancel those in flight (each is left pending, due at
        once) and wait until their outcomes are recorded."""
        from scrapy.utils.defer import maybe_deferred_to_future

        self.stopped = True
        if self._pumping:  # its claims are recorded as not sent
            await maybe_deferred_to_future(self.pump())
        for entry_id, running in list(self._running.items()):
            self._cancelled.add(entry_id)
            running.cancel()
        await maybe_deferred_to_future(self.wait_idle())

    async def close(self) -> None:
        """Stop (see :meth:`stop`), then close the targets (each given ``timeout_seconds``
        at most)."""
        from scrapy.utils.defer import deferred_from_coro, maybe_deferred_to_future
        from twisted.internet.defer import maybeDeferred

        await self.stop()
        for target in self.targets.values():
            try:
                closing: Callable[[], Deferred[None]] = functools.partial(
                    deferred_from_coro, target.close())
                await maybe_deferred_to_future(_bounded(maybeDeferred(closing),
                                                        self.timeout_seconds))
            except Exception:
                logger.exception("scrapy_idempotent: outbox: closing %s failed",
                                 target_label(target.name))


def target_label(target: str) -> str:
    """A target as the setting names it, without credentials of a URL."""
    if "://" not in target:
        return target
    from scrapy.utils.url import strip_url
    from w3lib.url import safe_url_string

    return strip_url(safe_url_string(target), strip_credentials=True)


def open_outbox_store(config: IdempotentConfig, identity: CrawlIdentity) -> FrontierStore:
    """A connection of its own to the crawl's database (created and migrated already by
    the scheduler, or by an earlier crawl), for the deliverer; ``identity`` finds the crawl's
    frontier in a database that holds several (PostgreSQL schemas) and refuses another's."""
    from .store import open_store
    from .store.registry import redacted

    store = open_store(config.database, **config.store_options())
    info = store.open_existing(readonly=False, identity=identity)
    if not info.current:
        store.close()
        raise StoreError(f"{redacted(config.database)} has schema version "
                         f"{info.version}; this scrapy_idempotent reads "
                         f"{info.supported} (a crawl migrates it)")
    return store
