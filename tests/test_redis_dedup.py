"""The Redis fast layer of the duplicate check (``IDEMPOTENT_DEDUP_REDIS_URL``), against a real
PostgreSQL store and a real Redis: a fingerprint enters the hash only after the commit that
made it durable; a kill between the two leaves the hash short and the database answers; the
hash never says "known" for a request the database would admit (a new run, a recrawl window
that ends, a migrated frontier, an operator's retry); a Redis that fails sends every link to
the database, with one WARNING, and is asked again later. The setting is checked before the
crawl starts."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeClock
from scrapy.spiders import Spider
from scrapy.utils.test import get_crawler

from helpers.redis_dedup import frontier_holds_every_field
from redis_server import (  # noqa: F401
    RedisServer,
    private_redis_server,
    redis_server,
)
from scrapy_idempotent import redis_dedup
from scrapy_idempotent.config import IdempotentConfig
from scrapy_idempotent.exceptions import ConfigError
from scrapy_idempotent.redis_dedup import RedisKnownRequests, redis_client
from scrapy_idempotent.store import (
    Completion,
    NewRequest,
    RequestState,
    UnitOfWork,
    open_store,
)

pytest.importorskip("redis")
pytest.importorskip("psycopg")

W = "w1"


def fingerprint(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()


def link(name: str, parent: str | None = None) -> NewRequest:
    fp = fingerprint(name)
    return NewRequest(key=fp, fingerprint=fp, url=f"https://shop.example/{name}", priority=0,
                      data=json.dumps({"url": f"https://shop.example/{name}"}),
                      parent_key=parent)


class Layered:
    """A PostgreSQL store (fake clock) with the Redis layer in front, and its stats."""

    def __init__(self, database: str, redis_url: str, clock: FakeClock, *,
                 recrawl_seconds: float | None = None, run_mode: str = "auto") -> None:
        self.clock = clock
        self.database = database
        self.store: Any = open_store(database, clock=clock, heartbeat_seconds=None,
                                     dead_after_seconds=None, recrawl_seconds=recrawl_seconds)
        self.store.open(fingerprinter="f")
        self.store.begin_session(W, run_mode)
        self.stats: dict[str, int] = {}
        self.dedup = RedisKnownRequests(self.store, redis_client(redis_url), url=redis_url,
                                        recrawl_seconds=recrawl_seconds, count=self.count)
        self.dedup.open()
        self.reads = 0
        read = self.store.known_request

        def counted(fp: str, *, key: str | None = None) -> str | None:
            self.reads += 1
            return read(fp, key=key)

        self.store.known_request = counted
        self.database_answer = read

    def count(self, name: str, n: int) -> None:
        self.stats[name.rsplit("/", 1)[1]] = self.stats.get(name.rsplit("/", 1)[1], 0) + n

    def commit(self, work: UnitOfWork, *, tell: bool = True) -> Any:
        """Commit ``work`` as the writer does (the layer told after the commit, unless the
        worker is killed in between: ``tell=False``)."""
        began = self.store.clock()
        result = self.store.commit(work, W)
        if tell:
            self.dedup.committed(work, result, began)
        return result

    def page(self, key: str, *links: NewRequest, tell: bool = True) -> Any:
        """Claim ``key`` (pending) and commit its page with ``links``."""
        leased = self.commit(UnitOfWork(claim=50), tell=tell).leased
        assert key in {r.key for r in leased}, leased
        return self.commit(UnitOfWork(requests=list(links),
                                      completions=[Completion(key, RequestState.DONE)],
                                      give_back=[r.key for r in leased if r.key != key]),
                           tell=tell)

    def answer(self, name: str) -> str | None:
        return self.dedup.known_request(fingerprint(name))

    def close(self) -> None:
        self.store.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_700_000_000.0)


@pytest.fixture
def layered(postgres_url: str, redis_server: RedisServer,  # noqa: F811
            clock: FakeClock) -> Iterator[Layered]:
    made = Layered(postgres_url, redis_server.url, clock)
    yield made
    made.close()


def hash_fields(server: RedisServer, dedup: RedisKnownRequests, run_id: int | None) -> set[str]:
    import redis

    return {field.hex() for field in redis.Redis.from_url(server.url).hkeys(dedup.key(run_id))}


def test_a_known_link_is_refused_from_redis_without_a_database_read(
        layered: Layered, redis_server: RedisServer) -> None:  # noqa: F811
    start = link("list/1")
    layered.commit(UnitOfWork(requests=[start]))
    layered.page(start.key, link("p/1", start.key), link("p/2", start.key))
    assert hash_fields(redis_server, layered.dedup, layered.store.run_id) == {
        fingerprint(name) for name in ("list/1", "p/1", "p/2")}
    # the worker's memory of known entries is of another process: a second layer on the
    # same database (another worker) answers from Redis alone
    other = Layered(layered.database, redis_server.url, layered.clock)
    try:
        other.dedup.expect_lookups([fingerprint(n) for n in ("p/1", "p/2", "list/1", "p/3")])
        assert [other.answer(n) for n in ("p/1", "p/2", "list/1")] == [
            "duplicate", "duplicate", "already_done"]
        assert other.reads == 0
        assert other.answer("p/3") is None  # unknown: the database answers
        assert other.reads == 1
        assert other.stats == {"redis_hits": 3, "redis_misses": 1}
    finally:
        other.close()


def test_a_fingerprint_enters_redis_only_after_its_commit(
        layered: Layered, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Through the writer (the hook the scheduler registers): while the page's transaction
    runs, and when it has just returned, Redis holds none of its links; after, all."""
    from scrapy_idempotent.writer import WriterThread

    start = link("list/1")
    layered.commit(UnitOfWork(requests=[start]))
    leased = layered.commit(UnitOfWork(claim=1)).leased
    children = [link(f"p/{n}", start.key) for n in range(5)]
    seen_during: list[set[str]] = []
    commit = layered.store.commit

    def observed(work: UnitOfWork, worker: str) -> Any:
        seen_during.append(hash_fields(redis_server, layered.dedup, layered.store.run_id))
        result = commit(work, worker)
        seen_during.append(hash_fields(redis_server, layered.dedup, layered.store.run_id))
        return result

    monkeypatch.setattr(layered.store, "commit", observed)
    writer = WriterThread(layered.store, W, threaded=False)
    writer.follow_durable(layered.dedup.committed)
    writer._running = True  # (a writer driven by hand: no reactor, no thread)
    writer.commit(UnitOfWork(requests=children,
                             completions=[Completion(leased[0].key, RequestState.DONE)]))
    wanted = {r.fingerprint for r in children}
    assert seen_during and all(not wanted & seen for seen in seen_during)
    assert wanted <= hash_fields(redis_server, layered.dedup, layered.store.run_id)


