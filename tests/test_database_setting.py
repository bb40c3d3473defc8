"""``IDEMPOTENT_DATABASE`` picks the store in one place (``scrapy_idempotent.store.open_store``):
a path or ``sqlite:///PATH`` is the SQLite store, ``SCHEME://...`` the backend registered for
the scheme, any other scheme a clear error naming the setting before the crawl starts; the
crawl and the ``scrapy idempotent`` commands get their store from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import scrapy
from local_site import LocalSite
from scrapy.settings import Settings
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import EXAMPLE_PROJECT, crawl_settings, db_rows, run_crawl
from scrapy_idempotent.config import IdempotentConfig
from scrapy_idempotent.exceptions import ConfigError
from scrapy_idempotent.store import FrontierStore, SQLiteStore, open_store
from scrapy_idempotent.store.registry import BACKENDS, redacted
from shop.spiders.shop import ShopSpider

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


class XSpider(scrapy.Spider):
    name = "x"


@pytest.fixture(autouse=True)
def _no_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Relative paths resolve against the current directory: a temporary one, no project."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SCRAPY_SETTINGS_MODULE", raising=False)


def config(database: Any, **settings: Any) -> IdempotentConfig:
    return IdempotentConfig.from_settings(
        Settings({"IDEMPOTENT_DATABASE": database, **settings}), XSpider())


def test_a_path_and_a_sqlite_url_name_the_same_file(tmp_path: Path) -> None:
    expected = str(tmp_path / "data" / "x.sqlite3")
    assert config("data/{spider}.sqlite3").database == expected
    assert config("sqlite:///data/{spider}.sqlite3").database == expected  # relative
    assert config(f"sqlite:///{tmp_path}/data/x.sqlite3").database == expected  # 4 slashes
    assert config("SQLite:///data/x.sqlite3").database == expected

    cfg = config("sqlite:///data/{spider}.sqlite3", IDEMPOTENT_LEASE_SECONDS=7,
                 IDEMPOTENT_SYNCHRONOUS="full", IDEMPOTENT_BUSY_TIMEOUT_SECONDS=3,
                 IDEMPOTENT_MAX_ATTEMPTS=4, IDEMPOTENT_RECRAWL_SECONDS=3600)
    store = open_store(cfg.database, **cfg.store_options())
    assert isinstance(store, SQLiteStore)
    assert (store.path, store.lease_seconds, store.synchronous, store.busy_timeout_seconds,
            store.max_attempts, store.recrawl_seconds) == (expected, 7.0, "FULL", 3.0, 4,
                                                           3600.0)
    # a URL given as it is (scrapy idempotent --db): the path after sqlite:///
    assert isinstance(url_store := open_store(f"sqlite:///{expected}"), SQLiteStore)
    assert url_store.path == expected
    assert not (tmp_path / "data").exists()  # choosing a store creates nothing


@pytest.mark.parametrize(("database", "why"), [
    ("mysql://crawler@db/shop", "no backend is registered for mysql://"),
    ("file:///var/lib/shop.sqlite3", "no backend is registered for file://"),
    ("sqlite://db.internal/shop.sqlite3", "a SQLite URL is sqlite:///PATH"),
    ("sqlite:///", "a SQLite URL is sqlite:///PATH"),
])
def test_an_unknown_scheme_or_a_bad_sqlite_url_is_refused_naming_the_setting(
    database: str, why: str,
) -> None:
    for attempt in (lambda: config(database), lambda: open_store(database)):
        with pytest.raises(ConfigError) as raised:
            attempt()
        assert raised.value.setting == "IDEMPOTENT_DATABASE"
        assert str(raised.value).startswith(f"IDEMPOTENT_DATABASE={database!r} is not valid")
        assert why in str(raised.value)
        assert "sqlite://" in str(raised.value)  # what is allowed


def test_a_backend_that_cannot_be_loaded_is_an_error_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(BACKENDS, "gone", "scrapy_idempotent_no_such_module:Store")
    assert config("gone://somewhere/{spider}").database == "gone://somewhere/x"  # as given
    with pytest.raises(ConfigError, match=r"IDEMPOTENT_DATABASE='gone://somewhere/x' is not "
                                          r"valid: .*scrapy_idempotent_no_such_module"):
        open_store("gone://somewhere/x")


def test_a_url_password_is_not_shown() -> None:
    assert redacted("postgresql://crawler:s3cr:et@db.internal:5432/shop?sslmode=require") == (
        "postgresql://crawler:***@db.internal:5432/shop?sslmode=require")
    for shown in ("postgresql://crawler@db.internal/shop", "/srv/a:b@c.sqlite3",
                  "sqlite:///data/x.sqlite3"):
        assert redacted(shown) == shown


@deferred_f_from_coro_f
async def test_a_registered_scheme_gives_the_crawl_its_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scheduler takes the store of the scheme's backend (here: one that keeps the
    database in a file of its choosing), with the options of the settings."""
    opened: list[tuple[str, dict[str, Any]]] = []
    file = tmp_path / "elsewhere.sqlite3"

    def factory(database: str, **options: Any) -> FrontierStore:
        opened.append((database, options))
        return SQLiteStore(str(file), **options)

    monkeypatch.setitem(BACKENDS, "elsewhere", factory)
    with LocalSite(listing_pages=1, products_per_page=4) as site:
        crawler = await run_crawl(ShopSpider, crawl_settings(
            tmp_path / "unused.sqlite3", **NATURAL_KEYS,
            IDEMPOTENT_DATABASE="elsewhere://db/{spider}", IDEMPOTENT_LEASE_SECONDS=30),
            url=site.url)
    assert opened == [("elsewhere://db/shop", {
        "lease_seconds": 30.0, "max_attempts": 10, "synchronous": "NORMAL",
        "busy_timeout_seconds": 10.0, "recrawl_seconds": None})]
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert db_rows(file, "SELECT count(*) FROM records") == [(4,)]
    assert not (tmp_path / "unused.sqlite3").exists()


