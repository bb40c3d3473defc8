"""Deploying with scrapyd, verified against a real scrapyd.

One scrapyd per module: started on 127.0.0.1 on a free port, with its own configuration file
and temporary directories (``max_proc = 1``), from a working directory without a
``scrapy.cfg`` (like a real deployment). ``example_project`` is built into an egg with
setuptools and uploaded with ``addversion.json``; jobs are scheduled with ``schedule.json``
against the local test site (``local_site.LocalSite``) and an absolute ``IDEMPOTENT_DATABASE``.

* A job SIGKILLed in the middle of the crawl is resumed by the next job of the same spider:
  500 correct records, at most 525 + 1 requests, the dead job's leases reclaimed at once.
  With ``IDEMPOTENT_RUN_MODE=fresh`` (every job starts a new run) the same procedure breaks
  the request bound: this is what the resumed case is measured against.
* A job cancelled with ``cancel.json`` (scrapyd sends SIGINT by default; SIGTERM on request)
  stops gracefully and releases its leases; the next job takes the crawl over at once.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from local_site import LocalSite

from crawling import db_rows, frontier_counts

pytestmark = pytest.mark.slow

EXAMPLE_PROJECT = Path(__file__).resolve().parent.parent / "example_project"
PROJECT = "shop"
SPIDER = "shop"

#: Requests the first job makes before it is killed or cancelled (of the shop's 525 pages).
STOP_AFTER_REQUESTS = 150
#: CONCURRENT_REQUESTS of every job: a kill may repeat only the one request on the wire.
CONCURRENCY = 1
#: Longer than any wait below: a job that had to wait for a lease to expire (instead of
#: reclaiming it at once or finding it released) would run into JOB_TIMEOUT.
LEASE_SECONDS = 120
SCRAPYD_START_TIMEOUT = 30.0
JOB_START_TIMEOUT = 30.0
JOB_TIMEOUT = 60.0
HTTP_TIMEOUT = 10.0


# --- waiting -------------------------------------------------------------------------------


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- the egg -------------------------------------------------------------------------------

SETUP_PY = """\
from setuptools import find_packages, setup

