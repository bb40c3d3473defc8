"""What a crawl stored, read through the store interface (``FrontierStore``), so a crawl
test asserts the same on every backend: ``database`` is what ``IDEMPOTENT_DATABASE`` was (a
SQLite path, or a PostgreSQL URL holding one crawl)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from scrapy_idempotent.exceptions import StoreError
from scrapy_idempotent.store import FrontierStore, RequestState
from scrapy_idempotent.store.base import RejectedItem, StoredRecord
from scrapy_idempotent.store.reads import (
    FrontierEntry,
    IntegrityReport,
    OutboxRow,
    RunSummary,
    SessionInfo,
)
from scrapy_idempotent.store.registry import open_store, sqlite_path

Row = TypeVar("Row")


@contextlib.contextmanager
def reading(database: str | Path) -> Iterator[FrontierStore]:
    """The store of ``database``, opened read-only as the operator commands open it."""
    store = open_store(str(database))
    info = store.open_existing(readonly=True)
    try:
        if info.version == 0:  # a crawl is creating it: no tables yet
            raise StoreError(f"no frontier in {database} yet")
        yield store
    finally:
        store.close()


def every_page(database: str | Path, read: Callable[[FrontierStore, Any], list[Row]],
               after: Callable[[Row], Any]) -> list[Row]:
    """Every row of a keyset-paged read: ``read(store, after)`` gives the page after the
    key ``after`` (None: the first page), ``after(row)`` a row's key."""
    found: list[Row] = []
    with reading(database) as store:
        while page := read(store, after(found[-1]) if found else None):
            found.extend(page)
    return found


def stored_records(database: str | Path) -> list[StoredRecord]:
    """Every record, in record ID order."""
    return every_page(database, lambda store, key: store.records_page(after=key),
                      lambda record: record.record_id)


def stored_products(database: str | Path) -> list[dict[str, Any]]:
    """Every record's data, as dicts."""
    return [json.loads(record.data) for record in stored_records(database)]


def run_products(database: str | Path, run_id: int) -> list[dict[str, Any]]:
    """The data of every record run ``run_id`` stored or saw (what its feeds hold), as dicts,
    in the order the run first stored or saw them."""
    with reading(database) as store:
        return [json.loads(record.data) for record in store.run_records(run_id)]


def stored_runs(database: str | Path) -> list[RunSummary]:
    """Every run, in run ID order."""
    with reading(database) as store:
        return store.runs()


def frontier_counts(database: str | Path) -> dict[str, int]:
    """The frontier's requests per state, the states that have any."""
    with reading(database) as store:
        counts = store.counts()
    return {state.value: counts[state.value] for state in RequestState
            if counts.get(state.value)}


def requests_done(database: str | Path) -> int:
    """Frontier entries done so far, while a crawl may be writing (0 while its database is
    not created yet)."""
    try:
        return frontier_counts(database).get("done", 0)
    except Exception:  # not created yet
        return 0


def records_stored(database: str | Path) -> int:
    """Records stored so far, while a crawl may be writing (0 while its database is not
    created yet)."""
    try:
        with reading(database) as store:
            return int(store.counts().get("records", 0))
    except Exception:  # not created yet
        return 0


def stored_sessions(database: str | Path) -> list[SessionInfo]:
    """Every session (one per crawl process that opened the database), oldest first."""
    with reading(database) as store:
        return store.sessions()


def journaled_responses(database: str | Path) -> int:
    """Responses kept in the response journal (none once their pages are finished)."""
    with reading(database) as store:
        return store.request_summary().journaled_responses


def integrity_report(database: str | Path) -> IntegrityReport:
    """The database engine's own consistency check, as ``scrapy idempotent check`` runs it
    (on SQLite ``PRAGMA integrity_check``; on PostgreSQL its tables and indexes)."""
    with reading(database) as store:
        return store.integrity_check()


def stored_rejects(database: str | Path) -> list[RejectedItem]:
    """Every rejected item, newest first."""
    with reading(database) as store:
        return store.rejects()


def frontier_entries(database: str | Path) -> list[FrontierEntry]:
    """Every request of the frontier, in key order."""
    return every_page(database, lambda store, key: store.entries(after=key),
                      lambda entry: entry.key)


