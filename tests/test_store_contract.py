"""The store contract (``scrapy_idempotent.store.base``), without Scrapy.

Every test runs against each store backend (the ``store_factory`` fixture of
``tests/conftest.py``, where a backend is added) and reads state through the
``FrontierStore`` interface only, so the same tests hold for any backend. Tests of one
backend's own files and settings live in files of their own (``test_sqlite_store.py``).

Time never passes by itself: every store gets a ``FakeClock`` that the tests move forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from conftest import T0

from helpers.stores import (
    LEASE_SECONDS,
    claim,
    claim_keys,
    complete,
    count_reads,
    counts,
    enqueue,
    entries,
    frontier_keys,
    journal,
    rec,
    records,
    req,
    row,
)
from scrapy_idempotent.exceptions import StoreError
from scrapy_idempotent.store import (
    CommitResult,
    Completion,
    FrontierStatus,
    LeasedRequest,
    LeaseHolder,
    OutboxOutcome,
    OutboxState,
    Record,
    Reject,
    RequestState,
    RunInfo,
    UnitOfWork,
)
from scrapy_idempotent.store.base import StoredRecord


def open_store(make_store: Callable[..., Any], worker: str, run_mode: str = "auto",
               **options: Any) -> tuple[Any, RunInfo]:
    store = make_store(**options)
    store.open(fingerprinter="x")
    return store, store.begin_session(worker, run_mode)


# -- idempotent enqueue ---------------------------------------------------------------------


def test_enqueue_same_key_twice_keeps_one_row(store):
    assert enqueue(store, req("a")) == CommitResult(requests_added=1)
    assert enqueue(store, req("a")) == CommitResult(requests_duplicate=1)
    assert store.counts() == counts(pending=1)
    assert frontier_keys(store) == ["a"]


def test_enqueue_same_key_twice_in_one_unit(store):
    assert enqueue(store, req("a"), req("a")) == CommitResult(requests_added=1,
                                                              requests_duplicate=1)
    assert store.counts() == counts(pending=1)


def test_enqueue_of_a_leased_key_is_a_duplicate(store):
    enqueue(store, req("a"))
    assert claim_keys(store, 1) == ["a"]
    assert enqueue(store, req("a")) == CommitResult(requests_duplicate=1)
    assert row(store, "a") == ("leased", "w1", 1)


def test_enqueue_of_a_done_key_is_already_done(store):
    enqueue(store, req("a"))
    claim(store, 1)
    assert complete(store, "a").completed == {"done": 1}
    assert enqueue(store, req("a")) == CommitResult(requests_already_done=1)
    assert store.counts() == counts(done=1)


def test_start_request_of_a_done_key_is_already_done(store):
    # start requests (dont_filter) are re-yielded on every run, without the fingerprint filter
    enqueue(store, req("start:0", is_start=True, filter_fingerprint=False))
    claim(store, 1)
    complete(store, "start:0")
    assert enqueue(store, req("start:0", is_start=True, filter_fingerprint=False)) == (
        CommitResult(requests_already_done=1))
    assert enqueue(store, req("start:0", is_start=True, filter_fingerprint=False,
                              fingerprint="changed")) == CommitResult(requests_already_done=1)
    assert store.counts() == counts(done=1)


def test_enqueue_of_a_failed_key_is_already_done(store):
    enqueue(store, req("a"))
    claim(store, 1)
    complete(store, "a", RequestState.FAILED, error_kind="dns", error_message="no such host")
    assert enqueue(store, req("a")) == CommitResult(requests_already_done=1)


def test_known_key_is_not_inserted_even_without_fingerprint_filter(store):
    enqueue(store, req("a"))
    assert enqueue(store, req("a", filter_fingerprint=False)) == CommitResult(
        requests_duplicate=1)
    assert store.counts() == counts(pending=1)


def test_fingerprint_filter_drops_a_request_known_under_another_key(store):
    # a dont_filter start request for the URL was stored under its own key
    enqueue(store, req("start:0", fingerprint="F", is_start=True, filter_fingerprint=False))
    assert enqueue(store, req("F", fingerprint="F")) == CommitResult(requests_duplicate=1)
    assert frontier_keys(store) == ["start:0"]


def test_fingerprint_filter_counts_a_finished_fingerprint_as_already_done(store):
    enqueue(store, req("start:0", fingerprint="F", filter_fingerprint=False))
    claim(store, 1)
    complete(store, "start:0")
    assert enqueue(store, req("F", fingerprint="F")) == CommitResult(requests_already_done=1)
    assert frontier_keys(store) == ["start:0"]


def test_without_fingerprint_filter_a_new_key_is_inserted(store):
    enqueue(store, req("F", fingerprint="F"))
    result = enqueue(store, req("F:retry:1", fingerprint="F", filter_fingerprint=False))
    assert result == CommitResult(requests_added=1)
    assert frontier_keys(store) == ["F", "F:retry:1"]
    assert store.counts() == counts(pending=2)


# -- leasing order and exclusivity ----------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3, 10])
def test_claim_order_priority_then_non_start_then_newest(store, batch):
    for new in [
        req("start1", is_start=True),
        req("a"),
        req("start2", is_start=True),
        req("high", priority=5),
        req("b"),
        req("low", priority=-1),
        req("high-start", priority=5, is_start=True),
    ]:
        enqueue(store, new)  # one transaction each: enqueue order is age order
    claimed: list[str] = []
    while leased := claim_keys(store, batch):
        assert len(leased) <= batch
        claimed.extend(leased)
    assert claimed == ["high", "high-start", "b", "a", "start2", "start1", "low"]


def test_claim_order_within_one_unit_is_newest_first(store):
    enqueue(store, req("first"), req("second"), req("third"))
    assert claim_keys(store, 3) == ["third", "second", "first"]


def test_claimed_request_carries_its_data(store):
    new = req("a", priority=4)
    enqueue(store, new)
    assert claim(store, 1) == [
        LeasedRequest(key="a", fingerprint="fp-a", data=new.data, priority=4, attempts=1)]
    assert row(store, "a") == ("leased", "w1", 1)


def test_claims_never_return_a_request_twice(store):
    enqueue(store, *(req(f"r{i}") for i in range(5)))
    first = claim_keys(store, 2)
    second = claim_keys(store, 2)
    third = claim_keys(store, 2)
    assert (len(first), len(second), len(third)) == (2, 2, 1)
    assert sorted(first + second + third) == ["r0", "r1", "r2", "r3", "r4"]
    assert claim_keys(store, 2) == []
    assert claim_keys(store, 2, worker="w2") == []


def test_second_worker_cannot_claim_what_the_first_holds(store):
    enqueue(store, req("a"), req("b"))
    assert claim_keys(store, 5, worker="w1") == ["b", "a"]
    assert claim_keys(store, 5, worker="w2") == []
    assert store.counts() == counts(leased=2)


def test_second_connection_cannot_claim_what_the_first_holds(store, make_store):
    enqueue(store, req("a"), req("b"))
    assert claim_keys(store, 1, worker="w1") == ["b"]
    other, run = open_store(make_store, "w2")
    assert (run.run_id, run.new) == (1, False)
    assert claim_keys(other, 5, worker="w2") == ["a"]
    assert claim_keys(store, 5, worker="w1") == []
    assert row(other, "b") == ("leased", "w1", 1)
    assert row(store, "a") == ("leased", "w2", 1)


# -- lease expiry, renewal, release ---------------------------------------------------------


def test_expired_lease_is_reclaimed_only_after_lease_seconds(store, clock):
    enqueue(store, req("a"))
    claim(store, 1, worker="w1")
    clock.advance(LEASE_SECONDS - 1)
    assert store.reclaim_expired() == 0
    assert row(store, "a") == ("leased", "w1", 1)
    assert claim_keys(store, 1, worker="w2") == []
    clock.advance(2)
    assert store.reclaim_expired() == 1
    assert row(store, "a") == ("pending", None, 1)
    assert claim(store, 1, worker="w2")[0].attempts == 2
    assert row(store, "a") == ("leased", "w2", 2)


def test_lease_holders_report_workers_counts_and_expiry(store, clock):
    assert store.lease_holders() == []
    enqueue(store, req("a"), req("b"), req("c"))
    claim(store, 1, worker="w1")
    clock.advance(10)
    claim(store, 1, worker="w2")
    clock.advance(10)
    claim(store, 1, worker="w1")
    holders = sorted(store.lease_holders(), key=lambda h: h.worker)
    assert holders == [  # the latest expiry among a worker's leases
        LeaseHolder(worker="w1", leases=2, leased_until=T0 + 20 + LEASE_SECONDS),
        LeaseHolder(worker="w2", leases=1, leased_until=T0 + 10 + LEASE_SECONDS),
    ]


def test_renew_leases_pushes_expiry(store, clock):
    enqueue(store, req("a"), req("b"))
    claim(store, 2, worker="w1")
    clock.advance(50)
    assert sorted(store.renew_leases("w1")) == ["a", "b"]
    assert store.renew_leases("w2") == []
    assert store.lease_holders() == [
        LeaseHolder(worker="w1", leases=2, leased_until=T0 + 50 + LEASE_SECONDS)]
    clock.advance(20)  # past the first expiry, before the renewed one
    assert store.reclaim_expired() == 0
    clock.advance(LEASE_SECONDS - 20 + 1)
    assert store.reclaim_expired() == 2
    assert store.counts() == counts(pending=2)


def test_renew_leases_touches_only_that_worker(store, clock):
    enqueue(store, req("a"), req("b"))
    claim(store, 1, worker="w1")
    claim(store, 1, worker="w2")
    clock.advance(30)
    store.renew_leases("w1")
    clock.advance(LEASE_SECONDS - 30 + 1)
    assert store.reclaim_expired() == 1
    assert store.lease_holders() == [
        LeaseHolder(worker="w1", leases=1, leased_until=T0 + 30 + LEASE_SECONDS)]


def test_release_leases_puts_back_only_the_named_workers(store):
    enqueue(store, req("a"), req("b"), req("c"))
    assert claim_keys(store, 2, worker="w1") == ["c", "b"]
    assert claim_keys(store, 1, worker="w2") == ["a"]
    assert store.release_leases(["w1"]) == 2
    assert store.release_leases([]) == 0
    assert store.release_leases(["w3"]) == 0
    assert store.counts() == counts(pending=2, leased=1)
    assert row(store, "b") == ("pending", None, 1)
    assert [h.worker for h in store.lease_holders()] == ["w2"]
    assert store.release_leases(["w1", "w2"]) == 1
    assert store.lease_holders() == []


# -- completion in one transaction ----------------------------------------------------------


def test_completion_commits_children_records_and_done_together(store, clock):
    enqueue(store, req("parent"))
    claim(store, 1)
    clock.advance(5)
    result = store.commit(
        UnitOfWork(
            requests=[req("child1", parent_key="parent"), req("child2", parent_key="parent")],
            records=[(rec("r1", "h1"), "parent")],
            completions=[Completion("parent", RequestState.DONE)],
        ),
        "w1",
    )
    assert result == CommitResult(requests_added=2, records_inserted=1, completed={"done": 1})
    assert store.counts() == counts(pending=2, done=1, records=1)
    assert row(store, "parent") == ("done", None, 1)
    assert [(e.key, e.parent_key) for e in entries(store) if e.state == "pending"] == [
        ("child1", "parent"), ("child2", "parent")]
    assert [(r.record_id, r.source, r.natural_key, r.item_type, r.data, r.content_hash,
             r.first_seen, r.last_changed, r.request_key) for r in records(store)] == [
        ("r1", "shop", '["A1"]', "dict", '{"sku":"A1"}', "h1", T0 + 5, T0 + 5, "parent")]


def test_completion_and_claim_in_one_unit(store):
    enqueue(store, req("parent"))
    claim(store, 1)
    result = store.commit(
        UnitOfWork(requests=[req("child")], completions=[Completion("parent", RequestState.DONE)],
                   claim=1),
        "w1",
    )
    assert result.requests_added == 1
    assert result.completed == {"done": 1}
    assert [leased.key for leased in result.leased] == ["child"]
    assert store.counts() == counts(leased=1, done=1)


def test_failed_completion_keeps_the_error(store):
    enqueue(store, req("a"))
    claim(store, 1)
    result = complete(store, "a", RequestState.FAILED, error_kind="http_status",
                      error_message="HTTP 500 not handled by the spider")
    assert result == CommitResult(completed={"failed": 1})
    assert [(e.state, e.error_kind, e.error_message) for e in entries(store)] == [
        ("failed", "http_status", "HTTP 500 not handled by the spider")]


def test_redirected_completion(store):
    enqueue(store, req("a"))
    claim(store, 1)
    assert complete(store, "a", RequestState.REDIRECTED) == CommitResult(
        completed={"redirected": 1})
    assert store.counts() == counts(redirected=1)


def test_a_unit_of_many_completions_ends_each_lease_with_its_own_state(store):
    for key in "eabcd":
        enqueue(store, req(key))
    assert sorted(claim_keys(store, 4)) == ["a", "b", "c", "d"]  # e stays pending
    result = store.commit(UnitOfWork(completions=[
        Completion("a", RequestState.DONE),
        Completion("b", RequestState.FAILED, error_kind="http_status", error_message="500"),
        Completion("c", RequestState.PENDING, data='{"url":"retry"}'),
        Completion("d", RequestState.REDIRECTED),
        Completion("e", RequestState.DONE),  # not leased: lost, written nothing
    ]), "w1")
    assert result.completed == {"done": 1, "failed": 1, "pending": 1, "redirected": 1}
    assert (result.leases_lost, result.lost) == (1, ["e"])
    assert {e.key: (e.state, e.error_kind, e.error_message) for e in entries(store)} == {
        "a": ("done", None, None), "b": ("failed", "http_status", "500"),
        "c": ("pending", None, None), "d": ("redirected", None, None),
        "e": ("pending", None, None)}


@pytest.mark.parametrize("second", [RequestState.FAILED, RequestState.PENDING])
def test_a_key_completed_twice_in_one_unit_ends_its_lease_once(store, second):
    enqueue(store, req("a"))
    claim(store, 1)
    result = store.commit(UnitOfWork(completions=[
        Completion("a", RequestState.DONE), Completion("a", second)]), "w1")
    assert (result.completed, result.lost) == ({"done": 1}, ["a"])
    assert row(store, "a") == ("done", None, 1)


def test_empty_unit_of_work_changes_nothing(store):
    assert store.commit(UnitOfWork(), "w1") == CommitResult()
    assert store.counts() == counts()


def test_rejects_are_stored(store):
    result = store.commit(
        UnitOfWork(rejects=[Reject(item_type="dict", reason="no sku", data='{"name":"x"}',
                                   request_key="p1")]),
        "w1",
    )
    assert result == CommitResult(rejects=1)
    assert [(j.item_type, j.reason, j.data, j.request_key) for j in store.rejects()] == [
        ("dict", "no sku", '{"name":"x"}', "p1")]


# -- record upserts -------------------------------------------------------------------------


def record_times(store: Any, record_id: str) -> tuple[Any, ...]:
    (found,) = [r for r in records(store) if r.record_id == record_id]
    return (found.data, found.content_hash, found.first_seen, found.last_changed)


def commit_record(store: Any, record: Record) -> CommitResult:
    return store.commit(UnitOfWork(records=[(record, None)]), "w1")


def test_record_upsert_insert_unchanged_updated(store, clock):
    assert commit_record(store, rec("r1", "h1", '{"price":1}')) == CommitResult(
        records_inserted=1)
    assert record_times(store, "r1") == ('{"price":1}', "h1", T0, T0)

    clock.advance(100)
    assert commit_record(store, rec("r1", "h1", '{"price":1}')) == CommitResult(
        records_unchanged=1)
    assert record_times(store, "r1") == ('{"price":1}', "h1", T0, T0)

    clock.advance(100)
    assert commit_record(store, rec("r1", "h2", '{"price":2}')) == CommitResult(
        records_updated=1)
    assert record_times(store, "r1") == ('{"price":2}', "h2", T0, T0 + 200)

    clock.advance(100)
    assert commit_record(store, rec("r1", "h2", '{"price":2}')) == CommitResult(
        records_unchanged=1)
    assert record_times(store, "r1") == ('{"price":2}', "h2", T0, T0 + 200)
    assert store.counts() == counts(records=1)


def test_record_times_never_go_backwards_across_a_backward_clock_step(store, clock):
    """The wall clock steps back an hour between two changes: first_seen <= last_changed
    still holds, and `--since` with the newest time the data showed finds the later change
    (and the record first seen after the step)."""
    commit_record(store, rec("r1", "h1", '{"price":1}'))
    clock.advance(100)
    commit_record(store, rec("r2", "h1", '{"price":1}'))
    shown = max(r.last_changed for r in store.records_page())  # what an export showed
    clock.advance(-3600)  # NTP steps the clock back
    commit_record(store, rec("r1", "h2", '{"price":2}'))
    commit_record(store, rec("r3", "h1", '{"price":3}'))
    times = {r.record_id: (r.first_seen, r.last_changed) for r in store.records_page()}
    assert all(first <= last for first, last in times.values()), times
    assert {r.record_id for r in store.records_page(changed_since=shown)} >= {"r1", "r3"}
    assert store.anomalies()["record_times"] == 0


def test_record_with_same_hash_is_unchanged_whatever_its_data(store, clock):
    # volatile fields are in the data but not in the hash: such a change is no change
    commit_record(store, rec("r1", "h1", '{"seen":1}'))
    clock.advance(100)
    assert commit_record(store, rec("r1", "h1", '{"seen":2}')) == CommitResult(
        records_unchanged=1)
    assert record_times(store, "r1") == ('{"seen":1}', "h1", T0, T0)


def test_distinct_records_in_one_unit(store):
    result = store.commit(UnitOfWork(records=[(rec("r1", "h1"), None), (rec("r2", "h1"), None),
                                              (rec("r1", "h9"), None)]), "w1")
    assert result == CommitResult(records_inserted=2, records_updated=1)
    assert store.counts() == counts(records=2)


# -- record observation order and change versions --------------------------------------------

HOOK = "https://hooks.example/records"


def seen(record: Record, observed_at: float) -> Record:
    """``record`` as observed (its response received) at ``observed_at``."""
    return dataclasses.replace(record, observed_at=observed_at)


def page_with(store: Any, key: str, *found: Record, worker: str = "w1") -> CommitResult:
    """Commit the completion of leased request ``key`` with the records its page yielded,
    announced to ``HOOK``."""
    return store.commit(UnitOfWork(records=[(r, key) for r in found],
                                   completions=[Completion(key, RequestState.DONE)],
                                   outbox_targets=(HOOK,)), worker)


def stored(store: Any, record_id: str) -> StoredRecord:
    (found,) = [r for r in records(store) if r.record_id == record_id]
    return found


def announced(store: Any) -> list[tuple[str, str]]:
    return [(e.key, e.kind) for e in store.outbox_entries()]


def test_a_page_downloaded_earlier_but_committed_later_changes_nothing(store, clock):
    """Two pages yield the same record: the listing's response arrives first (price 10),
    the product page's later (price 12), and the product page commits first. The listing's
    late commit is refused: the record keeps price 12, its last change and version stay,
    nothing is announced, and the refusal is counted."""
    enqueue(store, req("listing"), req("product"))
    claim(store, 2)
    assert page_with(store, "product", seen(rec("r1", "h12", '{"price":12}'), T0 + 2)) \
        == CommitResult(records_inserted=1, outbox_entries=1, completed={"done": 1})
    clock.advance(10)
    assert page_with(store, "listing", seen(rec("r1", "h10", '{"price":10}'), T0 + 1)) \
        == CommitResult(records_stale=1, completed={"done": 1})
    record = stored(store, "r1")
    assert (record.data, record.content_hash, record.last_changed, record.version,
            record.observed_at) == ('{"price":12}', "h12", T0, 1, T0 + 2)
    assert announced(store) == [("r1:1:h12", "inserted")]
    assert store.counts() == counts(done=2, records=1)


def test_a_later_observation_replaces_the_record(store, clock):
    commit_record(store, seen(rec("r1", "h1", '{"price":1}'), T0))
    clock.advance(10)
    assert commit_record(store, seen(rec("r1", "h2", '{"price":2}'), T0 + 5)) == CommitResult(
        records_updated=1)
    record = stored(store, "r1")
    assert (record.data, record.last_changed, record.version, record.observed_at) == (
        '{"price":2}', T0 + 10, 2, T0 + 5)


def test_the_stale_page_of_another_worker_changes_nothing(make_store, clock):
    """Two workers on one database: w2 received its page later but commits first."""
    w1, _ = open_store(make_store, "w1")
    w2, _ = open_store(make_store, "w2")
    enqueue(w1, req("a"), req("b"))
    [a] = claim_keys(w1, 1, "w1")
    [b] = claim_keys(w2, 1, "w2")
    assert page_with(w2, b, seen(rec("r1", "new", '{"stock":0}'), T0 + 2),
                     worker="w2").records_inserted == 1
    clock.advance(5)
    result = page_with(w1, a, seen(rec("r1", "old", '{"stock":5}'), T0 + 1), worker="w1")
    assert (result.records_stale, result.records_updated, result.outbox_entries) == (1, 0, 0)
    assert result.completed == {"done": 1}  # the page itself is done
    assert (stored(w1, "r1").data, stored(w2, "r1").version) == ('{"stock":0}', 1)
    assert announced(w1) == [("r1:1:new", "inserted")]


def test_stale_records_in_one_transaction_of_several_pages(store):
    """One transaction holds several pages (the writer groups them): a record of a page
    observed earlier, written after the same record of a page observed later, is refused."""
    enqueue(store, req("a"), req("b"))
    claim(store, 2)
    result = store.commit(UnitOfWork(
        records=[(seen(rec("r1", "h2"), T0 + 2), "b"), (seen(rec("r1", "h1"), T0 + 1), "a")],
        completions=[Completion("b", RequestState.DONE), Completion("a", RequestState.DONE)],
        outbox_targets=(HOOK,)), "w1")
    assert (result.records_inserted, result.records_stale, result.outbox_entries) == (1, 1, 1)
    assert (stored(store, "r1").content_hash, stored(store, "r1").version) == ("h2", 1)


@pytest.mark.parametrize("step_seconds", [120.0, 86_400.0])
def test_a_later_run_s_data_is_never_older_whatever_the_clock_says(make_store, clock,
                                                                    step_seconds):
    """The wall clock was set back between run 1 and run 2 (by 2 minutes, by a day): run 2
    observes r1 'before' run 1 did by the clock, but later in fact. The run comes first:
    r1 is updated, announced with version 2, and listed by run 2's feeds."""
    store, _ = open_store(make_store, "w1")
    commit_record(store, seen(rec("r1", "h1", '{"price":10}'), T0 + 50))
    store.end_session("w1", "finished")
    store.close()
    clock.advance(-step_seconds)
    store, run = open_store(make_store, "w2")
    assert run.new
    result = store.commit(UnitOfWork(records=[(seen(rec("r1", "h2", '{"price":12}'),
                                                   clock() + 1), None)],
                                     outbox_targets=(HOOK,)), "w2")
    assert result == CommitResult(records_updated=1, outbox_entries=1)
    assert [(r.record_id, r.data) for r in store.run_records(run.run_id)] == [
        ("r1", '{"price":12}')]
    assert (stored(store, "r1").version, announced(store)) == (2, [("r1:2:h2", "updated")])


