"""``IDEMPOTENT_*`` settings (``scrapy_idempotent.config``): defaults, validation, overrides."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import scrapy
from scrapy.settings import Settings
from scrapy.utils.misc import build_from_crawler, load_object
from scrapy.utils.test import get_crawler

from crawling import EXAMPLE_PROJECT
from scrapy_idempotent import IdempotentScheduler
from scrapy_idempotent.config import DEFAULT_URL_IGNORE_PARAMS, IdempotentConfig
from scrapy_idempotent.exceptions import ConfigError


class XSpider(scrapy.Spider):
    name = "x"


class KeyedSpider(scrapy.Spider):
    name = "keyed"
    idempotent_natural_keys: ClassVar[dict[str, Any]] = {"Product": ["id"],
                                                         "Review": "review_id"}


@pytest.fixture(autouse=True)
def _no_project(tmp_path, monkeypatch):
    """Resolve the default database path outside any Scrapy project, creating nothing here."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SCRAPY_SETTINGS_MODULE", raising=False)


def config(values: dict[str, Any] | None = None,
           spider: scrapy.Spider | None = None) -> IdempotentConfig:
    return IdempotentConfig.from_settings(Settings(values or {}), spider or XSpider())


def test_defaults():
    cfg = config()
    assert cfg.database.replace(os.sep, "/").endswith("idempotent/x.sqlite3")
    assert cfg == IdempotentConfig(
        database=cfg.database,
        lease_seconds=60.0,
        lease_batch=16,  # Scrapy's CONCURRENT_REQUESTS
        run_mode="auto",
        natural_keys={},
        source="x",
        record_types={},
        record_id_field="record_id",
        volatile_fields=frozenset(),
        url_ignore_params=DEFAULT_URL_IGNORE_PARAMS,
        max_attempts=10,
        synchronous="NORMAL",
        busy_timeout_seconds=10.0,
        request_classes=(),
        log_interval_seconds=60.0,
    )


def test_default_database_path_creates_nothing(tmp_path):
    config()
    assert os.listdir(tmp_path) == []


def test_database_spider_placeholder(tmp_path):
    cfg = config({"IDEMPOTENT_DATABASE": str(tmp_path / "db" / "{spider}-frontier.sqlite3")})
    assert cfg.database == str(tmp_path / "db" / "x-frontier.sqlite3")


def test_database_path_object(tmp_path):
    assert config({"IDEMPOTENT_DATABASE": tmp_path / "f.db"}).database == str(
        tmp_path / "f.db")


def test_values_given_as_strings_on_the_command_line():
    cfg = config({
        "IDEMPOTENT_LEASE_SECONDS": "30",
        "IDEMPOTENT_LEASE_BATCH": "4",
        "IDEMPOTENT_MAX_ATTEMPTS": "3",
        "IDEMPOTENT_SYNCHRONOUS": "full",
        "IDEMPOTENT_RUN_MODE": "fresh",
        "IDEMPOTENT_VOLATILE_FIELDS": "seen_at, scraped_at",
        "IDEMPOTENT_URL_IGNORE_PARAMS": "utm_*,sid",
        "IDEMPOTENT_SOURCE": "shop-eu",
        "IDEMPOTENT_RECORD_ID_FIELD": "",
    })
    assert (cfg.lease_seconds, cfg.lease_batch, cfg.max_attempts) == (30.0, 4, 3)
    assert cfg.synchronous == "FULL"
    assert cfg.run_mode == "fresh"
    assert cfg.volatile_fields == frozenset({"seen_at", "scraped_at"})
    assert cfg.url_ignore_params == ("utm_*", "sid")
    assert cfg.source == "shop-eu"
    assert cfg.record_id_field is None


@pytest.mark.parametrize(("values", "batch"), [
    ({"CONCURRENT_REQUESTS": 32}, 32),
    ({"CONCURRENT_REQUESTS": "64"}, 64),
    ({"CONCURRENT_REQUESTS": 2}, 8),
    ({"CONCURRENT_REQUESTS": 50_000}, 10_000),
    ({"CONCURRENT_REQUESTS": 32, "IDEMPOTENT_LEASE_BATCH": None}, 32),
    ({"CONCURRENT_REQUESTS": 32, "IDEMPOTENT_LEASE_BATCH": ""}, 32),
    ({"CONCURRENT_REQUESTS": 32, "IDEMPOTENT_LEASE_BATCH": 4}, 4),
])
def test_the_lease_batch_follows_concurrent_requests_unless_set(values, batch):
    assert config(values).lease_batch == batch


