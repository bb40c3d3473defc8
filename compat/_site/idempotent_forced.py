"""Force ``scrapy_idempotent.Addon`` on for every Scrapy crawler of this process, and record
what happened.

Installed by ``sitecustomize`` (this folder is put first on ``PYTHONPATH`` by
``compat/run.py``) when ``SCRAPY_IDEMPOTENT_COMPAT_EVENTS`` names a directory, so the pytest
process, its xdist workers and any process a test starts are all covered. Nothing is imported
at start-up: the patch is applied right after ``scrapy.crawler`` is first imported.

``SCRAPY_IDEMPOTENT_COMPAT_FORCE=1`` adds, to every ``Crawler`` as it is built,
``ADDONS = {"scrapy_idempotent.Addon": 0}`` and an ``IDEMPOTENT_DATABASE`` of its own: a new
SQLite file in ``SCRAPY_IDEMPOTENT_COMPAT_TMP`` or, when ``SCRAPY_IDEMPOTENT_COMPAT_POSTGRESQL``
names a PostgreSQL server (the URL of its ``postgres`` database), a new schema in it; ``0``
leaves crawlers alone (plain Scrapy) but still counts them. Every process appends one JSON
line per event to ``<events dir>/events-<pid>.jsonl``:

* ``crawler``: a ``Crawler`` was built (``forced``: whether the add-on was added);
* ``opened``: a spider was opened (``scheduler``: the class of the engine's scheduler;
  ``development_command``: ``fetch``, ``shell``... when the add-on is off by design);
* ``idempotent_open``: ``IdempotentScheduler.open`` ran.

Each event names the test that was running (``PYTEST_CURRENT_TEST``, which processes started
by a test inherit).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import itertools
import json
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

EVENTS_ENV = "SCRAPY_IDEMPOTENT_COMPAT_EVENTS"
FORCE_ENV = "SCRAPY_IDEMPOTENT_COMPAT_FORCE"
TMP_ENV = "SCRAPY_IDEMPOTENT_COMPAT_TMP"
POSTGRESQL_ENV = "SCRAPY_IDEMPOTENT_COMPAT_POSTGRESQL"

ADDON_PATH = "scrapy_idempotent.Addon"
#: Above every named priority (cmdline is 40): a test's own settings cannot undo the forcing.
FORCED_PRIORITY = 100

_databases = itertools.count(1)
_events_file: Any = None


def current_test() -> str:
    """The pytest node id of the running test ("" outside a test)."""
    value = os.environ.get("PYTEST_CURRENT_TEST", "")
    return value.rsplit(" (", 1)[0]


def record(event: str, **fields: Any) -> None:
    """Append one event line (flushed at once: a test may kill its process)."""
    global _events_file
    if _events_file is None:
        path = os.path.join(os.environ[EVENTS_ENV], f"events-{os.getpid()}.jsonl")
        _events_file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (for the process)
    fields.update(event=event, test=current_test(), pid=os.getpid())
    _events_file.write(json.dumps(fields) + "\n")
    _events_file.flush()


def new_database() -> str:
    """The ``IDEMPOTENT_DATABASE`` of a new, empty frontier for one crawler."""
    number = next(_databases)
    server = os.environ.get(POSTGRESQL_ENV)
    if not server:
        return os.path.join(os.environ[TMP_ENV], f"{os.getpid()}-{number}.sqlite3")
    # a schema of its own in the server's database (the store creates it)
    return f"{server}?schema=compat_{os.getpid()}_{number}"


def _class_name(obj: object) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _scheduler_of(crawler: Any) -> object:
    from scrapy_idempotent.scrapy_compat import engine_scheduler  # every supported release

    return engine_scheduler(crawler)


def _development_command() -> str | None:
    """The Scrapy development command this process runs (``fetch``, ``shell``...), for which
    the add-on turns itself off by design; None for crawls."""
    try:
        from scrapy_idempotent.addon import development_command
    except ImportError:
        return None
    return development_command()


def _patch_crawler(module: ModuleType) -> None:
    from scrapy import signals

    crawler_class = module.Crawler
    original_init = crawler_class.__init__
    force = os.environ.get(FORCE_ENV) == "1"

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if force:
            addons = dict(self.settings.getdict("ADDONS"))
            addons[ADDON_PATH] = 0
            self.settings.set("ADDONS", addons, priority=FORCED_PRIORITY)
            self.settings.set("IDEMPOTENT_DATABASE", new_database(),
                              priority=FORCED_PRIORITY)
            # Stamping a record ID into every item is a visible change by design (and the
            # package's documented opt-out); Scrapy's tests compare items field by field.
            self.settings.set("IDEMPOTENT_RECORD_ID_FIELD", "", priority=FORCED_PRIORITY)
        spider = getattr(self, "spidercls", None)
        record("crawler", forced=force, spider=_class_name(spider) if spider else None)

        def on_opened(spider: Any) -> None:
            record("opened", scheduler=_class_name(_scheduler_of(self)),
                   development_command=_development_command())

        # kept alive by the crawler: the dispatcher holds receivers weakly
        self._compat_on_opened = on_opened
        self.signals.connect(on_opened, signal=signals.spider_opened)

    crawler_class.__init__ = __init__
    _patch_scheduler()


def _patch_scheduler() -> None:
    from scrapy_idempotent.scheduler import IdempotentScheduler

    original_open = IdempotentScheduler.open

    def open(self: Any, spider: Any) -> Any:
        record("idempotent_open", spider=_class_name(spider))
        return original_open(self, spider)

    IdempotentScheduler.open = open  # type: ignore[method-assign]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` once ``name`` has been imported (and executed)."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        exec_module = loader.exec_module
        callback = self.callback

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            callback(module)

        loader.exec_module = exec_then_patch
        return spec


def install() -> None:
    """Patch ``scrapy.crawler.Crawler`` now if it is imported, else right after its import."""
    if not os.environ.get(EVENTS_ENV):
        return
    module = sys.modules.get("scrapy.crawler")
    if module is not None:
        _patch_crawler(module)
    else:
        sys.meta_path.insert(0, _AfterImport("scrapy.crawler", _patch_crawler))
