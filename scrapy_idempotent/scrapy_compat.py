"""The Scrapy releases this package runs on, and every difference between them.

Exact request completion hooks private methods of Scrapy's engine (see
:mod:`scrapy_idempotent.engine_hooks`), and a few public APIs the package uses are newer than
the oldest supported release. Everything that differs between Scrapy releases lives here, one
function per API, each naming the Scrapy release that changed it, detected by feature (does
the method exist?) wherever that is possible and by version only where the difference is a
behaviour, not a name.

Supported: Scrapy 2.13 (the first with the asynchronous ``Spider.start()``) to 2.19, each
minor release tested by the CI matrix. An older Scrapy, or one that lacks a hook or changed its
shape (:func:`~.engine_hooks.check_engine`), is refused
at start with :class:`~.UnsupportedScrapy`; a newer one that still has every hook runs with
one warning.

The hooks themselves, and why they are private, are in :mod:`scrapy_idempotent.engine_hooks`.

The differences, by the release that changed them:

* 2.13: ``Spider.start()``, ``Scraper.handle_spider_output_async`` (the oldest release);
  components are passed ``spider`` (they accept it as an optional argument); every command
  builds a crawler process (:func:`quiet_command`).
* 2.14: ``scrapy crawl`` starts the crawl inside the reactor (on 2.13 a start that fails
  at once leaves an unhandled failed Deferred: :func:`start_failure_exits_nonzero`);
  ``Scraper.start_itemproc_async`` (:class:`~.engine_hooks.EngineHooks`),
  ``ExecutionEngine.close_spider_async`` (:func:`close_spider`), ``get_spider_loader``
  (:func:`spider_loader`), ``SignalManager.send_catch_log_async`` (:func:`send_signal`).
* 2.15: download errors wrapped in Scrapy's own (:func:`failure_name`); a failed start exits
  non-zero (:func:`start_failure_exits_nonzero`); component dicts unified with their base
  (:func:`component_priorities`, :func:`disable_component`).
* 2.18: ``apply_uri_params`` (:func:`feed_uri`); callbacks run without the 0.1 s delay (a
  behaviour, nothing to adapt: ``CloseSpider`` takes effect sooner).
* 2.19: ``ExecutionEngine.scheduler`` (:func:`engine_scheduler`), ``Response.to_dict`` and
  ``response_from_dict`` (:func:`response_to_dict`, :func:`response_from_dict`); the stats
  collector's methods wrapped on each lookup (:func:`stat_counter`).
* Later (Scrapy's throttling pull request, not in 2.19.0): a throttler on the
  crawler decides a request's throttling scopes (``throttling_scopes`` meta key in place of
  ``download_slot``; ``THROTTLING_SCOPES`` in place of ``DOWNLOAD_SLOTS``;
  ``Downloader.get_slot_key`` and ``Downloader.slots`` deprecated): :func:`slot_key_of`,
  :func:`per_slot_settings`, :func:`downloader_slots`.
"""
from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import scrapy
from scrapy.utils.misc import load_object

from ._version import __version__
from .exceptions import UnsupportedScrapy

if TYPE_CHECKING:
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from scrapy.settings import BaseSettings
    from twisted.internet.defer import Deferred

__all__ = [
    "NEWEST_TESTED",
    "OLDEST_SUPPORTED",
    "check_scrapy",
    "close_spider",
    "component_priorities",
    "disable_component",
    "engine_scheduler",
    "failure_name",
    "feed_uri",
    "quiet_command",
    "refuse_release",
    "response_from_dict",
    "response_to_dict",
    "scrapy_version",
    "send_signal",
    "spider_loader",
    "start_failure_exits_nonzero",
    "supported_range",
    "supported_requirement",
    "warn_if_untested",
]

logger = logging.getLogger(__name__)

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


def supported_requirement() -> str:
    """``"scrapy>=2.13,<2.20"``: the requirement that installs a tested release (a Scrapy
    too new to have a hook is refused as one too old is, so ``>=`` alone would not do)."""
    return "scrapy>={}.{},<{}.{}".format(*OLDEST_SUPPORTED, NEWEST_TESTED[0],
                                         NEWEST_TESTED[1] + 1)


