"""A site's 429 and the kill of the worker that got it: one run of the campaign that
``benchmarks/throttle_kills.py`` repeats and ``tests/test_throttle_kills.py`` samples.

Three sites on loopback addresses of their own (three download slots), each answering in
``answer_seconds``; ``workers`` ``scrapy runspider`` processes of ``tests/sites_spider.py``
on one frontier, with the crawl's politeness and ``CONCURRENT_REQUESTS_PER_DOMAIN
= 1`` (nothing else of the throttled site is in flight when it answers 429, so every request
it receives after the 429 was sent after it). The throttled site has ``pages`` pages, the
two others ``other_pages`` (soon done: the workers are then idle, and a dead worker's leases
come back within a second, so nothing but the pause holds the throttled site's next
request). Once every worker has opened its spider, the throttled site answers its next
request with ``429`` and ``Retry-After: retry_after``, and every request until that time has
passed likewise (a site that keeps to its word); the worker that sent the first (each worker
has a user agent of its own) is SIGKILLed ``kill_after`` seconds after that answer was
written (None: not killed). The run ends once the throttled site is fetched again after the
pause (or ``retry_after + 30`` seconds after the 429: a killed worker's sites are paused
for the first backoff, 10 s, from when its leases are taken back), every worker killed
then: it counts the requests that came before the Retry-After had passed, and the earliest
of all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from local_site import LocalSite, Received

__all__ = ["SPIDER", "ThrottledRun", "start_worker", "throttled_run"]

SPIDER = Path(__file__).resolve().parent.parent / "sites_spider.py"
#: the throttled site's clock resolution (its accept loop): a request may look this much
#: earlier than it was sent
RESOLUTION = 0.02


@dataclasses.dataclass(frozen=True)
class ThrottledRun:
    kill_after: float | None  #: seconds from the 429 to the SIGKILL (None: no kill)
    killed: bool  #: the worker that got the 429 died by the SIGKILL (not before it)
    #: seconds from the 429 to the throttled site's next request (None: none came)
    earliest: float | None
    #: requests the throttled site received before its Retry-After had passed (each
    #: answered 429 again)
    within: int
    retry_after: float

    @property
    def early(self) -> bool:
        """A request came to the throttled site before its Retry-After had passed."""
        return self.earliest is not None and self.earliest < self.retry_after - RESOLUTION


def start_worker(sites: list[LocalSite], database: str, log: Path, pages: str, name: str,
            ) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "scrapy", "runspider", str(SPIDER),
               "-a", "sites=" + ",".join(site.url for site in sites), "-a", f"pages={pages}",
               "-s", f"IDEMPOTENT_DATABASE={database}", "-s", f"LOG_FILE={log}",
               "-s", "LOG_LEVEL=INFO", "-s", "CONCURRENT_REQUESTS_PER_DOMAIN=1",
               "-s", "IDEMPOTENT_RUN_MODE=resume", "-s", f"USER_AGENT={name}"]
    return subprocess.Popen(command, cwd=log.parent, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def throttled_run(database: str, workdir: Path, kill_after: float | None, *,
                  workers: int = 3, pages: int = 150, other_pages: int = 12,
                  retry_after: int = 5,
                  answer_seconds: float = 0.2,
                  hosts: tuple[str, str, str] = ("127.0.0.21", "127.0.0.22", "127.0.0.23"),
                  timeout: float = 120.0) -> ThrottledRun:
    """One run (see the module docstring) on ``database`` (a new, empty one), the workers'
    logs in ``workdir``. Raises RuntimeError when a worker ends before the run does, or when
    the 429 does not come within ``timeout``."""
    workdir.mkdir(parents=True, exist_ok=True)
    names = [f"worker-{n}" for n in range(workers)]
    lock = threading.Lock()
    armed = threading.Event()  # every worker's spider is open
    answered = threading.Event()
    throttled_at: list[float] = []  # when the 429 was written (time.monotonic())
    killed_at: list[float] = []
    processes: dict[str, subprocess.Popen[bytes]] = {}
    with ExitStack() as stack:
        sites = [stack.enter_context(LocalSite(host=host, delay=answer_seconds))
                 for host in hosts]
        throttling = sites[0]

        def ok(received: Received) -> tuple[int, dict[str, str], str]:
            return 200, {"Content-Type": "text/html"}, "<html>ok</html>"

        def throttle(received: Received) -> tuple[int, dict[str, str], str]:
            # the first request after the workers are up, and every request until its
            # Retry-After has passed, is answered 429: a site that keeps to its word
            with lock:
                if armed.is_set() and not answered.is_set():
                    answered.set()
                    return 429, {"Retry-After": str(retry_after),
                                 "Content-Type": "text/html"}, "slow down"
                if throttled_at and time.monotonic() < throttled_at[0] + retry_after:
                    return 429, {"Retry-After": str(retry_after),
                                 "Content-Type": "text/html"}, "slow down"
            return 200, {"Content-Type": "text/html"}, "<html>ok</html>"

        def kill(agent: str) -> None:
            process = processes.get(agent)
            if process is not None and process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                    killed_at.append(time.monotonic())
                process.wait()  # reaped, as a supervisor would: a zombie looks alive

        def on_answered(received: Received, status: int) -> None:
            if status != 429 or throttled_at:
                return
            throttled_at.append(time.monotonic())
            if kill_after is None:
                return
            agent = received.headers.get("User-Agent", "")
            if kill_after <= 0:
                kill(agent)
            else:
                timer = threading.Timer(kill_after, kill, (agent,))
                timer.daemon = True
                timer.start()

        for n in range(pages):
            throttling.add_responder(f"/ok/p{n}", throttle)
        for n in range(other_pages):
            for site in sites[1:]:
                site.add_responder(f"/ok/p{n}", ok)
        throttling.on_answered = on_answered
        for name in names:
            processes[name] = start_worker(sites, database, workdir / f"{name}.log",
                                      f"{pages},{other_pages},{other_pages}", name)
        try:
            deadline = time.monotonic() + timeout
            logs = [workdir / f"{name}.log" for name in names]
            while not armed.is_set():
                if all(log.exists() and "Spider opened" in log.read_text(errors="replace")
                       for log in logs):
                    armed.set()
                elif time.monotonic() > deadline:
                    raise RuntimeError("the workers did not open their spiders")
                else:
                    time.sleep(0.05)
            while not throttled_at:
                if time.monotonic() > deadline:
                    raise RuntimeError("the throttled site's 429 did not come")
                ended = [name for name, p in processes.items() if p.poll() is not None]
                if ended:
                    raise RuntimeError(f"{ended} ended before the 429: "
                                       + (workdir / f"{ended[0]}.log").read_text(
                                           errors="replace")[-2000:])
                time.sleep(0.01)
            at = throttled_at[0]
            later: list[float] = []
            while time.monotonic() < at + retry_after + 30:
                later = [t - at for t in throttling.arrival_times() if t > at]
                if any(t >= retry_after - RESOLUTION for t in later):
                    break  # fetched again after the pause
                time.sleep(0.01)
        finally:
            for process in processes.values():
                if process.poll() is None:
                    process.kill()
                process.wait()
    return ThrottledRun(kill_after=kill_after, killed=bool(killed_at),
                        earliest=min(later) if later else None,
                        within=sum(t < retry_after - RESOLUTION for t in later),
                        retry_after=float(retry_after))
