"""``scrapy idempotent migrate --to postgresql://...``: a crawl stopped on SQLite continues on
PostgreSQL where it stopped."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from datetime import datetime, timezone
from pathlib import Path

import pytest
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, db_rows, frontier_counts, run_crawl
from helpers.commands import idempotent, idempotent_json
from scrapy_idempotent.store.packing import unpack
from shop.spiders.shop import ShopSpider

psycopg = pytest.importorskip("psycopg")

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


def pg_entries(url: str) -> list[tuple[str, str, str, str]]:
    """(key, fingerprint, url, data) of every request of the crawl at ``url``, by key."""
    from scrapy_idempotent.store import open_store

    store = open_store(url)
    store.open_existing(readonly=True)
    try:
        return [(e.key, e.fingerprint, e.url, e.data) for e in store.entries(limit=100_000)]
    finally:
        store.close()


@deferred_f_from_coro_f
async def test_a_crawl_stopped_on_sqlite_continues_on_postgresql(
        shop: LocalSite, db_path: Path, postgres_url: str) -> None:
    first = await run_crawl(ShopSpider, crawl_settings(
        db_path, CLOSESPIDER_ITEMCOUNT=100, **NATURAL_KEYS), url=shop.url)
    assert first.stats.get_value("finish_reason") == "closespider_itemcount"
    before = frontier_counts(db_path)
    assert before.get("pending") and not before.get("leased")
    seen = dict(db_rows(db_path, "SELECT record_id, first_seen FROM records"))
    fetched = shop.request_count
    # a count the crawl's workers shared is the source's, not the copy's
    with contextlib.closing(sqlite3.connect(db_path)) as source, source:
        source.execute("INSERT INTO meta VALUES ('frontier_counts', ?)",
                       (json.dumps({"at": 1.0, "seconds": 1.0, "counts": before}),))

    code, out, err = idempotent("migrate", "--db", str(db_path), "--to", postgres_url)
    assert code == 0, err
    assert out.startswith(f"Migrated {db_path} to postgresql://postgres:***@")
    assert f"{len(seen)} records" in out
    status = idempotent_json("status", "--db", postgres_url)
    assert status["run"]["run_id"] == 1 and status["run"]["finished_at"] is None
    assert {k: v for k, v in status["frontier"].items() if v and k != "total"} == before
    assert status["records"]["stored"] == len(seen)
    # every request as it was (its URL kept once, its fingerprint only where not its key;
    # packed where smaller, on SQLite a BLOB)
    sqlite_rows = db_rows(db_path, "SELECT key, fingerprint, url, data FROM requests"
                                   " ORDER BY key")
    assert any(isinstance(data, bytes) for *_, data in sqlite_rows)
    assert pg_entries(postgres_url) == [
        (key, fingerprint, url, data if isinstance(data, str) else unpack(data, url, key))
        for key, fingerprint, url, data in sqlite_rows]
    with psycopg.connect(postgres_url) as conn:
        [schema] = conn.execute("SELECT nspname FROM pg_namespace"
                                " WHERE nspname LIKE 'idempotent%'").fetchall()[0]
        assert conn.execute(f'SELECT count(*) FROM "{schema}".meta'
                            " WHERE key = 'frontier_counts'").fetchone() == (0,)
        assert conn.execute(
            f'SELECT count(*) FILTER (WHERE fingerprint IS NOT NULL),'
            f' count(*) FILTER (WHERE starts_with(data, \'{{"url":\')),'
            f' count(*) FILTER (WHERE packed IS NOT NULL AND data <> \'\'),'
            f' count(*) FILTER (WHERE packed IS NOT NULL) > 0'
            f' FROM "{schema}".requests').fetchone() == (db_rows(
                db_path, "SELECT count(*) FROM requests WHERE key <> fingerprint")[0][0], 0,
                0, True)
        # the ids kept, their sequence moved to the highest (the next request's id after it)
        assert conn.execute(
            f'SELECT (SELECT max(id) FROM "{schema}".requests), last_value, is_called'
            f' FROM "{schema}".requests_id_seq').fetchone() == (
                db_rows(db_path, "SELECT max(id) FROM requests")[0][0],) * 2 + (True,)
    # a second migrate into the same database is refused, nothing changed
    code, _, err = idempotent("migrate", "--db", str(db_path), "--to", postgres_url)
    assert code == 1 and "already holds a crawl" in err

    second = await run_crawl(ShopSpider, crawl_settings(
        postgres_url, **NATURAL_KEYS), url=shop.url)  # type: ignore[arg-type]
    stats = second.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/run_id"] == 1  # the same run, continued
    assert stats["idempotent/records/inserted"] == 500 - len(seen)
    assert shop.request_count - fetched == 525 - fetched  # nothing fetched twice
    status = idempotent_json("status", "--db", postgres_url)
    assert status["frontier"]["done"] + status["frontier"]["redirected"] == 525
    assert status["run"]["state"] == "finished"
    out_path = db_path.parent / "records.jsonl"
    assert idempotent("export", "--db", postgres_url, "-o", str(out_path))[0] == 0
    rows = [json.loads(line) for line in out_path.read_text().splitlines()]
    expected = shop.expected_products()
    assert len(rows) == 500
    for row in rows:
        assert (row["name"], row["price"]) == (expected[row["sku"]]["name"],
                                               expected[row["sku"]]["price"])
        if row["record_id"] in seen:  # migrated records keep their history
            assert row["first_seen"] == datetime.fromtimestamp(
                seen[row["record_id"]], timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@deferred_f_from_coro_f
async def test_a_migrated_sqlite_crawl_is_refused_naming_where_it_went_until_undone(
        shop: LocalSite, db_path: Path, postgres_url: str) -> None:
    """After migrate, a crawl still pointed at the SQLite file would make a second copy of
    the crawl that diverges: it is refused naming the database the crawl went to, nothing
    fetched or changed, until ``migrate --undo`` makes the file a crawl's again."""
    first = await run_crawl(ShopSpider, crawl_settings(
        db_path, CLOSESPIDER_ITEMCOUNT=30, **NATURAL_KEYS), url=shop.url)
    assert first.stats.get_value("finish_reason") == "closespider_itemcount"
    code, _, err = idempotent("migrate", "--db", str(db_path), "--to", postgres_url)
    assert code == 0, err
    fetched = shop.request_count
    before = db_rows(db_path, "SELECT state, count(*) FROM requests GROUP BY state")
    sessions = db_rows(db_path, "SELECT count(*) FROM sessions")

    refused = await run_crawl(ShopSpider, crawl_settings(db_path, **NATURAL_KEYS), url=shop.url)
    assert refused.stats.get_value("finish_reason") == "idempotent_store_error"
    error = refused.stats.get_value("idempotent/error")
    assert f"{db_path} was migrated to postgresql://postgres:***@" in error, error
    assert "IDEMPOTENT_DATABASE" in error and "migrate --undo" in error, error
    assert shop.request_count == fetched
    assert db_rows(db_path, "SELECT state, count(*) FROM requests GROUP BY state") == before
    assert db_rows(db_path, "SELECT count(*) FROM sessions") == sessions
    status = idempotent_json("status", "--db", str(db_path))  # still readable
    assert status["run"]["run_id"] == 1

    code, out, err = idempotent("migrate", "--undo", "--db", str(db_path))
    assert code == 0, err
    assert "postgresql://postgres:***@" in out and "no longer marked" in out, out
    again = await run_crawl(ShopSpider, crawl_settings(
        db_path, CLOSESPIDER_ITEMCOUNT=10, **NATURAL_KEYS), url=shop.url)
    assert again.stats.get_value("finish_reason") == "closespider_itemcount"
    assert again.stats.get_value("idempotent/run_id") == 1  # resumed on SQLite
    code, _, err = idempotent("migrate", "--undo", "--db", str(db_path))
    assert code == 1 and "was not migrated" in err, err


