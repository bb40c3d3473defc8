"""Politeness for the whole crawl, in the store (every backend, an injected clock): claims keep
each download slot's concurrency and delay over all workers, take the slots that waited
longest first, and keep the pauses sites ask for (429/503, Retry-After) for every worker and
store opened later; and the pieces the scheduler side reads (Retry-After, the settings)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import FakeClock

from scrapy_idempotent.config import ConfigError, IdempotentConfig, slot_limits
from scrapy_idempotent.slot_backoff import throttled
from scrapy_idempotent.store.base import (
    Completion,
    FrontierStore,
    NewRequest,
    RequestState,
    SlotLimits,
    UnitOfWork,
)
from scrapy_idempotent.store.rules import (
    SLOT_WANTED_RECHECK_SECONDS,
    SLOT_WANTED_SECONDS,
    pause_seconds,
)

LIMITS = SlotLimits(concurrency=2, per_slot=(("slow.example", 1, 5.0),))
#: the crawl's limits as a worker keeps them: a dead worker's slots paused 10 s
CAUTIOUS = dataclasses.replace(LIMITS, dead_worker_pause_seconds=10.0)


def req(slot: str, n: int) -> NewRequest:
    url = f"https://{slot}/{n}"
    return NewRequest(key=f"{slot}/{n}", fingerprint=f"fp-{slot}/{n}", url=url, priority=0,
                      data=json.dumps({"url": url}), slot=slot, fifo=True)


@pytest.fixture
def polite(store_factory: Callable[..., FrontierStore]) -> Callable[..., FrontierStore]:
    """``polite(worker)``: a store of the test's database, opened for ``worker``, claiming by
    :data:`LIMITS` (as two worker processes of one crawl)."""

    def make(worker: str, limits: SlotLimits = LIMITS) -> FrontierStore:
        store = store_factory(lease_seconds=60.0)
        store.open(fingerprinter="x")
        store.begin_session(worker, "auto")  # type: ignore[arg-type]
        store.keep_slot_limits(limits)
        return store

    return make


def claim(store: FrontierStore, worker: str, count: int = 10) -> list[str]:
    return [r.key for r in store.commit(UnitOfWork(claim=count), worker).leased]


def done(store: FrontierStore, worker: str, *keys: str) -> None:
    store.commit(UnitOfWork(completions=[Completion(k, RequestState.DONE) for k in keys]),
                 worker)


def test_concurrency_of_a_slot_holds_over_every_worker(
        polite: Callable[[str], FrontierStore]) -> None:
    one, two = polite("w1"), polite("w2")
    one.commit(UnitOfWork(requests=[req("a.example", n) for n in range(6)]), "w1")
    first = claim(one, "w1")
    assert first == ["a.example/0", "a.example/1"]  # the slot's concurrency: 2
    assert claim(two, "w2") == []  # another worker's leases count too
    done(one, "w1", first[0])
    assert claim(two, "w2") == ["a.example/2"]
    assert [(s.slot, s.leased, s.pending) for s in two.slots()] == [("a.example", 2, 3)]


def claim_done(store: FrontierStore, worker: str, *keys: str) -> list[str]:
    """Complete ``keys`` and claim in the same transaction (a page commit refilling)."""
    return [r.key for r in store.commit(UnitOfWork(
        completions=[Completion(k, RequestState.DONE) for k in keys], claim=10),
        worker).leased]


def test_a_slots_places_spread_over_the_workers_that_want_them(
        polite: Callable[..., FrontierStore], clock: FakeClock) -> None:
    four = SlotLimits(concurrency=4)
    one, two = polite("w1", four), polite("w2", four)
    one.commit(UnitOfWork(requests=[req("a.example", n) for n in range(20)]), "w1")
    held = {"w1": claim(one, "w1"), "w2": []}
    assert len(held["w1"]) == 4  # alone: the whole limit
    # the slot is full: the second worker wants places, and asks again soon
    result = two.commit(UnitOfWork(claim=10), "w2")
    assert result.leased == [] and result.claim_again_in == SLOT_WANTED_RECHECK_SECONDS
    # the first worker's page commits leave places: it keeps its share (4 / 2)
    assert claim_done(one, "w1", held["w1"].pop(0)) == []
    assert claim_done(one, "w1", held["w1"].pop(0)) == []
    held["w2"] = claim(two, "w2")
    assert len(held["w2"]) == 2
    # each refills its own share; never more than 4 leased over both
    for _ in range(3):
        for worker, store in (("w1", one), ("w2", two)):
            held[worker] += claim_done(store, worker, held[worker].pop(0))
            assert len(held[worker]) == 2
            assert [s.leased for s in one.slots()] == [4]
    # nobody wanted the slot for a while, the second worker is gone: one takes it all again
    done(two, "w2", *held["w2"])
    clock.advance(SLOT_WANTED_SECONDS + 1)
    assert len(claim_done(one, "w1", held["w1"].pop(0))) == 3


def test_a_lone_worker_keeps_a_slots_whole_limit(
        polite: Callable[..., FrontierStore]) -> None:
    one = polite("w1", SlotLimits(concurrency=4))
    one.commit(UnitOfWork(requests=[req("a.example", n) for n in range(20)]), "w1")
    held = claim(one, "w1")
    assert len(held) == 4
    for _ in range(4):
        result = one.commit(UnitOfWork(
            completions=[Completion(held.pop(0), RequestState.DONE)], claim=10), "w1")
        held += [r.key for r in result.leased]
        assert len(held) == 4 and result.claim_again_in is None  # it wants nothing more


def test_a_slot_with_a_delay_gives_one_request_per_delay(
        polite: Callable[[str], FrontierStore], clock: FakeClock) -> None:
    one, two = polite("w1"), polite("w2")
    one.commit(UnitOfWork(requests=[req("slow.example", n) for n in range(3)]
                          + [req("a.example", 0)]), "w1")
    result = one.commit(UnitOfWork(claim=10), "w1")
    assert sorted(r.key for r in result.leased) == ["a.example/0", "slow.example/0"]
    # to be sent within its margin (a quarter of the delay, at most 1 s), and the slot's
    # next claim after that and the delay: never two sends closer than the delay
    assert [r.send_by for r in result.leased if r.key == "slow.example/0"] == [clock() + 1.0]
    assert [r.send_by for r in result.leased if r.key == "a.example/0"] == [0.0]
    assert result.claim_again_in == pytest.approx(6.0)  # when slow.example may send again
    done(one, "w1", "slow.example/0")  # done, but its delay is not over
    clock.advance(5.9)
    waiting = two.commit(UnitOfWork(claim=10), "w2")
    assert waiting.leased == [] and waiting.claim_again_in == pytest.approx(0.1)
    clock.advance(0.1)
    assert claim(two, "w2") == ["slow.example/1"]


def test_claims_take_the_slot_that_waited_longest_first(
        polite: Callable[[str], FrontierStore], clock: FakeClock) -> None:
    store = polite("w1")
    # a busy site at the head of the frontier does not take every claim
    store.commit(UnitOfWork(requests=[req("busy.example", n) for n in range(6)]
                            + [req("b.example", n) for n in range(2)]), "w1")
    assert claim(store, "w1", 2) == ["b.example/0", "b.example/1"]  # (by name at a tie)
    clock.advance(1)
    assert claim(store, "w1", 1) == ["busy.example/0"]  # b.example was served last


def test_a_pause_holds_for_every_worker_and_backs_off(
        polite: Callable[[str], FrontierStore], clock: FakeClock,
        store_factory: Callable[..., FrontierStore]) -> None:
    one = polite("w1")
    one.commit(UnitOfWork(requests=[req("a.example", n) for n in range(3)]
                          + [req("b.example", 0)]), "w1")
    assert one.pause_slot("a.example", retry_after=5.0, first_seconds=10.0,
                          max_seconds=600.0) == 5.0
    two = polite("w2")  # a worker started after the 429: it reads the pause from the store
    assert claim(two, "w2") == ["b.example/0"]  # the other site goes on
    clock.advance(4.9)
    assert claim(two, "w2") == []
    assert [(s.slot, s.paused_until, s.backoffs) for s in one.slots()
            if s.slot == "a.example"] == [("a.example", clock() + 0.1, 1)]
    clock.advance(0.1)
    assert claim(two, "w2") == ["a.example/0", "a.example/1"]
    # without Retry-After: the first pause, then doubled for every answer in a row
    assert one.pause_slot("a.example", retry_after=None, first_seconds=10.0,
                          max_seconds=600.0) == 20.0
    clock.advance(20)
    assert one.pause_slot("a.example", retry_after=None, first_seconds=10.0,
                          max_seconds=25.0) == 25.0  # (the maximum)
    one.slot_answered("a.example")
    clock.advance(25)
    assert one.pause_slot("a.example", retry_after=None, first_seconds=10.0,
                          max_seconds=600.0) == 10.0  # answered normally in between


def test_a_crawl_delay_kept_by_the_store_is_the_slots_delay_when_longer(
        polite: Callable[[str], FrontierStore], clock: FakeClock) -> None:
    store = polite("w1")
    store.commit(UnitOfWork(requests=[req("a.example", n) for n in range(3)]), "w1")
    store.set_slot_delay("a.example", 2.0)
    assert claim(store, "w1") == ["a.example/0"]
    clock.advance(2.4)  # its delay and its margin (a quarter of it)
    assert claim(store, "w1") == []
    clock.advance(0.1)
    assert claim(store, "w1") == ["a.example/1"]


def test_per_worker_limits_claim_the_frontier_head(
        store_factory: Callable[..., FrontierStore]) -> None:
    store = store_factory(lease_seconds=60.0)
    store.open(fingerprinter="x")
    store.begin_session("w1", "auto")  # type: ignore[arg-type]
    store.keep_slot_limits(None)
    store.commit(UnitOfWork(requests=[req("a.example", n) for n in range(5)]), "w1")
    assert len(claim(store, "w1")) == 5


def test_pause_seconds_backs_off_exponentially_with_jitter_up_to_the_maximum() -> None:
    assert pause_seconds(None, 0, 10.0, 600.0) == 10.0
    assert pause_seconds(None, 3, 10.0, 600.0) == 80.0
    assert pause_seconds(None, 30, 10.0, 600.0) == 600.0
    assert pause_seconds(7.0, 5, 10.0, 600.0) == 7.0  # the site's word
    assert pause_seconds(7200.0, 0, 10.0, 600.0) == 600.0
    jittered = {pause_seconds(None, 1, 10.0, 600.0, 0.25) for _ in range(50)}
    assert all(20.0 <= s <= 25.0 for s in jittered) and len(jittered) > 1


def test_a_429_or_a_503_with_retry_after_asks_for_a_pause() -> None:
    assert throttled(429, False) and throttled(429, True) and throttled(503, True)
    assert not throttled(503, False)  # a failing page: RetryMiddleware's, as in Scrapy
    assert not throttled(500, True)


def test_the_slot_limits_are_scrapys_settings() -> None:
    from scrapy.settings import Settings

    settings = Settings({"CONCURRENT_REQUESTS_PER_DOMAIN": 3, "DOWNLOAD_DELAY": 0.5,
                         "DOWNLOAD_SLOTS": {"b.example": {"concurrency": 1},
                                            "a.example": {"delay": 2}}})
    assert slot_limits(settings) == SlotLimits(
        concurrency=3, delay_seconds=0.5,
        per_slot=(("a.example", None, 2.0), ("b.example", 1, None)))


def test_the_slot_limits_read_throttling_scopes_where_scrapy_has_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Scrapy's throttling work (after 2.19.0) renames DOWNLOAD_SLOTS to
    # THROTTLING_SCOPES: the limits a user sets there bind the crawl too, an entry of the new
    # setting winning key by key; a Scrapy without it (2.13 to 2.19.0) does not read it
    from scrapy.settings import Settings, default_settings

    given = {"DOWNLOAD_SLOTS": {"a.example": {"delay": 2, "concurrency": 4}},
             "THROTTLING_SCOPES": {"a.example": {"concurrency": 1},
                                   "api": {"concurrency": 2, "delay": 0.5}}}
    if not hasattr(default_settings, "THROTTLING_SCOPES"):
        assert slot_limits(Settings(given)).per_slot == (("a.example", 4, 2.0),)
        monkeypatch.setattr(default_settings, "THROTTLING_SCOPES", {}, raising=False)
    assert slot_limits(Settings(given)).per_slot == (("a.example", 1, 2.0),
                                                     ("api", 2, 0.5))


class _Throttler:
    """Scrapy's throttler as its throttling work has it: the key of a request's scopes."""

    def get_scopes_key(self, request: Any) -> str:
        scopes = request.meta.get("throttling_scopes")
        if scopes is None:
            return "host-of-" + request.url
        return scopes if isinstance(scopes, str) else json.dumps(sorted(scopes))


class _Downloader:
    """A downloader whose crawler has Scrapy's throttler: its deprecated slot API must not
    be used (it warns)."""

    def __init__(self) -> None:
        self.crawler = type("Crawler", (), {"throttler": _Throttler()})()

    def get_slot_key(self, request: Any) -> str:
        raise AssertionError("Downloader.get_slot_key is deprecated with a throttler")

    @property
    def slots(self) -> dict[str, Any]:
        raise AssertionError("Downloader.slots is deprecated with a throttler")


def test_a_request_is_stored_with_its_throttling_scopes_where_scrapy_has_a_throttler(
        ) -> None:
    from scrapy import Request

    from scrapy_idempotent.politeness import Politeness

    politeness = Politeness.__new__(Politeness)
    politeness.crawl_wide, politeness.autothrottle = True, False
    politeness._downloader = _Downloader()
    assert politeness.slot_of(Request("https://a.example/1")) == "host-of-https://a.example/1"
    request = Request("https://a.example/2", meta={"throttling_scopes": "api"})
    assert politeness.slot_of(request) == "api"
    politeness.handing_out(request)  # the throttler keeps the worker's delay: left alone


@pytest.mark.parametrize(("settings", "name"), [
    ({"IDEMPOTENT_POLITENESS": "site"}, "IDEMPOTENT_POLITENESS"),
    ({"IDEMPOTENT_BACKOFF_SECONDS": 0}, "IDEMPOTENT_BACKOFF_SECONDS"),
    ({"IDEMPOTENT_BACKOFF_SECONDS": 60, "IDEMPOTENT_BACKOFF_MAX_SECONDS": 30},
     "IDEMPOTENT_BACKOFF_MAX_SECONDS"),
    ({"CONCURRENT_REQUESTS_PER_DOMAIN": 0, "IDEMPOTENT_POLITENESS": "crawl"},
     "CONCURRENT_REQUESTS_PER_DOMAIN"),
])
def test_bad_politeness_settings_are_refused(settings: dict[str, Any], name: str) -> None:
    from scrapy import Spider
    from scrapy.settings import Settings

    from scrapy_idempotent.config import SETTINGS

    with pytest.raises(ConfigError, match=name):
        IdempotentConfig.from_settings(Settings({**SETTINGS, **settings}),
                                       Spider(name="s"))


def test_an_expired_lease_does_not_hold_its_slot(
        polite: Callable[[str], FrontierStore], clock: FakeClock) -> None:
    """A stopped worker's leases, once expired, leave the slot to the others (they may take
    the expired requests again once reclaimed)."""
    stopped, other = polite("w1"), polite("w2")
    stopped.commit(UnitOfWork(requests=[req("a.example", n) for n in range(4)]), "w1")
    assert len(claim(stopped, "w1")) == 2
    assert claim(other, "w2") == []
    clock.advance(61)  # past the lease
    assert claim(other, "w2") == ["a.example/2", "a.example/3"]


def test_status_shows_the_busy_and_paused_slots(
        store_factory: Callable[..., FrontierStore]) -> None:
    from scrapy_idempotent.commands.status import _slot_report, _slots_section

    # the real clock: the status report reads the pauses against the time now
    store = store_factory(lease_seconds=60.0, clock=time.time)
    store.open(fingerprinter="x")
    store.begin_session("w1", "auto")  # type: ignore[arg-type]
    store.keep_slot_limits(LIMITS)
    store.commit(UnitOfWork(requests=[req("a.example", n) for n in range(3)]
                            + [req("b.example", 0)]), "w1")
    store.commit(UnitOfWork(claim=1), "w1")
    store.pause_slot("b.example", retry_after=30.0, first_seconds=10.0, max_seconds=600.0)
    report = _slot_report(store)
    assert [(s["slot"], s["leased"], s["pending"], s["backoffs"]) for s in report] == [
        ("a.example", 1, 2, 0), ("b.example", 0, 1, 1)]
    assert report[0]["paused_until"] is None and report[1]["paused_for_seconds"] > 25
    text = "\n".join(_slots_section(report))
    assert "Download slots (whole crawl)" in text and "backoff 1" in text


@pytest.mark.parametrize(("politeness", "installed"), [("worker", False), ("crawl", True)])
def test_the_backoff_middleware_runs_only_with_politeness_for_the_crawl(
        tmp_path: Any, politeness: str, installed: bool) -> None:
    """Per-worker politeness (the default) leaves every response's way as Scrapy's: the
    middleware that pauses slots for the whole crawl is not configured."""
    import scrapy
    from scrapy.core.downloader.middleware import DownloaderMiddlewareManager
    from scrapy.utils.test import get_crawler

    from scrapy_idempotent.slot_backoff import SlotBackoffMiddleware

    crawler = get_crawler(scrapy.Spider, {
        "ADDONS": {"scrapy_idempotent.Addon": 0},
        "IDEMPOTENT_DATABASE": str(tmp_path / "f.db"),
        "IDEMPOTENT_POLITENESS": politeness,
    })
    crawler.spider = crawler._create_spider("politeness")
    manager = DownloaderMiddlewareManager.from_crawler(crawler)
    found = [mw for mw in manager.middlewares if isinstance(mw, SlotBackoffMiddleware)]
    assert bool(found) is installed


def test_a_pause_binds_the_worker_that_got_the_429_before_it_is_written() -> None:
    # the pause is written by the writer's thread; until then (and after) the worker holds
    # back what it claimed of the slot: no request of it is handed out in between
    from twisted.internet.defer import Deferred

    from scrapy_idempotent.politeness import Politeness

    class Writer:
        def __init__(self) -> None:
            self.pausing: Deferred[float] = Deferred()

        def call(self, what: str, action: Any) -> Deferred[float]:
            return self.pausing

    class Stats:
        def inc_value(self, *args: Any) -> None:
            pass

    politeness = Politeness.__new__(Politeness)
    politeness.stats, politeness.writer = Stats(), Writer()
    politeness.first_backoff_seconds, politeness.max_backoff_seconds = 10.0, 600.0
    politeness._holds, politeness._backing_off = {}, set()
    assert not politeness.holding("a.example")
    politeness.throttled("a.example", 5.0)  # not written yet
    assert politeness.holding("a.example") and not politeness.holding("b.example")
    politeness.writer.pausing.callback(5.0)
    assert politeness.holding("a.example")
    politeness._holds["a.example"] = time.monotonic() - 1  # the pause is over
    assert not politeness.holding("a.example")


# -- a dead worker's slots ------------------------------------------------------------------


def _pauses(store: FrontierStore) -> dict[str, tuple[float, int]]:
    return {s.slot: (s.paused_until, s.backoffs) for s in store.slots()}


def test_a_dead_workers_slots_are_paused_when_its_leases_are_taken_back(
        polite: Callable[..., FrontierStore], clock: FakeClock) -> None:
    """It may have got a 429 it could not write: every slot it held a lease of (claimed
    ahead or in flight: the store cannot tell them apart) is paused for the first backoff
    from the take-back, in the same transaction, as a guess (the backoff is not doubled)."""
    dead, live = polite("w1", CAUTIOUS), polite("w2", CAUTIOUS)
    dead.commit(UnitOfWork(requests=[req("a.example", n) for n in range(3)]
                           + [req("b.example", n) for n in range(2)] + [req("c.example", 0)]),
                "w1")
    assert claim(dead, "w1", 3) == ["a.example/0", "a.example/1", "b.example/0"]
    clock.advance(1)
    reclaimed = live.reclaim_leases(["w1"], expired=False)
    assert (reclaimed.released, reclaimed.expired, reclaimed.dead) == (3, 0, ("w1",))
    assert reclaimed.paused == {"w1": ("a.example", "b.example")}
    assert reclaimed.paused_seconds == 10.0
    pauses = _pauses(live)
    assert pauses["a.example"] == pauses["b.example"] == (clock() + 10.0, 0)
    assert pauses["c.example"][0] <= clock()
    assert claim(live, "w2") == ["c.example/0"]  # the other site goes on
    clock.advance(9.9)
    assert claim(live, "w2") == []
    clock.advance(0.1)
    assert sorted(claim(live, "w2")) == ["a.example/0", "a.example/1", "b.example/0",
                                         "b.example/1"]


def test_a_longer_pause_stays_when_a_dead_workers_slots_are_paused(
        polite: Callable[..., FrontierStore], clock: FakeClock) -> None:
    dead, live = polite("w1", CAUTIOUS), polite("w2", CAUTIOUS)
    dead.commit(UnitOfWork(requests=[req("a.example", 0), req("b.example", 0)]), "w1")
    assert len(claim(dead, "w1")) == 2
    dead.pause_slot("a.example", retry_after=30.0, first_seconds=10.0, max_seconds=600.0)
    # the dead worker is found by the caller's test of its process (same host)
    reclaimed = live.reclaim_leases(expired=False, is_dead=lambda worker: worker == "w1")
    assert reclaimed.released == 2 and reclaimed.paused == {"w1": ("b.example",)}
    assert _pauses(live)["a.example"] == (clock() + 30.0, 1)
    assert _pauses(live)["b.example"] == (clock() + 10.0, 0)
    # a live worker is never judged dead: nothing read as dead, nothing written
    assert live.reclaim_leases(expired=False, is_dead=lambda worker: False).released == 0


def test_a_lone_workers_restart_does_not_pause_its_predecessors_slots(
        polite: Callable[..., FrontierStore], clock: FakeClock) -> None:
    """A restart that finds no other worker of the crawl alive takes its predecessor's leases
    back without pausing their slots: the sites heard nothing from the crawl since the kill,
    and the restart is the only worker that could send to them."""
    dead = polite("w1", CAUTIOUS)
    dead.commit(UnitOfWork(requests=[req("a.example", 0), req("b.example", 0)]), "w1")
    assert len(claim(dead, "w1")) == 2
    restarted = polite("w2", CAUTIOUS)
    reclaimed = restarted.reclaim_leases(expired=False, is_dead=lambda worker: worker == "w1",
                                         starting=True)
    assert (reclaimed.released, reclaimed.paused) == (2, {})
    assert sorted(claim(restarted, "w2")) == ["a.example/0", "b.example/0"]


def test_a_restart_beside_a_live_worker_pauses_its_predecessors_slots(
        polite: Callable[..., FrontierStore], clock: FakeClock) -> None:
    """Another worker of the crawl alive (holding a lease: on SQLite a worker of a made-up
    id counts as alive only so) may have been sending meanwhile: the slots are paused."""
    dead, other = polite("w1", CAUTIOUS), polite("w3", CAUTIOUS)
    dead.commit(UnitOfWork(requests=[req("a.example", 0), req("b.example", 0),
                                     req("c.example", 0)]), "w1")
    assert claim(dead, "w1", 2) == ["a.example/0", "b.example/0"]
    assert claim(other, "w3") == ["c.example/0"]
    restarted = polite("w2", CAUTIOUS)
    reclaimed = restarted.reclaim_leases(expired=False, is_dead=lambda worker: worker == "w1",
                                         starting=True)
    assert (reclaimed.released, reclaimed.paused) == (2, {"w1": ("a.example", "b.example")})
    assert claim(restarted, "w2") == []


def test_a_claim_takes_back_expired_leases_and_pauses_their_slots(
        polite: Callable[..., FrontierStore], clock: FakeClock) -> None:
    """A worker that died on another host (or stopped) has its leases expire: the next claim
    takes them back and pauses their slots before it reads the slots, so no claim sends to
    such a slot between the expiry and the pause."""
    stopped, other = polite("w1", CAUTIOUS), polite("w2", CAUTIOUS)
    stopped.commit(UnitOfWork(requests=[req("a.example", n) for n in range(4)]
                              + [req("b.example", 0)]), "w1")
    assert claim(stopped, "w1", 2) == ["a.example/0", "a.example/1"]
    clock.advance(61)  # past the lease
    result = other.commit(UnitOfWork(claim=10), "w2")
    assert [r.key for r in result.leased] == ["b.example/0"]
    assert result.reclaimed is not None and result.reclaimed.expired == 2
    assert result.reclaimed.paused == {"w1": ("a.example",)}
    assert result.claim_again_in == pytest.approx(10.0)
    clock.advance(10)
    assert claim(other, "w2") == ["a.example/0", "a.example/1"]
    assert other.commit(UnitOfWork(claim=10), "w2").reclaimed is None  # none expired


def test_reclaim_expired_pauses_the_slots_of_the_leases_it_takes_back(
        polite: Callable[..., FrontierStore], clock: FakeClock) -> None:
    stopped, other = polite("w1", CAUTIOUS), polite("w2", CAUTIOUS)
    stopped.commit(UnitOfWork(requests=[req("a.example", 0)]), "w1")
    assert claim(stopped, "w1") == ["a.example/0"]
    clock.advance(61)
    assert other.reclaim_expired() == 1
    assert _pauses(other)["a.example"] == (clock() + 10.0, 0)


def test_without_a_pause_for_dead_workers_their_slots_are_not_paused(
        polite: Callable[..., FrontierStore], clock: FakeClock) -> None:
    """Per-worker politeness keeps no slots' limits in the store: nothing to pause."""
    dead, live = polite("w1"), polite("w2")
    dead.commit(UnitOfWork(requests=[req("a.example", 0)]), "w1")
    assert claim(dead, "w1") == ["a.example/0"]
    reclaimed = live.reclaim_leases(["w1"], expired=False)
    assert reclaimed.released == 1 and reclaimed.paused == {}
    assert _pauses(live)["a.example"][0] <= clock()


