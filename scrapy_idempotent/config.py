"""All ``IDEMPOTENT_*`` settings, read and validated once into a frozen :class:`IdempotentConfig`.

A wrong value stops the crawl before the first request with a :class:`~.ConfigError` that names
the setting, the value and what is allowed.
"""

from __future__ import annotations

import asyncio
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
from .exceptions import ConfigError
from .store.base import RunMode, SlotLimits
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

#: Query parameters ignored when a page URL serves as a natural key: analytics and session
#: ids. Matching is by exact name, or by prefix for names ending in ``*``.
DEFAULT_URL_IGNORE_PARAMS: tuple[str, ...] = (
    "utm_*",
    "fbclid",
    "gclid",
    "dclid",
    "msclkid",
    "mc_cid",
    "mc_eid",
    "ref",
    "sid",
    "sessionid",
    "session_id",
    "phpsessid",
    "jsessionid",
)


@dataclass(frozen=True)
class Setting:
    """One setting's definition: its default and its documentation.

    The docs' settings reference is generated from :data:`SETTING_DEFINITIONS` (``docs/_ext``),
    so a setting exists exactly when it is documented. ``doc`` is reStructuredText (it may use
    the ``:setting:`` and ``:ref:`` roles of the docs); ``example`` is a Python literal, the
    value of a one-line example as written in ``settings.py``; ``default_text``, when given,
    says in words what the default (shown as ``repr(default)`` otherwise) means; ``allowed``
    states the values accepted (the range that the validation below enforces: the docs test
    checks that it names the same bounds).
    """

    name: str
    default: Any
    type: str
    section: str
    example: str
    doc: str
    default_text: str = ""
    allowed: str = ""


#: The sections of the settings reference, in order.
SETTING_SECTIONS: tuple[str, ...] = (
    "Database",
    "Record identity",
    "Frontier, leases and runs",
    "Queue input",
    "Politeness",
    "Outbox",
    "Logging",
)

