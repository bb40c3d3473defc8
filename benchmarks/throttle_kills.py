"""A site's 429 and the kill of the worker that got it: is the pause kept?

    python benchmarks/throttle_kills.py [--stores sqlite,postgresql] [--runs 20]
        [--delays none,0,5,10,20,40,100]

One of three sites answers ``429`` with ``Retry-After: 5`` to a request of one of three
workers (``scrapy runspider`` processes on one new frontier, the package's default
politeness, ``CONCURRENT_REQUESTS_PER_DOMAIN = 1``); that worker is SIGKILLed the given
milliseconds after the answer was written (``none``: not killed); the site answers 429
again to any request within the 5 s. A run ends once the site is fetched after the pause.
Printed per store and kill delay: runs, runs where the kill hit the live worker, runs with a
request to the site within the 5 s, the most such requests in a run, and the earliest and
the median time from the 429 to the site's next request. The run itself is
``tests/helpers/throttle_kills.py``; PostgreSQL is a throwaway cluster of the tests'
``tests/postgres_server.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.throttle_kills import ThrottledRun, throttled_run  # noqa: E402


@contextmanager
def databases(store: str, tmp: Path) -> Iterator[Callable[[int], str]]:
    """A function giving a new, empty database of ``store`` per run number."""
    if store == "sqlite":
        yield lambda n: str(tmp / f"run{n}.sqlite3")
        return
    from postgres_server import INSTALL_HINT, find_binaries, running_cluster

    bindir = find_binaries()
    if bindir is None:
        raise SystemExit(INSTALL_HINT)
    with running_cluster(bindir) as cluster:
        yield lambda n: str(cluster.new_database())


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="sqlite,postgresql")
    parser.add_argument("--runs", type=int, default=20, help="runs per store and delay")
    parser.add_argument("--delays", default="none,0,5,10,20,40,100",
                        help="kill delays in milliseconds after the 429 (none: no kill)")
    parser.add_argument("--workers", type=int, default=3)
    args = parser.parse_args()
    delays = [None if d == "none" else float(d) / 1000 for d in args.delays.split(",")]
    print(f"load average {os.getloadavg()[0]:.2f} at the start, {os.cpu_count()} cores",
          flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="idempotent-throttle-kills-") as name:
        tmp = Path(name)
        for store in args.stores.split(","):
            with databases(store, tmp) as database:
                results: dict[float | None, list[ThrottledRun]] = {d: [] for d in delays}
                count = 0
                for n in range(args.runs):
                    for delay in delays:  # the delays alternate
                        count += 1
                        run = throttled_run(database(count), tmp / f"{store}{count}", delay,
                                            workers=args.workers)
                        results[delay].append(run)
                        print(f"{store} kill {_label(delay)} run {n + 1}: earliest "
                              f"{_ms(run.earliest)}{' EARLY' if run.early else ''}, "
                              f"{run.within} within"
                              f"{'' if run.killed or delay is None else ' (not killed)'}",
                              file=sys.stderr, flush=True)
                for delay in delays:
                    runs = results[delay]
                    times = [r.earliest for r in runs if r.earliest is not None]
                    rows.append((store, _label(delay), len(runs),
                                 sum(r.killed for r in runs), sum(r.early for r in runs),
                                 max((r.within for r in runs), default=0),
                                 _ms(min(times) if times else None),
                                 _ms(statistics.median(times) if times else None)))
    print(f"load average {os.getloadavg()[0]:.2f} at the end; {time.strftime('%Y-%m-%d')}")
    print("| store | kill after the 429 | runs | killed | runs with a request within 5 s"
          " | most requests within 5 s | earliest next request | median |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(str(v) for v in row) + " |")


def _label(delay: float | None) -> str:
    return "no kill" if delay is None else f"{delay * 1000:g} ms"


if __name__ == "__main__":
    main()
