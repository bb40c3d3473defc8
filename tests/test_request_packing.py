"""A frontier row's request packed (:mod:`scrapy_idempotent.store.packing`): raw deflate
with a preset dictionary of the codec's fixed fragments and the row's URL. Packing gives back
exactly the text packed, for every shape of request; bytes that are not a whole packed
request of its row (truncated, unpacked beside another URL or with another dictionary, an
unknown format) are refused with an error naming the row, never read as other text. On
SQLite the packed request is a BLOB in the row's ``data`` column, rows of the schema before
(text) read as they are."""

from __future__ import annotations

import base64
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import scrapy
from scrapy.http import JsonRequest
from scrapy.http.request.form import FormRequest

from scrapy_idempotent.codec import RequestCodec
from scrapy_idempotent.store import (
    Completion,
    NewRequest,
    RequestState,
    SQLiteStore,
    UnitOfWork,
    packing,
)
from scrapy_idempotent.store.packing import PackedRequestError, pack, unpack
from scrapy_idempotent.store.rules import stored_request_data

URL = "https://shop7.example.com/product/12345-widget-30.html"
#: the benchmark's request (benchmarks/depth.py), as the PostgreSQL row stores it
LINK = ('{"callback":"parse","headers":{"Referer":["https://shop7.example.com/category/345'
        '?page=25"]},"meta":{"depth":2}}')


class Spider(scrapy.Spider):
    name = "packing"

    def parse(self, response: Any) -> None:
        pass

    def parse_item(self, response: Any) -> None:
        pass

    def failed(self, failure: Any) -> None:
        pass


def _encoded() -> list[tuple[str, str]]:
    """(url, the codec's JSON text) of requests of many shapes."""
    spider = Spider()
    codec = RequestCodec(spider)
    body = base64.b64encode(os.urandom(6000))
    requests = [
        scrapy.Request(URL, callback=spider.parse),  # no Referer, nothing else
        scrapy.Request(URL, callback=spider.parse, meta={"depth": 2},
                       headers={"Referer": "https://shop7.example.com/category/345?page=25"}),
        scrapy.Request("https://books.toscrape.com/catalogue/a-light-in-the-attic_1000/"
                       "index.html", callback=spider.parse_item, meta={"depth": 1},
                       headers={"Referer": "https://books.toscrape.com/"}),
        # non-ASCII: in the URL (percent-encoded), the meta, a header of bytes
        scrapy.Request("https://bücher.example/straße/ü?q=é", callback=spider.parse,
                       errback=spider.failed, meta={"title": "Grüße, 東京 🚀", "depth": 3},
                       headers={"X-Name": "naïve".encode()}, cookies={"café": "crème"}),
        scrapy.Request(URL, method="PUT", body=body, priority=5, dont_filter=True),
        scrapy.Request(URL, method="POST", body=os.urandom(3000)),  # incompressible
        FormRequest("https://shop.example/login", formdata={"user": "ü", "p": "x" * 500},
                    callback=spider.parse),
        JsonRequest("https://shop.example/api", data={"a": [1, 2, {"b": "東京"}]},
                    callback=spider.parse),
        scrapy.Request("http://shop.example/a", callback=spider.parse,
                       meta={"redirect_urls": ["http://shop.example/b"], "redirect_times": 1,
                             "download_slot": "shop.example", "depth": 9}),
    ]
    return [(r.url, codec.encode(r)) for r in requests]


def _texts() -> list[tuple[str, str]]:
    """(row URL, stored text): the codec's, whole (SQLite) and as PostgreSQL's row stores
    it, and texts of other forms (the URL not first, other spacing, rows of earlier
    releases, not JSON, empty)."""
    texts: list[tuple[str, str]] = []
    for url, text in _encoded():
        texts += [(url, text), (url, stored_request_data(text, url)), (URL, text)]
    texts += [(URL, text) for text in (
        LINK, "{}", " {}", "", " ", "\x00", "{" * 40, json.dumps({"k": "v" * 40000}),
        '{"callback":"parse","url":"https://shop7.example.com/product/12345-widget-30.html"}',
        '{"url": "https://shop7.example.com/product/12345-widget-30.html"}',
        '{"url":"https://shop.example/b","callback":"parse"}', "東京" * 50)]
    return [*texts, ("", LINK), ("https://ü.example/" + "x" * 3000, LINK)]


