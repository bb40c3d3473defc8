"""Pages' validators at the store level (no Scrapy): kept with a done page, loaded with the
claims of a later run, and a page answered ``304 Not Modified`` completed from them in its
page transaction. Part of the store contract: every test runs against each store backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conftest import FakeClock as Clock

from helpers.validated_pages import (
    VALIDATORS,
    claim_one,
    new,
    record,
    two_listings_sharing_a_product,
)
from scrapy_idempotent.store import (
    Completion,
    FrontierStore,
    RequestState,
    UnitOfWork,
)
from scrapy_idempotent.store.base import PageValidators

Stores = Callable[..., FrontierStore]


def open_store(store_factory: Stores, clock: Clock, worker: str = "w1",
               **kwargs: Any) -> FrontierStore:
    store = store_factory(clock=clock, **kwargs)
    store.open(fingerprinter="f")
    store.load_validators_with_claims(True)
    store.begin_session(worker, "auto")
    return store


def first_run(store: FrontierStore) -> None:
    """Run 1: the listing page (with validators) adds two products and stores a record;
    each product stores its own."""
    store.commit(UnitOfWork(requests=[new("list")]), "w1")
    listing = claim_one(store)
    assert listing.validators is None  # never done before
    store.commit(UnitOfWork(
        requests=[new("p1", "list"), new("p2", "list")],
        records=[(record(0), "list")],
        completions=[Completion("list", RequestState.DONE, validators=VALIDATORS)]), "w1")
    for _ in (1, 2):
        product = claim_one(store)
        n = int(product.key[1:])
        store.commit(UnitOfWork(records=[(record(n), product.key)], completions=[
            Completion(product.key, RequestState.DONE, validators=VALIDATORS)]), "w1")
    store.end_session("w1", "finished")


def test_a_304_completes_the_page_from_what_it_produced_last_time(
    store_factory: Stores,
) -> None:
    clock = Clock(1000.0)
    store = open_store(store_factory, clock)
    first_run(store)
    clock.now += 100
    assert store.begin_session("w1", "auto").run_id == 2
    store.commit(UnitOfWork(requests=[new("list")]), "w1")
    listing = claim_one(store)
    assert listing.validators == VALIDATORS  # loaded with the claim
    result = store.commit(UnitOfWork(completions=[
        Completion("list", RequestState.DONE, not_modified=True)]), "w1")
    # its products are enqueued again, its record seen (unchanged) in run 2
    assert (result.pages_not_modified, result.requests_relinked,
            result.requests_added, result.records_unchanged) == (1, 2, 2, 1)
    assert [r.record_id for r in store.run_records(2)] == ["r0"]
    products = [claim_one(store), claim_one(store)]
    assert sorted(p.key for p in products) == ["p1", "p2"]
    assert all(p.validators == VALIDATORS for p in products)
    store.commit(UnitOfWork(completions=[
        Completion("p1", RequestState.DONE, not_modified=True)]), "w1")
    store.commit(UnitOfWork(records=[(record(2, price=2), "p2")], completions=[
        Completion("p2", RequestState.DONE, validators=VALIDATORS)]), "w1")
    store.end_session("w1", "finished")
    (_, run) = store.runs()
    assert (run.done, run.records_updated, run.records_unchanged) == (3, 1, 2)
    assert sorted(r.record_id for r in store.run_records(2)) == ["r0", "r1", "r2"]
    # the unchanged page keeps its requests for the run after
    clock.now += 100
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=[new("list")]), "w1")
    claim_one(store)
    assert store.commit(UnitOfWork(completions=[
        Completion("list", RequestState.DONE, not_modified=True)]), "w1").requests_added == 2


def test_a_304_of_a_lost_lease_writes_nothing(store_factory: Stores) -> None:
    clock = Clock(1000.0)
    store = open_store(store_factory, clock)
    first_run(store)
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=[new("list")]), "w1")
    claim_one(store)
    store.release_leases(["w1"])  # its lease lost; another worker takes the page
    other = open_store(store_factory, clock, "w2")
    assert claim_one(other, "w2").key == "list"
    result = store.commit(UnitOfWork(completions=[
        Completion("list", RequestState.DONE, not_modified=True)]), "w1")
    assert (result.leases_lost, result.requests_added, result.records_unchanged) == (1, 0, 0)
    assert list(store.run_records(2)) == []


def test_a_page_that_ends_otherwise_forgets_its_validators(store_factory: Stores) -> None:
    clock = Clock(1000.0)
    store = open_store(store_factory, clock)
    first_run(store)
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=[new("list")]), "w1")
    claim_one(store)
    # answered 200 with new validators, then its callback failed
    store.commit(UnitOfWork(completions=[
        Completion("list", RequestState.FAILED, "spider_error/ValueError", "boom",
                   validators=PageValidators('"new"', None, "cd" * 32))]), "w1")
    store.end_session("w1", "finished")
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=[new("list")]), "w1")
    assert claim_one(store).validators is None  # fetched in full next time


def test_a_page_without_validators_is_kept_unusable(store_factory: Stores) -> None:
    clock = Clock(1000.0)
    store = open_store(store_factory, clock)
    store.commit(UnitOfWork(requests=[new("list")]), "w1")
    claim_one(store)
    store.commit(UnitOfWork(completions=[Completion(
        "list", RequestState.DONE, validators=PageValidators(None, None, "ef" * 32))]), "w1")
    store.end_session("w1", "finished")
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=[new("list")]), "w1")
    validators = claim_one(store).validators
    # sent unconditionally; what it produced kept (a sitemap's lastmod may skip it)
    assert validators is not None and not validators.usable
    assert validators.fetched_at == 1000.0


def test_claims_load_no_validators_unless_asked(store_factory: Stores) -> None:
    clock = Clock(1000.0)
    store = open_store(store_factory, clock)
    first_run(store)
    store.load_validators_with_claims(False)
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=[new("list")]), "w1")
    assert claim_one(store).validators is None


def test_a_304_enqueues_every_link_of_its_page_not_only_those_it_added(
    store_factory: Stores,
) -> None:
    """The page that added a product changed and no longer links it; another page that
    links it answers 304: the product is still reached (and again in the run after)."""
    clock = Clock(1000.0)
    store = open_store(store_factory, clock)
    two_listings_sharing_a_product(store)
    for run in (2, 3):
        clock.now += 100
        assert store.begin_session("w1", "auto").run_id == run
        store.commit(UnitOfWork(requests=[new("a"), new("b")]), "w1")
        assert sorted([claim_one(store).key, claim_one(store).key]) == ["a", "b"]
        # changed: answered 200, no link to p any more
        store.commit(UnitOfWork(completions=[Completion(
            "a", RequestState.DONE, validators=PageValidators(f'"a{run}"', None, "cd" * 32))]),
            "w1")
        result = store.commit(UnitOfWork(completions=[
            Completion("b", RequestState.DONE, not_modified=True)]), "w1")
        assert (result.requests_relinked, result.requests_added) == (1, 1)
        product = claim_one(store)
        assert (product.key, product.data, product.validators) \
            == ("p", '{"url": "p"}', VALIDATORS)
        store.commit(UnitOfWork(completions=[
            Completion("p", RequestState.DONE, not_modified=True)]), "w1")
        store.end_session("w1", "finished")
        assert [r.record_id for r in store.run_records(run)] == ["r1"]


def test_links_are_packed_in_one_value() -> None:
    from scrapy_idempotent.store.sql_pages import pack_keys, unpack_keys

    hexes = ["ab" * 20, "0" * 40, "f1e2"]
    assert len(pack_keys(hexes)) == 1 + 21 + 21 + 3
    assert unpack_keys(pack_keys(hexes)) == hexes
    others = ["p1", "AB" * 20, "a b", ""]  # (not lowercase hex: kept as text)
    assert unpack_keys(pack_keys(others)) == others
    assert unpack_keys(pack_keys([])) == []


#: A page's ``children`` as the schema before links were kept wrote them: the requests it
#: added, as ``[key, fingerprint, url, priority, data, is_start, filter_fingerprint, fifo,
#: slot]``.
OLD_CHILDREN = ('[["p1","p1","https://example.com/p1",0,"{\\"url\\": \\"p1\\"}",false,true,'
                'false,""],["p2","p2","https://example.com/p2",0,"{\\"url\\": \\"p2\\"}",false,'
                'true,false,""]]')


def as_before_links(store_database: str, schema: str) -> None:
    """The database as the schema before links were kept left it (SQLite 16, PostgreSQL
    13): the listing's row holds its children, no links, no ``linked_requests`` (nor the
    slots' columns of later versions)."""
    undo = ["ALTER TABLE slots DROP COLUMN wanted_by", "ALTER TABLE slots DROP COLUMN wanted_at",
            "DROP TABLE linked_requests", "ALTER TABLE page_validators DROP COLUMN links",
            f"UPDATE page_validators SET children = '{OLD_CHILDREN}' WHERE key = 'list'"]
    if store_database.startswith("postgresql"):
        import psycopg

        with psycopg.connect(store_database, autocommit=True) as conn:
            conn.execute(f'SET search_path TO "{schema}"')
            conn.execute("ALTER TABLE requests DROP CONSTRAINT requests_key_key, ADD CONSTRAINT"
                         " requests_key_key UNIQUE (key), ADD CONSTRAINT requests_pkey"
                         " PRIMARY KEY (id)")  # PostgreSQL 18: the primary key the id's
            for statement in undo:
                conn.execute(statement.replace("%", "%%"))
            for statement in ("DROP TRIGGER requests_pending_added ON requests",
                              "DROP TRIGGER requests_pending_again ON requests",
                              "DROP FUNCTION slots_pending_added(), slots_pending_again()",
                              "DROP INDEX slots_pending",
                              "ALTER TABLE slots DROP COLUMN has_pending"):
                conn.execute(statement)  # PostgreSQL 20
            conn.execute("DROP STATISTICS requests_slot_hash")  # PostgreSQL 19
            conn.execute("UPDATE meta SET value = '13' WHERE key = 'schema_version'")
        return
    import sqlite3

    conn = sqlite3.connect(store_database, isolation_level=None)
    for statement in ("ALTER TABLE runs DROP COLUMN observed_at",
                      "DROP TRIGGER requests_pending_added", "DROP TRIGGER requests_pending_again",
                      "DROP INDEX slots_pending", "ALTER TABLE slots DROP COLUMN has_pending",
                      *undo):  # SQLite 21, 19, then the rest

        conn.execute(statement)
    conn.execute("PRAGMA user_version = 16")
    conn.close()


def test_pages_kept_before_links_were_are_answered_from_their_children(
    store_factory: Stores, store_database: str,
) -> None:
    """The migration copies the requests of the kept rows' children into
    ``linked_requests``; a 304 of such a row enqueues its children again, as before."""
    clock = Clock(1000.0)
    store = open_store(store_factory, clock)
    first_run(store)
    store.close()
    as_before_links(store_database, getattr(store, "schema", ""))
    store = open_store(store_factory, clock)
    clock.now += 100
    assert store.begin_session("w1", "auto").run_id == 2
    store.commit(UnitOfWork(requests=[new("list")]), "w1")
    claim_one(store)
    result = store.commit(UnitOfWork(completions=[
        Completion("list", RequestState.DONE, not_modified=True)]), "w1")
    assert (result.requests_relinked, result.requests_added) == (2, 2)
    assert sorted(store._select(  # type: ignore[attr-defined]
        "SELECT key, fingerprint, url, priority, data, slot FROM linked_requests")) == [
        (f"p{n}", None, f"https://example.com/p{n}", 0, f'{{"url": "p{n}"}}', "")
        for n in (1, 2)]