setup(
    name="shop",
    version="1.0",
    packages=find_packages(),
    entry_points={"scrapy": ["settings = shop.settings"]},
)
"""


def build_egg(workdir: Path) -> Path:
    """Build ``example_project`` into an egg, as ``scrapyd-deploy`` does: a ``setup.py`` with
    the ``scrapy.settings`` entry point, ``setup.py bdist_egg``; in a copy of the project."""
    source = workdir / "project"
    shutil.copytree(
        EXAMPLE_PROJECT, source,
        ignore=shutil.ignore_patterns(".scrapy", "__pycache__", "*.sqlite3*", "*.egg-info",
                                      "build", "dist"),
    )
    (source / "setup.py").write_text(SETUP_PY)
    out = workdir / "egg"
    result = subprocess.run(
        [sys.executable, "setup.py", "-q", "bdist_egg", "--dist-dir", str(out)],
        cwd=source, capture_output=True, text=True, timeout=120, check=False,
    )
    eggs = sorted(out.glob("*.egg")) if out.is_dir() else []
    if result.returncode != 0 or len(eggs) != 1:
        pytest.fail(f"building the egg failed ({result.returncode}):\n{result.stdout}\n"
                    f"{result.stderr}")
    return eggs[0]


# --- scrapyd -------------------------------------------------------------------------------


def multipart(fields: Mapping[str, str], files: Mapping[str, tuple[str, bytes]]
              ) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts: list[bytes] = []
    for name, value in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
                     f"{value}\r\n".encode())
    for name, (filename, content) in files.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
                     f'filename="{filename}"\r\nContent-Type: application/octet-stream\r\n\r\n'
                     .encode() + content + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


class Scrapyd:
    """A scrapyd process of this test and a small client of its JSON API."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.logs_dir = root / "logs"
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._output: Any = None
        self.pids: set[int] = set()  # job processes seen, to kill leftovers at teardown

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle --

    def write_config(self) -> None:
        (self.root / "scrapyd.conf").write_text(
            "[scrapyd]\n"
            "bind_address = 127.0.0.1\n"
            f"http_port = {self.port}\n"
            f"eggs_dir = {self.root / 'eggs'}\n"
            f"logs_dir = {self.logs_dir}\n"
            "items_dir =\n"
            f"dbs_dir = {self.root / 'dbs'}\n"
            "jobs_to_keep = 20\n"
            "max_proc = 1\n"
            "poll_interval = 0.1\n"
        )

    def start(self) -> None:
        """Start scrapyd on a free port (a few tries: the port is free when picked, not
        necessarily when scrapyd binds it) and wait until it answers."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SCRAPY_", "SCRAPYD_"))}
        # No ~/.scrapyd.conf or ~/.scrapy.cfg of the machine running the tests.
        env["HOME"] = str(self.root)
        for attempt in range(3):
            self.port = free_port()
            self.write_config()
            self._output = open(self.root / f"scrapyd-{attempt}.out", "wb")  # noqa: SIM115
            # Its own session: scrapyd's job processes join its process group, so the
            # teardown can end all of them with one signal to the group.
            self.process = subprocess.Popen(
                [sys.executable, "-m", "scrapyd"], cwd=self.root, env=env,
                stdout=self._output, stderr=subprocess.STDOUT, start_new_session=True,
            )
            deadline = time.monotonic() + SCRAPYD_START_TIMEOUT
            while time.monotonic() < deadline and self.process.poll() is None:
                try:
                    if self.get("daemonstatus.json")["status"] == "ok":
                        return
                except OSError:
                    pass
                time.sleep(0.1)
            self.stop()
        output = (self.root / "scrapyd-2.out").read_text(errors="replace")
        pytest.fail(f"scrapyd did not start:\n{output}")

    def stop(self) -> None:
        """Kill every job process still running, then scrapyd and its process group."""
        if self.process is not None:
            try:
                running = self.get("listjobs.json")["running"]
            except (OSError, ValueError, KeyError, AssertionError):
                running = []
            self.pids.update(job["pid"] for job in running if job.get("pid"))
        for pid in self.pids:
            if _is_job_process(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
            self.process = None
        if self._output is not None:
            self._output.close()
            self._output = None

    # -- API --

    def _call(self, request: urllib.request.Request) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:
                payload: dict[str, Any] = json.load(response)
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            exc.close()
            raise AssertionError(f"scrapyd answered {exc.code}: {body}") from None
        assert payload.get("status") == "ok", payload
        return payload

    def get(self, endpoint: str, **params: str) -> dict[str, Any]:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        return self._call(urllib.request.Request(f"{self.url}/{endpoint}{query}"))

    def post(self, endpoint: str, fields: list[tuple[str, str]]) -> dict[str, Any]:
        data = urllib.parse.urlencode(fields).encode()
        return self._call(urllib.request.Request(f"{self.url}/{endpoint}", data=data))

    def add_version(self, egg: Path, version: str = "1") -> dict[str, Any]:
        body, content_type = multipart({"project": PROJECT, "version": version},
                                       {"egg": (egg.name, egg.read_bytes())})
        request = urllib.request.Request(f"{self.url}/addversion.json", data=body,
                                         headers={"Content-Type": content_type})
        return self._call(request)

    def schedule(self, settings: Mapping[str, Any], **spider_args: str) -> str:
        fields = [("project", PROJECT), ("spider", SPIDER)]
        fields += [("setting", f"{name}={value}") for name, value in settings.items()]
        fields += list(spider_args.items())
        return str(self.post("schedule.json", fields)["jobid"])

    def cancel(self, job: str, signal_name: str | None = None) -> str | None:
        fields = [("project", PROJECT), ("job", job)]
        if signal_name is not None:
            fields.append(("signal", signal_name))
        prevstate: str | None = self.post("cancel.json", fields)["prevstate"]
        return prevstate

    def state(self, job: str) -> str | None:
        """``pending``, ``running`` or ``finished`` (from ``listjobs.json``); None if unknown."""
        jobs = self.get("listjobs.json", project=PROJECT)
        for state in ("finished", "running", "pending"):
            if any(entry["id"] == job for entry in jobs[state]):
                return state
        return None

    def running_pid(self, job: str) -> int | None:
        for entry in self.get("listjobs.json", project=PROJECT)["running"]:
            if entry["id"] == job and entry.get("pid"):
                self.pids.add(entry["pid"])
                return int(entry["pid"])
        return None

    def wait_running(self, job: str) -> int:
        def started() -> int | None:
            if self.state(job) == "finished":
                pytest.fail(f"job {job} ended before it was seen running:\n{self.log(job)}")
            return self.running_pid(job)

        return int(wait_until(started, JOB_START_TIMEOUT, f"job {job} to start"))

    def wait_finished(self, job: str, timeout: float = JOB_TIMEOUT) -> None:
        wait_until(lambda: self.state(job) == "finished", timeout, f"job {job} to finish")

    def clear_jobs(self) -> None:
        """Drop pending jobs, SIGKILL running ones, and wait until none runs."""
        jobs = self.get("listjobs.json", project=PROJECT)
        for entry in jobs["pending"]:
            self.cancel(entry["id"])
        for entry in jobs["running"]:
            if entry.get("pid") and _is_job_process(entry["pid"]):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(entry["pid"], signal.SIGKILL)
        wait_until(lambda: not self.get("listjobs.json", project=PROJECT)["running"],
                   JOB_TIMEOUT, "the jobs of the test to end")

    def log(self, job: str) -> str:
        path = self.logs_dir / PROJECT / SPIDER / f"{job}.log"
        return path.read_text(errors="replace") if path.is_file() else f"(no log at {path})"


def _is_job_process(pid: int) -> bool:
    """True if ``pid`` is still a scrapyd job process (not a pid reused by something else)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: trust the pid, it came from scrapyd a moment ago
        return True
    return b"scrapyd.runner" in cmdline


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


