"""``QueueInput``: feed a crawl from a Redis stream, acknowledging a message only once the
request it produced is done.

Enabled by ``IDEMPOTENT_QUEUE_URL`` (the add-on adds the extension; without the setting it is
off). Each worker reads the stream ``IDEMPOTENT_QUEUE_KEY`` as a consumer of the group
``IDEMPOTENT_QUEUE_GROUP`` (``XREADGROUP``): a message read is pending for that consumer in the
stream's pending entries list until it is acknowledged (``XACK``). A message is acknowledged
when the :data:`~scrapy_idempotent.signals.request_done` signal announces its request (by
fingerprint), that is once the request's page, records and completion are committed, or when
the request was already done in the current recrawl window. Never before: a worker killed
before that leaves the message pending, and it is delivered again (claimed at once from a
dead consumer on the same host, or with ``XAUTOCLAIM`` once it has been idle
``IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS``); the frontier makes the repeated delivery harmless
(one entry per fingerprint).

Why a stream and not a list with a processing list: the stream's pending entries list keeps,
per message, its consumer, its idle time and its delivery count, so a message of a dead worker
is found and claimed by any worker (``XAUTOCLAIM``) without a list per worker, and several
workers share one stream through the group; acknowledging is ``XACK`` by id (O(1)), where a
processing list needs an ``LREM`` scan and only its own worker knows to recover it.

A message is one stream entry with either a field ``url`` (a URL, fetched with ``GET`` and the
spider's ``parse``), or a field ``request`` holding a JSON object: ``url`` (required),
``method``, ``body`` (text), ``headers`` (object), ``meta`` (object), ``cb_kwargs`` (object),
``callback`` and ``errback`` (names of spider methods), ``priority`` (integer). A message
with a field ``stop`` ends the crawl (``finished``) once every message read before it is done.
A message that is not one of these, or whose request cannot be built, is parked: added to the
stream ``<IDEMPOTENT_QUEUE_KEY>:parked`` with its id, fields and error, and acknowledged, in
one ``MULTI``; it is logged and counted, never dropped in silence, and the crawl goes on.

Redis is never called on the reactor thread: every command (``redis-py``'s blocking client,
``XREADGROUP`` without ``BLOCK``, polled every ``IDEMPOTENT_QUEUE_POLL_SECONDS``; the
acknowledgements; the parking) runs on one thread of the extension's own, one after the other
in the order they were sent, and the reactor gets the replies back. A Redis server that stops
answering delays the queue's reads and acknowledgements (each command up to its socket
timeout), never the downloads, the page commits or the lease renewals; a poll starts only once
the one before it is back. A Redis error is logged and retried at the next poll;
acknowledgements that failed are sent again then.

``IDEMPOTENT_QUEUE_PREFETCH`` bounds the messages a worker holds unacknowledged, whatever
brought them: read (``XREADGROUP``), claimed from a dead consumer (``XCLAIM``) or claimed
once idle (``XAUTOCLAIM``); what is left over is claimed by the next polls (or by other
workers).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from scrapy import Request
from scrapy import signals as scrapy_signals
from scrapy.exceptions import DontCloseSpider, NotConfigured
from scrapy.utils.defer import maybe_deferred_to_future
from twisted.internet import task

from . import scrapy_compat, signals
from ._serial_thread import SerialThread
from .config import QueueConfig, config_for
from .exceptions import ConfigError, StoreBusy
from .workers import declare_live, forget_live, new_worker_id, worker_is_dead

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred
    from twisted.python.failure import Failure
    from typing_extensions import Self

    from .scheduler import IdempotentScheduler

__all__ = ["QueueConfig", "QueueInput", "QueueMessageError", "request_from_message"]

logger = logging.getLogger(__name__)

#: Keys a JSON request message may have.
REQUEST_FIELDS = ("url", "method", "body", "headers", "meta", "cb_kwargs", "callback",
                  "errback", "priority")
#: Messages waiting longer than this are checked against the frontier (a request finished by
#: another worker, whose signal this process never sees).
_RECONCILE_AFTER_SECONDS = 5.0
#: A request state that could not be read (the frontier was not readable at once).
_UNREADABLE = "unreadable"
#: How often the consumers of the group are checked for dead ones of this host.
_DEAD_CHECK_SECONDS = 5.0


class QueueMessageError(ValueError):
    """A message that is not a request this crawl can make (parked with this error)."""


def request_from_message(fields: Mapping[str, str], spider: Spider) -> Request:
    """The request a stream entry asks for. Raises :class:`QueueMessageError` saying what is
    wrong (the message is then parked)."""
    if set(fields) == {"url"}:
        data: dict[str, Any] = {"url": fields["url"]}
    elif set(fields) == {"request"}:
        try:
            data = json.loads(fields["request"])
        except ValueError as exc:
            raise QueueMessageError(f"the request field is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise QueueMessageError("the request field must be a JSON object")
    else:
        raise QueueMessageError(
            f"a message has one field, 'url' (a URL) or 'request' (a JSON object), or 'stop';"
            f" got {', '.join(sorted(fields)) or 'none'}")
    unknown = sorted(set(data) - set(REQUEST_FIELDS))
    if unknown:
        raise QueueMessageError(f"unknown request key(s) {', '.join(unknown)}; allowed: "
                                f"{', '.join(REQUEST_FIELDS)}")
    url = data.get("url")
    if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https") \
            or not urlsplit(url).netloc:
        raise QueueMessageError(f"url must be an absolute http(s) URL, not {url!r}")
    kwargs: dict[str, Any] = {"url": url}
    for name, kind in (("method", str), ("body", str), ("headers", dict), ("meta", dict),
                       ("cb_kwargs", dict), ("priority", int)):
        if name in data:
            value = data[name]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise QueueMessageError(f"{name} must be a JSON {kind.__name__}, not "
                                        f"{value!r}"[:300])
            kwargs[name] = value
    for name in ("callback", "errback"):
        if name in data:
            method = data[name]
            target = getattr(spider, method, None) if isinstance(method, str) else None
            if not isinstance(method, str) or method.startswith("_") or not callable(target):
                raise QueueMessageError(
                    f"{name} must name a method of the spider {spider.name!r}, not {method!r}")
            kwargs[name] = target
    try:
        return Request(**kwargs)
    except (TypeError, ValueError) as exc:
        raise QueueMessageError(f"invalid request: {exc}") from None


@dataclass(frozen=True)
class _PollPlan:
    """What one poll asks of Redis, decided on the reactor thread."""

    create_group: bool
    acks: list[str]  #: ids whose XACK failed before: sent again first
    claim_dead: bool  #: take over the pending messages of this host's dead consumers
    autoclaim: str | None  #: XAUTOCLAIM from this cursor (None: not this time)
    room: int  #: messages that may be taken (claims and reads together)
    read: bool  #: read new messages (XREADGROUP) with the room left
    known: frozenset[str]  #: ids this worker holds already (not taken twice)


@dataclass
class _Polled:
    """What one poll got from Redis (on the Redis thread), for the reactor thread."""

    group_ready: bool = False
    acked: int = 0
    claimed: int = 0
    entries: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    dead_left: bool = False  #: a dead consumer still has pending messages (no room)
    autoclaim_cursor: str | None = None  #: where the next XAUTOCLAIM goes on (None: done)
    error: BaseException | None = None  #: the Redis error that ended the poll early


@dataclass
class _Message:
    """A message read and not yet acknowledged."""

    id: str
    received: float
    #: fingerprints whose request_done acknowledges it: its request's, then its redirect
    #: targets' (a redirected request is done when its target is)
    fingerprints: set[str] = field(default_factory=set)
    urls: set[str] = field(default_factory=set)  #: of those requests (to follow redirects)
    fingerprint: str = ""  #: its own request's
    fields: Mapping[str, str] = field(default_factory=dict)  #: as read (to park it)
    #: what could not be decided because the frontier could not be read at once (a lost
    #: PostgreSQL connection being re-established): "refused" (whether its request was
    #: refused before the frontier), "targets" (which redirect targets were); decided again
    #: at the next reconciliation
    undecided: set[str] = field(default_factory=set)


class QueueInput:
    """The extension that feeds the crawl from the Redis stream (see the module docstring).

    Off (``NotConfigured``) without ``IDEMPOTENT_QUEUE_URL``. Needs the
    :class:`~.IdempotentScheduler` (its frontier makes redelivery harmless)."""

    def __init__(self, crawler: Crawler, config: QueueConfig, client: Any) -> None:
        self.crawler = crawler
        self.config = config
        self.redis = client
        self.consumer = new_worker_id()  #: a worker id, so dead consumers can be told
        self.stats = crawler.stats
        self.spider: Spider | None = None
        self.scheduler: IdempotentScheduler | None = None
        self._messages: dict[str, _Message] = {}  # id -> message read, not acknowledged
        self._waiting: dict[str, set[str]] = {}  # fingerprint -> message ids
        self._by_url: dict[str, set[str]] = {}  # URL of a waited request -> message ids
        self._unacked: list[str] = []  # ids whose XACK failed, sent again at the next poll
        self._poll: task.LoopingCall | None = None
        #: every Redis command, one after the other, off the reactor thread
        self._redis_calls = SerialThread("scrapy_idempotent-queue")
        self._closed = False
        self._group_ready = False
        self._claimed_dead_at = 0.0
        self._autoclaimed_at = 0.0
        self._autoclaim_cursor = "0-0"  #: where XAUTOCLAIM goes on (kept between polls)
        self._reconciled_at = 0.0
        self._stop_id: str | None = None  # a stop message read
        self._finishing = False  # the crawl was let close: read nothing more
        self._empty_since: float | None = None  # the stream had nothing for us since then
        self._redis_error: str | None = None  # the last Redis error logged

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        with scrapy_compat.start_failure_exits_nonzero(crawler):
            config = config_for(crawler).queue  # validated with every other setting
            if config is None:
                raise NotConfigured("IDEMPOTENT_QUEUE_URL is not set")
            try:
                import redis
            except ImportError:
                raise ConfigError(
                    "IDEMPOTENT_QUEUE_URL", config.url,
                    "a Redis URL, with the redis client installed: pip install "
                    "'scrapy-idempotent[redis]' (or pip install redis)") from None
            client = redis.Redis.from_url(config.url, decode_responses=True,
                                          socket_timeout=10, socket_connect_timeout=10)
        extension = cls(crawler, config, client)
        connect = crawler.signals.connect
        connect(extension.spider_opened, signal=scrapy_signals.spider_opened)
        connect(extension.spider_idle, signal=scrapy_signals.spider_idle)
        connect(extension.spider_closed, signal=scrapy_signals.spider_closed)
        connect(extension.request_scheduled, signal=scrapy_signals.request_scheduled)
        connect(extension.request_done, signal=signals.request_done)
        return extension

    # -- lifecycle --------------------------------------------------------------------------

    def spider_opened(self, spider: Spider) -> None:
        from .scheduler import is_idempotent_scheduler

        scheduler = scrapy_compat.engine_scheduler(self.crawler)
        if not is_idempotent_scheduler(scheduler):
            raise ConfigError("IDEMPOTENT_QUEUE_URL", self.config.url,
                              "a queue input needs scrapy_idempotent's scheduler (the add-on "
                              f"sets it); this crawl's scheduler is {type(scheduler).__name__}")
        self.scheduler = cast("IdempotentScheduler", scheduler)
        self.spider = spider
        declare_live(self.consumer)
        logger.info("scrapy_idempotent: reading requests from the Redis stream %r (group %r, "
                    "consumer %s)", self.config.key, self.config.group, self.consumer)
        # the first poll's messages are taken when Redis answers, in a later reactor turn:
        # after every spider_opened handler ran (Scrapy 2.13's OffsiteMiddleware builds its
        # host filter in its own, and refuses nothing before)
        self._poll = task.LoopingCall(self.poll)
        self._poll.start(self.config.poll_seconds, now=True)

    def spider_idle(self, spider: Spider) -> None:
        """Keep an idle crawl open while the queue may bring more work; let it finish after a
        stop message (once everything before it is done) or after
        ``IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS`` with nothing to do."""
        if self._messages:
            raise DontCloseSpider  # their requests are still being done (elsewhere)
        if self._stop_id is not None:
            self._finishing = True
            return
        timeout = self.config.idle_timeout_seconds
        if timeout is not None and self._empty_since is not None \
                and time.monotonic() - self._empty_since >= timeout:
            logger.info("scrapy_idempotent: the queue had nothing for %.1f s "
                        "(IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS): finishing", timeout)
            self._finishing = True  # read nothing more: this crawl is closing
            return
        raise DontCloseSpider

    async def spider_closed(self, spider: Spider, reason: str) -> None:
        """Stop polling; send the acknowledgements still owed (after every command sent
        before), then close the client and end the Redis thread. The close waits for it."""
        self._closed = True
        if self._poll is not None and self._poll.running:
            self._poll.stop()
        ids, self._unacked = self._unacked, []
        if self._stop_id is not None and reason == "finished":
            ids.append(self._stop_id)
        if self._messages:
            logger.info("scrapy_idempotent: %d queue message(s) not acknowledged (their "
                        "requests are not done): they will be delivered again",
                        len(self._messages))
        forget_live(self.consumer)
        closing = self._redis_calls(lambda: self._ack_and_close(ids))
        closing.addCallbacks(self._acked, self._ack_failed, errbackArgs=(ids,))
        closing.addBoth(lambda _: self._redis_calls.stop())
        await maybe_deferred_to_future(closing)

    def _ack_and_close(self, ids: list[str]) -> int:
        """On the Redis thread: the last acknowledgements, then the client is closed."""
        try:
            return self._xack(ids)
        finally:
            with contextlib.suppress(Exception):  # closing only
                self.redis.close()

    # -- reading ----------------------------------------------------------------------------

    def poll(self) -> Deferred[Any] | None:
        """One round: acknowledgements that failed, claims, new messages; the Redis commands
        run on the Redis thread, the messages are taken here when they are back (the next
        poll starts after that). Never fails."""
        if self._closed:
            return None
        now = time.monotonic()
        plan = self._plan(now)
        polling = self._redis_calls(lambda: self._poll_redis(plan))
        polling.addCallback(self._polled, plan, now)
        polling.addErrback(self._poll_failed)
        return polling

    def _plan(self, now: float) -> _PollPlan:
        acks, self._unacked = self._unacked, []
        reading = not self._finishing and self._stop_id is None
        claim_dead = not self._finishing and now >= self._claimed_dead_at
        autoclaim = not self._finishing and now >= self._autoclaimed_at
        known = frozenset(self._messages) | (
            {self._stop_id} if self._stop_id is not None else frozenset())
        return _PollPlan(
            create_group=not self._group_ready, acks=acks, claim_dead=claim_dead,
            autoclaim=self._autoclaim_cursor if autoclaim else None,
            room=self.config.prefetch - len(self._messages) if not self._finishing else 0,
            read=reading, known=known)

    def _poll_redis(self, plan: _PollPlan) -> _Polled:
        """On the Redis thread: the commands of one poll. A Redis error ends it early,
        returned with what was got until then (messages claimed are this worker's now)."""
        polled = _Polled(autoclaim_cursor=plan.autoclaim)
        try:
            if plan.create_group:
                self._create_group()
            polled.group_ready = True
            polled.acked = self._xack(plan.acks)
            room = plan.room
            if plan.claim_dead and room > 0:
                room -= self._claim_from_dead(room, polled)
            elif plan.claim_dead:
                polled.dead_left = True  # not checked: no room
            if plan.autoclaim is not None and room > 0:
                room -= self._autoclaim(plan.autoclaim, room, plan.known, polled)
            if plan.read and room > 0:
                read = self.redis.xreadgroup(self.config.group, self.consumer,
                                             {self.config.key: ">"}, count=room)
                for _, stream_entries in read or []:
                    polled.entries += stream_entries
        except Exception as exc:
            polled.error = exc
        return polled

    def _polled(self, polled: _Polled, plan: _PollPlan, now: float) -> None:
        """On the reactor thread: take the messages one poll brought."""
        if polled.group_ready:
            self._group_ready = True
        if polled.acked:
            self.stats.inc_value("idempotent/queue/acknowledged", polled.acked)
        elif plan.acks and polled.error is not None:
            self._unacked += plan.acks  # not sent: again at the next poll
        if polled.claimed:
            self.stats.inc_value("idempotent/queue/claimed", polled.claimed)
        if plan.claim_dead and not polled.dead_left and polled.error is None:
            self._claimed_dead_at = now + _DEAD_CHECK_SECONDS  # all taken: check later
        if plan.autoclaim is not None and polled.error is None:
            if polled.autoclaim_cursor is None:  # the pending list was scanned to its end
                self._autoclaim_cursor = "0-0"
                self._autoclaimed_at = now + max(1.0, self.config.claim_idle_seconds / 4)
            else:  # more to scan: at the next poll
                self._autoclaim_cursor = polled.autoclaim_cursor
        if self._closed:
            return  # read while closing: not acknowledged, so delivered again
        for message_id, fields in polled.entries:
            self._take(message_id, fields)
        if polled.error is not None:
            self._redis_failed(polled.error)
            return
        if polled.entries or self._messages:
            self._empty_since = None
        elif self._empty_since is None:
            self._empty_since = now
        if now >= self._reconciled_at:
            self._reconciled_at = now + _RECONCILE_AFTER_SECONDS
            self._reconcile(now)
        if self._redis_error is not None:
            logger.info("scrapy_idempotent: Redis queue %r reachable again", self.config.key)
            self._redis_error = None

    def _poll_failed(self, failure: Failure) -> None:
        """An error taking the poll's messages on the reactor (the Redis commands' own errors
        come back in :class:`_Polled`, its acknowledgements counted already)."""
        logger.error("scrapy_idempotent: queue %r: cannot take the messages read: %s",
                     self.config.key, failure.getTraceback())

    def _redis_failed(self, exc: BaseException | None) -> None:
        self.stats.inc_value("idempotent/queue/redis_errors")
        text = f"{type(exc).__name__}: {exc}"
        if text != self._redis_error:
            self._redis_error = text
            logger.error("scrapy_idempotent: Redis queue %r: %s (retried every %.1f s)",
                         self.config.key, text, self.config.poll_seconds)

    def _create_group(self) -> None:
        import redis

        try:
            self.redis.xgroup_create(self.config.key, self.config.group, id="0",
                                     mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _claim_from_dead(self, room: int, polled: _Polled) -> int:
        """On the Redis thread: take at once up to ``room`` pending messages of consumers
        that ran on this host, in this process's PID namespace, and are gone (their process
        no longer exists), and remove such a consumer once it has none left. Returns how many
        were taken."""
        taken = 0
        for consumer in self.redis.xinfo_consumers(self.config.key, self.config.group):
            name = consumer["name"]
            if name == self.consumer or not worker_is_dead(name):
                continue
            if taken >= room:
                polled.dead_left = True
                break
            want = room - taken
            pending = self.redis.xpending_range(self.config.key, self.config.group,
                                                min="-", max="+", count=want,
                                                consumername=name)
            if pending:
                ids = [p["message_id"] for p in pending]
                entries = [e for e in self.redis.xclaim(self.config.key, self.config.group,
                                                        self.consumer, 0, ids)
                           if e[1] is not None]
                polled.entries += entries
                taken += len(entries)
                gone = set(ids) - {e[0] for e in entries}
                if gone:  # deleted from the stream meanwhile: nothing to do for them
                    self.redis.xack(self.config.key, self.config.group, *gone)
                if len(pending) == want:  # it may have more: taken at the next poll
                    polled.dead_left = True
                    break
            self.redis.xgroup_delconsumer(self.config.key, self.config.group, name)
            logger.info("scrapy_idempotent: consumer %s is gone: its pending messages are "
                        "delivered again here", name)
        polled.claimed += taken
        return taken

    def _autoclaim(self, cursor: str, room: int, known: frozenset[str],
                   polled: _Polled) -> int:
        """On the Redis thread: up to ``room`` messages pending for
        ``IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS`` with any consumer (a worker on another host
        that died, or that is too slow), delivered again here; the scan goes on from
        ``cursor`` and stops where the room is full (the next poll goes on from there).
        Returns how many were taken."""
        min_idle_ms = int(self.config.claim_idle_seconds * 1000)
        taken = 0
        while taken < room:
            reply = self.redis.xautoclaim(self.config.key, self.config.group, self.consumer,
                                          min_idle_ms, start_id=cursor, count=room - taken)
            cursor, entries = reply[0], reply[1]
            new = [e for e in entries if e[0] not in known and e[1] is not None]
            polled.entries += new
            taken += len(new)
            if cursor in ("0-0", b"0-0"):
                polled.autoclaim_cursor = None
                break
            polled.autoclaim_cursor = cursor
            if not entries:
                break
        polled.claimed += taken
        return taken

    def _take(self, message_id: str, fields: dict[str, str]) -> None:
        """Feed one message to the crawl, or park it."""
        if message_id in self._messages or message_id == self._stop_id:
            return
        assert self.spider is not None and self.scheduler is not None
        self.stats.inc_value("idempotent/queue/received")
        if set(fields) == {"stop"}:
            self._stop_id = message_id
            logger.info("scrapy_idempotent: stop message %s read: the crawl finishes once "
                        "the requests of the messages before it are done", message_id)
            return
        try:
            request = request_from_message(fields, self.spider)
        except QueueMessageError as exc:
            self._park(message_id, fields, str(exc))
            return
        fingerprint = self.crawler.request_fingerprinter.fingerprint(request).hex()
        message = _Message(message_id, time.monotonic(), {fingerprint}, {request.url},
                           fingerprint, fields)
        self._messages[message_id] = message
        self._waiting.setdefault(fingerprint, set()).add(message_id)
        self._by_url.setdefault(request.url, set()).add(message_id)
        assert self.crawler.engine is not None
        try:
            self.crawler.engine.crawl(request)  # already done: acknowledged by now
        except Exception:
            # the engine is closing: not acknowledged, so delivered again to the next worker
            logger.exception("scrapy_idempotent: cannot crawl the request of queue message "
                             "%s now; it will be delivered again", message_id)
            self._forget(message)
            return
        if message_id in self._messages:
            self._check_refused(message)

    def _check_refused(self, message: _Message) -> None:
        """Park ``message`` when its request is neither accepted nor known: refused before
        the scheduler (an IgnoreRequest in a request_scheduled handler, as OffsiteMiddleware
        raises, or no fingerprint). Left undecided while the frontier cannot be read."""
        state = self._request_state(message.fingerprint)
        if state == _UNREADABLE:
            message.undecided.add("refused")
            return
        message.undecided.discard("refused")
        if state is None:
            self._forget(message)
            self._park(message.id, message.fields, "the request was refused before it "
                       "reached the frontier (not in the spider's allowed_domains, or refused "
                       "by a request_scheduled handler)")

    def _request_state(self, fingerprint: str) -> str | None:
        """The scheduler's :meth:`~.IdempotentScheduler.request_state`, or
        :data:`_UNREADABLE` while the frontier cannot be read at once (asked again later)."""
        assert self.scheduler is not None
        try:
            return self.scheduler.request_state(fingerprint)
        except StoreBusy as exc:
            logger.debug("scrapy_idempotent: queue: frontier not readable now (%s)", exc)
            return _UNREADABLE

    def _park(self, message_id: str, fields: Mapping[str, str], error: str) -> None:
        """Move a bad message to the parked stream with its error, and acknowledge it, in
        one transaction (MULTI): visible to operators, never lost."""
        entry = {"id": message_id, "fields": json.dumps(dict(fields), sort_keys=True),
                 "error": error, "consumer": self.consumer}

        def park() -> None:  # on the Redis thread
            pipe = self.redis.pipeline(transaction=True)
            pipe.xadd(self.config.parked_key, entry)
            pipe.xack(self.config.key, self.config.group, message_id)
            pipe.execute()

        parking = self._redis_calls(park)
        parking.addCallbacks(self._parked, lambda failure: self._redis_failed(failure.value),
                             callbackArgs=(message_id, error))

    def _parked(self, _: None, message_id: str, error: str) -> None:
        self.stats.inc_value("idempotent/queue/parked")
        logger.warning("scrapy_idempotent: queue message %s parked in %r: %s", message_id,
                       self.config.parked_key, error)

    # -- acknowledging ----------------------------------------------------------------------

    def request_scheduled(self, request: Request, spider: Spider) -> None:
        """A redirect of a request a message waits for: the message waits for its target."""
        redirected_from = request.meta.get("redirect_urls")
        if not redirected_from or not self._by_url:
            return
        ids = self._by_url.get(redirected_from[-1])
        if not ids:
            return
        fingerprint = self.crawler.request_fingerprinter.fingerprint(request).hex()
        for message_id in list(ids):
            message = self._messages[message_id]
            message.fingerprints.add(fingerprint)
            message.urls.add(request.url)
            self._waiting.setdefault(fingerprint, set()).add(message_id)
            self._by_url.setdefault(request.url, set()).add(message_id)

    def request_done(self, fingerprint: str, state: str) -> None:
        """Acknowledge the messages waiting for ``fingerprint``: its final state (or that it
        was done already) is committed."""
        ids = self._waiting.get(fingerprint)
        if not ids:
            return
        done: list[str] = []
        for message_id in list(ids):
            message = self._messages[message_id]
            if state == "redirected" and self._wait_for_targets(message, fingerprint):
                # its target is another request (registered when it was scheduled): the
                # message is done when that is
                ids.discard(message_id)
                continue
            done.append(message_id)
        if not ids:
            self._waiting.pop(fingerprint, None)
        for message_id in done:
            self._forget(self._messages[message_id])
        self._ack(done)

    def _wait_for_targets(self, message: _Message, redirected: str) -> bool:
        """Whether ``message`` still waits for a target of its redirected request. A target
        the frontier does not know was refused before it was stored (a ``request_scheduled``
        handler such as the offsite middleware dropped it, or it was unidentifiable): the
        redirect's own commit, which would have stored an accepted target, is durable now,
        so nothing more will come of it."""
        message.fingerprints.discard(redirected)
        return self._prune_targets(message)

    def _prune_targets(self, message: _Message) -> bool:
        """Forget the targets of ``message`` that the frontier does not know (see
        :meth:`_wait_for_targets`); whether it still waits for one. A target is kept,
        undecided, while the frontier cannot be read."""
        message.undecided.discard("targets")
        for target in list(message.fingerprints):
            state = self._request_state(target)
            if state == _UNREADABLE:
                message.undecided.add("targets")
            elif state is None:
                message.fingerprints.discard(target)
                ids = self._waiting.get(target)
                if ids is not None:
                    ids.discard(message.id)
                    if not ids:
                        del self._waiting[target]
        return bool(message.fingerprints)

    def _forget(self, message: _Message) -> None:
        del self._messages[message.id]
        for fingerprint in message.fingerprints:
            ids = self._waiting.get(fingerprint)
            if ids is not None:
                ids.discard(message.id)
                if not ids:
                    del self._waiting[fingerprint]
        for url in message.urls:
            ids = self._by_url.get(url)
            if ids is not None:
                ids.discard(message.id)
                if not ids:
                    del self._by_url[url]

    def _ack(self, ids: list[str]) -> None:
        """Acknowledge ``ids`` (on the Redis thread, after every command sent before: always
        after the commit that ``request_done`` announced)."""
        if not ids or self._closed:
            return  # (closed: the close acknowledges what is owed)
        acking = self._redis_calls(lambda: self._xack(ids))
        acking.addCallbacks(self._acked, self._ack_failed, errbackArgs=(ids,))

    def _xack(self, ids: list[str]) -> int:
        if not ids:
            return 0
        self.redis.xack(self.config.key, self.config.group, *ids)
        return len(ids)

    def _acked(self, count: int) -> None:
        if count:
            self.stats.inc_value("idempotent/queue/acknowledged", count)

    def _ack_failed(self, failure: Failure, ids: list[str]) -> None:
        logger.warning("scrapy_idempotent: cannot acknowledge %d queue message(s) yet "
                       "(%s): retried at the next poll", len(ids), failure.value)
        if not self._closed:
            self._unacked += ids

    def _reconcile(self, now: float) -> None:
        """Messages waiting for a while on a request this worker does not process (another
        worker holds it): acknowledged once the frontier has it finished."""
        for message in list(self._messages.values()):
            if message.undecided:
                self._decide(message)
                continue
            if now - message.received < _RECONCILE_AFTER_SECONDS \
                    or len(message.fingerprints) != 1:
                continue
            (fingerprint,) = message.fingerprints
            if self._request_state(fingerprint) == signals.ALREADY_DONE:
                self._forget(message)
                self._ack([message.id])

    def _decide(self, message: _Message) -> None:
        """What was left undecided about ``message`` while the frontier could not be read."""
        if "refused" in message.undecided:
            self._check_refused(message)
            if message.id not in self._messages or "refused" in message.undecided:
                return
        if "targets" in message.undecided and not self._prune_targets(message):
            self._forget(message)  # its redirect is done and every target was refused
            self._ack([message.id])
