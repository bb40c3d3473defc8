"""The ``IDEMPOTENT_*`` settings are read once per crawl and shared: every component of a real
crawl gets the same :class:`~.IdempotentConfig` object from ``config_for``."""

from __future__ import annotations

from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, run_crawl
from scrapy_idempotent import config as config_module
from scrapy_idempotent.config import IdempotentConfig, config_for
from shop.spiders.shop import ShopSpider


@deferred_f_from_coro_f
async def test_one_config_object_per_crawl(crawl_database: str, monkeypatch) -> None:
    reads: list[IdempotentConfig] = []
    read = IdempotentConfig.from_settings

    def counted(settings, spider):  # type: ignore[no-untyped-def]
        config = read(settings, spider)
        reads.append(config)
        return config

    monkeypatch.setattr(IdempotentConfig, "from_settings", staticmethod(counted))
    with LocalSite(listing_pages=1, products_per_page=2) as site:
        crawler = await run_crawl(ShopSpider, crawl_settings(
            crawl_database, IDEMPOTENT_LOG_INTERVAL_SECONDS=30,
            IDEMPOTENT_NATURAL_KEYS={"shop.items.ProductItem": "sku"}), url=site.url)
    assert crawler.stats.get_value("finish_reason") == "finished"
    # read for the spider class (components built before the spider), then for the spider:
    # never once per component
    assert 1 <= len(reads) <= 2, len(reads)
    assert config_for(crawler) is reads[-1]
    assert config_for(crawler).log_interval_seconds == 30.0
    assert config_module._CONFIGS[crawler][1] is reads[-1]
