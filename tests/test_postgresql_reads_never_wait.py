"""The reactor thread never waits for a lost PostgreSQL connection to come back: its reads
(the duplicate check of every rediscovered link, the frontier status, the counts) raise
StoreBusy at once while another thread reconnects, and the crawl goes on (downloads, the
reactor's timers) through a server outage, then finishes once the server is back."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from local_site import LocalSite
from scrapy import signals
from scrapy.utils.defer import deferred_f_from_coro_f
from twisted.internet import task

from crawling import crawl_settings, crawl_to_end, wait_for
from scrapy_idempotent.commits import retry_busy
from scrapy_idempotent.exceptions import StoreBusy
from scrapy_idempotent.store import CrawlIdentity, NewRequest, UnitOfWork
from shop.site import listing_html
from shop.spiders.shop import ShopSpider

psycopg = pytest.importorskip("psycopg")
from helpers.postgresql import crawl_rows  # noqa: E402
from scrapy_idempotent.store.postgresql import PostgreSQLStore  # noqa: E402

SHOP = CrawlIdentity(project="p", spider="shop", source="shop")
#: A lost connection would be waited for this long (seconds) by a thread that waits: far
#: longer than any test here waits for an answer.
PATIENCE = 600.0
#: The shop's listing page answered while the server is down.
HELD = "/list/6"


@pytest.fixture
def server_back(postgres_cluster: Any) -> Iterator[None]:
    """The session's server is running again after the test, whatever happened."""
    yield
    with contextlib.suppress(RuntimeError):  # already running
        postgres_cluster.start()


def req(key: str) -> NewRequest:
    return NewRequest(key=key, fingerprint=key, url=f"https://shop.example/{key}", priority=0,
                      data="{}")


class Reader:
    """A thread that never waits (as the reactor's) running the store's reads on demand."""

    def __init__(self, store: PostgreSQLStore) -> None:
        self.store = store
        self.answers: list[Any] = []
        self._asks: list[str] = []
        self._ask = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        self.store.counts()  # connected first, as the reactor's is when the store opens
        self.store.never_wait_here()
        while True:
            with self._ask:
                self._ask.wait_for(lambda: self._asks)
                fingerprint = self._asks.pop()
            try:
                answer: Any = self.store.known_request(fingerprint)
            except Exception as exc:
                answer = exc
            with self._ask:
                self.answers.append(answer)

    def read(self, fingerprint: str) -> Any:
        """The answer to ``known_request(fingerprint)`` on the thread; an AssertionError when
        none comes in a minute (a thread that waits for the server would take PATIENCE)."""
        with self._ask:
            before = len(self.answers)
            self._asks.append(fingerprint)
            self._ask.notify()
        wait_for(lambda: len(self.answers) > before, 60, "the reader's answer")
        return self.answers[before]


def test_a_read_on_a_thread_that_never_waits_is_busy_at_once_and_reconnects_elsewhere(
        postgres_url: str, postgres_cluster: Any, server_back: None) -> None:
    store = PostgreSQLStore(postgres_url, heartbeat_seconds=None,
                            busy_timeout_seconds=PATIENCE)
    try:
        store.open(fingerprinter="f", identity=SHOP)
        store.begin_session("w1", "auto")
        store.commit(UnitOfWork(requests=[req("p1")]), "w1")
        reader = Reader(store)
        assert reader.read("p0") is None  # (read: a fingerprint the store has not seen)
        postgres_cluster.stop("immediate")
        # the connection is found lost, then the server still refuses: busy, at once, each
        # time (a thread that waits would be reconnecting for PATIENCE seconds)
        for _ in range(3):
            assert isinstance(reader.read("p0"), StoreBusy)
        postgres_cluster.start()
        # reconnected by another thread: the reader's next reads are answered
        answers: list[Any] = []
        wait_for(lambda: answers.append(reader.read("p0")) or answers[-1] is None, 120,
                 "the reader's reads answered again")
        assert all(isinstance(a, StoreBusy) for a in answers[:-1])
        assert reader.read("p2") is None
        # a thread that may wait (the writer's) reconnects by itself, as before (its lost
        # connection is found at its first use: busy, retried)
        retry_busy("committing", lambda: store.commit(UnitOfWork(requests=[req("p2")]), "w1"))
        assert reader.read("p2") == "duplicate"
    finally:
        store.close()


