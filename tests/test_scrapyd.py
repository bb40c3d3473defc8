"""Deploying with scrapyd, verified against a real scrapyd.

One scrapyd per module: started on 127.0.0.1 on a free port, with its own configuration file
and temporary directories (``max_proc = 1``), from a working directory without a
``scrapy.cfg`` (like a real deployment). ``example_project`` is built into an egg with
setuptools and uploaded with ``addversion.json``; jobs are scheduled with ``schedule.json``
against the local test site (``local_site.LocalSite``) and an absolute ``IDEMPOTENT_DATABASE``
(a SQLite file or a PostgreSQL URL: each test runs on each store backend).

* A job SIGKILLed in the middle of the crawl is resumed by the next job of the same spider:
  500 correct records, at most 525 + 1 requests, the dead job's leases reclaimed at once.
  With ``IDEMPOTENT_RUN_MODE=fresh`` (every job starts a new run) the same procedure breaks
  the request bound: this is what the resumed case is measured against.
* A job cancelled with ``cancel.json`` (scrapyd sends SIGINT by default; SIGTERM on request)
  stops gracefully and releases its leases; the next job takes the crawl over at once.
* Two scrapyd instances (two ports, one database) each run the shop spider on one crawl; one
  job is SIGKILLed mid-crawl: the other finishes the crawl, every product once.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from local_site import LocalSite

from helpers.scrapyd import (
    JOB_START_TIMEOUT,
    Scrapyd,
    build_egg,
    is_job_process,
    stat,
    wait_until,
)
from helpers.stored import frontier_counts, leases_by_worker, stored_products, stored_runs

pytestmark = pytest.mark.slow


#: Requests the first job makes before it is killed or cancelled (of the shop's 525 pages).
STOP_AFTER_REQUESTS = 150
#: CONCURRENT_REQUESTS of every job: a kill may repeat only the one request on the wire.
CONCURRENCY = 1
#: Longer than any wait below: a job that had to wait for a lease to expire (instead of
#: reclaiming it at once or finding it released) would run into JOB_TIMEOUT.
LEASE_SECONDS = 120


@pytest.fixture(scope="module")
def scrapyd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scrapyd]:
    """A running scrapyd with ``example_project`` deployed as project ``shop``."""
    root = tmp_path_factory.mktemp("scrapyd")
    egg = build_egg(tmp_path_factory.mktemp("egg"))
    server = Scrapyd(root)
    try:
        server.start()
        deployed = server.add_version(egg)
        assert deployed["spiders"] == 1, deployed
        yield server
    finally:
        server.stop()


@pytest.fixture
def scrapyd(scrapyd_server: Scrapyd) -> Iterator[Scrapyd]:
    """The module's scrapyd, left without jobs after each test (a failed test may leave one
    running or pending; the next test's jobs would queue behind it)."""
    yield scrapyd_server
    scrapyd_server.clear_jobs()


# --- reading results -----------------------------------------------------------------------


def score(db: str, expected: Mapping[str, Mapping[str, str]]) -> dict[str, int]:
    """Records stored, distinct SKUs, and records equal to what the shop shows."""
    records = stored_products(db)
    correct = {r.get("sku") for r in records
               if r.get("sku") in expected
               and {k: r.get(k) for k in ("sku", "name", "price")} == expected[r["sku"]]}
    return {"rows": len(records), "distinct": len({r.get("sku") for r in records}),
            "correct": len(correct)}


def leases_of(db: str) -> list[tuple[str, int]]:
    """(worker, requests it holds leased) of every worker holding leases."""
    return list(leases_by_worker(db).items())


def job_settings(db: str, run_mode: str) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "IDEMPOTENT_DATABASE": db,  # absolute: jobs run in scrapyd's working directory
        "CONCURRENT_REQUESTS": CONCURRENCY,
        "IDEMPOTENT_LEASE_SECONDS": LEASE_SECONDS,
    }
    if run_mode != "auto":
        settings["IDEMPOTENT_RUN_MODE"] = run_mode
    return settings


def wait_for_requests(scrapyd: Scrapyd, job: str, site: LocalSite, count: int) -> None:
    def enough() -> bool:
        if site.request_count >= count:
            return True
        if scrapyd.state(job) == "finished":
            pytest.fail(f"job {job} ended after {site.request_count} requests, before "
                        f"{count}:\n{scrapyd.log(job)}")
        return False

    wait_until(enough, JOB_START_TIMEOUT, f"{count} requests of job {job}", interval=0.01)


