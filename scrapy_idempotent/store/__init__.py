"""Stores: the durable frontier, leases, runs and records behind one interface."""

from .base import (
    CommitResult,
    Completion,
    CrawlIdentity,
    FrontierStatus,
    FrontierStore,
    LeasedRequest,
    LeaseHolder,
    NewRequest,
    Record,
    Reject,
    RequestState,
    RunInfo,
    UnitOfWork,
)
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
    "Record",
    "Reject",
    "RequestState",
    "RunInfo",
    "SQLiteStore",
    "UnitOfWork",
]
