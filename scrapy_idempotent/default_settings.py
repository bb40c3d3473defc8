"""Every ``IDEMPOTENT_*`` setting: its default, its type and its documentation, as Scrapy
declares its own in ``scrapy/settings/default_settings.py``. The docs' settings reference is
generated from :data:`SETTING_DEFINITIONS`; :mod:`.config` reads and validates the values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .store.base import RunMode

__all__ = [
    "DEFAULT_URL_IGNORE_PARAMS",
    "SETTINGS",
    "SETTING_DEFINITIONS",
    "SETTING_SECTIONS",
    "Setting",
]

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
    states the values accepted (the range that the validation in :mod:`.config` enforces: the
    docs test checks that it names the same bounds).
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
        "IDEMPOTENT_DEDUP_REDIS_URL", None, "str or None", "Database",
        '"redis://cache.internal:6379/0"',
        default_text="``None``: off, every duplicate check asks the worker's memory, then the "
                     "database",
        allowed="``None``, or a ``redis://``, ``rediss://`` or ``unix://`` URL, with a "
                "PostgreSQL :setting:`IDEMPOTENT_DATABASE`",
        doc="""
A Redis shared by the crawl's workers as a fast layer in front of the database for duplicate
links (see :ref:`redis-dedup`): a hash of the fingerprints the frontier holds durably,
written after each page commit. A link the hash knows is refused with no database read; any
other goes to the database as without it. Opt-in: it cuts the PostgreSQL server's CPU per
page by about a third where most links are rediscovered ones and the workers' own memory
of known entries misses (a frontier far larger than its 50,000 entries). PostgreSQL store
only (with SQLite the setting is refused: a read of the file costs less than a round trip
to Redis); needs the ``redis`` extra. A Redis that fails is not an error: a WARNING, then
the database answers every link for 30 s, and Redis is asked again. The URL's password is
shown as ``***``.""",
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
page unchanged, without running its callback: its stored records are seen in the run, every
request it linked when last fetched is enqueued again (``ConditionalRequestMiddleware``,
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
        "IDEMPOTENT_ADAPTIVE_REVISIT", False, "bool", "Frontier, leases and runs", "True",
        allowed="``True``/``False``, ``1``/``0``, ``'true'``/``'false'``; ``True`` needs "
                ":setting:`IDEMPOTENT_CONDITIONAL_REQUESTS`",
        doc="""
With :setting:`IDEMPOTENT_CONDITIONAL_REQUESTS`: each page that yields records gets a revisit
interval of its own, between :setting:`IDEMPOTENT_REVISIT_MIN_SECONDS` and
:setting:`IDEMPOTENT_REVISIT_MAX_SECONDS`: halved when its records changed since its last
fetch, doubled when they did not. A later run fetches such a page only once its interval has
passed since the start of the run that last fetched it (or confirmed it unchanged); before,
it is done as unchanged without a request, as if it had answered ``304`` (counted in
``idempotent/revisit/not_due``). Start requests and pages that yield no records (listings:
how new pages are found) are fetched in every run. See :ref:`adaptive-revisits`.""",
    ),
    Setting(
        "IDEMPOTENT_REVISIT_MIN_SECONDS", 86400.0, "float, seconds",
        "Frontier, leases and runs", "3600",
        allowed="1 to 315360000 (ten years), at most IDEMPOTENT_REVISIT_MAX_SECONDS",
        doc="""
With :setting:`IDEMPOTENT_ADAPTIVE_REVISIT`: the shortest revisit interval, the one a page
starts with and the one a page that changes at every visit keeps. Set it to the spacing of
your runs (a page is due up to a tenth of it early, so a run started a little before its
schedule still fetches it).""",
    ),
    Setting(
        "IDEMPOTENT_REVISIT_MAX_SECONDS", 2592000.0, "float, seconds",
        "Frontier, leases and runs", "604800",
        allowed="1 to 315360000 (ten years), at least IDEMPOTENT_REVISIT_MIN_SECONDS",
        doc="""
With :setting:`IDEMPOTENT_ADAPTIVE_REVISIT`: the longest revisit interval, the one a page that
never changes reaches. No change of a page is found later than this after it happened (plus
the time until the next run).""",
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
``DOWNLOAD_SLOTS`` entry), and only once the slot's delay (``DOWNLOAD_DELAY``
or its ``DOWNLOAD_SLOTS`` entry, or robots.txt's ``Crawl-delay`` with ``ROBOTSTXT_OBEY``
when longer) has passed since its last claim; a 429 (or a 503 with ``Retry-After``) pauses
the slot for every worker (see :setting:`IDEMPOTENT_BACKOFF_SECONDS`). A request counts
against its slot's concurrency from its claim to its page's commit (callback and pipelines
included), so a worker short of CPU sends less than plain Scrapy would.
``"worker"``: each worker keeps Scrapy's own limits in its downloader (N workers: N times
the load on a site, and a 429 is only what ``RetryMiddleware`` makes of it), and claims take
the head of the frontier whatever its slots. Every worker of a crawl must use the same mode:
a ``"worker"`` worker's requests count against no slot. See
:ref:`politeness`.""",
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
``RETRY_ENABLED = False`` or ``dont_retry`` the pause alone holds). Also the cautious pause
of every slot a dead worker held requests of, from when its leases are taken back (it may
have got a 429 it could not write; see :ref:`pause-exactly`). With
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