def finish_crawl(scrapyd: Scrapyd, site: LocalSite, settings: Mapping[str, Any]
                 ) -> dict[str, Any]:
    """Schedule the next job and wait until it ends; what it did."""
    before = site.request_count
    began = time.monotonic()
    job = scrapyd.schedule(settings, url=site.url)
    scrapyd.wait_running(job)
    wait_until(lambda: site.request_count > before or scrapyd.state(job) == "finished",
               JOB_START_TIMEOUT, f"the first request of job {job}", interval=0.01)
    first_request = time.monotonic() - began
    scrapyd.wait_finished(job)
    return {"job": job, "log": scrapyd.log(job), "first_request_s": round(first_request, 2),
            "wall_s": round(time.monotonic() - began, 2)}


def report(name: str, **figures: Any) -> None:
    """The figures of a run, printed (pytest -s shows them)."""
    print(f"\n[{name}] " + ", ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


# --- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("run_mode", ["auto", "fresh"])
def test_sigkilled_job_is_resumed_by_the_next_job(scrapyd: Scrapyd, crawl_database: str,
                                                  run_mode: str) -> None:
    """SIGKILL the crawl process of a running job, schedule the spider again: the next job
    reclaims the dead job's leases at once and resumes. ``fresh`` is the control: each job
    starts a new run, so the requests of the killed job are all made again."""
    db = crawl_database
    settings = job_settings(db, run_mode)
    with LocalSite(delay=0.01) as site:
        expected = site.expected_products()
        pages = site.page_count
        killed = scrapyd.schedule(settings, url=site.url)
        pid = scrapyd.wait_running(killed)
        assert is_job_process(pid), (f"job {killed} (pid {pid}) ended before it could be "
                                     f"killed:\n{scrapyd.launcher_lines(killed)}\n"
                                     f"{scrapyd.log(killed)}")
        wait_for_requests(scrapyd, killed, site, STOP_AFTER_REQUESTS)
        os.kill(pid, signal.SIGKILL)
        scrapyd.wait_finished(killed)
        at_kill = site.request_count
        # The kill landed in the middle of the crawl: the dead job still holds leases.
        dead_leases = leases_of(db)
        counts_at_kill = frontier_counts(db)
        assert [worker.split(":")[1] for worker, _ in dead_leases] == [str(pid)], dead_leases
        assert counts_at_kill.get("pending", 0) > 0, counts_at_kill
        assert at_kill < pages

        resumed = finish_crawl(scrapyd, site, settings)
        requests = site.request_count

    log = resumed["log"]
    result = score(db, expected)
    report(f"kill/{run_mode}", requests_before_kill=at_kill, dead_leases=dead_leases[0][1],
           requests=requests, bound=pages + CONCURRENCY, **result,
           reclaimed=stat(log, "idempotent/requests/reclaimed"),
           next_job_first_request_s=resumed["first_request_s"],
           next_job_wall_s=resumed["wall_s"])
    assert stat(log, "finish_reason") == "finished", log
    assert stat(log, "log_count/ERROR") is None, log
    assert result == {"rows": 500, "distinct": 500, "correct": 500}
    assert frontier_counts(db) == {"done": pages}  # nothing pending, leased or failed
    if run_mode == "auto":
        # Resumed: only the request on the wire at the kill was made twice, and the dead
        # job's leases were taken back at once (not after LEASE_SECONDS).
        assert requests <= pages + CONCURRENCY, site.counts_by_path()
        assert stat(log, "idempotent/requests/reclaimed") == dead_leases[0][1]
        assert len(stored_runs(db)) == 1
    else:
        # Not resumed: the bound the test above holds the package to is broken.
        assert requests > pages + CONCURRENCY
        assert requests >= at_kill + pages
        assert len(stored_runs(db)) == 2


@pytest.mark.parametrize(
    ("cancel_signal", "run_mode"),
    [(None, "auto"), ("TERM", "auto"), (None, "fresh")],
    ids=["default-signal", "TERM", "fresh-control"],
)
def test_cancelled_job_releases_its_leases_and_the_next_job_finishes(
    scrapyd: Scrapyd, crawl_database: str, cancel_signal: str | None, run_mode: str
) -> None:
    """``cancel.json`` on a running job (scrapyd 1.6 sends SIGINT unless told otherwise) is a
    graceful stop: the scheduler's close releases the job's leases, and the next job starts
    at once and completes the crawl."""
    db = crawl_database  # a fresh database
    settings = job_settings(db, run_mode)
    with LocalSite(delay=0.01) as site:
        expected = site.expected_products()
        pages = site.page_count
        cancelled = scrapyd.schedule(settings, url=site.url)
        scrapyd.wait_running(cancelled)
        wait_for_requests(scrapyd, cancelled, site, STOP_AFTER_REQUESTS)
        assert scrapyd.cancel(cancelled, cancel_signal) == "running"
        scrapyd.wait_finished(cancelled)
        at_cancel = site.request_count
        cancelled_log = scrapyd.log(cancelled)
        counts_at_cancel = frontier_counts(db)
        leases_at_cancel = leases_of(db)

        following = finish_crawl(scrapyd, site, settings)
        requests = site.request_count

    log = following["log"]
    result = score(db, expected)
    report(f"cancel/{cancel_signal or 'default'}/{run_mode}", requests_before_cancel=at_cancel,
           frontier_after_cancel=counts_at_cancel,
           released=stat(cancelled_log, "idempotent/requests/released"),
           requests=requests, bound=pages + CONCURRENCY, **result,
           next_job_first_request_s=following["first_request_s"],
           next_job_wall_s=following["wall_s"])
    # A graceful stop, not a crash: Scrapy saw the signal and closed the spider.
    received = "SIGTERM" if cancel_signal == "TERM" else "SIGINT"
    assert f"Received {received}, shutting down gracefully" in cancelled_log, cancelled_log
    assert stat(cancelled_log, "finish_reason") == "shutdown", cancelled_log
    # Its leases were released at close: nothing is leased, the rest is pending.
    assert leases_at_cancel == [], leases_at_cancel
    assert stat(cancelled_log, "idempotent/requests/released") > 0, cancelled_log
    assert counts_at_cancel.get("pending", 0) > 0, counts_at_cancel
    assert at_cancel < pages

    assert stat(log, "finish_reason") == "finished", log
    assert stat(log, "log_count/ERROR") is None, log
    assert result == {"rows": 500, "distinct": 500, "correct": 500}
    assert frontier_counts(db) == {"done": pages}
    if run_mode == "auto":
        # Nothing was left to reclaim, and nothing was fetched again but (at most) the
        # request on the wire at the cancel.
        assert stat(log, "idempotent/requests/reclaimed") is None, log
        assert requests <= pages + CONCURRENCY, site.counts_by_path()
        assert len(stored_runs(db)) == 1
    else:
        assert requests > pages + CONCURRENCY
        assert len(stored_runs(db)) == 2


@pytest.fixture
def two_scrapyds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Scrapyd]]:
    egg = build_egg(tmp_path_factory.mktemp("egg"))
    servers = [Scrapyd(tmp_path_factory.mktemp(f"scrapyd{n}")) for n in (1, 2)]
    try:
        for server in servers:
            server.start()
            assert server.add_version(egg)["spiders"] == 1
        yield servers
    finally:
        for server in servers:
            server.stop()


