"""Crash-safe, idempotent Scrapy crawls: a durable leased frontier, record IDs derived from
item data, and upserts committed together with the completion of their request."""

from __future__ import annotations

__version__ = "0.1.0"

from .addon import Addon
from .exceptions import (
    ConfigError,
    IdempotentError,
    MissingNaturalKey,
    StoreError,
    UnstorableRequest,
    UnsupportedScrapy,
)
from .feeds import IdempotentFeedExporter
from .journal import ResponseJournalMiddleware
from .middleware import RecordIdMiddleware
from .pipeline import UpsertPipeline
from .scheduler import IdempotentScheduler
from .store import SQLiteStore

__all__ = [
    "Addon",
    "ConfigError",
    "IdempotentError",
    "IdempotentFeedExporter",
    "IdempotentScheduler",
    "MissingNaturalKey",
    "RecordIdMiddleware",
    "ResponseJournalMiddleware",
    "SQLiteStore",
    "StoreError",
    "UnstorableRequest",
    "UnsupportedScrapy",
    "UpsertPipeline",
    "__version__",
]