def test_a_worker_of_an_earlier_run_is_older_than_the_next_run(make_store, clock):
    """w1 is still in run 1 (its clock ahead) when run 2 has stored r1: w1's data is of the
    earlier run and is refused; r1 stays run 2's."""
    late, _ = open_store(make_store, "w1")
    closing, _ = open_store(make_store, "w0")
    closing.end_session("w0", "finished")
    closing.close()
    late.end_session("w1", "shutdown", finish_run=False)
    store, run = open_store(make_store, "w2")
    assert run.new and late.run_id == run.run_id - 1
    commit_record(store, seen(rec("r1", "h2"), T0))
    assert late.commit(UnitOfWork(records=[(seen(rec("r1", "h1"), T0 + 100), None)]),
                       "w1") == CommitResult(records_stale=1)
    assert [r.record_id for r in store.run_records(run.run_id)] == ["r1"]
    assert stored(store, "r1").content_hash == "h2"


def test_records_observed_at_the_same_time_are_written_in_commit_order(store, clock):
    """One page yielding the same record twice: the later item wins, as before."""
    result = store.commit(UnitOfWork(records=[(seen(rec("r1", "h1"), T0), None),
                                              (seen(rec("r1", "h2"), T0), None)]), "w1")
    assert (result.records_inserted, result.records_updated) == (1, 1)
    assert (stored(store, "r1").content_hash, stored(store, "r1").version) == ("h2", 2)


