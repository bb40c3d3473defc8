"""``scrapy idempotent migrate --to postgresql://...`` copies one consistent state of the
SQLite crawl: refused while a crawl of it runs (even one holding no lease), and a commit
trying to land during the copy waits until the copy is in the target (it is not half in
the copy: no outbox entry without its record)."""

from __future__ import annotations

import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from helpers.commands import idempotent, idempotent_json
from scrapy_idempotent import workers
from scrapy_idempotent.exceptions import StoreBusy
from scrapy_idempotent.store import Completion, NewRequest, Record, RequestState, UnitOfWork
from scrapy_idempotent.store.sqlite import SQLiteStore

psycopg = pytest.importorskip("psycopg")
from scrapy_idempotent.store.postgresql import PostgreSQLStore  # noqa: E402

#: A worker of another host: not live once its session ended (no lease).
OTHER = "other-host:4242:1:1"


def req(key: str) -> NewRequest:
    return NewRequest(key=key, fingerprint=key, url=f"https://shop.example/{key}", priority=0,
                      data="{}")


def rec(record_id: str) -> Record:
    return Record(record_id=record_id, source="shop", natural_key=f'["{record_id}"]',
                  item_type="dict", data=f'{{"sku": "{record_id}"}}',
                  content_hash=f"hash-{record_id}")


def crawled(db_path: Path) -> None:
    """A crawl on SQLite that stopped: one page done with its record r5 and an outbox entry
    for it; k1 pending; its session ended (no lease, no live worker)."""
    store = SQLiteStore(str(db_path))
    store.open(fingerprinter="f")
    store.begin_session(OTHER, "auto")
    store.commit(UnitOfWork(requests=[req("k1"), req("k5")]), OTHER)
    leased = store.commit(UnitOfWork(claim=2), OTHER).leased
    assert {r.key for r in leased} == {"k1", "k5"}
    store.commit(UnitOfWork(records=[(rec("r5"), "k5")],
                            completions=[Completion("k5", RequestState.DONE)],
                            outbox_targets=("h",)), OTHER)
    store.end_session(OTHER, "shutdown")
    store.close()


def copied(url: str) -> tuple[list[str], list[str]]:
    """The record IDs and the outbox entries' record IDs in the target."""
    store = PostgreSQLStore(url, heartbeat_seconds=None)
    try:
        store.open_existing()
        records = sorted(r.record_id for r in store.records_page())
        announced = sorted(e.record_id for e in store.outbox_entries())
    finally:
        store.close()
    return records, announced


def test_a_commit_during_the_copy_waits_for_it_and_the_copy_is_consistent(
        db_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    crawled(db_path)
    outcome: dict[str, Any] = {}

    def commit_a_page() -> None:
        # another process's commit of a page (record r1 + its outbox entry), with a short
        # busy timeout: it lands at once, or finds the database locked
        other = SQLiteStore(str(db_path), busy_timeout_seconds=0.2)
        try:
            other.open(fingerprinter="f")
            other.commit(UnitOfWork(records=[(rec("r1"), "k1")], outbox_targets=("h",)), OTHER)
            outcome["committed"] = True
        except StoreBusy as exc:
            outcome["busy"] = exc
        finally:
            other.close()

    load = PostgreSQLStore.load

    def load_with_a_commit_between_tables(self: PostgreSQLStore, batches: Any) -> Any:
        def interleaved() -> Any:
            for table, rows in batches:
                yield table, rows
                if table == "records" and "tried" not in outcome:
                    # the records are copied (one batch), the outbox is not read yet
                    outcome["tried"] = True
                    committer = threading.Thread(target=commit_a_page)
                    committer.start()
                    committer.join()
        return load(self, interleaved())

    monkeypatch.setattr(PostgreSQLStore, "load", load_with_a_commit_between_tables)
    code, _, err = idempotent("migrate", "--db", str(db_path), "--to", postgres_url)
    assert code == 0, err
    assert outcome.get("tried")
    # the source was locked for the copy: the commit did not land in the middle of it
    assert "busy" in outcome and "committed" not in outcome, outcome
    records, announced = copied(postgres_url)
    assert records == ["r5"]
    assert announced == ["r5"]  # every entry's record is there
    # after the copy the source is free again: its mark taken back (a write), a crawl that
    # waited commits
    code, _, err = idempotent("migrate", "--undo", "--db", str(db_path))
    assert code == 0, err
    commit_a_page()
    assert outcome.get("committed")


def test_migrate_is_refused_while_a_crawl_of_the_source_runs_without_a_lease(
        db_path: Path, postgres_url: str) -> None:
    crawled(db_path)
    running = SQLiteStore(str(db_path))
    worker = workers.new_worker_id()  # of this process, declared live as a crawl's is
    workers.declare_live(worker)
    running.open(fingerprinter="f")
    try:
        running.begin_session(worker, "auto")  # a crawl idle on its queue: no lease held
        code, _, err = idempotent("migrate", "--db", str(db_path), "--to", postgres_url)
        assert code == 1
        assert "in use by the crawl of" in err and worker in err
        assert "stop every crawl of it before migrating" in err
        # nothing was copied
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            schemas = conn.execute("SELECT count(*) FROM pg_namespace"
                                   " WHERE nspname LIKE 'idempotent%'").fetchone()
        assert schemas == (0,)
        running.end_session(worker, "shutdown")
    finally:
        running.close()
        workers.forget_live(worker)
    code, _, err = idempotent("migrate", "--db", str(db_path), "--to", postgres_url)
    assert code == 0, err
    assert copied(postgres_url) == (["r5"], ["r5"])


def test_migrate_takes_back_the_leases_of_a_killed_crawl_at_once(
        db_path: Path, postgres_url: str) -> None:
    """A crawl of this host killed while it held leases (its process is gone): migrate does
    not wait for the leases to expire, nor says to stop a crawl that does not run; the copy's
    requests are pending again, as the next crawl would take them back."""
    process = subprocess.Popen(["sleep", "60"])
    start = workers.process_start_ticks(process.pid)
    process.kill()
    process.wait()
    assert start is not None
    dead = str(workers.WorkerId(socket.gethostname(), process.pid, start, "0000",
                                workers.pid_namespace()))
    assert workers.worker_state(dead) == "dead"
    killed = SQLiteStore(str(db_path), lease_seconds=3600)
    killed.open(fingerprinter="f")
    killed.begin_session(dead, "auto")
    killed.commit(UnitOfWork(requests=[req("k1"), req("k2")]), dead)
    assert len(killed.commit(UnitOfWork(claim=2), dead).leased) == 2
    killed.close()  # no end_session: the process was killed
    code, out, err = idempotent("migrate", "--db", str(db_path), "--to", postgres_url)
    assert code == 0, err
    assert "2 requests" in out
    status = idempotent_json("status", "--db", postgres_url)
    assert (status["frontier"]["pending"], status["frontier"]["leased"]) == (2, 0)
