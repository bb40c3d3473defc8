"""The outbox deliverer keeps its bounds: ``IDEMPOTENT_OUTBOX_DRAIN_SECONDS`` bounds a crawl's
close (a target that never answers cannot hold it up, a backlog is not delivered to its end),
every attempt ends within ``IDEMPOTENT_OUTBOX_TIMEOUT_SECONDS``, an announcement is delivered
once at a time, and only the outcomes that were recorded are counted.

Real crawls of the local shop (on SQLite and on PostgreSQL) and real SQLite stores; the
targets are tests/outbox_targets.py classes. The store's clock is a fake one where a hold must
end (no waiting for it)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from local_site import LocalSite
from outbox_targets import StuckTarget
from scrapy.utils.defer import deferred_f_from_coro_f, maybe_deferred_to_future
from twisted.internet.defer import Deferred

from crawling import crawl_settings, run_crawl
from helpers.stored import outbox_rows, outbox_states
from helpers.stores import fetch_page, rec
from scrapy_idempotent import DeliveryRetry, OutboxTarget
from scrapy_idempotent._serial_thread import SerialThread
from scrapy_idempotent.outbox import HOLD_MARGIN_SECONDS, Deliverer
from scrapy_idempotent.store import SQLiteStore
from shop.spiders.shop import ShopSpider

STUCK = "outbox_targets.StuckTarget"
NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


@pytest.fixture
def small_shop() -> Any:
    """5 listing pages, 50 products."""
    with LocalSite(listing_pages=5, products_per_page=10) as site:
        yield site


@pytest.fixture
def stuck() -> Any:
    StuckTarget.reset()
    yield StuckTarget
    StuckTarget.release()  # the hung calls end (their outcome is long dropped)


def outbox_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("scrapy_idempotent-outbox")]


@deferred_f_from_coro_f
async def test_a_target_that_never_answers_does_not_hold_up_the_close(
        small_shop: LocalSite, crawl_database: str, stuck: type[StuckTarget]) -> None:
    """The attempts' timeout is far away (600 s): it is the drain (1 s) that ends the close.
    The deliveries in flight then are cut off and left pending, due at once: the next crawl
    delivers them."""
    settings = crawl_settings(crawl_database, **NATURAL_KEYS,
                              IDEMPOTENT_OUTBOX_TARGETS=[STUCK],
                              IDEMPOTENT_OUTBOX_CONCURRENCY=4,
                              IDEMPOTENT_OUTBOX_TIMEOUT_SECONDS=600,
                              IDEMPOTENT_OUTBOX_DRAIN_SECONDS=1)
    crawler = await run_crawl(ShopSpider, settings, url=small_shop.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/outbox/written"] == 50
    assert stats["idempotent/outbox/pending"] == 50
    assert "idempotent/outbox/delivered" not in stats
    # four deliveries started (the concurrency), none of them twice
    assert sum(stuck.CALLS.values()) == 4 and set(stuck.CALLS.values()) == {1}
    assert outbox_states(crawl_database) == {"pending": 50}
    cut = [(e.detail, e.attempts) for e in outbox_rows(crawl_database) if e.detail is not None]
    assert cut == [("not acknowledged before delivery stopped", 1)] * 4
    assert outbox_threads() == []  # the deliverer's store thread was joined at close

    stuck.ANSWER = True  # the broker is back: the next crawl delivers what is left
    crawler = await run_crawl(ShopSpider, settings, url=small_shop.url)
    assert crawler.stats.get_value("idempotent/outbox/delivered") == 50
    assert outbox_states(crawl_database) == {"delivered": 50}


@deferred_f_from_coro_f
async def test_an_attempt_ends_at_the_timeout_and_is_never_run_twice_at_once(
        small_shop: LocalSite, crawl_database: str, stuck: type[StuckTarget]) -> None:
    """Each announcement's first attempt hangs: it is cut off after the timeout and tried
    again (once), never while the first is still running."""
    stuck.reset(answer=True, first_stuck=True)
    crawler = await run_crawl(ShopSpider, crawl_settings(
        crawl_database, **NATURAL_KEYS, IDEMPOTENT_OUTBOX_TARGETS=[STUCK],
        IDEMPOTENT_OUTBOX_TIMEOUT_SECONDS=0.5, IDEMPOTENT_OUTBOX_RETRY_SECONDS=0.05,
        IDEMPOTENT_OUTBOX_DRAIN_SECONDS=120), url=small_shop.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert (stats["idempotent/outbox/delivered"], stats["idempotent/outbox/retried"]) == (50, 50)
    assert set(stuck.CALLS.values()) == {2} and len(stuck.CALLS) == 50
    assert set(stuck.MOST_AT_ONCE.values()) == {1}
    rows = [(e.state, e.attempts) for e in outbox_rows(crawl_database)]
    assert rows == [("delivered", 2)] * 50


class Gate(OutboxTarget):
    """Answers each delivery when the test says: ``calls`` holds (key, Deferred) pairs; fire
    the Deferred with the answer (or a failure)."""

    def __init__(self, name: str = "gate") -> None:
        self.name = name
        self.calls: list[tuple[str, Deferred[str]]] = []

    async def deliver(self, announcement: Any) -> str:
        answer: Deferred[str] = Deferred()
        self.calls.append((announcement.key, answer))
        result: str = await maybe_deferred_to_future(answer)
        return result


class Instant(OutboxTarget):
    """Acknowledges at once; the first ``answer_first`` calls only, the later ones hang
    (cancellable) when ``answer_first`` is set."""

    def __init__(self, name: str = "gate", answer_first: int | None = None) -> None:
        self.name = name
        self.answer_first = answer_first
        self.calls: list[str] = []

    async def deliver(self, announcement: Any) -> str:
        self.calls.append(announcement.key)
        if self.answer_first is not None and len(self.calls) > self.answer_first:
            await maybe_deferred_to_future(Deferred())
        return "ok"


async def turns_until(condition: Any) -> None:
    """Let the reactor run until ``condition()`` holds (the targets' calls start in later
    turns of the loop than the pump that claims their entries)."""
    from twisted.internet import reactor
    from twisted.internet.task import deferLater

    while not condition():
        await maybe_deferred_to_future(deferLater(reactor, 0, lambda: None))


def fake_clock() -> Any:
    now = [1_700_000_000.0]

    def clock() -> float:
        return now[0]

    clock.advance = lambda seconds: now.__setitem__(0, now[0] + seconds)  # type: ignore[attr-defined]
    return clock


def entries_store(path: Path, clock: Any, count: int, target: str = "gate") -> SQLiteStore:
    store = SQLiteStore(str(path), clock=clock)
    store.open(fingerprinter="x")
    store.begin_session("w1", "auto")
    fetch_page(store, "a", *(rec(f"r{n}", f"h{n}") for n in range(count)), targets=(target,))
    return store


def deliverer(store: Any, target: OutboxTarget, clock: Any, **options: Any) -> Deliverer:
    settings: dict[str, Any] = {"concurrency": 8, "timeout_seconds": 300.0,
                                "retry_seconds": 0.0, "retry_max_seconds": 0.0, **options}
    return Deliverer(store, [target], clock=clock, **settings)


@deferred_f_from_coro_f
async def test_an_entry_in_flight_is_not_claimed_again_when_its_hold_ends(
        tmp_path: Path) -> None:
    clock = fake_clock()
    store = entries_store(tmp_path / "db.sqlite3", clock, 1)
    gate = Gate()
    one = deliverer(store, gate, clock)
    assert await maybe_deferred_to_future(one.pump()) == 1
    clock.advance(one.hold_seconds + 1)  # the hold is over, the delivery still in flight
    assert await maybe_deferred_to_future(one.pump()) == 0
    await turns_until(lambda: gate.calls)
    assert [key for key, _ in gate.calls] == ["r0:1:h0"]
    gate.calls[0][1].callback("HTTP 200")
    await maybe_deferred_to_future(one.wait_idle())
    assert one.counts["delivered"] == 1
    assert [(e.state, e.attempts) for e in store.outbox_entries()] == [("delivered", 1)]
    await one.close()
    store.close()


@deferred_f_from_coro_f
async def test_a_late_outcome_of_an_expired_claim_changes_nothing_and_is_not_counted(
        tmp_path: Path) -> None:
    """Deliverer ``a`` (another process, say) holds two entries past their hold; ``b``
    claims them again. ``a``'s late answers (an acknowledgement, a retry) change neither
    entry, are not counted, and do not end ``b``'s hold."""
    clock = fake_clock()
    path = tmp_path / "db.sqlite3"
    store = entries_store(path, clock, 2)
    other = SQLiteStore(str(path), clock=clock)
    other.open_existing(readonly=False)
    gate_a, gate_b = Gate(), Gate()
    a, b = deliverer(store, gate_a, clock), deliverer(other, gate_b, clock)
    assert await maybe_deferred_to_future(a.pump()) == 2
    clock.advance(a.hold_seconds + 1)
    assert await maybe_deferred_to_future(b.pump()) == 2
    await turns_until(lambda: len(gate_a.calls) == len(gate_b.calls) == 2)
    (_, first_a), (_, second_a) = gate_a.calls
    first_a.callback("HTTP 200 from a")
    second_a.errback(DeliveryRetry("HTTP 503 to a", retry_after_seconds=0))
    await maybe_deferred_to_future(a.wait_idle())
    assert (a.counts["delivered"], a.counts["pending"]) == (0, 0)
    assert [(e.state, e.attempts, e.detail) for e in store.outbox_entries()] == [
        ("pending", 0, None), ("pending", 0, None)]
    # b's hold stands: nobody may claim them meanwhile
    assert store.claim_outbox(["gate"], 10, 30.0) == []
    for _, answer in gate_b.calls:
        answer.callback("HTTP 200 from b")
    await maybe_deferred_to_future(b.wait_idle())
    assert b.counts["delivered"] == 2
    assert [(e.state, e.attempts, e.detail) for e in store.outbox_entries()] == [
        ("delivered", 1, "HTTP 200 from b")] * 2
    await a.close()
    await b.close()
    other.close()
    store.close()