def test_an_unchanged_later_observation_still_fences_older_data(store, clock):
    """The stored data was seen again, unchanged, at T0 + 20: data observed at T0 + 10 is
    older than that, even though it is newer than the stored data's first observation."""
    commit_record(store, seen(rec("r1", "h1"), T0))
    assert commit_record(store, seen(rec("r1", "h1"), T0 + 20)) == CommitResult(
        records_unchanged=1)
    assert stored(store, "r1").observed_at == T0 + 20
    assert commit_record(store, seen(rec("r1", "h2"), T0 + 10)) == CommitResult(
        records_stale=1)
    assert (stored(store, "r1").content_hash, stored(store, "r1").version) == ("h1", 1)


def test_a_record_without_observation_time_is_observed_at_its_commit(store, clock):
    commit_record(store, seen(rec("r1", "h1"), T0 + 100))  # a worker whose clock runs ahead
    assert commit_record(store, rec("r1", "h2")) == CommitResult(records_stale=1)
    clock.advance(200)
    assert commit_record(store, rec("r1", "h2")) == CommitResult(records_updated=1)
    assert stored(store, "r1").observed_at == T0 + 200


def test_a_change_back_to_earlier_content_has_a_key_of_its_own(store, clock):
    """A -> B -> A: three changes, three keys (a receiver deduplicating by key applies the
    change back); the version counts the stored changes."""
    for key, content_hash in (("p1", "hA"), ("p2", "hB"), ("p3", "hA")):
        enqueue(store, req(key))
        claim(store, 1)
        clock.advance(1)
        page_with(store, key, seen(rec("r1", content_hash), clock()))
    keys = [key for key, _ in announced(store)]
    assert keys == ["r1:1:hA", "r1:2:hB", "r1:3:hA"]
    assert len(set(keys)) == 3
    assert [kind for _, kind in announced(store)] == ["inserted", "updated", "updated"]
    assert stored(store, "r1").version == 3
    # seen again unchanged: no change, no new version, no announcement
    enqueue(store, req("p4"))
    claim(store, 1)
    clock.advance(1)
    page_with(store, "p4", seen(rec("r1", "hA"), clock()))
    assert (stored(store, "r1").version, len(announced(store))) == (3, 3)