def test_a_concurrent_requests_that_is_no_number_is_named_when_the_lease_batch_follows_it():
    with pytest.raises(ConfigError, match="CONCURRENT_REQUESTS"):
        config({"CONCURRENT_REQUESTS": "many"})
    assert config({"CONCURRENT_REQUESTS": "many", "IDEMPOTENT_LEASE_BATCH": 8}).lease_batch == 8


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("IDEMPOTENT_LEASE_SECONDS", 0),
        ("IDEMPOTENT_LEASE_SECONDS", -1),
        ("IDEMPOTENT_LEASE_SECONDS", "abc"),
        ("IDEMPOTENT_LEASE_SECONDS", True),
        ("IDEMPOTENT_LEASE_BATCH", 0),
        ("IDEMPOTENT_LEASE_BATCH", 1.5),
        ("IDEMPOTENT_RUN_MODE", "bogus"),
        ("IDEMPOTENT_NATURAL_KEYS", "notjson"),
        ("IDEMPOTENT_NATURAL_KEYS", {"A": 3}),
        ("IDEMPOTENT_NATURAL_KEYS", {"A": []}),
        ("IDEMPOTENT_NATURAL_KEYS", {"A": ["sku", ""]}),
        ("IDEMPOTENT_SYNCHRONOUS", "OFF"),
        ("IDEMPOTENT_MAX_ATTEMPTS", 0),
        ("IDEMPOTENT_MAX_ATTEMPTS", 2.5),
        ("IDEMPOTENT_VOLATILE_FIELDS", [1]),
        ("IDEMPOTENT_VOLATILE_FIELDS", [""]),
        ("IDEMPOTENT_URL_IGNORE_PARAMS", 5),
        ("IDEMPOTENT_REQUEST_CLASSES", [None]),
        ("IDEMPOTENT_SOURCE", "  "),
        ("IDEMPOTENT_RECORD_ID_FIELD", 3),
        ("IDEMPOTENT_DATABASE", 3),
        ("IDEMPOTENT_BUSY_TIMEOUT_SECONDS", -1),
        ("IDEMPOTENT_LOG_INTERVAL_SECONDS", "often"),
        ("IDEMPOTENT_SAMPLE_SECONDS", 0.5),
        ("IDEMPOTENT_SAMPLE_SECONDS", -1),
        ("IDEMPOTENT_METRICS_LISTEN", "9811"),
        ("IDEMPOTENT_METRICS_LISTEN", "localhost:http"),
        ("IDEMPOTENT_METRICS_LISTEN", 9811),
    ],
)
def test_bad_value_raises_config_error_naming_setting_and_value(name, value):
    with pytest.raises(ConfigError) as caught:
        config({name: value})
    assert caught.value.setting == name
    assert caught.value.value == value
    assert str(caught.value).startswith(f"{name}={value!r} is not valid: ")
    assert caught.value.allowed in str(caught.value)


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("IDEMPOTENT_LEASE_SECONDS", 0, "a number >= 1 and <= 604800"),
        ("IDEMPOTENT_LEASE_BATCH", 1.5, "an integer >= 1 and <= 10000"),
        ("IDEMPOTENT_MAX_ATTEMPTS", 0, "an integer >= 1 and <= 10000"),
        ("IDEMPOTENT_RUN_MODE", "bogus", "one of auto, resume, fresh"),
    ],
)
def test_config_error_says_what_is_allowed(name, value, allowed):
    with pytest.raises(ConfigError) as caught:
        config({name: value})
    assert str(caught.value) == f"{name}={value!r} is not valid: {allowed}"


@pytest.mark.parametrize("value", [False, "False", "0"])
def test_reactorless_mode_is_refused_naming_the_setting(value: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        config({"TWISTED_REACTOR_ENABLED": value})
    assert caught.value.setting == "TWISTED_REACTOR_ENABLED"
    assert "reactorless" in caught.value.allowed


def test_the_reactor_enabled_setting_is_accepted() -> None:
    assert config({"TWISTED_REACTOR_ENABLED": True}) == config()


@pytest.mark.parametrize("text", ['["sku"]', '{"Product": 3}'])
def test_natural_keys_json_string_of_the_wrong_shape_is_reported_as_given(text):
    # the value named is the one found in the settings (the string given with -s)
    with pytest.raises(ConfigError) as caught:
        config({"IDEMPOTENT_NATURAL_KEYS": text})
    assert caught.value.value == text
    assert str(caught.value).startswith(f"IDEMPOTENT_NATURAL_KEYS={text!r} is not valid: ")


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        config({"IDEMPOTENT_LEASE_BATCH": 0})


def test_natural_keys_dict():
    cfg = config({"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku",
                                              "Review": ["sku", "author"], "*": ("url",)}})
    assert cfg.natural_keys == {"shop.items.ProductItem": ("sku",),
                                "Review": ("sku", "author"), "*": ("url",)}


