"""The Scrapy releases this package runs on, and every difference between them.

Exact request completion hooks private methods of Scrapy's engine (see
:mod:`scrapy_idempotent.scheduler`), and a few public APIs the package uses are newer than the
oldest supported release. Everything that differs between Scrapy releases lives here, one
function per API, each naming the Scrapy release that changed it, detected by feature (does
the method exist?) wherever that is possible and by version only where the difference is a
behaviour, not a name.

Supported: Scrapy 2.13 (the first with the asynchronous ``Spider.start()``) to 2.19, each
minor release tested by the CI matrix. An older Scrapy, or one that lacks a hook, is refused
at start with :class:`~.UnsupportedScrapy`; a newer one that still has every hook runs with
one warning.

Scrapy's issue scrapy/scrapy#7978 ("Support crash-tolerant crawls") proposes a public
``Scheduler.finish_request``; until something like it exists the hooks stay private.

The differences, by the release that changed them:

* 2.13: ``Spider.start()``, ``Scraper.handle_spider_output_async`` (the oldest release);
  components are passed ``spider`` (they accept it as an optional argument); every command
  builds a crawler process (:func:`quiet_command`).
* 2.14: ``Scraper.start_itemproc_async`` (:class:`EngineHooks`),
  ``ExecutionEngine.close_spider_async`` (:func:`close_spider`), ``get_spider_loader``
  (:func:`spider_loader`), ``SignalManager.send_catch_log_async`` (:func:`send_signal`).
* 2.15: download errors wrapped in Scrapy's own (:func:`failure_name`); a failed start exits
  non-zero (:func:`start_failure_exits_nonzero`); component dicts unified with their base
  (:func:`component_priorities`, :func:`disable_component`).
* 2.18: ``apply_uri_params`` (:func:`feed_uri`); callbacks run without the 0.1 s delay (a
  behaviour, nothing to adapt: ``CloseSpider`` takes effect sooner).
* 2.19: ``ExecutionEngine.scheduler`` (:func:`engine_scheduler`), ``Response.to_dict`` and
  ``response_from_dict`` (:func:`response_to_dict`, :func:`response_from_dict`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import scrapy
from scrapy.utils.misc import load_object

from . import __version__
from .exceptions import UnsupportedScrapy

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from scrapy import Request
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from scrapy.settings import BaseSettings
    from twisted.internet.defer import Deferred
    from twisted.python.failure import Failure

__all__ = [
    "NEWEST_TESTED",
    "OLDEST_SUPPORTED",
    "EngineHooks",
    "EngineObserver",
    "check_engine",
    "check_scrapy",
    "close_spider",
    "close_spider_failed",
    "component_priorities",
    "disable_component",
    "engine_scheduler",
    "failure_name",
    "feed_uri",
    "quiet_command",
    "response_from_dict",
    "response_to_dict",
    "scrapy_version",
    "send_signal",
    "spider_loader",
    "start_failure_exits_nonzero",
    "supported_range",
]

logger = logging.getLogger(__name__)

#: The oldest supported Scrapy release: the first with the asynchronous ``Spider.start()``
#: (and ``Scraper.handle_spider_output_async``, which the errback hook wraps).
OLDEST_SUPPORTED = (2, 13)
#: The newest Scrapy release the hooks are tested with.
NEWEST_TESTED = (2, 19)

_warned_untested = False


def scrapy_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the running Scrapy's ``__version__``);
    ``(0, 0)`` when it cannot be read."""
    match = re.match(r"(\d+)\.(\d+)", version if version is not None else scrapy.__version__)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def supported_range() -> str:
    """``"2.13 to 2.19"``: the releases the hooks are tested with."""
    return "{}.{} to {}.{}".format(*OLDEST_SUPPORTED, *NEWEST_TESTED)