def test_a_kill_between_the_commit_and_redis_leaves_it_short(
        layered: Layered, redis_server: RedisServer) -> None:  # noqa: F811
    start = link("list/1")
    layered.commit(UnitOfWork(requests=[start]))
    layered.page(start.key, link("p/1", start.key), tell=False)  # killed before telling Redis
    assert hash_fields(redis_server, layered.dedup, layered.store.run_id) == {
        fingerprint("list/1")}
    other = Layered(layered.database, redis_server.url, layered.clock)  # another worker
    try:
        assert other.answer("p/1") == "duplicate"  # the database's answer
        assert other.stats == {"redis_misses": 1}
        assert other.reads == 1
    finally:
        other.close()


def test_a_lost_lease_adds_nothing(layered: Layered, redis_server: RedisServer) -> None:  # noqa: F811
    """A page whose lease is another worker's now wrote nothing: its links are not added."""
    start = link("list/1")
    layered.commit(UnitOfWork(requests=[start]))
    result = layered.commit(UnitOfWork(requests=[link("p/1", start.key)],
                                       completions=[Completion(start.key, RequestState.DONE)]))
    assert result.lost == [start.key]
    assert fingerprint("p/1") not in hash_fields(redis_server, layered.dedup,
                                                 layered.store.run_id)
    assert layered.answer("p/1") is None


def test_a_new_run_starts_with_an_empty_hash(
        postgres_url: str, redis_server: RedisServer, clock: FakeClock) -> None:  # noqa: F811
    first = Layered(postgres_url, redis_server.url, clock)
    start = link("list/1")
    first.commit(UnitOfWork(requests=[start]))
    first.page(start.key, link("p/1", start.key))
    assert first.answer("p/1") == "duplicate"
    first.store.end_session(W, "shutdown")
    first.close()
    fresh = Layered(postgres_url, redis_server.url, clock, run_mode="fresh")
    try:
        assert fresh.store.run_id == 2
        # the new run's frontier is empty: the link is new, and Redis does not say otherwise
        assert fresh.database_answer(fingerprint("p/1")) is None
        assert fresh.answer("p/1") is None
        assert fresh.answer("list/1") is None
    finally:
        fresh.close()