@deferred_f_from_coro_f
async def test_drain_bounds_a_backlog(tmp_path: Path) -> None:
    """40 entries due; the target acknowledges the first 5 at once and never answers the
    others: the drain (5 s) returns with the 5 delivered and the 35 others pending."""
    store = entries_store(tmp_path / "db.sqlite3", fake_clock(), 40)
    target = Instant(answer_first=5)
    one = deliverer(store, target, store.clock, concurrency=2)
    left = await one.drain(5)
    assert (one.counts["delivered"], left) == (5, 35)
    assert len(target.calls) == 7  # five acknowledged, two cut off at the drain's end
    await one.close()
    store.close()


@deferred_f_from_coro_f
async def test_drain_zero_starts_no_delivery(tmp_path: Path) -> None:
    store = entries_store(tmp_path / "db.sqlite3", fake_clock(), 40)
    target = Instant()
    one = deliverer(store, target, store.clock)
    assert await one.drain(0) == 40
    assert target.calls == []
    await one.close()
    store.close()


@deferred_f_from_coro_f
async def test_drain_zero_cuts_off_the_deliveries_in_flight(tmp_path: Path) -> None:
    clock = fake_clock()
    store = entries_store(tmp_path / "db.sqlite3", clock, 3)
    gate = Gate()
    one = deliverer(store, gate, clock)
    assert await maybe_deferred_to_future(one.pump()) == 3
    await turns_until(lambda: len(gate.calls) == 3)
    assert await one.drain(0) == 3
    assert [(e.state, e.attempts) for e in store.outbox_entries()] == [("pending", 1)] * 3
    assert store.outbox_next_due(["gate"]) == clock()  # due again at once
    assert one.counts["pending"] == 3
    await one.close()
    store.close()