def _refuse(lacks: str) -> UnsupportedScrapy:
    """The error refusing this Scrapy, logged first as one CRITICAL line (as a bad setting
    is), so the reason is the first thing ``scrapy crawl`` says."""
    error = UnsupportedScrapy(
        f"scrapy_idempotent {__version__} supports Scrapy {supported_range()}; the installed "
        f"Scrapy {scrapy.__version__} lacks {lacks}. Install a supported release "
        f"(pip install 'scrapy>={OLDEST_SUPPORTED[0]}.{OLDEST_SUPPORTED[1]}') or remove "
        "scrapy_idempotent from the settings"
    )
    logger.critical("%s; the crawl was not started", error)
    return error


def check_scrapy() -> None:
    """Refuse a Scrapy without what the package is built on, warn once about an untested one.

    Called when the add-on configures a crawl and again when the scheduler opens (manual
    wiring), before anything is fetched. Raises :class:`~.UnsupportedScrapy` naming what is
    missing; logs one warning for a release newer than :data:`NEWEST_TESTED` (or older than
    :data:`OLDEST_SUPPORTED`) that has every hook."""
    from scrapy import Spider
    from scrapy.settings import BaseSettings

    missing = []
    if not callable(getattr(Spider, "start", None)):  # Scrapy 2.13: async Spider.start()
        missing.append("the asynchronous Spider.start() (Scrapy 2.13)")
    if not callable(getattr(BaseSettings, "set_in_component_priority_dict", None)):
        missing.append("BaseSettings.set_in_component_priority_dict() (Scrapy 2.13)")
    if missing:
        raise _refuse(" and ".join(missing))
    _warn_if_untested()


def _warn_if_untested() -> None:
    global _warned_untested
    version = scrapy_version()
    if OLDEST_SUPPORTED <= version <= NEWEST_TESTED or _warned_untested:
        return
    _warned_untested = True
    logger.warning(
        "scrapy_idempotent %s is tested with Scrapy %s, not %s: the engine hooks it needs "
        "are present, but check that interrupted crawls resume correctly",
        __version__, supported_range(), scrapy.__version__,
    )


# -- the completion hooks -------------------------------------------------------------------


class EngineObserver(Protocol):
    """What :class:`EngineHooks` reports to (the scheduler). Each method is called from
    inside the engine, before (or around) the engine's own step, with the request the engine
    handed out; none may raise into the engine."""

    def request_finished(self, request: Request) -> None:
        """``_Slot.remove_request(request)``: Scrapy is done with ``request`` (its items went
        through the pipelines, its children were enqueued), whatever the outcome."""

    def downloader_output(self, result: Request | Response | Failure,
                          request: Request) -> None:
        """What the downloader (its middlewares) answered for ``request``: a response, a
        failure, or a new request (a redirect or retry)."""

    def spider_output(self, result: Any, request: Request,
                      response: Response | Failure) -> Any:
        """The final output of a callback or errback (an iterable or async iterable), before
        the scraper processes it; returns the iterable to process instead."""

    def spider_error(self, failure: Failure, request: Request,
                     response: Response | Failure) -> None:
        """An exception of a callback or errback (``CloseSpider`` included)."""

    def item_in_pipelines(self, item: Any,
                          response: Response | Failure | None) -> AbstractContextManager[Any]:
        """Entered while ``item`` goes through the item pipelines."""


def _itemproc_name(scraper: Any) -> str:
    # Scrapy 2.14 added Scraper.start_itemproc_async; 2.13 has the Deferred-returning
    # start_itemproc only (and calls it from both the scraper and the engine).
    if callable(getattr(scraper, "start_itemproc_async", None)):
        return "start_itemproc_async"
    return "start_itemproc"


def _hooked_methods(engine: Any) -> list[tuple[Any, str, str]]:
    """(object, its label, method name) of every private method the hooks wrap."""
    slot = getattr(engine, "_slot", None)
    scraper = getattr(engine, "scraper", None)
    return [
        (slot, "ExecutionEngine._slot", "remove_request"),
        (engine, "ExecutionEngine", "_handle_downloader_output"),
        (scraper, "Scraper", "handle_spider_output_async"),  # Scrapy 2.13
        (scraper, "Scraper", "handle_spider_error"),
        (scraper, "Scraper", _itemproc_name(scraper)),
    ]


