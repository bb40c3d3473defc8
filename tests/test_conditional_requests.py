"""Conditional requests in real crawls of a static site (nginx when installed): a recrawl
after 1% of the products changed downloads the changed pages only, updates exactly their
records, sees every other record unchanged and writes an exact feed; a site that ignores
validators is crawled as without them; Scrapy's HTTP cache and the conditional requests do
not fool each other."""

from __future__ import annotations

import datetime
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import scrapy
from local_site import LocalSite, Received
from scrapy.utils.defer import deferred_f_from_coro_f
from static_shop import (
    SitemapShopSpider,
    StaticShopSpider,
    StaticSite,
    change_products,
    new_price,
    old_price,
    shop_settings,
    sku,
    write_shop,
    write_sitemap,
)

from crawling import kill_crawls, run_crawl
from helpers.stored import reading, run_products, stored_products, stored_runs
from scrapy_idempotent.conditional import not_modified_since

LISTINGS, PER_PAGE = 10, 30
PRODUCTS = LISTINGS * PER_PAGE
PAGES = PRODUCTS + LISTINGS
CHANGED = [7, 150, 283]  # 1% of the products
STATIC_SHOP = Path(__file__).resolve().parent / "static_shop.py"


def feed(path: Path) -> dict[str, int]:
    """sku -> price of a JSON lines feed (every sku once)."""
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    prices = {e["sku"]: e["price"] for e in entries}
    assert len(prices) == len(entries), "an entry twice in the feed"
    return prices


def expected_prices(changed: list[int]) -> dict[str, int]:
    return {sku(n): new_price(n) if n in changed else old_price(n)
            for n in range(1, PRODUCTS + 1)}


async def crawl(site: StaticSite, database: str, feed_path: Path, **settings: Any) -> Any:
    crawler = await run_crawl(StaticShopSpider, shop_settings(
        database, FEEDS={str(feed_path): {"format": "jsonlines"}}, **settings), url=site.url)
    assert crawler.stats.get_value("finish_reason") == "finished"
    return crawler.stats


@deferred_f_from_coro_f
async def test_a_recrawl_downloads_only_what_changed(tmp_path: Path,
                                                    crawl_database: str) -> None:
    write_shop(tmp_path / "site", listings=LISTINGS, per_page=PER_PAGE)
    with StaticSite(tmp_path / "site", tmp_path / "nginx") as site:
        full = await crawl(site, crawl_database, tmp_path / "run1.jsonl")
        assert full.get_value("idempotent/conditional/sent") is None  # nothing known yet
        assert feed(tmp_path / "run1.jsonl") == expected_prices([])
        change_products(tmp_path / "site", CHANGED)
        recrawl = await crawl(site, crawl_database, tmp_path / "run2.jsonl")
    get = recrawl.get_value
    assert get("idempotent/conditional/sent") == PAGES
    assert get("idempotent/conditional/not_modified") == PAGES - len(CHANGED)
    assert get("downloader/response_status_count/200") == len(CHANGED)
    assert get("idempotent/records/updated") == len(CHANGED)
    assert get("idempotent/records/unchanged") == PRODUCTS - len(CHANGED)
    assert get("idempotent/records/inserted") is None
    assert get("idempotent/requests/done") == PAGES
    # the bytes received: the changed pages and a header per unchanged page
    full_bytes = full.get_value("downloader/response_bytes")
    assert get("downloader/response_bytes") <= 0.05 * full_bytes, (
        get("downloader/response_bytes"), full_bytes)
    # the recrawl's feed holds every product once, the changed ones at their new price
    assert feed(tmp_path / "run2.jsonl") == expected_prices(CHANGED)
    assert {p["sku"]: p["price"] for p in run_products(crawl_database, 2)} \
        == expected_prices(CHANGED)


@deferred_f_from_coro_f
async def test_a_site_ignoring_validators_is_crawled_as_without_them(
    tmp_path: Path, crawl_database: str
) -> None:
    write_shop(tmp_path / "site", listings=LISTINGS, per_page=PER_PAGE)
    with StaticSite(tmp_path / "site", tmp_path / "nginx", honour_validators=False) as site:
        await crawl(site, crawl_database, tmp_path / "run1.jsonl")
        change_products(tmp_path / "site", CHANGED)
        recrawl = await crawl(site, crawl_database, tmp_path / "run2.jsonl")
    get = recrawl.get_value
    assert get("idempotent/conditional/not_modified") is None
    assert get("downloader/response_status_count/200") == PAGES
    assert (get("idempotent/records/updated"), get("idempotent/records/unchanged")) \
        == (len(CHANGED), PRODUCTS - len(CHANGED))
    assert feed(tmp_path / "run2.jsonl") == expected_prices(CHANGED)


