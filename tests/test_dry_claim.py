"""The dry claim (nothing claimed ahead, the writer idle) never blocks the reactor on the
database: while another process holds the SQLite write lock, the claim waits on the writer's
thread, the reactor keeps running, and the crawl goes on once the lock is released."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from local_site import LocalSite
from scrapy import signals
from scrapy.utils.defer import deferred_f_from_coro_f
from twisted.internet import task

from crawling import crawl_settings, crawl_to_end, frontier_counts, stored_products
from scrapy_idempotent import scrapy_compat
from shop.spiders.shop import ShopSpider

#: Reactor turns (LoopingCall ticks) counted while the lock is held and the crawl's first
#: claim waits for it; a reactor blocked on the database counts none.
TICKS_WHILE_LOCKED = 30

#: Holds the write lock of the SQLite file argv[1] (another process, as an operator's
#: command or another worker would) until a line comes on stdin.
LOCK_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=60)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
conn.close()
"""


class LockAtOpen:
    """At ``spider_opened`` (the scheduler is open, nothing is claimed yet) another process
    takes the write lock; a LoopingCall counts reactor turns, and the lock is released once
    it has counted :data:`TICKS_WHILE_LOCKED` (or when the spider closes)."""

    def __init__(self, crawler: Any, db_path: Path, site: LocalSite) -> None:
        self.crawler = crawler
        self.db_path = db_path
        self.site = site
        self.holder: subprocess.Popen[str] | None = None
        self.ticks = 0
        self.at_release: dict[str, Any] = {}
        self.loop = task.LoopingCall(self.tick)
        crawler.signals.connect(self.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(self.release, signal=signals.spider_closed)

    def spider_opened(self, spider: Any) -> None:
        self.holder = subprocess.Popen(
            [sys.executable, "-c", LOCK_HOLDER, str(self.db_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.holder.stdout is not None
        assert self.holder.stdout.readline().strip() == "locked"
        self.loop.start(0.01, now=False)

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks >= TICKS_WHILE_LOCKED:
            scheduler = scrapy_compat.engine_scheduler(self.crawler)
            self.at_release = {"downloads": self.site.request_count,
                               "writer_idle": scheduler.writer.idle}
            self.release()

    def release(self, *args: Any, **kwargs: Any) -> None:
        if self.loop.running:
            self.loop.stop()
        holder, self.holder = self.holder, None
        if holder is not None:
            assert holder.stdin is not None
            holder.stdin.write("release\n")
            holder.stdin.close()
            holder.wait()
            assert holder.stdout is not None
            holder.stdout.close()


@deferred_f_from_coro_f
async def test_the_reactor_runs_while_the_first_claim_waits_for_a_lock(
        shop: LocalSite, db_path: Path) -> None:
    from scrapy.utils.test import get_crawler

    crawler = get_crawler(ShopSpider, crawl_settings(
        db_path, IDEMPOTENT_NATURAL_KEYS={"shop.items.ProductItem": "sku"},
        # each of the writer's attempts waits so long for the lock: with a reactor that
        # waited on the claim, the crawl would fail after 5 of them, with no tick counted
        IDEMPOTENT_BUSY_TIMEOUT_SECONDS=4))
    lock = LockAtOpen(crawler, db_path, shop)
    await crawl_to_end(crawler, url=shop.url)
    assert lock.ticks >= TICKS_WHILE_LOCKED
    # the reactor ran while the first claim waited for the lock: nothing was downloaded,
    # the claim was still on the writer's thread
    assert lock.at_release == {"downloads": 0, "writer_idle": False}
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert frontier_counts(db_path) == {"done": 525}
    assert len(stored_products(db_path)) == 500
    assert shop.request_count == 525