@pytest.mark.parametrize(("entry", "message"), [
    ({"shop.items.Product": "sku"}, "doesn't define any object named 'Product'"),
    ({"shop.items.ProductItem": "SKU"}, "declares (name, price, sku, url); not SKU"),
])
def test_natural_keys_typos_are_caught_at_start(entry, message):
    with pytest.raises(ConfigError) as caught:
        config({"IDEMPOTENT_NATURAL_KEYS": entry})
    assert caught.value.setting == "IDEMPOTENT_NATURAL_KEYS"
    assert message in str(caught.value)


def test_natural_keys_json_string():
    cfg = config({"IDEMPOTENT_NATURAL_KEYS": '{"Product": "sku", "Review": ["sku", "author"]}'})
    assert cfg.natural_keys == {"Product": ("sku",), "Review": ("sku", "author")}


def test_natural_keys_class_as_key():
    cfg = config({"IDEMPOTENT_NATURAL_KEYS": {XSpider: "sku"}})
    assert cfg.natural_keys == {f"{__name__}.XSpider": ("sku",)}


def test_spider_attribute_overrides_setting_entries():
    cfg = config(
        {"IDEMPOTENT_NATURAL_KEYS": {"Product": "sku", "Offer": "offer_id"}},
        KeyedSpider(),
    )
    assert cfg.natural_keys == {"Product": ("id",), "Offer": ("offer_id",),
                                "Review": ("review_id",)}


def test_bad_spider_attribute_names_the_attribute():
    class BadSpider(scrapy.Spider):
        name = "bad"
        idempotent_natural_keys: ClassVar[list[str]] = ["sku"]

    with pytest.raises(ConfigError) as caught:
        config({}, BadSpider())
    assert caught.value.setting == "BadSpider.idempotent_natural_keys"
    assert str(caught.value).startswith("BadSpider.idempotent_natural_keys=['sku'] is not valid")


def test_source_defaults_to_the_spider_name():
    assert config({}, KeyedSpider()).source == "keyed"
    assert config({"IDEMPOTENT_SOURCE": "shop"}, KeyedSpider()).source == "shop"


def test_config_is_frozen():
    cfg = config()
    with pytest.raises(AttributeError):
        cfg.lease_seconds = 5.0  # type: ignore[misc]


# -- a bad setting stops the crawl before it starts -----------------------------------------


def scheduler_for(settings: dict[str, Any]) -> Any:
    """Build the scheduler the way a crawl does: the crawler creates the spider, applies
    the settings (add-ons included), then the engine builds ``SCHEDULER`` from the crawler."""
    crawler = get_crawler(XSpider, {"ADDONS": {"scrapy_idempotent.Addon": 0}, **settings})
    crawler.spider = crawler._create_spider()
    scheduler_cls = load_object(crawler.settings["SCHEDULER"])
    assert scheduler_cls is IdempotentScheduler
    return build_from_crawler(scheduler_cls, crawler)


def test_good_settings_build_the_scheduler(tmp_path):
    scheduler = scheduler_for({"IDEMPOTENT_DATABASE": str(tmp_path / "{spider}.sqlite3"),
                               "IDEMPOTENT_LEASE_SECONDS": 5})
    assert isinstance(scheduler, IdempotentScheduler)
    assert scheduler.config.lease_seconds == 5.0
    assert scheduler.config.database == str(tmp_path / "x.sqlite3")
    assert os.listdir(tmp_path) == []  # nothing opened before the crawl starts


def test_bad_setting_stops_the_crawl_before_it_starts(tmp_path):
    with pytest.raises(ConfigError) as caught:
        scheduler_for({"IDEMPOTENT_DATABASE": str(tmp_path / "{spider}.sqlite3"),
                       "IDEMPOTENT_LEASE_SECONDS": -1})
    assert str(caught.value).startswith("IDEMPOTENT_LEASE_SECONDS=-1 is not valid")
    assert os.listdir(tmp_path) == []


# -- what an operator sees: `scrapy crawl` of the example project -------------------------