#: Every setting: default, type and documentation (the one source of the settings reference).
SETTING_DEFINITIONS: tuple[Setting, ...] = (
    Setting(
        "IDEMPOTENT_DATABASE", None, "str or None", "Database",
        '"/var/lib/crawls/{spider}.sqlite3"',
        default_text="``.scrapy/idempotent/<spider>.sqlite3`` in the project data directory",
        doc="""
Where the frontier and the records live: a path of a SQLite file, or a database URL.
``{spider}`` is replaced by the spider name, made one file name (path separators, NUL and
leading dots become ``_``, so ``../../x`` is ``___.._x``).

A relative path (here and in the commands' ``--db``: one rule) is relative to the project
directory (where ``scrapy.cfg`` is, found from the current directory upwards, as for Scrapy's
``.scrapy`` paths), so a crawl or a command started from a subdirectory uses the same
frontier; with no ``scrapy.cfg``, to the current directory. The log line at open and the
commands' output show the absolute path. Its directory is created; a new file is created
readable by its owner only, also at the target of a symbolic link that does not exist yet.
One database per crawl: a file made by another spider or project is refused (see :ref:`identity`).

A URL: ``sqlite:///PATH`` is the same SQLite file (three slashes and a relative path,
``sqlite:///data/{spider}.sqlite3``, or four for an absolute one,
``sqlite:////var/lib/crawls/{spider}.sqlite3``, as in SQLAlchemy's URLs);
``postgresql://user:password@host:port/dbname`` (or ``postgres://``) is the PostgreSQL store
(see :doc:`/postgresql`; without psycopg installed the crawl stops before the first request
with one line naming the extra to install). A scheme no backend is registered for stops the
crawl before the first request, with an error naming ``IDEMPOTENT_DATABASE`` and the known
schemes. A URL's
password is shown as ``***`` in logs and command output.""",
    ),
    Setting(
        "IDEMPOTENT_SYNCHRONOUS", "NORMAL", "str", "Database", '"FULL"',
        default_text=("``\"NORMAL\"``, or ``\"FULL\"`` when :setting:`IDEMPOTENT_OUTBOX_TARGETS` "
                      "or :setting:`IDEMPOTENT_QUEUE_URL` is set"),
        allowed='``NORMAL`` or ``FULL``',
        doc="""
SQLite's ``synchronous`` in WAL mode. ``NORMAL`` survives the death of the process (the
promise); ``FULL`` also survives power loss or an operating system crash, at one fsync per
commit. With outbox targets or a queue input a commit is announced to another system right
after it returns (a webhook, a queue acknowledgement), so it must not be lost afterwards:
``FULL`` is the default then; set ``"NORMAL"`` explicitly to trade that for speed. On
PostgreSQL, ``FULL`` turns a ``synchronous_commit = off`` configured for the database or role
into ``on`` for the crawl's connections (``NORMAL`` leaves it as configured).""",
    ),
    Setting(
        "IDEMPOTENT_BUSY_TIMEOUT_SECONDS", 10.0, "float, seconds", "Database", "30",
        allowed='0 to 3600',
        doc="""
How long a statement waits for another process's write lock (or, on PostgreSQL, a lock wait
or a restarting server) before the write is retried: five attempts in all, then the spider
closes with reason ``idempotent_store_error``. The wait is on the writer's thread: downloads
of requests claimed ahead go on meanwhile.""",
    ),
    Setting(
        "IDEMPOTENT_NATURAL_KEYS", {}, "dict", "Record identity",
        '{"myproject.items.ProductItem": "sku", "ReviewItem": ["sku", "author"]}',
        doc="""
Maps an item class (``"module.Class"``, ``"Class"``, or ``"*"`` for any type) to the field
or list of fields that identify the item on its site. Types without an entry use the page URL
(or, for an item of ``start()``, its content: see :ref:`record-ids`). A spider attribute
``idempotent_natural_keys`` of the same shape overrides entries. A ``module.Class`` entry must
import, and its key fields must be declared by the class when the class declares fields
(``scrapy.Item``, dataclasses, attrs).""",
    ),
    Setting(
        "IDEMPOTENT_RECORD_TYPES", {}, "dict", "Record identity",
        '{"myproject.items.Product": "myproject.items.ProductItem"}',
        doc="""
Maps an item class (``"module.Class"`` or ``"Class"``: that class only, not its subclasses)
to the record type its records are identified by. By default an item's record type is its
class, ``module.QualName``, so a product and an offer with the same key are two records.
Name the old type here when you rename or move an item class, so that its records are still
found (see :ref:`changing-keys`). The record types and the natural key each one was stored
under are kept in the database: a crawl that identifies them otherwise is refused at start.""",
    ),
    Setting(
        "IDEMPOTENT_SOURCE", None, "str or None", "Record identity", '"shop-eu"',
        default_text="the spider name",
        doc="""
The namespace of record IDs: two spiders with the same source and natural key write the same
record. Part of the database's identity (see :ref:`identity`).""",
    ),
    Setting(
        "IDEMPOTENT_RECORD_ID_FIELD", "record_id", "str or None", "Record identity", '"id"',
        doc="""
The item field the record ID is stamped into, when the item type has room for it (dicts
always; ``scrapy.Item`` and dataclasses only if they declare it). ``None`` or ``""`` leaves
items unchanged (no field is stamped). A natural key field is refused at start (the record
ID would replace the key in the stored data and feeds).""",
    ),
    Setting(
        "IDEMPOTENT_VOLATILE_FIELDS", [], "list[str]", "Record identity",
        '["url", "scraped_at"]',
        doc="""
Fields stored but left out of the content hash, so that a field that varies while the item
does not (the URL it was found at, a scrape timestamp) does not count as a change.""",
    ),
    Setting(
        "IDEMPOTENT_URL_IGNORE_PARAMS", list(DEFAULT_URL_IGNORE_PARAMS), "list[str]",
        "Record identity", '["utm_*", "ref", "sort"]',
        default_text="analytics and session parameters: " + ", ".join(
            f"``{name}``" for name in DEFAULT_URL_IGNORE_PARAMS),
        doc="""
Query and ``;path`` parameters removed from a page URL used as a natural key, and from a
file URL before it is named (:doc:`/files`); a trailing ``*`` matches a prefix.""",
    ),
    Setting(
        "IDEMPOTENT_LEASE_SECONDS", 60.0, "float, seconds", "Frontier, leases and runs", "300",
        allowed='1 to 604800 (a week)',
        doc="""
How long a claim lasts unless renewed. Leases are renewed every third of it while
the worker lives. A worker stopped for longer (SIGSTOP, a suspended VM) loses its leases to
other workers, and its late completions write nothing (see :ref:`fencing`).""",
    ),
    Setting(
        "IDEMPOTENT_LEASE_BATCH", None, "int or None", "Frontier, leases and runs", "16",
        default_text="``CONCURRENT_REQUESTS``, at least 8",
        allowed='``None``, or 1 to 10000',
        doc="""
How many requests a worker claims ahead (per transaction, once fewer than half of them are
left), so that ``next_request`` is answered from memory; claims ride on the completion
transactions, so a steady crawl writes at most one transaction per page. ``None`` claims as
many as the worker downloads at once (``CONCURRENT_REQUESTS``, at least 8). A larger batch
means fewer, larger claims: on PostgreSQL with two workers of 32 concurrent requests, 32
instead of 8 took a fifth off the server's CPU time per page (:doc:`/development`); on SQLite
it makes no measurable difference. In exchange, a worker killed leaves up to this many
claimed, unsent requests under its lease until they are reclaimed (at once by a worker of
the same host, after :setting:`IDEMPOTENT_LEASE_SECONDS` by another), each counted as a
repeated request but never downloaded twice (:ref:`repeats`); and at a crawl's start or end,
when fewer requests are pending than the workers could take, one worker may hold requests
claimed ahead while another has none to send.""",
    ),
    Setting(
        "IDEMPOTENT_RUN_MODE", RunMode.AUTO.value, "str", "Frontier, leases and runs",
        '"fresh"',
        allowed='``auto``, ``resume`` or ``fresh``',
        doc="""
``auto``: resume an unfinished run, else start a new run. ``resume``: always continue the
last run (a finished run stays finished). ``fresh``: always start a new run (the frontier is
emptied; records are kept). See :doc:`/runs`.""",
    ),
    Setting(
        "IDEMPOTENT_RECRAWL_SECONDS", None, "float, seconds, or None",
        "Frontier, leases and runs", "86400",
        allowed='``None``, or 1 to 315360000 (ten years)',
        doc="""
The recrawl window. ``None``: a new run starts from an empty frontier (every page is fetched
again, once). A number W: a new run keeps the frontier, and a request done in an earlier
window than the current one (windows are ``floor(unix time / W)``) is due again when it is
discovered again; within the window it is not fetched again. The decision is one state change
in the database, so workers whose clocks differ near a window boundary still fetch a page
once.""",
    ),
    Setting(
        "IDEMPOTENT_RESPONSE_JOURNAL", True, "bool", "Frontier, leases and runs", "False",
        allowed="``True``/``False``, ``1``/``0``, ``'true'``/``'false'``",
        doc="""
Keep each raw response of a leased request in the database until its request is done
(``ResponseJournalMiddleware``, priority 950), so a kill after the response arrived does not
download it again: a kill then repeats only what was on the wire. The response goes on to its
callback once it is written (with the transaction of another page's completion, usually);
``False`` saves the write of the response's body, and a kill then also repeats the pages
being processed.""",
    ),
    Setting(
        "IDEMPOTENT_CONDITIONAL_REQUESTS", False, "bool", "Frontier, leases and runs", "True",
        allowed="``True``/``False``, ``1``/``0``, ``'true'``/``'false'``",
        doc="""
Send a later run's request for a page done before with that page's validators
(``If-None-Match``, ``If-Modified-Since``), and complete a ``304 Not Modified`` answer as the
page unchanged, without running its callback: its stored records are seen in the run, the
requests it added when last fetched are enqueued again (``ConditionalRequestMiddleware``,
priority 940). Off by default, since a callback that does not run is a change from Scrapy's
behaviour (its side effects, its ``spider.state`` changes and its logging do not happen). A
request opts out with the ``idempotent_conditional`` meta key ``False``. See
:doc:`/recrawls`.""",
    ),
    Setting(
        "IDEMPOTENT_SITEMAP_LASTMOD", True, "bool", "Frontier, leases and runs", "False",
        allowed="``True``/``False``, ``1``/``0``, ``'true'``/``'false'``",
        doc="""
With :setting:`IDEMPOTENT_CONDITIONAL_REQUESTS`: a ``SitemapSpider`` page whose sitemap entry
has a ``lastmod`` not later than the page's last fetch is not fetched again; it is done as
unchanged, as if it had answered ``304`` (``SitemapLastmodMiddleware``, counted in
``idempotent/sitemap/skipped``). ``False`` asks the site about every such page. See
:doc:`/recrawls`.""",
    ),
    Setting(
        "IDEMPOTENT_KEEP_COOKIES", True, "bool", "Frontier, leases and runs", "False",
        allowed="``True``/``False``, ``1``/``0``, ``'true'``/``'false'``",
        doc="""
Copy the cookie jars of Scrapy's ``CookiesMiddleware`` into the database (at most once a
second, when a cookie changed) and put them back when a crawl opens, so that a crawl that
logged in resumes logged in (:ref:`resume-cookies`). ``False`` writes no cookie to the
database: a resumed crawl starts with empty jars, as Scrapy does.""",
    ),
    Setting(
        "IDEMPOTENT_GC_FREEZE", True, "bool", "Frontier, leases and runs", "False",
        allowed="``True``/``False``, ``1``/``0``, ``'true'``/``'false'``",
        doc="""
When the spider opens, move every object then alive (what start-up made: modules, Scrapy's
components, the settings, the spider) out of the garbage collector's reach with
``gc.freeze()``, until the last crawl of the process that did so closes
(``gc.unfreeze()``). A crawl keeps each page's objects until its transaction commits,
which makes CPython's full collections frequent; skipping the start-up objects makes each
one cheap (without it the collector took a fifth of the CPU time of a crawl of tiny pages).
``False`` leaves the collector as it is: for a process that manages it itself.""",
    ),
    Setting(
        "IDEMPOTENT_FEED_STREAMING", True, "bool", "Frontier, leases and runs", "False",
        allowed="``True``/``False``, ``1``/``0``, ``'true'``/``'false'``",
        doc="""
Write local feeds (``-o``, ``-O``, ``FEEDS`` to a file path or ``file://``) while the crawl
runs: the records each transaction commits reach the file within about a second, in commit
order, and the database keeps how far each file is durably written, so a kill is cut back and
continued by the next crawl (:doc:`feeds`). Only on SQLite; feeds on PostgreSQL, remote and
post-processed feeds are written when a crawl process closes. ``False``: every feed is written
at the close, from the run's records.""",
    ),
    Setting(
        "IDEMPOTENT_MAX_ATTEMPTS", 10, "int", "Frontier, leases and runs", "5",
        allowed='1 to 10000',
        doc="""
A request whose lease ended this many times in a row without the request finishing (its
worker died, or its lease expired) is failed as ``quarantined`` instead of being handed out
again: a page that kills the crawl every time stops doing so. Retries (``RETRY_TIMES``)
finish their lease and do not count; requests claimed but never started when a crawl stops
gracefully do not count either.

Suspects are isolated without slowing a resume: after a kill, the requests that were in
flight are replayed at full concurrency (most kills are not a page's fault: a redeploy, the
OOM killer, a Ctrl+C twice). A request that was in flight at two deaths is a suspect and runs
alone, with nothing else in flight; if it is the cause, every later death has it alone in
flight, and only it reaches the limit. With a limit of 2, suspects run alone from their first
death.""",
    ),
    Setting(
        "IDEMPOTENT_REQUEST_CLASSES", [], "list[str]", "Frontier, leases and runs",
        '["myproject.requests.SignedRequest"]',
        allowed=("import paths of ``scrapy.Request`` subclasses (each imported and checked at "
                 "start)"),
        doc="""
Request classes (``"module.Class"``) allowed in the frontier besides Scrapy's ``Request``,
``FormRequest``, ``JsonRequest`` and ``XmlRpcRequest``.""",
    ),
    Setting(
        "IDEMPOTENT_QUEUE_URL", None, "str or None", "Queue input",
        '"redis://localhost:6379/0"',
        doc="""
The queue the crawl also reads requests from (see :doc:`/queue`), its broker told by the URL:
a Redis URL (``redis://host:port/db``, ``rediss://...``, ``unix://...``) reads a Redis stream
(needs the ``redis`` extra); ``sqs://name`` (``?region=...`` and ``&endpoint_url=...``
optional) or a queue's URL (``https://sqs.<region>.amazonaws.com/<account>/<name>``; another
host is taken as the endpoint, as LocalStack's) reads an SQS queue (needs the ``sqs``
extra); ``amqp://user:password@host:port/vhost`` (or ``amqps://``, pika's URL parameters
accepted) reads a RabbitMQ queue (needs the ``amqp`` extra);
``kafka://host:port,host2:port/topic`` reads a Kafka topic through a consumer group (needs the
``kafka`` extra; the client's options, such as ``security.protocol`` or ``sasl.mechanism``, as
query parameters named as librdkafka names them: :ref:`queue-kafka`).""",
    ),
    Setting(
        "IDEMPOTENT_QUEUE_KEY", None, "str or None", "Queue input", '"{spider}:urls"',
        default_text="``\"<spider name>:requests\"``",
        doc="""
The stream to read, or on RabbitMQ the queue to consume (``{spider}`` is replaced by the
spider name). Bad messages are parked in ``<key>:parked`` (RabbitMQ: the dead-letter exchange
and queue of that name). Not used by SQS (the URL names the queue). On Kafka, the topic when
the URL names none (default ``<spider name>-requests``: a topic name has only letters, digits,
``.``, ``_`` and ``-``); bad messages go to the topic ``<topic>-parked``.""",
    ),
    Setting(
        "IDEMPOTENT_QUEUE_GROUP", "scrapy_idempotent", "str", "Queue input", '"shop-workers"',
        doc="""
The consumer group the workers share (created with the stream if missing, reading from the
stream's start). On Kafka, the consumer group (``group.id``), which reads a partition it has
no committed offset for from its start (``auto.offset.reset`` ``earliest``, unless the URL
says otherwise).""",
    ),
    Setting(
        "IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS", None, "float, seconds, or None",
        "Queue input", "600",
        allowed='``None``, or 0 to 31536000 (a year)',
        doc="""
``None``: a queue-fed crawl waits for work while the queue is empty until a stop message (or
Ctrl+C / SIGTERM, which stops it as ``shutdown``, to be resumed). A number T: the crawl ends
``finished`` once the queue has had nothing for it and nothing was in progress for T seconds
(checked at Scrapy's idle heartbeat, every 5 seconds). A queue that cannot be reached has
nothing for the crawl: if it is still unreachable at the end of those T seconds, the crawl
closes as ``idempotent_queue_unreachable`` instead (an ERROR line, exit code 1), never waiting
for ever on a wrong URL or a lost server.""",
    ),
    Setting(
        "IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS", 300.0, "float, seconds", "Queue input", "900",
        allowed='1 to 604800 (a week)',
        doc="""
A message pending this long with a consumer that no longer keeps it is
delivered again to another worker (``XAUTOCLAIM``): the recovery for a worker on another host
that died. A live worker keeps the messages whose requests are in progress, however long
their pages or their wait in the frontier take: it resets their idle time (``XCLAIM`` to
itself) once they reach a third of this. A dead worker of the same host is noticed at once
(its process is gone) and its messages are taken over at the next poll. Set it above the
longest a worker may stall (its process stopped, Redis unreachable from it): taking over a
live worker's message is harmless (its request is one frontier entry), only wasted work.

On SQS this is the visibility timeout asked for (whole seconds, at most 12 hours): a held
message's is extended every third of it while its request is in progress, and a dead worker's
messages are received again once it runs out. Not used by Kafka, whose group hands a dead
member's partitions to the others once its session times out (``session.timeout.ms``, a query
parameter of the URL: :ref:`queue-kafka`).""",
    ),
    Setting(
        "IDEMPOTENT_QUEUE_PREFETCH", 100, "int", "Queue input", "20",
        allowed='1 to 10000',
        doc="""
At most this many messages are held, not yet acknowledged, at once per worker,
whatever brought them: read from the stream, or taken over from a dead worker or once idle
(:setting:`IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS`); a dead worker's longer pending list is taken
over by the next polls, and by other workers meanwhile. On Kafka, the worker pauses its
partitions while it holds this many.""",
    ),
    Setting(
        "IDEMPOTENT_QUEUE_POLL_SECONDS", 0.2, "float, seconds", "Queue input", "1.0",
        allowed='0.01 to 60',
        doc="""
How often the stream is read for new messages. Redis is called on a thread of
the queue input's own, never on the reactor: a Redis server that stops answering delays the
queue's reads and acknowledgements (a poll starts when the one before it is back), not the
downloads and page commits.""",
    ),
    Setting(
        "IDEMPOTENT_QUEUE_WAIT_SECONDS", 1.0, "float, seconds", "Queue input", "5",
        allowed='0 to 20',
        doc="""
SQS: how long a receive waits for a message when the queue is empty (long polling,
``WaitTimeSeconds``, whole seconds; 0 is short polling). The queue input's deletes and
extensions wait behind a receive, so a longer wait means fewer empty receives, acknowledged up
to that much later. Not used by Redis.""",
    ),
    Setting(
        "IDEMPOTENT_OUTBOX_TARGETS", [], "list[str] (or a comma-separated str)", "Outbox",
        '["https://hooks.example.com/products", "myproject.outbox.SearchIndex"]',
        doc="""
Where record changes are announced (see :doc:`/outbox`): webhook URLs (``http://``,
``https://``) and import paths of ``OutboxTarget`` classes. Empty: no outbox entries are
written and ``OutboxDelivery`` is off. Entries are kept per target as written here, a
password replaced by ``***``: a webhook URL's ``user:password@`` is sent as HTTP Basic auth
(never in the URL) and shown as ``user:***@`` in logs, the outbox and ``status``.""",
    ),
    Setting(
        "IDEMPOTENT_OUTBOX_HEADERS", {}, "dict[str, str]", "Outbox",
        '{"Authorization": "Bearer s3cr3t"}',
        doc="Headers added to every webhook POST (authentication).",
    ),
    Setting(
        "IDEMPOTENT_OUTBOX_CONCURRENCY", 8, "int", "Outbox", "4",
        allowed='1 to 10000',
        doc="Deliveries in flight at once, per target.",
    ),
    Setting(
        "IDEMPOTENT_OUTBOX_TIMEOUT_SECONDS", 30.0, "float, seconds", "Outbox", "10",
        allowed='0.1 to 3600',
        doc="""
How long one delivery attempt may take in all, for webhooks (connecting,
sending, the whole answer) and target classes alike; an attempt still running then is
cancelled and tried again later. A claimed announcement is held that long plus 5 s: no other
delivery of it starts meanwhile, and one taken by a crawl that dies is sent again once the
hold has passed.""",
    ),
    Setting(
        "IDEMPOTENT_OUTBOX_RETRY_SECONDS", 1.0, "float, seconds", "Outbox", "5",
        allowed='0 to 86400',
        doc="""
The wait before the first retry of a delivery; it doubles with every further attempt (with
jitter, and at least the receiver's ``Retry-After``).""",
    ),
    Setting(
        "IDEMPOTENT_OUTBOX_RETRY_MAX_SECONDS", 300.0, "float, seconds", "Outbox", "3600",
        allowed='0 to 604800 (a week)',
        doc="""
The longest wait between two attempts (a longer ``Retry-After``, up to a day, is still
honoured).""",
    ),
    Setting(
        "IDEMPOTENT_OUTBOX_DRAIN_SECONDS", 30.0, "float, seconds", "Outbox", "120",
        allowed='0 to 86400',
        doc="""
How long a closing crawl (and ``scrapy idempotent deliver``) goes on delivering
what is left: the close ends as soon as nothing is due, and at the latest after this time,
when no delivery starts any more and those still in flight are cut off (left pending, due at
once). What is still pending is sent by the next crawl or ``scrapy idempotent deliver``.
``0``: nothing more is delivered at close; the deliveries in flight when the spider closes are
cut off.""",
    ),
    Setting(
        "IDEMPOTENT_POLITENESS", "crawl", "str", "Politeness", '"worker"',
        allowed="'crawl' or 'worker'",
        doc="""
Where Scrapy's per-site limits hold. ``"crawl"`` (the default): for the whole crawl, every
worker together, across kills: each request is stored with its download slot (Scrapy's slot
key: the ``download_slot`` meta key, else the host name, or its IP with
``CONCURRENT_REQUESTS_PER_IP``), and a claim takes a slot's requests only while fewer of
them are leased (claimed ahead or in flight, by any worker) than the slot's concurrency
(``CONCURRENT_REQUESTS_PER_DOMAIN``, or ``CONCURRENT_REQUESTS_PER_IP``, or the slot's
``DOWNLOAD_SLOTS`` entry), and only once the slot's delay (``DOWNLOAD_DELAY`` or its
``DOWNLOAD_SLOTS`` entry, or robots.txt's ``Crawl-delay`` with ``ROBOTSTXT_OBEY`` when longer)
has passed since its last claim; a 429 (or a 503 with ``Retry-After``) pauses the slot for
every worker (see :setting:`IDEMPOTENT_BACKOFF_SECONDS`). A request counts against its
slot's concurrency from its claim to its page's commit (callback and pipelines included), so
a worker short of CPU sends less than plain Scrapy would. ``"worker"``: each worker keeps
Scrapy's own limits in its downloader (N workers: N times the load on a site, and a 429 is
only what ``RetryMiddleware`` makes of it), and claims take the head of the frontier whatever
its slots. Every worker of a crawl must use the same mode: a ``"worker"`` worker's requests
count against no slot. See :ref:`politeness`.""",
    ),
    Setting(
        "IDEMPOTENT_BACKOFF_SECONDS", 10.0, "float, seconds", "Politeness", "60",
        allowed='0.1 to 86400',
        doc="""
How long a download slot is paused, for every worker, after a 429 answer without a
``Retry-After`` header (a 503 pauses only with one); doubled with every such answer in a
row, up to
:setting:`IDEMPOTENT_BACKOFF_MAX_SECONDS`, and lengthened by up to a quarter at random. A
``Retry-After`` (seconds or an HTTP date) is the pause instead (at most the maximum). The
throttled request is fetched again after the pause without counting against
``RETRY_TIMES`` (ten times in a row at most, then RetryMiddleware decides; with
``RETRY_ENABLED = False`` or ``dont_retry`` the pause alone holds). With
``IDEMPOTENT_POLITENESS = "crawl"`` only.""",
    ),
    Setting(
        "IDEMPOTENT_BACKOFF_MAX_SECONDS", 600.0, "float, seconds", "Politeness", "3600",
        allowed='0.1 to 604800 (a week), and at least IDEMPOTENT_BACKOFF_SECONDS',
        doc="""
The longest pause of a download slot after 429 (or 503) answers, ``Retry-After``
included.""",
    ),
    Setting(
        "IDEMPOTENT_ROBOTSTXT_MAX_AGE_SECONDS", 86400.0, "float, seconds", "Politeness",
        "3600", allowed='1 to 31536000 (a year)',
        doc="""
With ``ROBOTSTXT_OBEY = True``: how long a site's robots.txt, fetched once and kept in the
crawl's database, is obeyed by every worker and every resume before it is fetched again
(24 hours by default, the longest RFC 9309 allows a cached robots.txt to be used). A
request of a site waits until the site's rules are known, so no page robots.txt disallows
is downloaded, however many requests start at once. A 4xx answer allows everything and is
kept as well; a 5xx or a network error is obeyed as Scrapy does (everything allowed) by the
process that met it only, and the next worker or resume asks again. See :ref:`robots`.""",
    ),
    Setting(
        "IDEMPOTENT_LOG_INTERVAL_SECONDS", 60.0, "float, seconds", "Logging", "30",
        allowed='0 (no progress line), or 0.1 to 86400',
        doc="""
How often the progress line (see :ref:`progress-line`) is logged; ``0`` turns it
off.""",
    ),
    Setting(
        "IDEMPOTENT_METRICS_LISTEN", None, "str or None", "Logging", '"127.0.0.1:9811"',
        doc="""
``HOST:PORT`` where each crawl process serves its own figures for Prometheus while its spider
runs (``http://HOST:PORT/metrics``, ``prometheus_client``: the ``metrics`` extra): the
process's CPU time, memory and open files, and its Scrapy stats. Several workers of one host
each need a port of their own (``-s IDEMPOTENT_METRICS_LISTEN=...`` per process; port ``0``
takes a free one, named in the log). The whole crawl's figures come from the database:
``scrapy idempotent metrics`` (see :ref:`monitoring`). ``None``: no endpoint.""",
    ),
    Setting(
        "IDEMPOTENT_SAMPLE_SECONDS", 60.0, "float, seconds", "Logging", "300",
        allowed='0 (no samples), or 1 to 86400',
        doc="""
How often the run's counters are stored as a progress sample (the picture of the run that
``scrapy idempotent status --chart`` draws, see :ref:`run-chart`): one row per interval for the
whole crawl, written by the first worker to reach it, and one more at each worker's close.
``0`` stores none (the chart is then counted from the frontier's rows).""",
    ),
)

