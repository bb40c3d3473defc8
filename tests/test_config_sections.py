"""The config's sections read with every other setting, once, by ``config_for``: the queue
input's ``IDEMPOTENT_QUEUE_*`` settings (``IdempotentConfig.queue``) and the Scrapy settings
the frontier follows (``HTTPERROR_*``, the scheduler's queue classes). A bad value is a
:class:`~.ConfigError` naming the setting, and stops ``scrapy crawl`` before it starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import scrapy
from scrapy.settings import Settings

from crawling import EXAMPLE_PROJECT
from scrapy_idempotent.config import IdempotentConfig, QueueConfig
from scrapy_idempotent.exceptions import ConfigError

REDIS_URL = "redis://127.0.0.1:9/0"  # never connected to: the settings are refused first


class XSpider(scrapy.Spider):
    name = "x"


def config(values: dict[str, Any]) -> IdempotentConfig:
    return IdempotentConfig.from_settings(Settings(values), XSpider())


def test_queue_settings_with_their_defaults(tmp_path: Path) -> None:
    database = str(tmp_path / "db.sqlite3")
    assert config({"IDEMPOTENT_DATABASE": database}).queue is None  # no queue input
    assert config({"IDEMPOTENT_DATABASE": database, "IDEMPOTENT_QUEUE_URL": REDIS_URL}
                  ).queue == QueueConfig(url=REDIS_URL, key="x:requests",
                                         group="scrapy_idempotent", idle_timeout_seconds=None,
                                         claim_idle_seconds=300.0, prefetch=100,
                                         poll_seconds=0.2)
    given = config({"IDEMPOTENT_DATABASE": database, "IDEMPOTENT_QUEUE_URL": REDIS_URL,
                    "IDEMPOTENT_QUEUE_KEY": "jobs:{spider}", "IDEMPOTENT_QUEUE_GROUP": "g",
                    "IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS": "30",
                    "IDEMPOTENT_QUEUE_PREFETCH": "5"}).queue
    assert given is not None
    assert (given.key, given.parked_key, given.group) == ("jobs:x", "jobs:x:parked", "g")
    assert (given.idle_timeout_seconds, given.prefetch) == (30.0, 5)


@pytest.mark.parametrize(("name", "value", "allowed"), [
    ("IDEMPOTENT_QUEUE_URL", "http://localhost", "a Redis URL"),
    ("IDEMPOTENT_QUEUE_URL", 6379, "a Redis URL"),
    ("IDEMPOTENT_QUEUE_KEY", "   ", "a Redis key"),
    ("IDEMPOTENT_QUEUE_KEY", 5, "a Redis key"),
    ("IDEMPOTENT_QUEUE_GROUP", "", "a non-empty consumer group name"),
    ("IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS", "soon", "a number >= 0"),
    ("IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS", 0.5, "a number >= 1"),
    ("IDEMPOTENT_QUEUE_PREFETCH", 0, "an integer >= 1"),
    ("IDEMPOTENT_QUEUE_PREFETCH", 2.5, "an integer >= 1"),
    ("IDEMPOTENT_QUEUE_POLL_SECONDS", 0, "a number >= 0.01"),
])
def test_a_bad_queue_setting_names_the_setting(tmp_path: Path, name: str, value: Any,
                                               allowed: str) -> None:
    values = {"IDEMPOTENT_DATABASE": str(tmp_path / "db.sqlite3"),
              "IDEMPOTENT_QUEUE_URL": REDIS_URL, name: value}
    with pytest.raises(ConfigError) as caught:
        config(values)
    assert caught.value.setting == name
    assert caught.value.value == value
    assert allowed in str(caught.value)


def test_the_scrapy_settings_the_frontier_follows(tmp_path: Path) -> None:
    database = str(tmp_path / "db.sqlite3")
    defaults = config({"IDEMPOTENT_DATABASE": database})
    assert (defaults.httperror_allow_all, defaults.httperror_allowed_codes) == (False, ())
    assert (defaults.queue_order.start_queue, defaults.queue_order.start_fifo,
            defaults.queue_order.other_fifo) == (True, True, False)  # Scrapy's defaults
    given = config({"IDEMPOTENT_DATABASE": database, "HTTPERROR_ALLOW_ALL": "1",
                    "HTTPERROR_ALLOWED_CODES": "404,410",
                    "SCHEDULER_MEMORY_QUEUE": "scrapy.squeues.FifoMemoryQueue",
                    "SCHEDULER_START_MEMORY_QUEUE": None})
    assert (given.httperror_allow_all, given.httperror_allowed_codes) == (True, (404, 410))
    assert (given.queue_order.start_queue, given.queue_order.other_fifo) == (False, True)


@pytest.mark.parametrize(("name", "value"), [
    ("HTTPERROR_ALLOWED_CODES", ["404", "gone"]),
    ("HTTPERROR_ALLOW_ALL", "sometimes"),
])
def test_a_bad_httperror_setting_names_the_setting(tmp_path: Path, name: str,
                                                   value: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        config({"IDEMPOTENT_DATABASE": str(tmp_path / "db.sqlite3"), name: value})
    assert caught.value.setting == name
    assert caught.value.value == value


@pytest.mark.slow
def test_a_bad_queue_setting_stops_scrapy_crawl_with_one_critical_line(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    database = tmp_path / "db.sqlite3"
    result = subprocess.run(
        [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", "url=http://127.0.0.1:9",
         "-s", "LOG_LEVEL=INFO", "-s", f"IDEMPOTENT_DATABASE={database}",
         "-s", f"IDEMPOTENT_QUEUE_URL={REDIS_URL}", "-s", "IDEMPOTENT_QUEUE_PREFETCH=0"],
        cwd=EXAMPLE_PROJECT, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    critical = [line for line in output.splitlines() if "CRITICAL" in line]
    assert len(critical) == 1, output
    assert "IDEMPOTENT_QUEUE_PREFETCH='0'" in critical[0], critical
    assert "an integer >= 1" in critical[0]
    assert "Traceback" not in output, output
    assert not database.exists()  # nothing was started