@deferred_f_from_coro_f
async def test_scrapy_http_cache_and_conditional_requests_do_not_fool_each_other(
    tmp_path: Path,
) -> None:
    database = str(tmp_path / "crawl.sqlite3")
    write_shop(tmp_path / "site", listings=2, per_page=10)
    cache = {"HTTPCACHE_ENABLED": True, "HTTPCACHE_DIR": str(tmp_path / "cache")}
    with StaticSite(tmp_path / "site", tmp_path / "nginx") as site:
        await crawl(site, database, tmp_path / "run1.jsonl")
        change_products(tmp_path / "site", [3])
        # an empty cache (Scrapy's default policy stores every answer): the 304s asked for
        # are not stored as the pages
        second = await crawl(site, database, tmp_path / "run2.jsonl", **cache)
        assert second.get_value("idempotent/conditional/not_modified") == 21
        assert second.get_value("httpcache/store") == 1  # the changed page only
        # the cache answers the page it stored; the others are asked conditionally again
        third = await crawl(site, database, tmp_path / "run3.jsonl", **cache)
        assert third.get_value("httpcache/hit") == 1
        assert third.get_value("idempotent/conditional/not_modified") == 21
        assert third.get_value("idempotent/requests/failed") is None
        # RFC 2616 policy: the cache's own conditional requests are its own
        rfc = {**cache, "HTTPCACHE_POLICY": "scrapy.extensions.httpcache.RFC2616Policy",
               "HTTPCACHE_DIR": str(tmp_path / "rfc-cache")}
        fourth = await crawl(site, database, tmp_path / "run4.jsonl", **rfc)
        assert fourth.get_value("idempotent/requests/failed") is None
    prices = {n: new_price(n) if n == 3 else old_price(n) for n in range(1, 21)}
    for run in ("run2", "run3", "run4"):
        assert feed(tmp_path / f"{run}.jsonl") == {sku(n): p for n, p in prices.items()}
    assert {p["sku"]: p["price"] for p in stored_products(database)} \
        == {sku(n): p for n, p in prices.items()}


@pytest.mark.slow
def test_kills_during_a_recrawl_repeat_only_what_was_in_flight(tmp_path: Path,
                                                               crawl_database: str) -> None:
    listings, per_page, kills, concurrency = 5, 20, 5, 8
    products = listings * per_page
    write_shop(tmp_path / "site", listings=listings, per_page=per_page)

    def command(url: str, feed: str) -> list[str]:
        return [sys.executable, str(STATIC_SHOP), "--url", url, "--db", crawl_database,
                "-s", "FEEDS=" + json.dumps({str(tmp_path / feed): {"format": "jsonlines"}}),
                "-s", f"CONCURRENT_REQUESTS={concurrency}"]

    with StaticSite(tmp_path / "site", tmp_path / "nginx") as site:
        first = subprocess.run([*command(site.url, "run-1.jsonl"),
                                "-s", f"LOG_FILE={tmp_path / 'first.log'}"],
                               cwd=tmp_path, stdin=subprocess.DEVNULL, timeout=300)
        assert first.returncode == 0
        change_products(tmp_path / "site", [1, 42])
        before = site.request_count
        kill_crawls(site, command(site.url, "run-2.jsonl"), tmp_path, random.Random(41),
                    kills)
        recrawl_requests = site.request_count - before
    # each kill repeats at most the requests on the wire (a 304 received before a kill is
    # journaled, not asked again)
    assert recrawl_requests <= products + listings + kills * concurrency
    prices = {sku(n): new_price(n) if n in (1, 42) else old_price(n)
              for n in range(1, products + 1)}
    assert {p["sku"]: p["price"] for p in run_products(crawl_database, 2)} == prices
    entries = [json.loads(line)
               for line in (tmp_path / "run-2.jsonl").read_text().splitlines()]
    assert {e["sku"]: e["price"] for e in entries} == prices
    assert len(entries) == products