def stat(log: str, name: str) -> Any:
    """A value of the stats dump at the end of a Scrapy log (None when absent)."""
    match = re.search(rf"'{re.escape(name)}': ([^,\n]+)", log)
    return None if match is None else ast.literal_eval(match.group(1))


def score(db: Path, expected: Mapping[str, Mapping[str, str]]) -> dict[str, int]:
    """Records stored, distinct SKUs, and records equal to what the shop shows."""
    records = [json.loads(data) for (data,) in db_rows(db, "SELECT data FROM records")]
    correct = {r.get("sku") for r in records
               if r.get("sku") in expected
               and {k: r.get(k) for k in ("sku", "name", "price")} == expected[r["sku"]]}
    return {"rows": len(records), "distinct": len({r.get("sku") for r in records}),
            "correct": len(correct)}


def leases_of(db: Path) -> list[tuple[str, int]]:
    return db_rows(db, "SELECT worker, count(*) FROM requests WHERE state = 'leased' "
                       "GROUP BY worker")


def job_settings(db: Path, run_mode: str) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "IDEMPOTENT_DATABASE": str(db),  # absolute: jobs run in scrapyd's working directory
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
def test_sigkilled_job_is_resumed_by_the_next_job(scrapyd: Scrapyd, tmp_path: Path,
                                                  run_mode: str) -> None:
    """SIGKILL the crawl process of a running job, schedule the spider again: the next job
    reclaims the dead job's leases at once and resumes. ``fresh`` is the control: each job
    starts a new run, so the requests of the killed job are all made again."""
    db = tmp_path / "shop.sqlite3"
    settings = job_settings(db, run_mode)
    with LocalSite(delay=0.01) as site:
        expected = site.expected_products()
        pages = site.page_count
        killed = scrapyd.schedule(settings, url=site.url)
        pid = scrapyd.wait_running(killed)
        assert _is_job_process(pid)
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
        assert db_rows(db, "SELECT count(*) FROM runs") == [(1,)]
    else:
        # Not resumed: the bound the test above holds the package to is broken.
        assert requests > pages + CONCURRENCY
        assert requests >= at_kill + pages
        assert db_rows(db, "SELECT count(*) FROM runs") == [(2,)]


@pytest.mark.parametrize(
    ("cancel_signal", "run_mode"),
    [(None, "auto"), ("TERM", "auto"), (None, "fresh")],
    ids=["default-signal", "TERM", "fresh-control"],
)
def test_cancelled_job_releases_its_leases_and_the_next_job_finishes(
    scrapyd: Scrapyd, tmp_path: Path, cancel_signal: str | None, run_mode: str
) -> None:
    """``cancel.json`` on a running job (scrapyd 1.6 sends SIGINT unless told otherwise) is a
    graceful stop: the scheduler's close releases the job's leases, and the next job starts
    at once and completes the crawl."""
    db = tmp_path / "shop.sqlite3"  # a fresh database
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
        assert db_rows(db, "SELECT count(*) FROM runs") == [(1,)]
    else:
        assert requests > pages + CONCURRENCY
        assert db_rows(db, "SELECT count(*) FROM runs") == [(2,)]

