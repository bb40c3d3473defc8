"""All ``IDEMPOTENT_*`` settings, read and validated once into a frozen :class:`IdempotentConfig`.

A wrong value stops the crawl before the first request with a :class:`~.ConfigError` that names
the setting, the value and what is allowed. The settings themselves (defaults and
documentation) are declared in :mod:`.default_settings`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import json
import logging
import os
import re
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from scrapy.exceptions import NotConfigured
from scrapy.utils.conf import closest_scrapy_cfg
from scrapy.utils.project import data_path

from ._kafka_url import redacted_kafka_url
from ._order import QueueOrder
from .config_readers import (
    _DAY,
    _HOUR,
    _MAX_BATCH,
    _WEEK,
    _YEAR,
    _boolean,
    _dedup_redis_url,
    _get,
    _headers,
    _names,
    _number,
    _seconds_or_off,
)
from .default_settings import (
    DEFAULT_URL_IGNORE_PARAMS,
    SETTING_DEFINITIONS,
    SETTING_SECTIONS,
    SETTINGS,
    Setting,
)
from .exceptions import ConfigError
from .scrapy_compat import per_slot_settings
from .store.base import RevisitBounds, RunMode, SlotLimits
from .store.registry import check_driver, sqlite_path

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from scrapy.settings import BaseSettings

__all__ = [
    "DEFAULT_URL_IGNORE_PARAMS",
    "IDENTITY_SETTINGS",
    "SETTINGS",
    "SETTING_DEFINITIONS",
    "SETTING_SECTIONS",
    "IdempotentConfig",
    "QueueConfig",
    "RunMode",
    "Setting",
    "config_for",
    "log_interval_seconds",
    "metrics_listen",
    "resolve_database",
    "store_options",
    "unknown_settings",
]

logger = logging.getLogger(__name__)


#: Scrapy's default queue order (``SCHEDULER_MEMORY_QUEUE`` LIFO, start requests in a FIFO
#: queue of their own).
_SCRAPY_QUEUE_ORDER = QueueOrder(start_queue=True, start_fifo=True, other_fifo=False)
#: The URL schemes of ``IDEMPOTENT_QUEUE_URL``, by broker: a Redis stream (redis-py's
#: ``Redis.from_url``), an SQS queue (``sqs://name``; its ``https://`` queue URL is told by its
#: path, ``/<account>/<name>``), a RabbitMQ queue (pika's ``URLParameters``).
_QUEUE_SCHEMES = {"redis": "redis", "rediss": "redis", "unix": "redis", "sqs": "sqs",
                  "amqp": "amqp", "amqps": "amqp", "kafka": "kafka"}
_BROKER_NAMES = {"redis": "Redis", "sqs": "SQS", "amqp": "RabbitMQ (AMQP)", "kafka": "Kafka"}
#: A Kafka topic name (Kafka's own rule: at most 249 of these characters).
_KAFKA_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
#: The most an SQS long poll may wait (ReceiveMessage's WaitTimeSeconds).
_SQS_LONGEST_WAIT = 20.0


def queue_broker(url: str) -> str | None:
    """The broker an ``IDEMPOTENT_QUEUE_URL`` names ("redis", "sqs", "amqp"), None for
    none."""
    parts = urlsplit(url)
    if parts.scheme in _QUEUE_SCHEMES:
        return _QUEUE_SCHEMES[parts.scheme]
    if parts.scheme in ("https", "http") and parts.netloc \
            and len([p for p in parts.path.split("/") if p]) == 2:
        return "sqs"  # an SQS queue URL: https://sqs.<region>.amazonaws.com/<account>/<name>
    return None


@dataclass(frozen=True)
class QueueConfig:
    """The validated ``IDEMPOTENT_QUEUE_*`` settings: the queue input's (see
    :mod:`.queue_input`)."""

    url: str
    key: str  #: the stream (``{spider}`` replaced)
    group: str
    idle_timeout_seconds: float | None
    claim_idle_seconds: float
    prefetch: int
    poll_seconds: float
    wait_seconds: float = 1.0  #: the longest a read waits for a message (SQS long polling)

    @property
    def parked_key(self) -> str:
        """Where bad messages are parked: ``<key>:parked``; on Kafka the topic
        ``<topic>-parked`` (a topic name has no ``:``)."""
        return f"{self.key}-parked" if self.broker == "kafka" else f"{self.key}:parked"

    @property
    def broker(self) -> str:
        """The broker of :attr:`url`: "redis", "sqs", "amqp" or "kafka"."""
        return queue_broker(self.url) or "redis"

    @property
    def broker_name(self) -> str:
        return _BROKER_NAMES[self.broker]

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> QueueConfig | None:
        """The queue settings of ``crawler`` (:attr:`IdempotentConfig.queue`), None when
        ``IDEMPOTENT_QUEUE_URL`` is not set; :class:`~.ConfigError` naming the setting for a
        bad value."""
        return config_for(crawler).queue


#: Scrapy's defaults: CONCURRENT_REQUESTS_PER_DOMAIN 8, no DOWNLOAD_DELAY, no DOWNLOAD_SLOTS;
#: a dead worker's slots paused for IDEMPOTENT_BACKOFF_SECONDS' default.
_DEFAULT_SLOT_LIMITS = SlotLimits(concurrency=8, dead_worker_pause_seconds=10.0)


@dataclass(frozen=True)
class IdempotentConfig:
    """The validated ``IDEMPOTENT_*`` settings of one crawl. Field names carry units."""

    #: the database string: an absolute file path (SQLite), or another backend's URL
    database: str
    lease_seconds: float
    lease_batch: int
    run_mode: RunMode
    natural_keys: dict[str, tuple[str, ...]]
    source: str
    record_types: dict[str, str]
    record_id_field: str | None
    volatile_fields: frozenset[str]
    url_ignore_params: tuple[str, ...]
    max_attempts: int
    synchronous: str
    busy_timeout_seconds: float
    request_classes: tuple[str, ...]
    log_interval_seconds: float
    sample_seconds: float = 60.0
    #: where the process serves its own figures (IDEMPOTENT_METRICS_LISTEN); None: nowhere
    metrics_listen: tuple[str, int] | None = None
    recrawl_seconds: float | None = None
    response_journal: bool = True
    #: IDEMPOTENT_CONDITIONAL_REQUESTS: requests sent with their page's validators
    conditional_requests: bool = False
    #: IDEMPOTENT_SITEMAP_LASTMOD: a sitemap's lastmod skips pages not changed since fetched
    sitemap_lastmod: bool = True
    #: IDEMPOTENT_ADAPTIVE_REVISIT and its bounds: each page's own revisit interval (None: off)
    revisit: RevisitBounds | None = None
    keep_cookies: bool = True
    feed_streaming: bool = True
    #: IDEMPOTENT_GC_FREEZE: start-up's objects frozen while the crawl runs (:mod:`.gc_freeze`)
    gc_freeze: bool = True
    #: delivery targets of record changes: webhook URLs and import paths of target classes
    outbox_targets: tuple[str, ...] = ()
    outbox_headers: tuple[tuple[str, str], ...] = ()
    outbox_concurrency: int = 8
    outbox_timeout_seconds: float = 30.0
    outbox_retry_seconds: float = 1.0
    outbox_retry_max_seconds: float = 300.0
    outbox_drain_seconds: float = 30.0
    #: the queue input's settings; None without ``IDEMPOTENT_QUEUE_URL``
    queue: QueueConfig | None = None
    #: IDEMPOTENT_DEDUP_REDIS_URL: the Redis of the duplicate check's fast layer (None: off)
    dedup_redis_url: str | None = None
    #: Scrapy's settings the frontier follows: ``HTTPERROR_ALLOW_ALL`` and
    #: ``HTTPERROR_ALLOWED_CODES`` (which responses reach their callback) ...
    httperror_allow_all: bool = False
    httperror_allowed_codes: tuple[int, ...] = ()
    #: ... and ``SCHEDULER_MEMORY_QUEUE`` / ``SCHEDULER_START_MEMORY_QUEUE`` (the queue order)
    queue_order: QueueOrder = _SCRAPY_QUEUE_ORDER
    #: IDEMPOTENT_POLITENESS: ``crawl`` (limits kept by the claims) or ``worker``
    politeness: str = "crawl"
    #: the per-slot limits from Scrapy's settings (see :func:`slot_limits`)
    slot_limits: SlotLimits = _DEFAULT_SLOT_LIMITS
    backoff_seconds: float = 10.0
    backoff_max_seconds: float = 600.0
    #: IDEMPOTENT_ROBOTSTXT_MAX_AGE_SECONDS: how long a kept robots.txt is obeyed
    robotstxt_max_age_seconds: float = 86400.0

    def store_options(self) -> dict[str, Any]:
        """The keyword options of :func:`~.store.open_store` these settings give (see
        :func:`store_options`)."""
        return {name: getattr(self, name) for name in _STORE_OPTIONS}

    @classmethod
    def from_settings(cls, settings: BaseSettings, spider: Spider) -> IdempotentConfig:
        """Read every ``IDEMPOTENT_*`` setting, and the Scrapy settings the frontier follows;
        the spider's ``idempotent_natural_keys`` attribute (same shape as
        ``IDEMPOTENT_NATURAL_KEYS``) overrides entries of the setting.

        Raises :class:`~.ConfigError` naming the first bad setting.
        """
        identity = _identity(settings, spider)
        run_mode = _run_mode(settings)
        database = _database(_get(settings, "IDEMPOTENT_DATABASE"), spider.name)
        return cls(
            database=database,
            dedup_redis_url=_dedup_redis_url(settings, database),
            **store_options(settings),
            **identity,
            lease_batch=_lease_batch(settings),
            run_mode=run_mode,
            request_classes=_request_classes(settings),
            log_interval_seconds=log_interval_seconds(settings),
            sample_seconds=_sample_seconds(settings),
            metrics_listen=metrics_listen(settings),
            response_journal=_boolean(settings, "IDEMPOTENT_RESPONSE_JOURNAL"),
            conditional_requests=_boolean(settings, "IDEMPOTENT_CONDITIONAL_REQUESTS"),
            sitemap_lastmod=_boolean(settings, "IDEMPOTENT_SITEMAP_LASTMOD"),
            revisit=_revisit(settings),
            keep_cookies=_boolean(settings, "IDEMPOTENT_KEEP_COOKIES"),
            feed_streaming=_boolean(settings, "IDEMPOTENT_FEED_STREAMING"),
            gc_freeze=_boolean(settings, "IDEMPOTENT_GC_FREEZE"),
            **_outbox(settings),
            queue=_queue(settings, spider.name),
            **_scrapy_rules(settings),
            **_politeness(settings),
        )


def _revisit(settings: BaseSettings) -> RevisitBounds | None:
    """IDEMPOTENT_ADAPTIVE_REVISIT and its bounds (validated even when it is off)."""
    shortest = _number(settings, "IDEMPOTENT_REVISIT_MIN_SECONDS", minimum=1.0,
                       maximum=10 * _YEAR)
    longest = _number(settings, "IDEMPOTENT_REVISIT_MAX_SECONDS", minimum=1.0,
                      maximum=10 * _YEAR)
    if longest < shortest:
        raise ConfigError("IDEMPOTENT_REVISIT_MAX_SECONDS",
                          _get(settings, "IDEMPOTENT_REVISIT_MAX_SECONDS"),
                          "at least IDEMPOTENT_REVISIT_MIN_SECONDS")
    if not _boolean(settings, "IDEMPOTENT_ADAPTIVE_REVISIT"):
        return None
    if not _boolean(settings, "IDEMPOTENT_CONDITIONAL_REQUESTS"):
        raise ConfigError("IDEMPOTENT_ADAPTIVE_REVISIT",
                          _get(settings, "IDEMPOTENT_ADAPTIVE_REVISIT"),
                          "False unless IDEMPOTENT_CONDITIONAL_REQUESTS is True (a page not "
                          "due is answered from what its conditional request kept)")
    return RevisitBounds(shortest, longest)


def _lease_batch(settings: BaseSettings) -> int:
    """IDEMPOTENT_LEASE_BATCH; ``None`` (the default): ``CONCURRENT_REQUESTS``, at least 8."""
    if settings.get("IDEMPOTENT_LEASE_BATCH") not in (None, ""):
        return int(_number(settings, "IDEMPOTENT_LEASE_BATCH", minimum=1, maximum=_MAX_BATCH,
                           integer=True))
    try:
        concurrency = settings.getint("CONCURRENT_REQUESTS", 16)
    except (TypeError, ValueError):
        raise ConfigError("CONCURRENT_REQUESTS", settings.get("CONCURRENT_REQUESTS"),
                          "an integer (IDEMPOTENT_LEASE_BATCH follows it when None)") from None
    return max(8, min(concurrency, _MAX_BATCH))


def _identity(settings: BaseSettings, spider: Spider) -> dict[str, Any]:
    """The record identity: ``natural_keys`` (the spider's ``idempotent_natural_keys`` over
    ``IDEMPOTENT_NATURAL_KEYS``), ``source``, ``record_id_field``, ``volatile_fields`` and
    ``url_ignore_params``."""
    natural_keys = _natural_keys("IDEMPOTENT_NATURAL_KEYS",
                                 _get(settings, "IDEMPOTENT_NATURAL_KEYS"))
    _check_declared_fields("IDEMPOTENT_NATURAL_KEYS", natural_keys)
    override = getattr(spider, "idempotent_natural_keys", None)
    if override is not None:
        natural_keys.update(_natural_keys(f"{type(spider).__name__}.idempotent_natural_keys",
                                          override))
    source = _get(settings, "IDEMPOTENT_SOURCE")
    if source is None:
        source = spider.name
    if not isinstance(source, str) or not source.strip():
        raise ConfigError("IDEMPOTENT_SOURCE", source,
                          "a non-empty string (default: the spider name)")
    record_id_field = _record_id_field(settings)
    for item_type, fields in natural_keys.items():
        if record_id_field is not None and record_id_field in fields:
            # the stamped record ID would replace the key field in the stored data and feeds
            raise ConfigError("IDEMPOTENT_RECORD_ID_FIELD", record_id_field,
                              f"a field that is no natural key field ({item_type} is keyed"
                              f" by {', '.join(fields)}), or None/'' to keep items unchanged")
    return {
        "natural_keys": natural_keys,
        "record_types": _record_types(_get(settings, "IDEMPOTENT_RECORD_TYPES")),
        "source": source,
        "record_id_field": record_id_field,
        "volatile_fields": frozenset(_names(settings, "IDEMPOTENT_VOLATILE_FIELDS")),
        "url_ignore_params": tuple(_names(settings, "IDEMPOTENT_URL_IGNORE_PARAMS")),
    }


def _record_id_field(settings: BaseSettings) -> str | None:
    # settings.get() answers the default for a None value: read the raw value, so an
    # explicit None turns stamping off as "" does
    name = "IDEMPOTENT_RECORD_ID_FIELD"
    record_id_field = settings[name] if name in settings else SETTINGS[name]
    if record_id_field in (None, ""):
        return None
    if not isinstance(record_id_field, str):
        raise ConfigError(name, record_id_field,
                          "a field name, or None/'' to keep items unchanged")
    return record_id_field


def _run_mode(settings: BaseSettings) -> RunMode:
    raw = _get(settings, "IDEMPOTENT_RUN_MODE")
    try:
        return RunMode(raw)
    except (ValueError, TypeError):
        raise ConfigError("IDEMPOTENT_RUN_MODE", raw,
                          f"one of {', '.join(mode.value for mode in RunMode)}") from None


def _outbox(settings: BaseSettings) -> dict[str, Any]:
    """The ``IDEMPOTENT_OUTBOX_*`` settings, as the ``outbox_*`` fields."""
    return {
        "outbox_targets": _outbox_targets(settings),
        "outbox_headers": _headers(settings, "IDEMPOTENT_OUTBOX_HEADERS"),
        "outbox_concurrency": int(_number(settings, "IDEMPOTENT_OUTBOX_CONCURRENCY",
                                          minimum=1, maximum=_MAX_BATCH, integer=True)),
        "outbox_timeout_seconds": _number(settings, "IDEMPOTENT_OUTBOX_TIMEOUT_SECONDS",
                                          minimum=0.1, maximum=_HOUR),
        "outbox_retry_seconds": _number(settings, "IDEMPOTENT_OUTBOX_RETRY_SECONDS",
                                        minimum=0.0, maximum=_DAY),
        "outbox_retry_max_seconds": _number(settings, "IDEMPOTENT_OUTBOX_RETRY_MAX_SECONDS",
                                            minimum=0.0, maximum=_WEEK),
        "outbox_drain_seconds": _number(settings, "IDEMPOTENT_OUTBOX_DRAIN_SECONDS",
                                        minimum=0.0, maximum=_DAY),
    }


def _queue(settings: BaseSettings, spider_name: str) -> QueueConfig | None:
    """The ``IDEMPOTENT_QUEUE_*`` settings; None without ``IDEMPOTENT_QUEUE_URL`` (the others
    are then not read)."""
    url = _get(settings, "IDEMPOTENT_QUEUE_URL")
    if url in (None, ""):
        return None
    if not isinstance(url, str) or queue_broker(url) is None:
        raise ConfigError("IDEMPOTENT_QUEUE_URL", url,
                          "a Redis URL (redis://host:port/db, rediss://... or unix://...), "
                          "an SQS queue (sqs://name, or the queue's https:// URL), a "
                          "RabbitMQ URL (amqp://user:password@host:port/vhost, amqps://...) "
                          "or a Kafka URL (kafka://host:port,host2:port/topic)")
    key = _get(settings, "IDEMPOTENT_QUEUE_KEY")
    if queue_broker(url) == "kafka":
        key = _kafka_topic(url, key)
    elif key in (None, ""):
        key = "{spider}:requests"
    elif not isinstance(key, str) or not key.strip():
        raise ConfigError("IDEMPOTENT_QUEUE_KEY", key,
                          "a Redis key (or the queue's name), not blank (may contain "
                          "{spider})")
    group = _get(settings, "IDEMPOTENT_QUEUE_GROUP")
    if not isinstance(group, str) or not group.strip():
        raise ConfigError("IDEMPOTENT_QUEUE_GROUP", group, "a non-empty consumer group name")
    idle_timeout = _get(settings, "IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS")
    return QueueConfig(
        url=url,
        key=key.replace("{spider}", spider_name),
        group=group,
        idle_timeout_seconds=None if idle_timeout in (None, "") else _number(
            settings, "IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS", minimum=0.0, maximum=_YEAR),
        claim_idle_seconds=_number(settings, "IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS",
                                   minimum=1.0, maximum=_WEEK),
        prefetch=int(_number(settings, "IDEMPOTENT_QUEUE_PREFETCH", minimum=1,
                             maximum=_MAX_BATCH, integer=True)),
        poll_seconds=_number(settings, "IDEMPOTENT_QUEUE_POLL_SECONDS", minimum=0.01,
                             maximum=60.0),
        wait_seconds=_queue_wait(settings),
    )


def _kafka_topic(url: str, key: object) -> str:
    """The topic of a ``kafka://`` URL: its path, else ``IDEMPOTENT_QUEUE_KEY``, else
    ``{spider}-requests`` (``{spider}`` replaced by the caller). A URL without bootstrap
    servers, or a topic name Kafka refuses, is a :class:`~.ConfigError`."""
    parts = urlsplit(url)
    if not parts.netloc.rpartition("@")[2]:
        raise ConfigError("IDEMPOTENT_QUEUE_URL", redacted_kafka_url(url),
                          "a Kafka URL names its bootstrap servers: "
                          "kafka://host:port,host2:port/topic")
    topic: object = parts.path.strip("/")
    setting = "IDEMPOTENT_QUEUE_URL"
    if not topic:
        if key in (None, ""):
            return "{spider}-requests"
        setting, topic = "IDEMPOTENT_QUEUE_KEY", key
    if not isinstance(topic, str) or not _KAFKA_TOPIC.match(topic.replace("{spider}", "x")):
        raise ConfigError(setting, redacted_kafka_url(url) if setting.endswith("URL") else topic,
                          "a Kafka topic name: 1 to 249 letters, digits, '.', '_' or '-' (may "
                          "contain {spider})")
    return topic


def _queue_wait(settings: BaseSettings) -> float:
    return _number(settings, "IDEMPOTENT_QUEUE_WAIT_SECONDS", minimum=0.0,
                   maximum=_SQS_LONGEST_WAIT)


def _scrapy_rules(settings: BaseSettings) -> dict[str, Any]:
    """The Scrapy settings the frontier follows as Scrapy does: which responses reach their
    callback (``HTTPERROR_ALLOW_ALL``, ``HTTPERROR_ALLOWED_CODES``, as ``HttpErrorMiddleware``
    reads them) and the queue order (``SCHEDULER_MEMORY_QUEUE``,
    ``SCHEDULER_START_MEMORY_QUEUE``). Refuses Scrapy's reactorless mode
    (:func:`_check_reactor`)."""
    _check_reactor(settings)
    try:
        allow_all = settings.getbool("HTTPERROR_ALLOW_ALL")
    except ValueError:
        raise ConfigError("HTTPERROR_ALLOW_ALL", settings.get("HTTPERROR_ALLOW_ALL"),
                          "a boolean: True or False") from None
    codes = settings.getlist("HTTPERROR_ALLOWED_CODES")
    try:
        allowed = tuple(int(code) for code in codes)
    except (TypeError, ValueError):
        raise ConfigError("HTTPERROR_ALLOWED_CODES", settings.get("HTTPERROR_ALLOWED_CODES"),
                          "a list of HTTP status codes (integers)") from None
    return {"httperror_allow_all": allow_all, "httperror_allowed_codes": allowed,
            "queue_order": QueueOrder.from_settings(settings)}


def _check_reactor(settings: BaseSettings) -> None:
    """``TWISTED_REACTOR_ENABLED = False`` (Scrapy 2.15+: the crawl runs on asyncio alone) is
    refused: the frontier's writer thread hands its results to Twisted's reactor
    (``callFromThread``), and the lease renewals, the streamed feeds and the engine wake-ups
    are reactor timers, so such a crawl would open the database and then crash. The setting
    is read as Scrapy reads it (absent before 2.15: the reactor is on)."""
    try:
        enabled = settings.getbool("TWISTED_REACTOR_ENABLED", True)
    except ValueError:
        enabled = True  # Scrapy refuses the value itself
    if not enabled:
        raise ConfigError("TWISTED_REACTOR_ENABLED", settings.get("TWISTED_REACTOR_ENABLED"),
                          "True (the default): scrapy_idempotent needs Twisted's reactor "
                          "and does not run in Scrapy's reactorless mode")


def _politeness(settings: BaseSettings) -> dict[str, Any]:
    """``IDEMPOTENT_POLITENESS``, the backoff settings, and the per-slot limits of Scrapy's
    settings (``CONCURRENT_REQUESTS_PER_DOMAIN``/``_PER_IP``, ``DOWNLOAD_DELAY``,
    ``DOWNLOAD_SLOTS``)."""
    mode = str(_get(settings, "IDEMPOTENT_POLITENESS")).lower()
    if mode not in ("crawl", "worker"):
        raise ConfigError("IDEMPOTENT_POLITENESS", _get(settings, "IDEMPOTENT_POLITENESS"),
                          "'crawl' or 'worker'")
    first = _number(settings, "IDEMPOTENT_BACKOFF_SECONDS", minimum=0.1, maximum=_DAY)
    most = _number(settings, "IDEMPOTENT_BACKOFF_MAX_SECONDS", minimum=0.1, maximum=_WEEK)
    if most < first:
        raise ConfigError("IDEMPOTENT_BACKOFF_MAX_SECONDS",
                          _get(settings, "IDEMPOTENT_BACKOFF_MAX_SECONDS"),
                          "at least IDEMPOTENT_BACKOFF_SECONDS")
    try:
        limits = slot_limits(settings)
    except (TypeError, ValueError, AttributeError):
        raise ConfigError("DOWNLOAD_SLOTS", settings.get("DOWNLOAD_SLOTS"),
                          "a dict of slot -> dict with numbers for concurrency and delay"
                          ) from None
    if mode == "crawl" and (limits.concurrency < 1 or any(
            c is not None and c < 1 for _, c, _ in limits.per_slot)):
        raise ConfigError("CONCURRENT_REQUESTS_PER_DOMAIN",
                          settings.get("CONCURRENT_REQUESTS_PER_DOMAIN"),
                          "at least 1 for every download slot (with IDEMPOTENT_POLITENESS "
                          "'crawl')")
    # a dead worker's slots are paused as if they had answered 429 (the first backoff)
    limits = dataclasses.replace(limits, dead_worker_pause_seconds=first)
    return {"politeness": mode, "slot_limits": limits, "backoff_seconds": first,
            "backoff_max_seconds": most,
            "robotstxt_max_age_seconds": _number(
                settings, "IDEMPOTENT_ROBOTSTXT_MAX_AGE_SECONDS", minimum=1, maximum=_YEAR)}


def slot_limits(settings: BaseSettings) -> SlotLimits:
    """The crawl's per-slot limits from Scrapy's settings, as the downloader reads them
    (scrapy/core/downloader/__init__.py, ``Downloader._get_slot``): the concurrency is
    ``CONCURRENT_REQUESTS_PER_IP`` when set, else ``CONCURRENT_REQUESTS_PER_DOMAIN``; the
    delay ``DOWNLOAD_DELAY``; ``DOWNLOAD_SLOTS`` entries' ``concurrency`` and ``delay``,
    and ``THROTTLING_SCOPES`` entries' where the installed Scrapy has that setting
    (:func:`.scrapy_compat.per_slot_settings`)."""
    per_slot: list[tuple[str, int | None, float | None]] = []
    for slot, given in sorted(per_slot_settings(settings).items()):
        concurrency = given.get("concurrency")
        delay = given.get("delay")
        per_slot.append((str(slot), int(concurrency) if concurrency is not None else None,
                         float(delay) if delay is not None else None))
    return SlotLimits(
        concurrency=(settings.getint("CONCURRENT_REQUESTS_PER_IP")
                     or settings.getint("CONCURRENT_REQUESTS_PER_DOMAIN")),
        delay_seconds=settings.getfloat("DOWNLOAD_DELAY"),
        per_slot=tuple(per_slot))


def log_interval_seconds(settings: BaseSettings) -> float:
    """``IDEMPOTENT_LOG_INTERVAL_SECONDS`` (validated): read without a spider, as the progress
    extension is built for any crawler."""
    return _seconds_or_off(settings, "IDEMPOTENT_LOG_INTERVAL_SECONDS", 0.1,
                           "0 (no progress line)")


def metrics_listen(settings: BaseSettings) -> tuple[str, int] | None:
    """``IDEMPOTENT_METRICS_LISTEN`` (validated) as a host and a port; None when not set."""
    name = "IDEMPOTENT_METRICS_LISTEN"
    value = _get(settings, name)
    if value in (None, ""):
        return None
    host, sep, port = str(value).rpartition(":")
    host = host.strip("[]")
    if not isinstance(value, str) or not sep or not host or not port.isdigit() \
            or int(port) > 65535:
        raise ConfigError(name, value, "HOST:PORT, e.g. 127.0.0.1:9811 (port 0: any free one)")
    return host, int(port)


def _sample_seconds(settings: BaseSettings) -> float:
    return _seconds_or_off(settings, "IDEMPOTENT_SAMPLE_SECONDS", 1, "0 (no samples)")


#: The fields of :class:`IdempotentConfig` that are options of the store.
_STORE_OPTIONS = ("lease_seconds", "max_attempts", "synchronous", "busy_timeout_seconds",
                  "recrawl_seconds")


def store_options(settings: BaseSettings) -> dict[str, Any]:
    """The keyword options of :func:`~.store.open_store` that ``settings`` give (validated):
    ``lease_seconds``, ``max_attempts``, ``synchronous``, ``busy_timeout_seconds`` and
    ``recrawl_seconds``, as :class:`IdempotentConfig` holds them. Raises
    :class:`~.ConfigError` naming the first bad setting."""
    given = settings.get("IDEMPOTENT_SYNCHRONOUS")
    if given in (None, ""):
        # a webhook or a queue acknowledgement announces a commit to another system: the
        # commit must not be lost afterwards, even to power loss
        given = "FULL" if _tells_others(settings) else SETTINGS["IDEMPOTENT_SYNCHRONOUS"]
    synchronous = str(given)
    if synchronous.upper() not in ("NORMAL", "FULL"):
        raise ConfigError("IDEMPOTENT_SYNCHRONOUS", settings.get("IDEMPOTENT_SYNCHRONOUS"),
                          "'NORMAL' (survives a process kill) or 'FULL' (also power loss)")
    return {
        "lease_seconds": _number(settings, "IDEMPOTENT_LEASE_SECONDS", minimum=1.0,
                                 maximum=_WEEK),
        "max_attempts": int(_number(settings, "IDEMPOTENT_MAX_ATTEMPTS", minimum=1,
                                    maximum=_MAX_BATCH, integer=True)),
        "synchronous": synchronous.upper(),
        "busy_timeout_seconds": _number(settings, "IDEMPOTENT_BUSY_TIMEOUT_SECONDS",
                                        minimum=0.0, maximum=_HOUR),
        "recrawl_seconds": (
            None if settings.get("IDEMPOTENT_RECRAWL_SECONDS") in (None, "")
            else _number(settings, "IDEMPOTENT_RECRAWL_SECONDS", minimum=1.0,
                         maximum=10 * _YEAR)
        ),
    }


def _tells_others(settings: BaseSettings) -> bool:
    """Whether a commit of the crawl is announced to another system once done: outbox
    deliveries (``IDEMPOTENT_OUTBOX_TARGETS``) or queue acknowledgements
    (``IDEMPOTENT_QUEUE_URL``). ``IDEMPOTENT_SYNCHRONOUS`` is then ``FULL`` unless set."""
    targets = settings.get("IDEMPOTENT_OUTBOX_TARGETS")
    if isinstance(targets, str):
        targets = targets.split(",")
    return bool(settings.get("IDEMPOTENT_QUEUE_URL")) or any(
        str(target).strip() for target in targets or ())


#: The config of each crawler, read once (again only when the spider object it was read
#: for changes: the spider class before the spider exists, then the spider).
_CONFIGS: weakref.WeakKeyDictionary[Crawler, tuple[Any, IdempotentConfig]] = (
    weakref.WeakKeyDictionary())
#: Crawlers whose setting names were checked and whose bad setting was reported.
_REPORTED: weakref.WeakKeyDictionary[Crawler, set[str]] = weakref.WeakKeyDictionary()


def config_for(crawler: Crawler) -> IdempotentConfig:
    """The validated config of ``crawler``'s spider (every component reads it through here),
    read once per crawler and spider and shared.

    The first call per crawler warns about unknown ``IDEMPOTENT_*`` names (with the nearest
    known one). A bad value is logged once as one CRITICAL line naming the setting, the value
    and what is allowed, and the :class:`~.ConfigError` is raised: the crawl does not start
    and ``scrapy crawl`` exits with code 1. The error is marked as handled for asyncio, so no
    "Task exception was never retrieved" traceback follows the line.
    """
    reported = _REPORTED.setdefault(crawler, set())
    misspelt_identity: ConfigError | None = None
    spider: Any = crawler.spider if crawler.spider is not None else crawler.spidercls
    cached = _CONFIGS.get(crawler)
    if cached is not None and cached[0] is spider:
        return cached[1]
    for name, nearest in unknown_settings(crawler.settings).items():
        if nearest in IDENTITY_SETTINGS:
            misspelt_identity = misspelt_identity or ConfigError(
                name, crawler.settings[name],
                f"no such setting: did you mean {nearest}? (a misspelt setting that decides "
                "record identity would store every record under another ID)")
        elif "names" not in reported:
            logger.warning("Unknown setting %s ignored%s", name,
                           f": did you mean {nearest}?" if nearest else "")
    reported.add("names")
    try:
        if misspelt_identity is not None:
            raise misspelt_identity
        config = IdempotentConfig.from_settings(crawler.settings, spider)
    except ConfigError as exc:
        if "error" not in reported:
            reported.add("error")
            logger.critical("scrapy_idempotent: %s; the crawl was not started", exc)
            _quiet_task_exception()
        exc.reported = True
        raise
    _CONFIGS[crawler] = (spider, config)
    return config


def _quiet_task_exception() -> None:
    """Mark the exception the current asyncio task is about to end with as retrieved: it was
    reported (one CRITICAL line) and Scrapy sets the exit code from it."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running event loop
        return
    if task is not None:
        task.add_done_callback(lambda t: None if t.cancelled() else t.exception())


