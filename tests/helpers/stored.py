"""What a crawl stored, read through the store interface (``FrontierStore``), so a crawl
test asserts the same on every backend: ``database`` is what ``IDEMPOTENT_DATABASE`` was (a
SQLite path, or a PostgreSQL URL holding one crawl)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from scrapy_idempotent.store import FrontierStore, RequestState
from scrapy_idempotent.store.base import RejectedItem, StoredRecord
from scrapy_idempotent.store.reads import FrontierEntry
from scrapy_idempotent.store.registry import open_store


@contextlib.contextmanager
def reading(database: str | Path) -> Iterator[FrontierStore]:
    """The store of ``database``, opened read-only as the operator commands open it."""
    store = open_store(str(database))
    store.open_existing(readonly=True)
    try:
        yield store
    finally:
        store.close()


def stored_records(database: str | Path) -> list[StoredRecord]:
    """Every record, in record ID order."""
    found: list[StoredRecord] = []
    with reading(database) as store:
        while page := store.records_page(after=found[-1].record_id if found else None):
            found.extend(page)
    return found


def stored_products(database: str | Path) -> list[dict[str, Any]]:
    """Every record's data, as dicts."""
    return [json.loads(record.data) for record in stored_records(database)]


def frontier_counts(database: str | Path) -> dict[str, int]:
    """The frontier's requests per state, the states that have any."""
    with reading(database) as store:
        counts = store.counts()
    return {state.value: counts[state.value] for state in RequestState
            if counts.get(state.value)}


def stored_rejects(database: str | Path) -> list[RejectedItem]:
    """Every rejected item, newest first."""
    with reading(database) as store:
        return store.rejects()


def frontier_entries(database: str | Path) -> list[FrontierEntry]:
    """Every request of the frontier, in key order."""
    found: list[FrontierEntry] = []
    with reading(database) as store:
        while page := store.entries(after=found[-1].key if found else None):
            found.extend(page)
    return found


def request_keys(database: str | Path) -> dict[str, str]:
    """URL path -> frontier key."""
    return {urlsplit(entry.url).path: entry.key for entry in frontier_entries(database)}