def test_every_delivery_of_one_change_carries_its_key(store, clock):
    enqueue(store, req("p1"), req("p2"))
    claim(store, 2)
    page_with(store, "p1", rec("r1", "hA"))
    page_with(store, "p2", rec("r1", "hB"))
    first = store.claim_outbox([HOOK], 10, 30.0)
    assert [e.key for e in first] == ["r1:1:hA", "r1:2:hB"]
    store.settle_outbox([OutboxOutcome(e.entry_id, OutboxState.PENDING, "503", clock())
                         for e in first])
    again = store.claim_outbox([HOOK], 10, 30.0)
    assert [(e.key, e.attempts) for e in again] == [("r1:1:hA", 1), ("r1:2:hB", 1)]


# -- rollback -------------------------------------------------------------------------------


def test_failed_commit_writes_nothing_of_its_unit(store):
    enqueue(store, req("parent"))
    claim(store, 1)
    broken = Record(record_id="r2", source=None, natural_key='["B"]',  # type: ignore[arg-type]
                    item_type="dict", data="{}", content_hash="h2")
    work = UnitOfWork(
        requests=[req("child1"), req("child2")],
        records=[(rec("r1", "h1"), "parent"), (broken, "parent")],
        completions=[Completion("parent", RequestState.DONE)],
    )
    with pytest.raises(StoreError):  # source is NOT NULL
        store.commit(work, "w1")
    assert frontier_keys(store) == ["parent"]
    assert row(store, "parent") == ("leased", "w1", 1)
    assert store.counts() == counts(leased=1)
    assert records(store) == []

    # the store is usable afterwards: no transaction was left open
    work.records = [(rec("r1", "h1"), "parent")]
    assert store.commit(work, "w1") == CommitResult(requests_added=2, records_inserted=1,
                                                    completed={"done": 1})
    assert store.counts() == counts(pending=2, done=1, records=1)


def test_failure_after_a_completion_rolls_the_completion_back(store):
    enqueue(store, req("a"), req("b"))
    claim(store, 2)
    journal(store, "a", '{"status":200}', b"<html>")
    work = UnitOfWork(
        requests=[req("child")],
        records=[(rec("r1", "h1"), "a")],
        rejects=[Reject(item_type="dict", reason="no sku", data="{}", request_key="a")],
        completions=[
            Completion("a", RequestState.DONE),
            Completion("b", RequestState.PENDING, data={"not": "text"}),  # type: ignore[arg-type]
        ],
    )
    with pytest.raises(StoreError):  # the data of a continuation must be JSON text
        store.commit(work, "w1")
    assert row(store, "a") == ("leased", "w1", 1)
    assert row(store, "b") == ("leased", "w1", 1)
    assert store.counts() == counts(leased=2)
    assert store.count_rejects() == 0
    assert frontier_keys(store) == ["a", "b"]
    assert store.journaled_response("a") == ('{"status":200}', b"<html>")


# -- completions guarded by the lease owner -------------------------------------------------


def test_completion_by_another_worker_is_a_lost_lease(store):
    enqueue(store, req("a"))
    claim(store, 1, worker="w1")
    result = complete(store, "a", worker="w2")
    assert result == CommitResult(leases_lost=1)
    assert row(store, "a") == ("leased", "w1", 1)


def test_completion_after_the_lease_moved_to_another_worker(store, clock):
    enqueue(store, req("a"))
    claim(store, 1, worker="w1")
    clock.advance(LEASE_SECONDS + 1)
    store.reclaim_expired()
    claim(store, 1, worker="w2")
    assert complete(store, "a", worker="w1") == CommitResult(leases_lost=1)
    assert row(store, "a") == ("leased", "w2", 2)
    assert complete(store, "a", worker="w2") == CommitResult(completed={"done": 1})
    assert row(store, "a") == ("done", None, 2)


def test_completion_of_a_pending_request_is_a_lost_lease(store):
    enqueue(store, req("a"))
    assert complete(store, "a") == CommitResult(leases_lost=1)
    assert row(store, "a") == ("pending", None, 0)


def test_completion_of_a_done_request_is_a_lost_lease(store):
    enqueue(store, req("a"))
    claim(store, 1)
    complete(store, "a")
    assert complete(store, "a", RequestState.FAILED) == CommitResult(leases_lost=1)
    assert row(store, "a") == ("done", None, 1)