#: Every setting's default, by name (built from :data:`SETTING_DEFINITIONS`).
SETTINGS: dict[str, Any] = {setting.name: setting.default for setting in SETTING_DEFINITIONS}


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


#: Scrapy's defaults: CONCURRENT_REQUESTS_PER_DOMAIN 8, no DOWNLOAD_DELAY, no DOWNLOAD_SLOTS.
_DEFAULT_SLOT_LIMITS = SlotLimits(concurrency=8)


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
    #: Scrapy's settings the frontier follows: ``HTTPERROR_ALLOW_ALL`` and
    #: ``HTTPERROR_ALLOWED_CODES`` (which responses reach their callback) ...
    httperror_allow_all: bool = False
    httperror_allowed_codes: tuple[int, ...] = ()
    #: ... and ``SCHEDULER_MEMORY_QUEUE`` / ``SCHEDULER_START_MEMORY_QUEUE`` (the queue order)
    queue_order: QueueOrder = _SCRAPY_QUEUE_ORDER
    #: IDEMPOTENT_POLITENESS: ``crawl`` (limits kept by the claims) or ``worker``
    politeness: str = "crawl"
    #: the per-slot limits from Scrapy's settings (see :func:`.politeness.slot_limits`)
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
        return cls(
            database=_database(_get(settings, "IDEMPOTENT_DATABASE"), spider.name),
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
            keep_cookies=_boolean(settings, "IDEMPOTENT_KEEP_COOKIES"),
            feed_streaming=_boolean(settings, "IDEMPOTENT_FEED_STREAMING"),
            gc_freeze=_boolean(settings, "IDEMPOTENT_GC_FREEZE"),
            **_outbox(settings),
            queue=_queue(settings, spider.name),
            **_scrapy_rules(settings),
            **_politeness(settings),
        )


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
    from .politeness import slot_limits

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
    return {"politeness": mode, "slot_limits": limits, "backoff_seconds": first,
            "backoff_max_seconds": most,
            "robotstxt_max_age_seconds": _number(
                settings, "IDEMPOTENT_ROBOTSTXT_MAX_AGE_SECONDS", minimum=1, maximum=_YEAR)}


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