def test_redis_forgets_a_done_entry_when_its_recrawl_window_ends(
        postgres_url: str, redis_server: RedisServer, clock: FakeClock) -> None:  # noqa: F811
    """At every moment, Redis says known only when the database does (checked each 100 s
    across the end of the window the page was done in)."""
    window = 3600.0
    clock.now = 1_700_000_000.0 // window * window + window - 1000  # 1000 s before its end
    crawl = Layered(postgres_url, redis_server.url, clock, recrawl_seconds=window)
    try:
        start = link("list/1")
        crawl.commit(UnitOfWork(requests=[start]))
        crawl.page(start.key, link("p/1", start.key))
        checked = 0
        for _ in range(30):
            clock.advance(100)
            for name in ("list/1", "p/1"):
                database = crawl.database_answer(fingerprint(name))
                cached = crawl.dedup._cached(fingerprint(name), crawl.store.run_id)
                assert cached is None or cached == database, (name, clock.now)
                checked += cached is not None
        assert checked  # Redis answered for a while ...
        assert crawl.database_answer(fingerprint("list/1")) is None  # ... and it is due again
        assert crawl.answer("list/1") is None
    finally:
        crawl.close()


def test_a_migrated_frontier_has_its_own_hash(
        tmp_path: Path, postgres_url: str, redis_server: RedisServer,  # noqa: F811
        clock: FakeClock) -> None:
    source: Any = open_store(f"sqlite:///{tmp_path / 'crawl.db'}", clock=clock)
    source.open(fingerprinter="f")
    source.begin_session(W, "auto")
    target: Any = open_store(postgres_url, clock=clock, heartbeat_seconds=None,
                             dead_after_seconds=None)
    target.open(fingerprinter="f")
    with source.frozen():
        target.load(source.dump())
    try:
        assert source.frontier_id() != target.frontier_id()
        assert len(target.frontier_id()) == 32
    finally:
        source.close()
        target.close()


def test_a_retried_failed_entry_stays_known(
        layered: Layered, redis_server: RedisServer) -> None:  # noqa: F811
    """``retry`` puts a failed entry back to pending: the database still knows it, so what
    Redis says (already done) refuses the link as the database's answer (duplicate) does."""
    start = link("list/1")
    layered.commit(UnitOfWork(requests=[start]))
    layered.commit(UnitOfWork(claim=1))
    layered.commit(UnitOfWork(completions=[Completion(start.key, RequestState.FAILED,
                                                      error_kind="http", error_message="503")]))
    assert layered.store.retry_failed().retried == 1
    assert layered.database_answer(start.key) == "duplicate"
    other = Layered(layered.database, redis_server.url, layered.clock)  # another worker
    try:
        assert other.answer("list/1") == "already_done"
        assert other.reads == 0
    finally:
        other.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with private_redis_server(tmp_path / "redis") as server:
        yield server