def test_lost_lease_writes_nothing_of_its_unit_of_work(store, clock):
    """The lease fences the whole unit of work: a completion that is not the worker's any
    more writes neither its records, nor its rejects, nor its child requests, nor a journal
    row, and counts nothing in the run's counters; the rest of the transaction (an orphan
    request, another page's completion) is written."""
    enqueue(store, req("a"), req("b"))
    claim(store, 2, worker="w1")
    clock.advance(LEASE_SECONDS + 1)
    store.reclaim_expired()
    assert claim_keys(store, 1, worker="w2") == ["b"]
    assert store.commit(UnitOfWork(records=[(rec("r1", "new"), "b")],
                                   completions=[Completion("b", RequestState.DONE)]),
                        "w2").records_inserted == 1
    runs_before = store.runs()
    result = store.commit(
        UnitOfWork(requests=[req("orphan"), req("child", parent_key="b")],
                   records=[(rec("r1", "old"), "b"), (rec("r2", "x"), "b")],
                   rejects=[Reject("T", "no key", "{}", "b")],
                   responses=[("b", "{}", b"late")],
                   started=["b"],
                   completions=[Completion("b", RequestState.DONE)]),
        "w1",
    )
    assert result == CommitResult(requests_added=1, leases_lost=1)
    assert result.lost == ["b"]
    assert [(r.record_id, r.content_hash) for r in records(store)] == [("r1", "new")]
    assert store.count_rejects() == 0
    assert store.request_summary().journaled_responses == 0
    assert [key for key in frontier_keys(store) if key in ("orphan", "child")] == ["orphan"]
    assert row(store, "b")[2] == 2
    runs_after = store.runs()
    assert [r.done for r in runs_after] == [r.done for r in runs_before]
    assert [r.leased for r in runs_after] == [r.leased for r in runs_before]


def test_renewal_does_not_revive_an_expired_lease(store, clock):
    enqueue(store, req("a"), req("b"))
    claim(store, 1, worker="w1")
    clock.advance(LEASE_SECONDS / 2)
    claim(store, 1, worker="w1")
    clock.advance(LEASE_SECONDS / 2 + 1)  # b (claimed first: newest) expired, a live
    assert store.renew_leases("w1") == ["a"]
    assert store.reclaim_expired() == 1
    assert row(store, "b") == ("pending", None, 1)


def test_pending_completion_is_a_continuation(store):
    enqueue(store, req("a", priority=0))
    claim(store, 1)
    store.commit(UnitOfWork(downloaded=["a"]), "w1")  # sent to the network
    result = complete(store, "a", RequestState.PENDING, data='{"url":"retry"}', priority=-3)
    assert result == CommitResult(completed={"pending": 1})
    assert row(store, "a") == ("pending", None, 1)
    assert claim(store, 1, worker="w2") == [
        LeasedRequest(key="a", fingerprint="fp-a", data='{"url":"retry"}', priority=-3,
                      attempts=2, downloads=1)]


def test_pending_completion_without_data_keeps_the_stored_request(store):
    new = req("a", priority=2)
    enqueue(store, new)
    claim(store, 1)
    complete(store, "a", RequestState.PENDING)  # never sent: no download counted
    assert claim(store, 1) == [
        LeasedRequest(key="a", fingerprint="fp-a", data=new.data, priority=2, attempts=2,
                      downloads=0)]


# -- attempts and quarantine ----------------------------------------------------------------


def test_request_started_max_attempts_times_without_finishing_is_quarantined(make_store):
    store, _ = open_store(make_store, "w1", max_attempts=2)
    enqueue(store, req("poison"))
    for attempt in (1, 2):
        assert [(r.key, r.attempts) for r in claim(store, 1)] == [("poison", attempt)]
        assert store.release_leases(["w1"]) == 1  # the worker died with it
    result = store.commit(UnitOfWork(claim=1), "w1")
    assert result == CommitResult(quarantined=["https://shop.example/poison"])
    assert [(e.state, e.worker, e.attempts, e.error_kind) for e in entries(store)] == [
        ("failed", None, 2, "quarantined")]
    assert store.counts() == counts(failed=1)
    assert enqueue(store, req("poison")) == CommitResult(requests_already_done=1)


@pytest.mark.parametrize(("max_attempts", "alone_from"), [(10, 2), (3, 2), (2, 1)])
def test_a_request_runs_alone_once_it_was_in_flight_at_two_deaths(make_store, max_attempts,
                                                                  alone_from):
    """In flight at one death: replayed with the rest (a resume runs at full concurrency).
    At two deaths (at one, when the limit is 2): a suspect, to run alone."""
    store, _ = open_store(make_store, "w1", max_attempts=max_attempts)
    enqueue(store, req("page"))
    suspects = []
    for _ in range(max_attempts):
        (leased,) = claim(store, 1)
        suspects.append(leased.suspect)
        store.release_leases(["w1"])  # the worker died with it in flight
    assert suspects == [deaths >= alone_from for deaths in range(max_attempts)]


def test_quarantine_leaves_other_requests_claimable(make_store):
    store, _ = open_store(make_store, "w1", max_attempts=1)
    enqueue(store, req("poison", priority=9), req("fine"))
    assert claim_keys(store, 1) == ["poison"]
    store.release_leases(["w1"])
    result = store.commit(UnitOfWork(claim=2), "w1")
    assert len(result.quarantined) == 1
    assert [(r.key, r.attempts) for r in result.leased] == [("fine", 1)]


def test_claimed_but_never_started_leases_do_not_count_towards_quarantine(make_store):
    """A worker that dies with a batch of claimed requests it had not started yet: only what
    it started is a suspect. Each claim still counts an attempt (the store cannot tell a
    request claimed ahead from one whose download was under way)."""
    store, _ = open_store(make_store, "w1", max_attempts=2)
    enqueue(store, req("bystander"), req("poison", priority=9))
    for _ in range(2):
        leased = store.commit(UnitOfWork(claim=2), "w1").leased
        assert [r.key for r in leased] == ["poison", "bystander"]
        store.commit(UnitOfWork(started=["poison"]), "w1")  # started poison, then died
        store.release_leases(["w1"])
    result = store.commit(UnitOfWork(claim=2), "w1")
    assert [(r.key, r.attempts, r.suspect) for r in result.leased] == [("bystander", 3, False)]
    assert [(e.key, e.state, e.attempts, e.unfinished) for e in entries(store)] == [
        ("bystander", "leased", 3, 0), ("poison", "failed", 2, 0)]


def test_a_lease_lost_before_its_start_was_written_counts_as_an_attempt(make_store):
    """A worker killed while downloading, before the transaction writing the attempt's start:
    the claim counted the attempt (leases are an upper bound of what the site saw); the
    downloads count what was recorded as sent (a lower bound)."""
    store, _ = open_store(make_store, "w1")
    enqueue(store, req("a"))
    (leased,) = store.commit(UnitOfWork(claim=1), "w1").leased  # handed out, then killed
    assert leased.attempts == 1
    assert store.release_leases(["w1"]) == 1  # its dead worker's leases taken back
    (again,) = claim(store, 1, worker="w2")
    assert (again.attempts, again.downloads, again.suspect) == (2, 0, False)
    store.commit(UnitOfWork(started=["a"], downloaded=["a"]), "w2")
    complete(store, "a", worker="w2")
    summary = store.request_summary()
    assert (summary.leases, summary.repeated, summary.downloads,
            summary.downloaded_again) == (2, 1, 1, 0)
    assert [r.key for r in store.repeated_requests(10)] == ["a"]
    assert [r.leased for r in store.runs()] == [2]


def test_downloads_count_each_sending_of_a_held_lease(make_store):
    """``downloaded`` names a leased request once per sending (a retry within one batch
    twice); a request the worker does not hold any more counts nothing."""
    store, _ = open_store(make_store, "w1")
    enqueue(store, req("a"), req("b"))
    store.commit(UnitOfWork(claim=2), "w1")
    store.commit(UnitOfWork(started=["a", "b"], downloaded=["a", "b", "a"]), "w1")
    assert store.release_leases(["w1"]) == 2
    store.commit(UnitOfWork(downloaded=["b"]), "w1")  # not its lease any more
    assert {e.key: e.downloads for e in entries(store)} == {"a": 2, "b": 1}
    summary = store.request_summary()
    assert (summary.downloads, summary.downloaded_again) == (3, 1)


