"""``Addon``: one line in ``ADDONS`` wires the scheduler, the middleware and the pipeline."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .journal import ResponseJournalMiddleware
from .middleware import RecordIdMiddleware
from .pipeline import UpsertPipeline
from .scheduler import IdempotentScheduler

if TYPE_CHECKING:
    from scrapy.settings import BaseSettings

__all__ = ["JOURNAL_PRIORITY", "MIDDLEWARE_PRIORITY", "PIPELINE_PRIORITY", "Addon"]

#: Below StartSpiderMiddleware (25): the middleware sees the final output of every callback.
MIDDLEWARE_PRIORITY = 10
#: Next to the download handler (HttpCacheMiddleware is 900): journals raw responses.
JOURNAL_PRIORITY = 950
#: Above any usual pipeline: the upsert sees what every other pipeline let through.
PIPELINE_PRIORITY = 1000


class Addon:
    """``ADDONS = {"scrapy_idempotent.Addon": 0}`` is the same as::

        SCHEDULER = "scrapy_idempotent.IdempotentScheduler"
        SPIDER_MIDDLEWARES = {"scrapy_idempotent.RecordIdMiddleware": 10}
        DOWNLOADER_MIDDLEWARES = {"scrapy_idempotent.ResponseJournalMiddleware": 950}
        ITEM_PIPELINES = {"scrapy_idempotent.UpsertPipeline": 1000}
        EXTENSIONS = {"scrapy_idempotent.progress.IdempotentLogStats": 0}
    """

    def update_settings(self, settings: BaseSettings) -> None:
        settings.set("SCHEDULER", IdempotentScheduler, "addon")
        settings.set_in_component_priority_dict(
            "SPIDER_MIDDLEWARES", RecordIdMiddleware, MIDDLEWARE_PRIORITY)
        settings.set_in_component_priority_dict(
            "DOWNLOADER_MIDDLEWARES", ResponseJournalMiddleware, JOURNAL_PRIORITY)
        settings.set_in_component_priority_dict(
            "ITEM_PIPELINES", UpsertPipeline, PIPELINE_PRIORITY)
        from .progress import IdempotentLogStats  # the progress line

        settings.set_in_component_priority_dict("EXTENSIONS", IdempotentLogStats, 0)
