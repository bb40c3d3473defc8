"""Hardening: bad items, bad database files, bad neighbours, no code from the database.

Every test runs the real thing: crawls through Scrapy's engine against a tiny local site
(``hardening_site.LocalSite``), real SQLite files, real processes for the neighbours. Each one
checks that nothing committed is lost and that the message tells the operator what happened
and what to do.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import hashlib
import json
import logging
import os
import re
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import scrapy
from hardening_site import LocalSite
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, db_rows, frontier_counts, run_crawl
from scrapy_idempotent.codec import loads

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "scrapy_idempotent"
EXAMPLE_PROJECT = ROOT / "example_project"


@pytest.fixture
def site() -> Iterator[LocalSite]:
    with LocalSite() as local:
        yield local


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


class PagesSpider(scrapy.Spider):
    """Fetches the given paths; each page's output is ``make_output(response)``."""

    name = "hardening"

    def __init__(self, url: str, paths: list[str],
                 make_output: Callable[[Any], Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base_url = url
        self.paths = paths
        self.make_output = make_output

    async def start(self) -> Any:
        for path in self.paths:
            yield scrapy.Request(self.base_url + path, dont_filter=True)

    def parse(self, response: Any) -> Any:
        if self.make_output is not None:
            yield from self.make_output(response)


class CatalogueSpider(scrapy.Spider):
    """``/list`` -> every ``/item/<i>`` -> one dict item ``{"sku", "name", "text"}``."""

    name = "catalogue"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base_url = url

    async def start(self) -> Any:
        yield scrapy.Request(f"{self.base_url}/list", dont_filter=True)

    def parse(self, response: Any) -> Any:
        yield from response.follow_all(css="a.item", callback=self.parse_item)

    def parse_item(self, response: Any) -> Any:
        yield {
            "sku": response.css("span.sku::text").get(),
            "name": response.css("h1::text").get(),
            "text": response.css("p.text::text").get(),
        }


def pages(site: LocalSite, count: int) -> list[str]:
    paths = [f"/page/{i}" for i in range(1, count + 1)]
    for path in paths:
        site.add(path, f"<html><body>{path}</body></html>")
    return paths


def request_keys(db_path: Path) -> dict[str, str]:
    """URL path -> frontier key."""
    return {urlsplit(url).path: key
            for url, key in db_rows(db_path, "SELECT url, key FROM requests")}


def package_messages(caplog: Any, level: int = logging.DEBUG, *,
                     tracebacks: bool = False) -> list[str]:
    """Messages of the package's own loggers (``scrapy_idempotent...``), optionally with the
    text of the traceback logged with them."""
    formatter = logging.Formatter()
    return [r.getMessage() + (("\n" + formatter.formatException(r.exc_info))
                              if tracebacks and r.exc_info else "")
            for r in caplog.records
            if r.name.startswith("scrapy_idempotent") and r.levelno >= level]


def all_messages(caplog: Any, level: int = logging.DEBUG) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# == bad items ================================================================================


@deferred_f_from_coro_f
async def test_item_without_its_natural_key_is_rejected_and_the_crawl_goes_on(
    site: LocalSite, db_path: Path, caplog: Any
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

    crawler = await run_crawl(PagesSpider, crawl_settings(db_path, **KEYS), url=site.url,
                              paths=pages(site, 2), make_output=output)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/records/rejected"] == 4
    assert stats["item_dropped_count"] == 4
    assert stats["idempotent/records/inserted"] == 2  # the good items of both pages
    assert frontier_counts(db_path) == {"done": 2}
    keys = request_keys(db_path)
    rejects = db_rows(db_path, "SELECT item_type, reason, request_key, data FROM rejects"
                               " ORDER BY id")
    assert len(rejects) == 4
    for (item_type, reason, request_key, data), name in zip(rejects, bad, strict=True):
        assert item_type == PRODUCT
        assert PRODUCT in reason and "'sku'" in reason, reason
        assert request_key == keys["/page/1"]
        assert loads(data)["name"] == bad[name]["name"]  # the item is kept, readable
    dropped = [m for m in all_messages(caplog, logging.WARNING) if "Dropped" in m]
    assert len(dropped) == 4
    for message in dropped:
        assert "Product" in message and "'sku'" in message and "rejects table" in message


@deferred_f_from_coro_f
async def test_natural_key_int_string_and_padded_string_are_one_record(
    site: LocalSite, db_path: Path
) -> None:
    values = {"/page/1": 123, "/page/2": "123", "/page/3": " 123 "}

    def output(response: Any) -> Any:
        yield Offer(sku=values[urlsplit(response.url).path], price="9.99")

    crawler = await run_crawl(PagesSpider, crawl_settings(db_path, **KEYS), url=site.url,
                              paths=pages(site, 3), make_output=output)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/records/inserted"] == 1
    rows = db_rows(db_path, "SELECT natural_key, item_type FROM records")
    assert rows == [('["123"]', f"{__name__}.Offer")]
    assert frontier_counts(db_path) == {"done": 3}


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
    site: LocalSite, db_path: Path
) -> None:
    def output(response: Any) -> Any:
        yield {"sku": "RICH-1", **NOT_PLAIN_JSON}
        yield Product(sku="RICH-2", name="nested", extra=dict(NOT_PLAIN_JSON))

    crawler = await run_crawl(PagesSpider, crawl_settings(db_path, **KEYS), url=site.url,
                              paths=pages(site, 1), make_output=output)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert crawler.stats.get_value("idempotent/records/inserted") == 2
    stored = {loads(data)["sku"]: loads(data) for (data,) in
              db_rows(db_path, "SELECT data FROM records")}
    first = stored["RICH-1"]
    assert first == {"sku": "RICH-1", **plain(NOT_PLAIN_JSON)}
    for name, value in plain(NOT_PLAIN_JSON).items():  # same types too, not only equal
        assert type(first[name]) is type(value), name
    assert first["when"].utcoffset() == datetime.timedelta(hours=5, minutes=30)
    assert str(first["price"]) == "19.990"
    assert stored["RICH-2"] == {"sku": "RICH-2", "name": "nested",
                                "extra": plain(NOT_PLAIN_JSON)}


@deferred_f_from_coro_f
async def test_very_large_item_is_stored(site: LocalSite, db_path: Path) -> None:
    text = "0123456789abcdef" * (5 * 1024 * 1024 // 16)  # 5 MiB

    def output(response: Any) -> Any:
        yield {"sku": "BIG-1", "text": text, "blob": text.encode("ascii")}
        yield {"sku": "SMALL-1", "text": "small"}

    crawler = await run_crawl(PagesSpider, crawl_settings(db_path, **KEYS), url=site.url,
                              paths=pages(site, 1), make_output=output)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert crawler.stats.get_value("idempotent/records/inserted") == 2
    (data,), = db_rows(db_path, "SELECT data FROM records WHERE natural_key = '[\"BIG-1\"]'")
    record = loads(data)
    assert record["text"] == text
    assert record["blob"] == text.encode("ascii")
    assert frontier_counts(db_path) == {"done": 1}


@deferred_f_from_coro_f
async def test_item_with_a_value_that_cannot_be_stored_is_rejected_not_a_crash(
    site: LocalSite, db_path: Path, tmp_path: Path, caplog: Any
) -> None:
    handle = (tmp_path / "open.txt").open("w")

    def output(response: Any) -> Any:
        yield {"sku": "FILE-1", "attachment": {"files": [handle]}}
        yield {"sku": "GOOD-1"}

    try:
        crawler = await run_crawl(PagesSpider, crawl_settings(db_path, **KEYS), url=site.url,
                                  paths=pages(site, 1), make_output=output)
    finally:
        handle.close()
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/records/rejected"] == 1
    assert stats["idempotent/records/inserted"] == 1
    (item_type, reason, request_key), = db_rows(
        db_path, "SELECT item_type, reason, request_key FROM rejects")
    assert item_type == "dict"
    assert "['attachment']['files'][0]" in reason and "TextIOWrapper" in reason, reason
    assert request_key == request_keys(db_path)["/page/1"]
    dropped = [m for m in all_messages(caplog, logging.WARNING) if "Dropped" in m]
    assert len(dropped) == 1 and "TextIOWrapper" in dropped[0] and "rejects table" in dropped[0]
    assert frontier_counts(db_path) == {"done": 1}


@deferred_f_from_coro_f
async def test_item_whose_natural_key_value_cannot_be_stored_is_rejected_and_the_page_kept(
    site: LocalSite, db_path: Path, caplog: Any
) -> None:
    """A key field holding an object with no data form (here a lock: a parser handed back the
    wrong thing) is a bad item like a missing key: rejected, and the rest of the page's output
    (the good item after it) is stored; the page is done, not failed."""
    import threading

    def output(response: Any) -> Any:
        yield {"sku": threading.Lock(), "name": "key is an object"}
        yield {"sku": "AFTER-1", "name": "yielded after the bad one"}

    crawler = await run_crawl(PagesSpider, crawl_settings(db_path, **KEYS), url=site.url,
                              paths=pages(site, 1), make_output=output)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert db_rows(db_path, "SELECT natural_key FROM records") == [('["AFTER-1"]',)]
    assert frontier_counts(db_path) == {"done": 1}
    assert stats.get("idempotent/records/rejected") == 1
    (item_type, reason), = db_rows(db_path, "SELECT item_type, reason FROM rejects")
    assert item_type == "dict" and "'sku'" in reason and "lock" in reason, reason


@deferred_f_from_coro_f
async def test_text_with_a_lone_surrogate_is_stored_or_rejected_never_a_store_error(
    site: LocalSite, db_path: Path
) -> None:
    """JSON APIs can send ``"\\ud800"`` (a lone UTF-16 surrogate), which ``json.loads`` turns
    into a str that has no UTF-8 form. Such an item must not take the crawl down."""
    site.add_json("/api/1", {"sku": "SUR-1", "name": "bad \ud800 text"})
    site.add_json("/api/2", {"sku": "bad-key-\udfff", "name": "surrogate in the key"})
    site.add_json("/api/3", {"sku": "PLAIN-3", "name": "fine"})

    def output(response: Any) -> Any:
        yield json.loads(response.text)

    crawler = await run_crawl(PagesSpider, crawl_settings(db_path, **KEYS), url=site.url,
                              paths=["/api/1", "/api/2", "/api/3"], make_output=output)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished", stats.get("idempotent/error")
    assert frontier_counts(db_path) == {"done": 3}
    stored = {loads(d)["sku"]: loads(d) for (d,) in db_rows(db_path, "SELECT data FROM records")}
    rejected = db_rows(db_path, "SELECT reason FROM rejects")
    assert "PLAIN-3" in stored
    # each surrogate item is either stored faithfully or kept in the rejects table
    assert len(stored) + len(rejected) == 3
    if "SUR-1" in stored:
        assert stored["SUR-1"]["name"] == "bad \ud800 text"


# == bad database files =======================================================================


@deferred_f_from_coro_f
async def test_missing_directories_of_the_database_are_created(
    site: LocalSite, tmp_path: Path
) -> None:
    db = tmp_path / "not" / "there" / "yet" / "{spider}.sqlite3"
    crawler = await run_crawl(PagesSpider, crawl_settings(db, **KEYS), url=site.url,
                              paths=pages(site, 2),
                              make_output=lambda r: [{"sku": r.url}])
    created = tmp_path / "not" / "there" / "yet" / "hardening.sqlite3"
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert created.is_file()
    assert frontier_counts(created) == {"done": 2}
    assert len(db_rows(created, "SELECT * FROM records")) == 2


def _crawl_shop(site_url: str, database: Path, *settings: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"url={site_url}",
               "-s", f"IDEMPOTENT_DATABASE={database}", "-s", "LOG_LEVEL=INFO"]
    for setting in settings:
        command += ["-s", setting]
    return subprocess.Popen(command, cwd=EXAMPLE_PROJECT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_unwritable_database_path_stops_scrapy_crawl_before_any_request(
    site: LocalSite, tmp_path: Path
) -> None:
    """What a real ``scrapy crawl`` does when the database cannot be created: a directory in
    the path is a regular file (root ignores permission bits, so chmod would prove nothing),
    or a directory sits where the file should be. Both crawls run at once."""
    (tmp_path / "afile").write_text("a regular file, not a directory\n")
    under_a_file = tmp_path / "afile" / "db.sqlite3"
    (tmp_path / "adir.sqlite3").mkdir()
    a_directory = tmp_path / "adir.sqlite3"
    why = {under_a_file: r"(?i)not a directory|file exists|is a file",
           a_directory: r"(?i)is a directory"}
    crawls = {path: _crawl_shop(site.url, path) for path in (under_a_file, a_directory)}
    outputs = {path: proc.communicate(timeout=120)[0] for path, proc in crawls.items()}
    assert site.request_count == 0
    assert (tmp_path / "afile").read_text() == "a regular file, not a directory\n"
    assert os.listdir(a_directory) == []
    for path, proc in crawls.items():
        output = outputs[path]
        assert proc.returncode != 0, output
        errors = "\n".join(line for line in output.splitlines()
                           if "ERROR" in line or "Error:" in line)
        assert str(path) in errors, output
        # the error says why, and which setting to change
        assert re.search(why[path], errors), errors
        assert "IDEMPOTENT_DATABASE" in errors, errors
        # no follow-up noise from closing a frontier that was never opened
        assert "error while closing the frontier" not in output, output
        assert "Crawled (" not in output


def _corrupt(path: Path) -> None:
    import random

    path.write_bytes(random.Random(8).randbytes(16384))


def _newer(path: Path) -> None:
    """A database of a later scrapy_idempotent (its application id, a later schema)."""
    from scrapy_idempotent.store.sqlite import APPLICATION_ID

    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE future (x)")
    conn.execute("PRAGMA user_version = 99")
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.commit()
    conn.close()


def _sqlite_file(*statements: str) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        conn = sqlite3.connect(path)
        for statement in statements:
            conn.execute(statement)
        conn.commit()
        conn.close()
    return make


#: Databases of other applications: refused before anything in them changes (no WAL switch,
#: no table, no user_version), with a message that says so and names the setting.
_FOREIGN = "not a scrapy_idempotent database"


@pytest.mark.parametrize(("make", "hint"), [
    pytest.param(_corrupt, "IDEMPOTENT_DATABASE", id="random-bytes"),
    pytest.param(_newer, "upgrade", id="schema-99"),
    pytest.param(_sqlite_file("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)",
                              "INSERT INTO users VALUES (1, 'ann')"), _FOREIGN,
                 id="users-table-version-0"),
    pytest.param(_sqlite_file("CREATE TABLE records (x)"), _FOREIGN, id="records-table"),
    pytest.param(_sqlite_file("PRAGMA user_version = 7"), _FOREIGN, id="empty-version-7"),
    pytest.param(_sqlite_file(
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        "CREATE TABLE users (id INTEGER)", "PRAGMA user_version = 1"), _FOREIGN,
        id="version-1-with-a-foreign-table"),
])
@deferred_f_from_coro_f
async def test_corrupt_or_newer_database_stops_the_crawl_and_is_left_untouched(
    site: LocalSite, db_path: Path, caplog: Any, make: Callable[[Path], None], hint: str
) -> None:
    make(db_path)
    before = file_digest(db_path)
    names = sorted(os.listdir(db_path.parent))
    from scrapy_idempotent.exceptions import StoreError

    with pytest.raises(StoreError) as caught:
        await run_crawl(PagesSpider, crawl_settings(db_path, **KEYS), url=site.url,
                        paths=pages(site, 2), make_output=lambda r: [{"sku": r.url}])
    assert file_digest(db_path) == before  # no WAL switch, no table, no user_version
    assert sorted(os.listdir(db_path.parent)) == names  # no -wal/-shm/-journal either
    assert site.request_count == 0
    message = str(caught.value)
    assert str(db_path) in message
    assert hint in message, message
    assert not [m for m in package_messages(caplog, logging.ERROR)
                if "error while closing" in m]


@deferred_f_from_coro_f
async def test_database_at_schema_version_0_is_migrated_forward(
    site: LocalSite, db_path: Path
) -> None:
    """Version 0 is what an empty file is; the only migration step (0 -> 1) runs on it."""
    from scrapy_idempotent.store.sqlite import SCHEMA_VERSION

    db_path.write_bytes(b"")
    assert db_rows(db_path, "PRAGMA user_version") == [(0,)]
    crawler = await run_crawl(PagesSpider, crawl_settings(db_path, **KEYS), url=site.url,
                              paths=pages(site, 3), make_output=lambda r: [{"sku": r.url}])
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert db_rows(db_path, "PRAGMA user_version") == [(SCHEMA_VERSION,)]
    assert db_rows(db_path, "PRAGMA integrity_check") == [("ok",)]
    assert frontier_counts(db_path) == {"done": 3}
    assert len(db_rows(db_path, "SELECT * FROM records")) == 3
    tables = {name for (name,) in db_rows(db_path,
                                           "SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"meta", "runs", "sessions", "requests", "records", "responses",
            "rejects"} <= tables


@deferred_f_from_coro_f
async def test_new_database_files_are_private_to_their_owner(
    site: LocalSite, tmp_path: Path
) -> None:
    db = tmp_path / "private" / "frontier.sqlite3"
    old_umask = os.umask(0o002)  # a permissive umask: group and others could read
    try:
        crawler = await run_crawl(PagesSpider, crawl_settings(db, **KEYS), url=site.url,
                                  paths=pages(site, 1), make_output=lambda r: [{"sku": "P"}])
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in db.parent.iterdir()}
    finally:
        os.umask(old_umask)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert modes["frontier.sqlite3"] == 0o600
    for name, mode in modes.items():  # -wal and -shm hold the same data
        assert mode & 0o077 == 0, (name, oct(mode))


def _records_by_sku(db_path: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for data, request_key in db_rows(db_path, "SELECT data, request_key FROM records"):
        found.setdefault(loads(data)["sku"], []).append(request_key)
    return found


def _assert_done_means_stored(db_path: Path, count: int) -> None:
    """Done is the last write: each done item page has its record, the done listing has all
    its children, and every record belongs to a done request."""
    rows = db_rows(db_path, "SELECT key, url, state FROM requests")
    state_of = {key: state for key, _, state in rows}
    records = _records_by_sku(db_path)
    for key, url, state in rows:
        path = urlsplit(url).path
        if state == "done" and path.startswith("/item/"):
            assert records.get(f"S-{path.rsplit('/', 1)[1]}") == [key], path
        if state == "done" and path == "/list":
            assert len(rows) == count + 1
    for sku, keys in records.items():
        assert len(keys) == 1 and state_of.get(keys[0]) == "done", sku


@deferred_f_from_coro_f
async def test_disk_full_during_commits_closes_cleanly_and_the_next_crawl_completes(
    site: LocalSite, db_path: Path, monkeypatch: Any, caplog: Any
) -> None:
    """SQLITE_FULL, simulated with ``PRAGMA max_page_count`` on every connection the store
    opens: the database stops growing part-way through the crawl."""
    count = 60
    site.add_catalogue(count, filler=3000)
    settings = crawl_settings(db_path, IDEMPOTENT_NATURAL_KEYS={"dict": "sku"},
                              CONCURRENT_REQUESTS=4)
    real_connect = sqlite3.connect

    def connect_with_a_small_disk(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = real_connect(*args, **kwargs)
        if os.fspath(args[0]) == os.fspath(db_path):
            conn.execute("PRAGMA max_page_count = 60")  # 240 KiB: about half the catalogue
        return conn

    with monkeypatch.context() as patched:
        patched.setattr(sqlite3, "connect", connect_with_a_small_disk)
        full = await run_crawl(CatalogueSpider, settings, url=site.url)
    stats = full.stats.get_stats()
    assert stats["finish_reason"] == "idempotent_store_error"
    store_error = stats["idempotent/error"]
    assert db_rows(db_path, "PRAGMA integrity_check") == [("ok",)]
    done_paths = {urlsplit(url).path for (url,) in
                  db_rows(db_path, "SELECT url FROM requests WHERE state = 'done'")}
    assert 1 <= len(done_paths) < count + 1, frontier_counts(db_path)
    _assert_done_means_stored(db_path, count)
    errors = package_messages(caplog, logging.ERROR)
    inserted_before = stats.get("idempotent/records/inserted", 0)

    site.counts.clear()
    resumed = await run_crawl(CatalogueSpider, settings, url=site.url)
    stats = resumed.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert frontier_counts(db_path) == {"done": count + 1}
    records = _records_by_sku(db_path)
    assert sorted(records) == sorted(f"S-{i}" for i in range(1, count + 1))
    assert inserted_before + stats.get("idempotent/records/inserted", 0) == count
    assert "idempotent/records/updated" not in stats
    _assert_done_means_stored(db_path, count)
    # only what was not done is leased again (fetched, or replayed from the journal)
    assert stats["idempotent/requests/leased"] == count + 1 - len(done_paths)
    assert not [path for path in done_paths if site.count(path)]
    # the messages name the real cause, and tell the operator what to do
    assert "full" in store_error, store_error
    assert any("full" in m and re.search(r"(?i)resum|again", m) for m in errors), errors


#: A neighbour process: waits until the crawl has done ``min_done`` requests, then holds the
#: database's write lock (``BEGIN IMMEDIATE``) for ``hold`` seconds.
LOCKER = r"""
import sqlite3, sys, time
path, min_done, hold = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.time() + 60
conn = sqlite3.connect(path, isolation_level=None, timeout=0.01)
while min_done > 0 and time.time() < deadline:
    try:
        conn = sqlite3.connect(path, isolation_level=None, timeout=0.01)
        done = conn.execute("SELECT count(*) FROM requests WHERE state = 'done'").fetchone()[0]
        if done >= min_done:
            break
    except sqlite3.Error:
        pass
    time.sleep(0.01)
conn.execute("BEGIN IMMEDIATE")
print("locked", time.time(), flush=True)
time.sleep(hold)
conn.execute("ROLLBACK")
print("released", time.time(), flush=True)
"""


async def _crawl_while_locked(db_path: Path, site: LocalSite, settings: dict[str, Any],
                              hold_seconds: float) -> tuple[Any, dict[str, int]]:
    """Crawl the catalogue while a neighbour takes the write lock after 5 pages for
    ``hold_seconds``; returns the crawler and the frontier once the neighbour is gone."""
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(db_path), "5",
                               str(hold_seconds)], stdout=subprocess.PIPE, text=True)
    try:
        crawler = await run_crawl(CatalogueSpider, settings, url=site.url)
    finally:
        locker_output, _ = locker.communicate(timeout=60)
    assert "locked" in locker_output and "released" in locker_output
    assert db_rows(db_path, "PRAGMA integrity_check") == [("ok",)]
    return crawler, frontier_counts(db_path)


def _assert_catalogue_once(db_path: Path, site: LocalSite, count: int) -> None:
    assert frontier_counts(db_path) == {"done": count + 1}
    assert sorted(_records_by_sku(db_path)) == sorted(f"S-{i}" for i in range(1, count + 1))
    _assert_done_means_stored(db_path, count)
    assert max(site.counts.values()) <= 2


@deferred_f_from_coro_f
async def test_neighbour_holding_the_write_lock_briefly_is_waited_for(
    db_path: Path, caplog: Any
) -> None:
    """Another process holds the write lock for 0.5 s; IDEMPOTENT_BUSY_TIMEOUT_SECONDS is 0.2
    (five attempts and back-off: about 1.75 s of patience). The crawl waits, says so in the
    log, and finishes with every record once."""
    count = 30
    with LocalSite(delay_seconds=0.02) as site:
        site.add_catalogue(count)
        settings = crawl_settings(db_path, IDEMPOTENT_NATURAL_KEYS={"dict": "sku"},
                                  IDEMPOTENT_BUSY_TIMEOUT_SECONDS=0.2, CONCURRENT_REQUESTS=4)
        crawler, _ = await _crawl_while_locked(db_path, site, settings, 0.5)
        assert crawler.stats.get_value("finish_reason") == "finished"
        _assert_catalogue_once(db_path, site, count)
    warnings = package_messages(caplog, logging.WARNING)
    assert any("busy" in m or "locked" in m for m in warnings), warnings


@deferred_f_from_coro_f
async def test_neighbour_holding_the_write_lock_too_long_closes_and_next_crawl_completes(
    db_path: Path, caplog: Any
) -> None:
    """The lock is held for 2.5 s while IDEMPOTENT_BUSY_TIMEOUT_SECONDS is 0.05 (about 1 s of
    patience): the crawl closes with ``idempotent_store_error`` while the lock is still held
    (so it cannot even release its leases), and the next crawl, here in the same Python
    process as with ``CrawlerRunner``, must complete it without losing a request."""
    count = 30
    with LocalSite(delay_seconds=0.02) as site:
        site.add_catalogue(count)
        settings = crawl_settings(db_path, IDEMPOTENT_NATURAL_KEYS={"dict": "sku"},
                                  IDEMPOTENT_BUSY_TIMEOUT_SECONDS=0.05, CONCURRENT_REQUESTS=4)
        first, after_first = await _crawl_while_locked(db_path, site, settings, 2.5)
        assert first.stats.get_value("finish_reason") == "idempotent_store_error"
        _assert_done_means_stored(db_path, count)
        errors = package_messages(caplog, logging.ERROR)
        second = await run_crawl(CatalogueSpider, settings, url=site.url)
        assert second.stats.get_value("finish_reason") == "finished"
        assert frontier_counts(db_path) == {"done": count + 1}, after_first
        _assert_catalogue_once(db_path, site, count)
    # says what happened and what to do (raise the timeout, or run the crawl again)
    assert any("locked" in m and re.search(
        r"IDEMPOTENT_BUSY_TIMEOUT_SECONDS|(?i:resum|again)", m) for m in errors), errors


@deferred_f_from_coro_f
async def test_neighbour_holding_the_write_lock_when_the_crawl_starts(
    site: LocalSite, db_path: Path
) -> None:
    """The lock is already held (for 1 s) when the crawl opens the database. Writes during the
    crawl would wait 5 x 0.2 s plus back-off (about 1.75 s) before giving up; opening the
    database should be as patient, then start and finish."""
    settings = crawl_settings(db_path, IDEMPOTENT_BUSY_TIMEOUT_SECONDS=0.2, **KEYS)
    earlier = await run_crawl(PagesSpider, settings, url=site.url, paths=pages(site, 1),
                              make_output=lambda r: [{"sku": r.url}])
    assert earlier.stats.get_value("finish_reason") == "finished"
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(db_path), "0", "1"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout is not None
        assert locker.stdout.readline().startswith("locked")
        crawler = await run_crawl(PagesSpider, settings, url=site.url, paths=pages(site, 3),
                                  make_output=lambda r: [{"sku": r.url}])
    finally:
        locker.communicate(timeout=60)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert frontier_counts(db_path) == {"done": 3}
    assert len(db_rows(db_path, "SELECT * FROM records")) == 3


# == security: no code from the database ======================================================


def test_no_module_of_the_package_can_unpickle() -> None:
    """Reading the database must never execute code: no pickle, marshal, shelve (or their
    look-alikes), no eval/exec, anywhere in the package."""
    import ast

    banned_modules = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill",
                      "cloudpickle", "jsonpickle", "copyreg"}
    banned_calls = {"eval", "exec", "__import__"}
    found: list[str] = []
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) >= 10
    for module in modules:
        tree = ast.parse(module.read_text(), filename=str(module))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in banned_calls):
                found.append(f"{module.name}:{node.lineno}: {node.func.id}()")
            for name in names:
                if name.split(".")[0] in banned_modules:
                    found.append(f"{module.name}:{getattr(node, 'lineno', 0)}: import {name}")
    assert found == []
    for module in modules:  # nor through importlib with a literal name
        text = module.read_text()
        assert not re.search(r"""import_module\(\s*["'](pickle|marshal|shelve)""", text)


def _stored_request(db_path: Path, url: str, **changes: Any) -> dict[str, Any]:
    """The data of a real stored request, re-aimed at ``url`` and changed by ``changes``."""
    (data,), = db_rows(db_path, "SELECT data FROM requests LIMIT 1")
    value = json.loads(data)
    value["url"] = url
    value.update(changes)
    return value


def _insert_pending(db_path: Path, key: str, url: str, data: dict[str, Any],
                    attempts: int = 0) -> None:
    conn = sqlite3.connect(db_path)
    try:
        run_id = conn.execute("SELECT max(run_id) FROM runs").fetchone()[0]
        conn.execute(
            "INSERT INTO requests (key, fingerprint, url, priority, state, data, attempts,"
            " enqueued_at, run_id) VALUES (?, ?, ?, 0, 'pending', ?, ?, 0, ?)",
            (key, hashlib.sha1(key.encode()).hexdigest(), url, json.dumps(data), attempts,
             run_id))
        conn.commit()
    finally:
        conn.close()


STORED_CODE = {
    "class-os-system": {"_class": "os.system"},
    "class-popen": {"_class": "subprocess.Popen"},
    "class-marker": {"_class": "hardening_marker.EvilRequest"},
    "callback-init": {"callback": "__init__"},
    "callback-class": {"callback": "__class__"},
    "callback-crawler-engine": {"callback": "crawler.engine"},
    "callback-globals": {"callback": "parse.__globals__"},
    "callback-module-function": {"callback": "hardening_marker.touch"},
    "errback-engine-close": {"errback": "crawler.engine.close_spider"},
    "errback-dunder": {"errback": "__reduce_ex__"},
}

#: Callable attributes every spider has that are Scrapy's API, not callbacks: a stored request
#: naming one is data from the database choosing which spider code to run.
STORED_FRAMEWORK_METHODS = {
    "callback-from-crawler": {"callback": "from_crawler"},
    "callback-set-crawler": {"callback": "_set_crawler"},
    "callback-close": {"callback": "close"},
    "callback-update-settings": {"callback": "update_settings"},
    "errback-start": {"errback": "start"},
}


async def _crawl_with_stored_rows(site: LocalSite, db_path: Path, rows: dict[str, Any],
                                  caplog: Any) -> tuple[Any, dict[str, list[Any]]]:
    settings = crawl_settings(db_path, **KEYS)
    site.add("/good", "<html>good</html>")
    first = await run_crawl(PagesSpider, settings, url=site.url, paths=pages(site, 1),
                            make_output=lambda r: [{"sku": r.url}])
    assert first.stats.get_value("finish_reason") == "finished"
    for name, changes in rows.items():
        path = f"/stored/{name}"
        site.add(path, "<html>should never be fetched</html>")
        _insert_pending(db_path, name, site.url + path,
                        _stored_request(db_path, site.url + path, **changes))
    _insert_pending(db_path, "good", site.url + "/good", _stored_request(db_path,
                                                                          site.url + "/good"))
    site.counts.clear()
    sys.modules.pop("hardening_marker", None)
    crawler = await run_crawl(PagesSpider, {**settings, "IDEMPOTENT_RUN_MODE": "resume"},
                              url=site.url, paths=[], make_output=lambda r: [{"sku": r.url}])
    # what the first crawl committed is still there, and the good row added its record
    assert {"/good", "/page/1"} <= {urlsplit(loads(d)["sku"]).path for (d,) in
                                    db_rows(db_path, "SELECT data FROM records")}
    outcome = {key: row for key, *row in db_rows(
        db_path, "SELECT key, state, error_kind, error_message FROM requests")}
    return crawler, outcome


@deferred_f_from_coro_f
async def test_stored_request_naming_code_is_failed_as_unloadable_and_nothing_runs(
    site: LocalSite, db_path: Path, caplog: Any
) -> None:
    crawler, outcome = await _crawl_with_stored_rows(site, db_path, STORED_CODE, caplog)
    assert "hardening_marker" not in sys.modules  # nothing was imported
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert outcome["good"][0] == "done"  # the crawl went on
    assert site.count("/good") == 1
    assert [path for path in site.counts if path.startswith("/stored/")] == []
    for name, changes in STORED_CODE.items():
        state, kind, message = outcome[name]
        assert (state, kind) == ("failed", "unloadable"), (name, outcome[name])
        (value,) = changes.values()
        assert value in message, (name, message)
    assert crawler.stats.get_value("idempotent/requests/unloadable") == len(STORED_CODE)
    logged = package_messages(caplog, logging.ERROR)
    for name in STORED_CODE:
        assert any(f"cannot load stored request {name}" in m for m in logged), name


@deferred_f_from_coro_f
async def test_stored_request_naming_a_spider_framework_method_is_unloadable(
    site: LocalSite, db_path: Path, caplog: Any
) -> None:
    """``from_crawler``, ``_set_crawler``, ``close``, ``update_settings``, ``start`` are
    callable attributes of every spider, and no spider method encoded by the package could
    have stored them as a callback: loading must refuse them instead of calling them with a
    response."""
    crawler, outcome = await _crawl_with_stored_rows(site, db_path, STORED_FRAMEWORK_METHODS,
                                                     caplog)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert outcome["good"][0] == "done"
    spider_errors = [m for m in all_messages(caplog, logging.ERROR) if "Spider error" in m]
    wrong = {name: outcome[name] for name in STORED_FRAMEWORK_METHODS
             if tuple(outcome[name][:2]) != ("failed", "unloadable")}
    assert wrong == {}, (wrong, spider_errors)
    assert [path for path in site.counts if path.startswith("/stored/")] == []


@deferred_f_from_coro_f
async def test_journaled_response_naming_another_class_is_not_loaded(
    site: LocalSite, db_path: Path, caplog: Any
) -> None:
    """A response journaled for a pending request (a replay after a kill) whose ``_class``
    names code outside Scrapy's response classes: not imported; the page is downloaded."""
    settings = crawl_settings(db_path, **KEYS)
    first = await run_crawl(PagesSpider, settings, url=site.url, paths=pages(site, 1),
                            make_output=lambda r: [{"sku": r.url}])
    assert first.stats.get_value("finish_reason") == "finished"
    site.add("/replayed", "<html>the real page</html>")
    url = site.url + "/replayed"
    _insert_pending(db_path, "replayed", url, _stored_request(db_path, url), attempts=1)
    conn = sqlite3.connect(db_path)
    conn.execute("INSERT INTO responses (key, data, body, stored_at) VALUES (?, ?, ?, 0)",
                 ("replayed", json.dumps({"_class": "hardening_marker.EvilResponse",
                                          "url": url, "status": 200, "headers": {},
                                          "flags": []}), b"<html>forged</html>"))
    conn.commit()
    conn.close()
    sys.modules.pop("hardening_marker", None)
    seen: list[str] = []

    def output(response: Any) -> Any:
        seen.append(response.text)
        return []

    crawler = await run_crawl(PagesSpider, {**settings, "IDEMPOTENT_RUN_MODE": "resume"},
                              url=site.url, paths=[], make_output=output)
    assert "hardening_marker" not in sys.modules
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert seen == ["<html>the real page</html>"]
    assert site.count("/replayed") == 1
    assert any("journaled response" in m and "not allowed" in m
               for m in package_messages(caplog, logging.WARNING))


SQL_INJECTION = "'; DROP TABLE records; --"
SQL_INJECTION_2 = "\"); DELETE FROM requests WHERE (\"1\"=\"1"


@deferred_f_from_coro_f
async def test_sql_injection_in_urls_meta_items_and_source_is_stored_as_data(
    site: LocalSite, db_path: Path
) -> None:
    from urllib.parse import quote

    target = f"/q/{quote(SQL_INJECTION, safe='')}?x={quote(SQL_INJECTION_2, safe='')}"
    site.add(target, "<html>injected target</html>")

    class InjectionSpider(PagesSpider):
        def parse(self, response: Any, **cb_kwargs: Any) -> Any:
            if response.url.endswith("/page/1"):
                yield scrapy.Request(self.base_url + target, callback=self.parse,
                                     meta={"note": SQL_INJECTION, SQL_INJECTION_2: [1]},
                                     cb_kwargs={"why": SQL_INJECTION})
            yield {"sku": f"{SQL_INJECTION} {response.url}", "name": SQL_INJECTION_2,
                   SQL_INJECTION: SQL_INJECTION_2}

    settings = crawl_settings(db_path, IDEMPOTENT_SOURCE=SQL_INJECTION_2, **KEYS)
    crawler = await run_crawl(InjectionSpider, settings, url=site.url, paths=pages(site, 1))
    assert crawler.stats.get_value("finish_reason") == "finished"
    tables = {name for (name,) in db_rows(db_path,
                                           "SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"records", "requests", "rejects", "runs", "meta"} <= tables
    assert frontier_counts(db_path) == {"done": 2}
    records = [loads(d) for (d,) in db_rows(db_path, "SELECT data FROM records")]
    assert len(records) == 2
    assert all(r["name"] == SQL_INJECTION_2 and r[SQL_INJECTION] == SQL_INJECTION_2
               for r in records)
    assert {src for (src,) in db_rows(db_path, "SELECT source FROM records")} == {
        SQL_INJECTION_2}
    (data,), = db_rows(db_path, "SELECT data FROM requests WHERE url LIKE '%/q/%'")
    stored = loads(data)
    assert stored["meta"]["note"] == SQL_INJECTION
    assert stored["meta"][SQL_INJECTION_2] == [1]
    assert stored["cb_kwargs"] == {"why": SQL_INJECTION}
    assert site.count(target) == 1


@deferred_f_from_coro_f
async def test_no_credentials_in_the_package_logs(
    site: LocalSite, db_path: Path, tmp_path: Path, caplog: Any
) -> None:
    """Credentials in a URL, an Authorization header and a proxy URL, on a request that
    cannot be stored (something else in it; fetched from memory) and on one whose download
    fails: the package's own log lines never show them."""
    caplog.set_level(logging.DEBUG, logger="scrapy_idempotent")
    host = site.url.split("://", 1)[1]
    handle = (tmp_path / "f.txt").open("w")
    secrets = ["pw-secret-url", "tok-secret-header", "pw-secret-proxy"]

    def with_credentials(path: str, **meta: Any) -> scrapy.Request:
        return scrapy.Request(
            f"http://alice:pw-secret-url@{host}{path}",
            headers={"Authorization": "Bearer tok-secret-header"},
            meta={"proxy": "http://bob:pw-secret-proxy@127.0.0.1:1", **meta},
            dont_filter=True)

    class CredentialsSpider(PagesSpider):
        def parse(self, response: Any) -> Any:
            yield with_credentials("/refused", handle=handle)  # unstorable: an open file
            yield with_credentials("/failing")  # the proxy port refuses connections
            yield {"sku": "CRED-1"}

    try:
        crawler = await run_crawl(CredentialsSpider, crawl_settings(db_path, **KEYS),
                                  url=site.url, paths=pages(site, 1))
    finally:
        handle.close()
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/requests/unstorable"] == 1
    # the download through the proxy failed; the page whose unstorable child (fetched from
    # memory through the same proxy) failed is failed too
    assert stats["idempotent/requests/failed"] == 2
    logged = package_messages(caplog, tracebacks=True)
    assert any("/refused" in m and "meta['handle']" in m for m in logged), logged
    leaks = [m for m in logged if "secret" in m or "alice:" in m or "bob:" in m
             or any(secret in m for secret in secrets)]
    assert leaks == []
    # the stored frontier keeps what the request needs (a 0600 file), the failure says why
    kinds = sorted(k for (k,) in db_rows(
        db_path, "SELECT error_kind FROM requests WHERE state = 'failed'"))
    assert kinds[0].startswith("download_error/")
    assert kinds[1].startswith("unstorable_child/download_error/")


# == property: record IDs are stable across processes and item types ==========================

#: What a natural key field can hold: ints (any size), and text that is not blank (no lone
#: surrogates: those are the subject of their own test above).
_key_values = st.one_of(
    st.integers(),
    st.text(min_size=1, max_size=30).filter(lambda s: s.strip() != ""),
)
_keys = st.tuples(_key_values, _key_values)

#: Computes record IDs in a fresh interpreter (another hash seed) for a JSON list of
#: ``[source, sku, region]``.
RECORD_IDS_ELSEWHERE = r"""
import json, sys
from scrapy_idempotent.records import RecordIdentity
ids = []
for source, sku, region in json.load(sys.stdin):
    ident = RecordIdentity(source=source, natural_keys={"*": ("sku", "region")})
    ids.append(ident.record_id(ident.natural_key({"sku": sku, "region": region}, None)))
print(json.dumps(ids))
"""


class KeyedItem(scrapy.Item):
    sku = scrapy.Field()
    region = scrapy.Field()
    record_id = scrapy.Field()


@dataclasses.dataclass
class KeyedData:
    region: Any
    sku: Any
    extra: str = "ignored by the key"


def test_record_ids_are_the_same_in_another_process_and_for_every_item_type() -> None:
    """Hypothesis draws batches of compound keys (ints of any size, any non-blank text) and
    sources; every item type gives one ID per key in this process; then ONE other process
    (another ``PYTHONHASHSEED``) computes the IDs of everything drawn, and they agree."""
    from scrapy_idempotent.records import RecordIdentity

    kinds: list[Callable[[Any, Any], Any]] = [
        lambda a, b: {"sku": a, "region": b},
        lambda a, b: KeyedItem(sku=a, region=b),
        lambda a, b: KeyedData(sku=a, region=b),
        lambda a, b: {"region": f" {b}\t" if isinstance(b, str) else b, "sku": a,
                      "noise": object()},
    ]
    drawn: list[tuple[str, Any, Any]] = []
    ids: list[str] = []

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(batch=st.lists(_keys, min_size=1, max_size=20),
           source=st.text(min_size=1, max_size=8).filter(lambda s: s.strip() != ""))
    def same_id_for_every_item_type(batch: list[tuple[Any, Any]], source: str) -> None:
        ident = RecordIdentity(source=source, natural_keys={"*": ("sku", "region")})
        by_key: dict[tuple[str, str], str] = {}
        for a, b in batch:
            found = {ident.record_id(ident.natural_key(make(a, b), None)) for make in kinds}
            assert len(found) == 1, (a, b)
            record_id = found.pop()
            # the same normalised key (1, "1", " 1 ") always has the same ID
            assert by_key.setdefault((str(a).strip(), str(b).strip()), record_id) == record_id
            drawn.append((source, a, b))
            ids.append(record_id)
        assert len(set(by_key.values())) == len(by_key)  # different keys, different IDs

    same_id_for_every_item_type()
    assert len(drawn) >= 60
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", RECORD_IDS_ELSEWHERE], input=json.dumps(drawn),
                         capture_output=True, text=True, env=env, check=True, timeout=60)
    assert json.loads(out.stdout) == ids
