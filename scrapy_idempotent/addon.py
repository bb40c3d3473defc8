"""``Addon``: one line in ``ADDONS`` wires the scheduler, the middleware and the pipeline."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import scrapy_compat
from .conditional import (
    CONDITIONAL_PRIORITY,
    SITEMAP_PRIORITY,
    ConditionalRequestMiddleware,
    SitemapLastmodMiddleware,
)
from .journal import ResponseJournalMiddleware
from .middleware import RecordIdMiddleware
from .pipeline import UpsertPipeline
from .scheduler import IdempotentScheduler
from .slot_backoff import BACKOFF_PRIORITY, SlotBackoffMiddleware

if TYPE_CHECKING:
    from scrapy.crawler import Crawler
    from scrapy.settings import BaseSettings
    from typing_extensions import Self

__all__ = [
    "CRAWL_COMMANDS",
    "JOURNAL_PRIORITY",
    "MIDDLEWARE_PRIORITY",
    "PIPELINE_PRIORITY",
    "Addon",
    "development_command",
]

logger = logging.getLogger(__name__)

#: Below StartSpiderMiddleware (25): the middleware sees the final output of every callback.
MIDDLEWARE_PRIORITY = 10
#: Next to the download handler (HttpCacheMiddleware is 900): journals raw responses.
JOURNAL_PRIORITY = 950
#: Above any usual pipeline: the upsert sees what every other pipeline let through.
PIPELINE_PRIORITY = 1000


#: The commands of the ``scrapy`` tool that run the crawls users run. Every other command
#: (``shell``, ``fetch``, ``parse``, ``check``, ``bench``, a plugin's such as scrapy-poet's
#: ``savefixture``) runs its spider for a developer: with the frontier wired in, it would
#: store its one-off requests and items, and resume or finish the spider's real run.
#: Crawls started outside the tool (scripts, scrapyd's jobs) always get the add-on.
CRAWL_COMMANDS = frozenset({"crawl", "runspider"})


def development_command(argv: list[str] | None = None) -> str | None:
    """The command of the ``scrapy`` tool being run if it is not one of
    :data:`CRAWL_COMMANDS`, read from the tool's command line (``scrapy shell ...``,
    ``python -m scrapy ...``, ``python -m scrapy.cmdline ...``); None for crawls and for
    processes that are not the tool (scripts running crawlers, scrapyd's runner). Scrapy
    removes the command name from ``sys.argv``, so the process's original command line is
    read where the system keeps it (``/proc/self/cmdline``)."""
    if argv is None:
        argv = _process_argv()
    if not argv:
        return None
    program = Path(argv[0])
    if program.name not in {"scrapy", "scrapy.cmdline"} and program.parent.name != "scrapy":
        return None
    command = next((arg for arg in argv[1:] if not arg.startswith("-")), None)
    return command if command is not None and command not in CRAWL_COMMANDS else None


def _process_argv() -> list[str]:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return list(sys.argv)
    # python -m scrapy ...: drop the interpreter and its options up to the module name
    if len(args) > 2 and "-m" in args[:-1]:
        index = args.index("-m")
        args = [args[index + 1], *args[index + 2:]]
    elif args and Path(args[0]).name.startswith("python") and len(args) > 1:
        args = args[1:]
    return args


class Addon:
    """``ADDONS = {"scrapy_idempotent.Addon": 0}`` is the same as::

        SCHEDULER = "scrapy_idempotent.IdempotentScheduler"
        SPIDER_MIDDLEWARES = {"scrapy_idempotent.RecordIdMiddleware": 10,
            # IDEMPOTENT_CONDITIONAL_REQUESTS and IDEMPOTENT_SITEMAP_LASTMOD:
            "scrapy_idempotent.SitemapLastmodMiddleware": 990}
        DOWNLOADER_MIDDLEWARES = {"scrapy_idempotent.ResponseJournalMiddleware": 950,
            # IDEMPOTENT_CONDITIONAL_REQUESTS:
            "scrapy_idempotent.ConditionalRequestMiddleware": 940,
            "scrapy_idempotent.SlotBackoffMiddleware": 560,  # IDEMPOTENT_POLITENESS
            # ROBOTSTXT_OBEY:
            "scrapy.downloadermiddlewares.robotstxt.RobotsTxtMiddleware": None,
            "scrapy_idempotent.CrawlRobotsTxtMiddleware": 100}
        ITEM_PIPELINES = {"scrapy_idempotent.UpsertPipeline": 1000}
        # and, where the project enables them, at their priority:
        # "scrapy_idempotent.IdempotentFilesPipeline" for FilesPipeline,
        # "scrapy_idempotent.IdempotentImagesPipeline" for ImagesPipeline
        EXTENSIONS = {"scrapy_idempotent.progress.IdempotentLogStats": 0,
                      "scrapy_idempotent.queue_input.QueueInput": 0,  # IDEMPOTENT_QUEUE_URL
                      "scrapy_idempotent.OutboxDelivery": 0,  # IDEMPOTENT_OUTBOX_TARGETS
                      # IDEMPOTENT_METRICS_LISTEN:
                      "scrapy_idempotent.worker_metrics.WorkerMetrics": 0,
                      "scrapy.extensions.feedexport.FeedExporter": None,
                      "scrapy_idempotent.IdempotentFeedExporter": 0,
                      "scrapy.extensions.closespider.CloseSpider": None,
                      "scrapy_idempotent.RunCloseSpider": 0,
                      # spider.state is restored from the database by the scheduler
                      "scrapy.extensions.spiderstate.SpiderState": None}
    """

    def __init__(self, crawler: Crawler | None = None) -> None:
        self.crawler = crawler

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        return cls(crawler)

    def update_settings(self, settings: BaseSettings) -> None:
        """Wire the components into ``settings``. Raises :class:`~.UnsupportedScrapy` on a
        Scrapy release without what the package is built on (``scrapy crawl`` then stops
        before anything is fetched, and exits non-zero)."""
        command = development_command()
        if command is not None:
            logger.info("scrapy_idempotent is off for `scrapy %s`: only crawl and runspider "
                        "resume and write the crawl's database", command)
            return
        if self.crawler is not None:
            with scrapy_compat.start_failure_exits_nonzero(self.crawler):
                scrapy_compat.check_scrapy()
        else:
            scrapy_compat.check_scrapy()
        settings.set("SCHEDULER", IdempotentScheduler, "addon")
        settings.set_in_component_priority_dict(
            "SPIDER_MIDDLEWARES", RecordIdMiddleware, MIDDLEWARE_PRIORITY)
        settings.set_in_component_priority_dict(
            "DOWNLOADER_MIDDLEWARES", ResponseJournalMiddleware, JOURNAL_PRIORITY)
        settings.set_in_component_priority_dict(
            "DOWNLOADER_MIDDLEWARES", SlotBackoffMiddleware, BACKOFF_PRIORITY)
        settings.set_in_component_priority_dict(
            "DOWNLOADER_MIDDLEWARES", ConditionalRequestMiddleware, CONDITIONAL_PRIORITY)
        settings.set_in_component_priority_dict(
            "SPIDER_MIDDLEWARES", SitemapLastmodMiddleware, SITEMAP_PRIORITY)
        settings.set_in_component_priority_dict(
            "ITEM_PIPELINES", UpsertPipeline, PIPELINE_PRIORITY)
        from .progress import IdempotentLogStats  # the progress line

        settings.set_in_component_priority_dict("EXTENSIONS", IdempotentLogStats, 0)
        if settings.get("IDEMPOTENT_QUEUE_URL"):  # queue input only with a queue
            from .queue_input import QueueInput

            settings.set_in_component_priority_dict("EXTENSIONS", QueueInput, 0)
        if settings.get("IDEMPOTENT_OUTBOX_TARGETS"):  # delivery only with a target
            from .outbox_delivery import OutboxDelivery

            settings.set_in_component_priority_dict("EXTENSIONS", OutboxDelivery, 0)
        if settings.get("IDEMPOTENT_METRICS_LISTEN"):  # this process's own endpoint
            from .worker_metrics import WorkerMetrics

            settings.set_in_component_priority_dict("EXTENSIONS", WorkerMetrics, 0)
        _replace_feed_exporter(settings)
        _replace_close_spider(settings)
        _spider_state_from_the_database(settings)
        _replace_robots_txt(settings)
        _replace_media_pipelines(settings)
        if self.crawler is not None and self.crawler.spider is not None:
            # check every IDEMPOTENT_* setting before anything is built (a bad one is one
            # CRITICAL line and exit code 1)
            from .config import config_for

            with scrapy_compat.start_failure_exits_nonzero(self.crawler):
                config_for(self.crawler)


def _replace_media_pipelines(settings: BaseSettings) -> None:
    """Scrapy's ``FilesPipeline`` and ``ImagesPipeline`` in ``ITEM_PIPELINES`` replaced by
    :class:`~.IdempotentFilesPipeline` and :class:`~.IdempotentImagesPipeline` at their
    priority (files named by record ID); subclasses of them are left as they are."""
    from scrapy.pipelines.files import FilesPipeline
    from scrapy.pipelines.images import ImagesPipeline
    from scrapy.utils.misc import load_object

    from .files import IdempotentFilesPipeline, IdempotentImagesPipeline

    ours: dict[type, type] = {FilesPipeline: IdempotentFilesPipeline,
                              ImagesPipeline: IdempotentImagesPipeline}
    for name, value in scrapy_compat.component_priorities(settings, "ITEM_PIPELINES").items():
        try:
            cls = load_object(name) if isinstance(name, str) else name
        except (ImportError, NameError, ValueError, AttributeError):
            continue
        if cls in ours and value is not None:
            scrapy_compat.disable_component(settings, "ITEM_PIPELINES", cls)
            settings.set_in_component_priority_dict("ITEM_PIPELINES", ours[cls], value)


def _replace_feed_exporter(settings: BaseSettings) -> None:
    """Scrapy's ``FeedExporter`` off, :class:`~.IdempotentFeedExporter` in its place (at
    the priority it had), unless the project turned feed exports off."""
    from scrapy.extensions.feedexport import FeedExporter

    from .feeds import IdempotentFeedExporter

    _replace_extension(settings, FeedExporter, IdempotentFeedExporter)


def _spider_state_from_the_database(settings: BaseSettings) -> None:
    """Scrapy's ``SpiderState`` (``spider.state`` in a ``JOBDIR`` file, saved at a clean close
    only) off: the scheduler restores ``spider.state`` from the crawl's database and commits
    its changes with the pages that made them (:mod:`.spider_state`)."""
    from scrapy.extensions.spiderstate import SpiderState

    scrapy_compat.disable_component(settings, "EXTENSIONS", SpiderState)


def _replace_close_spider(settings: BaseSettings) -> None:
    """Scrapy's ``CloseSpider`` off, :class:`~.RunCloseSpider` (the ``CLOSESPIDER_*``
    counts of the run) in its place, unless the project turned it off."""
    from scrapy.extensions.closespider import CloseSpider

    from .run_limits import RunCloseSpider

    _replace_extension(settings, CloseSpider, RunCloseSpider)


def _replace_robots_txt(settings: BaseSettings) -> None:
    """Scrapy's ``RobotsTxtMiddleware`` off, :class:`~.CrawlRobotsTxtMiddleware` (robots.txt
    kept for the crawl, every request waiting for its site's rules) in its place, unless the
    project turned it off. Like Scrapy's, it does nothing without ``ROBOTSTXT_OBEY``."""
    from scrapy.downloadermiddlewares.robotstxt import RobotsTxtMiddleware

    from .robots import CrawlRobotsTxtMiddleware

    _replace_extension(settings, RobotsTxtMiddleware, CrawlRobotsTxtMiddleware,
                       "DOWNLOADER_MIDDLEWARES")


def _replace_extension(settings: BaseSettings, scrapy_cls: type, ours: type,
                       setting: str = "EXTENSIONS") -> None:
    """Scrapy's component ``scrapy_cls`` (an extension, or another component of the
    priority dict ``setting``) off and ``ours`` in its place, at the priority it had, unless
    the project turned it off (``None``)."""
    from scrapy.utils.misc import load_object

    priority: Any = 0
    for name, value in scrapy_compat.component_priorities(settings, setting).items():
        try:
            cls = load_object(name) if isinstance(name, str) else name
        except (ImportError, NameError, ValueError, AttributeError):
            continue
        if cls is scrapy_cls:
            if value is None:
                return  # turned off by the project
            priority = value
    scrapy_compat.disable_component(settings, setting, scrapy_cls)
    settings.set_in_component_priority_dict(setting, ours, priority)
