"""``QueueInput``: feed a crawl from a queue (a Redis stream, an SQS queue, a RabbitMQ queue),
acknowledging a message only once the request it produced is done.

Enabled by ``IDEMPOTENT_QUEUE_URL`` (the add-on adds the extension; without the setting it is
off); its scheme picks the broker: ``redis://``, ``rediss://``, ``unix://`` a Redis stream
(:mod:`.redis_stream`), ``sqs://`` or a queue's ``https://`` URL an SQS queue (:mod:`.sqs`),
``amqp://``, ``amqps://`` a RabbitMQ queue (:mod:`.amqp`), ``kafka://`` a Kafka topic read
by a consumer group (:mod:`.kafka`). Each broker keeps the contract of
:mod:`.broker`: take a batch, extend a held message's invisibility while its request is in
progress, acknowledge after the commit, park a bad message with its error, take over a dead
consumer's messages.

A message is acknowledged when the :data:`~scrapy_idempotent.signals.request_done` signal
announces its request (by fingerprint), that is once the request's page, records and
completion are committed, or when the request was already done in the current recrawl window.
Never before: a worker killed before that leaves the message unacknowledged, and the broker
delivers it again; the frontier makes the repeated delivery harmless (one entry per
fingerprint).

A message is either a URL (fetched with ``GET`` and the spider's ``parse``), or a JSON object:
``url`` (required), ``method``, ``body`` (text), ``headers`` (object), ``meta`` (object),
``cb_kwargs`` (object), ``callback`` and ``errback`` (names of spider methods), ``priority``
(integer); on a Redis stream an entry with a field ``url`` or a field ``request`` holding the
JSON object, elsewhere the message body. A message ``stop`` (a field ``stop``, or the body
``{"stop": true}``) ends the crawl (``finished``) once every message read before it, or in
its batch, is done; nothing new is read after it. Every stop message read is acknowledged
when the crawl finishes (several in one batch end one crawl: none is left to end the next);
a crawl ended otherwise acknowledges none, so they are delivered again.
A message that is not one of these, or whose request cannot be built, is parked with its
error: logged and counted, never dropped in silence, and the crawl goes on.

The broker is never called on the reactor thread: every call (the reads, the extensions, the
acknowledgements, the parking) runs on one thread of the extension's own, one after the other
in the order they were sent, and the reactor gets the replies back. A broker that stops
answering delays the queue's reads and acknowledgements, never the downloads, the page commits
or the lease renewals; a poll starts only once the one before it is back. A broker error is
logged and retried at the next poll; acknowledgements that failed are sent again then. While
the broker cannot be reached, the crawl counts as idle for
``IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS`` (it then closes as ``idempotent_queue_unreachable``,
exit code 1, when the last poll failed).

``IDEMPOTENT_QUEUE_PREFETCH`` bounds the messages a worker holds unacknowledged, whatever
brought them (read, or taken over from another consumer); what is left over is taken by the
next polls (or by other workers).
"""

from __future__ import annotations

import importlib
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

from .. import scrapy_compat, signals
from .._kafka_url import redacted_kafka_url
from .._scheduler_kind import is_idempotent_scheduler
from .._serial_thread import SerialThread
from ..config import QueueConfig, config_for
from ..exceptions import ConfigError, StoreBusy
from ..workers import declare_live, forget_live, new_worker_id
from .broker import QueueBroker, Taken, fields_from_body

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred
    from twisted.python.failure import Failure
    from typing_extensions import Self

    from ..scheduler import IdempotentScheduler

__all__ = ["QueueBroker", "QueueConfig", "QueueInput", "QueueMessageError", "Taken",
           "fields_from_body", "request_from_message"]

logger = logging.getLogger(__name__)

#: Keys a JSON request message may have.
REQUEST_FIELDS = ("url", "method", "body", "headers", "meta", "cb_kwargs", "callback",
                  "errback", "priority")
#: Messages waiting longer than this are checked against the frontier (a request finished by
#: another worker, whose signal this process never sees).
_RECONCILE_AFTER_SECONDS = 5.0
#: A request state that could not be read (the frontier was not readable at once).
_UNREADABLE = "unreadable"
#: The close reason of a crawl whose queue could not be reached for
#: IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS.
UNREACHABLE_REASON = "idempotent_queue_unreachable"


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
    """What one poll asks of the broker, decided on the reactor thread."""

    acks: list[str]  #: ids whose acknowledgement failed before: sent again first
    extend: list[str]  #: ids held whose requests are in progress
    take: bool  #: take messages (not once the crawl is finishing)
    room: int  #: messages that may be taken (taken over and read together)
    read: bool  #: read new messages with the room left
    known: frozenset[str]  #: ids this worker holds already (not taken twice)


