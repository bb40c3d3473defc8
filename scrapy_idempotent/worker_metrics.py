"""``IDEMPOTENT_METRICS_LISTEN = "HOST:PORT"``: this crawl process's own figures for
Prometheus at ``http://HOST:PORT/metrics`` while its spider runs (``prometheus_client``, the
``metrics`` extra): the process's CPU time, memory and open files (``process_*``), Python's
garbage collector (``python_gc_*``), and its Scrapy stats as ``idempotent_process_stat{stat}``
(every numeric stat, the ``idempotent/...`` ones included); ``idempotent_process_info``
names the worker and the spider.

These are one process's figures, gone with it: the whole crawl's, kept through kills, are read
from the database by ``scrapy idempotent metrics``. The add-on enables the extension when the
setting is given; with manual wiring add
``EXTENSIONS = {"scrapy_idempotent.worker_metrics.WorkerMetrics": 0}``.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from scrapy import signals
from scrapy.exceptions import NotConfigured

from . import scrapy_compat
from .config import metrics_listen
from .exceptions import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterator

    from prometheus_client.core import Metric
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from typing_extensions import Self

__all__ = ["WorkerMetrics"]

logger = logging.getLogger(__name__)


class _StatsCollector:
    """The crawler's Scrapy stats, read at each scrape."""

    def __init__(self, crawler: Crawler, worker: str) -> None:
        self.crawler = crawler
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

        spider = self.crawler.spider
        yield InfoMetricFamily("idempotent_process", "This crawl process",
                               value={"worker": self.worker,
                                      "spider": spider.name if spider else ""})
        stats = GaugeMetricFamily("idempotent_process_stat",
                                  "This process's Scrapy stats (numeric ones), by name",
                                  labels=["stat"])
        assert self.crawler.stats is not None
        for name, value in sorted(self.crawler.stats.get_stats().items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                stats.add_metric([name], value)
        yield stats


class WorkerMetrics:
    """Serves this process's figures at :setting:`IDEMPOTENT_METRICS_LISTEN` from the spider's
    open to its close (prometheus_client's HTTP server, on a thread of its own)."""

    def __init__(self, crawler: Crawler, host: str, port: int) -> None:
        self.crawler = crawler
        self.host, self.port = host, port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        """Raises :class:`~scrapy.exceptions.NotConfigured` without the setting, and
        :class:`~.ConfigError` for a bad value or without prometheus_client."""
        with scrapy_compat.start_failure_exits_nonzero(crawler):
            address = metrics_listen(crawler.settings)
            if address is None:
                raise NotConfigured("IDEMPOTENT_METRICS_LISTEN is not set")
            try:
                import prometheus_client  # noqa: F401
            except ImportError:
                raise ConfigError("IDEMPOTENT_METRICS_LISTEN", f"{address[0]}:{address[1]}",
                                  "HOST:PORT with prometheus_client installed: pip install "
                                  "'scrapy_idempotent[metrics]'") from None
        extension = cls(crawler, *address)
        crawler.signals.connect(extension.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(extension.spider_closed, signal=signals.spider_closed)
        return extension

    def spider_opened(self, spider: Spider) -> None:
        from prometheus_client import (
            GC_COLLECTOR,
            PROCESS_COLLECTOR,
            CollectorRegistry,
            start_http_server,
        )

        scheduler = scrapy_compat.engine_scheduler(self.crawler)
        worker = str(getattr(scheduler, "worker", "") or "")
        registry = CollectorRegistry(auto_describe=False)
        for collector in (PROCESS_COLLECTOR, GC_COLLECTOR):
            registry.register(collector)
        registry.register(_StatsCollector(self.crawler, worker))
        try:
            self._server, self._thread = start_http_server(self.port, addr=self.host,
                                                           registry=registry)
        except OSError as exc:  # the crawl goes on without the endpoint
            logger.error("scrapy_idempotent: cannot serve this worker's metrics on %s:%d: %s",
                         self.host, self.port, exc)
            return
        logger.info("scrapy_idempotent: this worker's metrics at http://%s:%d/metrics",
                    self.host, self._server.server_port)

    def spider_closed(self, spider: Spider) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
