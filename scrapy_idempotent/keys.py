"""Request identity in the frontier: fingerprints, and the keys of ``dont_filter`` requests.

A filtered request's key is its fingerprint (the crawler's ``REQUEST_FINGERPRINTER_CLASS``,
hex): a rediscovered link is the same entry. A request with ``dont_filter=True`` (or every
request when ``DUPEFILTER_CLASS`` is ``BaseDupeFilter``) gets a key derived from its parent's
key (``start`` for start requests, ``orphan`` for a request of no request), its fingerprint
and its rank among that parent's such requests with that fingerprint, so a replayed parent or
a restarted ``start()`` maps to the same keys and inserts nothing twice.

The ranks of requests of no parent (``start`` and ``orphan``) are counted over the whole
crawl: a rank needs to know how many requests of that fingerprint came before in this run of
``start()``, so the counts cannot be dropped while ``start()`` goes on (an exact rank needs
every fingerprint seen; a probabilistic one would give another key to a start request the
next run, and fetch it again). They are kept in memory up to :data:`ROOT_COUNTS_IN_MEMORY`
fingerprints, then in a temporary SQLite file of this process (removed at close): memory stays
bounded however long the start list, at the cost of one small disk read per batch of start
requests.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sqlite3
import tempfile
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .codec import describe

if TYPE_CHECKING:
    from scrapy import Request

__all__ = ["ROOT_COUNTS_IN_MEMORY", "RequestFingerprints", "RequestKeys"]

logger = logging.getLogger(__name__)

#: Fingerprints of requests of no parent whose ranks are counted in memory; beyond, in a
#: temporary file (see the module docstring).
ROOT_COUNTS_IN_MEMORY = 100_000


class RequestFingerprints:
    """The crawler's request fingerprinter, as hex, with its errors logged once per type."""

    def __init__(self, fingerprinter: object) -> None:
        self.fingerprinter = fingerprinter
        self._errors: set[str] = set()  # exception types logged

    @property
    def name(self) -> str:
        """``module.QualName`` of the fingerprinter (kept in the store, to notice a change)."""
        cls = type(self.fingerprinter)
        return f"{cls.__module__}.{cls.__qualname__}"

    def __call__(self, request: Request) -> str | None:
        """The request's fingerprint (hex), or None when the request fingerprinter raises
        (logged once per exception type, with its traceback)."""
        try:
            fingerprint: bytes = self.fingerprinter.fingerprint(request)  # type: ignore[attr-defined]
            return fingerprint.hex()
        except Exception as exc:
            cause = type(exc).__name__
            if cause not in self._errors:
                self._errors.add(cause)
                logger.error(
                    "scrapy_idempotent: the request fingerprinter %s raised %s for %s: "
                    "such a request has no identity in the frontier and is not fetched "
                    "(further %s errors are counted in idempotent/requests/unidentified)",
                    self.name, cause, describe(request), cause, exc_info=True)
            return None


class _RootCounts:
    """How many requests of no parent had each ``scope|fingerprint`` so far: a Counter up to
    ``limit`` entries, then a table in a temporary SQLite file."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._memory: Counter[str] = Counter()
        self._file: sqlite3.Connection | None = None
        self._path: str | None = None

    def __len__(self) -> int:
        """Entries held in memory."""
        return len(self._memory)

    def add(self, names: Sequence[str]) -> list[int]:
        """Count one more of each of ``names`` (in order; a name may repeat); the rank of
        each, its count once counted."""
        if self._file is None and len(self._memory) + len(names) > self.limit:
            self._spill()
        if self._file is None:
            ranks = []
            for name in names:
                self._memory[name] += 1
                ranks.append(self._memory[name])
            return ranks
        batch = Counter(names)
        totals = dict(self._file.execute(
            "INSERT INTO counts (name, n) SELECT key, value FROM json_each(?) WHERE true"
            " ON CONFLICT (name) DO UPDATE SET n = n + excluded.n RETURNING name, n",
            (json.dumps(batch),)).fetchall())
        before = {name: totals[name] - count for name, count in batch.items()}
        ranks = []
        for name in names:
            before[name] += 1
            ranks.append(before[name])
        return ranks

    def _spill(self) -> None:
        descriptor, self._path = tempfile.mkstemp(prefix="idempotent-ranks-",
                                                  suffix=".sqlite3")
        os.close(descriptor)
        self._file = sqlite3.connect(self._path, isolation_level=None,
                                     check_same_thread=False)
        for pragma in ("journal_mode = OFF", "synchronous = OFF", "cache_size = -2000"):
            self._file.execute(f"PRAGMA {pragma}")
        self._file.execute(
            "CREATE TABLE counts (name TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID")
        self._file.execute("INSERT INTO counts SELECT key, value FROM json_each(?)",
                           (json.dumps(self._memory),))
        self._memory = Counter()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
            self._path = None


class RequestKeys:
    """Frontier keys of new requests (see the module docstring)."""

    def __init__(self, *, in_memory: int = ROOT_COUNTS_IN_MEMORY) -> None:
        #: "scope|fingerprint" -> rank given, for requests of no parent
        self._root_counts = _RootCounts(in_memory)

    def key(self, fingerprint: str, *, filtered: bool, parent_key: str | None,
            parent_counts: Counter[str] | None, is_start: bool) -> str:
        """The key of a request with ``fingerprint``. ``parent_counts``: the ranks already
        given among the parent's unfiltered requests (updated here)."""
        if filtered:
            return fingerprint
        if parent_key is not None and parent_counts is not None:
            parent_counts[fingerprint] += 1
            return _derived(parent_key, fingerprint, parent_counts[fingerprint])
        return self.root_keys([fingerprint], is_start=is_start)[0]

    def root_keys(self, fingerprints: Sequence[str], *, is_start: bool) -> list[str]:
        """The keys of unfiltered requests of no parent with ``fingerprints``, in the order
        they came (start requests with ``is_start``), as :meth:`key` gives them one by one."""
        scope = "start" if is_start else "orphan"
        ranks = self._root_counts.add([f"{scope}|{fingerprint}" for fingerprint in fingerprints])
        return [_derived(scope, fingerprint, rank)
                for fingerprint, rank in zip(fingerprints, ranks, strict=True)]

    def close(self) -> None:
        """Remove the temporary file of the counts (the crawl ends)."""
        self._root_counts.close()


def _derived(scope: str, fingerprint: str, rank: int) -> str:
    return hashlib.sha1(f"{scope}|{fingerprint}|{rank}".encode()).hexdigest()