def _crawl(*settings: str, cwd: Path = EXAMPLE_PROJECT, url: str = "http://127.0.0.1:9"
           ) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"url={url}",
               "-s", "CLOSESPIDER_PAGECOUNT=1", "-s", "LOG_LEVEL=INFO"]
    for setting in settings:
        command += ["-s", setting]
    return subprocess.run(command, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize(("setting", "value", "allowed"), [
    ("IDEMPOTENT_RESPONSE_JOURNAL", "yes", "a boolean: True or False"),
    ("IDEMPOTENT_LEASE_SECONDS", "0", "a number >= 1"),
    ("IDEMPOTENT_RUN_MODE", "again", "one of auto, resume, fresh"),
    ("IDEMPOTENT_NATURAL_KEYS", '{"shop.items.ProductItem": "skuu"}', "fields that"),
])
def test_a_bad_setting_stops_the_crawl_with_one_critical_line_and_exit_code_1(
    tmp_path: Path, setting: str, value: str, allowed: str
) -> None:
    result = _crawl(f"{setting}={value}", f"IDEMPOTENT_DATABASE={tmp_path / 'db.sqlite3'}")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    critical = [line for line in output.splitlines() if "CRITICAL" in line]
    assert len(critical) == 1, output
    assert f"{setting}=" in critical[0] and allowed in critical[0]
    assert (value if '"' not in value else "skuu") in critical[0]
    assert "Traceback" not in output and "never retrieved" not in output, output
    assert not (tmp_path / "db.sqlite3").exists()  # nothing was started


@pytest.mark.slow
def test_misspelt_setting_names_are_warned_about_with_the_nearest_known_name(
    tmp_path: Path
) -> None:
    result = _crawl("IDEMPOTNET_LEASE_SECONDS=5", "IDEMPOTENT_MAX_ATTEMPT=3",
                    f"IDEMPOTENT_DATABASE={tmp_path / 'db.sqlite3'}")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert ("Unknown setting IDEMPOTNET_LEASE_SECONDS ignored: did you mean "
            "IDEMPOTENT_LEASE_SECONDS?") in output
    assert ("Unknown setting IDEMPOTENT_MAX_ATTEMPT ignored: did you mean "
            "IDEMPOTENT_MAX_ATTEMPTS?") in output
    assert output.count("Unknown setting") == 2  # once each


@pytest.mark.slow
def test_a_misspelt_record_identity_setting_stops_the_crawl_before_it_starts(
    tmp_path: Path
) -> None:
    """Every record would be stored under another ID (keyed by page URL instead of SKU):
    one CRITICAL line naming the setting and the closest known one, exit code 1, nothing
    created."""
    result = _crawl("IDEMPOTENT_NATURAL_KEY=sku", "IDEMPOTNET_LEASE_SECONDS=5",
                    f"IDEMPOTENT_DATABASE={tmp_path / 'db.sqlite3'}")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    critical = [line for line in output.splitlines() if "CRITICAL" in line]
    assert len(critical) == 1, output
    assert ("IDEMPOTENT_NATURAL_KEY='sku' is not valid: no such setting: did you mean "
            "IDEMPOTENT_NATURAL_KEYS?") in critical[0]
    assert "Traceback" not in output and "never retrieved" not in output, output
    assert not (tmp_path / "db.sqlite3").exists()


@pytest.mark.slow
def test_a_relative_database_path_is_resolved_against_the_project_directory(
    tmp_path: Path
) -> None:
    project = tmp_path / "project"
    shutil.copytree(EXAMPLE_PROJECT, project,
                    ignore=shutil.ignore_patterns(".scrapy", "__pycache__"))
    expected = project / "data" / "shop.sqlite3"
    (project / "logs").mkdir()
    for cwd in (project, project / "logs"):  # from the project and from a subfolder
        result = _crawl("IDEMPOTENT_DATABASE=data/{spider}.sqlite3", cwd=cwd)
        output = result.stdout + result.stderr
        assert result.returncode == 0, output
        # the first crawl reached CLOSESPIDER_PAGECOUNT = 1 (the run's one page, failed):
        # the second resumes that run, in the same file, and closes at once
        started = "started" if cwd == project else "resumed"
        assert f"{started} run 1 in {expected}:" in output, output
    assert expected.exists()
    assert not (project / "logs" / "data").exists()


@pytest.mark.parametrize("keys", [{"dict": "sku"}, {"dict": ["shop", "sku"]}])
def test_a_record_id_field_naming_a_natural_key_field_is_refused(keys):
    """The record ID stamped into that field would erase the key in the stored data."""
    with pytest.raises(ConfigError) as caught:
        config({"IDEMPOTENT_NATURAL_KEYS": keys, "IDEMPOTENT_RECORD_ID_FIELD": "sku"})
    assert (caught.value.setting, caught.value.value) == ("IDEMPOTENT_RECORD_ID_FIELD", "sku")
    assert "no natural key field" in str(caught.value)


@pytest.mark.parametrize("value", [["A"], {"*": "x"}, {"A": ""}, {"A": 1}, "{not json"])
def test_a_bad_record_types_setting_names_it(value: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        config({"IDEMPOTENT_RECORD_TYPES": value})
    assert caught.value.setting == "IDEMPOTENT_RECORD_TYPES"
    assert "the record type its records are identified by" in str(caught.value)


def test_record_types_map_classes_given_as_classes_or_json_text() -> None:
    class Renamed(scrapy.Item):
        pass

    assert config({"IDEMPOTENT_RECORD_TYPES": {Renamed: "old.Item"}}).record_types == {
        f"{__name__}.{Renamed.__qualname__}": "old.Item"}
    assert config({"IDEMPOTENT_RECORD_TYPES": '{"New": "old.Item"}'}).record_types == {
        "New": "old.Item"}