#: The settings that decide record identity: a misspelt name near one of them stops the
#: crawl (the others are warned about).
IDENTITY_SETTINGS = frozenset(
    setting.name for setting in SETTING_DEFINITIONS if setting.section == "Record identity")


def unknown_settings(settings: BaseSettings) -> dict[str, str | None]:
    """Setting names that look like this package's but are not (``IDEMPOTENT_NATURAL_KEY``,
    ``IDEMPOTNET_LEASE_SECONDS``, ``idempotent_lease_seconds``), each with the nearest known
    name (None if none is near)."""
    unknown: dict[str, str | None] = {}
    for name in settings:
        if not isinstance(name, str) or name in SETTINGS:
            continue
        # Scrapy's setting names are upper case: idempotent_lease_seconds is not read either
        upper = name.upper()
        prefix = upper.split("_", 1)[0]
        if not (upper.startswith("IDEMPOTENT_")
                or difflib.SequenceMatcher(None, prefix, "IDEMPOTENT").ratio() >= 0.8):
            continue
        nearest = difflib.get_close_matches(upper, SETTINGS, n=1, cutoff=0.6)
        unknown[name] = nearest[0] if nearest else None
    return unknown


def _request_classes(settings: BaseSettings) -> tuple[str, ...]:
    """``IDEMPOTENT_REQUEST_CLASSES``: import paths of ``scrapy.Request`` subclasses, each
    imported and checked now (a typo, or a path naming something else, is refused at start
    rather than when a request of that class is first stored)."""
    from scrapy import Request
    from scrapy.utils.misc import load_object

    name = "IDEMPOTENT_REQUEST_CLASSES"
    paths = _names(settings, name)
    for path in paths:
        try:
            loaded = load_object(path)
        except (ImportError, AttributeError, NameError, ValueError) as exc:
            raise ConfigError(name, path, f"the import path of a scrapy.Request subclass "
                                          f"({exc})") from None
        if not (isinstance(loaded, type) and issubclass(loaded, Request)):
            raise ConfigError(name, path, f"the import path of a scrapy.Request subclass, "
                                          f"not {loaded!r}")
    return tuple(paths)