def test_scrapy_crawl_with_an_unknown_scheme_stops_before_any_request(
    tmp_path: Path,
) -> None:
    with LocalSite(listing_pages=1, products_per_page=4) as site:
        result = subprocess.run(
            [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"url={site.url}",
             "-s", "IDEMPOTENT_DATABASE=mysql://crawler@db/shop"],
            cwd=EXAMPLE_PROJECT, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=120)
        assert site.request_count == 0
    assert result.returncode != 0
    critical = [line for line in result.stderr.splitlines() if "CRITICAL" in line]
    assert len(critical) == 1, result.stderr
    assert ("IDEMPOTENT_DATABASE='mysql://crawler@db/shop' is not valid: a file path, or a URL "
            "of a known database" in critical[0]), critical
    assert "Traceback" not in result.stderr


@deferred_f_from_coro_f
async def test_the_commands_take_a_sqlite_url_and_refuse_an_unknown_scheme(
    tmp_path: Path, db_path: Path,
) -> None:
    with LocalSite(listing_pages=1, products_per_page=4) as site:
        await run_crawl(ShopSpider, crawl_settings(db_path, **NATURAL_KEYS), url=site.url)

    def idempotent(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "scrapy", "idempotent", *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)

    url = f"sqlite:///{db_path}"
    by_path, by_url = idempotent("status", "--db", str(db_path)), idempotent("status", "--db", url)
    assert by_path.returncode == by_url.returncode == 0, by_url.stderr
    # the same file, shown as its absolute path either way (as the crawl's log shows it)
    assert by_url.stdout == by_path.stdout

    unknown = idempotent("check", "--db", "mysql://crawler:secret@db/shop")
    assert unknown.returncode == 1
    assert unknown.stdout == ""
    assert unknown.stderr.startswith(
        "scrapy idempotent check: IDEMPOTENT_DATABASE='mysql://crawler:***@db/shop' is not "
        "valid: a file path, or a URL of a known database"), unknown.stderr
