"""The engine hooks: how the in-flight tracker learns what the engine does with a request.

Scrapy has no public "the engine is done with this request" (a public
``Scheduler.finish_request`` has been proposed to Scrapy, under the title "Support
crash-tolerant crawls"; until something like it exists the hooks stay private). The exact
moment is the engine's private ``_slot.remove_request(request)``, which fires once per
handed-out request after its items went through the pipelines and its children were
enqueued, whatever the outcome. Besides it,
the tracker observes the downloader's output (a response, a failure, a retry or redirect),
the spider's final output and errors (errback output bypasses every spider middleware), and
each item's trip through the item pipelines.

:class:`EngineHooks` is the one place that installs and removes these hooks: it checks that
every private method exists on the running Scrapy in the shape the hooks call it
(:data:`HOOKED_METHODS`, :func:`check_engine`: refusing to run otherwise with
:class:`~.UnsupportedScrapy`, naming the method), shadows each with an instance attribute that
reports to an :class:`EngineObserver` and then calls the engine's own method, and deletes
those attributes again at close. :func:`close_spider_failed` closes a crawl that failed
after it started (a store error) so that ``scrapy crawl`` exits non-zero;
:func:`schedule_next_request` (and :class:`EngineWakeup`) wakes an idle engine when the store
says work appeared.

The differences between Scrapy releases are in :mod:`scrapy_idempotent.scrapy_compat`.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .scrapy_compat import close_spider, refuse_release, warn_if_untested

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from scrapy import Request
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from twisted.internet.defer import Deferred
    from twisted.python.failure import Failure

__all__ = [
    "HOOKED_METHODS",
    "EngineHooks",
    "EngineObserver",
    "EngineWakeup",
    "HookedMethod",
    "check_engine",
    "close_spider_failed",
    "exit_nonzero",
    "report_close_reason",
    "schedule_next_request",
    "shape_problem",
]


class EngineObserver(Protocol):
    """What :class:`EngineHooks` reports to (the scheduler). Each method is called from
    inside the engine, before (or around) the engine's own step, with the request the engine
    handed out; none may raise into the engine."""

    def request_finished(self, request: Request) -> None:
        """``_Slot.remove_request(request)``: Scrapy is done with ``request`` (its items went
        through the pipelines, its children were enqueued), whatever the outcome."""

    def request_sent(self, request: Request) -> None:
        """The downloader hands ``request`` to its download handler: it goes to the network
        now (a request answered by a downloader middleware, Scrapy's HTTP cache for one,
        never gets here)."""

    def downloader_output(self, result: Request | Response | Failure,
                          request: Request) -> Deferred[None] | None:
        """What the downloader (its middlewares) answered for ``request``: a response, a
        failure, or a new request (a redirect or retry). A Deferred returned is waited for
        before the engine passes the result on (to the callback); the downloader is free
        for other requests meanwhile."""

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


@dataclass(frozen=True)
class HookedMethod:
    """A private method of the engine the hooks wrap (or call), and the shape they rely on:
    the parameters they pass by position (``positional``, names as Scrapy 2.13 to 2.19 give
    them, a leading ``_`` ignored) and by keyword (``keywords``), and whether it is a
    coroutine function (the hook awaits it) or not (the hook returns what it returns). Any
    other parameter must have a default; ``shadowed``: replaced by an instance attribute,
    so the object must take one."""

    label: str  #: the owner as the messages name it: ``Scraper``, ``ExecutionEngine._slot``
    name: str
    positional: tuple[str, ...]
    keywords: tuple[str, ...] = ()
    coroutine: bool = False
    shadowed: bool = True

    @property
    def qualname(self) -> str:
        return f"{self.label}.{self.name}"


#: Every private method the hooks rely on, with its owner's path from the engine.
HOOKED_METHODS: tuple[tuple[str, HookedMethod], ...] = (
    ("_slot", HookedMethod("ExecutionEngine._slot", "remove_request", ("request",))),
    ("_slot.nextcall", HookedMethod("ExecutionEngine._slot.nextcall", "schedule", (),
                                    shadowed=False)),
    ("", HookedMethod("ExecutionEngine", "_handle_downloader_output", ("result", "request"))),
    ("scraper", HookedMethod("Scraper", "handle_spider_output_async",
                             ("result", "request", "response"), coroutine=True)),
    ("scraper", HookedMethod("Scraper", "handle_spider_error",
                             ("failure", "request", "response"))),
    ("scraper", HookedMethod("Scraper", "start_itemproc_async", ("item",), ("response",),
                             coroutine=True)),  # Scrapy 2.14
    ("scraper", HookedMethod("Scraper", "start_itemproc", ("item",), ("response",))),
    ("downloader.handlers", HookedMethod("DownloadHandlers", "download_request_async",
                                         ("request",), coroutine=True)),  # Scrapy 2.14
    ("downloader.handlers", HookedMethod("DownloadHandlers", "download_request",
                                         ("request", "spider"))),
)
#: the methods of which a release has one or the other: (2.14 on, 2.13)
_ALTERNATIVES = (("start_itemproc_async", "start_itemproc"),
                 ("download_request_async", "download_request"))


def _owner(engine: Any, path: str) -> Any:
    owner = engine
    for attribute in filter(None, path.split(".")):
        owner = getattr(owner, attribute, None)
    return owner


def _hooked_methods(engine: Any) -> list[tuple[Any, HookedMethod]]:
    """(owner, its description) of every private method the hooks wrap or call on
    ``engine``'s release (the scraper's item method is the one of that release)."""
    chosen = {_itemproc_name(getattr(engine, "scraper", None)), _send_name(engine)}
    alternatives = {name for pair in _ALTERNATIVES for name in pair}
    return [(_owner(engine, path), method) for path, method in HOOKED_METHODS
            if method.name not in alternatives or method.name in chosen]


def shape_problem(function: Any, method: HookedMethod) -> str | None:
    """How ``function`` (the method as found, bound) differs from the shape the hooks rely
    on (``method``), None when it does not: the first difference, in words."""
    if not (inspect.isfunction(function) or inspect.ismethod(function)):
        return None  # not a Python function (a test's mock): nothing to judge
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return "its signature cannot be read"
    kinds = {p.kind for p in signature.parameters.values()}
    # (*args, **kwargs): a wrapper (or a test's stand-in) may return an awaitable whatever
    # it is; its other parameters are still judged
    generic = {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds
    if not generic and inspect.iscoroutinefunction(function) != method.coroutine:
        return ("it is a coroutine function" if not method.coroutine
                else "it is not a coroutine function")
    parameters = list(signature.parameters.values())
    by_position = [p for p in parameters
                   if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    count = len(method.positional)
    shown = f"its parameters are ({_shown(signature)})"
    names = tuple(p.name.lstrip("_") for p in by_position[:count])
    takes_args = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    if names != method.positional and not (  # a wrapper's (*args) takes the rest
            takes_args and method.positional[:len(names)] == names):
        return shown
    rest = [p for p in parameters if p not in by_position[:count]
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in parameters)
    by_keyword = {p.name for p in rest if p.kind is not p.POSITIONAL_ONLY}
    if not takes_kwargs and not set(method.keywords) <= by_keyword:
        return shown
    for p in rest:
        if p.default is p.empty and p.name not in method.keywords:
            return f"it needs {p.name!r} too: {shown}"
    return None


def _shown(signature: inspect.Signature) -> str:
    return ", ".join(str(p).split(":")[0].split("=")[0].strip()
                     for p in signature.parameters.values())


def _expected(method: HookedMethod) -> str:
    parameters = [*method.positional, *(["*"] if method.keywords else []), *method.keywords]
    return f"{'async ' if method.coroutine else ''}{method.qualname}({', '.join(parameters)})"


def _download_handlers(engine: Any) -> Any:
    return getattr(getattr(engine, "downloader", None), "handlers", None)


def _send_name(engine: Any) -> str:
    """The download handlers' method the downloader sends each request with:
    ``download_request_async(request)`` from Scrapy 2.14 on, ``download_request(request,
    spider)`` (returning a Deferred) in 2.13."""
    if callable(getattr(_download_handlers(engine), "download_request_async", None)):
        return "download_request_async"
    return "download_request"


def check_engine(engine: Any) -> None:
    """Raise :class:`~.UnsupportedScrapy` unless ``engine`` (an open ``ExecutionEngine``)
    has every private method the completion hooks wrap or call (present from Scrapy 2.13
    on), in the shape they rely on (:data:`HOOKED_METHODS`: its parameters, whether it is a
    coroutine function, an owner that takes an instance attribute); warn once about a
    release outside the tested range. The error names each method that differs and how, in
    one line: a changed method would otherwise complete requests wrongly, not fail."""
    missing: list[str] = []
    changed: list[str] = []
    for owner, method in _hooked_methods(engine):
        function = getattr(owner, method.name, None)
        if not callable(function):
            missing.append(f"{method.qualname}()")
            continue
        problem = shape_problem(function, method)
        if problem is None and method.shadowed and not hasattr(owner, "__dict__"):
            problem = "its object takes no instance attribute (__slots__)"
        if problem is not None:
            changed.append(f"{_expected(method)} ({problem})")
    if missing:
        raise refuse_release(
            f"the engine internals that exact completion hooks ({', '.join(missing)})")
    if changed:
        raise refuse_release(
            "the engine internals that exact completion hooks, in the shape it calls them: "
            + "; ".join(changed))
    warn_if_untested()


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
        handlers = _download_handlers(engine)
        send_name = _send_name(engine)
        send = getattr(handlers, send_name)

        def hooked_remove_request(request: Request) -> None:
            observer.request_finished(request)
            remove_request(request)

        def hooked_handle_output(result: Any, request: Request) -> Any:
            wait = observer.downloader_output(result, request)
            if wait is None:
                return handle_output(result, request)
            return wait.addCallback(lambda _: handle_output(result, request))

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
        if send_name == "download_request_async":
            async def download_request_async(request: Request) -> Response:
                observer.request_sent(request)
                response: Response = await send(request)
                return response
            self._shadow(handlers, send_name, download_request_async)
        else:  # Scrapy 2.13: returns a Deferred
            def download_request(request: Request, spider: Any) -> Any:
                observer.request_sent(request)
                return send(request, spider)
            self._shadow(handlers, send_name, download_request)
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


def schedule_next_request(crawler: Crawler) -> None:
    """Make the engine ask the scheduler for requests at the next turn of the reactor
    instead of at its next heartbeat (``_SLOT_HEARTBEAT_INTERVAL``, 5 s): the engine slot's
    ``nextcall.schedule()``, as the engine does itself when a download ends
    (scrapy/core/engine.py). Nothing when no spider is open."""
    slot = getattr(crawler.engine, "_slot", None)
    nextcall = getattr(slot, "nextcall", None)
    if nextcall is not None:
        nextcall.schedule()


class EngineWakeup:
    """Has the engine ask for requests at the next reactor turn: at once (:meth:`now`), or
    only when the last time it asked it got none (:meth:`if_asked_in_vain`, after a write
    that may bring requests: an engine woken between a download and its callback would send
    the next request before the callback's children, out of Scrapy's order)."""

    def __init__(self, crawler: Crawler) -> None:
        self._crawler = crawler
        #: the scheduler answered None since the engine was last woken
        self.asked_in_vain = False

    def now(self) -> None:
        schedule_next_request(self._crawler)

    def if_asked_in_vain(self) -> None:
        if self.asked_in_vain:
            self.asked_in_vain = False
            schedule_next_request(self._crawler)


def close_spider_failed(crawler: Crawler, reason: str) -> None:
    """Close the spider with ``reason`` as a failed crawl: ``scrapy crawl`` (and
    ``runspider``) then exits with 1 (see :func:`exit_nonzero`)."""
    exit_nonzero(crawler)
    close_spider(crawler, reason)


def report_close_reason(crawler: Crawler, reason: str) -> None:
    """Make the close under way (its ``spider_closed`` signal not sent yet) say ``reason``
    where it tells how the crawl ended, instead of the reason it started with (``finished``
    when a feed fails only at the close): the ``finish_reason`` stat, which Scrapy's
    ``CoreStats`` sets from the signal (set again by a handler connected after it), and
    Scrapy's ``Spider closed (...)`` line (a filter on the engine's logger gives that record
    this reason). The engine's own reason, as its close passes it to the scheduler and to
    the ``spider_closed`` handlers, cannot change (a local variable of
    ``ExecutionEngine.close_spider_async``); a Scrapy that words the line otherwise logs its
    own reason. Both are undone when the engine stops."""
    from scrapy import signals

    spider = crawler.spider
    stats = crawler.stats
    engine_logger = logging.getLogger("scrapy.core.engine")
    said = _CloseReasonFilter(spider, reason)

    def set_stat() -> None:
        if stats is not None:
            stats.set_value("finish_reason", reason)

    def remove() -> None:
        engine_logger.removeFilter(said)
        crawler.signals.disconnect(set_stat, signal=signals.spider_closed)
        crawler.signals.disconnect(remove, signal=signals.engine_stopped)

    engine_logger.addFilter(said)
    crawler.signals.connect(set_stat, signal=signals.spider_closed, weak=False)
    crawler.signals.connect(remove, signal=signals.engine_stopped, weak=False)


class _CloseReasonFilter(logging.Filter):
    """Gives Scrapy's ``Spider closed (%(reason)s)`` record of ``spider`` ``reason``."""

    def __init__(self, spider: Any, reason: str) -> None:
        super().__init__()
        self.spider = spider
        self.reason = reason

    def filter(self, record: logging.LogRecord) -> bool:
        if (record.msg == "Spider closed (%(reason)s)" and isinstance(record.args, dict)
                and getattr(record, "spider", None) is self.spider):
            record.args = {**record.args, "reason": self.reason}
        return True


#: The crawlers :func:`exit_nonzero` was called for.
_EXITS_NONZERO: weakref.WeakSet[Crawler] = weakref.WeakSet()


def exit_nonzero(crawler: Crawler) -> None:
    """Make ``scrapy crawl`` (and ``runspider``) exit with 1 once this crawl is over, whatever
    its close reason (a failure found while the spider closes, when the reason is set
    already). Scrapy (2.12 to 2.19) exits non-zero only when the crawl failed to start, which
    it tells by the crawler having no spider once the crawl is over
    (``CrawlerProcess._crawl``: ``bootstrap_failed |= not crawler.spider``), so the crawler
    forgets its spider when the engine has stopped: the last signal of a crawl, after every
    extension's close work. Calling it again changes nothing."""
    from scrapy import signals

    if crawler in _EXITS_NONZERO:
        return
    _EXITS_NONZERO.add(crawler)

    def forget_spider() -> None:
        crawler.spider = None

    crawler.signals.connect(forget_spider, signal=signals.engine_stopped, weak=False)
