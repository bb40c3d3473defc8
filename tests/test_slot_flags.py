"""The slots' flags of pending requests (every backend): a claim by the crawl's slot limits
reads only the flagged slots, through their index, in the claim's order. Every transition of a
request into 'pending' flags its slot (the schema's triggers), so the slot is claimable
afterwards; a claim reading a flagged slot without pending requests clears its flag; the read
does not read every slot (its plan); and on PostgreSQL a flag lost to the race of a claim
clearing it with another transaction adding a request is set again before the crawl could
stall or end."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from conftest import FakeClock

from scrapy_idempotent.store.base import (
    Completion,
    FrontierStore,
    NewRequest,
    RequestState,
    SlotLimits,
    UnitOfWork,
)

LIMITS = SlotLimits(concurrency=100)
SLOT = "a.example"


def req(n: int, slot: str = SLOT, **options: Any) -> NewRequest:
    url = f"https://{slot}/{n}"
    return NewRequest(key=f"{slot}/{n}", fingerprint=f"fp-{slot}/{n}", url=url, priority=0,
                      data=json.dumps({"url": url}), slot=slot, **options)


def claim(store: FrontierStore, worker: str = "w1", count: int = 10) -> list[str]:
    return [r.key for r in store.commit(UnitOfWork(claim=count), worker).leased]


def flagged(store: Any, slot: str = SLOT) -> bool:
    (row,) = store._select("SELECT has_pending FROM slots WHERE slot = ?", (slot,))
    return bool(row[0])


@pytest.fixture
def polite(store_factory: Callable[..., FrontierStore]) -> Callable[..., FrontierStore]:
    def make(worker: str = "w1", limits: SlotLimits = LIMITS, **options: Any) -> FrontierStore:
        options.setdefault("lease_seconds", 60.0)
        store = store_factory(**options)
        store.open(fingerprinter="x")
        store.begin_session(worker, "auto")  # type: ignore[arg-type]
        store.keep_slot_limits(limits)
        return store

    return make


def leased_and_unflagged(store: FrontierStore, *requests: NewRequest) -> list[str]:
    """Add ``requests``, claim them all, and claim once more: that claim reads the slot,
    finds no pending request and clears its flag. Returns the keys leased."""
    store.commit(UnitOfWork(requests=list(requests)), "w1")
    assert flagged(store)
    keys = claim(store)
    assert sorted(keys) == sorted(r.key for r in requests)
    assert claim(store) == []
    assert not flagged(store)
    return keys


def claimable(store: FrontierStore, *keys: str) -> None:
    assert flagged(store)
    assert sorted(claim(store)) == sorted(keys)


def test_a_new_request_flags_its_slot(polite: Callable[..., FrontierStore]) -> None:
    store = polite()
    leased_and_unflagged(store, req(0))
    store.commit(UnitOfWork(requests=[req(1)]), "w1")
    claimable(store, f"{SLOT}/1")


def test_a_start_request_flags_its_slot(polite: Callable[..., FrontierStore]) -> None:
    store = polite()
    leased_and_unflagged(store, req(0))
    store.commit(UnitOfWork(requests=[req(1, is_start=True, fifo=True)]), "w1")
    claimable(store, f"{SLOT}/1")


def test_a_continuation_flags_its_slot(polite: Callable[..., FrontierStore]) -> None:
    store = polite()
    (key,) = leased_and_unflagged(store, req(0))
    store.commit(UnitOfWork(started=[key],
                            completions=[Completion(key, RequestState.PENDING)]), "w1")
    claimable(store, key)


def test_a_lease_given_back_flags_its_slot(polite: Callable[..., FrontierStore]) -> None:
    store = polite()
    (key,) = leased_and_unflagged(store, req(0))
    store.commit(UnitOfWork(give_back=[key]), "w1")
    claimable(store, key)


def test_leases_released_flag_their_slot(polite: Callable[..., FrontierStore]) -> None:
    store = polite()
    (key,) = leased_and_unflagged(store, req(0))
    assert store.release_leases(["w1"]) == 1
    claimable(store, key)


def test_an_expired_lease_taken_back_flags_its_slot(
        polite: Callable[..., FrontierStore], clock: FakeClock) -> None:
    store = polite()
    (key,) = leased_and_unflagged(store, req(0))
    clock.advance(61)
    assert store.reclaim_expired() == 1
    claimable(store, key)


def test_an_expired_lease_taken_back_by_a_claim_flags_its_slot(
        polite: Callable[..., FrontierStore], clock: FakeClock) -> None:
    cautious = SlotLimits(concurrency=100, dead_worker_pause_seconds=10.0)
    store = polite(limits=cautious)
    (key,) = leased_and_unflagged(store, req(0))
    clock.advance(61)
    assert claim(store) == []  # taken back, its slot paused for the dead worker's pause
    assert flagged(store)
    clock.advance(10)
    claimable(store, key)


def test_a_failed_request_retried_flags_its_slot(polite: Callable[..., FrontierStore]) -> None:
    store = polite()
    (key,) = leased_and_unflagged(store, req(0))
    store.commit(UnitOfWork(completions=[Completion(key, RequestState.FAILED, "http", "500")]),
                 "w1")
    assert not flagged(store)
    assert store.retry_failed().retried == 1
    claimable(store, key)


def test_a_request_due_again_flags_its_slot(polite: Callable[..., FrontierStore],
                                            clock: FakeClock) -> None:
    store = polite(recrawl_seconds=100.0)
    (key,) = leased_and_unflagged(store, req(0))
    store.commit(UnitOfWork(completions=[Completion(key, RequestState.DONE)]), "w1")
    clock.advance(101)
    result = store.commit(UnitOfWork(requests=[req(0)]), "w1")
    assert result.requests_due_again == 1
    claimable(store, key)


def test_a_claim_clears_the_flags_of_the_slots_it_finds_empty_and_reads_on(
        polite: Callable[..., FrontierStore]) -> None:
    """A claim whose read of the slots finds only emptied slots (flags not yet cleared)
    clears them and reads again: it takes the requests of the slots behind them."""
    store = polite(limits=SlotLimits(concurrency=1))
    store.commit(UnitOfWork(requests=[req(0, f"s{n:02}.example") for n in range(40)]), "w1")
    assert len(claim(store, count=40)) == 40  # every slot emptied, still flagged
    store.commit(UnitOfWork(requests=[req(1, "z.example")]), "w1")
    # a claim of 1 reads 2 x 1 + 8 = 10 slots at a time: four reads of emptied ones first
    assert claim(store, count=1) == ["z.example/1"]
    assert [s for s in (f"s{n:02}.example" for n in range(40)) if flagged(store, s)] == []
    assert flagged(store, "z.example")  # cleared by the next claim that reads it


def test_the_claims_read_of_the_slots_reads_the_head_of_their_index(
        polite: Callable[..., FrontierStore], store_database: str) -> None:
    """20,000 slots with pending requests: the claim's read of the slots (a claim of 16: 40
    slots) reads the head of the flagged slots' index, not every slot."""
    store: Any = polite(limits=SlotLimits(concurrency=1))
    store.commit(UnitOfWork(requests=[req(0, f"s{n:05}.example") for n in range(20_000)]), "w1")
    sql = store._pending_slots_sql()
    if not store_database.startswith("postgresql"):
        plan = [row[3] for row in store.conn.execute(f"EXPLAIN QUERY PLAN {sql}", (0.0, 40))]
        assert "SCAN s USING INDEX slots_pending" in plan
        assert not any("TEMP B-TREE" in step for step in plan)  # in the index's order
        return
    with store._write() as cur:
        (explained,) = cur.execute(store._q(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}"),
                                   (0.0, 40)).fetchone()
    slot_scans: list[dict[str, Any]] = []

    def walk(node: dict[str, Any]) -> None:
        if node.get("Relation Name") == "slots":
            slot_scans.append(node)
        for child in node.get("Plans", ()):
            walk(child)

    walk(explained[0]["Plan"])
    assert [(n["Node Type"], n.get("Index Name"), n["Actual Rows"] <= 40)
            for n in slot_scans] == [("Index Scan", "slots_pending", True)]


