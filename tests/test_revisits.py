"""Adaptive revisits at the store level (no Scrapy): each page that yields records keeps a
revisit interval beside its validators, halved when its records changed and doubled when
they did not, within the bounds; a page not due is completed as unchanged without a request
and keeps its schedule; start requests and pages without records are due in every run; over
simulated rounds the requests fall near the changed pages and no change is found later than
the longest interval. Part of the store contract: every test runs against each backend."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from conftest import FakeClock as Clock

from helpers.revisit_rounds import BODY_BYTES, simulate_rounds
from scrapy_idempotent.store import (
    Completion,
    FrontierStore,
    NewRequest,
    RequestState,
    UnitOfWork,
)
from scrapy_idempotent.store.base import PageValidators, Record, RevisitBounds
from scrapy_idempotent.store.rules import next_revisit, revisit_due, revisit_due_at

Stores = Callable[..., FrontierStore]
DAY = 86400.0
BOUNDS = RevisitBounds(DAY, 8 * DAY)


def validators(version: int = 0) -> PageValidators:
    return PageValidators(f'"v{version}"', None, f"{version:064x}", body_bytes=BODY_BYTES)


def record(n: int, version: int = 0) -> Record:
    return Record(record_id=f"r{n}", source="s", natural_key=f'["{n}"]', item_type="Product",
                  data=f'{{"n": {n}, "v": {version}}}', content_hash=f"h{n}-{version}")


def new(name: str, parent: str | None = None) -> NewRequest:
    return NewRequest(key=name, fingerprint=name, url=f"https://example.com/{name}",
                      priority=0, data=f'{{"url": "{name}"}}', parent_key=parent,
                      is_start=parent is None)


def open_store(store_factory: Stores, clock: Clock) -> FrontierStore:
    store = store_factory(clock=clock)
    store.open(fingerprinter="f")
    store.load_validators_with_claims(True, revisit=BOUNDS)
    return store


def run(store: FrontierStore, answer: Callable[[Any], tuple[list[Any], Completion]]
        ) -> dict[str, Any]:
    """One run: the start request ``list``, then every page claimed answered by
    ``answer(leased) -> (records, completion)``; returns each page's leased request."""
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=[new("list")]), "w1")
    seen: dict[str, Any] = {}
    while leased := store.commit(UnitOfWork(claim=8), "w1").leased:
        for page in leased:
            seen[page.key] = page
            records, completion = answer(page)
            children = [new("p1", "list"), new("p2", "list")] if page.key == "list" else []
            store.commit(UnitOfWork(records=records, completions=[completion],
                                    requests=children if not completion.not_modified else []),
                         "w1")
    store.end_session("w1", "finished")
    return seen


def fetch(versions: dict[str, int]) -> Callable[[Any], tuple[list[Any], Completion]]:
    """A site whose product ``pN`` is at version ``versions[pN]``: a page not due is done
    without a request, one whose version its validators know answers 304."""
    def answer(page: Any) -> tuple[list[Any], Completion]:
        valid = page.validators
        if valid is not None and not valid.due:
            return [], Completion(page.key, RequestState.DONE, not_modified=True, not_due=True)
        version = versions.get(page.key, 0)
        if valid is not None and valid.etag == f'"v{version}"':
            return [], Completion(page.key, RequestState.DONE, not_modified=True)
        records = [(record(int(page.key[1:]), version), page.key)] if page.key != "list" else []
        return records, Completion(page.key, RequestState.DONE, validators=validators(version))
    return answer