@pytest.mark.parametrize(("url", "text"), _texts())
def test_a_packed_request_unpacks_to_exactly_the_text_packed(url: str, text: str) -> None:
    packed = pack(text, url)
    if packed is None:  # not smaller: the row keeps its text
        assert len(text.encode()) < 10
        return
    assert len(packed) < len(text.encode())
    assert packed[0] == packing.FORMAT < 0x20
    assert unpack(packed, url, "k1") == text
    assert unpack(memoryview(packed), url) == text  # (as a driver may give it)


def test_the_benchmarks_request_packs_to_less_than_half() -> None:
    assert len(LINK) == 112
    packed = pack(LINK, URL)
    assert packed is not None and len(packed) <= 40
    whole = '{"url":' + json.dumps(URL) + "," + LINK[1:]  # (SQLite: the URL in the text)
    assert len(pack(whole, URL) or b"") <= 48


def test_texts_not_smaller_packed_are_not_packed() -> None:
    assert pack("{}", URL) is None
    assert pack("", URL) is None
    assert pack('{"a":1}', URL) is None


def test_truncated_bytes_are_refused_naming_the_row() -> None:
    packed = pack(LINK, URL)
    assert packed is not None
    for end in range(len(packed)):
        with pytest.raises(PackedRequestError, match="frontier row k7"):
            unpack(packed[:end], URL, "k7")
    with pytest.raises(PackedRequestError, match=r"frontier row k7.*bytes after its end"):
        unpack(packed + b"\x00", URL, "k7")


def test_another_dictionary_is_refused_not_read_as_other_text(
        monkeypatch: pytest.MonkeyPatch) -> None:
    packed = pack(LINK, URL)
    assert packed is not None
    # the row's URL changed without its request: the dictionary's tail differs
    with pytest.raises(PackedRequestError, match="frontier row k2 unpacks to other text"):
        unpack(packed, URL.replace("shop7", "shop8"), "k2")
    # a dictionary changed after its release
    changed = packing.DICTIONARIES[packing.FORMAT].replace(b"Referer", b"Referrr")
    monkeypatch.setitem(packing.DICTIONARIES, packing.FORMAT, changed)
    with pytest.raises(PackedRequestError, match="frontier row k2"):
        unpack(packed, URL, "k2")


def test_an_unknown_format_is_refused_naming_the_row() -> None:
    packed = pack(LINK, URL)
    assert packed is not None
    with pytest.raises(PackedRequestError, match=r"row k3 is not a packed request this release"
                       r" reads \(format byte 1f"):
        unpack(b"\x1f" + packed[1:], URL, "k3")
    with pytest.raises(PackedRequestError, match="format byte missing"):
        unpack(b"", URL, "k3")


def test_the_released_dictionary_is_unchanged() -> None:
    """Rows packed with format 1 are read with this dictionary for as long as they live:
    it never changes (a new one is a new format)."""
    import hashlib

    assert sorted(packing.DICTIONARIES) == [1]
    assert hashlib.sha256(packing.DICTIONARIES[1]).hexdigest() == (
        "0b6f0ea2c5e03c4cd6efaeffb2b7ccd09d7674856b4debe1447531642b720231")


# -- SQLite: a BLOB in the data column --------------------------------------------------------


def _rows(path: Path) -> dict[str, tuple[str, Any]]:
    with sqlite3.connect(path) as conn:
        return {key: (typeof, data) for key, typeof, data in conn.execute(
            "SELECT key, typeof(data), data FROM requests")}


def _store(path: Path, **options: Any) -> SQLiteStore:
    store = SQLiteStore(str(path), **options)
    store.open(fingerprinter="f")
    return store