def test_migrated_pages_keep_their_validators_and_links(tmp_path: Path,
                                                         postgres_url: str) -> None:
    """A recrawl of a crawl migrated to PostgreSQL is conditional as it was on SQLite: the
    pages' validators and every link they yielded move with the crawl (a 304 on PostgreSQL
    reaches the product only the unchanged listing still links)."""
    from conftest import FakeClock

    from helpers.validated_pages import (
        VALIDATORS,
        claim_one,
        new,
        two_listings_sharing_a_product,
    )
    from scrapy_idempotent.store import Completion, RequestState, UnitOfWork, open_store
    from scrapy_idempotent.store.base import PageValidators

    clock = FakeClock(1000.0)
    source = open_store(f"sqlite:///{tmp_path / 'crawl.db'}", clock=clock)
    source.open(fingerprinter="f")
    source.load_validators_with_claims(True)
    source.begin_session("w1", "auto")
    two_listings_sharing_a_product(source)
    target = open_store(postgres_url, clock=clock)
    target.open(fingerprinter="f")
    with source.frozen():
        written = target.load(source.dump())
    source.close()
    assert (written["page_validators"], written["linked_requests"]) == (3, 1)

    target.load_validators_with_claims(True)
    clock.now += 100
    assert target.begin_session("w1", "auto").run_id == 2
    target.commit(UnitOfWork(requests=[new("a"), new("b")]), "w1")
    listings = [claim_one(target), claim_one(target)]
    assert [p.validators for p in listings] == [VALIDATORS, VALIDATORS]
    target.commit(UnitOfWork(completions=[Completion(
        "a", RequestState.DONE, validators=PageValidators('"a2"', None, "cd" * 32))]), "w1")
    result = target.commit(UnitOfWork(completions=[
        Completion("b", RequestState.DONE, not_modified=True)]), "w1")
    assert (result.requests_relinked, result.requests_added) == (1, 1)
    product = claim_one(target)
    assert (product.key, product.validators) == ("p", VALIDATORS)
    target.close()