def test_a_redis_that_fails_sends_links_to_the_database(
        postgres_url: str, own_redis: RedisServer, clock: FakeClock,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    crawl = Layered(postgres_url, own_redis.url, clock)
    try:
        start = link("list/1")
        crawl.commit(UnitOfWork(requests=[start]))
        crawl.page(start.key, link("p/1", start.key), link("p/2", start.key))
        own_redis.stop()
        caplog.set_level(logging.INFO, "scrapy_idempotent")
        # down: every answer is the database's; the commits go on (nothing raised)
        assert [crawl.answer(n) for n in ("p/1", "p/2", "list/1", "p/3")] == [
            "duplicate", "duplicate", "already_done", None]
        crawl.commit(UnitOfWork(requests=[link("p/3")]))
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "the Redis dedup cache at redis://127.0.0.1:" in warnings[0].getMessage()
        assert crawl.stats["redis_errors"] == 1  # then not asked for RETRY_SECONDS
        # back (empty: no persistence): asked again once RETRY_SECONDS have passed
        own_redis.start_again()
        monkeypatch.setattr(crawl.dedup, "_down_until", 1.0)
        assert crawl.answer("p/1") == "duplicate"  # a miss: the database answers
        crawl.commit(UnitOfWork(requests=[link("p/4")]))  # (the read's answer written)
        reads = crawl.reads
        assert crawl.answer("p/1") == "duplicate"
        assert crawl.reads == reads  # from Redis again
        assert "asking the Redis dedup cache at" in caplog.text
    finally:
        crawl.close()


# -- the setting ----------------------------------------------------------------------------


def config(**settings: Any) -> IdempotentConfig:
    crawler = get_crawler(Spider, settings)
    return IdempotentConfig.from_settings(crawler.settings, Spider("s"))


def test_the_setting_is_off_by_default() -> None:
    assert config().dedup_redis_url is None


@pytest.mark.parametrize("value", ["http://cache:6379", "cache:6379", 6379,
                                   "redis://cache:notaport/0"])
def test_a_bad_url_is_refused_naming_the_setting(value: object) -> None:
    with pytest.raises(ConfigError, match="IDEMPOTENT_DEDUP_REDIS_URL"):
        config(IDEMPOTENT_DATABASE="postgresql://db/crawl", IDEMPOTENT_DEDUP_REDIS_URL=value)


def test_sqlite_is_refused_and_the_password_not_shown(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SQLite") as raised:
        config(IDEMPOTENT_DATABASE=str(tmp_path / "f.sqlite3"),
               IDEMPOTENT_DEDUP_REDIS_URL="redis://:secret@cache:6379/0")
    assert "secret" not in str(raised.value)
    assert config(IDEMPOTENT_DATABASE="postgresql://db/crawl",
                  IDEMPOTENT_DEDUP_REDIS_URL="redis://cache:6379/0").dedup_redis_url \
        == "redis://cache:6379/0"


def test_values_name_the_end_of_their_window() -> None:
    """A value written with a window says until when it may answer; without one, always."""
    store: Any = type("S", (), {"clock": staticmethod(lambda: 7250.0)})()
    windowed = RedisKnownRequests(store, None, url="redis://x", recrawl_seconds=3600.0)
    assert windowed._value(True, 7250.0) == b"7"  # done, until 3 * 3600
    assert windowed._answer(b"7") == "already_done"
    assert windowed._answer(b"6") == "duplicate"
    assert windowed._answer(b"5") is None  # its window ended at 7200
    assert windowed._answer(b"written by someone else") is None
    # a commit that began within the margin after a window's start counts in the previous
    assert windowed._value(False, 7200.5) == b"4"
    plain = RedisKnownRequests(store, None, url="redis://x", recrawl_seconds=None)
    assert (plain._value(True, 0.0), plain._value(False, 0.0)) == (b"1", b"0")
    assert redis_dedup.shown_url("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"


# -- crawls ---------------------------------------------------------------------------------


def test_crawls_with_the_layer_fetch_each_page_once_per_run(
        postgres_url: str, redis_server: RedisServer,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The shop's listings link each other: with the worker's memory of known entries off
    (a frontier far larger than it), Redis answers most rediscovered links; each page is
    fetched once, each product stored once, in a first run and in the next one (its own
    hash)."""
    from local_site import LocalSite
    from scrapy.utils.defer import deferred_f_from_coro_f

    from crawling import crawl_settings, run_crawl
    from scrapy_idempotent.store import sql_known
    from shop.spiders.shop import ShopSpider

    monkeypatch.setattr(sql_known, "KNOWN_DONE_ENTRIES", 0)
    monkeypatch.setattr(sql_known, "KNOWN_PENDING_ENTRIES", 0)
    settings = crawl_settings(postgres_url, IDEMPOTENT_DEDUP_REDIS_URL=redis_server.url,
                              IDEMPOTENT_NATURAL_KEYS={"shop.items.ProductItem": "sku"})

    @deferred_f_from_coro_f
    async def crawl_twice() -> None:
        with LocalSite() as shop:
            for run in (1, 2):
                shop.reset_counts()
                crawler = await run_crawl(ShopSpider, settings, url=shop.url)
                stats = crawler.stats.get_stats()
                assert stats["finish_reason"] == "finished"
                assert shop.request_count == 525
                assert stats["idempotent/requests/done"] == 525
                assert stats.get("idempotent/records/inserted", 0) + stats.get(
                    "idempotent/records/unchanged", 0) == 500
                hits = stats.get("idempotent/dedup/redis_hits", 0)
                # the 25 rediscovered links (each listing links the next one and back):
                # most answered by Redis (one not durable yet goes on)
                duplicates = (stats["idempotent/requests/enqueued"]
                              - stats["idempotent/requests/added"])
                assert 10 <= hits <= duplicates, stats
                assert "idempotent/dedup/redis_errors" not in stats
                assert frontier_holds_every_field(postgres_url, redis_server, run) >= 525

    return crawl_twice()  # type: ignore[no-any-return]
