"""Long start list benchmark: does a spider whose ``start()`` yields N URLs crawl at once?

    python benchmarks/start_list.py [--urls N] [--seconds S] [--only NAME ...] [--profile]
                                    [--trace SECONDS] [--package PATH]

Serves the tests' local site (``tests/local_site.py``, instant answers, keep-alive) from a
subprocess on 127.0.0.1, then runs one crawl per configuration, each a ``CrawlerProcess`` in
a subprocess of its own, of a spider whose ``start()`` yields ``N`` (default 1,000,000)
requests of distinct pages of that site; CONCURRENT_REQUESTS = 16, LOG_LEVEL = WARNING, no
robots.txt, no telnet console:

    plain        Scrapy's default scheduler, requests with dont_filter=True (its dupefilter
                 on a list this long stalls Scrapy itself)
    addon        scrapy_idempotent through its add-on, ordinary requests
    addon_df     scrapy_idempotent through its add-on, requests with dont_filter=True
    addon_worker as addon, with IDEMPOTENT_POLITENESS = "worker" (Scrapy's limits per process)
    addon_crawl  as addon, with IDEMPOTENT_POLITENESS = "crawl" (the crawl's limits)

Each crawl is stopped (SIGKILL) ``S`` seconds (default 60) after its process started.
Printed per configuration: the requests that reached the site in those seconds, the ratio to
``plain``, the crawl process's peak RSS (``VmHWM``), and with ``--profile`` the functions of
most own and most cumulative time on the reactor thread (``cProfile``, dumped by the reactor
a few seconds before the end: a reactor that never gets a turn leaves no profile).
``--trace`` prints the crawl's counters as it goes (start requests enqueued, requests added
to the frontier, downloads, write transactions, start requests buffered for the writer, RSS).
``--package PATH`` crawls with the copy of the package in ``PATH`` (``git archive`` of an
earlier commit) instead of the installed one. The machine's load average before and after is
printed too: on a shared machine the figures of one run are comparable with each other, not
with another run's.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
TESTS = HERE.parent.parent / "tests"

CONFIGS = {
    "plain": {"addon": False, "dont_filter": True},
    "addon": {"addon": True, "dont_filter": False},
    "addon_df": {"addon": True, "dont_filter": True},
    "addon_worker": {"addon": True, "dont_filter": False, "politeness": "worker"},
    "addon_crawl": {"addon": True, "dont_filter": False, "politeness": "crawl"},
}


# -- the site ---------------------------------------------------------------------------------

def serve() -> None:
    """In the site's subprocess: serve until stdin closes."""
    sys.path.insert(0, str(TESTS))
    from local_site import LocalSite

    with LocalSite() as site:
        print(site.url, flush=True)
        sys.stdin.read()


def site_requests(url: str) -> int:
    with urllib.request.urlopen(url + "/__stats__", timeout=30) as answer:
        return int(json.load(answer)["requests"])


def reset_site(url: str) -> None:
    with urllib.request.urlopen(url + "/__reset__", timeout=30) as answer:
        answer.read()


# -- the crawl --------------------------------------------------------------------------------

def peak_rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def top_functions(profiler: cProfile.Profile, top: int = 25) -> dict[str, Any]:
    """The functions of most own time and of most cumulative time (seconds)."""
    stats = pstats.Stats(profiler)
    rows = [(f"{Path(file).name}:{line}:{name}", tt, ct)
            for (file, line, name), (_, _, tt, ct, _) in stats.stats.items()]  # type: ignore[attr-defined]
    return {"self": [(n, round(tt, 2)) for n, tt, _ in sorted(rows, key=lambda r: -r[1])[:top]],
            "total": [(n, round(ct, 2)) for n, _, ct in sorted(rows, key=lambda r: -r[2])[:top]]}


