"""Record observation order and change versions beyond the store contract: databases of the
schema before them are migrated forward, ``migrate --to postgresql://`` carries them, and a
real crawl whose page downloaded earlier commits later keeps the newer record.

The contract itself (stale writes refused, A -> B -> A giving three keys) is in
``tests/test_store_contract.py``, on both backends."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
from local_site import LocalSite
from scrapy import Request, Spider
from scrapy.utils.defer import deferred_f_from_coro_f, maybe_deferred_to_future
from twisted.internet.defer import Deferred

from crawling import crawl_settings, db_rows, run_crawl
from helpers.stored import change_stored, reading, stored_records
from helpers.stores import sqlite_at_version
from scrapy_idempotent import OutboxTarget, signals
from scrapy_idempotent.store import Record, SQLiteStore, UnitOfWork
from scrapy_idempotent.store.base import observation_clock
from scrapy_idempotent.store.sqlite import SCHEMA_VERSION

HOOK = "https://hooks.example/records"


def rec(record_id: str, content_hash: str, observed_at: float | None = None) -> Record:
    return Record(record_id=record_id, source="shop", natural_key='["A1"]', item_type="dict",
                  data=json.dumps({"hash": content_hash}), content_hash=content_hash,
                  observed_at=observed_at)


def test_a_schema_6_database_gets_observation_times_and_versions(tmp_path: Path) -> None:
    path = tmp_path / "v6.sqlite3"
    sqlite_at_version(
        path, 6,
        "INSERT INTO runs (run_id, started_at) VALUES (1, 100.0), (2, 200.0)",
        # r1 changed in run 1 and seen unchanged in run 2; r2 never seen again
        "INSERT INTO records (record_id, source, natural_key, item_type, data, content_hash,"
        " first_seen, last_changed, first_run_id, changed_run_id, seen_run_id, seen_at)"
        " VALUES ('r1', 'shop', '[]', 'dict', '{}', 'hA', 100.0, 150.0, 1, 1, 2, 250.0),"
        " ('r2', 'shop', '[]', 'dict', '{}', 'hX', 110.0, 110.0, 1, 1, 1, NULL)",
        "INSERT INTO outbox (target, idempotency_key, kind, record_id, content_hash,"
        " item_type, source, natural_key, data, run_id, created_at, due_at)"
        " VALUES ('hook', 'r2:hX', 'inserted', 'r2', 'hX', 'dict', 'shop', '[]', '{}', 1,"
        " 110.0, 110.0)")
    store = SQLiteStore(str(path), clock=lambda: 300.0)
    store.open()
    try:
        assert db_rows(path, "PRAGMA user_version") == [(SCHEMA_VERSION,)]
        assert db_rows(path, "SELECT record_id, observed_at, version FROM records"
                             " ORDER BY record_id") == [("r1", 250.0, 1), ("r2", 110.0, 1)]
        store.begin_session("w1", "resume")
        # data observed before the last time r1's data was known to be current: refused
        result = store.commit(UnitOfWork(records=[(rec("r1", "hB", 200.0), None)],
                                         outbox_targets=(HOOK,)), "w1")
        assert (result.records_stale, result.outbox_entries) == (1, 0)
        # a change after it: version 2, and its own key
        result = store.commit(UnitOfWork(records=[(rec("r1", "hB", 260.0), None),
                                                  (rec("r2", "hY", 260.0), None)],
                                         outbox_targets=(HOOK,)), "w1")
        assert result.records_updated == 2
        assert [(e.target, e.key) for e in store.outbox_entries()] == [
            ("hook", "r2:hX"), (HOOK, "r1:2:hB"), (HOOK, "r2:2:hY")]
    finally:
        store.close()


def test_a_schema_4_postgresql_database_gets_observation_times_and_versions(
        postgres_url: str) -> None:
    psycopg = pytest.importorskip("psycopg")
    from scrapy_idempotent.store.postgresql import SCHEMA_VERSION as PG_VERSION
    from scrapy_idempotent.store.postgresql import PostgreSQLStore

    url = f"{postgres_url}?schema=old_records"
    first = PostgreSQLStore(url, clock=lambda: 300.0, heartbeat_seconds=None,
                            dead_after_seconds=None)
    first.open()
    first.close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        # the schema as schema version 4 left it (the steps before are unchanged)
        conn.execute("SET search_path TO old_records")
        conn.execute("ALTER TABLE requests ALTER COLUMN key TYPE text COLLATE \"C\","
                     " ALTER COLUMN parent_key TYPE text,"
                     " ALTER COLUMN fingerprint TYPE text,"
                     " ALTER COLUMN run_id TYPE bigint")  # schema 22 (no rows)
        conn.execute("ALTER TABLE requests DROP COLUMN packed")  # schema 21
        for statement in ("DROP TRIGGER requests_pending_added ON requests",
                          "DROP TRIGGER requests_pending_again ON requests",
                          "DROP FUNCTION slots_pending_added(), slots_pending_again()"):
            conn.execute(statement)  # schema 20 (its column and index go with the table)
        conn.execute("DROP STATISTICS requests_slot_hash")  # schema 19
        conn.execute("ALTER TABLE requests DROP CONSTRAINT requests_key_key, ADD CONSTRAINT"
                     " requests_key_key UNIQUE (key), ADD CONSTRAINT requests_pkey"
                     " PRIMARY KEY (id)")  # schema 18
        conn.execute("ALTER TABLE records DROP COLUMN observed_at, DROP COLUMN version")
        conn.execute("DROP TABLE linked_requests")  # schema 14
        conn.execute("DROP INDEX requests_failed, requests_redirected")  # schema 13
        conn.execute("DROP TABLE page_validators")  # schema 11
        conn.execute("ALTER TABLE requests DROP COLUMN downloads")  # schema 10
        conn.execute("DROP TABLE robots")  # schema 9
        conn.execute("DROP TABLE record_keys")  # schema 8
        conn.execute("DROP TABLE samples")
        conn.execute("DROP TABLE slots")  # schema 7 (its indexes go with the column)
        conn.execute("ALTER TABLE requests DROP COLUMN slot")
        conn.execute("ALTER TABLE sessions DROP COLUMN records_stale,"
                     " DROP COLUMN leases_reclaimed, DROP COLUMN leases_lost")
        conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
        conn.execute(
            "INSERT INTO records (record_id, source, natural_key, item_type, data,"
            " content_hash, first_seen, last_changed, first_run_id, changed_run_id,"
            " seen_run_id, seen_at, seen_seq) VALUES"
            " ('r1', 'shop', '[]', 'dict', '{}', 'hA', 100.0, 150.0, 1, 1, 2, 250.0, 1),"
            " ('r2', 'shop', '[]', 'dict', '{}', 'hX', 110.0, 110.0, 1, 1, 1, NULL, 2)")
    store = PostgreSQLStore(url, clock=lambda: 300.0, heartbeat_seconds=None,
                            dead_after_seconds=None)
    store.open()
    try:
        assert store.meta()["schema_version"] == str(PG_VERSION) == "22"
        got = {r.record_id: (r.observed_at, r.version) for r in store.records_page()}
        assert got == {"r1": (250.0, 1), "r2": (110.0, 1)}
        store.begin_session("w1", "resume")
        result = store.commit(UnitOfWork(records=[(rec("r1", "hB", 200.0), None),
                                                  (rec("r2", "hY", 260.0), None)],
                                         outbox_targets=(HOOK,)), "w1")
        assert (result.records_stale, result.records_updated) == (1, 1)
        assert [e.key for e in store.outbox_entries()] == ["r2:2:hY"]
    finally:
        store.close()


def test_migrate_to_postgresql_carries_observation_times_and_versions(
        tmp_path: Path, postgres_url: str) -> None:
    pytest.importorskip("psycopg")
    from helpers.commands import idempotent
    from scrapy_idempotent.store.postgresql import PostgreSQLStore

    db = tmp_path / "crawl.sqlite3"
    source = SQLiteStore(str(db), clock=lambda: 300.0)
    source.open()
    source.begin_session("w1", "auto")
    for content_hash, observed in (("hA", 100.0), ("hB", 110.0), ("hA", 120.0)):
        source.commit(UnitOfWork(records=[(rec("r1", content_hash, observed), None)]), "w1")
    source.commit(UnitOfWork(records=[(rec("r2", "hX", 130.0), None)]), "w1")
    source.end_session("w1", "shutdown")
    source.close()
    url = f"{postgres_url}?schema=migrated_records"
    code, _, err = idempotent("migrate", "--db", str(db), "--to", url)
    assert code == 0, err
    target = PostgreSQLStore(url, heartbeat_seconds=None, dead_after_seconds=None)
    target.open_existing()
    try:
        got = {r.record_id: (r.content_hash, r.observed_at, r.version)
               for r in target.records_page()}
    finally:
        target.close()
    assert got == {"r1": ("hA", 120.0, 3), "r2": ("hX", 130.0, 1)}


# -- a real crawl -----------------------------------------------------------------------------


class TwoPagesOneRecordSpider(Spider):
    """``/listing`` and ``/product`` both show product P-1, at different prices (the site
    changed between the two downloads)."""

    name = "two_pages"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base_url = url

    async def start(self) -> Any:
        yield Request(self.base_url + "/listing", dont_filter=True)
        yield Request(self.base_url + "/product", dont_filter=True)

    def parse(self, response: Any) -> Any:
        yield {"sku": "P-1", "price": response.css("b::text").get(),
               "page": response.url.rsplit("/", 1)[1]}


class RecordingTarget(OutboxTarget):
    """Acknowledges every announcement, kept in ``RECEIVED`` (key, kind, price)."""

    RECEIVED: ClassVar[list[tuple[str, str, str]]] = []

    async def deliver(self, announcement: Any) -> str:
        payload = announcement.payload
        self.RECEIVED.append((payload["idempotency_key"], payload["kind"],
                              payload["record"]["price"]))
        return "ok"


class ListingCommitsLast:
    """An item pipeline holding the listing's item until the product page was committed,
    after releasing the product page's answer (held by the site) once the listing's
    response is in: the listing is downloaded first and committed last."""

    site: LocalSite

    def __init__(self, crawler: Any) -> None:
        self.product_done: Deferred[None] = Deferred()
        crawler.signals.connect(self._done, signal=signals.request_done)

    @classmethod
    def from_crawler(cls, crawler: Any) -> ListingCommitsLast:
        return cls(crawler)

    def _done(self, request: Any, state: str, **kwargs: Any) -> None:
        if request is not None and request.url.endswith("/product"):
            self.product_done.callback(None)

    async def process_item(self, item: Any, spider: Any = None) -> Any:
        if item["page"] == "listing":
            self.site.release()
            await maybe_deferred_to_future(self.product_done)
        return item


@deferred_f_from_coro_f
async def test_a_page_downloaded_earlier_but_committed_later_keeps_the_newer_record(
        site: LocalSite, crawl_database: str) -> None:
    site.add("/listing", "<html><body><b>10.00</b></body></html>")
    site.add("/product", "<html><body><b>12.00</b></body></html>", held=True)
    ListingCommitsLast.site = site
    RecordingTarget.RECEIVED.clear()
    crawler = await run_crawl(TwoPagesOneRecordSpider, crawl_settings(
        crawl_database, IDEMPOTENT_NATURAL_KEYS={"dict": "sku"},
        IDEMPOTENT_OUTBOX_TARGETS=[f"{__name__}.RecordingTarget"],
        ITEM_PIPELINES={f"{__name__}.ListingCommitsLast": 100}), url=site.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/records/inserted"] == 1
    assert stats["idempotent/records/stale"] == 1
    assert "idempotent/records/updated" not in stats
    [record] = stored_records(crawl_database)
    assert (json.loads(record.data)["price"], record.version) == ("12.00", 1)
    # one announcement: the newer data, inserted; the stale data is never announced
    key = f"{record.record_id}:1:{record.content_hash}"
    assert [(key, "inserted", "12.00")] == RecordingTarget.RECEIVED


# -- a wall clock set back ----------------------------------------------------------------------


def test_a_run_resumed_after_the_clock_was_set_back_keeps_its_order(tmp_path: Path) -> None:
    """SQLite: the host's clock is the database's. A crawl observed r1 at 1000 and was
    killed; the clock was set back 120 s; the resumed crawl (same run) observes r1 changed
    at 885 by the clock, later in fact: it is stored, not refused as stale. Within the
    resumed session, an earlier observation committing later is still refused."""
    now = [1000.0]
    path = str(tmp_path / "crawl.sqlite3")
    first = SQLiteStore(path, clock=lambda: now[0])
    first.open()
    run = first.begin_session("w1", "auto")
    first.commit(UnitOfWork(records=[(rec("r1", "hA", 1000.0), None)]), "w1")
    first.close()  # killed: the run stays open
    now[0] = 880.0
    second = SQLiteStore(path, clock=lambda: now[0])
    second.open()
    try:
        assert second.begin_session("w2", "auto").run_id == run.run_id
        result = second.commit(UnitOfWork(records=[(rec("r1", "hB", 885.0), None)],
                                          outbox_targets=(HOOK,)), "w2")
        assert (result.records_updated, result.records_stale) == (1, 0)
        result = second.commit(UnitOfWork(records=[(rec("r1", "hC", 883.0), None)]), "w2")
        assert (result.records_updated, result.records_stale) == (0, 1)
        (stored,) = second.records_page()
        assert (stored.content_hash, stored.version) == ("hB", 2)
    finally:
        second.close()


def _run_observed(path: str) -> list[Any]:
    with sqlite3.connect(path) as conn:
        return [row[0] for row in conn.execute("SELECT observed_at FROM runs")]


def test_a_resumed_run_takes_its_latest_observation_from_its_row(tmp_path: Path) -> None:
    """SQLite: page commits keep a run's latest observation in its row; a session resuming
    the run reads it there (not from every record it saw: seconds at millions of records).
    A run written by the release before has none kept: its records are read once, then it
    is kept."""
    now = [1000.0]
    path = str(tmp_path / "crawl.sqlite3")
    first = SQLiteStore(path, clock=lambda: now[0])
    first.open()
    run = first.begin_session("w1", "auto")
    first.commit(UnitOfWork(records=[(rec("r1", "hA", 1000.0), None),
                                     (rec("r2", "hA", 990.0), None)]), "w1")
    first.close()  # killed: the run stays open
    assert _run_observed(path) == [1000.0]
    # the row is what a resumed session reads: one ahead of the records moves it on
    change_stored(path, "UPDATE runs SET observed_at = 1100")
    now[0] = 880.0  # the clock was set back
    second = SQLiteStore(path, clock=lambda: now[0])
    second.open()
    try:
        assert second.begin_session("w2", "auto").run_id == run.run_id
        second.commit(UnitOfWork(records=[(rec("r1", "hB", 885.0), None)]), "w2")
        assert {r.record_id: r.observed_at for r in second.records_page()} == {
            "r1": 1105.0, "r2": 990.0}
    finally:
        second.close()
    assert _run_observed(path) == [1105.0]
    # as the release before left the run: nothing kept, its records are read once
    change_stored(path, "UPDATE runs SET observed_at = NULL")
    now[0] = 700.0
    third = SQLiteStore(path, clock=lambda: now[0])
    third.open()
    try:
        assert third.begin_session("w3", "auto").run_id == run.run_id
        assert _run_observed(path) == [1105.0]
        result = third.commit(UnitOfWork(records=[(rec("r2", "hB", 701.0), None)]), "w3")
        assert (result.records_updated, result.records_stale) == (1, 0)
    finally:
        third.close()
    assert _run_observed(path) == [1106.0]  # 701 + (1105 - 700)


def test_observation_times_do_not_follow_a_stepped_wall_clock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    before = observation_clock()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 86_400)
    after = observation_clock()
    assert before <= after < before + 60


class PricesSpider(Spider):
    """Three product pages, each one record keyed by its SKU."""

    name = "prices"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base_url = url

    async def start(self) -> Any:
        for n in range(3):
            yield Request(f"{self.base_url}/p{n}")

    def parse(self, response: Any) -> Any:
        yield {"sku": response.url.rsplit("/", 1)[1], "price": response.css("b::text").get()}


@deferred_f_from_coro_f
async def test_a_run_after_the_clock_was_set_back_a_day_stores_every_change(
        site: LocalSite, crawl_database: str) -> None:
    """Run 1 was observed by a clock a day ahead of run 2's (the clock was set back): every
    price changed and run 2 stores every change, none refused as stale."""
    settings = crawl_settings(crawl_database, IDEMPOTENT_NATURAL_KEYS={"dict": "sku"})
    for n in range(3):
        site.add(f"/p{n}", "<html><body><b>10.00</b></body></html>")
    await run_crawl(PricesSpider, settings, url=site.url)
    change_stored(crawl_database, "UPDATE records SET observed_at = observed_at + 86400")
    for n in range(3):
        site.add(f"/p{n}", "<html><body><b>12.00</b></body></html>")
    crawler = await run_crawl(PricesSpider, settings, url=site.url)
    stats = crawler.stats.get_stats()
    assert stats["idempotent/records/updated"] == 3
    assert "idempotent/records/stale" not in stats
    records = stored_records(crawl_database)
    assert sorted((json.loads(r.data)["price"], r.version, r.changed_run_id)
                  for r in records) == [("12.00", 2, 2)] * 3
    with reading(crawl_database) as store:  # seen by run 2: in its feeds
        assert sorted(r.record_id for r in store.run_records(2)) == sorted(
            r.record_id for r in records)
