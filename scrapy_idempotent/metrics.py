"""Crawl-wide metrics read from the store, in the Prometheus text format.

:class:`StoreCollector` is a ``prometheus_client`` collector that reads the frontier database
at scrape time (:meth:`~.FrontierStore.crawl_metrics`): the figures are those every worker
committed, on any host, so a worker killed with SIGKILL loses none of them and several
workers are not several partial views. ``scrapy idempotent metrics --listen HOST:PORT``
serves it (``prometheus_client`` is the ``metrics`` extra).

Names follow Prometheus' conventions: the ``idempotent_`` prefix, counters end in
``_total``, units in the name (``_seconds``); labels ``state``, ``run``, ``kind``,
``worker``, ``target``. Counters are read from the database, not kept in a process, so a
counter goes down only when an operator puts requests back (``scrapy idempotent retry``
resets their attempts), which Prometheus takes as a counter reset.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .workers import worker_state

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from .queue_input.broker import QueueBroker, QueueDepth
    from .store.base import CrawlMetrics, FrontierStore

__all__ = ["FRONTIER_READ_SHARE", "FRONTIER_WAIT_SECONDS", "QueueProbe", "StoreCollector",
           "metric_families"]

logger = logging.getLogger(__name__)

#: RunSummary field -> (metric name without ``_total``, help).
_RUN_COUNTERS: dict[str, tuple[str, str]] = {
    "leased": ("idempotent_run_requests_leased",
               "Leases handed out in the run (a request leased again counts again)"),
    "done": ("idempotent_run_pages_done", "Requests completed as done in the run"),
    "failed": ("idempotent_run_pages_failed", "Requests completed as failed in the run"),
    "redirected": ("idempotent_run_pages_redirected",
                   "Requests completed by a redirect in the run"),
    "records_inserted": ("idempotent_run_records_inserted",
                         "Records stored for the first time in the run"),
    "records_updated": ("idempotent_run_records_updated",
                        "Stored records whose content changed in the run"),
    "records_unchanged": ("idempotent_run_records_unchanged",
                          "Records seen again with the same content in the run"),
    "rejects": ("idempotent_run_items_rejected",
                "Items that could not become records in the run (kept as rejects)"),
    "records_stale": ("idempotent_run_records_stale",
                      "Records refused in the run: the stored one was observed later"),
    "leases_reclaimed": ("idempotent_run_leases_reclaimed",
                         "Leases taken back in the run from workers whose lease expired or "
                         "who died"),
    "leases_lost": ("idempotent_run_leases_lost",
                    "Completions refused in the run: their lease was another worker's by "
                    "then (their work was not written)"),
}


#: The frontier-wide figures (counts by state, failures by kind, attempts: passes over the
#: whole frontier) are read again at most once per this many times their last read took, so
#: that they keep the database busy for at most a tenth of the time however big the
#: frontier (a read of 40 ms is repeated at every scrape, one of 4 s every 40 s).
FRONTIER_READ_SHARE = 10


#: A scrape that finds the frontier-wide figures due waits for their new reading when the
#: last one took at most this many seconds (so it serves figures read for it, not those of
#: the scrape before), and at most this long; after a slower reading it serves the last one
#: and the new one is read in the background.
FRONTIER_WAIT_SECONDS = 1.0


#: The queue input's broker is asked for its depth at most once per this many seconds.
QUEUE_READ_SECONDS = 10.0


class QueueProbe:
    """The queue input's depth (:meth:`~.QueueBroker.depth`: messages waiting, held, parked),
    read on a thread of its own at most once per :data:`QUEUE_READ_SECONDS`: a scrape takes
    the last reading and never waits for the broker, so a broker that is slow or unreachable
    costs a scrape nothing (``idempotent_queue_up 0``, the reading's age grows)."""

    def __init__(self, open_broker: Callable[[], QueueBroker], *,
                 every: float = QUEUE_READ_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._open_broker = open_broker
        self._every = every
        self._clock = clock
        self._lock = threading.Lock()
        self._broker: QueueBroker | None = None
        self._depth: QueueDepth | None = None
        self._name = ""
        self._up = False
        self._read_at: float | None = None  #: clock of the last reading that answered
        self._started_at: float | None = None  #: clock when the last reading started
        self._reading: threading.Thread | None = None
        self._reported = False  #: a failure was logged (once until the broker answers)

    def reading(self) -> tuple[str, QueueDepth | None, bool, float | None]:
        """(queue name, the last depth read, whether the last read answered, seconds since
        that reading), starting a read in the background when due."""
        with self._lock:
            now = self._clock()
            due = self._started_at is None or now - self._started_at >= self._every
            if due and self._reading is None:
                self._started_at = now
                self._reading = threading.Thread(target=self._read, daemon=True,
                                                 name="idempotent-metrics-queue")
                self._reading.start()
            age = None if self._read_at is None else now - self._read_at
            return self._name, self._depth, self._up, age

    def _read(self) -> None:
        try:
            if self._broker is None:
                self._broker = self._open_broker()
            depth = self._broker.depth()
        except Exception as exc:  # the scrape answers; the failure is a figure and a line
            if not self._reported:
                logger.warning("scrapy_idempotent: metrics: cannot read the queue: %s", exc)
                self._reported = True
            broker, self._broker = self._broker, None
            if broker is not None:
                broker.close()
            with self._lock:
                self._up, self._reading = False, None
            return
        with self._lock:
            self._name = self._broker.name
            self._depth, self._up, self._read_at = depth, True, self._clock()
            self._reported, self._reading = False, None

    def close(self) -> None:
        if self._broker is not None:
            self._broker.close()


class StoreCollector(Collector):
    """Reads the store on every scrape. ``open_store`` returns an opened, read-only store
    (a new one per read, closed after it: a scrape may run on any of the HTTP server's
    threads, and a database connection is not shared between them).

    What each scrape reads: the runs' counters, the leases, the live workers and their
    heartbeats (cheap at any frontier size). The frontier-wide figures
    (:meth:`~.FrontierStore.crawl_metrics`: requests by state, failures by kind, attempts,
    the outbox) are read by the first scrape, then again on a thread of their own once
    :data:`FRONTIER_READ_SHARE` times their read time has passed. A scrape that starts (or
    finds running) such a reading waits for it when the last one took at most
    :data:`FRONTIER_WAIT_SECONDS`, and at most that long, so it serves the figures read
    for it; after a slower reading it serves the last one without waiting.
    ``idempotent_frontier_read_age_seconds`` says how old they are.

    A store that cannot be opened or read (no database yet, removed, the server down) is
    ``idempotent_store_up 0`` and one WARNING line, logged again only after the store was
    read (or with another reason)."""

    def __init__(self, open_store: Callable[[], FrontierStore], *,
                 clock: Callable[[], float] = time.monotonic,
                 queue: QueueProbe | None = None) -> None:
        self._open_store = open_store
        self._queue = queue
        self._clock = clock
        self._lock = threading.Lock()
        self._frontier: CrawlMetrics | None = None
        self._read_at = 0.0  #: clock when the last frontier read started
        self._read_seconds = 0.0
        self._reading: threading.Thread | None = None
        self._failure: str | None = None  #: the reason last logged, until a read succeeds

    def collect(self) -> Iterator[Metric]:
        if self._queue is not None:  # first: the broker is not asked while a store is read
            yield from _queue(*self._queue.reading())
        started = time.perf_counter()
        up = GaugeMetricFamily("idempotent_store_up",
                               "1 when the last scrape could read the frontier database")
        try:
            frontier = self._frontier_figures()
            store = self._open_store()
            try:
                metrics = dataclasses.replace(
                    frontier, read_at=time.time(), runs=tuple(store.runs()),
                    leases=tuple(store.lease_holders()),
                    live_workers=tuple(store.live_workers()), heartbeats=store.heartbeats())
            finally:
                store.close()
        except Exception as exc:  # the scrape answers; the failure is a figure and a line
            self._failed(exc)
            up.add_metric([], 0)
            yield up
            return
        self._failure = None
        up.add_metric([], 1)
        yield up
        yield from metric_families(metrics)
        yield GaugeMetricFamily("idempotent_frontier_read_age_seconds",
                                "Age of the frontier-wide figures (requests by state, "
                                "failures by kind, attempts): read again in the background",
                                value=max(0.0, metrics.read_at - frontier.read_at))
        yield GaugeMetricFamily("idempotent_frontier_read_seconds",
                                "Time the last read of the frontier-wide figures took",
                                value=self._read_seconds)
        yield GaugeMetricFamily("idempotent_store_read_seconds",
                                "Time this scrape took to read the frontier database",
                                value=time.perf_counter() - started)

    def _failed(self, exc: Exception) -> None:
        """One WARNING per reason, until a read succeeds again (a database not created yet
        is not a line per scrape)."""
        reason = str(exc)
        if reason != self._failure:
            self._failure = reason
            logger.warning("scrapy_idempotent: metrics: cannot read the store: %s", exc)

    def _frontier_figures(self) -> CrawlMetrics:
        """The frontier-wide reading this scrape serves: the first one is read here; a later
        one, when due, on a thread, waited for when the last reading was quick
        (:data:`FRONTIER_WAIT_SECONDS`)."""
        with self._lock:
            frontier = self._frontier
            due = (self._clock() - self._read_at
                   >= FRONTIER_READ_SHARE * self._read_seconds)
            if frontier is not None and due and self._reading is None:
                self._reading = threading.Thread(target=self._read_in_background,
                                                 daemon=True,
                                                 name="idempotent-metrics-frontier")
                self._reading.start()
            reading = self._reading if due else None
            quick = self._read_seconds <= FRONTIER_WAIT_SECONDS
        if frontier is None:
            return self._read_frontier()
        if reading is not None and quick:
            reading.join(FRONTIER_WAIT_SECONDS)
            with self._lock:
                frontier = self._frontier
        assert frontier is not None
        return frontier

    def _read_in_background(self) -> None:
        try:
            self._read_frontier()
        except Exception as exc:  # the last reading stays; the next scrape tries again
            self._failed(exc)

    def _read_frontier(self) -> CrawlMetrics:
        started = self._clock()
        try:
            store = self._open_store()
            try:
                metrics = store.crawl_metrics()
            finally:
                store.close()
        finally:
            with self._lock:
                self._reading = None
        with self._lock:
            self._frontier, self._read_at = metrics, started
            self._read_seconds = self._clock() - started
        return metrics


def metric_families(m: CrawlMetrics) -> Iterator[Metric]:
    """The metric families of one :class:`~.CrawlMetrics` reading."""
    yield from _frontier(m)
    yield from _runs(m)
    yield from _workers(m)
    yield from _revisits(m)
    outbox = GaugeMetricFamily("idempotent_outbox_entries",
                               "Outbox announcements by delivery target and state",
                               labels=["target", "state"])
    for target, states in sorted(m.outbox.items()):
        for state, n in sorted(states.items()):
            outbox.add_metric([target, state], n)
    yield outbox
    backlog = GaugeMetricFamily("idempotent_outbox_backlog",
                                "Outbox announcements waiting for delivery, by target",
                                labels=["target"])
    oldest = GaugeMetricFamily("idempotent_outbox_oldest_age_seconds",
                               "Age of the oldest announcement waiting for delivery, by "
                               "target (0: none waits)", labels=["target"])
    for target in sorted(m.outbox):
        waiting = m.outbox_backlog.get(target)
        backlog.add_metric([target], waiting.entries if waiting else 0)
        oldest.add_metric([target], max(0.0, m.read_at - waiting.oldest_at) if waiting else 0)
    yield backlog
    yield oldest


def _frontier(m: CrawlMetrics) -> Iterator[Metric]:
    requests = GaugeMetricFamily("idempotent_requests", "Frontier entries by state",
                                 labels=["state"])
    for state, n in sorted(m.requests.items()):
        requests.add_metric([state], n)
    yield requests
    yield GaugeMetricFamily("idempotent_records", "Records stored", value=m.records)
    failed = GaugeMetricFamily("idempotent_requests_failed",
                               "Failed frontier entries by error kind", labels=["kind"])
    for kind, n in sorted(m.failures.items()):
        failed.add_metric([kind or "unknown"], n)
    yield failed
    s = m.summary
    yield CounterMetricFamily("idempotent_leases", "Leases of the frontier's entries (attempts)",
                              value=s.leases)
    yield CounterMetricFamily("idempotent_downloads",
                              "Frontier entries' requests sent to the network (not answered "
                              "by the response journal or Scrapy's HTTP cache)",
                              value=s.downloads)
    yield CounterMetricFamily("idempotent_replays",
                              "Attempts answered from the response journal", value=s.replays)
    yield GaugeMetricFamily("idempotent_requests_downloaded_again",
                            "Frontier entries sent to the network more than once (retries, "
                            "requests in flight when a worker was killed)",
                            value=s.downloaded_again)
    yield GaugeMetricFamily("idempotent_requests_repeated",
                            "Frontier entries leased more than once", value=s.repeated)
    yield GaugeMetricFamily("idempotent_leases_expired",
                            "Leased entries whose lease time is over (their worker stopped "
                            "renewing: they are taken back)", value=s.expired_leases)


def _revisits(m: CrawlMetrics) -> Iterator[Metric]:
    r = m.revisits
    if r is None:
        return
    pages = GaugeMetricFamily("idempotent_revisit_pages",
                              "Pages kept for conditional requests: all of them, those with "
                              "a revisit time (adaptive revisits), those due now",
                              labels=["state"])
    for state, n in (("kept", r.pages), ("scheduled", r.scheduled), ("due", r.due)):
        pages.add_metric([state], n)
    yield pages
    outcomes = GaugeMetricFamily("idempotent_revisit_run_pages",
                                 "Pages kept, by how the latest run reached them",
                                 labels=["outcome"])
    for outcome, n in (("fetched", r.fetched), ("not_modified", r.not_modified),
                       ("not_due", r.not_due)):
        outcomes.add_metric([outcome], n)
    yield outcomes
    yield GaugeMetricFamily("idempotent_revisit_requests_saved",
                            "Requests the latest run did not send (pages not due)",
                            value=r.requests_saved)
    yield GaugeMetricFamily("idempotent_revisit_bytes_saved",
                            "Bytes the latest run did not download: the bodies of the pages "
                            "answered 304 or not due, at their size when last downloaded",
                            value=r.bytes_saved)


def _runs(m: CrawlMetrics) -> Iterator[Metric]:
    families = {field: CounterMetricFamily(name, text, labels=["run"])
                for field, (name, text) in _RUN_COUNTERS.items()}
    for run in m.runs:
        for field, family in families.items():
            family.add_metric([str(run.run_id)], getattr(run, field))
    yield from families.values()
    current = m.runs[-1] if m.runs else None
    yield GaugeMetricFamily("idempotent_current_run", "The id of the latest run (0: none)",
                            value=current.run_id if current else 0)
    yield GaugeMetricFamily("idempotent_current_run_finished",
                            "1 when the latest run has finished",
                            value=int(current is not None and current.finished_at is not None))
    yield GaugeMetricFamily("idempotent_current_run_start_time_seconds",
                            "When the latest run started (unix seconds)",
                            value=current.started_at if current else 0)
    end = current.finished_at if current and current.finished_at is not None else m.read_at
    yield GaugeMetricFamily("idempotent_current_run_age_seconds",
                            "Seconds from the latest run's start to its end, or to now",
                            value=max(0.0, end - current.started_at) if current else 0)


def _queue(name: str, depth: QueueDepth | None, up: bool,
           age: float | None) -> Iterator[Metric]:
    yield GaugeMetricFamily("idempotent_queue_up",
                            "1 when the last read of the queue input's broker answered",
                            value=int(up))
    messages = GaugeMetricFamily("idempotent_queue_messages",
                                 "The queue input's messages by state: waiting (no consumer "
                                 "took them yet), held (taken, not acknowledged), parked; "
                                 "only the states the broker tells", labels=["queue", "state"])
    if depth is not None:
        for state in ("waiting", "held", "parked"):
            n = getattr(depth, state)
            if n is not None:
                messages.add_metric([name, state], n)
    yield messages
    if age is not None:
        yield GaugeMetricFamily("idempotent_queue_read_age_seconds",
                                "Age of the queue's figures (read in the background)",
                                value=age)


def _workers(m: CrawlMetrics) -> Iterator[Metric]:
    yield GaugeMetricFamily("idempotent_workers_alive",
                            "Workers whose crawl sessions still run", value=len(m.live_workers))
    leases = GaugeMetricFamily("idempotent_worker_leases", "Leases held, by worker",
                               labels=["worker", "worker_state"])
    expiry = GaugeMetricFamily("idempotent_worker_lease_expiry_seconds",
                               "Seconds until the worker's latest lease expires (negative: "
                               "expired, the worker stopped renewing)", labels=["worker"])
    alive = set(m.live_workers)
    for holder in m.leases:
        state = "alive" if holder.worker in alive else worker_state(holder.worker)
        leases.add_metric([holder.worker, state], holder.leases)
        expiry.add_metric([holder.worker], holder.leased_until - m.read_at)
    yield leases
    yield expiry
    beat = GaugeMetricFamily("idempotent_worker_heartbeat_age_seconds",
                             "Seconds since the live worker's latest heartbeat (PostgreSQL "
                             "stores; past the liveness bound the worker is dead and its "
                             "leases are taken back)", labels=["worker"])
    for worker, at in sorted(m.heartbeats.items()):
        if worker in alive:
            beat.add_metric([worker], max(0.0, m.read_at - at))
    yield beat
