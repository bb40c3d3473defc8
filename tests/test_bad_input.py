"""Bad input gets one clear line before the first request: every number setting has a range,
``IDEMPOTENT_REQUEST_CLASSES`` is imported and checked at start, a spider name cannot place the
database outside its folder, a missing database driver names the extra that installs it, and
setting names in lower case are warned about. What a user sees is checked through a real
``scrapy crawl`` of the example project: one line naming the setting or the package, exit code
1, no traceback, nothing created."""

from __future__ import annotations

import logging
import math
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import scrapy
from scrapy.settings import Settings

from crawling import EXAMPLE_PROJECT, fill_up, small_file_system
from scrapy_idempotent.config import (
    SETTINGS,
    IdempotentConfig,
    config_for,
    file_name_part,
    store_options,
    unknown_settings,
)
from scrapy_idempotent.exceptions import ConfigError
from scrapy_idempotent.store import open_store


class XSpider(scrapy.Spider):
    name = "x"


def config(values: dict[str, Any], name: str = "x") -> IdempotentConfig:
    spider: Any = type("S", (scrapy.Spider,), {"name": name})()
    return IdempotentConfig.from_settings(Settings(values), spider)


#: Every number setting (the queue's are read only with a queue URL).
NUMBER_SETTINGS = sorted(
    name for name, default in SETTINGS.items()
    if (isinstance(default, (int, float)) and not isinstance(default, bool))
    or name in ("IDEMPOTENT_RECRAWL_SECONDS", "IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS"))
WITH_QUEUE = {"IDEMPOTENT_QUEUE_URL": "redis://127.0.0.1:9/0"}


@pytest.mark.parametrize("name", NUMBER_SETTINGS)
@pytest.mark.parametrize("value", [math.inf, 1e308, 10**20, math.nan, "inf", -math.inf])
def test_every_number_setting_has_a_range(name: str, value: Any) -> None:
    assert len(NUMBER_SETTINGS) >= 15
    with pytest.raises(ConfigError) as caught:
        config({**WITH_QUEUE, name: value})
    assert caught.value.setting == name
    assert " and <= " in caught.value.allowed or name == "IDEMPOTENT_LOG_INTERVAL_SECONDS"


@pytest.mark.parametrize(("name", "value"), [
    ("IDEMPOTENT_LEASE_SECONDS", 604800), ("IDEMPOTENT_LEASE_BATCH", 10000),
    ("IDEMPOTENT_BUSY_TIMEOUT_SECONDS", 3600), ("IDEMPOTENT_MAX_ATTEMPTS", 10000),
    ("IDEMPOTENT_LOG_INTERVAL_SECONDS", 0), ("IDEMPOTENT_LOG_INTERVAL_SECONDS", 0.1),
    ("IDEMPOTENT_LOG_INTERVAL_SECONDS", 86400), ("IDEMPOTENT_RECRAWL_SECONDS", 86400 * 3650),
])
def test_the_bounds_themselves_are_accepted(name: str, value: float) -> None:
    config({name: value})


def test_a_log_interval_below_a_tenth_of_a_second_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"IDEMPOTENT_LOG_INTERVAL_SECONDS=1e-09 .*0 \(no "):
        config({"IDEMPOTENT_LOG_INTERVAL_SECONDS": 1e-9})


def test_the_commands_refuse_the_same_numbers() -> None:
    with pytest.raises(ConfigError, match="IDEMPOTENT_BUSY_TIMEOUT_SECONDS"):
        store_options(Settings({"IDEMPOTENT_BUSY_TIMEOUT_SECONDS": "inf"}))


