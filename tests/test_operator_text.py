"""What the operator commands say of one thing: ``1 run``, ``fetches it`` (not ``1 runs``,
``fetches them``)."""

from __future__ import annotations

from pathlib import Path

from helpers.commands import idempotent
from scrapy_idempotent.store import (
    Completion,
    CrawlIdentity,
    NewRequest,
    RequestState,
    SQLiteStore,
    UnitOfWork,
)

SHOP = CrawlIdentity(project="shop", spider="shop", source="shop")
WORKER = "other-host:4242:1:1"


def crawled_with_one_failure(path: Path) -> None:
    """One run, one request, failed; the crawl ended."""
    store = SQLiteStore(str(path))
    store.open(fingerprinter="f", identity=SHOP)
    store.begin_session(WORKER, "auto")
    store.commit(UnitOfWork(requests=[NewRequest(
        key="k1", fingerprint="k1", url="https://shop.example/1", priority=0, data="{}")]),
        WORKER)
    assert len(store.commit(UnitOfWork(claim=1), WORKER).leased) == 1
    store.commit(UnitOfWork(completions=[Completion(
        "k1", RequestState.FAILED, error_kind="http_error/404", error_message="404")]), WORKER)
    store.end_session(WORKER, "finished")
    store.close()


def test_one_thing_is_said_in_the_singular(tmp_path: Path) -> None:
    source = tmp_path / "crawl.sqlite3"
    crawled_with_one_failure(source)
    code, out, err = idempotent("retry", "--db", str(source))
    assert code == 0, err
    assert out.startswith("Put 1 failed request back to pending; run 1 ")
    assert "and fetches it (unless" in out


def test_migrate_counts_one_run_in_the_singular(tmp_path: Path, postgres_url: str) -> None:
    source = tmp_path / "crawl.sqlite3"
    crawled_with_one_failure(source)
    code, out, err = idempotent("migrate", "--db", str(source), "--to", postgres_url)
    assert code == 0, err
    assert ": 1 run, 1 request, 0 records, 0 rejects, 0 responses;" in out


def test_a_relative_db_is_taken_from_the_project_as_the_setting_is(tmp_path: Path) -> None:
    """One rule for relative paths: ``--db data/x.sqlite3`` from a subdirectory of the project
    names the file IDEMPOTENT_DATABASE = "data/x.sqlite3" names, and it is shown absolute."""
    import shutil
    import subprocess
    import sys

    from crawling import EXAMPLE_PROJECT

    project = tmp_path / "project"
    shutil.copytree(EXAMPLE_PROJECT, project,
                    ignore=shutil.ignore_patterns(".scrapy", "__pycache__", "*.sqlite3*"))
    (project / "data").mkdir()
    (project / "logs").mkdir()
    crawled_with_one_failure(project / "data" / "shop.sqlite3")
    result = subprocess.run(
        [sys.executable, "-m", "scrapy", "idempotent", "failed", "--db", "data/shop.sqlite3"],
        cwd=project / "logs", stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("1 failed request\n"), result.stdout
    status = subprocess.run(
        [sys.executable, "-m", "scrapy", "idempotent", "status", "--db", "data/shop.sqlite3"],
        cwd=project / "logs", stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=120, check=False)
    assert status.stdout.startswith(f"Database  {project / 'data' / 'shop.sqlite3'}\n"), (
        status.stdout + status.stderr)