def test_a_flag_cleared_by_a_claim_racing_a_commit_is_set_again(
        polite: Callable[..., FrontierStore], store_database: str) -> None:
    """PostgreSQL, READ COMMITTED: a transaction adds a request to a flagged slot without
    pending requests (its trigger finds the flag set: nothing to write) and commits only
    after a claim read the slot, found it empty and cleared its flag. The request is pending,
    its slot not flagged: the next claim finds nothing to take and nothing soon, flags the
    slot again and asks to claim at once; the one after takes the request."""
    if not store_database.startswith("postgresql"):
        pytest.skip("SQLite writes one transaction at a time: no such race")
    import psycopg

    store: Any = polite()
    other = polite("w2")
    leased_and_unflagged(store, req(0))
    store.commit(UnitOfWork(requests=[req(1)]), "w1")  # flagged again
    assert claim(store) == [f"{SLOT}/1"]  # emptied, still flagged
    assert flagged(store)
    with psycopg.connect(store_database, autocommit=False) as adding:
        adding.execute("SELECT set_config('search_path', %s, false)", (f'"{store.schema}"',))
        adding.execute(
            "INSERT INTO requests (key, fingerprint, url, priority, state, data, enqueued_at,"
            " run_id, slot) VALUES (%s, %s, %s, 0, 'pending', '{}', 0, 1, %s)",
            # (the keys as the store keeps them: bytes, schema 22)
            (store._key(f"{SLOT}/2"), store._key(f"fp-{SLOT}/2"), f"https://{SLOT}/2", SLOT))
        # the other worker's claim: reads the slot, sees no pending request, clears the flag
        assert claim(other, "w2") == []
        assert not flagged(store)
        adding.commit()
    assert not flagged(store)  # the race's outcome: a pending request, its slot unflagged
    result = other.commit(UnitOfWork(claim=10), "w2")
    assert result.leased == [] and result.claim_again_in == 0.0
    claimable(other, f"{SLOT}/2")


