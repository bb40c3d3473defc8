"""Queue-fed worker processes for the kill tests on every broker: ``scrapy runspider`` of the
queue spider (``tests/queue_spiders.py``) in the example project, fed from a broker's queue,
and SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Protocol

from local_site import LocalSite

from crawling import EXAMPLE_PROJECT

SPIDER_FILE = Path(__file__).resolve().parent.parent / "queue_spiders.py"


class WorkerQueue(Protocol):
    """What a worker needs of a broker's queue: its URL and the broker's own settings."""

    url: str

    def settings(self) -> tuple[str, ...]: ...


def start_worker(queue: WorkerQueue, db: str, log: Path, *settings: str) -> Any:
    """``scrapy runspider`` of the queue spider in the example project, fed from ``queue``."""
    command = [sys.executable, "-m", "scrapy", "runspider", str(SPIDER_FILE),
               "-s", f"IDEMPOTENT_DATABASE={db}", "-s", f"LOG_FILE={log}",
               "-s", f"IDEMPOTENT_QUEUE_URL={queue.url}",
               "-s", "IDEMPOTENT_QUEUE_POLL_SECONDS=0.05", "-s", "LOG_LEVEL=INFO"]
    for setting in (*queue.settings(), *settings):
        command += ["-s", setting]
    return subprocess.Popen(command, cwd=EXAMPLE_PROJECT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env=dict(os.environ))


def kill(process: Any) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def running(worker: Any, condition: Any) -> Any:
    """``condition``, failing at once if ``worker`` exited (a worker that could not start
    would otherwise be waited for until the timeout)."""
    def check() -> bool:
        if worker.poll() is not None:
            raise AssertionError(f"the worker exited with {worker.returncode}")
        return bool(condition())
    return check


def product_body(shop: LocalSite, number: int) -> dict[str, Any]:
    return {"url": f"{shop.url}/product/SKU-{number:05d}", "callback": "parse_product"}


def body_url(body: str) -> str:
    """The URL a message body asks for (a URL, or a JSON request object)."""
    text = body.strip()
    return str(json.loads(text)["url"]) if text.startswith("{") else text
