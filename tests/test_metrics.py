"""``scrapy idempotent metrics``: the crawl's figures read from the database for Prometheus.
They equal what the store says (``status --json``), are scraped by a real Prometheus server
while two workers crawl and one is killed with SIGKILL, and the killed worker's figures stay."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from local_site import LocalSite, free_port
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import (
    EXAMPLE_PROJECT,
    crawl_settings,
    run_crawl,
    start_shop_crawl,
    wait_for,
)
from helpers.stored import add_to_run_counter, requests_done
from scrapy_idempotent.store import open_store
from shop.spiders.shop import ShopSpider

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from scrapy_idempotent.metrics import StoreCollector  # noqa: E402

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def exposition(db: Path | str) -> str:
    def opened() -> Any:
        store = open_store(str(db))
        store.open_existing(readonly=True)
        return store

    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(opened))
    return prometheus_client.generate_latest(registry).decode()


def status(db: Path | str) -> Any:
    result = subprocess.run([sys.executable, "-m", "scrapy", "idempotent", "status", "--db",
                             str(db), "--json"], capture_output=True, text=True, timeout=60,
                            check=True)
    return json.loads(result.stdout)


@deferred_f_from_coro_f
async def test_the_metrics_are_what_the_store_says(crawl_database: str) -> None:
    with LocalSite(listing_pages=2, products_per_page=5, products_failing=[3]) as site:
        await run_crawl(ShopSpider, crawl_settings(crawl_database, **NATURAL_KEYS),
                        url=site.url)
    got = samples(exposition(crawl_database))
    report = status(crawl_database)
    run = report["run"]
    assert got[("idempotent_store_up", ())] == 1
    assert got[("idempotent_current_run", ())] == run["run_id"] == 1
    assert got[("idempotent_current_run_finished", ())] == 1
    for state, n in report["frontier"].items():
        if state != "total":
            assert got[("idempotent_requests", (("state", state),))] == n
    assert got[("idempotent_records", ())] == report["records"]["stored"] == 9
    labels = (("run", "1"),)
    assert got[("idempotent_run_pages_done_total", labels)] == run["done"]
    assert got[("idempotent_run_pages_failed_total", labels)] == run["failed"] == 1
    assert got[("idempotent_run_records_inserted_total", labels)] == 9
    assert got[("idempotent_run_records_unchanged_total", labels)] == 0
    for kind, n in report["failures"].items():
        assert got[("idempotent_requests_failed", (("kind", kind),))] == n
    assert got[("idempotent_downloads_total", ())] == report["repeated"]["downloads"]
    assert got[("idempotent_workers_alive", ())] == 0
    assert not [key for key in got if key[0] == "idempotent_worker_leases"]


def test_the_dashboard_and_the_alert_rules_use_only_metrics_that_exist(
        crawl_database: str) -> None:
    import re

    store = open_store(crawl_database)
    store.open(fingerprinter="SHA1")
    store.close()
    served = {family.name for family in
              text_string_to_metric_families(exposition(crawl_database))}
    # and those of a queue input's broker, once read
    from scrapy_idempotent.metrics import _queue
    from scrapy_idempotent.queue_input.broker import QueueDepth

    served |= {family.name for family in _queue("requests", QueueDepth(1, 1, 1), True, 0.0)}
    served |= {f"{name}_total" for name in served}
    monitoring = Path(__file__).resolve().parent.parent / "docs" / "monitoring"
    dashboard = json.loads((monitoring / "grafana-dashboard.json").read_text())
    queries = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    used = set(re.findall(r"\bidempotent_[a-z_]+", queries))
    used |= set(re.findall(r"\bidempotent_[a-z_]+", (monitoring / "alerts.yml").read_text()))
    assert len(used) > 15
    assert used <= served, used - served
    page = (monitoring.parent / "monitoring.rst").read_text()
    assert {name for name in served if not name.endswith("_total")} <= {
        name.removesuffix("_total") for name in re.findall(r"idempotent_[a-z_]+", page)} | {
        "idempotent_run_pages_failed", "idempotent_run_pages_redirected",
        "idempotent_run_records_updated", "idempotent_run_records_unchanged"}


def test_a_broken_database_is_a_figure_not_an_error(tmp_path: Path) -> None:
    got = samples(exposition(tmp_path / "missing.sqlite3"))
    assert got == {("idempotent_store_up", ()): 0}


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _query(prometheus: str, expr: str) -> float | None:
    """The value of an instant query of one sample, None when it has none (yet)."""
    answer = json.loads(_get(f"{prometheus}/api/v1/query?"
                             + urllib.parse.urlencode({"query": expr})))
    result = answer["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def _start_prometheus(tmp_path: Path, target: str) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary: install Debian's prometheus package")
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                      "scrape_configs:\n  - job_name: crawl\n"
                      f"    static_configs:\n      - targets: ['{target}']\n")
    port = free_port()
    with (tmp_path / "prometheus.log").open("wb") as log:
        server = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    return server, f"http://127.0.0.1:{port}"


def _up(url: str) -> bool:
    try:
        _get(url)
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_prometheus_scrapes_the_crawl_of_two_workers_one_killed(tmp_path: Path) -> None:
    # on SQLite only: over a minute per backend, the time of the crawl, not of the store
    db = str(tmp_path / "crawl.sqlite3")
    port = free_port()
    processes: list[subprocess.Popen[Any]] = []
    try:
        # slow enough (about 16 pages a second) that the crawl outlasts Prometheus' start
        with LocalSite(delay=0.25) as site:
            workers = [start_shop_crawl(site.url, db, tmp_path / f"worker{n}.log",
                                        "CONCURRENT_REQUESTS=2")
                       for n in (1, 2)]
            processes += workers
            wait_for(lambda: requests_done(db) > 0, 60, "a first page done",
                     tmp_path / "worker1.log")
            with (tmp_path / "exporter.log").open("wb") as log:
                exporter = subprocess.Popen(
                    [sys.executable, "-m", "scrapy", "idempotent", "metrics", "--db", db,
                     "--listen", f"127.0.0.1:{port}"], cwd=EXAMPLE_PROJECT,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
            processes.append(exporter)
            endpoint = f"http://127.0.0.1:{port}/metrics"
            wait_for(lambda: _up(endpoint), 60, "the metrics endpoint",
                     tmp_path / "exporter.log")
            prometheus, api = _start_prometheus(tmp_path, f"127.0.0.1:{port}")
            processes.append(prometheus)
            wait_for(lambda: _up(f"{api}/-/ready"), 60, "Prometheus ready",
                     tmp_path / "prometheus.log")

            done = 'idempotent_run_pages_done_total{run="1"}'
            wait_for(lambda: _query(api, "idempotent_workers_alive") == 2, 60,
                     "two live workers, scraped", tmp_path / "prometheus.log")
            # the killed worker's commits: done by then, scraped by Prometheus
            wait_for(lambda: (_query(api, done) or 0) >= 40, 120, "40 pages done, scraped",
                     tmp_path / "worker1.log")
            os.kill(workers[0].pid, signal.SIGKILL)
            workers[0].wait()
            killed_at = requests_done(db)
            assert workers[1].wait(timeout=240) == 0
            report = status(db)
            run = report["run"]
            assert run["done"] >= killed_at
            # what Prometheus scraped after the crawl ended is what the store says
            wait_for(lambda: _query(api, "idempotent_current_run_finished") == 1, 60,
                     "the finished run, scraped")
            wait_for(lambda: _query(api, done) == run["done"], 60, "the final count, scraped")
            # the frontier-wide counts are read again at most once per ten times their read
            # time: wait for a reading taken after the end
            wait_for(lambda: _query(api, 'idempotent_requests{state="done"}') == 525, 60,
                     "the frontier's final count, scraped")
            assert _query(api, 'idempotent_requests{state="done"}') == \
                report["frontier"]["done"] == 525
            assert _query(api, "idempotent_records") == report["records"]["stored"] == 500
            assert _query(api, 'idempotent_run_records_inserted_total{run="1"}') == 500
            assert _query(api, 'idempotent_run_requests_leased_total{run="1"}') == \
                run["leased"]
            assert _query(api, "idempotent_downloads_total") == \
                report["repeated"]["downloads"]
            assert _query(api, "idempotent_workers_alive") == 0
            # the killed worker's leases, taken back by the other one: counted in the store
            assert _query(api, 'idempotent_run_leases_reclaimed_total{run="1"}') == \
                run["leases_reclaimed"] >= 1
            # the killed worker's part is counted: never lower after the kill than before
            lowest_after = _query(api, f"min_over_time({done}[10m])")
            assert lowest_after is not None and lowest_after > 0
            assert _query(api, f"resets({done}[10m])") == 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert exporter.returncode == 0


@deferred_f_from_coro_f
async def test_status_watch_redraws_in_place_with_rates_per_minute(
        crawl_database: str) -> None:
    """Through a pseudo-terminal, as a user sees it: frames redrawn in place (the screen
    cleared before each), a rate per minute once the figures move, Ctrl+C ends it with 0."""
    import pty
    import re
    import select

    with LocalSite(listing_pages=1, products_per_page=4) as site:
        await run_crawl(ShopSpider, crawl_settings(crawl_database, **NATURAL_KEYS),
                        url=site.url)
    leader, follower = pty.openpty()
    # Ctrl+C's KeyboardInterrupt is set up in the watcher: a SIGINT ignored by the process
    # that runs the tests (left so by an earlier test) would be ignored by it too
    watcher = subprocess.Popen(
        [sys.executable, "-c",
         "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler);"
         " sys.argv = ['scrapy', *sys.argv[1:]]; runpy.run_module('scrapy', run_name='__main__')",
         "idempotent", "status", "--db", crawl_database, "--watch", "0.2"],
        stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    output = b""

    def frames() -> list[str]:
        return output.decode(errors="replace").split("\x1b[H\x1b[2J")[1:]

    def read_until(condition: Any) -> None:
        nonlocal output
        deadline = time.monotonic() + 60
        while not condition() and time.monotonic() < deadline:
            if select.select([leader], [], [], 1)[0]:
                try:
                    output += os.read(leader, 65536)
                except OSError:  # (EIO: the watcher has exited, its terminal is closed)
                    time.sleep(0.05)
        assert condition(), output.decode(errors="replace")

    try:
        read_until(lambda: len(frames()) >= 2)
        first = frames()[0]
        assert "run 1, finished (finished)" in first
        assert re.search(r"pages done\s+5\s+-", first)
        # the figures move (as another worker's commits would move them)
        add_to_run_counter(crawl_database, 1, "done", 1000)
        read_until(lambda: any(re.search(r"pages done\s+1005\s+[1-9]\d*/min", f)
                               for f in frames()[:-1]))
        watcher.send_signal(signal.SIGINT)
        # its terminal is read until it has exited: a watcher blocked writing a frame to a
        # full terminal would otherwise never get to exit
        read_until(lambda: watcher.poll() is not None)
        assert watcher.wait(timeout=30) == 0
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
        os.close(leader)


def test_the_frontier_wide_figures_are_read_again_in_the_background_when_due(
        crawl_database: str) -> None:
    """Each scrape reads the runs, leases, workers and outbox; the passes over the whole
    frontier only once ten times their read time has passed (injected clock), on a thread."""
    store = open_store(crawl_database)
    store.open(fingerprinter="SHA1")
    store.close()
    reads: list[str] = []
    now = [1000.0]

    def opened() -> Any:
        opened_store = open_store(crawl_database)
        opened_store.open_existing(readonly=True)
        real = opened_store.crawl_metrics

        def counted() -> Any:
            reads.append("frontier")
            now[0] += 2.0  # the read takes 2 s on the injected clock
            return real()

        opened_store.crawl_metrics = counted  # type: ignore[method-assign]
        return opened_store

    collector = StoreCollector(opened, clock=lambda: now[0])
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(collector)

    def scrape() -> dict[Any, float]:
        return samples(prometheus_client.generate_latest(registry).decode())

    got = scrape()
    assert reads == ["frontier"]
    assert got[("idempotent_frontier_read_seconds", ())] == 2.0
    now[0] += 15.0  # 17 s after the read started: not due before 20 s
    scrape()
    assert reads == ["frontier"]
    now[0] += 5.0
    scrape()
    wait_for(lambda: len(reads) == 2 and collector._reading is None, 30,
             "the background read")
    assert scrape()[("idempotent_store_up", ())] == 1


def _counting_collector(database: str, now: list[float], *, read_seconds: float = 0.0,
                        hold: threading.Event | None = None) -> tuple[Any, list[int]]:
    """A collector whose frontier-wide reads are counted, each serving its number as
    ``idempotent_records`` and taking ``read_seconds`` on the injected clock ``now``; with
    ``hold``, reads after the first wait for it."""
    reads: list[int] = []

    def opened() -> Any:
        opened_store = open_store(database)
        opened_store.open_existing(readonly=True)
        real = opened_store.crawl_metrics

        def counted() -> Any:
            if reads and hold is not None:
                assert hold.wait(60)
            reads.append(len(reads) + 1)
            now[0] += read_seconds
            return dataclasses.replace(real(), records=len(reads))

        opened_store.crawl_metrics = counted  # type: ignore[method-assign]
        return opened_store

    collector = StoreCollector(opened, clock=lambda: now[0])
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry, reads


def test_a_scrape_serves_the_frontier_figures_read_for_it(crawl_database: str) -> None:
    """A quick frontier-wide read that is due is waited for: each scrape serves the reading
    taken for it, not the one taken after the scrape before."""
    store = open_store(crawl_database)
    store.open(fingerprinter="SHA1")
    store.close()
    now = [1000.0]
    registry, reads = _counting_collector(crawl_database, now, read_seconds=0.01)
    for n in (1, 2, 3):
        got = samples(prometheus_client.generate_latest(registry).decode())
        assert got[("idempotent_records", ())] == n == len(reads)
        now[0] += 60.0  # due again at the next scrape


def test_a_slow_frontier_read_does_not_hold_the_scrape(crawl_database: str) -> None:
    """After a read that took longer than FRONTIER_WAIT_SECONDS the scrape serves the last
    reading while the next one runs in the background."""
    from scrapy_idempotent.metrics import FRONTIER_WAIT_SECONDS

    store = open_store(crawl_database)
    store.open(fingerprinter="SHA1")
    store.close()
    now = [1000.0]
    hold = threading.Event()
    registry, reads = _counting_collector(crawl_database, now,
                                          read_seconds=FRONTIER_WAIT_SECONDS + 1, hold=hold)

    def records() -> float:
        return samples(prometheus_client.generate_latest(registry).decode())[
            ("idempotent_records", ())]

    assert records() == 1
    now[0] += 60.0
    assert records() == 1  # the second read is held: not waited for
    hold.set()
    wait_for(lambda: len(reads) == 2, 30, "the background read")
    wait_for(lambda: records() == 2, 30, "the background reading served")


def test_the_metrics_command_waits_for_the_database(tmp_path: Path) -> None:
    """Started before the first crawl, the exporter serves ``idempotent_store_up 0`` (one
    warning, not one per scrape) until the database exists, then its figures."""
    db = tmp_path / "later.sqlite3"
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}/metrics"
    with (tmp_path / "exporter.log").open("wb") as log:
        exporter = subprocess.Popen(
            [sys.executable, "-m", "scrapy", "idempotent", "metrics", "--db", str(db),
             "--listen", f"127.0.0.1:{port}"], cwd=EXAMPLE_PROJECT,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait_for(lambda: exporter.poll() is not None or _up(endpoint), 60,
                 "the metrics endpoint", tmp_path / "exporter.log")
        assert exporter.poll() is None, (tmp_path / "exporter.log").read_text()
        for _ in range(3):
            assert samples(_get(endpoint)) == {("idempotent_store_up", ()): 0}
        assert not db.exists()  # nothing created
        store = open_store(str(db))
        store.open(fingerprinter="SHA1")
        store.close()
        got = samples(_get(endpoint))
        assert got[("idempotent_store_up", ())] == 1
        assert got[("idempotent_records", ())] == 0
    finally:
        exporter.send_signal(signal.SIGTERM)
        exporter.wait(timeout=60)
    assert exporter.returncode == 0
    warnings = [line for line in (tmp_path / "exporter.log").read_text().splitlines()
                if "cannot read the store" in line]
    assert len(warnings) == 1 and f"no frontier database at {db}" in warnings[0], warnings


@pytest.mark.slow
@deferred_f_from_coro_f
async def test_status_chart_draws_the_run_as_headless_chromium_shows_it(
        crawl_database: str, tmp_path: Path) -> None:
    """The page is self-contained (no script, nothing fetched) and Chromium draws its lines:
    the screenshot has the colours of the series."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium binary: install Debian's chromium package")
    from PIL import Image

    with LocalSite(listing_pages=2, products_per_page=5, products_failing=[3]) as site:
        await run_crawl(ShopSpider, crawl_settings(crawl_database, **NATURAL_KEYS),
                        url=site.url)
    page = tmp_path / "run.html"
    result = subprocess.run([sys.executable, "-m", "scrapy", "idempotent", "status", "--db",
                             crawl_database, "--chart", str(page)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    text = page.read_text()
    assert "<svg" in text and "<script" not in text
    assert "src=" not in text and "href=" not in text and "url(" not in text
    assert "pages done: 11" in text and "pages failed: 1" in text
    assert "records changed: 9" in text
    shot = tmp_path / "run.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                    "--disable-background-networking", "--no-first-run",
                    f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1000,560",
                    f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    with Image.open(shot) as image:
        rgb_image = image.convert("RGB")
        colours = {rgb_image.getpixel((x, y)) for x in range(rgb_image.width)
                   for y in range(rgb_image.height)}
    for colour in ("#2b7bb9", "#d62728", "#2ca02c"):
        rgb = tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
        assert rgb in colours, colour


@deferred_f_from_coro_f
async def test_the_chart_from_samples_counts_what_the_stored_rows_say(
        crawl_database: str, second_crawl_database: str) -> None:
    """The run's samples (one at the start, one at the close) give the chart the totals that
    counting the stored rows gives; without samples (IDEMPOTENT_SAMPLE_SECONDS = 0) the chart
    is counted from the rows."""
    from scrapy_idempotent.commands import chart

    with LocalSite(listing_pages=2, products_per_page=5, products_failing=[3]) as site:
        await run_crawl(ShopSpider, crawl_settings(crawl_database, **NATURAL_KEYS),
                        url=site.url)
        unsampled = second_crawl_database
        await run_crawl(ShopSpider, crawl_settings(unsampled, IDEMPOTENT_SAMPLE_SECONDS=0,
                                                   **NATURAL_KEYS), url=site.url)

    def totals(series: dict[str, Any]) -> dict[str, int]:
        return {name: sum(counts.values()) for name, counts in series.items()}

    store = open_store(crawl_database)
    store.open_existing(readonly=True)
    try:
        (run,) = store.runs()
        samples = store.samples(1)
        assert samples and samples[-1].done == run.done == 11
        from_samples = totals(chart.from_samples(run, samples))
        assert from_samples == totals(chart.from_rows(store, 1)) == {
            "pages done": 11, "pages failed": 1, "repeats": 0, "records changed": 9}
    finally:
        store.close()
    store = open_store(unsampled)
    store.open_existing(readonly=True)
    try:
        assert store.samples(1) == []
        assert totals(chart.per_minute(store)[1]) == from_samples
    finally:
        store.close()


@pytest.mark.slow
def test_each_worker_serves_its_own_process_figures(tmp_path: Path) -> None:
    """IDEMPOTENT_METRICS_LISTEN: a crawl process serves its process figures and its Scrapy
    stats while its spider runs, and stops serving at its close."""
    db = tmp_path / "crawl.sqlite3"
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}/metrics"
    leased = 'idempotent_process_stat{stat="idempotent/requests/leased"}'

    def figures() -> dict[Any, float]:
        try:
            with urllib.request.urlopen(endpoint, timeout=10) as response:
                return samples(response.read().decode())
        except OSError:
            return {}

    with LocalSite(delay=0.25) as site:
        worker = start_shop_crawl(site.url, db, tmp_path / "worker.log", "CONCURRENT_REQUESTS=2",
                                  f"IDEMPOTENT_METRICS_LISTEN=127.0.0.1:{port}")
        try:
            wait_for(lambda: figures().get(
                ("idempotent_process_stat", (("stat", "idempotent/requests/leased"),)), 0) > 0,
                120, f"{leased} served", tmp_path / "worker.log")
            got = figures()
            assert got[("process_resident_memory_bytes", ())] > 0
            assert got[("process_cpu_seconds_total", ())] > 0
            (info,) = [labels for name, labels in got if name == "idempotent_process_info"]
            assert dict(info)["spider"] == "shop" and dict(info)["worker"].count(":") == 4
            worker.send_signal(signal.SIGINT)  # a graceful stop: the spider closes
            assert worker.wait(timeout=240) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    assert figures() == {}


def test_status_watch_shows_reclaims_heartbeats_and_the_outbox_backlog() -> None:
    from scrapy_idempotent.commands.watch import _figures, view
    from scrapy_idempotent.store.reads import (
        CrawlMetrics,
        LeaseHolder,
        OutboxBacklog,
        RequestSummary,
        RunSummary,
    )

    run = RunSummary(run_id=2, started_at=1000.0, finished_at=None, reason=None, leased=30,
                     done=20, failed=1, redirected=0, records_inserted=15, records_updated=2,
                     records_unchanged=0, rejects=0, records_stale=3, leases_reclaimed=7,
                     leases_lost=2)
    m = CrawlMetrics(
        read_at=1600.0, requests={"pending": 5, "leased": 4, "done": 20}, records=17,
        runs=(run,), failures={}, summary=RequestSummary(30, 30, 2, 2, 0, 0, 0, 30, 2),
        leases=(LeaseHolder("w1", 4, 1630.0),), live_workers=("w1",),
        outbox={"hook": {"pending": 6}}, outbox_backlog={"hook": OutboxBacklog(6, 1300.0)},
        heartbeats={"w1": 1590.0, "gone": 1000.0})
    text = "\n".join(view(m, "db", _figures(m), None, 0.0))
    for line in (r"leases reclaimed\s+7", r"leases lost\s+2", r"records stale\s+3",
                 r"w1\s+10 s ago", r"hook\s+6\s+5m00s"):
        assert re.search(line, text), (line, text)
    assert "gone" not in text
