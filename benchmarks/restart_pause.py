"""What the cautious pause costs a lone worker's restart.

    python benchmarks/restart_pause.py [--runs 3]

One worker (``scrapy runspider`` of ``tests/sites_spider.py``, the crawl's politeness,
``CONCURRENT_REQUESTS_PER_DOMAIN = 1``) crawls 3 sites on loopback addresses of their own
(pages answered in 0.2 s); once the sites got 15 requests it is SIGKILLed and started again
at once on the same frontier. Printed per run: seconds from the restart to each site's next
request (the restart's sites were in flight at the kill, so they are paused for
``IDEMPOTENT_BACKOFF_SECONDS`` from the take-back at the restart's open). Run it with the
package of another commit first on ``PYTHONPATH`` to compare.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from local_site import LocalSite, Received  # noqa: E402

from helpers.throttle_kills import start_worker  # noqa: E402

PAGES = 300
HOSTS = ("127.0.0.31", "127.0.0.32", "127.0.0.33")


def _ok(received: Received) -> tuple[int, dict[str, str], str]:
    return 200, {"Content-Type": "text/html"}, "<html>ok</html>"


def one_run(tmp: Path, n: int) -> list[float]:
    """Seconds from the restart to each site's next request (nan: none within 60 s)."""
    with ExitStack() as stack:
        sites = [stack.enter_context(LocalSite(host=host, delay=0.2)) for host in HOSTS]
        for site in sites:
            for page in range(PAGES):
                site.add_responder(f"/ok/p{page}", _ok)
        database = str(tmp / f"run{n}.sqlite3")
        pages = ",".join([str(PAGES)] * len(sites))
        first = start_worker(sites, database, tmp / f"run{n}-first.log", pages, "lone")
        began = time.monotonic()
        while sum(len(site.arrival_times()) for site in sites) < 15:
            if time.monotonic() - began > 120:
                first.kill()
                raise SystemExit("the worker sent nothing within 120 s")
            time.sleep(0.01)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        restart = time.monotonic()
        again = start_worker(sites, database, tmp / f"run{n}-again.log", pages, "lone")
        firsts: list[float] = []
        try:
            for site in sites:
                while True:
                    later = [t for t in site.arrival_times() if t > restart]
                    if later:
                        firsts.append(min(later) - restart)
                        break
                    if time.monotonic() - restart > 60:
                        firsts.append(float("nan"))
                        break
                    time.sleep(0.01)
        finally:
            again.kill()
            again.wait()
        return firsts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} at the start, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="idempotent-restart-pause-") as name:
        for n in range(args.runs):
            firsts = one_run(Path(name), n)
            print(f"run {n + 1}: " + ", ".join(f"{t:.2f} s" for t in firsts), flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
