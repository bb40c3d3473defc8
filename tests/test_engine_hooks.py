"""The engine hooks (``scrapy_idempotent.engine_hooks``): installed on a real engine, reported
to an observer through the ``EngineObserver`` interface, and removed again."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import scrapy
from scrapy.core.engine import _Slot
from scrapy.utils.reactor import CallLaterOnce
from scrapy.utils.test import get_crawler

from scrapy_idempotent.engine_hooks import EngineHooks

HOOKED = [("_slot", "remove_request"), (None, "_handle_downloader_output"),
          ("scraper", "handle_spider_output_async"), ("scraper", "handle_spider_error")]


class Recorder:
    """An EngineObserver that records what it is told."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def request_finished(self, request: scrapy.Request) -> None:
        self.calls.append(("request_finished", request))

    def downloader_output(self, result: Any, request: scrapy.Request) -> None:
        self.calls.append(("downloader_output", request))

    def spider_output(self, result: Any, request: scrapy.Request, response: Any) -> Any:
        self.calls.append(("spider_output", request))
        return result

    def spider_error(self, failure: Any, request: scrapy.Request, response: Any) -> None:
        self.calls.append(("spider_error", request))

    @contextlib.contextmanager
    def item_in_pipelines(self, item: Any, response: Any) -> Iterator[None]:
        self.calls.append(("item_in_pipelines", item))
        yield


def _engine() -> Any:
    crawler = get_crawler(scrapy.Spider, {})
    crawler.spider = crawler._create_spider("hooked")
    engine = crawler._create_engine()
    engine._slot = _Slot(True, CallLaterOnce(lambda: None), None)
    return engine


def _owner(engine: Any, attribute: str | None) -> Any:
    return engine if attribute is None else getattr(engine, attribute)


def test_install_reports_to_the_observer_and_remove_restores_the_engine() -> None:
    engine = _engine()
    observer = Recorder()
    hooks = EngineHooks(engine, observer)
    hooks.install()
    for attribute, name in HOOKED:
        assert name in vars(_owner(engine, attribute))  # shadowed on the instance
    request = scrapy.Request("https://example.com")
    engine._slot.add_request(request)
    engine._slot.remove_request(request)
    assert observer.calls == [("request_finished", request)]
    assert request not in engine._slot.inprogress  # the engine's own method ran too
    hooks.remove()
    hooks.remove()  # idempotent
    for attribute, name in HOOKED:
        assert name not in vars(_owner(engine, attribute))
    engine._slot.add_request(request)
    engine._slot.remove_request(request)
    assert len(observer.calls) == 1  # not reported any more