def _outbox_targets(settings: BaseSettings) -> tuple[str, ...]:
    """Webhook URLs (``http://``, ``https://``) and import paths of target classes, each
    checked now: a URL must have a host, a class path must import."""
    from urllib.parse import urlsplit

    from scrapy.utils.misc import load_object

    name = "IDEMPOTENT_OUTBOX_TARGETS"
    targets = _names(settings, name)
    for target in targets:
        if target.startswith(("http://", "https://")):
            if not urlsplit(target).hostname:
                raise ConfigError(name, target, "a webhook URL with a host name")
            continue
        if "://" in target:
            raise ConfigError(name, target, "an http:// or https:// webhook URL, or the "
                                            "import path of an outbox target class")
        try:
            load_object(target)
        except (ImportError, AttributeError, NameError, ValueError) as exc:
            raise ConfigError(name, target, "an http:// or https:// webhook URL, or the "
                                            f"import path of an outbox target class ({exc})"
                              ) from None
    if len(set(targets)) != len(targets):
        raise ConfigError(name, targets, "distinct targets (each one is delivered to once)")
    return tuple(targets)


def _by_item_class(name: str, given: Any, allowed: str) -> dict[Any, Any]:
    """A setting mapping item classes to something: a dict (or its JSON text, as ``-s``
    gives it) whose class keys are given as ``module.QualName``; raises
    :class:`~.ConfigError` for anything else."""
    raw = given
    if isinstance(raw, str):  # a JSON string given with -s
        try:
            raw = json.loads(raw)
        except ValueError:
            raise ConfigError(name, given, allowed) from None
    if not isinstance(raw, dict):
        raise ConfigError(name, given, allowed)
    return {f"{key.__module__}.{key.__qualname__}" if isinstance(key, type) else key: value
            for key, value in raw.items()}


