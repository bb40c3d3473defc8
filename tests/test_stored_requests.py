"""Requests through the store, in real crawls of the local site: children with meta copied
from the response, ``dont_filter`` children of a replayed parent, bodies, classes, headers,
cookies, ``cb_kwargs`` and errbacks round-tripping, and requests that cannot be stored
(fetched from memory under their owner's lease, retries and redirects included)."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import scrapy
from local_site import LocalSite
from scrapy.downloadermiddlewares.retry import get_retry_request
from scrapy.http import JsonRequest
from scrapy.http.request.form import FormRequest  # not scrapy.http: deprecated there in 2.16
from scrapy.utils.defer import deferred_f_from_coro_f

from helpers.site_crawls import (
    LinksSpider,
    PathSpider,
    assert_nothing_leased,
    crawl,
    finish_reason,
    frontier,
    istats,
    path_of,
    record_owner,
    records,
    rows,
    settings,
)

# -- identity of children: meta copied from the response, dont_filter, replayed parents -----------


class MetaCopySpider(PathSpider):
    """The parent is reached through a redirect and a retry, so ``response.meta`` carries
    ``redirect_urls``, ``retry_times``, ``depth``, ...; its children copy it wholesale."""

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/redirect/302/mm?to=/flaky/1/mparent"),
                             callback=self.parse_parent, meta={"custom": "kept"})

    def parse_parent(self, response: Any) -> Any:
        yield {"key": "parent", "retry_times": response.meta.get("retry_times"),
               "redirects": len(response.meta.get("redirect_urls", []))}
        for name in ("mc1", "mc2", "mc1"):  # mc1 twice: a duplicate like any other
            yield scrapy.Request(self.at(f"/ok/{name}"), meta=response.meta,
                                 callback=self.parse_child)
        # a plain link to itself, with its meta: a duplicate, not a retry
        yield scrapy.Request(response.url, meta=response.meta, callback=self.parse_child)

    def parse_child(self, response: Any) -> Any:
        yield {"key": path_of(response), "custom": response.meta.get("custom")}


@deferred_f_from_coro_f
async def test_children_with_meta_copied_from_the_response(
    site: LocalSite, crawl_database: str
) -> None:
    crawler = await crawl(MetaCopySpider, settings(crawl_database, RETRY_ENABLED=True,
                                                   RETRY_TIMES=2),
                          url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {
        "/redirect/302/mm?to=/flaky/1/mparent": ("redirected", None, 1),
        "/flaky/1/mparent": ("done", None, 2),
        "/ok/mc1": ("done", None, 1),
        "/ok/mc2": ("done", None, 1),
    }
    assert_nothing_leased(crawl_database)
    stored = records(crawl_database)
    assert stored["parent"] == {"key": "parent", "retry_times": 1, "redirects": 1}
    assert stored["/ok/mc1"]["custom"] == stored["/ok/mc2"]["custom"] == "kept"
    assert record_owner(crawl_database, site) == {
        "parent": "/flaky/1/mparent", "/ok/mc1": "/ok/mc1", "/ok/mc2": "/ok/mc2"}
    assert site.hits("/ok/mc1") == site.hits("/ok/mc2") == 1
    assert site.hits("/flaky/1/mparent") == 2
    stats = istats(crawler)
    assert stats.get("requests/duplicate", 0) + stats.get("requests/already_done", 0) == 2
    assert stats["requests/done"] == 3
    assert stats["records/inserted"] == 3


class DontFilterSpider(PathSpider):
    """A ``dont_filter`` start request whose callback yields ``dont_filter`` children (one
    URL twice) and a plain one; on its first attempt it also asks for a retry, so the same
    children are yielded again by the replayed parent."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.parent_calls = 0

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/dfparent"), dont_filter=True,
                             callback=self.parse_parent)

    def parse_parent(self, response: Any) -> Any:
        self.parent_calls += 1
        yield {"key": "dfparent", "calls": self.parent_calls}
        yield scrapy.Request(self.at("/ok/df1"), dont_filter=True, callback=self.parse_child)
        yield scrapy.Request(self.at("/ok/df1"), dont_filter=True, callback=self.parse_child)
        yield scrapy.Request(self.at("/ok/df2"), dont_filter=True, callback=self.parse_child)
        yield scrapy.Request(self.at("/ok/plain"), callback=self.parse_child)
        if self.parent_calls == 1:
            yield get_retry_request(response.request, spider=self, reason="replay me")

    def parse_child(self, response: Any) -> Any:
        yield {"key": path_of(response)}