def test_the_hold_outlasts_an_attempt() -> None:
    one = Deliverer(SQLiteStore(":memory:"), [], concurrency=1, timeout_seconds=30,
                    retry_seconds=1, retry_max_seconds=1)
    assert one.hold_seconds == one.timeout_seconds + HOLD_MARGIN_SECONDS > one.timeout_seconds


def test_the_store_threads_shutdown_waits_for_the_thread_to_end() -> None:
    thread = SerialThread("scrapy_idempotent-outbox")
    started, release = threading.Event(), threading.Event()
    done: list[str] = []

    def slow() -> None:
        started.set()
        release.wait()
        done.append("action")

    thread(slow)
    started.wait()
    releaser = threading.Thread(target=lambda: (wait_until_stopped(thread), release.set()))
    releaser.start()
    thread.shutdown()
    done.append("shutdown returned")
    releaser.join()
    assert done == ["action", "shutdown returned"]
    assert outbox_threads() == []
    with pytest.raises(RuntimeError):
        thread(lambda: None)


def wait_until_stopped(thread: SerialThread) -> None:
    """Until ``shutdown`` was called (the thread takes no new call)."""
    while not thread._stopped:
        threading.Event().wait(0.001)


class CancelledByItsClient(OutboxTarget):
    """A client whose own request was cancelled (not by the deliverer): a failed attempt."""

    name = "gate"

    async def deliver(self, announcement: Any) -> str:
        from twisted.internet.defer import CancelledError

        raise CancelledError("the client gave up")