def check_engine(engine: Any) -> None:
    """Raise :class:`~.UnsupportedScrapy` unless ``engine`` (an open ``ExecutionEngine``)
    has every private method the completion hooks wrap (present from Scrapy 2.13 on); warn
    once about a release outside the tested range."""
    missing = [f"{label}.{name}()" for obj, label, name in _hooked_methods(engine)
               if not callable(getattr(obj, name, None))]
    if missing:
        raise _refuse(f"the engine internals that exact completion hooks ({', '.join(missing)})")
    _warn_if_untested()


class EngineHooks:
    """The engine's private methods, wrapped so that ``observer`` learns when a handed-out
    request is completely processed (see :class:`EngineObserver`).

    :meth:`install` checks that every method exists (:func:`check_engine`) and shadows each
    with an instance attribute that reports to the observer and then calls the engine's own
    method; :meth:`remove` deletes those attributes again. One instance per open spider.
    """

    def __init__(self, engine: Any, observer: EngineObserver) -> None:
        self.engine = engine
        self.observer = observer
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        """Raises :class:`~.UnsupportedScrapy` (nothing installed) on a Scrapy without the
        hooks."""
        engine = self.engine
        check_engine(engine)
        observer = self.observer
        slot = engine._slot
        scraper = engine.scraper
        remove_request = slot.remove_request
        handle_output = engine._handle_downloader_output
        spider_output = scraper.handle_spider_output_async
        spider_error = scraper.handle_spider_error
        itemproc = _async_itemproc(scraper)

        def hooked_remove_request(request: Request) -> None:
            observer.request_finished(request)
            remove_request(request)

        def hooked_handle_output(result: Any, request: Request) -> Any:
            observer.downloader_output(result, request)
            return handle_output(result, request)

        async def hooked_spider_output(result: Any, request: Request,
                                       response: Response | Failure) -> None:
            await spider_output(observer.spider_output(result, request, response), request,
                                response)

        def hooked_spider_error(failure: Failure, request: Request,
                                response: Response | Failure) -> None:
            observer.spider_error(failure, request, response)
            spider_error(failure, request, response)

        async def hooked_itemproc(item: Any, *, response: Response | Failure | None) -> None:
            with observer.item_in_pipelines(item, response):
                await itemproc(item, response=response)

        self._shadow(slot, "remove_request", hooked_remove_request)
        self._shadow(engine, "_handle_downloader_output", hooked_handle_output)
        self._shadow(scraper, "handle_spider_output_async", hooked_spider_output)
        self._shadow(scraper, "handle_spider_error", hooked_spider_error)
        if _itemproc_name(scraper) == "start_itemproc_async":
            self._shadow(scraper, "start_itemproc_async", hooked_itemproc)
        else:  # Scrapy 2.13: its callers expect a Deferred
            from scrapy.utils.defer import deferred_from_coro

            def start_itemproc(item: Any, *, response: Response | Failure | None) -> Any:
                return deferred_from_coro(hooked_itemproc(item, response=response))
            self._shadow(scraper, "start_itemproc", start_itemproc)

    def _shadow(self, obj: Any, name: str, hook: Callable[..., Any]) -> None:
        setattr(obj, name, hook)  # an instance attribute shadows the method
        self._undo.append(lambda: delattr(obj, name))

    def remove(self) -> None:
        """Give the engine its own methods back (idempotent)."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def _async_itemproc(scraper: Any) -> Callable[..., Coroutine[Any, Any, None]]:
    """The scraper's "send one item through the item pipelines" as a coroutine function
    ``(item, *, response) -> None`` on every release."""
    if _itemproc_name(scraper) == "start_itemproc_async":
        method: Callable[..., Coroutine[Any, Any, None]] = scraper.start_itemproc_async
        return method
    from scrapy.utils.defer import maybe_deferred_to_future

    start_itemproc = scraper.start_itemproc  # Scrapy 2.13: returns a Deferred

    async def start_itemproc_async(item: Any, *, response: Any) -> None:
        await maybe_deferred_to_future(start_itemproc(item, response=response))
    return start_itemproc_async


def engine_scheduler(crawler: Crawler) -> Any:
    """The crawl's scheduler, or None before the engine has opened the spider:
    ``crawler.engine.scheduler`` (public in Scrapy 2.19), before that the engine slot's."""
    engine = crawler.engine
    if engine is None:
        return None
    try:
        return engine.scheduler
    except AttributeError:  # Scrapy < 2.19
        slot = getattr(engine, "_slot", None)
        return getattr(slot, "scheduler", None)


