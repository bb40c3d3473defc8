"""Schedulers driven by hand: each opened in a real crawler and engine on one database (a
SQLite file or a PostgreSQL URL), the crawl loop not started, so a test calls
``enqueue_request``/``next_request`` and the engine's completion hook
(``_slot.remove_request``) itself. The ``harness`` fixture (conftest.py) gives a test a
``Harness`` on its SQLite file, ``crawl_harness`` one on each store backend in turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import scrapy
from scrapy.core.engine import _Slot
from scrapy.utils.reactor import CallLaterOnce
from scrapy.utils.test import get_crawler

from scrapy_idempotent import IdempotentScheduler
from scrapy_idempotent.config import config_for


class Spider(scrapy.Spider):
    name = "unit"

    def parse(self, response: Any) -> Any:
        return None

    def parse_other(self, response: Any) -> Any:
        return None


class Harness:
    """Opens schedulers on one database, each in its own crawler and engine."""

    def __init__(self, database: str | Path) -> None:
        self.database = str(database)  #: ``IDEMPOTENT_DATABASE``
        self.open: list[IdempotentScheduler] = []

    def scheduler(self, worker: str | None = None, **settings: Any) -> IdempotentScheduler:
        # these tests drive the scheduler as an engine whose downloader has no limits: each
        # worker keeps Scrapy's (unless a test asks for the crawl's, see test_politeness.py)
        settings.setdefault("IDEMPOTENT_POLITENESS", "worker")
        crawler = get_crawler(Spider, {"IDEMPOTENT_DATABASE": self.database, **settings})
        crawler.spider = crawler._create_spider()
        crawler.engine = crawler._create_engine()
        # writes at once on this thread (no writer thread): each call's writes are done
        # when it returns, as the tests drive the scheduler by hand
        scheduler = IdempotentScheduler(crawler, config_for(crawler), threaded_writes=False)
        if worker is not None:
            scheduler.worker = worker
        crawler.engine._slot = _Slot(True, CallLaterOnce(lambda: None), scheduler)
        scheduler.open(crawler.spider)
        self.open.append(scheduler)
        return scheduler

    def close(self, scheduler: IdempotentScheduler, reason: str = "shutdown") -> None:
        scheduler.close(reason)
        self.open.remove(scheduler)


def finish(scheduler: IdempotentScheduler, request: scrapy.Request) -> None:
    """What the engine does when it is done with a request."""
    slot = scheduler.crawler.engine._slot
    slot.add_request(request)
    slot.remove_request(request)


def drain(scheduler: IdempotentScheduler) -> list[scrapy.Request]:
    requests = []
    while (request := scheduler.next_request()) is not None:
        requests.append(request)
    return requests


URLS = [f"https://example.com/{i}" for i in range(10)]