def crawl(config: str, url: str, urls: int, seconds: float, out: str, db: str,
          profile: bool, trace_every: float, package: str | None) -> None:
    """In the crawl's subprocess: crawl until killed; just before ``seconds`` have passed,
    write the peak RSS (and the profile) to ``out``."""
    if package:  # before anything imports the package: that copy, not the installed one
        sys.path.insert(0, package)
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__name__.lower()
                            and "editable" not in getattr(f, "__name__", "").lower()]
    import scrapy
    from scrapy.crawler import CrawlerProcess

    started = time.monotonic()
    options = CONFIGS[config]
    profiler = cProfile.Profile() if profile else None

    def write(result: dict[str, Any]) -> None:
        result["peak_rss_mb"] = round(peak_rss_mb(), 1)
        Path(out + ".tmp").write_text(json.dumps(result))
        os.replace(out + ".tmp", out)

    def dump_profile() -> None:  # on the reactor thread, where the profiler runs
        assert profiler is not None
        profiler.disable()
        write({"profile": top_functions(profiler)})

    def report() -> None:
        time.sleep(max(0.0, seconds - 3.0 - (time.monotonic() - started)))
        if not Path(out).exists():
            write({})
        if profiler is not None:
            from twisted.internet import reactor

            reactor.callFromThread(dump_profile)  # type: ignore[attr-defined]

    threading.Thread(target=report, daemon=True).start()

    class StartList(scrapy.Spider):
        name = "start_list"

        async def start(self) -> Any:
            for i in range(urls):
                yield scrapy.Request(f"{url}/ok/p{i}", dont_filter=options["dont_filter"])

        def parse(self, response: Any) -> None:
            return None

    settings: dict[str, Any] = {
        "CONCURRENT_REQUESTS": 16,
        "CONCURRENT_REQUESTS_PER_DOMAIN": 16,
        "LOG_LEVEL": "WARNING", "ROBOTSTXT_OBEY": False, "TELNETCONSOLE_ENABLED": False,
    }
    if options["addon"]:
        settings.update({"ADDONS": {"scrapy_idempotent.Addon": 0},
                         "IDEMPOTENT_DATABASE": db})
        if "politeness" in options:
            settings["IDEMPOTENT_POLITENESS"] = options["politeness"]
    process = CrawlerProcess(settings)
    crawler = process.create_crawler(StartList)
    if profiler is not None:
        profiler.enable()
    if trace_every:
        def trace() -> None:
            while True:
                time.sleep(trace_every)
                stats = crawler.stats.get_stats() if crawler.stats else {}
                scheduler = getattr(crawler.engine, "scheduler", None)
                tracker = getattr(scheduler, "tracker", None)
                print(f"{time.monotonic() - started:5.1f}s",
                      {k.split("/", 1)[-1]: v for k, v in stats.items()
                       if k in ("idempotent/requests/enqueued", "idempotent/requests/added",
                                "idempotent/requests/leased", "idempotent/transactions",
                                "downloader/request_count", "idempotent/requests/duplicate")},
                      "buffered", len(tracker.unattributed.requests) if tracker else "-",
                      "rss", round(peak_rss_mb(), 1), flush=True, file=sys.stderr)
        threading.Thread(target=trace, daemon=True).start()
    process.crawl(crawler)
    process.start()


def run(config: str, url: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    reset_site(url)
    out = tmp / f"{config}.json"
    db = tmp / f"{config}.sqlite3"
    command = [sys.executable, str(HERE), "--crawl", config, "--url", url,
               "--urls", str(args.urls), "--seconds", str(args.seconds),
               "--out", str(out), "--db", str(db), "--trace", str(args.trace)]
    command += ["--profile"] if args.profile else []
    command += ["--package", args.package] if args.package else []
    started = time.monotonic()
    child = subprocess.Popen(command)
    try:
        while time.monotonic() - started < args.seconds and child.poll() is None:
            time.sleep(0.2)
        requests = site_requests(url)
        peak = peak_rss_mb(child.pid) if child.poll() is None else None
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
        child.wait()
    result = json.loads(out.read_text()) if out.exists() else {}
    result["requests"] = requests
    result["peak_rss_mb"] = peak if peak is not None else result.get("peak_rss_mb")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--urls", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--only", nargs="*", choices=sorted(CONFIGS), default=None)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--package", metavar="PATH",
                        help="crawl with the package found in PATH (a checkout of an earlier "
                             "commit) instead of the installed one")
    parser.add_argument("--trace", type=float, default=0.0, metavar="SECONDS",
                        help="print the crawl's counters every SECONDS")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--crawl", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    if args.crawl:
        crawl(args.crawl, args.url, args.urls, args.seconds, args.out, args.db, args.profile,
              args.trace, args.package)
        return
    site = subprocess.Popen([sys.executable, str(HERE), "--serve"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert site.stdout is not None
        url = site.stdout.readline().strip()
        print(f"{args.urls:,} start URLs, {args.seconds:g} s per crawl, package "
              f"{args.package or 'installed'}; "
              f"load before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        results: dict[str, dict[str, Any]] = {}
        with tempfile.TemporaryDirectory(prefix="start_list-") as tmp:
            for config in args.only or list(CONFIGS):
                results[config] = result = run(config, url, args, Path(tmp))
                plain = results.get("plain", {}).get("requests")
                ratio = f"{result['requests'] / plain:.2f}" if plain else "-"
                print(f"{config:<9} requests in the first {args.seconds:g} s: "
                      f"{result['requests']:>7,}  (x plain: {ratio})  "
                      f"peak RSS: {result['peak_rss_mb']} MB", flush=True)
                for kind in ("self", "total"):
                    for name, spent in result.get("profile", {}).get(kind, []):
                        print(f"    {kind:<5} {spent:7.2f} s  {name}")
        print(f"load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        assert site.stdin is not None
        site.stdin.close()
        site.wait(timeout=30)


if __name__ == "__main__":
    main()