class CallsSpider(scrapy.Spider):
    """Fetches ``/v/plain``, ``/v/opt-out`` (meta ``idempotent_conditional = False``) and
    ``/v/moved``; records each callback and errback call in ``calls``."""

    name = "calls"
    custom_settings: ClassVar[dict[str, Any]] = {"IDEMPOTENT_NATURAL_KEYS": {"dict": "url"}}
    calls: ClassVar[list[str]] = []

    def __init__(self, url: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base = url

    async def start(self) -> Any:
        yield scrapy.Request(f"{self.base}/v/plain", errback=self.failed)
        yield scrapy.Request(f"{self.base}/v/opt-out", errback=self.failed,
                             meta={"idempotent_conditional": False})
        yield scrapy.Request(f"{self.base}/v/moved", errback=self.failed)

    def parse(self, response: Any) -> Any:
        self.calls.append(f"parse {response.status} {response.url.split('/v/')[1]}")
        yield {"url": response.url}

    def failed(self, failure: Any) -> None:
        self.calls.append(f"errback {failure.request.url}")


@deferred_f_from_coro_f
async def test_no_callback_for_a_304_opt_out_and_redirects(tmp_path: Path) -> None:
    received: dict[str, list[dict[str, str]]] = {}
    moved = [False]

    def validated(path: str) -> Any:
        def answer(request: Received) -> tuple[int, dict[str, str], str]:
            received.setdefault(path, []).append(dict(request.headers))
            if moved[0] and path == "/v/moved":
                return 301, {"Location": "/v/target", "Content-Type": "text/html"}, ""
            headers = {"ETag": '"v1"', "Content-Type": "text/html"}
            if request.headers.get("If-None-Match") == '"v1"':
                return 304, headers, ""
            return 200, headers, f"<html><body>{path}</body></html>"
        return answer

    database = str(tmp_path / "crawl.sqlite3")
    with LocalSite() as site:
        for path in ("/v/plain", "/v/opt-out", "/v/moved", "/v/target"):
            site.add_responder(path, validated(path))
        await run_crawl(CallsSpider, shop_settings(database), url=site.url)
        assert sorted(CallsSpider.calls) == ["parse 200 moved", "parse 200 opt-out",
                                             "parse 200 plain"]
        CallsSpider.calls.clear()
        moved[0] = True
        second = await run_crawl(CallsSpider, shop_settings(database), url=site.url)
    # the unchanged page: no callback, no errback; the opted-out one: sent plain, parsed
    assert sorted(CallsSpider.calls) == ["parse 200 opt-out", "parse 200 target"]
    assert second.stats.get_value("idempotent/conditional/not_modified") == 1
    assert "If-None-Match" not in received["/v/opt-out"][-1]
    # the redirect of a conditional request is not conditional
    assert received["/v/moved"][-1].get("If-None-Match") == '"v1"'
    assert "If-None-Match" not in received["/v/target"][-1]


@deferred_f_from_coro_f
async def test_a_sitemap_lastmod_skips_pages_not_changed_since_their_fetch(
    tmp_path: Path, crawl_database: str
) -> None:
    write_shop(tmp_path / "site", listings=1, per_page=20)
    old = (datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=10)).date()
    lastmods = {sku(n): old.isoformat() for n in range(1, 21)}
    with StaticSite(tmp_path / "site", tmp_path / "nginx") as site:
        write_sitemap(tmp_path / "site", site.url, lastmods)
        settings = shop_settings(crawl_database)
        first = await run_crawl(SitemapShopSpider, settings, url=site.url)
        assert first.stats.get_value("idempotent/records/inserted") == 20
        change_products(tmp_path / "site", [3])
        lastmods[sku(3)] = (datetime.datetime.now(datetime.timezone.utc)
                            + datetime.timedelta(minutes=1)).isoformat(timespec="seconds")
        write_sitemap(tmp_path / "site", site.url, lastmods)
        before = site.request_count
        second = await run_crawl(SitemapShopSpider, settings, url=site.url)
        # the site saw the sitemap (changed) and the changed product, nothing else
        assert site.request_count - before == 2
    get = second.stats.get_value
    assert get("idempotent/sitemap/skipped") == 19
    assert (get("idempotent/records/updated"), get("idempotent/records/unchanged")) == (1, 19)
    assert {p["sku"]: p["price"] for p in run_products(crawl_database, 2)} == {
        sku(n): new_price(n) if n == 3 else old_price(n) for n in range(1, 21)}