def test_a_slow_repair_of_the_flags_is_made_again_only_after_twenty_times_as_long(
        polite: Callable[..., FrontierStore], store_database: str, clock: FakeClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim that finds nothing to take reads every unflagged slot to repair their flags
    (0.6 s at a million sites): after one that took a second, the worker's claims ask to
    come back in 20 s instead of repairing again, and repair once they do."""
    if not store_database.startswith("postgresql"):
        pytest.skip("SQLite writes one transaction at a time: no race to repair")
    from scrapy_idempotent.store import sql_politeness

    store: Any = polite()
    leased_and_unflagged(store, req(0))
    repairs: list[float] = []
    repair = store._flag_pending_slots
    ticks = iter(range(0, 1000, 1))  # each reading a second later: a repair takes 1 s
    monkeypatch.setattr(sql_politeness, "perf_counter", lambda: float(next(ticks)))
    monkeypatch.setattr(store, "_flag_pending_slots",
                        lambda cur: repairs.append(clock()) or repair(cur))
    first = store.commit(UnitOfWork(claim=10), "w1")
    assert (first.leased, len(repairs)) == ([], 1)
    clock.advance(5)
    again = store.commit(UnitOfWork(claim=10), "w1")
    assert (again.leased, len(repairs), again.claim_again_in) == ([], 1, 15.0)
    clock.advance(15)
    assert store.commit(UnitOfWork(claim=10), "w1").leased == []
    assert len(repairs) == 2


def test_two_stores_racing_adds_and_claims_leave_no_request_unclaimable(
        polite: Callable[..., FrontierStore], store_database: str) -> None:
    """One store adds requests to 3 slots one page at a time while another claims and
    completes them (PostgreSQL: claims clearing the flags of slots they found empty race
    the adding commits). Once every request is added, claims take every one that remains:
    a claim that takes nothing either says when to ask again or leaves nothing pending."""
    import threading

    adder, claimer = polite("w1"), polite("w2")
    added = 300
    errors: list[BaseException] = []

    def add() -> None:
        try:
            for n in range(added):
                adder.commit(UnitOfWork(requests=[req(n, f"s{n % 3}.example")]), "w1")
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    adding = threading.Thread(target=add)
    adding.start()
    claimed: set[str] = set()

    def claim_and_complete() -> Any:
        result = claimer.commit(UnitOfWork(claim=5), "w2")
        keys = [r.key for r in result.leased]
        claimed.update(keys)
        if keys:
            claimer.commit(UnitOfWork(
                started=keys, completions=[Completion(k, RequestState.DONE) for k in keys]),
                "w2")
        return result

    while adding.is_alive():
        claim_and_complete()
    adding.join()
    assert errors == []
    everything = {req(n, f"s{n % 3}.example").key for n in range(added)}
    empty_in_a_row = 0
    while len(claimed) < added:
        result = claim_and_complete()
        empty_in_a_row = 0 if result.leased else empty_in_a_row + 1
        # nothing taken: a claim flagged a slot again and asked to come back at once (the
        # next one takes from it), or a request is lost
        assert empty_in_a_row < 2, sorted(everything - claimed)[:5]
        assert result.leased or result.claim_again_in == 0.0, sorted(everything - claimed)[:5]
    assert claimer.counts()["pending"] == 0


def test_a_crawl_migrated_to_postgresql_has_its_slots_flagged(tmp_path: Any,
                                                             postgres_url: str) -> None:
    """``migrate``'s copy to PostgreSQL (requests copied before their slots have rows to
    flag) flags the slots with pending requests, and only those: claims take them."""
    from scrapy_idempotent.store import open_store

    clock = FakeClock(1000.0)
    source: Any = open_store(f"sqlite:///{tmp_path / 'crawl.db'}", clock=clock)
    source.open(fingerprinter="f")
    source.begin_session("w1", "auto")
    source.keep_slot_limits(LIMITS)
    source.commit(UnitOfWork(requests=[req(0), req(1, "b.example")]), "w1")
    assert sorted(claim(source)) == [f"{SLOT}/0", "b.example/1"]
    source.commit(UnitOfWork(started=["b.example/1"], completions=[
        Completion("b.example/1", RequestState.DONE)]), "w1")
    source.commit(UnitOfWork(give_back=[f"{SLOT}/0"]), "w1")
    target: Any = open_store(postgres_url, clock=clock)
    target.open(fingerprinter="f")
    with source.frozen():
        target.load(source.dump())
    source.close()
    target.begin_session("w1", "auto")
    target.keep_slot_limits(LIMITS)
    assert (flagged(target), flagged(target, "b.example")) == (True, False)
    assert claim(target) == [f"{SLOT}/0"]