def schedule_next_request(crawler: Crawler) -> None:
    """Make the engine ask the scheduler for requests at the next turn of the reactor
    instead of at its next heartbeat (``_SLOT_HEARTBEAT_INTERVAL``, 5 s): the engine slot's
    ``nextcall.schedule()``, as the engine does itself when a download ends
    (scrapy/core/engine.py). Nothing when no spider is open."""
    slot = getattr(crawler.engine, "_slot", None)
    nextcall = getattr(slot, "nextcall", None)
    if nextcall is not None:
        nextcall.schedule()


def close_spider(crawler: Crawler, reason: str) -> Deferred[None] | None:
    """Ask the engine to close the spider with ``reason``; None when no spider is open.
    ``ExecutionEngine.close_spider_async(reason=...)`` (Scrapy 2.14), before that
    ``close_spider(spider, reason)``."""
    from scrapy.utils.defer import deferred_from_coro

    engine = crawler.engine
    if engine is None or engine.spider is None:
        return None
    if callable(getattr(engine, "close_spider_async", None)):
        return deferred_from_coro(engine.close_spider_async(reason=reason))
    closing: Deferred[None] = engine.close_spider(engine.spider, reason)  # Scrapy < 2.14
    return closing


def close_spider_failed(crawler: Crawler, reason: str) -> None:
    """Close the spider with ``reason`` as a failed crawl: ``scrapy crawl`` (and
    ``runspider``) then exits with 1. Scrapy (2.12 to 2.19) exits non-zero only when the
    crawl failed to start, which it tells by the crawler having no spider once the crawl is
    over (``CrawlerProcess._crawl``: ``bootstrap_failed |= not crawler.spider``), so the
    crawler forgets its spider when the engine has stopped: the last signal of a crawl,
    after every extension's close work."""
    from scrapy import signals

    def forget_spider() -> None:
        crawler.spider = None

    crawler.signals.connect(forget_spider, signal=signals.engine_stopped, weak=False)
    close_spider(crawler, reason)


def spider_loader(settings: BaseSettings) -> Any:
    """The project's spider loader: ``scrapy.spiderloader.get_spider_loader`` (Scrapy 2.14),
    before that the ``SPIDER_LOADER_CLASS`` built from the settings as ``CrawlerRunner``
    does."""
    from scrapy import spiderloader

    get_loader = getattr(spiderloader, "get_spider_loader", None)
    if get_loader is not None:
        return get_loader(settings)
    return load_object(settings["SPIDER_LOADER_CLASS"]).from_settings(settings.frozencopy())


def quiet_command(settings: BaseSettings) -> None:
    """For a command that only reads the database (from its ``process_options``):
    ``requires_crawler_process = False`` (Scrapy 2.14) spares it Scrapy's crawler process;
    Scrapy 2.13 builds one for every command, which logs Scrapy's start and versions at INFO
    on stderr, so there the log level is WARNING unless the command line sets one."""
    from scrapy.commands import ScrapyCommand
    from scrapy.settings import SETTINGS_PRIORITIES

    if "requires_crawler_process" in vars(ScrapyCommand):
        return
    if (settings.getpriority("LOG_LEVEL") or 0) < SETTINGS_PRIORITIES["cmdline"]:
        settings.set("LOG_LEVEL", "WARNING", priority="cmdline")