@dataclass
class _Polled:
    """What one poll got from the broker (on the broker's thread), for the reactor."""

    acked: int = 0
    acks_sent: bool = False
    taken: Taken = field(default_factory=Taken)
    error: BaseException | None = None  #: the broker error that ended the poll early


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


def broker_for(config: QueueConfig, consumer: str) -> QueueBroker:
    """The broker of ``IDEMPOTENT_QUEUE_URL`` (its scheme, checked by config.py), its client
    library imported here: :class:`~.ConfigError` naming the extra to install without it."""
    kind = config.broker
    module, extra = {"redis": ("redis", "redis"), "sqs": ("boto3", "sqs"),
                     "amqp": ("pika", "amqp"), "kafka": ("confluent_kafka", "kafka")}[kind]
    try:
        importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            "IDEMPOTENT_QUEUE_URL",
            redacted_kafka_url(config.url) if kind == "kafka" else config.url,
            f"a {config.broker_name} URL, with its client installed: pip install "
            f"'scrapy-idempotent[{extra}]' (or pip install {module})") from None
    if kind == "sqs":
        from .sqs import SqsBroker

        return SqsBroker.from_config(config, consumer)
    if kind == "amqp":
        from .amqp import AmqpBroker

        return AmqpBroker.from_config(config, consumer)
    if kind == "kafka":
        from .kafka import KafkaBroker

        return KafkaBroker.from_config(config, consumer)
    from .redis_stream import RedisStreamBroker

    return RedisStreamBroker.from_config(config, consumer)


