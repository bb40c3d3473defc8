"""robots.txt for the crawl (``CrawlRobotsTxtMiddleware``, ``FrontierStore.robots_txt``): fetched
once per site, kept in the crawl's database, read by every later crawl of it; no request of a
site is downloaded before the site's rules are known, however many start at once (Scrapy
2.19's own middleware lets all but the first of the requests waiting together through)."""

from __future__ import annotations

from typing import Any

import scrapy
from local_site import ROBOTS_TXT, LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from helpers.site_crawls import (
    LinksSpider,
    assert_nothing_leased,
    crawl,
    finish_reason,
    frontier,
    istats,
    settings,
)
from helpers.stored import change_stored, reading
from scrapy_idempotent.robots import CrawlRobotsTxtMiddleware, rules_body
from scrapy_idempotent.store import FrontierStore

#: pages of one site started together: half of them disallowed
STARTED = [f"/ok/open{i}" for i in range(8)] + [f"/private/p{i}" for i in range(8)]


class ManyStartsSpider(LinksSpider):
    """Starts every path of :data:`STARTED` at once (a resumed crawl's first moment)."""

    start_paths = tuple(STARTED)


def robots_settings(database: str, **extra: Any) -> dict[str, Any]:
    return settings(database, ROBOTSTXT_OBEY=True, CONCURRENT_REQUESTS=16,
                    CONCURRENT_REQUESTS_PER_DOMAIN=16, **extra)


def slow_robots(site: LocalSite, body: str = ROBOTS_TXT, status: int = 200) -> None:
    """robots.txt answered late, so every started request is waiting for it."""
    site.add("/robots.txt", body, "text/plain", status=status, delay=0.3)


def kept(database: str, site: LocalSite) -> Any:
    with reading(database) as store:
        return store.robots_txt(f"127.0.0.1:{site.port}")


def disallowed_served(site: LocalSite) -> dict[str, int]:
    return {path: hits for path, hits in site.counts_by_path().items()
            if path.startswith("/private/")}


