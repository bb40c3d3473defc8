"""``CLOSESPIDER_ITEMCOUNT``, ``_PAGECOUNT`` and ``_ERRORCOUNT`` count the run (every crawl of
it), not the process: a crawl resumed after its run reached a limit closes before fetching
anything, and every crawl's stats carry the run's totals (``idempotent/run/...``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import scrapy
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import PagesSpider, crawl_settings, pages, run_crawl
from helpers.stored import records_stored, requests_done
from scrapy_idempotent import RunCloseSpider
from shop.spiders.shop import ShopSpider

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}
CONCURRENCY = 2
ONE_AT_A_TIME = {"CONCURRENT_REQUESTS": CONCURRENCY,
                 "CONCURRENT_REQUESTS_PER_DOMAIN": CONCURRENCY}
#: What a crawl closed by a limit still completes, as with Scrapy's own CloseSpider: the
#: downloads under way and the responses waiting for their callbacks (measured with Scrapy's
#: extension on the same site: 10 items asked, 12 or 13 stored)
IN_FLIGHT = 2 * CONCURRENCY


def run_stats(crawler: Any) -> dict[str, Any]:
    prefix = "idempotent/run/"
    return {k[len(prefix):]: v for k, v in crawler.stats.get_stats().items()
            if k.startswith(prefix)}


@deferred_f_from_coro_f
async def test_the_item_count_is_the_runs_over_every_crawl(crawl_database: str) -> None:
    db = crawl_database
    with LocalSite(listing_pages=4, products_per_page=10) as site:
        first = await run_crawl(ShopSpider, crawl_settings(
            db, CLOSESPIDER_ITEMCOUNT=10, **ONE_AT_A_TIME, **NATURAL_KEYS), url=site.url)
        assert first.stats.get_value("finish_reason") == "closespider_itemcount"
        stored = records_stored(db)
        assert 10 <= stored <= 10 + IN_FLIGHT
        assert run_stats(first)["items"] == run_stats(first)["records/inserted"] == stored
        assert run_stats(first)["pages"] == requests_done(db)

        # the run reached its limit: the next crawl with the same limit closes at once
        fetched = site.request_count
        again = await run_crawl(ShopSpider, crawl_settings(
            db, CLOSESPIDER_ITEMCOUNT=10, **ONE_AT_A_TIME, **NATURAL_KEYS), url=site.url)
        assert again.stats.get_value("finish_reason") == "closespider_itemcount"
        assert site.request_count == fetched
        assert records_stored(db) == stored
        assert again.stats.get_value("idempotent/records/inserted") is None
        assert run_stats(again)["items"] == stored  # the run's, not this crawl's (0)

        # a higher limit: this crawl adds what the run lacks, not 25 more
        third = await run_crawl(ShopSpider, crawl_settings(
            db, CLOSESPIDER_ITEMCOUNT=25, **ONE_AT_A_TIME, **NATURAL_KEYS), url=site.url)
        assert third.stats.get_value("finish_reason") == "closespider_itemcount"
        assert 25 <= records_stored(db) <= 25 + IN_FLIGHT
        assert third.stats.get_value("idempotent/records/inserted") == records_stored(db) - stored
        assert run_stats(third)["items"] == records_stored(db)

        # no limit: the run finishes, and its totals are every crawl's
        last = await run_crawl(ShopSpider, crawl_settings(db, **NATURAL_KEYS), url=site.url)
        assert last.stats.get_value("finish_reason") == "finished"
        assert records_stored(db) == 40
        totals = run_stats(last)
        assert totals["items"] == totals["records/inserted"] == 40
        assert totals["pages"] == totals["requests/done"] == requests_done(db) == 44
        assert totals["requests/failed"] == totals["errors"] == 0


@deferred_f_from_coro_f
async def test_the_page_count_is_the_runs_over_every_crawl(crawl_database: str) -> None:
    db = crawl_database
    with LocalSite() as site:
        paths = pages(site, 30)
        first = await run_crawl(PagesSpider, crawl_settings(
            db, CLOSESPIDER_PAGECOUNT=10, **ONE_AT_A_TIME), url=site.url, paths=paths)
        assert first.stats.get_value("finish_reason") == "closespider_pagecount"
        done = requests_done(db)
        assert 10 <= done <= 10 + IN_FLIGHT
        second = await run_crawl(PagesSpider, crawl_settings(
            db, CLOSESPIDER_PAGECOUNT=20, **ONE_AT_A_TIME), url=site.url, paths=paths)
        assert second.stats.get_value("finish_reason") == "closespider_pagecount"
        assert 20 <= requests_done(db) <= 20 + IN_FLIGHT
        assert run_stats(second)["pages"] == requests_done(db)
        assert second.stats.get_value("idempotent/requests/done") == requests_done(db) - done


class RaisingSpider(PagesSpider):
    """Every page's callback raises."""

    def parse(self, response: Any) -> Any:
        raise ValueError(f"broken page {response.url}")