#: CONCURRENT_REQUESTS of each job of the two scrapyds.
TWO_CONCURRENCY = 4


def test_two_scrapyds_on_one_crawl_one_killed_the_other_finishes(
        two_scrapyds: list[Scrapyd], crawl_database: str) -> None:
    settings = {"IDEMPOTENT_DATABASE": crawl_database, "CONCURRENT_REQUESTS": TWO_CONCURRENCY,
                "IDEMPOTENT_RUN_MODE": "resume"}
    first, second = two_scrapyds
    with LocalSite(delay=0.02) as site:
        doomed = first.schedule(settings, url=site.url)
        survivor = second.schedule(settings, url=site.url)
        pid = first.wait_running(doomed)
        second.wait_running(survivor)
        wait_until(lambda: site.request_count >= 150, 120, "150 requests")
        os.kill(pid, signal.SIGKILL)
        first.wait_finished(doomed)
        at_kill = site.request_count
        second.wait_finished(survivor, timeout=300)
        requests = site.request_count
        expected = site.expected_products()
    log = second.log(survivor)
    assert stat(log, "finish_reason") == "finished", log[-3000:]
    assert at_kill < 525
    records = stored_products(crawl_database)
    assert len(records) == len({r["sku"] for r in records}) == 500
    assert all((r["name"], r["price"]) == (expected[r["sku"]]["name"],
                                           expected[r["sku"]]["price"]) for r in records)
    # the killed job's requests on the wire may be fetched again, nothing more
    assert 525 <= requests <= 525 + TWO_CONCURRENCY, requests
    assert frontier_counts(crawl_database) == {"done": 525}
    report("two scrapyds", requests_at_kill=at_kill, requests=requests,
           reclaimed=stat(log, "idempotent/requests/reclaimed"))