@pytest.mark.parametrize(("lastmod", "fetched_at", "skipped"), [
    ("2026-12-01", datetime.datetime(2026, 12, 2, tzinfo=datetime.timezone.utc), True),
    ("2026-12-01", datetime.datetime(2026, 12, 1, 23, tzinfo=datetime.timezone.utc), False),
    ("2026-12-01T10:00:00+01:00",
     datetime.datetime(2026, 12, 1, 9, 30, tzinfo=datetime.timezone.utc), True),
    ("2026-12-01T10:00:00Z",
     datetime.datetime(2026, 12, 1, 9, 30, tzinfo=datetime.timezone.utc), False),
    ("2026-12", datetime.datetime(2027, 1, 1, tzinfo=datetime.timezone.utc), False),
    ("yesterday", datetime.datetime(2027, 1, 1, tzinfo=datetime.timezone.utc), False),
])
def test_lastmod_against_the_last_fetch(lastmod: str, fetched_at: datetime.datetime,
                                        skipped: bool) -> None:
    assert not_modified_since(lastmod, fetched_at.timestamp()) is skipped


@deferred_f_from_coro_f
async def test_adaptive_revisits_fetch_only_the_pages_due(
    tmp_path: Path, crawl_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With IDEMPOTENT_ADAPTIVE_REVISIT, a run within a day of the last (the shortest
    interval) fetches the listing pages only (conditionally): the products are done as
    unchanged without a request, their records seen, the feed exact; a run a day later
    fetches them again and finds the change. The store's clock is moved forward a day
    between runs (a crawl's components never read the wall clock for this)."""
    import time

    import scrapy_idempotent.scheduler as scheduler_module

    offset = [0.0]
    opened = scheduler_module.open_store

    def store_at_offset(database: str, **options: Any) -> Any:
        return opened(database, **{**options, "clock": lambda: time.time() + offset[0]})

    monkeypatch.setattr(scheduler_module, "open_store", store_at_offset)
    write_shop(tmp_path / "site", listings=2, per_page=10)
    settings = {"IDEMPOTENT_ADAPTIVE_REVISIT": True, "IDEMPOTENT_REVISIT_MIN_SECONDS": 86400}
    with StaticSite(tmp_path / "site", tmp_path / "nginx") as site:
        await crawl(site, crawl_database, tmp_path / "run1.jsonl", **settings)
        change_products(tmp_path / "site", [4])
        offset[0] = 3600.0  # an hour later: nothing is due but the listings
        before = site.request_count
        early = await crawl(site, crawl_database, tmp_path / "run2.jsonl", **settings)
        assert site.request_count - before == 2  # the two listing pages
        offset[0] = 86400.0 + 3600.0
        later = await crawl(site, crawl_database, tmp_path / "run3.jsonl", **settings)
    get = early.get_value
    assert get("idempotent/revisit/not_due") == 20
    assert get("idempotent/conditional/not_modified") == 2
    assert get("idempotent/revisit/bytes_saved") > 20 * 8000
    assert (get("idempotent/records/unchanged"), get("idempotent/records/updated")) == (20, None)
    assert feed(tmp_path / "run2.jsonl") == {sku(n): old_price(n) for n in range(1, 21)}
    get = later.get_value
    assert get("idempotent/revisit/not_due") is None
    assert (get("idempotent/records/unchanged"), get("idempotent/records/updated")) == (19, 1)
    assert feed(tmp_path / "run3.jsonl") == {sku(n): new_price(n) if n == 4 else old_price(n)
                                             for n in range(1, 21)}


def write_shared_listings(root: Path, first_links: range) -> None:
    """``/list/1.html`` links the products of ``first_links`` and ``/list/2.html``; that one
    links products 1 to 10 (those of the first it repeats are known when it is parsed)."""
    def listing(numbers: range, more: str) -> str:
        return "<html><body>" + "".join(
            f'<a class="product" href="/product/{sku(n)}.html">{n}</a>\n' for n in numbers
        ) + more + "</body></html>"

    first = root / "list" / "1.html"
    mtime = first.stat().st_mtime + 10 if first.exists() else None
    first.write_text(listing(first_links, '<a class="next" href="/list/2.html">next</a>'))
    if mtime is not None:  # changed: a later Last-Modified
        import os

        os.utime(first, (mtime, mtime))
    if not (root / "list" / "2.html").exists():
        (root / "list" / "2.html").write_text(listing(range(1, 11), ""))


@deferred_f_from_coro_f
async def test_an_unchanged_page_reaches_a_link_another_page_added_and_dropped(
    tmp_path: Path, crawl_database: str
) -> None:
    """Products 1 to 10 are added by listing 1 and linked by listing 2 too; listing 1
    changes and drops products 6 to 10; listing 2 answers 304 and stands for all its links:
    every product is reached, the feed of the recrawl is exact."""
    write_shop(tmp_path / "site", listings=1, per_page=10)
    write_shared_listings(tmp_path / "site", range(1, 11))
    # one request at a time: listing 1 is parsed (and adds the products) before listing 2
    one = {"CONCURRENT_REQUESTS": 1}
    with StaticSite(tmp_path / "site", tmp_path / "nginx") as site:
        first = await crawl(site, crawl_database, tmp_path / "run1.jsonl", **one)
        assert first.get_value("idempotent/records/inserted") == 10
        write_shared_listings(tmp_path / "site", range(1, 6))
        recrawl = await crawl(site, crawl_database, tmp_path / "run2.jsonl", **one)
    get = recrawl.get_value
    assert get("downloader/response_status_count/200") == 1  # listing 1
    assert get("idempotent/conditional/not_modified") == 11
    assert (get("idempotent/records/unchanged"), get("idempotent/records/updated")) \
        == (10, None)
    assert feed(tmp_path / "run2.jsonl") == {sku(n): old_price(n) for n in range(1, 11)}


DAY = 86400.0
#: Adaptive revisits of the kill test: a first interval of 30 days, so that the revisit
#: times of a first crawl's pages spread over 15 days, hours apart
KILL_REVISITS = {"IDEMPOTENT_ADAPTIVE_REVISIT": True,
                 "IDEMPOTENT_REVISIT_MIN_SECONDS": 30 * DAY,
                 "IDEMPOTENT_REVISIT_MAX_SECONDS": 120 * DAY}


def revisit_schedule(database: str) -> tuple[list[float], dict[str, tuple[Any, ...]]]:
    """The start times of the runs, and per page kept: its revisit interval, its revisit
    time (None: every run) and how the latest run reached it, with that run."""
    with reading(database) as store:
        starts = [float(t) for (t,) in store._select(  # type: ignore[attr-defined]
            "SELECT started_at FROM runs ORDER BY run_id")]
        rows = store._select(  # type: ignore[attr-defined]
            "SELECT key, revisit_seconds, due_at, outcome, run_id FROM page_validators")
    return starts, {key: (seconds, due_at, outcome, run_id)
                    for key, seconds, due_at, outcome, run_id in rows}


def boundary(database: str) -> float:
    """A revisit time, counted from the first run's start, that falls in the widest gap
    between the products' revisit times in the middle third of them (hours from any): a
    run whose clock stands there finds the same pages due from its start to its end."""
    starts, rows = revisit_schedule(database)
    times = sorted(due_at - starts[0] for _, due_at, _, _ in rows.values()
                   if due_at is not None)
    third = len(times) // 3
    gaps = [(times[n + 1] - times[n], n) for n in range(third, 2 * third)]
    width, n = max(gaps)
    assert width > 3600, gaps
    return (times[n] + times[n + 1]) / 2


@pytest.mark.slow
def test_kills_during_an_adaptive_recrawl_round(tmp_path: Path, crawl_database: str,
                                                second_crawl_database: str) -> None:
    """Adaptive revisits on, a round in which about half of the products are due: the same
    round crawled without kills (``second_crawl_database``) and with 5 SIGKILLs at random
    moments (``crawl_database``) ends the same: its records and feed exact, every page
    fetched or not due (never both, never twice), the same revisit intervals and times
    (counted from each database's own runs), and the site asked at most the requests of
    the unkilled round plus those on the wire at each kill."""
    listings, per_page, kills, concurrency = 8, 25, 5, 8
    products = listings * per_page
    changed = list(range(3, products + 1, 10))
    write_shop(tmp_path / "site", listings=listings, per_page=per_page)
    databases = {"unkilled": second_crawl_database, "killed": crawl_database}

    def command(url: str, database: str, feed: str, offset: float = 0.0) -> list[str]:
        return [sys.executable, str(STATIC_SHOP), "--url", url, "--db", database,
                "--clock-offset", repr(offset),
                "-s", "FEEDS=" + json.dumps({str(tmp_path / feed): {"format": "jsonlines"}}),
                "-s", f"CONCURRENT_REQUESTS={concurrency}",
                *(arg for name, value in KILL_REVISITS.items()
                  for arg in ("-s", f"{name}={json.dumps(value)}"))]

    def run(cmd: list[str], log: str) -> None:
        done = subprocess.run([*cmd, "-s", f"LOG_FILE={tmp_path / log}"], cwd=tmp_path,
                              stdin=subprocess.DEVNULL, timeout=300, check=False)
        assert done.returncode == 0, (tmp_path / log).read_text(errors="replace")[-3000:]

    with StaticSite(tmp_path / "site", tmp_path / "nginx") as site:
        for name, database in databases.items():
            run(command(site.url, database, f"{name}-1.jsonl"), f"{name}-1.log")
        change_products(tmp_path / "site", changed)
        middle = boundary(databases["unkilled"])
        early = KILL_REVISITS["IDEMPOTENT_REVISIT_MIN_SECONDS"] / 10

        def offset(database: str) -> float:
            """The clock offset at which the round's claims find ``middle`` (a page counts
            as due a tenth of the shortest interval early)."""
            return revisit_schedule(database)[0][0] + middle - early - time.time()

        before = site.request_count
        run(command(site.url, databases["unkilled"], "unkilled-2.jsonl",
                    offset(databases["unkilled"])), "unkilled-2.log")
        unkilled_requests = site.request_count - before
        (tmp_path / "kills").mkdir()
        before = site.request_count
        kill_crawls(site, command(site.url, databases["killed"], "killed-2.jsonl",
                                  offset(databases["killed"])), tmp_path / "kills",
                    random.Random(43), kills, more=(3, 12))
        killed_requests = site.request_count - before
    schedules = {name: revisit_schedule(database) for name, database in databases.items()}
    rows = schedules["unkilled"][1]
    not_due = {key for key, row in rows.items() if row[2] == "not_due"}
    due = set(rows) - not_due
    assert 0 < len(not_due) < products and all(row[3] == 2 for row in rows.values())
    # the unkilled round: the listings and the due products asked once each, no other
    assert unkilled_requests == len(due)

    def normalised(schedule: tuple[list[float], dict[str, tuple[Any, ...]]]) -> dict[str, Any]:
        """Revisit times counted from the start of the run that set them: the first for a
        page not due (its row stays as it was), the round's for the others."""
        starts, rows = schedule
        return {key: (seconds, outcome, None if due_at is None else round(
                    due_at - starts[0 if outcome == "not_due" else 1], 3))
                for key, (seconds, due_at, outcome, _) in rows.items()}

    assert normalised(schedules["killed"]) == normalised(schedules["unkilled"])
    # each kill repeats at most the requests on the wire; a page not due is never asked
    assert unkilled_requests <= killed_requests <= unkilled_requests + kills * concurrency
    # records and feeds: a changed product is found if it was due, else seen unchanged
    with reading(databases["unkilled"]) as store:
        # (the validators' text keys as the requests' key column holds them)
        of_text = store.KEY_OF_TEXT.format(c="key")  # type: ignore[attr-defined]
        fetched_urls = {url for (url,) in store._select(  # type: ignore[attr-defined]
            f"SELECT url FROM requests WHERE key IN (SELECT {of_text} FROM page_validators"
            " WHERE outcome <> 'not_due')")}
    prices = {sku(n): new_price(n) if n in changed and any(
                  url.endswith(f"/product/{sku(n)}.html") for url in fetched_urls)
              else old_price(n) for n in range(1, products + 1)}
    assert prices != expected_prices([]) and prices != expected_prices(changed)
    for name, database in databases.items():
        assert {p["sku"]: p["price"] for p in run_products(database, 2)} == prices, name
        assert feed(tmp_path / f"{name}-2.jsonl") == prices, name
    runs = {name: stored_runs(database)[1] for name, database in databases.items()}
    assert (runs["killed"].done, runs["killed"].records_updated,
            runs["killed"].records_unchanged) == (runs["unkilled"].done,
                                                  runs["unkilled"].records_updated,
                                                  runs["unkilled"].records_unchanged)