def component_priorities(settings: BaseSettings, name: str) -> Any:
    """A component priority dict setting merged with its ``_BASE`` (``{component: priority}``,
    ``None`` for a component turned off): ``get_component_priority_dict_with_base`` (Scrapy
    2.15, which also unifies keys given as classes and as import paths), before that
    ``getwithbase``."""
    merged = getattr(settings, "get_component_priority_dict_with_base", None)
    if merged is not None:
        return merged(name)
    return settings.getwithbase(name)


def disable_component(settings: BaseSettings, name: str, cls: type) -> None:
    """Turn ``cls`` off in the component priority dict setting ``name`` (``EXTENSIONS``,
    ...), including where it is enabled by the ``_BASE`` setting. Scrapy 2.15 unifies keys
    given as classes and as import paths; before that a class key leaves the import path of
    ``<name>_BASE`` enabled, so the import path is turned off instead."""
    if callable(getattr(settings, "get_component_priority_dict_with_base", None)):
        settings.set_in_component_priority_dict(name, cls, None)
        return
    components = settings.getdict(name)
    components[f"{cls.__module__}.{cls.__qualname__}"] = None
    settings.set(name, components, settings.getpriority(name) or 0)


def response_to_dict(response: Response) -> dict[str, Any]:
    """The data of ``response`` as ``Response.to_dict()`` (Scrapy 2.19) returns it: every
    attribute in ``Response.attributes`` except ``request`` and ``certificate``, headers as a
    dict, and ``_class`` for a subclass. The same dict on every release, so a journal written
    under one release is read under another."""
    to_dict = getattr(response, "to_dict", None)
    if to_dict is not None:
        data: dict[str, Any] = to_dict()
        return data
    return _response_to_dict(response)


def _response_to_dict(response: Response) -> dict[str, Any]:
    # Scrapy < 2.19 (tested against 2.19's own method on every release)
    data: dict[str, Any] = {"headers": dict(response.headers)}
    for name in response.attributes:
        if name not in ("request", "certificate"):
            data.setdefault(name, getattr(response, name))
    if type(response) is not scrapy.http.Response:
        data["_class"] = f"{type(response).__module__}.{type(response).__name__}"
    return data


def response_from_dict(data: dict[str, Any]) -> Response:
    """Inverse of :func:`response_to_dict`: ``scrapy.utils.response.response_from_dict``
    (Scrapy 2.19), before that the class named by ``_class`` (or guessed from the headers,
    URL and body by ``responsetypes``) built from the other keys."""
    from scrapy.utils import response as response_utils

    from_dict = getattr(response_utils, "response_from_dict", None)
    if from_dict is not None:
        response: Response = from_dict(data)
        return response
    return _response_from_dict(data)


def _response_from_dict(data: dict[str, Any]) -> Response:
    # Scrapy < 2.19
    from scrapy.http import Headers
    from scrapy.responsetypes import responsetypes

    kwargs = {key: value for key, value in data.items() if key != "_class"}
    kwargs["headers"] = Headers(kwargs.get("headers") or {})
    if "_class" in data:
        cls = load_object(data["_class"])
    else:
        cls = responsetypes.from_args(headers=kwargs["headers"], url=kwargs["url"],
                                      body=kwargs.get("body"))
    built: Response = cls(**kwargs)
    return built