@deferred_f_from_coro_f
async def test_dont_filter_children_of_a_replayed_parent_are_not_inserted_twice(
    site: LocalSite, crawl_database: str
) -> None:
    crawler = await crawl(DontFilterSpider, settings(crawl_database, RETRY_TIMES=2), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert crawler.spider.parent_calls == 2
    expected = [
        ("/ok/df1", "done", None, 1),
        ("/ok/df1", "done", None, 1),  # two dont_filter requests: two entries, by design
        ("/ok/df2", "done", None, 1),
        ("/ok/dfparent", "done", None, 2),
        ("/ok/plain", "done", None, 1),
    ]
    assert rows(crawl_database, site) == expected
    assert_nothing_leased(crawl_database)
    assert site.counts_by_path() == {"/ok/dfparent": 2, "/ok/df1": 2, "/ok/df2": 1,
                                     "/ok/plain": 1}
    assert records(crawl_database)["dfparent"]["calls"] == 2
    stats = istats(crawler)
    assert stats["requests/added"] == 5
    assert stats.get("requests/duplicate", 0) + stats.get("requests/already_done", 0) == 4

    # the same crawl again, resuming the (finished) run: nothing new, nothing fetched
    site.reset_counts()
    again = await crawl(DontFilterSpider, settings(
        crawl_database, RETRY_TIMES=2, IDEMPOTENT_RUN_MODE="resume"), url=site.url)
    assert finish_reason(again) == "finished"
    assert rows(crawl_database, site) == expected
    assert site.counts_by_path() == {}
    assert istats(again)["requests/already_done"] == 1
    assert "requests/added" not in istats(again)


# -- request bodies, classes, headers, cookies, cb_kwargs and errbacks through the store ----------


class BodiesSpider(PathSpider):
    """``/ok/gate`` yields POST, FormRequest and JsonRequest children (and an errback on a
    failing POST); the first crawl stops after the gate (CLOSESPIDER_PAGECOUNT=1), so they
    are loaded from the store by the second."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.echoes: dict[str, dict[str, Any]] = {}
        self.errback_calls: list[str] = []

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/gate"), callback=self.parse_gate)

    def parse_gate(self, response: Any) -> Any:
        import datetime
        import decimal

        yield scrapy.Request(
            self.at("/echo/raw"), method="POST", body=b"raw \x00\xff body",
            headers={"X-Custom": "v1", "Content-Type": "application/octet-stream"},
            cookies={"c1": "cookie-one"}, callback=self.parse_echo, errback=self.on_error,
            cb_kwargs={"tag": "raw", "when": datetime.datetime(2024, 5, 6, 7, 8, 9),
                       "amount": decimal.Decimal("12.50"), "pair": (1, "two"),
                       "blob": b"\x01\x02"},
        )
        yield FormRequest(self.at("/echo/form"), formdata={"a": "1", "b": "two words"},
                          callback=self.parse_echo, cb_kwargs={"tag": "form"})
        yield JsonRequest(self.at("/echo/json"), data={"x": [1, 2], "y": "z"},
                          callback=self.parse_echo, cb_kwargs={"tag": "json"})
        for body in (b"one", b"two"):  # differ only in body: two requests
            yield scrapy.Request(self.at("/echo/same"), method="POST", body=body,
                                 callback=self.parse_echo, cb_kwargs={"tag": f"same-{body!r}"})
        yield scrapy.Request(self.at("/status/500/post"), method="POST", body=b"x",
                             callback=self.parse_echo, errback=self.on_error,
                             cb_kwargs={"tag": "failing"})

    def parse_echo(self, response: Any, tag: str, **extra: Any) -> Any:
        echo = response.json()
        self.echoes[tag] = {"echo": echo, "extra": extra,
                            "class": type(response.request).__name__}
        yield {"key": tag, "method": echo["method"], "body_b64": echo["body_b64"]}

    def on_error(self, failure: Any) -> Any:
        tag = failure.request.cb_kwargs["tag"]
        self.errback_calls.append(tag)
        yield {"key": f"failure:{tag}"}


@deferred_f_from_coro_f
async def test_post_form_and_json_requests_round_trip_through_the_store(
    site: LocalSite, crawl_database: str
) -> None:
    import base64
    import datetime
    import decimal

    first = await crawl(BodiesSpider, settings(crawl_database, CLOSESPIDER_PAGECOUNT=1),
                        url=site.url)
    assert finish_reason(first) == "closespider_pagecount"
    assert_nothing_leased(crawl_database)
    assert site.counts_by_path() == {"/ok/gate": 1}
    assert [r[:3] for r in rows(crawl_database, site)] == [
        ("/echo/form", "pending", None),
        ("/echo/json", "pending", None),
        ("/echo/raw", "pending", None),
        ("/echo/same", "pending", None),
        ("/echo/same", "pending", None),  # two POSTs that differ only in body
        ("/ok/gate", "done", None),
        ("/status/500/post", "pending", None),
    ]

    second = await crawl(BodiesSpider, settings(crawl_database), url=site.url)
    assert finish_reason(second) == "finished"
    assert_nothing_leased(crawl_database)
    assert [r[:3] for r in rows(crawl_database, site)] == [
        ("/echo/form", "done", None),
        ("/echo/json", "done", None),
        ("/echo/raw", "done", None),
        ("/echo/same", "done", None),
        ("/echo/same", "done", None),
        ("/ok/gate", "done", None),
        ("/status/500/post", "failed", "http_status"),
    ]
    echoes = second.spider.echoes
    raw = echoes["raw"]
    assert raw["class"] == "Request"
    assert raw["echo"]["method"] == "POST"
    assert base64.b64decode(raw["echo"]["body_b64"]) == b"raw \x00\xff body"
    assert raw["echo"]["headers"]["X-Custom"] == "v1"
    assert raw["echo"]["headers"]["Content-Type"] == "application/octet-stream"
    assert raw["echo"]["cookies"] == {"c1": "cookie-one"}
    assert raw["extra"] == {"when": datetime.datetime(2024, 5, 6, 7, 8, 9),
                            "amount": decimal.Decimal("12.50"), "pair": (1, "two"),
                            "blob": b"\x01\x02"}
    form = echoes["form"]
    assert form["class"] == "FormRequest"
    assert form["echo"]["method"] == "POST"
    assert form["echo"]["body"] == "a=1&b=two+words"
    assert form["echo"]["headers"]["Content-Type"] == "application/x-www-form-urlencoded"
    json_echo = echoes["json"]
    assert json_echo["class"] == "JsonRequest"
    assert json.loads(json_echo["echo"]["body"]) == {"x": [1, 2], "y": "z"}
    assert json_echo["echo"]["headers"]["Content-Type"] == "application/json"
    assert {echoes["same-b'one'"]["echo"]["body"], echoes["same-b'two'"]["echo"]["body"]} == {
        "one", "two"}
    assert site.hits("/echo/same", "POST") == 2
    # the stored errback ran, once, on the failing POST; its item is stored
    assert second.spider.errback_calls == ["failing"]
    assert set(records(crawl_database)) == {"raw", "form", "json", "same-b'one'", "same-b'two'",
                                     "failure:failing"}
    assert all(n == 1 for path, n in site.counts_by_path().items() if path != "/echo/same")
    stats = istats(second)
    assert stats["requests/done"] == 5
    assert stats["requests/failed"] == 1
    assert stats["records/inserted"] == 6


# -- requests that cannot be stored ---------------------------------------------------------


class UnstorableSpider(PathSpider):
    def __init__(self, url: str, file_path: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.file_path = file_path
        self.handle: Any = None

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/store-test"))

    def parse(self, response: Any) -> Any:
        if path_of(response) != "/ok/store-test":
            yield {"key": path_of(response)}
            return
        self.handle = open(self.file_path)  # noqa: SIM115 - closed in closed()
        yield scrapy.Request(self.at("/ok/u-lambda"), callback=lambda r: None)  # type: ignore[misc]
        yield scrapy.Request(self.at("/ok/u-partial"),
                             callback=functools.partial(self.parse_extra, extra=1))
        yield scrapy.Request(self.at("/ok/u-generator"),
                             meta={"rows": (n for n in range(3))})
        yield scrapy.Request(self.at("/ok/u-file"), cb_kwargs={"fh": self.handle},
                             callback=self.parse_extra)
        yield scrapy.Request(self.at("/ok/u-good"))

    def parse_extra(self, response: Any, **kwargs: Any) -> Any:
        yield {"key": path_of(response)}

    def closed(self, reason: str) -> None:
        if self.handle is not None:
            self.handle.close()


@deferred_f_from_coro_f
async def test_unstorable_requests_are_fetched_from_memory_and_logged_once_per_cause(
    site: LocalSite, crawl_database: str, tmp_path: Path, caplog: Any
) -> None:
    data_file = tmp_path / "data.txt"
    data_file.write_text("x")
    crawler = await crawl(UnstorableSpider, settings(crawl_database), url=site.url,
                          file_path=str(data_file))
    assert finish_reason(crawler) == "finished"
    # only storable requests are in the frontier; the page that yielded the others was done
    # after them (its items: from /ok/u-partial and /ok/u-file, whose callbacks yield some)
    assert frontier(crawl_database, site) == {
        "/ok/store-test": ("done", None, 1),
        "/ok/u-good": ("done", None, 1),
    }
    assert_nothing_leased(crawl_database)
    stats = istats(crawler)
    assert stats["requests/unstorable"] == 4
    assert stats["requests/from_memory"] == 4
    assert crawler.dropped_urls == []
    assert site.counts_by_path() == {path: 1 for path in (
        "/ok/store-test", "/ok/u-lambda", "/ok/u-partial", "/ok/u-generator", "/ok/u-file",
        "/ok/u-good")}
    assert set(records(crawl_database)) == {"/ok/u-partial", "/ok/u-generator", "/ok/u-file",
                                     "/ok/u-good"}
    assert record_owner(crawl_database, site)["/ok/u-file"] == "/ok/store-test"
    warnings: list[str] = [r.getMessage() for r in caplog.records
                           if r.levelno == logging.WARNING and "from memory" in r.getMessage()]

    def warning_for(name: str) -> str:
        found = [m for m in warnings if f"/ok/{name}" in m]
        assert len(found) == 1, (name, warnings)
        return found[0]

    # once per cause: the lambda and the partial are both a callback that is no spider method
    assert "callback" in warning_for("u-lambda")
    assert not [m for m in warnings if "/ok/u-partial" in m]
    assert "meta['rows']" in warning_for("u-generator")
    assert "generator" in warning_for("u-generator")
    assert "cb_kwargs['fh']" in warning_for("u-file")


# -- retries and redirects that cannot be stored ---------------------------------------------


class StashMiddleware:
    """A downloader middleware that keeps a live object in ``request.meta`` (as
    scrapy-playwright's ``playwright_page`` or a session object would): a retry or redirect
    copies it, so the copy cannot be stored."""

    def process_request(self, request: Any, spider: Any = None) -> None:
        if "stash" in request.url:
            request.meta["session"] = object()


@pytest.mark.parametrize(("path", "hits", "unstorable", "end", "stored"), [
    ("/flaky/1/stash", 2, 1, ("done", None), {"/flaky/1/stash"}),
    ("/reset/stash", 3, 2, ("failed", "download_error/"), set()),
    ("/redirect/302/stash?to=/ok/stash-target", 1, 1, ("redirected", None),
     {"/ok/stash-target"}),
], ids=["retry", "retries-fail", "redirect"])
@deferred_f_from_coro_f
async def test_retry_or_redirect_that_cannot_be_stored_is_fetched_under_its_requests_lease(
    site: LocalSite, crawl_database: str, path: str, hits: int, unstorable: int,
    end: tuple[str, str | None], stored: set[str],
) -> None:
    crawler = await crawl(LinksSpider, settings(
        crawl_database, RETRY_ENABLED=True, RETRY_TIMES=2,
        DOWNLOADER_MIDDLEWARES={f"{__name__}.StashMiddleware": 560},
    ), url=site.url, start_paths=(path,))
    assert finish_reason(crawler) == "finished"
    # the retries (or the redirect) copy the live object: fetched from memory, as Scrapy
    # does, and the stored request ends with their outcome
    assert istats(crawler)["requests/unstorable"] == unstorable
    assert site.hits(path) == hits
    assert set(records(crawl_database)) == stored
    assert_nothing_leased(crawl_database)
    [(state, error_kind, attempts)] = frontier(crawl_database, site).values()
    assert (state, (error_kind or "")[:len(end[1] or "")] or None) == end, error_kind
    assert attempts == 1
    if end[0] == "redirected":
        assert site.hits("/ok/stash-target") == 1
    assert crawler.dropped_urls == []