def test_the_interval_halves_on_a_change_and_doubles_otherwise_within_the_bounds() -> None:
    assert next_revisit(None, False, BOUNDS) == DAY  # the first fetch: the shortest
    assert next_revisit(DAY, False, BOUNDS) == 2 * DAY
    assert next_revisit(4 * DAY, True, BOUNDS) == 2 * DAY
    assert next_revisit(DAY, True, BOUNDS) == DAY  # never below the shortest
    assert next_revisit(8 * DAY, False, BOUNDS) == 8 * DAY  # nor above the longest
    # due between half its interval and its interval after the run's start, a tenth of the
    # shortest early counting
    due = [revisit_due_at(0.0, 8 * DAY, f"p{n}", 3) for n in range(200)]
    assert all(4 * DAY <= at <= 8 * DAY for at in due) and len(set(due)) == 200
    assert revisit_due_at(0.0, 8 * DAY, "p1", 3) == revisit_due_at(0.0, 8 * DAY, "p1", 3)
    assert revisit_due(DAY, 0.9 * DAY, BOUNDS) and not revisit_due(DAY, 0.89 * DAY, BOUNDS)
    assert revisit_due(None, 0.0, BOUNDS) and revisit_due(DAY, 0.0, None)


def test_a_page_not_due_is_done_unchanged_without_a_request(store_factory: Stores) -> None:
    clock = Clock(DAY)
    store = open_store(store_factory, clock)
    run(store, fetch({}))
    clock.now += 0.3 * DAY  # within the first interval: the products are not due
    seen = run(store, fetch({"p1": 1}))  # p1 changed: not found before it is due
    assert seen["list"].validators.due  # a start request always is
    assert not seen["p1"].validators.due and not seen["p2"].validators.due
    (_, second) = store.runs()
    # the products' records are seen (unchanged) in the run, their page rows as they were
    assert (second.done, second.records_unchanged, second.records_updated) == (3, 2, 0)
    assert sorted(r.record_id for r in store.run_records(second.run_id)) == ["r1", "r2"]
    report = store.revisits()
    assert report is not None
    assert (report.pages, report.scheduled, report.run_id) == (3, 2, 2)
    assert (report.fetched, report.not_modified, report.not_due) == (0, 1, 2)
    # the bodies not downloaded: the listing (a 304) and the products
    assert report.requests_saved == 2 and report.bytes_saved == 3 * BODY_BYTES
    assert report.due == 0 and report.next_due_at is not None
    # a day after the first run, both are due: p1's change is found
    clock.now = 2 * DAY
    assert store.revisits().due == 2
    seen = run(store, fetch({"p1": 1}))
    assert seen["p1"].validators.due and seen["p2"].validators.due
    (*_, third) = store.runs()
    assert (third.records_updated, third.records_unchanged) == (1, 1)


def test_intervals_follow_each_page_s_history(store_factory: Stores) -> None:
    """p1 changes at every visit, p2 never: p2's visits space out to the longest interval,
    p1 stays at the shortest; listing pages (no records) are due at every run."""
    clock = Clock(DAY)
    store = open_store(store_factory, clock)
    versions = {"p1": 0, "p2": 0}
    fetched: dict[str, list[int]] = {"p1": [], "p2": [], "list": []}
    for day in range(30):
        clock.now = DAY * (1 + day)
        versions["p1"] += 1
        seen = run(store, fetch(versions))
        for key, page in seen.items():
            if page.validators is None or page.validators.due:
                fetched[key].append(day)
    assert fetched["list"] == list(range(30))
    assert fetched["p1"] == list(range(30))
    gaps = [b - a for a, b in zip(fetched["p2"], fetched["p2"][1:], strict=False)]
    assert gaps[0] == 1 and max(gaps) <= 8 and gaps[-1] >= 4, gaps


def test_without_revisits_every_page_is_due(store_factory: Stores) -> None:
    clock = Clock(DAY)
    store = open_store(store_factory, clock)
    store.load_validators_with_claims(True)  # conditional requests alone
    run(store, fetch({}))
    clock.now += 0.1 * DAY
    seen = run(store, fetch({}))
    assert all(page.validators.due for page in seen.values())
    report = store.revisits()
    assert report is not None and report.scheduled == 0
    assert (report.not_modified, report.not_due) == (3, 0)


def _changes(n: int, number: int) -> bool:
    """A tenth of the products change every round, half never, the rest now and then (2%
    a round)."""
    if n % 10 == 0:
        return True
    if n % 2 == 1:
        return False
    return random.Random(n * 1000 + number).random() < 0.02


