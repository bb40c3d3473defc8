"""The outbox part of the store contract: entries written by ``commit()`` in the transaction
of the record change they announce, claimed with a hold, settled once.

Runs against every store backend (``store_factory``, through the store contract's fixtures
``make_store`` and ``store`` of ``tests/conftest.py``), with the fake clock, reading through the
interface only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from crawling import db_rows
from helpers.stores import (
    HOOK,
    LEASE_SECONDS,
    claim,
    enqueue,
    fetch_page,
    page,
    rec,
    records,
    req,
    row,
    sqlite_at_version,
)
from scrapy_idempotent.exceptions import StoreError
from scrapy_idempotent.store import (
    SCHEMA_VERSION,
    Completion,
    OutboxOutcome,
    OutboxState,
    RequestState,
    SQLiteStore,
    UnitOfWork,
)

BROKER = "myproject.targets.Broker"


def entries(store: Any) -> list[tuple[Any, ...]]:
    return [(e.target, e.key, e.kind, e.record_id, e.state) for e in store.outbox_entries()]


def test_inserted_and_updated_records_are_announced_unchanged_ones_not(store):
    result = fetch_page(store, "a", rec("r1", "h1"), rec("r2", "h2"))
    assert result.outbox_entries == 2
    fetch_page(store, "b", rec("r1", "h1"), rec("r2", "h3"))  # r1 unchanged, r2 changed
    assert entries(store) == [
        (HOOK, "r1:1:h1", "inserted", "r1", "pending"),
        (HOOK, "r2:1:h2", "inserted", "r2", "pending"),
        (HOOK, "r2:2:h3", "updated", "r2", "pending"),
    ]


def test_one_entry_per_target_with_the_same_key(store):
    fetch_page(store, "a", rec("r1", "h1"), targets=(HOOK, BROKER))
    assert [(t, k) for t, k, *_ in entries(store)] == [(HOOK, "r1:1:h1"), (BROKER, "r1:1:h1")]


def test_no_target_no_entry(store):
    result = fetch_page(store, "a", rec("r1", "h1"), targets=())
    assert result.records_inserted == 1 and result.outbox_entries == 0
    assert entries(store) == []
    assert store.outbox_counts() == {}


def test_a_lost_lease_announces_nothing(store, clock):
    enqueue(store, req("a"))
    claim(store, 1, worker="w1")
    clock.advance(LEASE_SECONDS + 1)
    store.reclaim_expired()
    claim(store, 1, worker="w2")
    result = page(store, "a", rec("r1", "h1"), worker="w1")
    assert result.leases_lost == 1 and result.outbox_entries == 0
    assert entries(store) == []
    page(store, "a", rec("r1", "h1"), worker="w2")
    assert [k for _, k, *_ in entries(store)] == ["r1:1:h1"]


def test_an_outbox_write_that_fails_takes_the_records_and_the_completion_with_it(store):
    """Records and their announcements are one transaction: when the outbox write fails
    (a target of None breaks a NOT NULL column), nothing of the unit is stored."""
    enqueue(store, req("a"))
    claim(store, 1)
    work = UnitOfWork(records=[(rec("r1", "h1"), "a")],
                      completions=[Completion("a", RequestState.DONE)],
                      outbox_targets=(HOOK, None))  # type: ignore[arg-type]
    with pytest.raises(StoreError):
        store.commit(work, "w1")
    assert entries(store) == []
    assert records(store) == []
    assert row(store, "a")[0] == "leased"
    work.outbox_targets = (HOOK,)
    assert store.commit(work, "w1").outbox_entries == 1


def test_entry_carries_the_record_and_the_run(store):
    fetch_page(store, "a", rec("r1", "h1", data='{"sku": "A1", "price": "3"}'))
    [entry] = store.claim_outbox([HOOK], 10, 30.0)
    assert (entry.target, entry.key, entry.kind, entry.record_id, entry.content_hash) == (
        HOOK, "r1:1:h1", "inserted", "r1", "h1")
    assert (entry.item_type, entry.source, entry.natural_key) == ("dict", "shop", '["A1"]')
    assert entry.data == '{"sku": "A1", "price": "3"}'
    assert entry.run_id == store.runs()[-1].run_id
    assert entry.attempts == 0


def test_claim_holds_entries_until_the_hold_ends(store, clock):
    fetch_page(store, "a", rec("r1", "h1"), rec("r2", "h2"))
    assert [e.key for e in store.claim_outbox([HOOK], 1, 30.0)] == ["r1:1:h1"]
    assert [e.key for e in store.claim_outbox([HOOK], 10, 30.0)] == ["r2:1:h2"]
    assert store.claim_outbox([HOOK], 10, 30.0) == []
    clock.advance(31)  # the holder died: due again
    assert [e.key for e in store.claim_outbox([HOOK], 10, 30.0)] == ["r1:1:h1", "r2:1:h2"]


def test_claim_takes_only_the_targets_asked_for(store):
    fetch_page(store, "a", rec("r1", "h1"), targets=(HOOK, BROKER))
    assert [e.target for e in store.claim_outbox([BROKER], 10, 30.0)] == [BROKER]
    assert store.claim_outbox([], 10, 30.0) == []


def test_settle_delivered_failed_and_retry(store, clock):
    fetch_page(store, "a", rec("r1", "h1"), rec("r2", "h2"), rec("r3", "h3"))
    one, two, three = store.claim_outbox([HOOK], 10, 30.0)
    store.settle_outbox([
        OutboxOutcome(one.entry_id, OutboxState.DELIVERED, "200"),
        OutboxOutcome(two.entry_id, OutboxState.FAILED, "400 bad payload"),
        OutboxOutcome(three.entry_id, OutboxState.PENDING, "503", retry_at=clock() + 5),
    ])
    assert store.outbox_counts() == {HOOK: {"pending": 1, "delivered": 1, "failed": 1}}
    assert [(e.state, e.attempts, e.detail, e.data is None)
            for e in store.outbox_entries()] == [("delivered", 1, "200", True),
                                                 ("failed", 1, "400 bad payload", False),
                                                 ("pending", 1, "503", False)]
    assert store.claim_outbox([HOOK], 10, 30.0) == []  # not due before its retry time
    clock.advance(5)
    [again] = store.claim_outbox([HOOK], 10, 30.0)
    assert (again.key, again.attempts) == ("r3:1:h3", 1)


def test_a_final_state_is_never_changed_by_a_late_outcome(store):
    fetch_page(store, "a", rec("r1", "h1"))
    [entry] = store.claim_outbox([HOOK], 10, 30.0)
    store.settle_outbox([OutboxOutcome(entry.entry_id, OutboxState.DELIVERED, "200")])
    store.settle_outbox([OutboxOutcome(entry.entry_id, OutboxState.PENDING, "503", 0.0),
                         OutboxOutcome(entry.entry_id, OutboxState.FAILED, "400")])
    assert [(e.state, e.attempts) for e in store.outbox_entries()] == [("delivered", 1)]


def test_new_run_keeps_undelivered_entries(make_store, store):
    fetch_page(store, "a", rec("r1", "h1"))
    store.end_session("w1", "finished")
    store.begin_session("w1", "auto")  # a new run clears the frontier
    assert [e.key for e in store.claim_outbox([HOOK], 10, 30.0)] == ["r1:1:h1"]


def test_sqlite_a_schema_5_database_gains_the_outbox(tmp_path: Path):
    path = tmp_path / "old.sqlite3"
    sqlite_at_version(
        path, 5, "INSERT INTO runs (run_id, started_at) VALUES (1, 1.0)",
        "INSERT INTO records (record_id, source, natural_key, item_type, data, content_hash,"
        " first_seen, last_changed, first_run_id, changed_run_id, seen_run_id, seen_at)"
        " VALUES ('r1', 'shop', '[\"A1\"]', 'dict', '{}', 'h1', 1.0, 1.0, 1, 1, 1, 1.0)")
    again = SQLiteStore(str(path))
    again.open(fingerprinter="x")
    again.begin_session("w1", "auto")
    assert db_rows(path, "PRAGMA user_version") == [(SCHEMA_VERSION,)]
    again.commit(UnitOfWork(records=[(rec("r1", "h2"), None)], outbox_targets=(HOOK,)), "w1")
    assert entries(again) == [(HOOK, "r1:2:h2", "updated", "r1", "pending")]
    again.close()