def test_a_unit_counts_starts_replays_and_downloads_of_its_requests_together(make_store):
    """The counters of one unit, whatever mix of them a request has in it (they are written
    together: one statement for the keys of one mix of increments)."""
    store, _ = open_store(make_store, "w1")
    enqueue(store, *(req(key) for key in "abcd"))
    store.commit(UnitOfWork(claim=4), "w1")
    store.commit(UnitOfWork(started=["a", "b", "d"], replayed=["b", "c"],
                            downloaded=["a", "a", "b", "c", "d"]), "w1")
    store.commit(UnitOfWork(started=["d"], downloaded=["d"]), "w1")
    assert {e.key: (e.unfinished, e.replays, e.downloads) for e in entries(store)} == {
        "a": (1, 0, 2), "b": (1, 1, 1), "c": (0, 1, 1), "d": (2, 0, 2)}


def test_leases_put_back_never_started_count_no_attempt(make_store):
    """Claimed ahead and given back, or released unstarted at a clean stop: not on the wire."""
    store, _ = open_store(make_store, "w1")
    enqueue(store, req("a"), req("b"), req("c"))
    assert [r.key for r in store.commit(UnitOfWork(claim=3), "w1").leased] == ["c", "b", "a"]
    store.commit(UnitOfWork(started=["c"], give_back=["b"]), "w1")
    assert store.end_session("w1", "shutdown", ["c"]) == 2  # c in flight, a claimed ahead
    assert [(e.key, e.state, e.attempts, e.unfinished) for e in entries(store)] == [
        ("a", "pending", 0, 0), ("b", "pending", 0, 0), ("c", "pending", 1, 0)]
    assert store.request_summary().leases == 1
    assert [r.leased for r in store.runs()] == [1]


def test_a_completed_attempt_resets_the_unfinished_count(make_store):
    store, _ = open_store(make_store, "w1", max_attempts=2)
    enqueue(store, req("flaky"))
    for _ in range(5):  # retried again and again, each attempt completes its lease
        assert len(claim(store, 1)) == 1
        store.commit(UnitOfWork(completions=[Completion("flaky", RequestState.PENDING)]), "w1")
    assert [(e.state, e.attempts, e.unfinished) for e in entries(store)] == [
        ("pending", 5, 0)]


# -- runs and sessions ----------------------------------------------------------------------


def finish_one(store: Any, key: str, record: Record | None = None) -> None:
    enqueue(store, req(key))
    claim(store, 1)
    store.commit(UnitOfWork(records=[(record, key)] if record else [],
                            completions=[Completion(key, RequestState.DONE)]), "w1")


def test_new_database_starts_run_1(make_store):
    _, run = open_store(make_store, "w1")
    assert run == RunInfo(run_id=1, new=True, counts=counts())


def test_finished_run_then_auto_starts_a_new_run_keeping_records(make_store, clock):
    store, _ = open_store(make_store, "w1")
    finish_one(store, "a", rec("r1", "h1"))
    assert store.end_session("w1", "finished") == 0
    store.close()

    clock.advance(3600)
    store, run = open_store(make_store, "w2")
    assert run == RunInfo(run_id=2, new=True, counts=counts(records=1))
    assert frontier_keys(store) == []
    # the frontier was cleared: the page is fetched again in the new run
    assert enqueue(store, req("a"), worker="w2") == CommitResult(requests_added=1)
    assert record_times(store, "r1") == ('{"sku":"A1"}', "h1", T0, T0)


def test_a_worker_open_across_the_run_boundary_writes_in_the_next_run(make_store):
    """w1 joined run 1 and is still open (idle) when w2 finishes that run and w3 starts run
    2: what w1 writes from then on is run 2's (its records are in run 2's feeds, its work in
    run 2's counters), not run 1's."""
    w1, _ = open_store(make_store, "w1")
    w2, _ = open_store(make_store, "w2")
    enqueue(w2, req("a"), worker="w2")
    claim(w2, 1, worker="w2")
    complete(w2, "a", worker="w2")
    assert w2.end_session("w2", "finished") == 0
    w3, run = open_store(make_store, "w3")
    assert (run.run_id, run.new) == (2, True)
    enqueue(w3, req("b"), worker="w3")
    assert claim_keys(w1, 1, worker="w1") == ["b"]
    result = w1.commit(UnitOfWork(records=[(rec("r1", "h1"), "b")], requests=[req("c")],
                                  completions=[Completion("b", RequestState.DONE)]), "w1")
    assert result.records_inserted == 1
    assert [r.record_id for r in w1.run_records(2)] == ["r1"]
    assert list(w1.run_records(1)) == []
    assert [(r.run_id, r.leased, r.done, r.records_inserted) for r in w1.runs()] == [
        (1, 1, 1, 0), (2, 1, 1, 1)]
    open_runs = {s.run_id for s in w1.sessions() if s.worker == "w1" and s.ended_at is None}
    assert open_runs == {2}


def test_run_totals_add_up_every_session_of_the_run(make_store):
    """The run's totals are what every worker committed in the run, a killed one's (its
    session never ended) included, and only what was committed: a lease lost to another
    worker counts nothing. Spider errors are the failed entries whose callback raised."""
    w1, run = open_store(make_store, "w1")
    enqueue(w1, req("a"), req("b"), req("c"), req("d"), req("e"))
    a, b = claim_keys(w1, 2)
    w1.commit(UnitOfWork(records=[(rec("r1", "h1"), a), (rec("r2", "h2"), a)],
                         completions=[Completion(a, RequestState.DONE)]), "w1")
    complete(w1, b, RequestState.FAILED, error_kind="spider_error/ValueError",
             error_message="boom")
    w1.close()  # killed: its session never ends
    w2, _ = open_store(make_store, "w2")
    c, d, e = claim_keys(w2, 3, worker="w2")
    w2.commit(UnitOfWork(records=[(rec("r1", "h1"), c), (rec("r3", "h3"), c)],
                         completions=[Completion(c, RequestState.DONE)]), "w2")
    complete(w2, d, RequestState.FAILED, worker="w2", error_kind="http_status")
    complete(w2, e, RequestState.REDIRECTED, worker="w2")
    complete(w2, a, worker="w2")  # not its lease: nothing written, nothing counted
    totals = w2.run_totals(run.run_id, spider_errors=True)
    assert (totals.done, totals.failed, totals.redirected, totals.records_inserted,
            totals.records_unchanged, totals.spider_errors) == (2, 2, 1, 3, 1, 1)
    assert (totals.pages, totals.items) == (5, 4)
    assert w2.run_totals(run.run_id).spider_errors is None
    assert w2.run_totals(run.run_id + 1).pages == 0


def test_end_session_finished_with_pending_requests_keeps_the_run_open(make_store):
    store, _ = open_store(make_store, "w1")
    enqueue(store, req("a"), req("b"))
    assert store.end_session("w1", "finished") == 0
    store.close()
    _, run = open_store(make_store, "w2")
    assert run == RunInfo(run_id=1, new=False, counts=counts(pending=2))


def test_end_session_finished_while_another_worker_holds_leases_keeps_the_run_open(make_store):
    store, _ = open_store(make_store, "w1")
    enqueue(store, req("a"))
    claim(store, 1, worker="w2")
    assert store.end_session("w1", "finished") == 0
    store.close()
    _, run = open_store(make_store, "w3")
    assert run == RunInfo(run_id=1, new=False, counts=counts(leased=1))


def test_end_session_with_another_reason_never_finishes_the_run(make_store):
    store, _ = open_store(make_store, "w1")
    finish_one(store, "a")
    assert store.end_session("w1", "shutdown") == 0
    store.close()
    _, run = open_store(make_store, "w2")
    assert run == RunInfo(run_id=1, new=False, counts=counts(done=1))


def test_end_session_releases_the_workers_leases(store):
    enqueue(store, req("a"), req("b"), req("c"))
    claim(store, 2, worker="w1")
    claim(store, 1, worker="w2")
    assert store.end_session("w1", "shutdown") == 2
    assert store.counts() == counts(pending=2, leased=1)
    assert [h.worker for h in store.lease_holders()] == ["w2"]