#: Scrapy 2.15 wraps the Twisted exceptions of its download handlers into its own
#: (``scrapy.utils._download_handlers.wrap_twisted_exceptions``); before that the Twisted
#: ones reach the engine. Failure kinds use the 2.15 names on every release, so
#: ``scrapy idempotent retry --kind download_error/DownloadTimeoutError`` means the same
#: whichever Scrapy crawled. (module, class) of the Twisted exception -> Scrapy's name.
_DOWNLOAD_ERROR_NAMES = {
    ("twisted.web.error", "SchemeNotSupported"): "UnsupportedURLSchemeError",
    ("twisted.internet.defer", "CancelledError"): "DownloadCancelledError",
    ("twisted.internet.error", "ConnectionRefusedError"): "DownloadConnectionRefusedError",
    ("twisted.internet.error", "DNSLookupError"): "CannotResolveHostError",
    ("twisted.web._newclient", "ResponseFailed"): "DownloadFailedError",
    ("twisted.internet.error", "TimeoutError"): "DownloadTimeoutError",
    ("twisted.internet.defer", "TimeoutError"): "DownloadTimeoutError",
}


def failure_name(exc: object) -> str:
    """The name a download failure is recorded under (``download_error/<name>``): the class
    name, with the Twisted exceptions that Scrapy 2.15 and later wrap named as Scrapy names
    them (a subclass by its nearest mapped base, as ``isinstance`` matches there)."""
    for cls in type(exc).__mro__:
        name = _DOWNLOAD_ERROR_NAMES.get((cls.__module__, cls.__name__))
        if name is not None:
            return name
    return type(exc).__name__


#: Scrapy 2.15 counts a crawl whose start failed after its spider was built (an add-on, a
#: component or the scheduler's ``open`` raised) as a failed bootstrap, so ``scrapy crawl``
#: exits 1; Scrapy 2.13 and 2.14 only count a crawl that never built its spider, and exit 0.
_START_FAILURE_EXITS_ZERO = scrapy_version() < (2, 15)


@contextlib.contextmanager
def start_failure_exits_nonzero(crawler: Crawler) -> Iterator[None]:
    """Around a step of a crawl's start that may refuse it (a setting, the database, the
    Scrapy release): when the step raises, ``scrapy crawl`` exits non-zero on every release.

    Nothing to do on Scrapy 2.15 and later. On 2.13 and 2.14 ``CrawlerRunner`` decides on
    the crawler's ``spider`` attribute once the failed crawl has unwound, so it is cleared
    then: when the engine has reported the spider closed (after the ``spider_closed``
    handlers connected before this one), or at once when the engine has no slot to close
    (it was not built, or the scheduler could not be)."""
    try:
        yield
    except Exception:
        if _START_FAILURE_EXITS_ZERO:
            _forget_spider_after_close(crawler)
        raise


def _forget_spider_after_close(crawler: Crawler) -> None:
    from scrapy import signals

    def forget_spider() -> None:
        crawler.spider = None

    if getattr(crawler.engine, "_slot", None) is None:
        forget_spider()
    else:
        crawler.signals.connect(forget_spider, signals.spider_closed, weak=False)


# -- feeds and signals ----------------------------------------------------------------------


async def send_signal(crawler: Crawler, signal: object, **kwargs: Any) -> None:
    """Send ``signal`` and wait for its asynchronous handlers:
    ``SignalManager.send_catch_log_async`` (Scrapy 2.14), before that the Deferred of
    ``send_catch_log_deferred``."""
    manager = crawler.signals
    if callable(getattr(manager, "send_catch_log_async", None)):
        await manager.send_catch_log_async(signal, **kwargs)
        return
    from scrapy.utils.defer import maybe_deferred_to_future

    await maybe_deferred_to_future(manager.send_catch_log_deferred(signal, **kwargs))


def feed_uri(uri_template: str, params: dict[str, Any]) -> str:
    """A feed URI from its template: ``apply_uri_params`` (Scrapy 2.18, which leaves percent
    signs outside ``%(name)s`` placeholders alone), before that ``uri_template % params``
    as Scrapy itself did."""
    from scrapy.extensions import feedexport

    apply = getattr(feedexport, "apply_uri_params", None)
    if apply is not None:
        uri: str = apply(uri_template, params)
        return uri
    return uri_template % params
