"""Duplicate requests reported as Scrapy's duplicate filter reports them.

The frontier is the duplicate filter: a request without ``dont_filter`` whose fingerprint is
already in it (or buffered for it) is refused, so ``enqueue_request`` returns False and Scrapy
sends ``request_dropped``, as with its default ``RFPDupeFilter``
(scrapy/dupefilters.py). Like that filter, each refusal counts ``dupefilter/filtered`` and is
logged at DEBUG: the first one only, or every one with ``DUPEFILTER_DEBUG``.

``DUPEFILTER_CLASS``: ``scrapy.dupefilters.RFPDupeFilter`` (the default) filters by request
fingerprint (``REQUEST_FINGERPRINTER_CLASS``), as the frontier does; ``BaseDupeFilter``
filters nothing, and then every request is its own frontier entry (keyed by the request that
yielded it and its rank, as ``dont_filter`` requests are). Another class cannot be honoured (its
memory of seen requests does not survive a restart, the frontier's does) and is refused at
start with a :class:`~.ConfigError`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from scrapy.dupefilters import BaseDupeFilter, RFPDupeFilter
from scrapy.utils.misc import load_object
from scrapy.utils.request import referer_str

from .exceptions import ConfigError
from .scrapy_compat import stat_counter

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.settings import BaseSettings
    from scrapy.statscollectors import StatsCollector

__all__ = ["DuplicateFilter"]

logger = logging.getLogger(__name__)


class DuplicateFilter:
    """Whether duplicates are filtered, and their stat and log lines."""

    def __init__(self, *, enabled: bool, debug: bool, stats: StatsCollector) -> None:
        self.enabled = enabled
        self.debug = debug
        self.stats = stats
        self._count = stat_counter(stats)  # (for every duplicate)
        self._logged = False

    @classmethod
    def from_settings(cls, settings: BaseSettings, stats: StatsCollector) -> DuplicateFilter:
        """Raises :class:`~.ConfigError` for a ``DUPEFILTER_CLASS`` other than Scrapy's two."""
        return cls(enabled=cls._enabled(settings), debug=settings.getbool("DUPEFILTER_DEBUG"),
                   stats=stats)

    @classmethod
    def check(cls, settings: BaseSettings) -> None:
        """Refuse a ``DUPEFILTER_CLASS`` that cannot be honoured, before the crawl starts:
        one CRITICAL line, then the :class:`~.ConfigError`."""
        try:
            cls._enabled(settings)
        except ConfigError as exc:
            logger.critical("scrapy_idempotent: %s; the crawl was not started", exc)
            raise

    @staticmethod
    def _enabled(settings: BaseSettings) -> bool:
        value: Any = settings.get("DUPEFILTER_CLASS")
        try:
            dupefilter = load_object(value) if isinstance(value, str) else value
        except (ImportError, NameError, ValueError):
            dupefilter = None
        if dupefilter not in (RFPDupeFilter, BaseDupeFilter):
            raise ConfigError(
                "DUPEFILTER_CLASS", value,
                "scrapy.dupefilters.RFPDupeFilter (the default: the frontier filters by "
                "request fingerprint; change what is a duplicate with "
                "REQUEST_FINGERPRINTER_CLASS) or scrapy.dupefilters.BaseDupeFilter (no "
                "filtering); scrapy_idempotent keeps the seen requests in its frontier, so "
                "another duplicate filter would not be consulted",
            )
        return dupefilter is RFPDupeFilter

    def filtered(self, request: Request) -> None:
        """Count and log one refused duplicate (RFPDupeFilter.log's wording)."""
        if self.debug:
            logger.debug("Filtered duplicate request: %(request)s (referer: %(referer)s)",
                         {"request": request, "referer": referer_str(request)})
        elif not self._logged:
            logger.debug("Filtered duplicate request: %(request)s - no more duplicates will be "
                         "shown (see DUPEFILTER_DEBUG to show all duplicates)",
                         {"request": request})
            self._logged = True
        self._count("dupefilter/filtered")