def test_the_dead_workers_slots_paused_are_counted_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    from scrapy.statscollectors import MemoryStatsCollector
    from scrapy.utils.test import get_crawler

    from scrapy_idempotent.leases import report_dead_worker_pauses
    from scrapy_idempotent.store.base import Reclaimed

    stats = MemoryStatsCollector(get_crawler())
    with caplog.at_level(logging.INFO, logger="scrapy_idempotent.leases"):
        report_dead_worker_pauses(stats, Reclaimed(
            released=3, dead=("host:1:2:x",), paused={"host:1:2:x": ("a.example", "b.example")},
            paused_seconds=10.0))
    assert stats.get_value("idempotent/slots/paused_after_dead_worker") == 2
    assert [r.getMessage() for r in caplog.records if r.name == "scrapy_idempotent.leases"] == [
        "scrapy_idempotent: download slots a.example, b.example paused for 10.0 s for every "
        "worker: worker host:1:2:x held requests of them when its leases were taken back "
        "(dead or stopped, it may have got a 429 it could not write)"]


def test_the_crawls_limits_pause_a_dead_workers_slots_for_the_first_backoff() -> None:
    from scrapy import Spider
    from scrapy.settings import Settings

    from scrapy_idempotent.config import SETTINGS

    config = IdempotentConfig.from_settings(Settings({
        **SETTINGS, "IDEMPOTENT_POLITENESS": "crawl", "IDEMPOTENT_BACKOFF_SECONDS": 7}),
        Spider(name="s"))
    assert config.slot_limits.dead_worker_pause_seconds == 7.0


