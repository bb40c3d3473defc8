"""The engine hooks (``scrapy_idempotent.engine_hooks``): installed on a real engine, reported
to an observer through the ``EngineObserver`` interface, and removed again."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import scrapy
from scrapy.core.engine import _Slot
from scrapy.utils.reactor import CallLaterOnce
from scrapy.utils.test import get_crawler

from scrapy_idempotent import UnsupportedScrapy
from scrapy_idempotent.engine_hooks import (
    HOOKED_METHODS,
    EngineHooks,
    HookedMethod,
    _hooked_methods,
    _owner,
    check_engine,
    shape_problem,
)

HOOKED = [("_slot", "remove_request"), (None, "_handle_downloader_output"),
          ("scraper", "handle_spider_output_async"), ("scraper", "handle_spider_error")]


class Recorder:
    """An EngineObserver that records what it is told."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def request_finished(self, request: scrapy.Request) -> None:
        self.calls.append(("request_finished", request))

    def request_sent(self, request: scrapy.Request) -> None:
        self.calls.append(("request_sent", request))

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


def test_install_reports_to_the_observer_and_remove_restores_the_engine() -> None:
    engine = _engine()
    observer = Recorder()
    hooks = EngineHooks(engine, observer)
    hooks.install()
    for attribute, name in HOOKED:
        assert name in vars(_owner(engine, attribute or ""))  # shadowed on the instance
    request = scrapy.Request("https://example.com")
    engine._slot.add_request(request)
    engine._slot.remove_request(request)
    assert observer.calls == [("request_finished", request)]
    assert request not in engine._slot.inprogress  # the engine's own method ran too
    hooks.remove()
    hooks.remove()  # idempotent
    for attribute, name in HOOKED:
        assert name not in vars(_owner(engine, attribute or ""))
    engine._slot.add_request(request)
    engine._slot.remove_request(request)
    assert len(observer.calls) == 1  # not reported any more


def _used_methods() -> list[Any]:
    """(owner path, HookedMethod) of every method the hooks wrap or call on this Scrapy (of
    the pairs a release has one of, the release's)."""
    used = {method for _, method in _hooked_methods(_engine())}
    return [pytest.param(path, method, id=method.qualname) for path, method in HOOKED_METHODS
            if method in used]


@pytest.mark.parametrize(("path", "method"), _used_methods())
def test_each_hooked_method_has_the_shape_the_hooks_rely_on(
        path: str, method: HookedMethod) -> None:
    """Fails, naming the method, when the installed Scrapy changed a private method the hooks
    wrap: its parameters, whether it is a coroutine function, or an owner without instance
    attributes. Such a release is refused at start (the tests below); this test says which
    method to look at, on every release of the matrix."""
    owner = _owner(_engine(), path)
    function = getattr(owner, method.name, None)
    assert callable(function), f"Scrapy {scrapy.__version__} has no {method.qualname}()"
    problem = shape_problem(function, method)
    assert problem is None, (
        f"{method.qualname}() changed shape in Scrapy {scrapy.__version__}: {problem}")
    if method.shadowed:
        assert hasattr(owner, "__dict__"), f"{method.label} takes no instance attribute"


def test_the_hooks_cover_every_method_they_install() -> None:
    engine = _engine()
    hooks = EngineHooks(engine, Recorder())
    hooks.install()
    shadowed = {f"{label}.{name}" for label, owner in (
        ("ExecutionEngine._slot", engine._slot), ("ExecutionEngine", engine),
        ("Scraper", engine.scraper), ("DownloadHandlers", engine.downloader.handlers))
        for name in vars(owner) if callable(vars(owner)[name])
        and name in {m.name for _, m in HOOKED_METHODS}}
    hooks.remove()
    assert shadowed == {m.qualname for _, m in _hooked_methods(engine) if m.shadowed}


def _with_spider(self: Any, *args: Any) -> None:
    """A private method that grew a required parameter."""


async def _a_coroutine(self: Any, *args: Any) -> None:
    """A private method that became a coroutine function."""


def _renamed(self: Any, response: Any, request: Any, spider: Any = None) -> None:
    """A private method whose parameters were swapped."""


@pytest.mark.parametrize(("path", "method"), _used_methods())
def test_a_hooked_method_of_another_shape_is_refused_naming_it(
        path: str, method: HookedMethod, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine()
    cls = type(_owner(engine, path))
    changes = [_renamed, _a_coroutine if not method.coroutine else _renamed]
    if method.positional:
        def with_spider(self: Any, *names: Any, spider: Any, **kwargs: Any) -> None:
            pass  # a new keyword-only parameter without a default
        changes.append(with_spider)
    for change in changes:
        monkeypatch.setattr(cls, method.name, change)
        caplog.clear()
        with caplog.at_level(logging.CRITICAL), pytest.raises(UnsupportedScrapy) as raised:
            check_engine(engine)
        message = str(raised.value)
        assert f"{method.qualname}(" in message, message
        assert "\n" not in message
        assert "in the shape it calls them" in message
        assert [r.getMessage() for r in caplog.records] == [
            f"{message}; the crawl was not started"]


def test_an_engine_whose_slot_takes_no_attributes_is_refused() -> None:
    engine = _engine()

    class SlotWithSlots:
        __slots__ = ("nextcall",)

        def __init__(self, nextcall: Any) -> None:
            self.nextcall = nextcall

        def remove_request(self, request: Any) -> None:
            pass

    engine._slot = SlotWithSlots(engine._slot.nextcall)
    with pytest.raises(UnsupportedScrapy, match=r"ExecutionEngine\._slot\.remove_request\("
                       r"request\) \(its object takes no instance attribute"):
        check_engine(engine)


@pytest.mark.parametrize(("path", "method"), _used_methods())
def test_a_mock_or_a_wrapper_taking_any_arguments_is_accepted(
        path: str, method: HookedMethod, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scrapy's own tests patch these methods with mocks, and a project may wrap one with
    ``(*args, **kwargs)``: neither shows a shape to refuse."""
    from unittest import mock

    engine = _engine()
    cls = type(_owner(engine, path))

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        pass

    async def async_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        pass

    for replacement in (mock.MagicMock(), wrapper, async_wrapper):
        monkeypatch.setattr(cls, method.name, replacement)
        check_engine(engine)