class ReactorTicks:
    """Counts reactor turns (a LoopingCall every 10 ms) from spider_opened on."""

    def __init__(self, crawler: Any) -> None:
        self.ticks = 0
        self.loop = task.LoopingCall(self.tick)
        crawler.signals.connect(self.start, signal=signals.spider_opened)
        crawler.signals.connect(self.stop, signal=signals.spider_closed)

    def start(self, spider: Any) -> None:
        self.loop.start(0.01, now=False)

    def tick(self) -> None:
        self.ticks += 1

    def stop(self, spider: Any) -> None:
        if self.loop.running:
            self.loop.stop()


@pytest.mark.slow
@deferred_f_from_coro_f
async def test_the_reactor_keeps_turning_through_a_server_outage_and_the_crawl_finishes(
        postgres_url: str, postgres_cluster: Any, server_back: None) -> None:
    from scrapy.utils.test import get_crawler

    outage: dict[str, Any] = {}

    def outage_while_a_listing_page_is_answered(crawler: Any, ticks: ReactorTicks) -> None:
        try:
            # requested (at the site: its claim counts the attempt before it is sent), and
            # its start written (unfinished: its callback waits for that write, so with the
            # start still unwritten it would not run while the server is down)
            wait_for(lambda: site.hits(HELD) == 1 and crawl_rows(
                postgres_url, "SELECT attempts, unfinished FROM requests WHERE url LIKE"
                f" '%{HELD}'") == [(1, 1)], 300, f"{HELD} requested and its start written")
            postgres_cluster.stop("immediate")
            outage["ticks"] = ticks.ticks
            site.release()  # answered now: its links are checked while the server is down
            # a reactor waiting for the server (PATIENCE seconds per read) would not turn
            wait_for(lambda: ticks.ticks >= outage["ticks"] + 100 and crawler.stats.get_value(
                "idempotent/requests/unchecked", 0) > 0, 120,
                "the reactor turning and checking links while the server is down")
            outage["turned"] = True
        except AssertionError:
            outage["unchecked"] = crawler.stats.get_value("idempotent/requests/unchecked", 0)
            outage["ticks_now"] = ticks.ticks
            raise
        finally:
            postgres_cluster.start()

    with LocalSite(delay=0.01) as site:
        # a listing page in the middle of the shop, held until the server is down
        site.add(HELD, listing_html(6, site.listing_pages, site.products_per_page), held=True)
        settings = crawl_settings(postgres_url,  # type: ignore[arg-type]
                                  IDEMPOTENT_BUSY_TIMEOUT_SECONDS=PATIENCE,
                                  # no journal row to wait for: the held page's callback
                                  # runs while the server is down
                                  IDEMPOTENT_RESPONSE_JOURNAL=False,
                                  IDEMPOTENT_NATURAL_KEYS={"shop.items.ProductItem": "sku"})
        crawler = get_crawler(ShopSpider, settings)
        ticks = ReactorTicks(crawler)
        watcher = threading.Thread(target=outage_while_a_listing_page_is_answered,
                                   args=(crawler, ticks), daemon=True)
        watcher.start()
        await crawl_to_end(crawler, url=site.url)
        watcher.join(300)
        assert outage.get("turned"), repr(outage)
        stats = crawler.stats.get_stats()
        assert stats["finish_reason"] == "finished"
        # the links checked during the outage were written by the commit (rediscovered
        # ones refused there), nothing twice; what was on the wire may be fetched again
        assert site.request_count <= 525 + 16
    assert crawl_rows(postgres_url, "SELECT state, count(*) FROM requests GROUP BY state") \
        == [("done", 525)]
    assert crawl_rows(postgres_url,
                      "SELECT count(*), count(DISTINCT natural_key) FROM records") == [(500, 500)]