class QueueInput:
    """The extension that feeds the crawl from a queue (see the module docstring).

    Off (``NotConfigured``) without ``IDEMPOTENT_QUEUE_URL``. Needs the
    :class:`~.IdempotentScheduler` (its frontier makes redelivery harmless)."""

    def __init__(self, crawler: Crawler, config: QueueConfig, broker: QueueBroker) -> None:
        self.crawler = crawler
        self.config = config
        self.broker = broker
        self.consumer = broker.consumer  #: a worker id, so dead consumers can be told
        self.stats = crawler.stats
        self.spider: Spider | None = None
        self.scheduler: IdempotentScheduler | None = None
        self._messages: dict[str, _Message] = {}  # id -> message read, not acknowledged
        self._waiting: dict[str, set[str]] = {}  # fingerprint -> message ids
        self._by_url: dict[str, set[str]] = {}  # URL of a waited request -> message ids
        self._unacked: list[str] = []  # ids whose ack failed, sent again at the next poll
        self._poll: task.LoopingCall | None = None
        #: every broker call, one after the other, off the reactor thread
        self._broker_calls = SerialThread("scrapy_idempotent-queue")
        self._closed = False
        self._reconciled_at = 0.0
        #: the stop messages read, in order: held unacknowledged until the crawl finishes,
        #: then acknowledged all together (a stop left unacknowledged would end the next crawl)
        self._stop_ids: list[str] = []
        self._finishing = False  # the crawl was let close: read nothing more
        self._empty_since: float | None = None  # the queue had nothing for us since then
        self._broker_error: str | None = None  # the last broker error logged (None: none)

    @property
    def redis(self) -> Any:
        """The Redis client of a Redis stream input (tests wrap it)."""
        return getattr(self.broker, "client", None)

    @redis.setter
    def redis(self, client: Any) -> None:
        cast("Any", self.broker).client = client

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        with scrapy_compat.start_failure_exits_nonzero(crawler):
            config = config_for(crawler).queue  # validated with every other setting
            if config is None:
                raise NotConfigured("IDEMPOTENT_QUEUE_URL is not set")
            broker = broker_for(config, new_worker_id())
        extension = cls(crawler, config, broker)
        connect = crawler.signals.connect
        connect(extension.spider_opened, signal=scrapy_signals.spider_opened)
        connect(extension.spider_idle, signal=scrapy_signals.spider_idle)
        connect(extension.spider_closed, signal=scrapy_signals.spider_closed)
        connect(extension.request_scheduled, signal=scrapy_signals.request_scheduled)
        connect(extension.request_done, signal=signals.request_done)
        return extension

    # -- lifecycle --------------------------------------------------------------------------

    def spider_opened(self, spider: Spider) -> None:
        scheduler = scrapy_compat.engine_scheduler(self.crawler)
        if not is_idempotent_scheduler(scheduler):
            raise ConfigError("IDEMPOTENT_QUEUE_URL", self.config.url,
                              "a queue input needs scrapy_idempotent's scheduler (the add-on "
                              f"sets it); this crawl's scheduler is {type(scheduler).__name__}")
        self.scheduler = cast("IdempotentScheduler", scheduler)
        self.spider = spider
        declare_live(self.consumer)
        logger.info("scrapy_idempotent: reading requests from %s", self.broker.describe())
        # the first poll's messages are taken when the broker answers, in a later reactor
        # turn: after every spider_opened handler ran (Scrapy 2.13's OffsiteMiddleware builds
        # its host filter in its own, and refuses nothing before)
        self._poll = task.LoopingCall(self.poll)
        self._poll.start(self.config.poll_seconds, now=True)

    def spider_idle(self, spider: Spider) -> None:
        """Keep an idle crawl open while the queue may bring more work; let it finish after a
        stop message (once everything before it is done) or after
        ``IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS`` with nothing to do (the queue empty or not
        reachable)."""
        if self._messages:
            raise DontCloseSpider  # their requests are still being done (elsewhere)
        if self._stop_ids:
            self._finishing = True
            return
        timeout = self.config.idle_timeout_seconds
        if timeout is not None and self._empty_since is not None \
                and time.monotonic() - self._empty_since >= timeout:
            self._finishing = True  # read nothing more: this crawl is closing
            if self._broker_error is not None:
                logger.error("scrapy_idempotent: %s queue %r could not be reached for %.1f s "
                             "(IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS; %s): closing as %s",
                             self.broker.kind, self.broker.name, timeout, self._broker_error,
                             UNREACHABLE_REASON)
                from ..engine_hooks import close_spider_failed

                close_spider_failed(self.crawler, UNREACHABLE_REASON)
                raise DontCloseSpider  # closed with that reason, not as finished
            logger.info("scrapy_idempotent: the queue had nothing for %.1f s "
                        "(IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS): finishing", timeout)
            return
        raise DontCloseSpider

    async def spider_closed(self, spider: Spider, reason: str) -> None:
        """Stop polling; send the acknowledgements still owed (after every call sent
        before), then close the broker's connection and end its thread. The close waits for
        it."""
        self._closed = True
        if self._poll is not None and self._poll.running:
            self._poll.stop()
        ids, self._unacked = self._unacked, []
        if reason == "finished":
            ids += self._stop_ids  # every stop message read ended this crawl
        if self._messages:
            logger.info("scrapy_idempotent: %d queue message(s) not acknowledged (their "
                        "requests are not done): they will be delivered again",
                        len(self._messages))
        forget_live(self.consumer)
        closing = self._broker_calls(lambda: self._ack_and_close(ids))
        closing.addCallbacks(self._acked, self._ack_failed, errbackArgs=(ids,))
        closing.addBoth(lambda _: self._broker_calls.stop())
        await maybe_deferred_to_future(closing)

    def _ack_and_close(self, ids: list[str]) -> int:
        """On the broker's thread: the last acknowledgements, then the connection is
        closed."""
        try:
            return self.broker.ack(ids) if ids else 0
        finally:
            self.broker.close()

    # -- reading ----------------------------------------------------------------------------

    def poll(self) -> Deferred[Any] | None:
        """One round: acknowledgements that failed, extensions, new messages; the broker
        calls run on the broker's thread, the messages are taken here when they are back
        (the next poll starts after that). Never fails."""
        if self._closed:
            return None
        now = time.monotonic()
        plan = self._plan()
        polling = self._broker_calls(lambda: self._poll_broker(plan))
        polling.addCallback(self._polled, plan, now)
        polling.addErrback(self._poll_failed)
        return polling

    def _plan(self) -> _PollPlan:
        acks, self._unacked = self._unacked, []
        known = frozenset(self._messages) | frozenset(self._stop_ids)
        return _PollPlan(
            acks=acks, extend=list(known), take=not self._finishing,
            room=self.config.prefetch - len(self._messages) if not self._finishing else 0,
            read=not self._finishing and not self._stop_ids, known=known)

    def _poll_broker(self, plan: _PollPlan) -> _Polled:
        """On the broker's thread: the calls of one poll. A broker error ends it early,
        returned with what was got until then (messages taken are this worker's now)."""
        polled = _Polled()
        try:
            polled.acked = self.broker.ack(plan.acks) if plan.acks else 0
            polled.acks_sent = True
            if plan.extend and not self._closed:
                self.broker.extend(plan.extend)
        except Exception as exc:
            polled.error = exc
            return polled
        if plan.take:
            polled.taken = self.broker.take(plan.room, plan.read, plan.known)
        else:
            polled.taken = self.broker.upkeep()
        polled.error = polled.taken.error
        return polled

    def _polled(self, polled: _Polled, plan: _PollPlan, now: float) -> None:
        """On the reactor thread: take the messages one poll brought."""
        taken = polled.taken
        if polled.acked:
            self.stats.inc_value("idempotent/queue/acknowledged", polled.acked)
        elif plan.acks and not polled.acks_sent:
            self._unacked += plan.acks  # not sent: again at the next poll
        if taken.claimed:
            self.stats.inc_value("idempotent/queue/claimed", taken.claimed)
        for message_id in taken.lost:  # delivered again by the broker (a new id)
            message = self._messages.get(message_id)
            if message is not None:
                self._forget(message)
            if message_id in self._stop_ids:
                self._stop_ids.remove(message_id)
        if self._closed:
            return  # read while closing: not acknowledged, so delivered again
        for message_id, fields in taken.entries:
            self._take(message_id, fields)
        if taken.entries or self._messages or taken.settling:
            self._empty_since = None
        elif self._empty_since is None:
            self._empty_since = now  # nothing to do: counts as idle, reachable or not
        if polled.error is not None:
            self._broker_failed(polled.error)
            return
        if now >= self._reconciled_at:
            self._reconciled_at = now + _RECONCILE_AFTER_SECONDS
            self._reconcile(now)
        if self._broker_error is not None:
            logger.info("scrapy_idempotent: %s queue %r reachable again", self.broker.kind,
                        self.broker.name)
            self._broker_error = None

    def _poll_failed(self, failure: Failure) -> None:
        """An error taking the poll's messages on the reactor (the broker calls' own errors
        come back in :class:`_Polled`, its acknowledgements counted already)."""
        logger.error("scrapy_idempotent: queue %r: cannot take the messages read: %s",
                     self.broker.name, failure.getTraceback())

    def _broker_failed(self, exc: BaseException | None) -> None:
        self.stats.inc_value(self.broker.error_stat)
        text = f"{type(exc).__name__}: {exc}"
        if text != self._broker_error:
            self._broker_error = text
            logger.error("scrapy_idempotent: %s queue %r: %s (retried every %.1f s)",
                         self.broker.kind, self.broker.name, text, self.config.poll_seconds)

    def _take(self, message_id: str, fields: Mapping[str, str]) -> None:
        """Feed one message to the crawl, or park it."""
        if message_id in self._messages or message_id in self._stop_ids:
            return
        assert self.spider is not None and self.scheduler is not None
        self.stats.inc_value("idempotent/queue/received")
        logger.debug("scrapy_idempotent: queue message %s read", message_id)
        if set(fields) == {"stop"}:
            self._stop_ids.append(message_id)
            logger.info("scrapy_idempotent: stop message %s read: the crawl finishes once "
                        "the requests of the messages read before it and in its batch are "
                        "done", message_id)
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
        """Park a bad message with its error (the broker's :meth:`~.QueueBroker.park`):
        visible to operators, never lost."""
        self._broker_calls(lambda: self.broker.park(message_id, fields, error)).addCallbacks(
            self._parked, lambda failure: self._broker_failed(failure.value),
            callbackArgs=(message_id, error))

    def _parked(self, _: None, message_id: str, error: str) -> None:
        self.stats.inc_value("idempotent/queue/parked")
        logger.warning("scrapy_idempotent: queue message %s parked in %s: %s", message_id,
                       self.broker.parked_name, error)

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
        """Acknowledge ``ids`` (on the broker's thread, after every call sent before: always
        after the commit that ``request_done`` announced)."""
        if not ids or self._closed:
            return  # (closed: the close acknowledges what is owed)
        acking = self._broker_calls(lambda: self.broker.ack(ids))
        acking.addCallbacks(self._acked, self._ack_failed, errbackArgs=(ids,))

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