@pytest.mark.parametrize(("value", "message"), [
    ("nosuch.Req", "No module named 'nosuch'"),
    ("os.system", "not <built-in function system>"),
    ("scrapy.Spider", "not <class 'scrapy.spiders.Spider'>"),
    (["scrapy.http.JsonRequest", "scrapy.Item"], "scrapy.Item"),
])
def test_request_classes_are_imported_and_checked_at_start(value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config({"IDEMPOTENT_REQUEST_CLASSES": value})
    assert caught.value.setting == "IDEMPOTENT_REQUEST_CLASSES"
    assert "scrapy.Request subclass" in str(caught.value) and message in str(caught.value)


def test_request_subclasses_are_accepted() -> None:
    classes = ("scrapy.http.JsonRequest", "scrapy.FormRequest")
    assert config({"IDEMPOTENT_REQUEST_CLASSES": list(classes)}).request_classes == classes


@pytest.mark.parametrize(("spider", "file"), [
    ("../../x", "___.._x.sqlite3"), ("a/b", "a_b.sqlite3"), ("..", "__.sqlite3"),
    (".hidden", "_hidden.sqlite3"), ("a\\b", "a_b.sqlite3"), ("shop-2.v1", "shop-2.v1.sqlite3"),
])
def test_a_spider_name_stays_one_file_name_in_the_database_path(
    tmp_path: Path, spider: str, file: str
) -> None:
    folder = tmp_path / "data"
    database = config({"IDEMPOTENT_DATABASE": f"{folder}/{{spider}}.sqlite3"}, spider).database
    assert database == str(folder / file)
    assert file_name_part(spider) + ".sqlite3" == file


def test_a_spider_name_in_a_url_is_left_as_it_is() -> None:
    database = "postgresql://crawler@127.0.0.1:9/shop?options=-csearch_path%3D{spider}"
    assert config({"IDEMPOTENT_DATABASE": database}, "a-b").database == database.replace(
        "{spider}", "a-b")


def test_setting_names_in_lower_case_are_warned_about(caplog: pytest.LogCaptureFixture,
                                                      ) -> None:
    assert unknown_settings(Settings({"idempotent_lease_seconds": 5,
                                      "Idempotent_Natural_Keys": {}, "other": 1})) == {
        "idempotent_lease_seconds": "IDEMPOTENT_LEASE_SECONDS",
        "Idempotent_Natural_Keys": "IDEMPOTENT_NATURAL_KEYS"}
    from scrapy.utils.test import get_crawler

    crawler = get_crawler(XSpider, {"idempotent_lease_seconds": 5})
    with caplog.at_level(logging.WARNING, logger="scrapy_idempotent.config"):
        config_for(crawler)
    assert [r.getMessage() for r in caplog.records] == [
        "Unknown setting idempotent_lease_seconds ignored: did you mean "
        "IDEMPOTENT_LEASE_SECONDS?"]


# -- a database driver that is not installed ------------------------------------------------


def without_psycopg(tmp_path: Path) -> dict[str, str]:
    """An environment in which ``import psycopg`` fails as it does when the package is not
    installed: a module of that name that raises ModuleNotFoundError, first on the path."""
    stub = tmp_path / "no_psycopg" / "psycopg"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'psycopg'\", name='psycopg')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(stub.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}


def test_a_missing_driver_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg: ImportError
    for database in ("postgresql://crawler@127.0.0.1:9/shop", "postgres://127.0.0.1:9/x"):
        with pytest.raises(ConfigError) as caught:
            config({"IDEMPOTENT_DATABASE": database})
        assert caught.value.setting == "IDEMPOTENT_DATABASE"
        assert "pip install 'scrapy-idempotent[postgresql]'" in str(caught.value)
        with pytest.raises(ConfigError, match=r"scrapy-idempotent\[postgresql\]"):
            open_store(database)


# -- what a user sees ------------------------------------------------------------------------


def crawl(*settings: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", "url=http://127.0.0.1:9",
               "-s", "LOG_LEVEL=INFO"]
    for setting in settings:
        command += ["-s", setting]
    return subprocess.run(command, cwd=EXAMPLE_PROJECT, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120, env=env)


def assert_one_line(result: subprocess.CompletedProcess[str], *words: str,
                    opened: bool = False) -> str:
    """Exit code 1, one CRITICAL or ERROR line with ``words``, no traceback; the spider not
    opened (a setting), or opened and closed as ``idempotent_store_error`` (a database refused
    at open). Either way no request was made: one to the closed port would be another ERROR
    line (the retry middleware giving up)."""
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    bad = [line for line in output.splitlines() if " CRITICAL: " in line or " ERROR: " in line]
    assert len(bad) == 1, output
    assert all(word in bad[0] for word in words), bad[0]
    assert "Traceback" not in output and "never retrieved" not in output, output
    if opened:
        assert "Spider closed (idempotent_store_error)" in output, output
        assert "'downloader/request_count'" not in output, output
    else:
        assert "Spider opened" not in output, output  # stopped before the first request
    return bad[0]


@pytest.mark.slow
@pytest.mark.parametrize(("setting", "allowed"), [
    ("IDEMPOTENT_BUSY_TIMEOUT_SECONDS=inf", "a number >= 0 and <= 3600"),
    ("IDEMPOTENT_BUSY_TIMEOUT_SECONDS=1e308", "a number >= 0 and <= 3600"),
    ("IDEMPOTENT_LEASE_BATCH=100000000000000000000", "an integer >= 1 and <= 10000"),
    ("IDEMPOTENT_LOG_INTERVAL_SECONDS=1e-9", "0 (no progress line) or"),
    ("IDEMPOTENT_LEASE_SECONDS=inf", "a number >= 1 and <= 604800"),
    ("IDEMPOTENT_REQUEST_CLASSES=nosuch.Req", "scrapy.Request subclass"),
    ("IDEMPOTENT_REQUEST_CLASSES=os.system", "scrapy.Request subclass"),
])
def test_a_bad_number_or_request_class_is_one_line_naming_the_setting(
    tmp_path: Path, setting: str, allowed: str
) -> None:
    db = tmp_path / "db.sqlite3"
    result = crawl(setting, f"IDEMPOTENT_DATABASE={db}")
    assert_one_line(result, setting.split("=", 1)[0] + "=", allowed)
    assert not db.exists()


@pytest.mark.slow
def test_a_postgresql_url_without_psycopg_names_the_extra(tmp_path: Path) -> None:
    env = without_psycopg(tmp_path)
    result = crawl("IDEMPOTENT_DATABASE=postgresql://crawler:secret@127.0.0.1:9/shop", env=env)
    line = assert_one_line(result, "IDEMPOTENT_DATABASE=",
                           "pip install 'scrapy-idempotent[postgresql]'")
    assert "secret" not in line
    # and migrate, to such a URL
    db = tmp_path / "crawl.sqlite3"
    from scrapy_idempotent.store import CrawlIdentity, SQLiteStore

    store = SQLiteStore(str(db))
    store.open(fingerprinter="x", identity=CrawlIdentity(project="shop", spider="shop",
                                                         source="shop"))
    store.close()
    migrate = subprocess.run(
        [sys.executable, "-m", "scrapy", "idempotent", "migrate", "--db", str(db), "--to",
         "postgresql://crawler@127.0.0.1:9/shop"], cwd=tmp_path, env=env,
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    output = migrate.stdout + migrate.stderr
    assert migrate.returncode == 1, output
    assert "Traceback" not in output, output
    assert output.strip().splitlines() == [output.strip()], output
    assert "pip install 'scrapy-idempotent[postgresql]'" in output


@pytest.mark.slow
@pytest.mark.parametrize("case", ["another application's file", "a path too long"])
def test_a_database_refused_at_open_closes_the_spider_with_one_error_line(
    tmp_path: Path, case: str
) -> None:
    if case == "a path too long":
        db = tmp_path / ("x" * 300 + ".sqlite3")
        words = ["cannot open the frontier database", "cannot create the database"]
    else:
        db = tmp_path / "notes.db"
        db.write_text("someone else's notes\n")
        words = ["cannot open the frontier database", "is not a scrapy_idempotent database",
                 "left untouched"]
    before = db.read_bytes() if db.name == "notes.db" else None
    result = crawl(f"IDEMPOTENT_DATABASE={db}")
    assert_one_line(result, *words, opened=True)
    assert "'finish_reason': 'idempotent_store_error'" in result.stdout + result.stderr
    if before is not None:
        assert db.read_bytes() == before


@pytest.mark.slow
def test_reactorless_mode_is_refused_before_the_database_is_touched(tmp_path: Path) -> None:
    """Scrapy 2.15+'s ``TWISTED_REACTOR_ENABLED = False``: one CRITICAL line naming the
    setting, exit code 1, no database file created (it used to open the database, start a
    run, then crash with four tracebacks)."""
    from scrapy.settings import default_settings

    if not hasattr(default_settings, "TWISTED_REACTOR_ENABLED"):
        pytest.skip("this Scrapy has no reactorless mode")
    db = tmp_path / "db.sqlite3"
    result = crawl("TWISTED_REACTOR_ENABLED=False", f"IDEMPOTENT_DATABASE={db}")
    assert_one_line(result, "TWISTED_REACTOR_ENABLED=", "reactorless")
    assert not db.exists()


def test_a_database_path_with_a_nul_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"IDEMPOTENT_DATABASE.*without a NUL"):
        config({"IDEMPOTENT_DATABASE": "/tmp/a\x00b.sqlite3"})


@pytest.mark.slow
def test_a_second_ctrl_c_exits_1(tmp_path: Path) -> None:
    """The first SIGINT starts the graceful close, which waits for the downloads in flight
    (slow pages); the second forces Scrapy's unclean shutdown: the crawl did not close, so
    ``scrapy crawl`` exits 1 (it exited 0)."""
    import signal

    from local_site import LocalSite

    from crawling import start_shop_crawl, wait_for

    log = tmp_path / "crawl.log"
    with LocalSite(delay=30) as site:
        crawl = start_shop_crawl(site.url, tmp_path / "db.sqlite3", log, "LOG_LEVEL=INFO")
        try:
            wait_for(lambda: site.in_flight >= 1, 120, "a download in flight", log)
            crawl.send_signal(signal.SIGINT)
            wait_for(lambda: "shutting down gracefully" in log.read_text(), 60,
                     "the graceful stop", log)
            crawl.send_signal(signal.SIGINT)
            assert crawl.wait(timeout=60) == 1, log.read_text()
        finally:
            if crawl.poll() is None:
                crawl.kill()
                crawl.wait()
    assert "forcing unclean shutdown" in log.read_text()


@pytest.mark.slow
def test_a_refused_database_with_outbox_targets_is_still_one_error_line(tmp_path: Path) -> None:
    """The outbox opens the crawl's database too: its refusal is the same cause, said once."""
    db = tmp_path / "notes.db"
    db.write_text("someone else's notes\n")
    result = crawl(f"IDEMPOTENT_DATABASE={db}", "IDEMPOTENT_OUTBOX_TARGETS=http://127.0.0.1:9/x")
    assert_one_line(result, "cannot open the frontier database",
                    "is not a scrapy_idempotent database", opened=True)
    assert db.read_text() == "someone else's notes\n"


@pytest.mark.slow
def test_a_full_disk_at_open_is_one_error_line_naming_it_and_loses_nothing(
        tmp_path: Path) -> None:
    """The disk of a stopped crawl's database filled up: the next crawl says so in one line
    (SQLite's own code is an I/O error of its -shm file) and the database keeps its requests."""
    from scrapy_idempotent.store import CrawlIdentity, NewRequest, SQLiteStore, UnitOfWork

    with small_file_system(tmp_path / "small", "512k") as mount:
        db = mount / "crawl.sqlite3"
        store = SQLiteStore(str(db))
        store.open(fingerprinter="x", identity=CrawlIdentity("shop", "shop", "shop"))
        store.begin_session("w1", "auto")
        store.commit(UnitOfWork(requests=[
            NewRequest(key=f"k{n}", fingerprint=f"k{n}", url=f"http://127.0.0.1:9/{n}",
                       priority=0, data="{}") for n in range(50)]), "w1")
        store.end_session("w1", "shutdown")
        store.close()
        filler = fill_up(mount)
        result = crawl(f"IDEMPOTENT_DATABASE={db}")
        assert_one_line(result, "cannot open the frontier database",
                        f"the disk holding the database {db} is full", opened=True)
        filler.unlink()
        conn = sqlite3.connect(db)
        assert conn.execute("SELECT count(*) FROM requests WHERE state = 'pending'"
                            ).fetchone() == (50,)
        conn.close()
