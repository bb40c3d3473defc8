"""Crash-safe, idempotent Scrapy crawls: a durable leased frontier, record IDs derived from
item data, and upserts committed together with the completion of their request."""

from __future__ import annotations

from ._version import __version__
from .addon import Addon
from .conditional import ConditionalRequestMiddleware, SitemapLastmodMiddleware
from .exceptions import (
    ConfigError,
    DeliveryRefused,
    DeliveryRetry,
    IdempotentError,
    MissingNaturalKey,
    StoreError,
    UnstorableRequest,
    UnsupportedScrapy,
)
from .feeds import IdempotentFeedExporter
from .files import IdempotentFilesPipeline, IdempotentImagesPipeline
from .journal import ResponseJournalMiddleware
from .middleware import RecordIdMiddleware
from .outbox import OutboxTarget
from .outbox_delivery import OutboxDelivery
from .pipeline import UpsertPipeline
from .robots import CrawlRobotsTxtMiddleware
from .run_limits import RunCloseSpider
from .scheduler import IdempotentScheduler
from .slot_backoff import SlotBackoffMiddleware
from .store import SQLiteStore

__all__ = [
    "Addon",
    "ConditionalRequestMiddleware",
    "ConfigError",
    "CrawlRobotsTxtMiddleware",
    "DeliveryRefused",
    "DeliveryRetry",
    "IdempotentError",
    "IdempotentFeedExporter",
    "IdempotentFilesPipeline",
    "IdempotentImagesPipeline",
    "IdempotentScheduler",
    "MissingNaturalKey",
    "OutboxDelivery",
    "OutboxTarget",
    "RecordIdMiddleware",
    "ResponseJournalMiddleware",
    "RunCloseSpider",
    "SQLiteStore",
    "SitemapLastmodMiddleware",
    "SlotBackoffMiddleware",
    "StoreError",
    "UnstorableRequest",
    "UnsupportedScrapy",
    "UpsertPipeline",
    "__version__",
]