def test_fresh_always_starts_a_new_run(make_store):
    store, _ = open_store(make_store, "w1")
    finish_one(store, "a", rec("r1", "h1"))
    enqueue(store, req("b"))  # unfinished run
    store.close()
    store, run = open_store(make_store, "w2", "fresh")
    assert run == RunInfo(run_id=2, new=True, counts=counts(records=1))
    assert frontier_keys(store) == []


def test_resume_keeps_the_last_run_even_when_finished(make_store):
    store, _ = open_store(make_store, "w1")
    finish_one(store, "a")
    store.end_session("w1", "finished")
    store.close()
    store, run = open_store(make_store, "w2", "resume")
    assert run == RunInfo(run_id=1, new=False, counts=counts(done=1))
    assert enqueue(store, req("a"), worker="w2") == CommitResult(requests_already_done=1)


def test_resume_on_a_new_database_starts_run_1(make_store):
    _, run = open_store(make_store, "w1", "resume")
    assert run == RunInfo(run_id=1, new=True, counts=counts())


def test_records_remember_the_run_that_created_and_changed_them(make_store):
    store, _ = open_store(make_store, "w1")
    finish_one(store, "a", rec("r1", "h1"))
    finish_one(store, "b", rec("r2", "h1"))
    store.end_session("w1", "finished")
    store.close()
    store, _ = open_store(make_store, "w2")
    store.commit(UnitOfWork(records=[(rec("r1", "h2"), None), (rec("r2", "h1"), None)]), "w2")
    assert [(r.record_id, r.first_run_id, r.changed_run_id) for r in records(store)] == [
        ("r1", 1, 2), ("r2", 1, 1)]


# -- the response journal -------------------------------------------------------------------


def test_journaled_response_is_kept_until_the_completion(store):
    enqueue(store, req("a"), req("b"))
    claim(store, 2)
    assert store.journaled_response("a") is None
    journal(store, "a", '{"status":200}', b"\x00<html>")
    assert store.journaled_response("a") == ('{"status":200}', b"\x00<html>")
    assert store.journaled_response("b") is None
    journal(store, "a", '{"status":203}', b"")  # a later response replaces it
    assert store.journaled_response("a") == ('{"status":203}', b"")
    result = store.commit(UnitOfWork(requests=[req("child")],
                                     completions=[Completion("a", RequestState.DONE)]), "w1")
    assert result.completed == {"done": 1}
    assert store.journaled_response("a") is None


def test_continuation_deletes_the_journaled_response(store):
    enqueue(store, req("a"))
    claim(store, 1)
    journal(store, "a", '{"status":503}', b"busy")
    complete(store, "a", RequestState.PENDING, data='{"url":"retry"}')
    assert store.journaled_response("a") is None


def test_lost_lease_completion_keeps_the_journaled_response(store, clock):
    # w1's lease expired and w2 took the request over and journaled its response; w1's late
    # completion is refused and must change nothing, the journal of w2 included
    enqueue(store, req("a"))
    claim(store, 1, worker="w1")
    clock.advance(LEASE_SECONDS + 1)
    store.reclaim_expired()
    claim(store, 1, worker="w2")
    journal(store, "a", '{"status":200}', b"w2", worker="w2")
    assert complete(store, "a", worker="w1") == CommitResult(leases_lost=1)
    assert store.journaled_response("a") == ('{"status":200}', b"w2")


def test_new_run_discards_the_journal(make_store):
    store, _ = open_store(make_store, "w1")
    enqueue(store, req("a"))
    claim(store, 1)
    journal(store, "a", '{"status":200}', b"x")
    store.close()
    store, run = open_store(make_store, "w2", "fresh")
    assert run.new is True
    assert store.journaled_response("a") is None


# -- the recrawl window ---------------------------------------------------------------------

RECRAWL_SECONDS = 3600.0
#: T0 lies 800 s into its recrawl window: the next window starts this much later
NEXT_WINDOW = RECRAWL_SECONDS - T0 % RECRAWL_SECONDS


def test_without_recrawl_window_done_stays_done(store, clock):
    finish_one(store, "a")
    clock.advance(10 * 365 * 86400)
    assert enqueue(store, req("a")) == CommitResult(requests_already_done=1)


def test_recrawl_done_request_is_due_again_in_a_later_window(make_store, clock):
    assert NEXT_WINDOW == 2800.0
    store, _ = open_store(make_store, "w1", recrawl_seconds=RECRAWL_SECONDS)
    finish_one(store, "a")
    clock.advance(NEXT_WINDOW - 1)  # same window
    assert enqueue(store, req("a")) == CommitResult(requests_already_done=1)
    clock.advance(1)
    assert enqueue(store, req("a", priority=3, data='{"v":2}')) == CommitResult(
        requests_due_again=1)
    assert row(store, "a") == ("pending", None, 0)
    assert enqueue(store, req("a")) == CommitResult(requests_duplicate=1)
    assert claim(store, 1) == [
        LeasedRequest(key="a", fingerprint="fp-a", data='{"v":2}', priority=3, attempts=1)]


def test_recrawl_new_run_keeps_what_was_done_in_the_current_window(make_store, clock):
    store, _ = open_store(make_store, "w1", recrawl_seconds=RECRAWL_SECONDS)
    finish_one(store, "a", rec("r1", "h1"))
    enqueue(store, req("b"))
    store.close()
    clock.advance(100)
    store, run = open_store(make_store, "w2", "fresh", recrawl_seconds=RECRAWL_SECONDS)
    assert run == RunInfo(run_id=2, new=True, counts=counts(done=1, records=1))
    assert enqueue(store, req("a"), worker="w2") == CommitResult(requests_already_done=1)
    store.close()
    clock.advance(NEXT_WINDOW)
    store, run = open_store(make_store, "w3", "fresh", recrawl_seconds=RECRAWL_SECONDS)
    assert run == RunInfo(run_id=3, new=True, counts=counts(records=1))


def test_known_request_of_a_done_fingerprint_asked_again(make_store, clock):
    # a rediscovered link to a done page is answered as the frontier says, each time: within
    # the window, once due again (None: the commit puts it back), then while pending again
    store, _ = open_store(make_store, "w1", recrawl_seconds=RECRAWL_SECONDS)
    finish_one(store, "a")
    for _ in range(3):
        assert store.known_request("a") == "already_done"
    assert store.known_request("fp-a") == "already_done"  # its fingerprint, not its key
    clock.advance(NEXT_WINDOW)
    assert store.known_request("a") is None
    assert enqueue(store, req("a")) == CommitResult(requests_due_again=1)
    assert store.known_request("a") == "duplicate"
    claim(store, 1)
    assert store.known_request("a") == "duplicate"
    complete(store, "a")
    assert store.known_request("a") == "already_done"


def test_known_requests_expected_are_read_in_one_statement(make_store, clock, monkeypatch):
    # a page's links, expected before they are enqueued: the first lookup reads them all
    # (each answered as a lookup of its own would be), the others are answered from it
    writer, _ = open_store(make_store, "w1")
    finish_one(writer, "done")
    enqueue(writer, req("pending"))
    enqueue(writer, req("start", fingerprint="fp-s", filter_fingerprint=False))
    store, _ = open_store(make_store, "w2")  # (another worker: it remembers none of them)
    reads = count_reads(store, monkeypatch)
    asked = ["fp-x", "pending", "done", "fp-s", "fp-y"]
    store.expect_lookups(asked)
    assert [store.known_request(f) for f in asked] == [
        None, "duplicate", "already_done", "duplicate", None]
    assert len(reads) == 1
    # each answer is used once: asked again, from memory or read anew
    assert store.known_request("fp-x") is None
    assert len(reads) == 2
    # answers of a read a while ago are not used
    store.expect_lookups(["fp-z", "fp-w"])
    assert store.known_request("fp-z") is None
    assert len(reads) == 3
    enqueue(store, req("w", fingerprint="fp-w"))
    clock.advance(2)
    assert store.known_request("fp-w") == "duplicate"
    assert len(reads) == 4


def test_known_request_of_a_done_fingerprint_in_a_new_run(store):
    finish_one(store, "a")
    assert store.known_request("a") == "already_done"
    store.end_session("w1", "finished")
    store.begin_session("w1", "auto")  # a new run from an empty frontier
    assert store.known_request("a") is None
    assert enqueue(store, req("a")) == CommitResult(requests_added=1)
    assert store.known_request("a") == "duplicate"