def _natural_keys(name: str, given: Any) -> dict[str, tuple[str, ...]]:
    allowed = ("a dict mapping an item class ('module.Class', 'Class' or '*') to a field name "
               "or a list of field names")
    result: dict[str, tuple[str, ...]] = {}
    for item_type, fields in _by_item_class(name, given, allowed).items():
        if isinstance(fields, str):
            fields = (fields,)
        if (
            not isinstance(item_type, str)
            or not item_type
            or not isinstance(fields, (list, tuple))
            or not fields
            or not all(isinstance(f, str) and f for f in fields)
        ):
            raise ConfigError(name, given, allowed)
        result[item_type] = tuple(fields)
    return result


def _record_types(given: Any) -> dict[str, str]:
    name = "IDEMPOTENT_RECORD_TYPES"
    allowed = ("a dict mapping an item class ('module.Class' or 'Class') to the record type "
               "its records are identified by (a non-empty string, e.g. its former "
               "'module.Class')")
    result: dict[str, str] = {}
    for item_type, record_type in _by_item_class(name, given, allowed).items():
        if not (isinstance(item_type, str) and item_type and item_type != "*"
                and isinstance(record_type, str) and record_type.strip()):
            raise ConfigError(name, given, allowed)
        result[item_type] = record_type
    return result