def test_a_start_writes_its_limits_into_the_slots_and_a_slots_own_are_kept(
        polite: Callable[..., FrontierStore]) -> None:
    """Each worker's start writes its limits into every slot (the crawl's limits are those
    of the worker that started last); a slot with limits of its own (``DOWNLOAD_SLOTS``)
    keeps them; a slot added since the start gets them."""
    a = polite("w1")
    a.commit(UnitOfWork(requests=[req(slot, 1) for slot in
                                  ("a.example", "b.example", "slow.example")]), "w1")

    def limits() -> dict[str, tuple[int, float]]:
        rows = a._select(  # type: ignore[attr-defined]
            "SELECT slot, concurrency, delay FROM slots WHERE slot <> '' ORDER BY slot")
        return {slot: (concurrency, delay) for slot, concurrency, delay in rows}

    assert limits() == {"a.example": (2, 0.0), "b.example": (2, 0.0),
                        "slow.example": (1, 5.0)}
    polite("w2", SlotLimits(concurrency=6, delay_seconds=0.5,
                            per_slot=(("slow.example", 1, 5.0), ("new.example", None, 2.0))))
    assert limits() == {"a.example": (6, 0.5), "b.example": (6, 0.5),
                        "new.example": (6, 2.0), "slow.example": (1, 5.0)}
    polite("w3")  # the first limits again: new.example no longer has its own
    assert limits() == {"a.example": (2, 0.0), "b.example": (2, 0.0),
                        "new.example": (2, 0.0), "slow.example": (1, 5.0)}