@deferred_f_from_coro_f
async def test_the_error_count_is_the_runs_over_every_crawl(crawl_database: str) -> None:
    db = crawl_database
    with LocalSite() as site:
        paths = pages(site, 20)
        settings = crawl_settings(db, CLOSESPIDER_ERRORCOUNT=5, **ONE_AT_A_TIME)
        first = await run_crawl(RaisingSpider, settings, url=site.url, paths=paths)
        assert first.stats.get_value("finish_reason") == "closespider_errorcount"
        errors = run_stats(first)["errors"]
        assert 5 <= errors <= 5 + IN_FLIGHT
        fetched = site.request_count
        again = await run_crawl(RaisingSpider, settings, url=site.url, paths=paths)
        assert again.stats.get_value("finish_reason") == "closespider_errorcount"
        assert site.request_count == fetched
        assert run_stats(again)["errors"] == errors


@deferred_f_from_coro_f
async def test_timeout_keeps_scrapys_meaning_and_other_schedulers_count_per_process(
    tmp_path: Any,
) -> None:
    """Without the package's scheduler the extension is Scrapy's own: per process."""
    with LocalSite() as site:
        paths = pages(site, 10)
        settings = {"EXTENSIONS": {"scrapy.extensions.closespider.CloseSpider": None,
                                   RunCloseSpider: 0},
                    "CLOSESPIDER_PAGECOUNT": 3, "ROBOTSTXT_OBEY": False,
                    "TELNETCONSOLE_ENABLED": False, **ONE_AT_A_TIME}
        crawler = await run_crawl(PagesSpider, settings, url=site.url, paths=paths)
        assert crawler.stats.get_value("finish_reason") == "closespider_pagecount"
        assert 3 <= site.request_count <= 3 + IN_FLIGHT


def test_the_add_on_puts_it_in_place_of_scrapys() -> None:
    from scrapy.extensions.closespider import CloseSpider
    from scrapy.utils.test import get_crawler

    crawler = get_crawler(scrapy.Spider, {"ADDONS": {"scrapy_idempotent.Addon": 0},
                                          "CLOSESPIDER_ITEMCOUNT": 5})
    crawler._apply_settings()
    extensions = crawler.settings.getwithbase("EXTENSIONS")
    assert extensions.get(RunCloseSpider) == 0
    assert any(extensions[name] is None for name in extensions
               if name in (CloseSpider, "scrapy.extensions.closespider.CloseSpider"))


@pytest.mark.parametrize("limit", [0])
def test_no_limit_no_extension(limit: int) -> None:
    from scrapy.exceptions import NotConfigured
    from scrapy.utils.test import get_crawler

    with pytest.raises(NotConfigured):
        RunCloseSpider(get_crawler(scrapy.Spider, {"CLOSESPIDER_ITEMCOUNT": limit}))


@pytest.mark.slow
def test_an_item_limit_holds_for_two_postgresql_workers(postgres_url: str, tmp_path: Path
                                                        ) -> None:
    """Two workers on one PostgreSQL frontier, ``CLOSESPIDER_ITEMCOUNT = 40``: both close
    with Scrapy's reason, and the run holds 40 items plus at most what the workers had in
    flight (each hands out no more pages than the limit leaves room for, as far as it knows
    the other's items: it reads the run's counters every 0.1 s near the limit). Measured:
    45 to 47 with 8 concurrent requests each (the counts of 2 x 40 before the hand-out
    gate and the near reads)."""
    from crawling import close_reason, start_shop_crawl
    from helpers.stored import records_stored

    database = f"{postgres_url}?schema=limit_workers"
    concurrency = 8
    settings = ("CLOSESPIDER_ITEMCOUNT=40", f"CONCURRENT_REQUESTS={concurrency}",
                f"CONCURRENT_REQUESTS_PER_DOMAIN={concurrency}")
    with LocalSite(listing_pages=10, products_per_page=15, delay=0.05) as site:
        workers = [start_shop_crawl(site.url, database, tmp_path / f"w{n}.log", *settings)
                   for n in range(2)]
        codes = [worker.wait(timeout=300) for worker in workers]
    logs = [(tmp_path / f"w{n}.log").read_text(errors="replace") for n in range(2)]
    assert codes == [0, 0], "\n".join(log[-2000:] for log in logs)
    assert [close_reason(tmp_path / f"w{n}.log") for n in range(2)] == [
        "closespider_itemcount"] * 2
    stored = records_stored(database)
    print(f"stored={stored}")
    assert 40 <= stored <= 40 + 2 * concurrency
