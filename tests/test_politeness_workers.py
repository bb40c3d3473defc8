"""Politeness for the whole crawl with real worker processes (``scrapy runspider`` of
``sites_spider.py``) on one frontier: several sites on loopback addresses of their own
(127.0.0.x, each its own download slot), each site recording the requests in flight and the
gaps between request starts. With 4 workers on one SQLite file, and 3 on PostgreSQL, no site
sees more than its limits; a site answering 429 with Retry-After gets nothing from any
worker for that long, also when the worker that saw the 429 is SIGKILLed at once (on each
store backend)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from local_site import LocalSite, Received

from crawling import wait_for
from scrapy_idempotent.scrapy_compat import has_throttling_scopes
from scrapy_idempotent.store.registry import sqlite_path

pytestmark = pytest.mark.slow

SPIDER = Path(__file__).resolve().parent / "sites_spider.py"
#: the sites' measuring resolution (their accept loop and clock): a gap may look this much
#: shorter than it was at the worker
RESOLUTION = 0.02
#: how much closer than the delay two workers' requests may arrive at the site on a loaded
#: machine: a worker starved of CPU sends late what it was handed on time, so the next one
#: arrives early by that much (docs/politeness.rst, Sizing a crawl: 0.17 to 0.46 s apart for
#: 0.5 s); a clock off by 2 s or more still shows far beyond it
ARRIVAL_JITTER = 0.2


def start_worker(sites: Sequence[LocalSite], database: str, log: Path, pages: int,
                 *settings: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "scrapy", "runspider", str(SPIDER),
               "-a", "sites=" + ",".join(site.url for site in sites), "-a", f"pages={pages}",
               "-s", f"IDEMPOTENT_DATABASE={database}", "-s", f"LOG_FILE={log}",
               "-s", "LOG_LEVEL=INFO"]
    for setting in settings:
        command += ["-s", setting]
    return subprocess.Popen(command, cwd=log.parent, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env=None if env is None else {**os.environ, **env})


@contextmanager
def sites(*hosts: str, delay: float) -> Iterator[list[LocalSite]]:
    with ExitStack() as stack:
        yield [stack.enter_context(LocalSite(host=host, delay=delay)) for host in hosts]


@contextmanager
def running(workers: list[subprocess.Popen[bytes]]) -> Iterator[None]:
    try:
        yield
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()


def crawl_with_workers(tmp_path: Path, database: str, count: int, hosts: Sequence[str],
                       *settings: str, pages: int = 12) -> list[LocalSite]:
    """``count`` workers crawl ``pages`` pages of each site (answering in 0.2 s) to the end;
    returns the sites (stopped), their recordings kept."""
    with sites(*hosts, delay=0.2) as crawled:
        logs = [tmp_path / f"worker{n}.log" for n in range(count)]
        workers = [start_worker(crawled, database, log, pages, *settings) for log in logs]
        with running(workers):
            for worker, log in zip(workers, logs, strict=True):
                code = worker.wait(timeout=300)
                assert code == 0, log.read_text(errors="replace")[-3000:]
    for site in crawled:
        assert site.request_count == pages, site.counts_by_path()  # each page once
    return crawled


LIMITS = ("CONCURRENT_REQUESTS_PER_DOMAIN=2",
          'DOWNLOAD_SLOTS={"%s": {"concurrency": 1, "delay": 0.5}}')


def assert_limits_held(crawled: list[LocalSite]) -> None:
    busy, other, delayed = crawled
    assert busy.most_in_flight <= 2 and other.most_in_flight <= 2
    assert delayed.most_in_flight == 1
    assert min(delayed.intervals()) >= 0.5 - RESOLUTION, delayed.intervals()


def test_workers_on_one_frontier_keep_each_sites_limits(tmp_path: Path,
                                                        crawl_database: str) -> None:
    # 4 workers on one SQLite file, 3 on PostgreSQL; every worker joins run 1, even one
    # started after the others finished it (each page once)
    workers = 4 if sqlite_path(crawl_database) is not None else 3
    hosts = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
    crawled = crawl_with_workers(tmp_path, crawl_database, workers, hosts,
                                 LIMITS[0], LIMITS[1] % hosts[2], "IDEMPOTENT_RUN_MODE=resume")
    assert_limits_held(crawled)
    # the sites had room: the limits were reached, not undercut
    assert crawled[0].most_in_flight == 2


def test_four_workers_with_default_settings_keep_a_sites_limit(tmp_path: Path,
                                                               crawl_database: str) -> None:
    # IDEMPOTENT_POLITENESS not set (sites_spider.py leaves it to the default): 4 workers
    # on one frontier, each site limited to 2 requests at once, never more at the site
    # (it counts the requests it has received and not answered yet); every worker joins
    # run 1, even one started after the others finished it (each page once)
    hosts = ("127.0.0.5", "127.0.0.6")
    crawled = crawl_with_workers(tmp_path, crawl_database, 4, hosts,
                                 "CONCURRENT_REQUESTS_PER_DOMAIN=2", "IDEMPOTENT_RUN_MODE=resume")
    assert [site.most_in_flight for site in crawled] == [2, 2]


def test_a_429_with_retry_after_pauses_the_site_for_every_worker_across_a_kill(
        tmp_path: Path, crawl_database: str) -> None:
    pages = 20
    with sites("127.0.0.8", "127.0.0.9", delay=0.1) as (throttling, other):
        answered: list[float] = []  # when the 429 was sent (the sites' clock)
        lock = threading.Lock()

        def answer(received: Received) -> tuple[int, dict[str, str], str]:
            with lock:
                if not answered:
                    answered.append(time.monotonic())
                    return 429, {"Retry-After": "5", "Content-Type": "text/html"}, "slow down"
            return 200, {"Content-Type": "text/html"}, "<html>ok</html>"

        for n in range(pages):
            throttling.add_responder(f"/ok/p{n}", answer)
        database = crawl_database
        logs = [tmp_path / f"worker{n}.log" for n in range(3)]
        # one request at a time per site: nothing else of the throttled site is in flight
        # at the 429 (so none is fetched again after the kill); every worker joins run 1
        slow_other = ("CONCURRENT_REQUESTS_PER_DOMAIN=1", "IDEMPOTENT_RUN_MODE=resume")
        workers = [start_worker([throttling, other], database, log, pages, *slow_other)
                   for log in logs[:2]]
        with running(workers):
            # the worker that saw the 429 logs the pause once it is stored: SIGKILLed then
            def pausing() -> int | None:
                return next((n for n, log in enumerate(logs[:2]) if log.exists()
                             and "paused for" in log.read_text(errors="replace")), None)

            wait_for(lambda: pausing() is not None, 120, "the pause of the throttled site")
            saw = pausing()
            assert saw is not None
            workers[saw].kill()
            assert workers[saw].wait() == -signal.SIGKILL
            # a new worker in its place reads the pause from the frontier too
            workers.append(start_worker([throttling, other], database, logs[2], pages,
                                        *slow_other))
            wait_for(lambda: throttling.request_count > 1, 120, "the site fetched again")
            for n, worker in enumerate(workers):
                if n != saw:
                    assert worker.wait(timeout=300) == 0
        times = throttling.arrival_times()
        after = [t - answered[0] for t in times if t > answered[0]]
        assert after and min(after) >= 5.0 - RESOLUTION, after
        assert throttling.request_count == pages + 1  # each page once, the throttled twice
        assert throttling.most_in_flight == 1
        # the other site went on meanwhile
        # (the killed worker's request in flight to it, if any, is fetched again), unless the
        # killed worker held its one place: then it is paused too, as a dead worker's site
        assert pages <= other.request_count <= pages + 1
        cautious = [line for log in logs for line in log.read_text(errors="replace").splitlines()
                    if "held requests of them when its leases were taken back" in line]
        if not any("127.0.0.9" in line for line in cautious):
            assert any(answered[0] < t < answered[0] + 5.0 for t in other.arrival_times())


#: libfaketime from Debian's faketime package: it moves one process's wall clock
FAKETIME_LIBRARY = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def skewed(offset: str) -> dict[str, str]:
    """The environment of a worker whose wall clock is ``offset`` (``+0.2``, ``-120``) seconds
    off (its monotonic clock is left alone, as a host's NTP leaves it)."""
    return {"LD_PRELOAD": str(FAKETIME_LIBRARY), "FAKETIME": offset,
            "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_DONT_RESET": "1"}


@pytest.mark.skipif(not FAKETIME_LIBRARY.exists(), reason="needs Debian's faketime")
@pytest.mark.parametrize("offset", ["+0", "+0.2", "-0.2", "+2", "-2", "+120", "-120"])
def test_a_worker_whose_clock_is_off_keeps_the_limits_and_finishes(
        tmp_path: Path, postgres_url: str, offset: str) -> None:
    # PostgreSQL: a worker whose clock is off from the server's, beside one whose clock is
    # right, both on a site with a delay: every time compared is the server's, so the crawl
    # finishes at the pace of the delay, no request is early, and nothing is given back as
    # late (a worker 0.2 s ahead used to give back every request of a slot with a delay)
    hosts = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
    pages = 8
    with sites(*hosts, delay=0.1) as crawled:
        logs = [tmp_path / "skewed.log", tmp_path / "right.log"]
        # (the second worker joins the first one's run, even if it has finished it)
        workers = [start_worker(crawled, postgres_url, logs[0], pages, LIMITS[0],
                                LIMITS[1] % hosts[2], "IDEMPOTENT_RUN_MODE=resume",
                                env=skewed(offset))]
        with running(workers):
            # alone, the skewed worker sends to the site with a delay at its pace
            wait_for(lambda: crawled[2].request_count >= 5, 60,
                     "the skewed worker's requests to the site with a delay")
            alone = crawled[2].arrival_times()[:5]
            workers.append(start_worker(crawled, postgres_url, logs[1], pages, LIMITS[0],
                                        LIMITS[1] % hosts[2], "IDEMPOTENT_RUN_MODE=resume"))
            for worker, log in zip(workers, logs, strict=True):
                code = worker.wait(timeout=300)
                assert code == 0, log.read_text(errors="replace")[-3000:]
    for site in crawled:
        assert site.request_count == pages, site.counts_by_path()
    busy, other, delayed = crawled
    assert busy.most_in_flight <= 2 and other.most_in_flight <= 2
    assert delayed.most_in_flight == 1
    # measured at the site, whose accept loop shares a loaded machine with the workers: a
    # request it reads late (or a starved worker sends late) makes the next gap look shorter
    # by as much, so one gap alone can look 0.4 s short on a loaded machine; over four gaps
    # such lags do not add up: the span is short by one lag at most (a clock off by 2 s or
    # more sends at once and shows far beyond this; at 0.2 s the crawl used to send nothing)
    assert alone[-1] - alone[0] >= 4 * 0.5 - ARRIVAL_JITTER, alone
    # (once two workers send, the delay holds between their hand-outs; at the site a
    # request of a worker starved of CPU, another starting beside it, may come closer
    # after the other's: see docs/politeness.rst, Sizing a crawl)


def closing_stat(log: Path, name: str) -> int:
    """A worker's stat as its log's stats dump at close has it (0 when absent)."""
    found = re.search(rf"'{re.escape(name)}': (\d+)", log.read_text(errors="replace"))
    return int(found.group(1)) if found else 0


PAUSE_SECONDS = int(os.environ.get("IDLE_PAUSE_SECONDS", "8"))


def test_idle_workers_wait_instead_of_committing_in_a_loop(tmp_path: Path,
                                                           crawl_database: str) -> None:
    # 4 workers (3 on PostgreSQL), one site paused by a 429 for PAUSE_SECONDS, the other
    # soon done: nothing is claimable, and the workers wait for the pause's end
    # (a timer), another worker's change or a bound of a second, not in a loop of claims
    workers_count = 4 if sqlite_path(crawl_database) is not None else 3
    pages = 4
    with sites("127.0.0.5", "127.0.0.6", delay=0.05) as (paused, other):
        lock = threading.Lock()
        answered: list[float] = []

        def answer(received: Received) -> tuple[int, dict[str, str], str]:
            with lock:
                if not answered:
                    answered.append(time.monotonic())
                    return 429, {"Retry-After": str(PAUSE_SECONDS),
                                 "Content-Type": "text/html"}, "slow down"
            return 200, {"Content-Type": "text/html"}, "<html>ok</html>"

        for n in range(pages):
            paused.add_responder(f"/ok/p{n}", answer)
        logs = [tmp_path / f"worker{n}.log" for n in range(workers_count)]
        workers = [start_worker([paused, other], crawl_database, log, pages,
                                "CONCURRENT_REQUESTS_PER_DOMAIN=1",
                                "IDEMPOTENT_RUN_MODE=resume") for log in logs]
        with running(workers):
            for worker, log in zip(workers, logs, strict=True):
                assert worker.wait(timeout=300) == 0, log.read_text(errors="replace")[-3000:]
    transactions = [closing_stat(log, "idempotent/transactions") for log in logs]
    renewals = [closing_stat(log, "idempotent/leases/renewals") for log in logs]
    print(f"{PAUSE_SECONDS} s paused, {workers_count} workers: transactions {transactions},"
          f" renewals {renewals}")
    # a few a second at most for each, over the pause (and the crawl's pages)
    for count in transactions:
        assert count <= 3 * PAUSE_SECONDS + 4 * pages + 20, transactions


def test_claims_ahead_leave_a_sites_places_to_the_workers_that_can_send(
        tmp_path: Path, crawl_database: str) -> None:
    # 3 workers that each send 2 requests at once, 3 sites with a limit of 2 each: 6 in
    # flight at once. A worker's claim takes no more places than it can send soon (else
    # the first worker's claim holds the 6 places of the 3 sites while it sends 2)
    pages = 6
    workers_count = 3
    with sites("127.0.0.2", "127.0.0.3", "127.0.0.4", delay=0.0) as crawled:
        condition = threading.Condition()
        in_flight = [0, 0]  # now, most
        timed_out: list[str] = []  # the answers that waited out the bound: a failure

        def answer(received: Received) -> tuple[int, dict[str, str], str]:
            with condition:
                in_flight[0] += 1
                in_flight[1] = max(in_flight[1], in_flight[0])
                condition.notify_all()
                # held until 6 have been in flight at once (a state: the third worker may
                # start long after the others on a loaded machine; once reached, nothing
                # waits). The bound only ends a failing run: claims ahead that hold the
                # places never let the third worker send, and the answers wait it out
                if not condition.wait_for(lambda: in_flight[1] >= 6, timeout=120):
                    timed_out.append(received.path)
                in_flight[0] -= 1
            return 200, {"Content-Type": "text/html"}, "<html>ok</html>"

        for site in crawled:
            for n in range(pages):
                site.add_responder(f"/ok/p{n}", answer)
        logs = [tmp_path / f"worker{n}.log" for n in range(workers_count)]
        workers = [start_worker(crawled, crawl_database, log, pages,
                                "CONCURRENT_REQUESTS=2", "CONCURRENT_REQUESTS_PER_DOMAIN=2",
                                "IDEMPOTENT_RUN_MODE=resume") for log in logs]
        with running(workers):
            for worker, log in zip(workers, logs, strict=True):
                assert worker.wait(timeout=300) == 0, log.read_text(errors="replace")[-3000:]
    assert in_flight[1] == 6
    assert not timed_out, timed_out
    for site in crawled:
        assert site.request_count == pages
        assert site.most_in_flight <= 2


@pytest.mark.skipif(not has_throttling_scopes(),
                    reason="the installed Scrapy has no THROTTLING_SCOPES (its throttling work)")
def test_workers_keep_the_limits_of_throttling_scopes(tmp_path: Path) -> None:
    # Scrapy's throttling work renames DOWNLOAD_SLOTS to THROTTLING_SCOPES: its limits bind
    # the crawl as the old setting's did (4 workers on one SQLite file)
    hosts = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
    crawled = crawl_with_workers(
        tmp_path, str(tmp_path / "crawl.sqlite3"), 4, hosts, LIMITS[0],
        "THROTTLING_SCOPES=" + json.dumps({hosts[2]: {"concurrency": 1, "delay": 0.5}}))
    assert_limits_held(crawled)
