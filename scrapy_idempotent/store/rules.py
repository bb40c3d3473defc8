"""The store's rules, written once for every backend: plain functions of plain values.

What a backend decides is the same whatever database holds the rows: which new run a session
starts, when a finished request is due again (the recrawl window), how a claim is split into
leases and quarantined requests, how a record write is decided (insert, update, unchanged,
stale), and which states of the rows are anomalies. A backend reads the rows, asks these
functions, and writes what they decided; nothing here touches a database.
"""

from __future__ import annotations

import enum
import hashlib
import json
import random
from collections.abc import Sequence
from typing import Any, NamedTuple

from .base import CrawlIdentity, LeasedRequest, RequestState, RevisitBounds, RunMode, StateChange

__all__ = [
    "CLAIMED_COLUMNS",
    "FIRST_RECORD_ID_SCHEME",
    "MIGRATED_RECORD_ID_SCHEMES",
    "QUEUE_ORDER",
    "QUEUE_ORDER_BACKWARD",
    "REVISIT_SPREAD",
    "SLOT_WANTED_RECHECK_SECONDS",
    "SLOT_WANTED_SECONDS",
    "TERMINAL",
    "ClaimedRow",
    "Enqueue",
    "RecordWrite",
    "StoredState",
    "after_write",
    "anomaly_checks",
    "apply_state_changes",
    "claim_order",
    "claimed_columns",
    "enqueue_decision",
    "is_older",
    "isolate_after",
    "known_request_answer",
    "next_revisit",
    "other_owner",
    "pause_seconds",
    "quarantine_message",
    "record_id_scheme_refusal",
    "record_write",
    "request_data",
    "revisit_due",
    "revisit_due_at",
    "send_margin",
    "slot_share",
    "split_claim",
    "starts_new_run",
    "stored_record_id_scheme",
    "stored_request_data",
    "window_start",
]

#: The states a request ends in (``done``, ``failed``, ``redirected``).
TERMINAL = tuple(s.value for s in RequestState if s.terminal)

#: The claim order, as in Scrapy's default scheduler (scrapy/pqueues.py,
#: ScrapyPriorityQueue.pop): highest priority first; at equal priority other requests
#: before start requests; within a queue by insertion, first-in-first-out for ``fifo``
#: rows, else last-in-first-out. Every backend writes its ``requests_pending`` index exactly
#: so, so that a claim reads the head of the index.
QUEUE_ORDER = "priority DESC, is_start, (CASE WHEN fifo THEN id ELSE -id END)"
#: :data:`QUEUE_ORDER` written for an index that holds it reversed, read backward (PostgreSQL's
#: pending indexes): the same order, with the queue's head at the index's right end, where
#: last-in-first-out requests (the newest first: Scrapy's default) are appended. The start
#: flag is folded into the order's bigint (a start request's 2^62 less: ids stay far below
#: 2^62), so that the index's key is 16 bytes or less (see the PostgreSQL schema, step 19):
#: read backward, at equal priority every other request comes before every start request.
QUEUE_ORDER_BACKWARD = ("priority DESC, (CASE WHEN fifo THEN -id ELSE id END)"
                        " - (CASE WHEN is_start THEN 4611686018427387904 ELSE 0 END) DESC")


# -- download slots -----------------------------------------------------------------------


#: A request claimed from a slot with a delay must reach the downloader within this share of
#: the delay (at most :data:`SEND_MARGIN_MAX_SECONDS`), else it is given back unsent; the
#: slot's next claim comes that much after the delay, so that two requests of the slot are
#: never sent less than its delay apart, whichever workers send them and however late.
SEND_MARGIN_SHARE = 0.25
SEND_MARGIN_MAX_SECONDS = 1.0


def send_margin(delay_seconds: float) -> float:
    """The margin of a slot with ``delay_seconds`` (see :data:`SEND_MARGIN_SHARE`)."""
    return min(delay_seconds * SEND_MARGIN_SHARE, SEND_MARGIN_MAX_SECONDS)


#: A worker whose claim finds a slot full while it holds less than its share of the slot's
#: places (:func:`slot_share`) records that it wants them (the slot's ``wanted_by`` and
#: ``wanted_at``). For this long after, every other worker's claim of the slot takes no more
#: than its own share, so that the places it frees go to the worker that wants them ...
SLOT_WANTED_SECONDS = 5.0
#: ... and the worker that wants them asks again this soon (while the slot is full and it
#: holds less than its share: at most a few transactions a second). So does a worker whose
#: claim took nothing while a slot with pending requests was left out of it: on PostgreSQL a
#: claim skips the row of a slot another worker's claim holds (SKIP LOCKED) rather than wait
#: for that transaction, and the worker cannot tell a slot full from one it could not see.
SLOT_WANTED_RECHECK_SECONDS = 0.5


