"""IDEMPOTENT_GC_FREEZE: start-up's objects are frozen while a crawl runs, and given back
when the last crawl of the process that froze them closes."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from local_site import LocalSite
from scrapy import signals
from scrapy.utils.defer import deferred_f_from_coro_f
from scrapy.utils.test import get_crawler

from crawling import crawl_settings, crawl_to_end
from scrapy_idempotent import gc_freeze
from shop.spiders.shop import ShopSpider

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


@pytest.fixture
def unfrozen(monkeypatch: pytest.MonkeyPatch) -> Any:
    # whatever an earlier test of this process left open (a scheduler never closed)
    monkeypatch.setattr(gc_freeze, "_open_crawls", 0)
    gc.unfreeze()
    yield
    gc.unfreeze()


async def frozen_counts_while_crawling(database: str, **settings: Any) -> list[int]:
    seen: list[int] = []
    with LocalSite(listing_pages=1, products_per_page=3) as shop:
        crawler = get_crawler(ShopSpider, crawl_settings(database, **NATURAL_KEYS, **settings))

        def received(**_: Any) -> None:
            seen.append(gc.get_freeze_count())

        crawler.signals.connect(received, signal=signals.response_received)  # held weakly
        await crawl_to_end(crawler, url=shop.url)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert len(seen) == 4
    return seen


@deferred_f_from_coro_f
async def test_startup_objects_are_frozen_while_the_crawl_runs(tmp_path: Any,
                                                                unfrozen: Any) -> None:
    assert gc.get_freeze_count() == 0
    seen = await frozen_counts_while_crawling(str(tmp_path / "f.db"))
    # everything alive at open: Scrapy's modules and the crawl's components at least
    assert min(seen) > 10_000
    assert gc.get_freeze_count() == 0  # given back at close


@deferred_f_from_coro_f
async def test_gc_freeze_off_leaves_the_collector_alone(tmp_path: Any, unfrozen: Any) -> None:
    seen = await frozen_counts_while_crawling(str(tmp_path / "f.db"),
                                              IDEMPOTENT_GC_FREEZE=False)
    assert seen == [0] * 4
    assert gc.get_freeze_count() == 0


def test_the_last_open_crawl_unfreezes(unfrozen: Any) -> None:
    gc_freeze.freeze()
    first = gc.get_freeze_count()
    assert first > 0
    made_since = [[object()] for _ in range(100)]  # the first crawl's own objects
    gc_freeze.freeze()  # a second crawl opens: nothing more is frozen
    # (at most as many: a frozen object whose last reference another thread drops leaves the
    # permanent generation; the 100 lists made since, frozen, would add 100)
    assert gc.get_freeze_count() <= first
    gc_freeze.thaw()
    assert 0 < gc.get_freeze_count() <= first  # the first crawl still runs
    gc_freeze.thaw()
    assert gc.get_freeze_count() == 0
    gc_freeze.thaw()  # one close too many changes nothing
    gc_freeze.freeze()
    assert gc.get_freeze_count() > 0
    gc_freeze.thaw()
    assert gc.get_freeze_count() == 0
    del made_since


def test_a_misspelt_value_names_the_setting() -> None:
    from scrapy.settings import Settings

    from scrapy_idempotent.config import ConfigError, IdempotentConfig

    spider = ShopSpider()
    with pytest.raises(ConfigError, match="IDEMPOTENT_GC_FREEZE"):
        IdempotentConfig.from_settings(
            Settings({"IDEMPOTENT_DATABASE": "x.db", "IDEMPOTENT_GC_FREEZE": "sometimes"}),
            spider)