def _check_declared_fields(name: str, natural_keys: dict[str, tuple[str, ...]]) -> None:
    """A ``module.Class`` entry must import, and a key field must be declared by a class that
    declares its fields (``scrapy.Item``, dataclass, attrs, pydantic): a typo would otherwise
    drop every item, or key them all by page URL, in silence."""
    from itemadapter import ItemAdapter
    from scrapy.utils.misc import load_object

    for path, fields in natural_keys.items():
        if "." not in path:
            continue  # a bare class name or '*': checked when items arrive
        try:
            cls = load_object(path)
        except (ImportError, AttributeError, NameError, ValueError) as exc:
            raise ConfigError(name, {path: list(fields)},
                              f"an importable item class; {path!r}: {exc}") from None
        try:
            declared = ItemAdapter.get_field_names_from_class(cls)
        except TypeError:  # not an item class itself: its instances may still be items
            declared = None
        missing = [f for f in fields if declared is not None and f not in declared]
        if missing:
            raise ConfigError(name, {path: list(fields)},
                              f"fields that {path} declares ({', '.join(sorted(declared or []))}"
                              f"); not {', '.join(missing)}")


def file_name_part(name: str) -> str:
    """``name`` (a spider's) made safe to put into a file name: path separators and NUL
    become ``_``, and so do leading dots (no ``..``, no hidden file). A usual spider name
    (letters, digits, ``_-.``) is left as it is."""
    safe = re.sub(r"[/\\\x00]", "_", name)
    safe = re.sub(r"^\.+", lambda dots: "_" * len(dots.group()), safe)
    return safe or "_"