def _seconds_or_off(settings: BaseSettings, name: str, least: float, off: str) -> float:
    """An interval setting: 0 turns it off, else seconds from ``least`` to a day."""
    interval = _number(settings, name, minimum=0.0, maximum=_DAY)
    if 0 < interval < least:
        raise ConfigError(name, _get(settings, name),
                          f"{off} or a number of seconds >= {least} and <= 86400")
    return interval


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


def _get(settings: BaseSettings, name: str) -> Any:
    return settings.get(name, SETTINGS[name])


_TRUE = ("1", "true", "True")
_FALSE = ("0", "false", "False")


def _boolean(settings: BaseSettings, name: str) -> bool:
    """What Scrapy's ``getbool`` accepts, with an error naming the setting otherwise."""
    raw = settings.get(name, SETTINGS[name])
    if isinstance(raw, bool):
        return raw
    if raw in (0, 1) or raw in _TRUE or raw in _FALSE:
        return raw in (1, *_TRUE)
    raise ConfigError(name, raw, "a boolean: True or False (1 or 0, 'true' or 'false')")


#: Upper bounds of the number settings: each is far above any sensible value, and keeps what
#: the databases store (lease times, SQLite's busy timeout in milliseconds, batch sizes in one
#: statement) finite and within range.
_HOUR = 3600.0
_DAY = 86400.0
_WEEK = 7 * _DAY
_YEAR = 365 * _DAY
_MAX_BATCH = 10_000