def refuse_release(lacks: str) -> UnsupportedScrapy:
    """The error refusing this Scrapy, logged first as one CRITICAL line (as a bad setting
    is), so the reason is the first thing ``scrapy crawl`` says."""
    error = UnsupportedScrapy(
        f"scrapy_idempotent {__version__} supports Scrapy {supported_range()}; the installed "
        f"Scrapy {scrapy.__version__} lacks {lacks}. Install a supported release "
        f"(pip install '{supported_requirement()}') or remove "
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
        raise refuse_release(" and ".join(missing))
    warn_if_untested()


def warn_if_untested() -> None:
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


# -- the engine and the spider -------------------------------------------------------------


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


def stat_counter(stats: Any) -> Callable[..., None]:
    """``stats.inc_value`` (``(key, count=1)``), for counts made for every link and every
    page. Scrapy 2.19's ``StatsCollector`` routes every attribute lookup through a Python
    ``__getattribute__`` (the deprecation of its methods' ``spider`` argument): a call of
    ``inc_value`` and its own read of the stats dict cost several microseconds. When
    ``inc_value`` is the base class's own, the count is added to the collector's dict as it
    would add it (the dict read at each count: ``set_stats`` may replace it). Another stats
    collector's ``inc_value`` is used as it is."""
    from scrapy.statscollectors import StatsCollector

    if isinstance(stats, StatsCollector) and type(stats).inc_value is StatsCollector.inc_value:
        read = object.__getattribute__

        def count(key: str, value: int = 1) -> None:
            data = read(stats, "_stats")
            data[key] = data.get(key, 0) + value
        return count
    inc_value: Callable[..., None] = stats.inc_value
    return inc_value


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
    except Exception as exc:
        if _START_FAILURE_EXITS_ZERO:
            _forget_spider_after_close(crawler)
        if _START_FAILURE_UNHANDLED and getattr(exc, "reported", False):
            _quiet_unhandled_deferred_log()
        raise


#: Scrapy 2.13's ``scrapy crawl`` calls ``Crawler.crawl`` before the reactor runs and, when
#: the crawl's Deferred has failed at once (a setting refused at start), sets the exit code
#: and drops that Deferred unhandled: Twisted then logs the error again, with its traceback,
#: as "Unhandled error in Deferred" (Scrapy 2.14 starts crawls inside the reactor).
_START_FAILURE_UNHANDLED = scrapy_version() < (2, 14)


class _QuietReportedFailures:
    """An observer in front of Twisted's Deferred logger (``twisted.internet.defer.log``)
    that drops the "Unhandled error in Deferred" report of an error this package has
    reported already (its ``reported`` attribute is true): the header event and the failure
    event that follows it. Everything else goes on to the observer it wraps, in order."""

    def __init__(self, observer: Any) -> None:
        self.observer = observer
        self._held: Any = None  # a header event, until the event that follows it is seen

    def __call__(self, event: Any) -> None:
        held, self._held = self._held, None
        failure = event.get("log_failure")
        if failure is not None and getattr(failure.value, "reported", False):
            return  # (and its header with it)
        if held is not None:
            self.observer(held)
        if failure is None and event.get("log_format") == "Unhandled error in Deferred:":
            self._held = event
            return
        self.observer(event)


def _quiet_unhandled_deferred_log() -> None:
    """Scrapy 2.13 (see :data:`_START_FAILURE_UNHANDLED`): an error reported already is not
    logged again by Twisted when its Deferred is dropped unhandled."""
    from twisted.internet import defer

    logger = getattr(defer, "log", None)
    observer = getattr(logger, "observer", None)
    if observer is None or isinstance(observer, _QuietReportedFailures):
        return
    logger.observer = _QuietReportedFailures(observer)  # type: ignore[union-attr]


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


# -- a forced stop --------------------------------------------------------------------------


def forced_stop_exits_nonzero() -> None:
    """Make a forced stop (a second Ctrl+C or SIGTERM while the graceful close runs: Scrapy's
    "forcing unclean shutdown") end ``scrapy crawl`` with exit code 1, not 0: the crawl did not
    close (its leases are taken back by the next crawl as a dead worker's).

    Scrapy's ``CrawlerProcess`` installs its ``_signal_shutdown`` as the handler of the
    shutdown signals once the reactor runs; the first signal installs ``_signal_kill`` for the
    next, which stops the reactor. ``scrapy crawl`` sets its exit code from the process's
    ``bootstrap_failed`` only, which a forced stop leaves false (scrapy/crawler.py,
    scrapy/commands/crawl.py). So the handlers found are wrapped: the kill handler sets
    ``bootstrap_failed`` first. Nothing is done when the handlers are not Scrapy's (a crawl
    run by a script's own ``CrawlerRunner``, a test)."""
    from twisted.internet import reactor as installed

    reactor: Any = installed

    def wrap(attempts: int = 2) -> None:
        import signal

        handler = signal.getsignal(signal.SIGINT)
        process = getattr(handler, "__self__", None)
        name = getattr(handler, "__name__", "")
        if name in ("_forced_stop_shutdown", "_forced_stop_kill"):
            return  # wrapped already (another crawl of this process)
        if process is None or not hasattr(process, "bootstrap_failed") or name not in (
                "_signal_shutdown", "_signal_shutdown_reactorless"):
            if attempts:  # Scrapy may install them later in the same startup
                reactor.callLater(0, wrap, attempts - 1)
            return
        _install_forced_stop_handlers(process, handler)

    reactor.callWhenRunning(wrap)


def _install_forced_stop_handlers(process: Any, shutdown: Any) -> None:
    from scrapy.utils.ossignal import install_shutdown_handlers

    def _forced_stop_shutdown(signum: int, frame: Any) -> None:
        import signal

        shutdown(signum, frame)  # Scrapy's: a graceful stop, its kill handler for the next
        kill = signal.getsignal(signum)
        if not callable(kill):
            return

        def _forced_stop_kill(signum: int, frame: Any) -> None:
            process.bootstrap_failed = True
            kill(signum, frame)

        install_shutdown_handlers(_forced_stop_kill)

    install_shutdown_handlers(_forced_stop_shutdown)


# -- download slots, or throttling scopes (Scrapy's throttling work) --------------------------


def has_throttling_scopes() -> bool:
    """Whether the installed Scrapy knows ``THROTTLING_SCOPES`` (its throttling work:
    the setting that replaces ``DOWNLOAD_SLOTS``)."""
    from scrapy.settings import default_settings

    return hasattr(default_settings, "THROTTLING_SCOPES")


def per_slot_settings(settings: BaseSettings) -> dict[str, dict[str, Any]]:
    """The per-slot entries of ``settings`` (slot -> its ``concurrency`` and ``delay``):
    ``DOWNLOAD_SLOTS``, and where the installed Scrapy has it ``THROTTLING_SCOPES``, whose
    entry for a slot wins key by key (as Scrapy merges them). Raises TypeError, ValueError or
    AttributeError on a malformed value."""
    merged: dict[str, dict[str, Any]] = {
        str(slot): dict(given or {}) for slot, given in settings.getdict("DOWNLOAD_SLOTS").items()}
    if has_throttling_scopes():
        for scope, given in settings.getdict("THROTTLING_SCOPES").items():
            merged[str(scope)] = {**merged.get(str(scope), {}), **dict(given or {})}
    return merged


def slot_key_of(downloader: Any, request: Any) -> str:
    """The key Scrapy's downloader throttles ``request`` under: with Scrapy's throttler (its
    throttling work), its scopes key (``throttling_scopes``, else a ``download_slot`` the
    user set, else the host name; several scopes as one JSON list); before it,
    ``Downloader.get_slot_key`` (``download_slot``, else the host name or its IP)."""
    throttler = getattr(getattr(downloader, "crawler", None), "throttler", None)
    scopes_key = getattr(throttler, "get_scopes_key", None)
    if scopes_key is not None:
        return str(scopes_key(request))
    return str(downloader.get_slot_key(request))


def downloader_slots(downloader: Any) -> dict[str, Any] | None:
    """The downloader's own slots (slot key -> ``scrapy.core.downloader.Slot``), or None
    where Scrapy's throttler keeps the limits instead (its throttling work deprecates
    ``Downloader.slots``)."""
    if getattr(getattr(downloader, "crawler", None), "throttler", None) is not None:
        return None
    slots: dict[str, Any] | None = getattr(downloader, "slots", None)
    return slots