def test_sqlite_rows_store_their_request_packed_and_give_it_back(tmp_path: Path) -> None:
    """Inserted packed where smaller (a BLOB), else text; claims and entries give each back
    exactly; a continuation (its row's URL not known there) stores text."""
    path = tmp_path / "f.sqlite3"
    store = _store(path)
    try:
        store.begin_session("w", "auto")
        given = {f"k{n}": (url, text) for n, (url, text) in enumerate(_encoded())}
        given["short"] = (URL, "{}")
        store.commit(UnitOfWork(requests=[
            NewRequest(key=key, fingerprint=key, url=url, priority=0, data=text)
            for key, (url, text) in given.items()]), "w")
        rows = _rows(path)
        assert rows["short"] == ("text", "{}")
        assert rows["k1"][0] == "blob" and len(rows["k1"][1]) < len(given["k1"][1]) / 2
        assert unpack(rows["k1"][1], URL, "k1") == given["k1"][1]
        assert {e.key: e.data for e in store.entries()} == {k: t for k, (_, t) in given.items()}
        leased = store.commit(UnitOfWork(claim=len(given)), "w").leased
        assert {r.key: r.data for r in leased} == {k: t for k, (_, t) in given.items()}
        continued = given["k1"][1].replace('"depth":2', '"depth":2,"retry_times":1')
        store.commit(UnitOfWork(completions=[
            Completion("k1", RequestState.PENDING, data=continued)]), "w")
        assert _rows(path)["k1"] == ("text", continued)
        assert store.entry("k1").data == continued  # type: ignore[union-attr]
    finally:
        store.close()


def test_a_damaged_packed_row_is_a_clear_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "f.sqlite3"
    store = _store(path)
    try:
        store.begin_session("w", "auto")
        store.commit(UnitOfWork(requests=[NewRequest(
            key="k1", fingerprint="k1", url=URL, priority=0,
            data='{"url":' + json.dumps(URL) + "," + LINK[1:])]), "w")
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE requests SET data = substr(data, 1, length(data) - 2)")
        with pytest.raises(PackedRequestError, match="frontier row k1 cannot be unpacked"):
            store.entries()
        # a claim hands it out marked, its data empty: the worker fails that one request
        lease, = store.commit(UnitOfWork(claim=1), "w").leased
        assert (lease.key, lease.data) == ("k1", "")
        assert "frontier row k1 cannot be unpacked" in lease.unreadable
    finally:
        store.close()


def test_a_sqlite_frontier_of_the_schema_before_reads_its_text_rows(tmp_path: Path) -> None:
    """Schema 20 changes nothing in the file: its rows of text stay as they are, read as
    before; the rows written from then on are packed."""
    from scrapy_idempotent.store.sqlite import SCHEMA_VERSION

    path = tmp_path / "f.sqlite3"
    old = '{"url":' + json.dumps(URL) + "," + LINK[1:]
    store = _store(path)
    store.begin_session("w", "auto")
    store.commit(UnitOfWork(requests=[NewRequest(
        key="old", fingerprint="old", url=URL, priority=0, data=old)]), "w")
    store.close()
    with sqlite3.connect(path) as conn:  # as schema 19 left it: its row of text
        conn.execute("UPDATE requests SET data = ?", (old,))
        conn.execute("ALTER TABLE runs DROP COLUMN observed_at")  # (schema 21's)
        conn.execute("PRAGMA user_version = 19")
    store = _store(path)
    try:
        with sqlite3.connect(path) as conn:
            assert conn.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
        assert _rows(path) == {"old": ("text", old)}
        store.begin_session("w", "auto")
        store.commit(UnitOfWork(requests=[NewRequest(
            key="new", fingerprint="new", url=URL, priority=0, data=old)]), "w")
        assert _rows(path)["new"][0] == "blob"
        leased = store.commit(UnitOfWork(claim=2), "w").leased
        assert {r.key: r.data for r in leased} == {"old": old, "new": old}
    finally:
        store.close()