def _number(settings: BaseSettings, name: str, *, minimum: float, maximum: float,
            integer: bool = False) -> float:
    """The number setting ``name``, in ``[minimum, maximum]`` (so never NaN or infinite), an
    integer with ``integer``; :class:`~.ConfigError` naming the setting and the range
    otherwise."""
    raw = _get(settings, name)
    try:
        value = float(raw)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int past a float
        value = float("nan")
    kind = "an integer" if integer else "a number"
    if (isinstance(raw, bool) or not minimum <= value <= maximum
            or (integer and value != int(value))):
        raise ConfigError(name, raw, f"{kind} >= {minimum:g} and <= {maximum:g}")
    return value


def _names(settings: BaseSettings, name: str) -> list[str]:
    raw = settings.get(name, SETTINGS[name])
    if isinstance(raw, str) and raw.lstrip().startswith("["):  # a JSON list given with -s
        try:
            raw = json.loads(raw)
        except ValueError:
            raise ConfigError(name, raw, "a list of non-empty strings") from None
    elif isinstance(raw, str):
        raw = [part.strip() for part in raw.split(",") if part.strip()]
    if not isinstance(raw, (list, tuple, set, frozenset)) or not all(
        isinstance(v, str) and v for v in raw
    ):
        raise ConfigError(name, raw, "a list of non-empty strings (or a comma-separated string)")
    return list(raw)


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


def _headers(settings: BaseSettings, name: str) -> tuple[tuple[str, str], ...]:
    raw = settings.get(name, SETTINGS[name])
    if isinstance(raw, str):  # a JSON object given with -s
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raw = None
    if hasattr(raw, "copy_to_dict"):  # a Scrapy BaseSettings
        raw = raw.copy_to_dict()
    if not isinstance(raw, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str) for k, v in raw.items()):
        raise ConfigError(name, raw, "a dict of header names to string values")
    return tuple(raw.items())


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