@deferred_f_from_coro_f
async def test_a_cancellation_the_deliverer_did_not_ask_for_is_a_failed_attempt(
        tmp_path: Path) -> None:
    clock = fake_clock()
    store = entries_store(tmp_path / "db.sqlite3", clock, 1)
    one = deliverer(store, CancelledByItsClient(), clock, retry_seconds=60.0,
                    retry_max_seconds=60.0)
    assert await maybe_deferred_to_future(one.pump()) == 1
    await maybe_deferred_to_future(one.wait_idle())
    assert one.counts["pending"] == 1
    [entry] = store.outbox_entries()
    assert (entry.state, entry.attempts, entry.detail) == (
        "pending", 1, "CancelledError: the client gave up")
    due = store.outbox_next_due(["gate"])
    assert due is not None and due - clock() >= 30  # the backoff, not "due at once"
    await one.close()
    store.close()


class Deaf(OutboxTarget):
    """A broker client that ignores cancellation (a call in a thread): the first call of each
    key ends only when the test fires ``release``; later calls acknowledge at once.
    ``most_at_once`` is the most calls of one key running at the same time."""

    def __init__(self, name: str = "gate") -> None:
        self.name = name
        self.released = False
        self.waits: list[Deferred[None]] = []
        self.calls: list[str] = []
        self.running: dict[str, int] = {}
        self.most_at_once = 0

    async def deliver(self, announcement: Any) -> str:
        key = announcement.key
        first = key not in self.calls
        self.calls.append(key)
        self.running[key] = self.running.get(key, 0) + 1
        self.most_at_once = max(self.most_at_once, self.running[key])
        try:
            while first and not self.released:
                wait: Deferred[None] = Deferred()
                self.waits.append(wait)
                try:
                    await maybe_deferred_to_future(wait)
                except BaseException:  # cancelled: it goes on all the same
                    continue
            return "ok"
        finally:
            self.running[key] -= 1

    def release(self) -> None:
        self.released = True
        for wait in self.waits:
            if not wait.called:
                wait.callback(None)


@deferred_f_from_coro_f
async def test_a_call_cut_off_but_still_running_keeps_its_entry_from_a_second_send(
        tmp_path: Path) -> None:
    """The attempt ends at the timeout, but the target's call goes on: the entry is settled
    pending, due at once, yet not sent again while that call runs, and the call keeps its
    place in the concurrency (stuck calls cannot pile up). Once it ends, the entry is
    delivered by a second call."""
    clock = fake_clock()
    store = entries_store(tmp_path / "db.sqlite3", clock, 2)
    deaf = Deaf()
    one = deliverer(store, deaf, clock, concurrency=1, timeout_seconds=0.05)
    await maybe_deferred_to_future(one.pump())
    await turns_until(lambda: one.counts["pending"] == 1)  # the first attempt cut off
    for _ in range(5):
        assert await maybe_deferred_to_future(one.pump()) == 0  # its place is still taken
    assert len(deaf.calls) == 1
    deaf.release()  # the stuck call ends; the entries go out one by one
    await turns_until(lambda: one.counts["delivered"] == 2)
    assert deaf.most_at_once == 1
    assert sorted(deaf.calls) == sorted([deaf.calls[0], *{e.key for e in
                                                          store.outbox_entries()}])
    assert {e.state for e in store.outbox_entries()} == {"delivered"}
    store.close()