# -- status ---------------------------------------------------------------------------------


def test_status_claimable_and_leased_elsewhere(store):
    assert store.status("w1") == FrontierStatus(claimable=False, leased_elsewhere=False)
    enqueue(store, req("a"), req("b"))
    assert store.status("w1") == FrontierStatus(claimable=True, leased_elsewhere=False)
    claim(store, 1, worker="w2")
    assert store.status("w1") == FrontierStatus(claimable=True, leased_elsewhere=True)
    assert store.status("w2") == FrontierStatus(claimable=True, leased_elsewhere=False)
    claim(store, 1, worker="w2")
    assert store.status("w1") == FrontierStatus(claimable=False, leased_elsewhere=True)
    assert store.status("w2") == FrontierStatus(claimable=False, leased_elsewhere=False)
    complete(store, "a", worker="w2")
    complete(store, "b", worker="w2")
    assert store.status("w1") == FrontierStatus(claimable=False, leased_elsewhere=False)


def test_status_counts_the_workers_own_expired_leases_as_reclaimable(store, clock):
    """A worker whose leases expired (it was stopped) must reclaim them itself: nobody else
    may be running, and it would otherwise finish with requests left leased."""
    enqueue(store, req("a"))
    claim(store, 1, worker="w1")
    assert store.status("w1") == FrontierStatus(claimable=False, leased_elsewhere=False)
    clock.advance(LEASE_SECONDS + 1)
    assert store.status("w1") == FrontierStatus(claimable=False, leased_elsewhere=True)


def test_unfinished_is_any_request_pending_or_leased_by_any_worker(store):
    # what a close asks before its hooks (did the crawl finish?), answered as counts() would
    assert store.unfinished() is False
    enqueue(store, req("a"), req("b"))
    assert store.unfinished() is True
    claim(store, 2, worker="w2")  # leased elsewhere, nothing pending
    assert store.counts() == counts(leased=2)
    assert store.unfinished() is True
    complete(store, "a", worker="w2")
    complete(store, "b", RequestState.FAILED, worker="w2", error_kind="dns",
             error_message="no such host")
    assert store.unfinished() is False


def test_a_feed_store_is_fenced_an_older_version_never_replaces_a_newer(store: Any) -> None:
    """store_feed: a version at a lower level than the one stored is refused (nothing done);
    equal or higher levels are stored, ``replace`` called inside the transaction; an error in
    ``replace`` rolls the level back; feeds of another run or URI are fenced apart."""
    done: list[str] = []
    assert store.store_feed(1, "/out.json", 100, lambda: done.append("a")) is True
    assert store.store_feed(1, "/out.json", 500, lambda: done.append("b")) is True
    assert store.store_feed(1, "/out.json", 100, lambda: done.append("late")) is False
    assert store.store_feed(1, "/out.json", 500, lambda: done.append("again")) is True

    def failing() -> None:
        raise OSError("rename failed")

    with pytest.raises(OSError):
        store.store_feed(1, "/out.json", 900, failing)
    assert store.store_feed(1, "/out.json", 600, lambda: done.append("c")) is True
    assert store.store_feed(1, "/other.json", 1, lambda: done.append("other")) is True
    assert store.store_feed(2, "/out.json", 1, lambda: done.append("run 2")) is True
    assert done == ["a", "b", "again", "c", "other", "run 2"]
    # the append base of the same URI is another row
    assert store.feed_base(1, "/out.json", 42) == 42


# -- the record ID scheme -------------------------------------------------------------------


def test_a_new_database_records_the_record_id_scheme_of_its_first_open(make_store):
    store = make_store()
    store.open(fingerprinter="x", record_id_scheme="7")
    assert store.meta()["record_id_scheme"] == "7"
    store.close()
    again = make_store()
    assert again.open(fingerprinter="x", record_id_scheme="7") is None
    again.close()


def test_a_database_of_another_record_id_scheme_is_refused_untouched(make_store):
    store = make_store()
    store.open(fingerprinter="x", record_id_scheme="3")
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(records=[(rec("r1", "h1"), None)]), "w1")
    store.close()
    older = make_store()
    with pytest.raises(StoreError, match=r"record ID scheme 3; .* by scheme 2") as refused:
        older.open(fingerprinter="x", record_id_scheme="2")
    assert "left untouched" in str(refused.value)
    same = make_store()
    same.open(fingerprinter="x", record_id_scheme="3")
    assert same.meta()["record_id_scheme"] == "3"
    assert [r.record_id for r in same.records_page()] == ["r1"]
    same.close()


def test_a_database_of_the_first_scheme_is_opened_to_be_re_identified(make_store):
    """Scheme 1 left the item type out of record IDs: its databases are opened (the crawl
    re-identifies them, see test_rekey.py), and keep scheme 1 until that is committed."""
    store = make_store()
    store.open(fingerprinter="x", record_id_scheme="1")
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(records=[(rec("r1", "h1"), None)]), "w1")
    store.close()
    newer = make_store()
    newer.open(fingerprinter="x", record_id_scheme="2")
    assert newer.meta()["record_id_scheme"] == "1"
    newer.close()


def test_records_stored_before_the_scheme_was_recorded_are_of_the_first_scheme(make_store):
    store = make_store()
    store.open(fingerprinter="x")  # a release that did not record the scheme
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(records=[(rec("r1", "h1"), None)]), "w1")
    assert "record_id_scheme" not in store.meta()
    store.close()
    current = make_store()
    current.open(fingerprinter="x", record_id_scheme="2")
    assert current.meta()["record_id_scheme"] == "1"
    current.close()


# -- counts shared by the crawl's workers ---------------------------------------------------


def test_a_slow_count_is_shared_by_the_workers_while_it_is_young(make_store, clock,
                                                                  monkeypatch):
    from scrapy_idempotent.store import sql_runs

    monkeypatch.setattr(sql_runs, "SHARED_COUNT_SECONDS", 0.0)  # every count is slow
    first, _ = open_store(make_store, "w1")
    second, _ = open_store(make_store, "w2")
    enqueue(first, req("a"))
    assert first.shared_counts(60) == (counts(pending=1), 0.0)
    enqueue(second, req("b"))
    clock.advance(10)
    # the first worker's count, 10 s old: the second counts nothing
    assert second.shared_counts(60) == (counts(pending=1), 10.0)
    # older than asked for: counted again, and kept for the others
    assert second.shared_counts(10) == (counts(pending=2), 0.0)
    clock.advance(1)
    assert first.shared_counts(60) == (counts(pending=2), 1.0)
    # a count kept on a clock ahead of this one's is not taken
    clock.advance(-5)
    assert first.shared_counts(60) == (counts(pending=2), 0.0)
    # nor a worker's own: its lines count as before
    enqueue(second, req("c"))
    assert first.shared_counts(60) == (counts(pending=3), 0.0)
    assert second.shared_counts(60) == (counts(pending=3), 0.0)


def test_a_quick_count_is_not_kept_and_a_kept_value_not_ours_is_replaced(make_store,
                                                                         monkeypatch):
    from scrapy_idempotent.store import sql_runs

    store, _ = open_store(make_store, "w1")
    enqueue(store, req("a"))
    # (a threshold no count reaches: a loaded machine can slow a count of a few rows)
    monkeypatch.setattr(sql_runs, "SHARED_COUNT_SECONDS", float("inf"))
    assert store.shared_counts(60) == (counts(pending=1), 0.0)
    assert "frontier_counts" not in store.meta()
    monkeypatch.setattr(sql_runs, "SHARED_COUNT_SECONDS", 0.0)
    with store._write() as cur:
        store._set_meta(cur, "frontier_counts", '{"at": "soon"}')
    assert store.shared_counts(60) == (counts(pending=1), 0.0)
    assert '"pending": 1' in store.meta()["frontier_counts"]
    enqueue(store, req("b"))
    assert store.shared_counts(60) == (counts(pending=2), 0.0)  # its own: counted again
