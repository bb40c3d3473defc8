"""Crawls of the local site whose frontier is then checked, shared by the request-outcome
tests: quick crawl settings, a crawl that notes what Scrapy dropped, readers of the frontier
rows, records and stats (through the store interface: a SQLite path or a PostgreSQL URL),
and the spiders' base class."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import scrapy
from local_site import LocalSite

from crawling import crawl_settings, crawl_to_end
from helpers.stored import frontier_entries, reading, stored_products, stored_records

NATURAL_KEYS = {"dict": "key"}


def settings(database: str | Path, **extra: Any) -> dict[str, Any]:
    """A quick crawl with the add-on: dict items keyed by their ``key`` field."""
    values: dict[str, Any] = {
        "IDEMPOTENT_NATURAL_KEYS": NATURAL_KEYS,
        "DOWNLOAD_TIMEOUT": 5,
        "CONCURRENT_REQUESTS": 4,
        "CONCURRENT_REQUESTS_PER_DOMAIN": 4,
        "TELNETCONSOLE_ENABLED": False,
    }
    values.update(extra)
    return crawl_settings(database, **values)


def rows(database: str | Path, site: LocalSite) -> list[tuple[str, str, str | None, int]]:
    """The frontier: ``(url relative to the site, state, error_kind, attempts)``, sorted."""
    return sorted((entry.url.removeprefix(site.url), entry.state, entry.error_kind,
                   entry.attempts) for entry in frontier_entries(database))


def frontier(database: str | Path, site: LocalSite) -> dict[str, tuple[str, str | None, int]]:
    """The frontier by relative URL, checking that no URL has two rows."""
    found = rows(database, site)
    by_url = {url: (state, kind, attempts) for url, state, kind, attempts in found}
    assert len(by_url) == len(found), f"a URL has several frontier rows: {found}"
    return by_url


def assert_nothing_leased(database: str | Path) -> None:
    """No lease left, and no journaled response of a request (all are finished)."""
    found = frontier_entries(database)
    with reading(database) as store:
        leased = [(e.url, e.worker) for e in found if e.state == "leased"]
        assert leased == [], f"leases left dangling: {leased}"
        journal = [e.url for e in found if store.journaled_response(e.key) is not None]
    assert journal == [], f"responses of finished requests left in the journal: {journal}"


def records(database: str | Path) -> dict[str, dict[str, Any]]:
    """Stored records by their ``key`` field (each record ID is one row by construction)."""
    found = stored_products(database)
    by_key = {record["key"]: record for record in found}
    assert len(by_key) == len(found), f"two records share a key: {found}"
    return by_key


def record_owner(database: str | Path, site: LocalSite) -> dict[str, str | None]:
    """Record ``key`` -> URL of the frontier entry whose completion stored it."""
    urls = {entry.key: entry.url for entry in frontier_entries(database)}
    owners: dict[str, str | None] = {}
    for record in stored_records(database):
        url = urls.get(record.request_key) if record.request_key else None
        owners[json.loads(record.data)["key"]] = url.removeprefix(site.url) if url else None
    return owners


async def crawl(spidercls: type, settings_dict: dict[str, Any], **kwargs: Any) -> Any:
    """Like :func:`crawling.run_crawl`, also noting the URLs of requests Scrapy reports as
    dropped (``request_dropped``: the scheduler refused them) in ``crawler.dropped_urls``."""
    from scrapy import signals
    from scrapy.utils.test import get_crawler

    crawler = get_crawler(spidercls, settings_dict)
    dropped: list[str] = []

    def on_dropped(request: Any, spider: Any) -> None:
        dropped.append(request.url)

    crawler.dropped_urls = dropped  # type: ignore[attr-defined]
    crawler.on_dropped = on_dropped  # type: ignore[attr-defined]  # signals hold weak refs
    crawler.signals.connect(on_dropped, signals.request_dropped)
    await crawl_to_end(crawler, **kwargs)
    return crawler


def istats(crawler: Any) -> dict[str, Any]:
    """The crawl's ``idempotent/...`` stats, without the prefix."""
    return {k.removeprefix("idempotent/"): v for k, v in crawler.stats.get_stats().items()
            if k.startswith("idempotent/")}


def finish_reason(crawler: Any) -> str:
    return str(crawler.stats.get_value("finish_reason"))


def path_of(response: Any) -> str:
    """The path (and query) of a response's URL."""
    from urllib.parse import urlsplit

    split = urlsplit(str(response.url))
    return split.path + (f"?{split.query}" if split.query else "")


class PathSpider(scrapy.Spider):
    """Base of the spiders below: ``url`` is the site's root; ``self.at(path)`` is absolute."""

    name = "paths"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base_url = url

    def at(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else self.base_url + path


class LinksSpider(PathSpider):
    """Every page yields one item (unless its path says ``empty``) and follows its links."""

    start_paths: tuple[str, ...] = ("/ok/home?links=/ok/a,/ok/b,/ok/empty",)

    async def start(self) -> Any:
        for path in self.start_paths:
            yield scrapy.Request(self.at(path))

    def parse(self, response: Any) -> Any:
        if not path_of(response).startswith("/ok/empty"):
            yield {"key": path_of(response)}
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href)
