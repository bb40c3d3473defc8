"""Request identity in the frontier: fingerprints, and the keys of ``dont_filter`` requests.

A filtered request's key is its fingerprint (the crawler's ``REQUEST_FINGERPRINTER_CLASS``,
hex): a rediscovered link is the same entry. A request with ``dont_filter=True`` (or every
request when ``DUPEFILTER_CLASS`` is ``BaseDupeFilter``) gets a key derived from its parent's
key (``start`` for start requests, ``orphan`` for a request of no request), its fingerprint
and its rank among that parent's such requests with that fingerprint, so a replayed parent or
a restarted ``start()`` maps to the same keys and inserts nothing twice.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from typing import TYPE_CHECKING

from .codec import describe

if TYPE_CHECKING:
    from scrapy import Request

__all__ = ["RequestFingerprints", "RequestKeys"]

logger = logging.getLogger(__name__)


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


class RequestKeys:
    """Frontier keys of new requests (see the module docstring)."""

    def __init__(self) -> None:
        self._root_counts: Counter[str] = Counter()  # "scope|fingerprint" -> rank given

    def key(self, fingerprint: str, *, filtered: bool, parent_key: str | None,
            parent_counts: Counter[str] | None, is_start: bool) -> str:
        """The key of a request with ``fingerprint``. ``parent_counts``: the ranks already
        given among the parent's unfiltered requests (updated here)."""
        if filtered:
            return fingerprint
        if parent_key is not None and parent_counts is not None:
            scope = parent_key
            parent_counts[fingerprint] += 1
            rank = parent_counts[fingerprint]
        else:
            scope = "start" if is_start else "orphan"
            self._root_counts[f"{scope}|{fingerprint}"] += 1
            rank = self._root_counts[f"{scope}|{fingerprint}"]
        return hashlib.sha1(f"{scope}|{fingerprint}|{rank}".encode()).hexdigest()