def resolve_database(raw: Any, spider_name: str) -> str:
    """The database string of ``IDEMPOTENT_DATABASE`` or of the commands' ``--db``, by one
    rule: a path (or ``sqlite:///PATH``) as an absolute path, a relative one taken from the
    project directory (where ``scrapy.cfg`` is, found from the current directory upwards),
    else from the current directory; another backend's URL as given; ``{spider}`` replaced
    in either. Raises :class:`~.ConfigError` naming ``IDEMPOTENT_DATABASE``."""
    return _database(raw, spider_name)


def _database(raw: Any, spider_name: str) -> str:
    """See :func:`resolve_database` (``raw`` None or empty: the default path)."""
    if raw is None or raw == "":
        try:
            return data_path(os.path.join("idempotent",
                                          f"{file_name_part(spider_name)}.sqlite3"))
        except NotConfigured:
            # Scrapy knows a project (SCRAPY_SETTINGS_MODULE) but finds no scrapy.cfg to put
            # its .scrapy data dir next to: the usual case of a job run by scrapyd.
            raise ConfigError(
                "IDEMPOTENT_DATABASE", raw,
                "an absolute file path; the default (.scrapy/idempotent/<spider>.sqlite3 in "
                "the project) needs a scrapy.cfg, and none was found (as when scrapyd runs a "
                "deployed egg)",
            ) from None
    if not isinstance(raw, (str, os.PathLike)):
        raise ConfigError("IDEMPOTENT_DATABASE", raw,
                          "a file path (may contain {spider}) or a database URL")
    given = os.fspath(raw)
    if "\x00" in given:
        raise ConfigError("IDEMPOTENT_DATABASE", raw,
                          "a file path (may contain {spider}) or a database URL, without a NUL "
                          "character")
    database = given.replace("{spider}", spider_name)
    path = sqlite_path(database)  # raises for a scheme no backend is registered for
    if path is None:
        check_driver(database)  # a missing driver: one line naming the extra to install
        return database  # another backend's URL
    # in a file path, the spider name is one file name: it cannot climb out of the folder
    path = sqlite_path(given.replace("{spider}", file_name_part(spider_name)))
    assert path is not None
    path = os.path.expanduser(path)
    if not os.path.isabs(path):
        # like Scrapy's .scrapy paths: relative to the project (where scrapy.cfg is), so a
        # crawl started from a subdirectory finds the same frontier; else the current one
        config_file = closest_scrapy_cfg()
        path = os.path.join(os.path.dirname(config_file) if config_file else os.getcwd(),
                            path)
    return os.path.normpath(path)
