"""robots.txt obeyed after every resume: a crawl with ``ROBOTSTXT_OBEY = True`` of a catalogue
whose pages link to pages robots.txt disallows, SIGKILLed 11 times (3 times while its
robots.txt downloads, 8 times at moments given by the site's progress), then run to its end:
the site never serves a disallowed page, and serves robots.txt once for the crawl, plus once
per process killed before robots.txt reached the database (not once per process)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from local_site import ROBOTS_TXT, LocalSite

from crawling import close_reason, wait_for
from helpers.stored import frontier_entries

SPIDER = Path(__file__).resolve().parent / "robots_spider.py"
CATEGORIES = 40
PRODUCTS = 12  #: per category, and as many disallowed pages
KILLED_WHILE_ROBOTS_DOWNLOADS = 3
KILLED_AT_PROGRESS = 8


def catalogue(site: LocalSite) -> None:
    """``/cat/<n>``: products ``/ok/c<n>-<i>``, disallowed ``/private/c<n>-<i>``, and the
    next category; robots.txt answered late (0.5 s: a kill can land while it downloads)."""
    site.add("/robots.txt", ROBOTS_TXT, "text/plain", delay=0.5)
    for n in range(1, CATEGORIES + 1):
        links = [f"/ok/c{n}-{i}" for i in range(PRODUCTS)]
        links += [f"/private/c{n}-{i}" for i in range(PRODUCTS)]
        links += [f"/cat/{n + 1}"] if n < CATEGORIES else []
        site.add(f"/cat/{n}", "<html><body>" + "".join(
            f'<a href="{link}">{link}</a>' for link in links) + "</body></html>")


def start(site: LocalSite, database: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "scrapy", "runspider", str(SPIDER), "-a", f"url={site.url}",
         "-s", f"IDEMPOTENT_DATABASE={database}", "-s", f"LOG_FILE={log}"],
        cwd=log.parent, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT)


def kill_when(process: subprocess.Popen[bytes], reached: object, what: str, log: Path) -> None:
    try:
        wait_for(lambda: reached() or process.poll() is not None,  # type: ignore[operator]
                 300, what, log)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == -signal.SIGKILL, (
        f"{log.name} ended by itself ({process.returncode}) before its kill:\n"
        + (log.read_text(errors="replace")[-3000:] if log.exists() else "no log"))


@pytest.mark.slow
def test_killed_and_resumed_crawls_never_download_a_disallowed_page(
        crawl_database: str, tmp_path: Path) -> None:
    rng = random.Random(1912)
    with LocalSite(keep_alive=False) as site:
        catalogue(site)
        runs = 0
        for _ in range(KILLED_WHILE_ROBOTS_DOWNLOADS):
            # killed once its robots.txt request reached the site (answered 0.5 s later)
            fetches = site.hits("/robots.txt") + 1
            process = start(site, crawl_database, tmp_path / f"run{runs}.log")
            kill_when(process, lambda f=fetches: site.hits("/robots.txt") >= f,
                      f"robots.txt request {fetches}", tmp_path / f"run{runs}.log")
            runs += 1
        assert site.counts_by_path() == {"/robots.txt": KILLED_WHILE_ROBOTS_DOWNLOADS}
        for _ in range(KILLED_AT_PROGRESS):
            target = site.request_count + rng.randint(5, 40)
            process = start(site, crawl_database, tmp_path / f"run{runs}.log")
            kill_when(process, lambda t=target: site.request_count >= t,
                      f"request {target}", tmp_path / f"run{runs}.log")
            runs += 1
        log = tmp_path / "final.log"
        final = start(site, crawl_database, log)
        try:
            assert final.wait(timeout=300) == 0, log.read_text(errors="replace")[-3000:]
        finally:
            if final.poll() is None:
                final.kill()
                final.wait()
        assert close_reason(log) == "finished"
        served = site.counts_by_path()
        assert {path: hits for path, hits in served.items() if path.startswith("/private/")} \
            == {}
        # once for the crawl, plus once per process killed while it downloaded
        assert served["/robots.txt"] == KILLED_WHILE_ROBOTS_DOWNLOADS + 1
        assert all(served.get(f"/ok/c{n}-{i}", 0) >= 1
                   for n in range(1, CATEGORIES + 1) for i in range(PRODUCTS))
        states = {entry.url.removeprefix(site.url): (entry.state, entry.error_kind)
                  for entry in frontier_entries(crawl_database)}
        assert {path: state for path, state in states.items() if path.startswith("/private/")} \
            == {f"/private/c{n}-{i}": ("failed", "ignored/IgnoreRequest")
                for n in range(1, CATEGORIES + 1) for i in range(PRODUCTS)}
        assert all(state == ("done", None) for path, state in states.items()
                   if not path.startswith("/private/"))
        assert len(states) == CATEGORIES * (2 * PRODUCTS + 1)
