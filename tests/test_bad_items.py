"""Items a crawl cannot store as they are: a missing natural key, keys that differ only in
type or padding, values that are not plain JSON, very large items, values the codec refuses,
lone surrogates. Real crawls against a local site; the crawl goes on, and the rejected item
is counted and named."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import json
import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import scrapy
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import (
    PagesSpider,
    all_messages,
    crawl_settings,
    frontier_counts,
    pages,
    request_keys,
    run_crawl,
)
from helpers.stored import stored_records, stored_rejects
from scrapy_idempotent.codec import loads

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "scrapy_idempotent"
EXAMPLE_PROJECT = ROOT / "example_project"





class Product(scrapy.Item):
    sku = scrapy.Field()
    name = scrapy.Field()
    extra = scrapy.Field()


class Part(scrapy.Item):
    ref = scrapy.Field()
    size = scrapy.Field()


@dataclasses.dataclass
class Offer:
    sku: Any
    price: Any = None


PRODUCT = f"{__name__}.Product"
KEYS = {"IDEMPOTENT_NATURAL_KEYS": {PRODUCT: "sku", "dict": "sku", f"{__name__}.Offer": "sku"}}




@deferred_f_from_coro_f
async def test_item_without_its_natural_key_is_rejected_and_the_crawl_goes_on(
    site: LocalSite, crawl_database: str, caplog: Any
) -> None:
    bad = {
        "missing": Product(name="no sku at all"),
        "none": Product(sku=None, name="sku is None"),
        "empty": Product(sku="", name="sku is empty"),
        "blank": Product(sku=" \t\n ", name="sku is whitespace"),
    }

    def output(response: Any) -> Any:
        if response.url.endswith("/page/1"):
            yield from bad.values()
        yield Product(sku=f"OK-{response.url[-1]}", name="good")

    crawler = await run_crawl(PagesSpider, crawl_settings(crawl_database, **KEYS), url=site.url,
                              paths=pages(site, 2), make_output=output)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/records/rejected"] == 4
    assert stats["item_dropped_count"] == 4
    assert stats["idempotent/records/inserted"] == 2  # the good items of both pages
    assert frontier_counts(crawl_database) == {"done": 2}
    keys = request_keys(crawl_database)
    rejects = sorted(stored_rejects(crawl_database), key=lambda reject: reject.id)
    assert len(rejects) == 4
    for reject, name in zip(rejects, bad, strict=True):
        assert reject.item_type == PRODUCT
        assert PRODUCT in reject.reason and "'sku'" in reject.reason, reject.reason
        assert reject.request_key == keys["/page/1"]
        assert loads(reject.data)["name"] == bad[name]["name"]  # the item is kept, readable
    dropped = [m for m in all_messages(caplog, logging.WARNING) if "Dropped" in m]
    assert len(dropped) == 4
    for message in dropped:
        assert "Product" in message and "'sku'" in message and "rejects table" in message


@deferred_f_from_coro_f
async def test_natural_key_int_string_and_padded_string_are_one_record(
    site: LocalSite, crawl_database: str
) -> None:
    values = {"/page/1": 123, "/page/2": "123", "/page/3": " 123 "}

    def output(response: Any) -> Any:
        yield Offer(sku=values[urlsplit(response.url).path], price="9.99")

    crawler = await run_crawl(PagesSpider, crawl_settings(crawl_database, **KEYS), url=site.url,
                              paths=pages(site, 3), make_output=output)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/records/inserted"] == 1
    rows = [(r.natural_key, r.item_type) for r in stored_records(crawl_database)]
    assert rows == [('["123"]', f"{__name__}.Offer")]
    assert frontier_counts(crawl_database) == {"done": 3}


NOT_PLAIN_JSON: dict[str, Any] = {
    "when": datetime.datetime(2024, 2, 29, 23, 59, 58, 123456,
                              tzinfo=datetime.timezone(datetime.timedelta(hours=5, minutes=30))),
    "naive_when": datetime.datetime(2001, 1, 1, 0, 0),
    "day": datetime.date(1999, 12, 31),
    "price": decimal.Decimal("19.990"),
    "tiny": decimal.Decimal("-1E-30"),
    "raw": b"\x00\xff\x80binary\n",
    "tags": {"b", "a", "c"},
    "frozen": frozenset({1, 2}),
    "pair": (1, "two", None),
    "int_keys": {1: "one", 2: "two"},
    "dollar_key": {"$bytes": "not a tag", "$set": [1]},
    "nested": {"part": Part(ref="P-1", size=decimal.Decimal("1.5")),
               "parts": [Part(ref="P-2"), {"deep": Part(ref="P-3", size=(1, 2))}]},
    "big_int": 2**80,
    "unicode": "Grüße, 東京, emoji 🚀, rtl \u202e",
    "float": 0.1,
}


def plain(value: Any) -> Any:
    """``value`` with every scrapy.Item turned into a dict of its fields (how they are stored)."""
    if isinstance(value, scrapy.Item):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return value


@deferred_f_from_coro_f
async def test_values_that_are_not_plain_json_are_stored_faithfully(
    site: LocalSite, crawl_database: str
) -> None:
    def output(response: Any) -> Any:
        yield {"sku": "RICH-1", **NOT_PLAIN_JSON}
        yield Product(sku="RICH-2", name="nested", extra=dict(NOT_PLAIN_JSON))

    crawler = await run_crawl(PagesSpider, crawl_settings(crawl_database, **KEYS), url=site.url,
                              paths=pages(site, 1), make_output=output)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert crawler.stats.get_value("idempotent/records/inserted") == 2
    stored = {loads(r.data)["sku"]: loads(r.data) for r in stored_records(crawl_database)}
    first = stored["RICH-1"]
    assert first == {"sku": "RICH-1", **plain(NOT_PLAIN_JSON)}
    for name, value in plain(NOT_PLAIN_JSON).items():  # same types too, not only equal
        assert type(first[name]) is type(value), name
    assert first["when"].utcoffset() == datetime.timedelta(hours=5, minutes=30)
    assert str(first["price"]) == "19.990"
    assert stored["RICH-2"] == {"sku": "RICH-2", "name": "nested",
                                "extra": plain(NOT_PLAIN_JSON)}


@deferred_f_from_coro_f
async def test_very_large_item_is_stored(site: LocalSite, crawl_database: str) -> None:
    text = "0123456789abcdef" * (5 * 1024 * 1024 // 16)  # 5 MiB

    def output(response: Any) -> Any:
        yield {"sku": "BIG-1", "text": text, "blob": text.encode("ascii")}
        yield {"sku": "SMALL-1", "text": "small"}

    crawler = await run_crawl(PagesSpider, crawl_settings(crawl_database, **KEYS), url=site.url,
                              paths=pages(site, 1), make_output=output)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert crawler.stats.get_value("idempotent/records/inserted") == 2
    [data] = [r.data for r in stored_records(crawl_database) if r.natural_key == '["BIG-1"]']
    record = loads(data)
    assert record["text"] == text
    assert record["blob"] == text.encode("ascii")
    assert frontier_counts(crawl_database) == {"done": 1}


@deferred_f_from_coro_f
async def test_item_with_a_value_that_cannot_be_stored_is_rejected_not_a_crash(
    site: LocalSite, crawl_database: str, tmp_path: Path, caplog: Any
) -> None:
    handle = (tmp_path / "open.txt").open("w")

    def output(response: Any) -> Any:
        yield {"sku": "FILE-1", "attachment": {"files": [handle]}}
        yield {"sku": "GOOD-1"}

    try:
        crawler = await run_crawl(PagesSpider, crawl_settings(crawl_database, **KEYS),
                                  url=site.url, paths=pages(site, 1), make_output=output)
    finally:
        handle.close()
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/records/rejected"] == 1
    assert stats["idempotent/records/inserted"] == 1
    (item_type, reason, request_key), = [(r.item_type, r.reason, r.request_key)
                                         for r in stored_rejects(crawl_database)]
    assert item_type == "dict"
    assert "['attachment']['files'][0]" in reason and "TextIOWrapper" in reason, reason
    assert request_key == request_keys(crawl_database)["/page/1"]
    dropped = [m for m in all_messages(caplog, logging.WARNING) if "Dropped" in m]
    assert len(dropped) == 1 and "TextIOWrapper" in dropped[0] and "rejects table" in dropped[0]
    assert frontier_counts(crawl_database) == {"done": 1}


@deferred_f_from_coro_f
async def test_item_whose_natural_key_value_cannot_be_stored_is_rejected_and_the_page_kept(
    site: LocalSite, crawl_database: str, caplog: Any
) -> None:
    """A key field holding an object with no data form (here a lock: a parser handed back the
    wrong thing) is a bad item like a missing key: rejected, and the rest of the page's output
    (the good item after it) is stored; the page is done, not failed."""
    import threading

    def output(response: Any) -> Any:
        yield {"sku": threading.Lock(), "name": "key is an object"}
        yield {"sku": "AFTER-1", "name": "yielded after the bad one"}

    crawler = await run_crawl(PagesSpider, crawl_settings(crawl_database, **KEYS), url=site.url,
                              paths=pages(site, 1), make_output=output)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert [r.natural_key for r in stored_records(crawl_database)] == ['["AFTER-1"]']
    assert frontier_counts(crawl_database) == {"done": 1}
    assert stats.get("idempotent/records/rejected") == 1
    (item_type, reason), = [(r.item_type, r.reason) for r in stored_rejects(crawl_database)]
    assert item_type == "dict" and "'sku'" in reason and "lock" in reason, reason


@deferred_f_from_coro_f
async def test_text_with_a_lone_surrogate_is_stored_or_rejected_never_a_store_error(
    site: LocalSite, crawl_database: str
) -> None:
    """JSON APIs can send ``"\\ud800"`` (a lone UTF-16 surrogate), which ``json.loads`` turns
    into a str that has no UTF-8 form. Such an item must not take the crawl down."""
    site.add_json("/api/1", {"sku": "SUR-1", "name": "bad \ud800 text"})
    site.add_json("/api/2", {"sku": "bad-key-\udfff", "name": "surrogate in the key"})
    site.add_json("/api/3", {"sku": "PLAIN-3", "name": "fine"})

    def output(response: Any) -> Any:
        yield json.loads(response.text)

    crawler = await run_crawl(PagesSpider, crawl_settings(crawl_database, **KEYS), url=site.url,
                              paths=["/api/1", "/api/2", "/api/3"], make_output=output)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished", stats.get("idempotent/error")
    assert frontier_counts(crawl_database) == {"done": 3}
    stored = {loads(r.data)["sku"]: loads(r.data) for r in stored_records(crawl_database)}
    rejected = [r.reason for r in stored_rejects(crawl_database)]
    assert "PLAIN-3" in stored
    # each surrogate item is either stored faithfully or kept in the rejects table
    assert len(stored) + len(rejected) == 3
    if "SUR-1" in stored:
        assert stored["SUR-1"]["name"] == "bad \ud800 text"