def slot_share(concurrency: int, workers: int) -> int:
    """One worker's share of a slot's ``concurrency`` places while ``workers`` (at least one)
    hold or want them: the places divided among them, rounded down, at least one. Rounded
    down, so that the shares leave room for a worker not counted (a slot records only the
    last worker that wants it); a place the shares leave over goes to whoever claims it once
    nobody has wanted the slot for :data:`SLOT_WANTED_SECONDS`."""
    return max(concurrency // max(workers, 1), 1)


def pause_seconds(retry_after: float | None, backoffs: int, first_seconds: float,
                  max_seconds: float, jitter: float = 0.0) -> float:
    """How long a slot is paused after a 429 or 503: the site's ``Retry-After`` when it sent
    one (at most ``max_seconds``); else ``first_seconds`` doubled for each such answer in a
    row before this one (``backoffs``), at most ``max_seconds``, lengthened by a random
    share of itself up to ``jitter`` (so that workers and crawls paused together do not
    come back together; never shortened: the site's wish is a minimum)."""
    if retry_after is not None:
        return min(max(retry_after, 0.0), max_seconds)
    seconds = min(first_seconds * 2.0 ** min(backoffs, 64), max_seconds)
    return min(seconds * (1.0 + random.uniform(0.0, jitter)), max_seconds)


# -- ownership ----------------------------------------------------------------------------


def other_owner(stored: dict[str, str], identity: CrawlIdentity) -> CrawlIdentity | None:
    """The crawl a database belongs to when it is not ``identity``'s, from the identity
    recorded in it (``project``, ``spider``, ``source``); None when it is this crawl's, or
    nobody's yet (nothing recorded: the first open records it)."""
    if not stored:
        return None
    owner = CrawlIdentity(project=stored.get("project", ""), spider=stored.get("spider", ""),
                          source=stored.get("source", ""))
    return None if owner == identity else owner



#: The record ID scheme of the records of a database made before it recorded one.
FIRST_RECORD_ID_SCHEME = "1"


def stored_record_id_scheme(recorded: str | None, has_records: bool, scheme: str) -> str:
    """The record ID scheme of a database's records: the one ``recorded`` in it; for a
    database that recorded none, :data:`FIRST_RECORD_ID_SCHEME` when it holds records, else
    ``scheme`` (the opener's: nothing stored can disagree with it)."""
    if recorded is not None:
        return recorded
    return FIRST_RECORD_ID_SCHEME if has_records else scheme


#: Record ID schemes whose databases are opened to be re-identified (the package's
#: ``rekey``) rather than refused: scheme 1 left the record type out of record IDs.
MIGRATED_RECORD_ID_SCHEMES = ("1",)


def record_id_scheme_refusal(where: str, stored: str, scheme: str) -> str:
    """Why a crawl deriving record IDs with ``scheme`` is refused a database whose records
    were identified with ``stored``: the same item would get another record ID."""
    return (f"{where} holds records identified by record ID scheme {stored}; this "
            f"scrapy_idempotent derives record IDs by scheme {scheme}, so the same item would "
            "get a second record under another ID; it was left untouched: use the "
            "scrapy_idempotent release that stored them, or set IDEMPOTENT_DATABASE to "
            "another database")


# -- runs and the recrawl window ----------------------------------------------------------


def starts_new_run(run_mode: RunMode | str, last_finished: bool | None) -> bool:
    """Whether a session joining with ``run_mode`` starts a new run: always when there is no
    run yet (``last_finished`` None), for ``fresh``, and for ``auto`` when the last run is
    finished; ``resume`` continues the last run, finished or not."""
    mode = RunMode(run_mode)
    return last_finished is None or mode is RunMode.FRESH or (
        mode is RunMode.AUTO and last_finished)


def window_start(recrawl_seconds: float | None, now: float) -> float | None:
    """The start of the recrawl window ``now`` falls in (``floor(now / W) * W``, unix
    seconds), or None without a recrawl window: a request finished before it is due again
    when it is enqueued again."""
    if recrawl_seconds is None:
        return None
    return (now // recrawl_seconds) * recrawl_seconds


class Enqueue(str, enum.Enum):
    """What enqueueing a request whose key (or fingerprint) is known comes to."""

    DUPLICATE = "duplicate"  #: pending or leased
    ALREADY_DONE = "already_done"  #: finished in the current recrawl window (or without one)
    DUE_AGAIN = "due_again"  #: finished in an earlier recrawl window: pending again


def next_revisit(interval: float | None, changed: bool, bounds: RevisitBounds) -> float:
    """A page's next revisit interval (seconds) after a visit: half of ``interval`` when the
    page's records changed since its last fetch, twice it when they did not, within
    ``bounds``. A page without an interval yet (its first fetch, or kept before adaptive
    revisits were on) starts at the shortest. (Nutch's ``AdaptiveFetchSchedule`` and
    StormCrawler's ``AdaptiveScheduler`` adapt the same way, by rates of their own.)"""
    if interval is None:
        return bounds.min_seconds
    interval = interval / 2 if changed else interval * 2
    return min(max(interval, bounds.min_seconds), bounds.max_seconds)


#: the share of a revisit interval by which a page's revisit may come early (see
#: :func:`revisit_due_at`)
REVISIT_SPREAD = 0.5


def revisit_due_at(started_at: float, interval: float, key: str, run_id: int) -> float:
    """When a page fetched (or confirmed unchanged) in the run started at ``started_at``
    is due again: after ``interval`` less up to half of it (a share drawn from the page's
    key and the run, so the same in every worker and every replay). The pages a first run
    fetched together would otherwise come due together, every time, in one run; spread,
    a site's unchanging pages are revisited a few each run, and never later than their
    interval. (A quarter was measured to leave the waves of the first run for over a
    hundred runs; half spreads them within about three longest intervals.)"""
    digest = hashlib.blake2b(f"{run_id}|{key}".encode(), digest_size=8).digest()
    share = int.from_bytes(digest, "big") / 2 ** 64
    return started_at + interval * (1 - REVISIT_SPREAD * share)


def revisit_due(due_at: float | None, now: float, bounds: RevisitBounds | None) -> bool:
    """Whether a page whose revisit time is ``due_at`` (None: none, it is due every run) is
    due at ``now`` (unix seconds, the store's clock), a little early counting
    (:attr:`.RevisitBounds.early_seconds`)."""
    return bounds is None or due_at is None or due_at - bounds.early_seconds <= now


def enqueue_decision(state: str, finished_at: float | None,
                     window: float | None) -> Enqueue:
    """The fate of a request enqueued again whose known entry is in ``state``, finished at
    ``finished_at``; ``window`` is :func:`window_start` of now."""
    if state not in TERMINAL:
        return Enqueue.DUPLICATE
    if window is not None and finished_at is not None and finished_at < window:
        return Enqueue.DUE_AGAIN
    return Enqueue.ALREADY_DONE


def known_request_answer(state: str, finished_at: float | None,
                         window: float | None) -> str | None:
    """:meth:`.FrontierStore.known_request`'s answer for a known entry: ``duplicate``,
    ``already_done``, or None when it is due again (the commit puts it back)."""
    decision = enqueue_decision(state, finished_at, window)
    return None if decision is Enqueue.DUE_AGAIN else decision.value


# -- claims -------------------------------------------------------------------------------


class ClaimedRow(NamedTuple):
    """A frontier row a claim took, as the claim statement returns it (in this order)."""

    id: int
    key: str
    fingerprint: str
    data: str
    priority: int
    is_start: Any  #: a boolean (SQLite gives 0 or 1)
    attempts: int  #: this claim's included (a claim counts the attempt)
    unfinished: int
    url: str
    replays: int
    fifo: Any  #: a boolean (SQLite gives 0 or 1)
    downloads: int  #: responses received from the network so far


#: The columns a claim returns, in :class:`ClaimedRow`'s order.
CLAIMED_COLUMNS = ("id", "key", "fingerprint", "data", "priority", "is_start", "attempts",
                   "unfinished", "url", "replays", "fifo", "downloads")


def claimed_columns(table: str = "", data: str = "{r}data") -> str:
    """:data:`CLAIMED_COLUMNS` as a claim's ``RETURNING`` list, of the rows of ``table`` (an
    alias; none: the only table). A fingerprint stored NULL is the key's (PostgreSQL
    stores it only where it differs); the stored request is read as ``data`` (an
    expression, ``{r}`` the alias and its dot: the dialect's ``DATA_READ``)."""
    prefix = f"{table}." if table else ""
    return ", ".join(f"coalesce({prefix}fingerprint, {prefix}key)" if column == "fingerprint"
                     else data.format(r=prefix) if column == "data"
                     else prefix + column for column in CLAIMED_COLUMNS)


#: How the JSON text of a request begins (the codec's: ``Request.to_dict`` puts the URL first).
_URL_MEMBER = '{"url":'
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def stored_request_data(data: str, url: str | None = None) -> str:
    """``data`` (a request's JSON text) as a frontier row that keeps the URL once stores it
    beside its ``url`` column: without its leading ``"url"`` member where that is ``url``
    (about 56 bytes a row), else whole: as given when it begins with a ``"url"`` member,
    after a space when it does not (JSON text still; :func:`request_data` then knows it
    whole). Without ``url`` (a row's own not known here): whole."""
    if url is not None:
        prefix = _URL_MEMBER + _JSON.encode(url)
        if data.startswith(prefix):
            rest = data[len(prefix):]
            if rest == "}":
                return "{}"
            if rest[:1] == "," and not rest.startswith(',"url":'):
                return "{" + rest[1:]
    return data if data.startswith(_URL_MEMBER) else " " + data


def request_data(stored: str, url: str) -> str:
    """The JSON text of a request whose row stores ``stored`` beside ``url``: the inverse of
    :func:`stored_request_data` (the text as given, exactly)."""
    if stored.startswith(_URL_MEMBER):
        return stored
    if stored.startswith(" "):
        return stored[1:]
    prefix = _URL_MEMBER + _JSON.encode(url)
    return prefix + "}" if stored == "{}" else prefix + "," + stored[1:]


def claim_order(row: ClaimedRow) -> tuple[int, bool, int]:
    """The sort key of :data:`QUEUE_ORDER` (a claim's ``RETURNING`` gives no order)."""
    return -row.priority, bool(row.is_start), row.id if row.fifo else -row.id


def isolate_after(max_attempts: int) -> int:
    """A request in flight at this many deaths runs alone (see :class:`.LeasedRequest`):
    two, so that the first replay after a kill runs at full concurrency, and one less than
    ``max_attempts`` so that its neighbours are cleared before it is quarantined."""
    return max(1, min(2, max_attempts - 1))


def quarantine_message(unfinished: int) -> str:
    """The error message of a request failed as ``quarantined``."""
    return (f"started {unfinished} times without finishing; it may kill the crawl "
            "(IDEMPOTENT_MAX_ATTEMPTS)")


def split_claim(rows: Sequence[Sequence[Any]], max_attempts: int, leased_until: float
                ) -> tuple[list[LeasedRequest], list[ClaimedRow]]:
    """Split the rows a claim took (:data:`CLAIMED_COLUMNS`) into the leases handed out, in
    the claim order, and the rows to fail as ``quarantined``: those started
    ``max_attempts`` times in a row without finishing (a page that kills the worker)."""
    claimed = sorted((ClaimedRow(*row) for row in rows), key=claim_order)
    suspect_at = isolate_after(max_attempts)
    leased = [
        LeasedRequest(key=r.key, fingerprint=r.fingerprint, data=r.data, priority=r.priority,
                      attempts=r.attempts, suspect=r.unfinished >= suspect_at,
                      downloads=r.downloads, leased_until=leased_until,
                      is_start=bool(r.is_start), rank=r.id if r.fifo else -r.id)
        for r in claimed if r.unfinished < max_attempts]
    return leased, [r for r in claimed if r.unfinished >= max_attempts]


# -- records ------------------------------------------------------------------------------


class StoredState(NamedTuple):
    """What a record write reads (and on a database of many writers, locks) of a stored
    record before deciding."""

    content_hash: str
    seen_run_id: int
    observed_at: float
    version: int


class RecordWrite(enum.Enum):
    """How one record write is decided (:func:`record_write`)."""

    INSERT = "inserted"  #: a new record ID
    UPDATE = "updated"  #: the content changed: a new version
    #: same content, first seen by this run: marked seen (and its observation moved on)
    SEEN = "seen"
    #: same content, seen by this run already, observed later: the observation moves on
    OBSERVED = "observed"
    UNCHANGED = "unchanged"  #: same content, nothing to write
    #: older than the stored data (see :func:`is_older`): refused, nothing written
    STALE = "stale"

    @property
    def change(self) -> bool:
        """A stored change (announced in the outbox, adding a version)."""
        return self in (RecordWrite.INSERT, RecordWrite.UPDATE)

    @property
    def stale(self) -> bool:
        return self is RecordWrite.STALE

    @property
    def first_sight(self) -> bool:
        """The write marks the record seen by its run for the first time (takes its place
        in the run's feeds)."""
        return self in (RecordWrite.INSERT, RecordWrite.SEEN)


def is_older(run_id: int, observed_at: float, stored_run_id: int | None,
             stored_observed_at: float) -> bool:
    """Whether data observed at ``observed_at`` in run ``run_id`` is older than the stored
    data, last observed at ``stored_observed_at`` in run ``stored_run_id`` (None: a row of
    a schema that did not know its run): the run first, so that a wall clock set back
    between two runs never makes the later run's data count as older; then the time within
    the run (equal: not older, the later commit wins)."""
    stored_run = stored_run_id or 0
    if run_id != stored_run:
        return run_id < stored_run
    return observed_at < stored_observed_at


def record_write(stored: StoredState | None, content_hash: str, observed: float,
                 run_id: int) -> RecordWrite:
    """The decision for a record with ``content_hash`` observed at ``observed`` (the store's
    clock) written by run ``run_id``, where ``stored`` is the stored record (None: none).

    Data older than the stored data (:func:`is_older`) is never stored; a record is written
    only when its content changed, or, unchanged, to mark it seen by a run or observed
    later."""
    if stored is None:
        return RecordWrite.INSERT
    if is_older(run_id, observed, stored.seen_run_id, stored.observed_at):
        # a page downloaded earlier, committed later; a worker of an earlier run: the data
        # stays, and so does the run that saw it (in the same run, this one: its feeds
        # list the record)
        return RecordWrite.STALE
    first_sight = stored.seen_run_id != run_id
    if stored.content_hash != content_hash:
        return RecordWrite.UPDATE
    if first_sight:
        return RecordWrite.SEEN
    return RecordWrite.OBSERVED if observed > stored.observed_at else RecordWrite.UNCHANGED


def after_write(stored: StoredState | None, decision: RecordWrite, content_hash: str,
                observed: float, run_id: int) -> StoredState:
    """The stored state once ``decision`` is written (a record ID twice in one unit of work
    is decided against the first write)."""
    if decision.stale:
        assert stored is not None
        return stored
    version = 1 if stored is None else stored.version + (1 if decision.change else 0)
    return StoredState(content_hash, run_id, observed, version)


# -- integrity ----------------------------------------------------------------------------


def anomaly_checks(key_of_text: str = "{c}") -> dict[str, str]:
    """The anomalies :meth:`.FrontierStore.anomalies` counts: name -> a ``SELECT count(*)``
    every backend runs as written (no parameters); ``key_of_text``: the dialect's
    ``KEY_OF_TEXT`` (another table's text key as the requests' key column holds it)."""
    terminal = ", ".join(f"'{state}'" for state in TERMINAL)
    known = ", ".join(f"'{state.value}'" for state in RequestState)
    return {
        "unknown_state": f"SELECT count(*) FROM requests WHERE state NOT IN ({known})",
        "leased_without_owner": "SELECT count(*) FROM requests WHERE state = 'leased'"
                                " AND (worker IS NULL OR leased_until IS NULL)",
        "owner_without_lease": "SELECT count(*) FROM requests WHERE state <> 'leased'"
                               " AND (worker IS NOT NULL OR leased_until IS NOT NULL)",
        "finished_without_time": "SELECT count(*) FROM requests"
                                 f" WHERE state IN ({terminal}) AND finished_at IS NULL",
        "unfinished_with_time": "SELECT count(*) FROM requests WHERE state IN"
                                " ('pending', 'leased') AND finished_at IS NOT NULL",
        "failed_without_kind": "SELECT count(*) FROM requests WHERE state = 'failed'"
                               " AND coalesce(error_kind, '') = ''",
        "finished_never_leased": "SELECT count(*) FROM requests"
                                 f" WHERE state IN ({terminal}) AND attempts < 1",
        "orphan_journal": "SELECT count(*) FROM responses WHERE NOT EXISTS (SELECT 1 FROM"
                          " requests q WHERE q.key = "
                          + key_of_text.format(c="responses.key")
                          + " AND q.state IN ('pending', 'leased'))",
        "record_times": "SELECT count(*) FROM records WHERE last_changed < first_seen"
                        " OR changed_run_id < first_run_id",
    }


# -- the spider's state ---------------------------------------------------------------------


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def apply_state_changes(state: dict[str, Any], changes: Sequence[StateChange]
                        ) -> dict[str, Any]:
    """``state`` (the stored spider state: tagged-JSON values) with ``changes`` applied in
    order: ``add`` adds its number to the number at its path (sets it where there is none:
    counters of several workers add up), ``set`` puts its value there (the last committed
    write wins), ``delete`` removes the key. The dicts on a path are made where missing (a
    value that is no dict on the way is replaced by one)."""
    for change in changes:
        node = state
        *parents, key = change.path
        for name in parents:
            child = node.get(name)
            if not isinstance(child, dict):
                child = node[name] = {}
            node = child
        if change.op == "delete":
            node.pop(key, None)
        elif change.op == "add" and _number(node.get(key)):
            node[key] = node[key] + change.value
        else:
            node[key] = change.value
    return state
