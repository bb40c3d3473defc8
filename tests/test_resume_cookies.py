"""Cookies kept across a resume: a crawl that logged in and stopped before its end resumes
logged in (the login page is done, and not fetched again), on every store backend."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import scrapy
from local_site import LocalSite, Received
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, run_crawl
from helpers.stored import stored_products

PAGES = 10


class LoginSpider(scrapy.Spider):
    """Logs in (``/login`` sets a session cookie), then reads account pages that show
    whether the request carried the session."""

    name = "login"

    def __init__(self, url: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start_urls = [f"{url}/login"]

    def parse(self, response: Any) -> Iterator[Any]:
        for n in range(1, PAGES + 1):
            yield response.follow(f"/account/{n}", callback=self.parse_account)

    def parse_account(self, response: Any) -> Iterator[Any]:
        yield {"sku": response.url.rsplit("/", 1)[-1],
               "logged_in": response.css("b::text").get() == "logged in"}


@pytest.fixture
def login_site() -> Iterator[LocalSite]:
    with LocalSite(keep_alive=False) as site:
        site.add_responder("/login", lambda received: (
            200, {"Content-Type": "text/html", "Set-Cookie": "session=s3cret; Path=/"},
            "<html><body>welcome</body></html>"))

        def account(received: Received) -> tuple[int, dict[str, str], str]:
            logged_in = "session=s3cret" in received.headers.get("Cookie", "")
            text = "logged in" if logged_in else "anonymous"
            return 200, {"Content-Type": "text/html"}, f"<html><body><b>{text}</b></body></html>"

        for n in range(1, PAGES + 1):
            site.add_responder(f"/account/{n}", account)
        yield site


async def crawl_in_two(site: LocalSite, database: str, **extra: Any) -> list[dict[str, Any]]:
    """A crawl stopped by CLOSESPIDER_ITEMCOUNT after 3 pages (its run stays open), then the
    crawl that resumes it; the records at the end."""
    settings = crawl_settings(database, CONCURRENT_REQUESTS=1, IDEMPOTENT_LEASE_BATCH=1,
                              **extra)
    first = await run_crawl(LoginSpider, {**settings, "CLOSESPIDER_ITEMCOUNT": 3}, url=site.url)
    assert first.stats.get_value("finish_reason") == "closespider_itemcount"
    second = await run_crawl(LoginSpider, settings, url=site.url)
    assert second.stats.get_value("finish_reason") == "finished"
    assert site.hits("/login") == 1  # done in the first crawl: not fetched again
    return stored_products(database)


@deferred_f_from_coro_f
async def test_a_resumed_crawl_is_still_logged_in(login_site: LocalSite,
                                                 crawl_database: str) -> None:
    products = await crawl_in_two(login_site, crawl_database)
    assert len(products) == PAGES
    assert all(product["logged_in"] for product in products), products


@deferred_f_from_coro_f
async def test_without_kept_cookies_a_resumed_crawl_is_logged_out(
        login_site: LocalSite, crawl_database: str) -> None:
    """IDEMPOTENT_KEEP_COOKIES = False: Scrapy's behaviour (the jars start empty)."""
    products = await crawl_in_two(login_site, crawl_database, IDEMPOTENT_KEEP_COOKIES=False)
    assert len(products) == PAGES
    assert sum(not product["logged_in"] for product in products) >= PAGES - 4
