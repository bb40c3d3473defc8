"""``scrapy idempotent status|failed|retry|export|check`` on databases of real crawls of the
example shop: with failing products, after a retry, after a SIGKILL, tampered with."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import EXAMPLE_PROJECT, crawl_settings, run_crawl, start_shop_crawl
from helpers.commands import idempotent, idempotent_json
from helpers.shop_spiders import NATURAL_KEYS, PartlyBrokenSpider
from scrapy_idempotent.store.registry import redacted
from scrapy_idempotent.store.sqlite import SCHEMA_VERSION
from shop.site import product_sku
from shop.spiders.shop import ShopSpider

ISO_SECONDS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def scrapy_subprocess(*args: str, cwd: Path | None = None,
                      env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real thing: ``python -m scrapy ARGS`` (the entry point registered in setup.cfg)."""
    return subprocess.run([sys.executable, "-m", "scrapy", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


@deferred_f_from_coro_f
async def test_failed_retry_and_the_next_crawl_fetches_only_the_failed(
    crawl_database: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    failing = {3, 7, 42}
    db = crawl_database
    settings = crawl_settings(db, **NATURAL_KEYS)
    # one site for both crawls: it recovers between them on the same address (a site
    # restarted on the same port could find the port taken by another process meanwhile)
    site = LocalSite(products_failing=failing).start()
    request.addfinalizer(site.stop)
    await run_crawl(ShopSpider, settings, url=site.url)
    urls = {f"{site.url}/product/{product_sku(n)}" for n in failing}

    status = idempotent_json("status", "--db", db)
    assert status["run"]["run_id"] == 1 and status["run"]["state"] == "finished"
    assert status["frontier"] == {"pending": 0, "leased": 0, "done": 522, "failed": 3,
                                  "redirected": 0, "total": 525}
    assert status["failures"] == {"http_status": 3}
    assert status["records"]["stored"] == status["records"]["inserted"] == 497
    assert status["leases"] == []
    assert status["totals"]["crawls_by_end"] == {"finished": 1}

    code, out, _ = idempotent("failed", "--db", db)
    assert code == 0
    assert out.startswith("3 failed requests\n")
    assert re.search(r"kind\s+attempts\s+failed at\s+url\s+message", out)
    for url in urls:
        assert re.search(rf"http_status\s+1\s+\S+Z\s+{re.escape(url)}\s+HTTP 503 not handled",
                         out)
    failed = idempotent_json("failed", "--db", db, "--kind", "http_status", "--url",
                             "*/SKU-0000[37]")
    assert failed["matching"] == 2
    assert {r["url"] for r in failed["failed"]} == {
        f"{site.url}/product/{product_sku(n)}" for n in (3, 7)}  # the URL, not the port
    assert idempotent_json("failed", "--db", db, "--url", "re:00042$")["matching"] == 1
    assert idempotent_json("failed", "--db", db, "--kind", "download_error")["matching"] == 0
    assert idempotent_json("failed", "--db", db, "--limit", "1")["listed"] == 1

    code, out, _ = idempotent("retry", "--db", db, "--url", "*/SKU-00042")
    assert code == 0
    assert out.startswith("Put 1 failed request with URL matching '*/SKU-00042' back to "
                          "pending; run 1 reopened")
    assert idempotent_json("retry", "--db", db) == {
        "database": redacted(db), "retried": 2, "run_id": 1, "reopened": False}
    status = idempotent_json("status", "--db", db)
    assert status["frontier"]["pending"] == 3 and status["frontier"]["failed"] == 0
    assert status["run"]["finished_at"] is None
    assert idempotent("check", "--db", db)[0] == 0

    # the next crawl resumes run 1 and fetches the three products, nothing else
    site.set_products_failing(())
    site.reset_counts()
    crawler = await run_crawl(ShopSpider, settings, url=site.url)
    assert site.counts_by_path() == {f"/product/{product_sku(n)}": 1 for n in failing}
    assert crawler.stats.get_value("idempotent/run_id") == 1
    assert crawler.stats.get_value("idempotent/records/inserted") == 3
    status = idempotent_json("status", "--db", db)
    assert status["run"]["state"] == "finished"
    assert status["frontier"]["done"] == 525 and status["frontier"]["failed"] == 0
    assert status["records"]["stored"] == 500
    assert status["totals"]["crawls"] == 2

    out_path = tmp_path / "records.jsonl"
    code, out, _ = idempotent("export", "--db", db, "-o", str(out_path))
    assert (code, out) == (0, f"Exported 500 records to {out_path} (jsonlines)\n")
    rows = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert {r["sku"]: (r["name"], r["price"]) for r in rows} == {
        sku: (p["name"], p["price"]) for sku, p in site.expected_products().items()}


@deferred_f_from_coro_f
async def test_export_formats_and_changed_since_filters(tmp_path: Path,
                                                       crawl_database: str) -> None:
    db = crawl_database
    settings = crawl_settings(db, **NATURAL_KEYS)
    with LocalSite(listing_pages=2, products_per_page=5) as shop:
        await run_crawl(ShopSpider, settings, url=shop.url)
        between = datetime.now(timezone.utc).isoformat()
        time.sleep(0.01)
        # run 2 on the same shop with five more products: 10 unchanged, 5 inserted
        shop.set_catalogue(listing_pages=3, products_per_page=5)
        await run_crawl(ShopSpider, settings, url=shop.url)

    def export(*args: str) -> Path:
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        code, _, err = idempotent("export", "--db", db, "-o", str(out), *args)
        assert code == 0, err
        return out

    lines = export("--format", "jsonl").read_text().splitlines()
    assert len(lines) == 15
    first = json.loads(lines[0])
    assert list(first) == ["record_id", "first_seen", "last_changed", "sku", "name", "price",
                           "url"]  # the item's own field order
    assert ISO_SECONDS.match(first["first_seen"]) and ISO_SECONDS.match(first["last_changed"])
    assert len(first["record_id"]) == 32

    with export("--format", "csv").open(newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 15
    assert {r["sku"] for r in table} == {product_sku(n) for n in range(1, 16)}
    assert {r["record_id"] for r in table} == {json.loads(line)["record_id"] for line in lines}

    records = json.loads(export("--format", "json").read_text())
    assert len(records) == 15 and records[0] == first

    new = {product_sku(n) for n in range(11, 16)}
    assert {json.loads(line)["sku"] for line in
            export("--run", "2").read_text().splitlines()} == new
    assert len(export("--run", "1").read_text().splitlines()) == 15
    assert {json.loads(line)["sku"] for line in
            export("--since", between).read_text().splitlines()} == new
    assert export("--since", "2999-01-01").read_text() == ""

    status = idempotent_json("status", "--db", db)
    assert [(r["run_id"], r["records_inserted"], r["records_unchanged"])
            for r in status["runs"]] == [(1, 10, 0), (2, 5, 10)]
    assert status["totals"]["records_inserted"] == 15


def test_status_and_check_show_the_leases_of_a_killed_crawl(tmp_path: Path,
                                                            crawl_database: str) -> None:
    db = crawl_database
    with LocalSite(delay=0.02) as site:
        crawl = start_shop_crawl(site.url, db, tmp_path / "crawl.log")
        deadline = time.monotonic() + 30
        while site.request_count < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(crawl.pid, signal.SIGKILL)
        crawl.wait()
        assert site.request_count >= 40

    status = idempotent_json("status", "--db", db)
    assert status["run"]["state"] == "open (killed)"
    assert status["totals"]["crawls_by_end"] == {"killed": 1}
    (lease,) = status["leases"]
    assert lease["worker"].split(":")[1] == str(crawl.pid)
    assert lease["worker_state"] == "dead"
    assert lease["leases"] == status["frontier"]["leased"] > 0
    _, out, _ = idempotent("status", "--db", db)
    assert "Run 1     unfinished (last crawl: killed): the next crawl resumes it" in out
    assert re.search(rf"{re.escape(lease['worker'])}\s+{lease['leases']}\s+\S+Z \(in \d+ s\)"
                     r"\s+dead: process gone", out)

    # check through the installed entry point, in a real process
    # the leases a kill left heal by themselves (the next crawl takes them back): reported,
    # and check exits 0, so monitoring built on its exit code does not alert after every kill
    result = scrapy_subprocess("idempotent", "check", "--db", db)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(rf"heals\s+leases\s+{lease['leases']} leases held by "
                     rf"{re.escape(lease['worker'])}, a process of this host that no longer "
                     "exists", result.stdout)
    assert result.stdout.endswith("No problem found; 1 state that heals by itself (the next "
                                  "crawl takes the leases back)\n")
    report = idempotent_json("check", "--db", db)
    assert (report["ok"], report["problems"], report["heals"]) == (True, 0, 1)
    assert [c["heals"] for c in report["checks"] if c["check"] == "leases"] == [True]


@deferred_f_from_coro_f
async def test_check_reports_impossible_rows_and_other_commands_refuse_foreign_schemas(
    db_path: Path,
) -> None:
    db = str(db_path)
    with LocalSite(listing_pages=1, products_per_page=4) as site:
        await run_crawl(ShopSpider, crawl_settings(db_path, **NATURAL_KEYS), url=site.url)
    assert idempotent_json("check", "--db", db)["ok"] is True

    conn = sqlite3.connect(db_path)
    with conn:
        conn.execute("UPDATE requests SET worker = 'somebody' WHERE id = 1")
        conn.execute("UPDATE requests SET state = 'lost' WHERE id = 2")
        key = conn.execute("SELECT key FROM requests WHERE id = 3").fetchone()[0]
        conn.execute("INSERT INTO responses VALUES (?, '{}', x'', 0)", (key,))
    conn.execute("PRAGMA journal_mode = DELETE")
    conn.close()
    report = idempotent_json("check", "--db", db)
    assert report["ok"] is False and report["problems"] == 2
    problems = {c["check"]: c["detail"] for c in report["checks"] if not c["ok"]}
    assert problems == {
        "journal_mode": "journal mode delete (expected wal)",
        "rows": "1 requests in an unknown state; 1 requests not leased but with a worker or "
                "lease time; 1 journaled responses of requests that are not pending or leased",
    }
    code, out, _ = idempotent("check", "--db", db)
    assert code == 1 and out.endswith("2 problems found\n")

    conn = sqlite3.connect(db_path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    assert idempotent_json("check", "--db", db)["checks"][1] == {
        "check": "schema_version", "ok": False, "heals": False,
        "detail": f"schema version 99, this scrapy_idempotent reads {SCHEMA_VERSION}"}
    code, out, err = idempotent("status", "--db", db)
    assert (code, out) == (1, "")
    assert f"has schema version 99; this scrapy_idempotent reads version {SCHEMA_VERSION}" in err


def test_usage_errors_and_a_missing_database(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.sqlite3")
    code, _, err = idempotent("status", "--db", missing)
    assert (code, err) == (1, f"scrapy idempotent status: no frontier database at {missing}\n")
    assert not os.path.exists(missing)  # not created
    for args, message in [
        ((), "choose one of status, failed, retry, rejects, export, check"),
        (("stats", "--db", missing), "unknown command 'stats'"),
        (("status",), "not inside a Scrapy project (no scrapy.cfg in"),
        (("status", "shop", "--db", missing), "give a spider name or --db PATH, not both"),
        (("status", "--db", missing, "--kind", "x"), "--kind applies to failed and retry"),
        (("status", "--db", missing, "--rejects"), "--rejects applies to retry"),
        (("retry", "--db", missing, "--rejects", "--kind", "x"), "use one or the other"),
        (("failed", "--db", missing, "--url", "re:("), "bad regular expression"),
        (("export", "--db", missing, "--since", "yesterday"), "not an ISO 8601 date"),
        (("check", "--db", missing, "--bogus"), "unknown option --bogus"),
    ]:
        code, _, err = idempotent(*args)
        assert code == 2 and message in err, (args, err)


@deferred_f_from_coro_f
async def test_a_spider_name_resolves_the_database_like_the_scheduler(tmp_path: Path) -> None:
    # the default path, inside a project: .scrapy/idempotent/<spider>.sqlite3 next to scrapy.cfg
    project = tmp_path / "project"
    default_db = project / ".scrapy" / "idempotent" / "shop.sqlite3"
    project.mkdir()
    (project / "scrapy.cfg").write_text("[settings]\ndefault = shop.settings\n")
    with LocalSite(listing_pages=1, products_per_page=2) as site:
        await run_crawl(ShopSpider, crawl_settings(default_db, **NATURAL_KEYS), url=site.url)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(EXAMPLE_PROJECT), os.environ.get("PYTHONPATH")]))}
    result = scrapy_subprocess("idempotent", "status", "shop", "--json", cwd=project, env=env)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert Path(status["database"]).resolve() == default_db.resolve()
    assert status["records"]["stored"] == 2

    # IDEMPOTENT_DATABASE with {spider}, given with -s (here outside any project)
    template = str(tmp_path / "dbs" / "{spider}.sqlite3")
    default_db.parent.rename(tmp_path / "dbs")
    status = idempotent_json("status", "shop", "-s", f"IDEMPOTENT_DATABASE={template}")
    assert status["database"] == str(tmp_path / "dbs" / "shop.sqlite3")
    assert status["frontier"]["done"] == 3


@deferred_f_from_coro_f
async def test_rejects_are_listed_and_their_pages_fetched_again_once_the_spider_is_fixed(
    crawl_database: str
) -> None:
    db = crawl_database
    settings = crawl_settings(db, **NATURAL_KEYS)
    with LocalSite() as site:
        PartlyBrokenSpider.broken = True
        crawler = await run_crawl(PartlyBrokenSpider, settings, url=site.url)
        assert crawler.stats.get_value("idempotent/records/rejected") == 50
        code, out, _ = idempotent("rejects", "--db", db, "--limit", "0")
        assert code == 0
        assert out.startswith("50 rejected items\n")
        assert re.search(r"run\s+rejected at\s+type\s+page\s+reason\s+put back", out)
        assert re.search(
            rf"1\s+\S+Z\s+shop\.items\.ProductItem\s+{re.escape(site.url)}/product/SKU-00010\s+"
            r"shop\.items\.ProductItem item has no natural key: field 'sku'", out)
        report = idempotent_json("rejects", "--db", db, "--limit", "3")
        assert (report["total"], report["listed"]) == (50, 3)
        assert report["rejects"][0]["page_state"] == "done"

        code, out, _ = idempotent("retry", "--db", db, "--rejects")
        assert code == 0
        assert out.startswith("Put 50 pages of 50 rejected items back to pending; run 1 "
                              "reopened")
        assert idempotent_json("retry", "--db", db, "--rejects")["pages"] == 0  # done once
        assert all(r["retried_at"] for r in idempotent_json("rejects", "--db", db)["rejects"])

        PartlyBrokenSpider.broken = False  # the spider is fixed
        site.reset_counts()
        crawler = await run_crawl(PartlyBrokenSpider, settings, url=site.url)
        assert crawler.stats.get_value("idempotent/run_id") == 1  # the run was resumed
        assert crawler.stats.get_value("idempotent/records/inserted") == 50
        assert set(site.counts_by_path()) == {
            f"/product/{product_sku(n)}" for n in range(10, 501, 10)}
    assert idempotent_json("status", "--db", db)["records"]["stored"] == 500


def test_commands_default_to_the_only_spider_and_name_the_known_ones(tmp_path: Path) -> None:
    project = tmp_path / "project"
    shutil.copytree(EXAMPLE_PROJECT, project,
                    ignore=shutil.ignore_patterns(".scrapy", "__pycache__"))
    result = scrapy_subprocess("idempotent", "status", cwd=project)
    assert result.returncode == 1
    assert result.stderr == ("scrapy idempotent status: no frontier database at "
                             f"{project / '.scrapy' / 'idempotent' / 'shop.sqlite3'}\n")
    result = scrapy_subprocess("idempotent", "failed", "shp", cwd=project)
    assert result.returncode == 2
    assert result.stderr.startswith("scrapy idempotent failed: unknown spider 'shp'; the "
                                     "spiders of this project: shop (no database at ")
    (project / "shop" / "spiders" / "other.py").write_text(
        "import scrapy\n\n\nclass OtherSpider(scrapy.Spider):\n    name = 'other'\n")
    result = scrapy_subprocess("idempotent", "rejects", cwd=project)
    assert result.returncode == 2
    assert result.stderr == ("scrapy idempotent rejects: give a spider name: this project has "
                             "2 spiders (other, shop)\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    result = scrapy_subprocess("idempotent", "status", cwd=outside)
    assert result.returncode == 2
    assert result.stderr == (
        f"scrapy idempotent status: not inside a Scrapy project (no scrapy.cfg in {outside} "
        "or above): run it in the project's directory, or give the database with --db PATH\n")
