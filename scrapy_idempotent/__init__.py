"""Crash-safe, idempotent Scrapy crawls: a durable leased frontier, record IDs derived from
item data, and upserts committed together with the completion of their request."""

from __future__ import annotations

__version__ = "0.1.0"

from .addon import Addon  # noqa: E402
from .exceptions import (  # noqa: E402
    ConfigError,
    IdempotentError,
    MissingNaturalKey,
    StoreError,
    UnstorableRequest,
    UnsupportedScrapy,
)
from .journal import ResponseJournalMiddleware  # noqa: E402
from .middleware import RecordIdMiddleware  # noqa: E402
from .pipeline import UpsertPipeline  # noqa: E402
from .scheduler import IdempotentScheduler  # noqa: E402
from .store import SQLiteStore  # noqa: E402

__all__ = [
    "Addon",
    "ConfigError",
    "IdempotentError",
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