@deferred_f_from_coro_f
async def test_requests_waiting_together_for_robots_txt_all_obey_it(
    site: LocalSite, crawl_database: str
) -> None:
    slow_robots(site)
    crawler = await crawl(ManyStartsSpider, robots_settings(crawl_database), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert disallowed_served(site) == {}
    assert site.hits("/robots.txt") == 1
    rows = frontier(crawl_database, site)
    assert {path: rows[path] for path in STARTED if path.startswith("/private/")} == {
        path: ("failed", "ignored/IgnoreRequest", 1)
        for path in STARTED if path.startswith("/private/")}
    assert all(rows[path] == ("done", None, 1) for path in STARTED if path.startswith("/ok/"))
    assert_nothing_leased(crawl_database)
    assert crawler.stats.get_value("robotstxt/forbidden") == 8
    assert crawler.stats.get_value("robotstxt/request_count") == 1
    stats = istats(crawler)
    assert stats["robotstxt/kept"] == 1
    assert "robotstxt/read" not in stats
    stored = kept(crawl_database, site)
    assert (stored.status, stored.body) == (200, ROBOTS_TXT.encode())
    assert stored.url == f"{site.url}/robots.txt"


@deferred_f_from_coro_f
async def test_a_later_crawl_reads_the_kept_robots_txt_instead_of_fetching_it(
    site: LocalSite, crawl_database: str
) -> None:
    slow_robots(site)
    await crawl(LinksSpider, robots_settings(crawl_database), url=site.url,
                start_paths=("/ok/first",))
    assert site.hits("/robots.txt") == 1
    # a new run of the same crawl (the first one finished), every page started at once
    crawler = await crawl(ManyStartsSpider, robots_settings(crawl_database), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert site.hits("/robots.txt") == 1  # not fetched again
    assert disallowed_served(site) == {}
    assert crawler.stats.get_value("robotstxt/forbidden") == 8
    assert crawler.stats.get_value("robotstxt/request_count") is None
    stats = istats(crawler)
    assert stats["robotstxt/read"] == 1
    assert "robotstxt/kept" not in stats


@deferred_f_from_coro_f
async def test_robots_txt_older_than_its_max_age_is_fetched_again(
    site: LocalSite, crawl_database: str
) -> None:
    slow_robots(site)
    await crawl(LinksSpider, robots_settings(crawl_database), url=site.url,
                start_paths=("/ok/first",))
    # the site now disallows everything; the kept robots.txt is two hours old, max age 1 h
    slow_robots(site, "User-agent: *\nDisallow: /\n")
    site.reset_counts()
    change_stored(crawl_database, "UPDATE robots SET fetched_at = fetched_at - 7200")
    crawler = await crawl(LinksSpider, robots_settings(
        crawl_database, IDEMPOTENT_ROBOTSTXT_MAX_AGE_SECONDS=3600), url=site.url,
        start_paths=("/ok/second",))
    assert finish_reason(crawler) == "finished"
    assert site.counts_by_path() == {"/robots.txt": 1}
    assert istats(crawler)["robotstxt/kept"] == 1
    assert kept(crawl_database, site).body == b"User-agent: *\nDisallow: /\n"


@deferred_f_from_coro_f
async def test_a_4xx_robots_txt_allows_everything_and_is_kept(
    site: LocalSite, crawl_database: str
) -> None:
    slow_robots(site, "<html>User-agent: *\nDisallow: /private/\n</html>", status=404)
    crawler = await crawl(ManyStartsSpider, robots_settings(crawl_database), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert all(site.hits(path) == 1 for path in STARTED)
    assert crawler.stats.get_value("robotstxt/response_status_count/404") == 1
    stored = kept(crawl_database, site)
    assert (stored.status, stored.body) == (404, b"")
    crawler = await crawl(LinksSpider, robots_settings(crawl_database), url=site.url,
                          start_paths=("/private/later",))
    assert site.hits("/robots.txt") == 1
    assert site.hits("/private/later") == 1


@deferred_f_from_coro_f
async def test_a_5xx_robots_txt_is_obeyed_as_scrapy_does_and_not_kept(
    site: LocalSite, crawl_database: str
) -> None:
    slow_robots(site, "busy", status=503)
    crawler = await crawl(ManyStartsSpider, robots_settings(crawl_database), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert all(site.hits(path) == 1 for path in STARTED)  # Scrapy: the error page's rules
    assert kept(crawl_database, site) is None
    assert "robotstxt/kept" not in istats(crawler)
    slow_robots(site)  # answering again: the next crawl asks, keeps and obeys it
    crawler = await crawl(LinksSpider, robots_settings(crawl_database), url=site.url,
                          start_paths=("/private/later", "/ok/later"))
    assert site.hits("/robots.txt") == 2
    assert site.hits("/private/later") == 0
    assert site.hits("/ok/later") == 1
    assert istats(crawler)["robotstxt/kept"] == 1


@deferred_f_from_coro_f
async def test_robots_txt_meta_and_scrapy_middleware_replaced(
    site: LocalSite, crawl_database: str
) -> None:
    class DontObeySpider(LinksSpider):
        async def start(self) -> Any:
            yield scrapy.Request(self.at("/private/mine"), meta={"dont_obey_robotstxt": True})

    crawler = await crawl(DontObeySpider, robots_settings(crawl_database), url=site.url)
    assert site.hits("/private/mine") == 1
    assert site.hits("/robots.txt") == 0
    names = [type(mw).__name__ for mw in crawler.engine.downloader.middleware.middlewares]
    assert "CrawlRobotsTxtMiddleware" in names
    assert "RobotsTxtMiddleware" not in names


def test_answers_kept_for_the_crawl() -> None:
    assert rules_body(200, b"x") == b"x"
    assert rules_body(404, b"<html>") == b""
    assert rules_body(403, b"<html>") == b""
    assert rules_body(500, b"x") is None
    assert rules_body(503, b"x") is None
    assert CrawlRobotsTxtMiddleware.__module__ == "scrapy_idempotent.robots"


# -- the store contract -----------------------------------------------------------------------


def test_robots_txt_kept_if_absent_or_too_old(store: FrontierStore, clock: Any) -> None:
    assert store.robots_txt("a.example") is None
    first = store.keep_robots_txt("a.example", "https://a.example/robots.txt", 200, b"A",
                                  max_age_seconds=100)
    assert (first.netloc, first.url, first.status, first.body, first.age_seconds) == (
        "a.example", "https://a.example/robots.txt", 200, b"A", 0.0)
    clock.advance(10)
    # another worker fetched it at the same time: the one kept first is everyone's
    second = store.keep_robots_txt("a.example", "https://a.example/robots.txt", 404, b"",
                                   max_age_seconds=100)
    assert (second.status, second.body, second.age_seconds) == (200, b"A", 10.0)
    assert store.robots_txt("a.example") == second
    clock.advance(100)
    # too old to use: replaced
    third = store.keep_robots_txt("a.example", "https://a.example/robots.txt", 404, b"",
                                  max_age_seconds=100)
    assert (third.status, third.body, third.age_seconds) == (404, b"", 0.0)
    assert store.robots_txt("b.example:8080") is None
    store.keep_robots_txt("b.example:8080", "http://b.example:8080/robots.txt", 200,
                          b"\x00\xff", max_age_seconds=100)
    assert store.robots_txt("b.example:8080").body == b"\x00\xff"  # type: ignore[union-attr]