@pytest.mark.slow
def test_requests_per_round_fall_near_the_changed_pages(store_factory: Stores) -> None:
    """The issue's acceptance, at the store level: over 80 daily rounds (the longest
    interval 32 days), the requests of the last 20 rounds come within 1.5 times the
    pages changed, and no change is found more than 32 rounds late."""
    clock = Clock(0.0)
    bounds = RevisitBounds(DAY, 32 * DAY)

    def store_of() -> FrontierStore:
        store = store_factory(clock=clock)
        store.open(fingerprinter="f")
        return store

    rounds = simulate_rounds(store_of, lambda now: setattr(clock, "now", now), products=300,
                             rounds=80, round_seconds=DAY, bounds=bounds, changes=_changes)
    for r in rounds:
        print(f"round {r.number:2d}: {r.changed:3d} changed, {r.requests:3d} requests"
              f" ({r.full} 200, {r.not_modified} 304), {r.not_due} not due,"
              f" {r.detected} changes found, at most {max(r.late, default=0)} rounds late")
    late = [days for r in rounds for days in r.late]
    assert max(late) <= 32
    assert all(r.records_updated == r.detected for r in rounds)
    last = rounds[-20:]
    assert sum(r.requests for r in last) <= 1.5 * sum(r.changed for r in last)
    assert sum(r.detected for r in rounds[1:]) <= sum(r.changed for r in rounds)


def test_adaptive_revisits_need_conditional_requests_and_ordered_bounds() -> None:
    import scrapy
    from scrapy.settings import Settings

    from scrapy_idempotent.config import IdempotentConfig
    from scrapy_idempotent.exceptions import ConfigError

    spider: Any = type("S", (scrapy.Spider,), {"name": "x"})()

    def config(**values: Any) -> IdempotentConfig:
        return IdempotentConfig.from_settings(Settings(values), spider)

    assert config().revisit is None
    assert config(IDEMPOTENT_CONDITIONAL_REQUESTS=True, IDEMPOTENT_ADAPTIVE_REVISIT=True
                  ).revisit == RevisitBounds(86400.0, 30 * 86400.0)
    with pytest.raises(ConfigError, match=r"IDEMPOTENT_ADAPTIVE_REVISIT=True .* unless"
                                          " IDEMPOTENT_CONDITIONAL_REQUESTS"):
        config(IDEMPOTENT_ADAPTIVE_REVISIT=True)
    with pytest.raises(ConfigError, match=r"IDEMPOTENT_REVISIT_MAX_SECONDS=60 .*at least"):
        config(IDEMPOTENT_REVISIT_MIN_SECONDS=120, IDEMPOTENT_REVISIT_MAX_SECONDS=60)


def test_a_revisit_of_a_lost_lease_writes_nothing(store_factory: Stores) -> None:
    """Fencing covers the revisit time: a completion whose lease is another worker's by
    then changes neither the page's schedule nor its records' sighting."""
    clock = Clock(DAY)
    store = open_store(store_factory, clock)
    run(store, fetch({}))
    clock.now += 2 * DAY
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=[new("list")]), "w1")
    [listing] = store.commit(UnitOfWork(claim=1), "w1").leased
    store.commit(UnitOfWork(completions=[
        Completion(listing.key, RequestState.DONE, not_modified=True)]), "w1")
    leased = store.commit(UnitOfWork(claim=8), "w1").leased
    assert sorted(p.key for p in leased) == ["p1", "p2"]
    store.release_leases(["w1"])  # their leases lost: another worker takes them
    other = open_store(store_factory, clock)
    other.begin_session("w2", "auto")
    assert len(other.commit(UnitOfWork(claim=8), "w2").leased) == 2
    result = store.commit(UnitOfWork(
        records=[(record(1, 5), "p1")],
        completions=[Completion("p1", RequestState.DONE, validators=validators(5)),
                     Completion("p2", RequestState.DONE, not_modified=True)]), "w1")
    assert (result.leases_lost, result.records_updated, result.records_unchanged) == (2, 0, 0)
    after = store.revisits()
    assert after is not None
    # both still due (a schedule written now would put them a day or more ahead)
    assert (after.scheduled, after.due) == (2, 2)
    assert (after.fetched, after.not_modified) == (0, 1)  # the listing's 304 only