def request_states(database: str | Path) -> dict[str, str]:
    """URL -> state of every frontier request (none while the database is not created
    yet)."""
    try:
        return {entry.url: entry.state for entry in frontier_entries(database)}
    except StoreError:  # not created yet
        return {}


def leases_by_worker(database: str | Path) -> dict[str, int]:
    """Worker -> requests it holds leased (none while the database is not created yet)."""
    try:
        with reading(database) as store:
            return {holder.worker: holder.leases for holder in store.lease_holders()}
    except StoreError:  # not created yet
        return {}


def request_keys(database: str | Path) -> dict[str, str]:
    """URL path -> frontier key."""
    return {urlsplit(entry.url).path: entry.key for entry in frontier_entries(database)}


def outbox_rows(database: str | Path) -> list[OutboxRow]:
    """Every outbox entry, in the order written."""
    return every_page(database, lambda store, key: store.outbox_entries(after=key),
                      lambda row: row.entry_id)


def outbox_states(database: str | Path) -> dict[str, int]:
    """Outbox entries per state, over every target, the states that have any."""
    with reading(database) as store:
        counts = store.outbox_counts()
    states: dict[str, int] = {}
    for by_state in counts.values():
        for state, n in by_state.items():
            if n:
                states[state] = states.get(state, 0) + n
    return states


# -- what no store method changes: a test's shortcuts -------------------------------------


def change_stored(database: str | Path, sql: str, params: Sequence[Any] = ()) -> None:
    """Run ``sql``, a statement both SQLite and PostgreSQL take (``?`` placeholders for
    ``params``), in the crawl's tables: a test's shortcut to a state no store method
    writes."""
    path = sqlite_path(str(database))
    if path is not None:
        import sqlite3

        conn = sqlite3.connect(path)
        try:
            with conn:
                conn.execute(sql, params)
        finally:
            conn.close()
        return
    import psycopg

    with reading(database) as store:  # the crawl's schema, and the URL without ?schema=
        url, schema = store.url, store.schema  # type: ignore[attr-defined]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT set_config('search_path', %s, false)", (f'"{schema}"',))
        conn.execute(sql.replace("?", "%s"), params)  # type: ignore[arg-type]


def stored_key(database: str | Path, key: str) -> Any:
    """``key`` as a parameter of :func:`change_stored` for the requests table's key columns:
    as it is on SQLite; on PostgreSQL the bytes the store keeps (schema 22), through its own
    codec (``helpers.named_keys`` in the test process)."""
    if sqlite_path(str(database)) is not None:
        return key
    with reading(database) as store:
        return store._key(key)  # type: ignore[attr-defined]


def rewrite_stored_requests(database: str | Path, change: Callable[[str], str]) -> None:
    """Replace the JSON text of every request of the frontier by ``change(text)``, stored
    whole as text (as a release before packing wrote it; the stores read such rows as they
    are): a test's shortcut to a stored request the code no longer matches."""
    packed = sqlite_path(str(database)) is None  # PostgreSQL: its column beside data
    for entry in frontier_entries(database):
        change_stored(database, "UPDATE requests SET data = ?"
                      + (", packed = NULL" if packed else "") + " WHERE key = ?",
                      (change(entry.data), stored_key(database, entry.key)))


def outbox_due_now(database: str | Path) -> None:
    """Make every outbox entry due now, whatever its backoff said (a shortcut past a retry
    delay); attempts and details are left as they are."""
    change_stored(database, "UPDATE outbox SET due_at = 0")


def add_to_run_counter(database: str | Path, run_id: int, counter: str, n: int) -> None:
    """Add ``n`` to the counter ``counter`` (``done``, ``failed``...) of run ``run_id``, as
    more commits of its workers would (a shortcut: the counters live in the table
    ``COUNTER_TABLE`` of the store, one row per run on SQLite, per session on PostgreSQL:
    the first row of the run takes it)."""
    with reading(database) as store:
        table = store.COUNTER_TABLE  # type: ignore[attr-defined]
    key = "run_id" if table == "runs" else "session_id"
    change_stored(database, f"UPDATE {table} SET {counter} = {counter} + ?"
                            f" WHERE {key} = (SELECT min({key}) FROM {table} WHERE run_id = ?)",
                  (n, run_id))
