"""Stores: the durable frontier, leases, runs and records behind one interface
(:mod:`.base`), the backend a database string names (:func:`open_store`, :mod:`.registry`),
and the SQLite backend (:mod:`.sqlite`)."""

from .base import (
    CommitResult,
    Completion,
    CrawlIdentity,
    FrontierStatus,
    FrontierStore,
    LeasedRequest,
    LeaseHolder,
    NewRequest,
    OutboxEntry,
    OutboxOutcome,
    OutboxState,
    Record,
    Reject,
    RequestState,
    RunInfo,
    UnitOfWork,
)
from .registry import open_store, register_backend
from .sqlite import SCHEMA_VERSION, SQLiteStore

__all__ = [
    "SCHEMA_VERSION",
    "CommitResult",
    "Completion",
    "CrawlIdentity",
    "FrontierStatus",
    "FrontierStore",
    "LeaseHolder",
    "LeasedRequest",
    "NewRequest",
    "OutboxEntry",
    "OutboxOutcome",
    "OutboxState",
    "Record",
    "Reject",
    "RequestState",
    "RunInfo",
    "SQLiteStore",
    "UnitOfWork",
    "open_store",
    "register_backend",
]
