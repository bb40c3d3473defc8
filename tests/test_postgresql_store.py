"""What the PostgreSQL store does beyond the shared contract (tests/test_store_contract.py
runs that on both backends): schemas per crawl and their refusal, worker liveness by
heartbeat across hosts, record conflicts between concurrent writers, connection loss and
server restarts, a wrong password."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from crawling import wait_for
from helpers import named_keys
from scrapy_idempotent.exceptions import StoreBusy, StoreError
from scrapy_idempotent.store import (
    Completion,
    CrawlIdentity,
    NewRequest,
    Record,
    RequestState,
    UnitOfWork,
    open_store,
)

psycopg = pytest.importorskip("psycopg")
from scrapy_idempotent.store.postgresql import (  # noqa: E402
    SCHEMA_VERSION,
    PostgreSQLStore,
    schema_for,
)

T0 = 1_700_000_000.0
SHOP = CrawlIdentity(project="p", spider="shop", source="shop")


class FakeClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make(postgres_url: str) -> Iterator[Callable[..., PostgreSQLStore]]:
    made: list[PostgreSQLStore] = []

    def make_store(url: str = postgres_url, **options: Any) -> PostgreSQLStore:
        store = PostgreSQLStore(url, **options)
        made.append(store)
        return store

    yield make_store
    for store in made:
        store.close()


def sql(url: str, statement: str, params: Any = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement, params or None)
        return [tuple(row) for row in cur.fetchall()] if cur.description else []


def req(key: str) -> NewRequest:
    return NewRequest(key=key, fingerprint=key, url=f"https://shop.example/{key}", priority=0,
                      data="{}")


def rec(record_id: str, content_hash: str) -> Record:
    return Record(record_id=record_id, source="shop", natural_key='["A1"]', item_type="dict",
                  data='{"sku": "A1"}', content_hash=content_hash)


def test_open_store_picks_postgresql_by_scheme(postgres_url: str) -> None:
    for url in (postgres_url, postgres_url.replace("postgresql://", "postgres://", 1)):
        store = open_store(url, lease_seconds=30.0)
        assert isinstance(store, PostgreSQLStore)
        assert store.lease_seconds == 30.0
        assert "***@" in store.shown_url and store.url == url


def test_each_crawl_identity_gets_its_own_schema(make: Callable[..., PostgreSQLStore],
                                                 postgres_url: str) -> None:
    other_source = CrawlIdentity(project="p", spider="shop", source="shop-us")
    for identity in (SHOP, other_source, SHOP):
        store = make(heartbeat_seconds=None)
        store.open(fingerprinter="f", identity=identity)
        store.begin_session("w", "auto")
        store.commit(UnitOfWork(requests=[req(identity.source)]), "w")
        store.close()
    schemas = [name for (name,) in sql(
        postgres_url, "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'idempotent%'"
        " ORDER BY 1")]
    assert sorted(schemas) == sorted([schema_for(SHOP), schema_for(other_source)])
    assert schema_for(SHOP).startswith("idempotent_shop_")
    # (a named key: see helpers.named_keys)
    assert sql(postgres_url, f'SELECT key FROM "{schema_for(SHOP)}".requests') == [
        (named_keys.MARK + b"shop",)]


def test_a_schema_of_another_crawl_is_refused_untouched(make: Callable[..., PostgreSQLStore],
                                                        postgres_url: str) -> None:
    url = postgres_url + "?schema=crawl"
    first = make(url, heartbeat_seconds=None)
    first.open(fingerprinter="f", identity=SHOP)
    first.close()
    before = sql(postgres_url, "SELECT key, value FROM crawl.meta ORDER BY key")
    other = make(url, heartbeat_seconds=None)
    with pytest.raises(StoreError, match=r"belongs to spider 'shop'.*left untouched"):
        other.open(fingerprinter="g", identity=CrawlIdentity("p", "books", "books"))
    assert sql(postgres_url, "SELECT key, value FROM crawl.meta ORDER BY key") == before


def test_a_schema_that_is_not_ours_is_refused_untouched(make: Callable[..., PostgreSQLStore],
                                                        postgres_url: str) -> None:
    sql(postgres_url, "CREATE SCHEMA app")
    sql(postgres_url, "CREATE TABLE app.users (id int)")
    store = make(postgres_url + "?schema=app", heartbeat_seconds=None)
    with pytest.raises(StoreError, match=r"not a scrapy_idempotent frontier.*users"):
        store.open(fingerprinter="f", identity=SHOP)
    assert sql(postgres_url, "SELECT tablename FROM pg_tables WHERE schemaname = 'app'") == [
        ("users",)]


def test_a_newer_schema_version_is_refused(make: Callable[..., PostgreSQLStore],
                                           postgres_url: str) -> None:
    store = make(heartbeat_seconds=None)
    store.open(fingerprinter="f", identity=SHOP)
    store.close()
    schema = schema_for(SHOP)
    sql(postgres_url, f"UPDATE \"{schema}\".meta SET value = %s WHERE key = 'schema_version'",
        (str(SCHEMA_VERSION + 1),))
    with pytest.raises(StoreError, match="newer than this scrapy_idempotent supports"):
        make(heartbeat_seconds=None).open(fingerprinter="f", identity=SHOP)


def test_rows_of_schema_15_are_read_as_they_are_and_new_rows_are_compact(
        make: Callable[..., PostgreSQLStore], postgres_url: str) -> None:
    """Schema 17 stores a request's fingerprint only where it is not its key (a
    ``dont_filter`` request's: claims, entries and lookups give the key for the others) and
    its encoded request without the row's URL. The migration rewrites no row but those
    whose request does not begin with its URL (given a space): the rows of schema 15 are read
    as they are, whole, with their fingerprint."""
    url = postgres_url + "?schema=fingerprints"
    unfiltered = NewRequest(key="bb", fingerprint="aa", url="https://shop.example/a", priority=0,
                            data='{"url":"https://shop.example/a","callback":"parse"}',
                            filter_fingerprint=False)
    store = make(url, heartbeat_seconds=None)
    store.open(fingerprinter="f", identity=SHOP)
    store.begin_session("w", "auto")
    store.commit(UnitOfWork(requests=[req("aa"), unfiltered]), "w")
    store.close()
    # (keys of hex digits: schema 22 stores their bytes; the rows of schema 15 held text)
    stored = ("SELECT encode(key, 'hex'), encode(fingerprint, 'hex'), data"
              " FROM fingerprints.requests ORDER BY key")
    assert _stored(postgres_url, "fingerprints", "fingerprint") == [
        ("aa", None, " {}"), ("bb", "aa", '{"callback":"parse"}')]
    # the rows and the column as schema 15 left them: requests whole (one of a form
    # without its URL first), fingerprints equal to their keys
    whole = {"aa": '{"url":"https://shop.example/a"}',
             "bb": '{"url":"https://shop.example/a","callback":"parse"}',
             "cc": '{"callback":"parse","url":"https://shop.example/c"}'}
    # schema 21: the keys as text
    sql(postgres_url, "ALTER TABLE fingerprints.requests"
        " ALTER COLUMN key TYPE text COLLATE \"C\" USING encode(key, 'hex'),"
        " ALTER COLUMN parent_key TYPE text USING encode(parent_key, 'hex'),"
        " ALTER COLUMN fingerprint TYPE text USING encode(fingerprint, 'hex'),"
        " ALTER COLUMN run_id TYPE bigint")
    sql(postgres_url, "INSERT INTO fingerprints.requests (key, fingerprint, url, priority,"
        " state, data, enqueued_at, run_id) VALUES ('cc', 'cc', 'https://shop.example/c', 0,"
        " 'pending', %s, 0, 1)", (whole["cc"],))
    for key in ("aa", "bb"):
        sql(postgres_url, "UPDATE fingerprints.requests SET data = %s WHERE key = %s",
            (whole[key], key))
    sql(postgres_url, "UPDATE fingerprints.requests SET fingerprint = key"
        " WHERE fingerprint IS NULL")
    sql(postgres_url, "ALTER TABLE fingerprints.requests ALTER COLUMN fingerprint SET NOT NULL")
    # schema 21 (nothing packed there now: every row's data was set above)
    sql(postgres_url, "ALTER TABLE fingerprints.requests DROP COLUMN packed")
    for statement in ("DROP TRIGGER requests_pending_added ON fingerprints.requests",
                      "DROP TRIGGER requests_pending_again ON fingerprints.requests",
                      "DROP FUNCTION fingerprints.slots_pending_added(),"
                      " fingerprints.slots_pending_again()",
                      "DROP INDEX fingerprints.slots_pending",
                      "ALTER TABLE fingerprints.slots DROP COLUMN has_pending"):  # schema 20
        sql(postgres_url, statement)
    sql(postgres_url, "DROP STATISTICS fingerprints.requests_slot_hash")  # schema 19
    sql(postgres_url, "ALTER TABLE fingerprints.requests DROP CONSTRAINT requests_key_key,"
        " ADD CONSTRAINT requests_key_key UNIQUE (key),"
        " ADD CONSTRAINT requests_pkey PRIMARY KEY (id)")  # schema 18
    sql(postgres_url, "UPDATE fingerprints.meta SET value = '15' WHERE key = 'schema_version'")
    assert sql(postgres_url, "SELECT key, fingerprint, data FROM fingerprints.requests"
               " ORDER BY key")[:2] == [("aa", "aa", whole["aa"]), ("bb", "aa", whole["bb"])]
    store = make(url, heartbeat_seconds=None)
    store.open(fingerprinter="f", identity=SHOP)
    assert store.meta()["schema_version"] == str(SCHEMA_VERSION) == "22"
    assert sql(postgres_url, stored) == [("aa", "aa", whole["aa"]), ("bb", "aa", whole["bb"]),
                                         ("cc", "cc", " " + whole["cc"])]
    assert [(e.key, e.fingerprint, e.data) for e in store.entries()] == [
        ("aa", "aa", whole["aa"]), ("bb", "aa", whole["bb"]), ("cc", "cc", whole["cc"])]
    assert store.known_request("aa") == "duplicate"
    store.begin_session("w", "resume")
    leased = store.commit(UnitOfWork(claim=3), "w").leased
    assert sorted((r.key, r.fingerprint, r.data) for r in leased) == [
        ("aa", "aa", whole["aa"]), ("bb", "aa", whole["bb"]), ("cc", "cc", whole["cc"])]
    # a request filtered by fingerprint "aa" is a duplicate of both
    result = store.commit(UnitOfWork(requests=[NewRequest(
        key="aa", fingerprint="aa", url="https://shop.example/a", priority=0, data="{}")]), "w")
    assert (result.requests_added, result.requests_duplicate) == (0, 1)


def _stored(postgres_url: str, schema: str, column: str = "",
            where: str = "true") -> list[tuple[Any, ...]]:
    """(key, ``column`` if any, the stored request's text) of the requests of ``schema``,
    by key: a row's ``data``, or its ``packed`` request unpacked (``data`` then '')."""
    from scrapy_idempotent.store.packing import unpack

    rows = sql(postgres_url, f"SELECT key, {column or 'key'}, data, packed, url"
                             f" FROM {schema}.requests WHERE {where} ORDER BY key")
    for key, _, data, packed, _ in rows:
        assert packed is None or data == "", (key, data)
    if column in ("key", "fingerprint", "parent_key"):  # (bytes: helpers.named_keys)
        rows = [(k, named_keys.key_read(None, v), *rest) for k, v, *rest in rows]
    rows = [(named_keys.key_read(None, key), *rest) for key, *rest in rows]
    return [(key, *([value] if column else []),
             data if packed is None else unpack(packed, url, key))
            for key, value, data, packed, url in rows]


#: Encoded requests of the row of https://shop.example/a, and how the row stores them.
URL_ONCE_FORMS = [
    ('{"url":"https://shop.example/a","callback":"parse","meta":{"depth":1}}',
     '{"callback":"parse","meta":{"depth":1}}'),
    ('{"url":"https://shop.example/a"}', "{}"),
    # whole: another URL, the URL not first, another spacing, the URL twice, not JSON
    ('{"url":"https://shop.example/b","callback":"parse"}',
     '{"url":"https://shop.example/b","callback":"parse"}'),
    ('{"callback":"parse","url":"https://shop.example/a"}',
     ' {"callback":"parse","url":"https://shop.example/a"}'),
    ('{"url": "https://shop.example/a"}', '{"url": "https://shop.example/a"}'),
    ('{"url":"https://shop.example/a","url":"https://shop.example/a"}',
     '{"url":"https://shop.example/a","url":"https://shop.example/a"}'),
    ("", " "), (" {}", "  {}"), ("{}", " {}"),
]


@pytest.mark.parametrize(("data", "stored"), URL_ONCE_FORMS)
def test_a_request_row_stores_its_url_once_and_reads_back_its_data_exactly(
        data: str, stored: str) -> None:
    from scrapy_idempotent.store.rules import request_data, stored_request_data

    url = "https://shop.example/a"
    assert stored_request_data(data, url) == stored
    assert request_data(stored, url) == data
    assert request_data(stored_request_data(data), url) == data  # (the row's URL unknown)


def test_request_rows_keep_their_url_once(make: Callable[..., PostgreSQLStore],
                                         postgres_url: str) -> None:
    """Inserted, due again, continued: each row stores its request as
    :func:`~.rules.stored_request_data` does; claims and entries give it back as given."""
    url = postgres_url + "?schema=url_once"
    clock = FakeClock()
    store = make(url, heartbeat_seconds=None, clock=clock, recrawl_seconds=100.0)
    store.open(fingerprinter="f", identity=SHOP)
    store.begin_session("w", "auto")
    given = {f"a{n}": data for n, (data, _) in enumerate(URL_ONCE_FORMS)}
    store.commit(UnitOfWork(requests=[
        NewRequest(key=key, fingerprint=key, url="https://shop.example/a", priority=0,
                   data=data) for key, data in given.items()]), "w")
    assert _stored(postgres_url, "url_once") == sorted(
        (key, stored) for key, (_, stored) in zip(given, URL_ONCE_FORMS, strict=True))
    # packed where smaller (data ''), as the continuation and the due-again below replace
    assert sql(postgres_url, "SELECT encode(key, 'hex') FROM url_once.requests"
               " WHERE packed IS NOT NULL ORDER BY key") == [
        ("a0",), ("a2",), ("a3",), ("a4",), ("a5",)]
    assert {e.key: e.data for e in store.entries()} == given
    leased = store.commit(UnitOfWork(claim=len(given)), "w").leased
    assert {r.key: r.data for r in leased} == given
    # a0 continued (a retry: its data replaced), a1 done, then due again at another URL
    continued = '{"url":"https://shop.example/a","callback":"parse","meta":{"retry":1}}'
    store.commit(UnitOfWork(completions=[
        Completion("a0", RequestState.PENDING, data=continued),
        Completion("a1", RequestState.DONE)]), "w")
    clock.now += 200.0
    again = '{"url":"https://shop.example/a?b","callback":"parse"}'
    result = store.commit(UnitOfWork(requests=[NewRequest(
        key="a1", fingerprint="a1", url="https://shop.example/a?b", priority=0,
        data=again)]), "w")
    assert result.requests_due_again == 1
    assert _stored(postgres_url, "url_once", "url", "encode(key, 'hex') IN ('a0', 'a1')") == [
        ("a0", "https://shop.example/a", continued),
        ("a1", "https://shop.example/a?b", '{"callback":"parse"}')]
    leased = store.commit(UnitOfWork(claim=2), "w").leased
    assert {r.key: r.data for r in leased} == {"a0": continued, "a1": again}


def test_a_wrong_password_is_a_clear_error_without_the_password(
        make: Callable[..., PostgreSQLStore], postgres_cluster: Any) -> None:
    store = make(postgres_cluster.url(password="not-the-password"))
    with pytest.raises(StoreError) as raised:
        store.open(fingerprinter="f", identity=SHOP)
    assert not isinstance(raised.value, StoreBusy)  # not worth retrying
    message = str(raised.value)
    assert "password authentication failed" in message and "IDEMPOTENT_DATABASE" in message
    assert "not-the-password" not in message and ":***@" in message


def test_a_worker_whose_heartbeat_is_stale_is_dead_and_its_leases_come_back(
        make: Callable[..., PostgreSQLStore]) -> None:
    clock = FakeClock()
    options = {"clock": clock, "lease_seconds": 60.0, "dead_after_seconds": 15.0,
               "heartbeat_seconds": None}
    a, b = make(**options), make(**options)
    for store, worker in ((a, "host-a:1:1:x"), (b, "host-b:1:1:y")):
        store.open(fingerprinter="f", identity=SHOP)
        store.begin_session(worker, "auto")
    a.commit(UnitOfWork(requests=[req("p1"), req("p2")]), "host-a:1:1:x")
    leased = a.commit(UnitOfWork(claim=2), "host-a:1:1:x").leased
    assert len(leased) == 2
    clock.now += 10
    b.heartbeat()
    assert b.reclaim_expired() == 0  # a beat 10 s ago: alive
    clock.now += 6  # a's heartbeat is 16 s old, its leases have 44 s left
    b.heartbeat()
    assert b.dead_workers() == ["host-a:1:1:x"]
    assert b.reclaim_expired() == 2
    assert {r.key for r in b.commit(UnitOfWork(claim=2), "host-b:1:1:y").leased} == {
        "p1", "p2"}
    # a comes back: what it completes is not its own any more, and writes nothing
    result = a.commit(UnitOfWork(completions=[Completion("p1", RequestState.DONE)],
                                 records=[(rec("r1", "h1"), "p1")]), "host-a:1:1:x")
    assert result.leases_lost == 1 and result.records_inserted == 0
    assert a.renew_leases("host-a:1:1:x") == []
    assert a.counts()["records"] == 0


def test_a_stale_heartbeats_leases_come_back_with_their_slots_paused(
        make: Callable[..., PostgreSQLStore]) -> None:
    """A worker dead on another host (its heartbeat stale, its leases not expired): the
    transaction that takes its leases back pauses every slot it held one of, as if each had
    answered 429 (it may have got one it could not write)."""
    from dataclasses import replace

    from scrapy_idempotent.store.base import SlotLimits

    clock = FakeClock()
    options = {"clock": clock, "lease_seconds": 60.0, "dead_after_seconds": 15.0,
               "heartbeat_seconds": None}
    limits = SlotLimits(concurrency=1, dead_worker_pause_seconds=10.0)
    a, b = make(**options), make(**options)
    for store, worker in ((a, "host-a:1:1:x"), (b, "host-b:1:1:y")):
        store.open(fingerprinter="f", identity=SHOP)
        store.begin_session(worker, "auto")
        store.keep_slot_limits(limits)
    a.commit(UnitOfWork(requests=[replace(req(f"p{n}"), slot=slot)
                                  for n, slot in enumerate(("s1", "s1", "s2"))]),
             "host-a:1:1:x")
    assert len(a.commit(UnitOfWork(claim=3), "host-a:1:1:x").leased) == 2  # s1/p0, s2/p2
    clock.now += 16  # a's heartbeat is 16 s old, its leases have 44 s left
    b.heartbeat()
    assert b.commit(UnitOfWork(claim=3), "host-b:1:1:y").leased == []  # a's leases count
    reclaimed = b.reclaim_leases()
    assert reclaimed.expired == 2 and reclaimed.paused == {"host-a:1:1:x": ("s1", "s2")}
    assert {s.slot: s.paused_until for s in b.slots()} == {"s1": clock.now + 10,
                                                           "s2": clock.now + 10}
    assert b.commit(UnitOfWork(claim=3), "host-b:1:1:y").leased == []
    clock.now += 10
    b.heartbeat()
    assert len(b.commit(UnitOfWork(claim=3), "host-b:1:1:y").leased) == 2


def test_a_new_worker_takes_a_killed_peers_leases_once_the_peers_heartbeat_is_stale(
        make: Callable[..., PostgreSQLStore]) -> None:
    """The judge's own liveness is the outage safeguard, not its connection's age: a worker
    started after its peer was killed takes the peer's leases once the peer's heartbeat is
    older than the bound and the judge itself has beaten for two heartbeat periods (a live
    peer beats within one period of the server being reachable again)."""
    clock = FakeClock()
    options = {"clock": clock, "lease_seconds": 600.0, "dead_after_seconds": 15.0,
               "heartbeat_seconds": 5.0}
    a, b = make(**options), make(**options)
    a.open(fingerprinter="f", identity=SHOP)
    a.begin_session("host-a:1:1:x", "auto")
    a._stop_heartbeat()  # driven by hand below: a is killed after its claim
    a.commit(UnitOfWork(requests=[req("p1"), req("p2")]), "host-a:1:1:x")
    assert len(a.commit(UnitOfWork(claim=2), "host-a:1:1:x").leased) == 2
    clock.now += 11
    b.open(fingerprinter="f", identity=SHOP)
    b.begin_session("host-b:1:1:y", "auto")  # b starts 11 s after a's last beat
    b._stop_heartbeat()
    clock.now += 5  # a's heartbeat is 16 s old
    b.heartbeat()
    assert b.dead_workers() == ["host-a:1:1:x"]
    assert b.reclaim_expired() == 0  # b has beaten for 5 s only: a live peer may not have yet
    clock.now += 5
    b.heartbeat()
    assert b.reclaim_expired() == 2  # 21 s after a's last beat, 10 s after b's start
    # a judge whose own heartbeat stopped (its network, its server) judges nobody until it
    # has beaten again for two periods
    c = make(**options)
    c.open(fingerprinter="f", identity=SHOP)
    c.begin_session("host-c:1:1:z", "auto")
    c._stop_heartbeat()
    b.commit(UnitOfWork(requests=[req("p3")]), "host-b:1:1:y")
    assert len(b.commit(UnitOfWork(claim=3), "host-b:1:1:y").leased) == 3
    for _ in range(3):
        clock.now += 5
        c.heartbeat()
    b._stop_heartbeat()
    clock.now += 20  # neither b nor c could beat (c's outage), b's beat is 20 s old
    c.heartbeat()
    assert c.reclaim_expired() == 0
    for _ in range(2):
        clock.now += 5
        c.heartbeat()
    assert c.reclaim_expired() == 3


def test_the_heartbeat_thread_keeps_a_worker_alive(make: Callable[..., PostgreSQLStore],
                                                   postgres_url: str) -> None:
    store = make(heartbeat_seconds=0.05, dead_after_seconds=15.0)
    store.open(fingerprinter="f", identity=SHOP)
    store.begin_session("w1", "auto")
    schema = schema_for(SHOP)

    def beat() -> float:
        return float(sql(postgres_url, f'SELECT heartbeat_at FROM "{schema}".sessions')[0][0])

    first = beat()
    wait_for(lambda: beat() > first, 60, "a heartbeat")
    store.end_session("w1", "finished")
    assert store._beat_thread is None


def test_concurrent_inserts_of_one_record_id_are_a_counted_conflict(
        make: Callable[..., PostgreSQLStore], postgres_url: str) -> None:
    store = make(heartbeat_seconds=None)
    store.open(fingerprinter="f", identity=SHOP)
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=[req("p1")]), "w1")
    store.commit(UnitOfWork(claim=1), "w1")
    schema = schema_for(SHOP)
    # another worker inserts the same record ID and has not committed yet
    other = psycopg.connect(postgres_url)
    other.execute(
        f'INSERT INTO "{schema}".records (record_id, source, natural_key, item_type, data,'
        " content_hash, first_seen, last_changed, first_run_id, changed_run_id, seen_run_id,"
        " seen_seq, observed_at) VALUES ('r1', 'shop', '[]', 'dict', '{}', 'h1', 1, 1, 1, 1, 1,"
        " 0, 1)")
    results: list[Any] = []
    committing = threading.Thread(target=lambda: results.append(store.commit(UnitOfWork(
        completions=[Completion("p1", RequestState.DONE)],
        records=[(rec("r1", "h2"), "p1")]), "w1")))
    committing.start()
    wait_for(lambda: sql(postgres_url, "SELECT count(*) FROM pg_stat_activity WHERE"
                         " application_name = 'scrapy_idempotent' AND wait_event_type = 'Lock'"
                         )[0][0] == 1, 60, "the commit waiting on the other insert")
    other.commit()
    other.close()
    committing.join(60)
    [result] = results
    assert result.records_conflicts == 1
    assert (result.records_inserted, result.records_updated) == (0, 1)
    assert result.completed == {"done": 1}
    assert sql(postgres_url, f'SELECT record_id, content_hash FROM "{schema}".records') == [
        ("r1", "h2")]


def test_a_lost_connection_is_reopened(make: Callable[..., PostgreSQLStore],
                                       postgres_url: str) -> None:
    store = make(heartbeat_seconds=None)
    store.open(fingerprinter="f", identity=SHOP)
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=[req("p1")]), "w1")
    sql(postgres_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE application_name = 'scrapy_idempotent'")
    # the transaction did not happen: worth retrying, and the retry works
    with pytest.raises(StoreBusy, match=r"connection .* was lost"):
        store.commit(UnitOfWork(claim=1), "w1")
    assert [r.key for r in store.commit(UnitOfWork(claim=1), "w1").leased] == ["p1"]


def test_a_server_restart_between_transactions_is_waited_for(
        make: Callable[..., PostgreSQLStore], postgres_cluster: Any) -> None:
    store = make(heartbeat_seconds=None, busy_timeout_seconds=120.0)
    store.open(fingerprinter="f", identity=SHOP)
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=[req("p1")]), "w1")
    postgres_cluster.stop("immediate")
    restarting = threading.Thread(target=postgres_cluster.start)
    with pytest.raises(StoreBusy):  # the old connection is gone
        store.counts()
    restarting.start()
    try:
        # the next call reconnects, waiting for the server to accept connections again
        assert store.counts()["pending"] == 1
    finally:
        restarting.join()
    assert [r.key for r in store.commit(UnitOfWork(claim=1), "w1").leased] == ["p1"]


class CuttingProxy:
    """A TCP proxy in front of the server that cuts one connection at the COMMIT of a
    transaction: ``"before"`` the server receives it (the client's side is cut; the server's
    transaction stays open, holding its locks, as in a network partition), or ``"after"`` the
    server committed, before the client reads the answer (committed, but the client cannot
    know)."""

    #: COMMIT sent as a simple query, or (pipeline mode) parsed as an extended query
    COMMIT_QUERY = (b"Q\x00\x00\x00\x0bCOMMIT\x00", b"P\x00\x00\x00\x0e\x00COMMIT\x00\x00\x00")
    COMMIT_DONE = (b"C\x00\x00\x00\x0bCOMMIT\x00",)

    def __init__(self, port: int) -> None:
        import socket

        self.target = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut: str | None = None
        self.cuts = 0
        #: every socket and thread of the proxy, released by close()
        self.sockets: list[Any] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self.sockets += [client, server]
            for source, sink, marker in ((client, server, "before"),
                                         (server, client, "after")):
                pump = threading.Thread(target=self._pump,
                                        args=(source, sink, client, server, marker),
                                        daemon=True)
                self.threads.append(pump)
                pump.start()

    def _pump(self, source: Any, sink: Any, client: Any, server: Any, marker: str) -> None:
        import socket

        pattern = self.COMMIT_QUERY if marker == "before" else self.COMMIT_DONE
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            if data and self.cut == marker and any(p in data for p in pattern):
                self.cut = None
                self.cuts += 1
                data = b""
            if not data:
                # a cut before the COMMIT leaves the server's side open: the server does not
                # notice (as in a network partition), its transaction keeps its locks
                ends = (client,) if marker == "before" and self.cuts else (client, server)
                for sock in ends:  # shutdown: the other pump's recv returns
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                    with contextlib.suppress(OSError):
                        sock.close()
                return
            with contextlib.suppress(OSError):
                sink.sendall(data)

    def close(self) -> None:
        """Stop accepting, end every connection still open (the server's side of a cut
        "before" included) and wait for the proxy's threads."""
        import socket

        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        for thread in self.threads:
            thread.join(60)


@pytest.mark.parametrize("cut", ["before", "after"])
def test_a_connection_lost_during_commit_is_resolved_by_reading_back(
        make: Callable[..., PostgreSQLStore], postgres_url: str, postgres_cluster: Any,
        cut: str) -> None:
    proxy = CuttingProxy(postgres_cluster.port)
    try:
        url = postgres_url.replace(f":{postgres_cluster.port}/", f":{proxy.port}/")
        # a lock wait of 1 s, shorter than the server's patience with an idle transaction
        # (5 s): the retry gets the locks only because the store ends its lost transaction
        store = make(url, heartbeat_seconds=None, busy_timeout_seconds=1.0)
        store.open(fingerprinter="f", identity=SHOP)
        store.begin_session("w1", "auto")
        store.commit(UnitOfWork(requests=[req("p1")]), "w1")
        store.commit(UnitOfWork(claim=1), "w1")
        store.commit(UnitOfWork(started=["p1"]), "w1")
        work = UnitOfWork(completions=[Completion("p1", RequestState.DONE)],
                          records=[(rec("r1", "h1"), "p1")])
        proxy.cut = cut
        if cut == "before":  # rolled back: worth retrying, and the retry writes it once
            with pytest.raises(StoreBusy, match="it was not: it is retried"):
                store.commit(work, "w1")
            result = store.commit(work, "w1")
        else:  # committed: read back, reported as done, not repeated
            result = store.commit(work, "w1")
        assert proxy.cuts == 1
        assert result.completed == {"done": 1} and result.records_inserted == 1
        assert store.counts() == {"pending": 0, "leased": 0, "done": 1, "failed": 0,
                                  "redirected": 0, "records": 1}
        assert [r.done for r in store.runs()] == [1]
    finally:
        proxy.close()


def test_a_listening_worker_is_told_when_work_appears(make: Callable[..., PostgreSQLStore],
                                                      postgres_url: str) -> None:
    idle, busy = make(heartbeat_seconds=None), make(heartbeat_seconds=None)
    for store, worker in ((idle, "w1"), (busy, "w2")):
        store.open(fingerprinter="f", identity=SHOP)
        store.begin_session(worker, "auto")
    signals = threading.Semaphore(0)
    assert idle.watch_for_work(signals.release)

    def listening() -> bool:
        return bool(sql(postgres_url, "SELECT count(*) FROM pg_stat_activity"
                        " WHERE query LIKE 'LISTEN %'")[0][0])

    wait_for(listening, 60, "the listener")
    busy.commit(UnitOfWork(requests=[req("p1"), req("p2")]), "w2")  # new requests
    assert signals.acquire(timeout=60)
    assert [r.key for r in busy.commit(UnitOfWork(claim=2), "w2").leased] == ["p2", "p1"]
    assert busy.release_leases(["w2"]) == 2  # released leases
    assert signals.acquire(timeout=60)
    busy.commit(UnitOfWork(claim=1), "w2")  # a claim makes nothing claimable: no signal
    listeners = [t for t in threading.enumerate() if t.name == "scrapy_idempotent listener"]
    idle.close()  # wakes its listener (no poll interval to wait out) and waits for it
    assert listeners and not any(t.is_alive() for t in listeners)
    wait_for(lambda: not listening(), 60, "the listener to stop")
    assert not signals.acquire(blocking=False)


def test_a_claim_that_finds_a_slots_row_locked_by_another_claim_asks_again_soon(
        make: Callable[..., PostgreSQLStore]) -> None:
    """Claims of a slot are serialised by its row, and a claim skips a row another worker's
    claim holds (SKIP LOCKED: it never waits for another transaction). A claim that took
    nothing asks again soon when it skipped a slot with pending requests, as when it found a
    slot full: told there was nothing, an idle worker would wait for the next notification,
    which a busy worker's page commits send only when they add requests, and the busy one
    would keep the site's every place."""
    from dataclasses import replace

    from scrapy_idempotent.store.base import SlotLimits
    from scrapy_idempotent.store.rules import SLOT_WANTED_RECHECK_SECONDS

    clock = FakeClock()
    options = {"clock": clock, "lease_seconds": 60.0, "heartbeat_seconds": None,
               "dead_after_seconds": None}
    a, b = make(**options), make(**options)
    for store, worker in ((a, "w1"), (b, "w2")):
        store.open(fingerprinter="f", identity=SHOP)
        store.begin_session(worker, "auto")
        store.keep_slot_limits(SlotLimits(concurrency=4))
    a.commit(UnitOfWork(requests=[replace(req(f"p{n}"), slot="s1") for n in range(12)]),
             "w1")
    assert len(a.commit(UnitOfWork(claim=2), "w1").leased) == 2  # 2 of the slot's 4 places

    @contextlib.contextmanager
    def slot_row_held() -> Iterator[None]:
        """Another worker's claim of the slot, its transaction not committed yet."""
        with psycopg.connect(a.url) as conn:
            conn.execute(f'SET search_path TO "{a.schema}"')
            conn.execute("SELECT 1 FROM slots WHERE slot = 's1' FOR UPDATE")
            yield
            conn.rollback()

    with slot_row_held():
        result = b.commit(UnitOfWork(claim=4), "w2")
    assert result.leased == [] and result.claim_again_in == SLOT_WANTED_RECHECK_SECONDS
    # asked again once the row is free: the places left
    assert len(b.commit(UnitOfWork(claim=4), "w2").leased) == 2
    # a full slot, each worker holding its share: nothing skipped, nothing to ask again for
    result = b.commit(UnitOfWork(claim=4), "w2")
    assert result.leased == [] and result.claim_again_in is None
    # a skipped slot that is paused: asked again when its pause ends, not sooner
    assert a.pause_slot("s1", retry_after=10.0, first_seconds=1.0, max_seconds=60.0) == 10.0
    with slot_row_held():
        result = a.commit(UnitOfWork(claim=4), "w1")
    assert result.leased == [] and result.claim_again_in == 10.0


def test_workers_starting_with_the_crawls_limits_write_and_wait_for_no_slot(
        make: Callable[..., PostgreSQLStore], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each worker's start writes its limits into the slots. Workers starting together (a
    deploy, a scale-up of 32) with the crawl's limits write no slot's row: the start waits for
    no claim holding one (it rewrote and locked every slot, and 32 starts at once deadlocked
    with each other and the claims), and a broad crawl's start does not rewrite a million
    slots. A start whose transaction the server ends (a deadlock: limits changed while
    claims run) is tried again."""
    from scrapy_idempotent.store import sql_politeness
    from scrapy_idempotent.store.base import SlotLimits

    limits = SlotLimits(concurrency=4)
    a = make(heartbeat_seconds=None)
    a.open(fingerprinter="f", identity=SHOP)
    a.begin_session("w1", "auto")
    a.keep_slot_limits(limits)
    a.commit(UnitOfWork(requests=[dataclasses.replace(req(f"p{n}"), slot=f"s{n}")
                                  for n in range(3)]), "w1")
    b = make(heartbeat_seconds=None, busy_timeout_seconds=0.5)
    b.open(fingerprinter="f", identity=SHOP)
    b.begin_session("w2", "auto")
    with psycopg.connect(a.url) as conn:  # a claim of s1, its transaction not committed
        conn.execute(f'SET search_path TO "{a.schema}"')
        conn.execute("SELECT 1 FROM slots WHERE slot = 's1' FOR UPDATE")
        b.keep_slot_limits(limits)  # no wait: nothing to write
        versions = conn.execute("SELECT slot, xmin::text FROM slots ORDER BY slot").fetchall()
        b.keep_slot_limits(limits)
        assert conn.execute("SELECT slot, xmin::text FROM slots ORDER BY slot"
                            ).fetchall() == versions
        conn.rollback()
    b.keep_slot_limits(SlotLimits(concurrency=6))  # changed: written
    assert a._select("SELECT DISTINCT concurrency FROM slots WHERE slot <> ''") == [(6,)]

    attempts: list[str] = []
    ended = [1]  # how many of the transactions the server ends
    write = b._write

    @contextlib.contextmanager
    def deadlocking(doing: str = "writing", **options: Any) -> Iterator[Any]:
        attempts.append(doing)
        with write(doing, **options) as cur:
            yield cur
            if len(attempts) <= ended[0]:
                raise StoreBusy("deadlock detected (a test's)")

    monkeypatch.setattr(b, "_write", deadlocking)
    b.keep_slot_limits(SlotLimits(concurrency=5))
    assert len(attempts) == 2
    assert a._select("SELECT DISTINCT concurrency FROM slots WHERE slot <> ''") == [(5,)]
    attempts.clear()
    ended[0] = 99
    with pytest.raises(StoreBusy):
        b.keep_slot_limits(SlotLimits(concurrency=7))
    assert len(attempts) == sql_politeness.SLOT_LIMITS_ATTEMPTS
    assert a._select("SELECT DISTINCT concurrency FROM slots WHERE slot <> ''") == [(5,)]


def test_the_store_clock_is_the_servers_by_the_quickest_round_trip(
        make: Callable[..., PostgreSQLStore], monkeypatch: pytest.MonkeyPatch) -> None:
    """A store's times are the server's clock: this process's clock plus an offset measured
    at each connection by round trips. A trip slowed on a loaded machine (the process
    descheduled between reading its clock and sending) is off by half its length; one such
    measure made a worker claim a site 0.27 s before the pause another worker wrote had
    ended. The quickest of a few round trips decides."""
    from scrapy_idempotent.store import postgresql_connection
    from scrapy_idempotent.store.postgresql_connection import clock_offset

    # the server's clock is ours + 100; the first trip slowed by a second
    assert clock_offset([(0.0, 100.05, 1.0), (2.0, 102.0015, 2.003),
                         (5.0, 105.2, 5.4)]) == pytest.approx(100.0, abs=0.002)
    real = postgresql_connection.observation_clock
    calls = [0]

    def descheduled_once() -> float:
        calls[0] += 1  # the first reading is 0.8 s before the question leaves
        return real() - (0.8 if calls[0] == 1 else 0.0)

    monkeypatch.setattr(postgresql_connection, "observation_clock", descheduled_once)
    store = make(heartbeat_seconds=None)
    store.open(fingerprinter="f", identity=SHOP)
    (server,) = store._select("SELECT extract(epoch FROM clock_timestamp())::float8")[0]
    assert abs(store.clock() - float(server)) < 0.1  # (one trip alone: 0.4 s off)


def test_a_statement_timeout_is_worth_retrying_and_writes_nothing(
        make: Callable[..., PostgreSQLStore]) -> None:
    store = make(heartbeat_seconds=None)
    store.open(fingerprinter="f", identity=SHOP)
    store.begin_session("w1", "auto")
    # the server's statement_timeout (set by the DBA, here on this connection): a big unit of
    # work runs past it
    store.conn.execute("SET statement_timeout = '1ms'")
    many = UnitOfWork(requests=[req(f"p{n}") for n in range(20000)])
    with pytest.raises(StoreBusy, match="statement_timeout"):
        store.commit(many, "w1")
    store.conn.execute("RESET statement_timeout")
    assert store.counts()["pending"] == 0  # rolled back: all or nothing
    assert store.commit(many, "w1").requests_added == 20000


def test_a_connection_whose_rollback_failed_is_not_used_again(
        make: Callable[..., PostgreSQLStore], monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed page commit is rolled back; if the ROLLBACK fails too (a starved server
    cancels it under a short statement_timeout), the connection stays in its failed
    transaction and is dropped, not handed to the next statement."""
    store = make(heartbeat_seconds=None)
    store.open(fingerprinter="f", identity=SHOP)
    store.begin_session("w1", "auto")
    failing = store.conn
    failing.execute("SET statement_timeout = '1ms'")
    real_execute = failing.execute

    def execute(query: Any, *args: Any, **kwargs: Any) -> Any:
        if query == "ROLLBACK":
            raise psycopg.errors.QueryCanceled("canceling statement due to statement timeout")
        return real_execute(query, *args, **kwargs)

    monkeypatch.setattr(failing, "execute", execute)
    with pytest.raises(StoreBusy, match="statement_timeout"):
        store.commit(UnitOfWork(requests=[req(f"p{n}") for n in range(20000)]), "w1")
    assert failing.closed
    assert store.conn is not failing
    assert store.counts()["pending"] == 0
    assert store.commit(UnitOfWork(requests=[req("p1")]), "w1").requests_added == 1


def test_lease_renewals_are_hot_updates(make: Callable[..., PostgreSQLStore],
                                        postgres_url: str) -> None:
    """A renewal changes only ``leased_until``, which no index holds: PostgreSQL can keep the
    new row version on its page without new index entries (a HOT update, when the page has
    room: the table leaves 20% free), so renewing every lease every few seconds does not
    bloat the indexes. With ``leased_until`` in an index none would be."""
    store = make(heartbeat_seconds=None)
    store.open(fingerprinter="f", identity=SHOP)
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=[req(f"p{n}") for n in range(16)]), "w1")
    assert len(store.commit(UnitOfWork(claim=16), "w1").leased) == 16
    for _ in range(5):
        assert len(store.renew_leases("w1")) == 16
    store.close()  # its statistics reach the server when its connection ends

    def updates() -> tuple[int, int]:
        rows = sql(postgres_url, "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
                   " WHERE schemaname = %s AND relname = 'requests'", (schema_for(SHOP),))
        return int(rows[0][0]), int(rows[0][1])

    wait_for(lambda: updates()[0] >= 16 + 5 * 16, 60, "the statistics of 96 updates")
    updated, hot = updates()
    assert hot >= 5 * 16 // 2, (updated, hot)  # the claims are not HOT: state changes


def test_after_a_server_outage_no_live_worker_looks_dead(
        make: Callable[..., PostgreSQLStore], postgres_cluster: Any, postgres_url: str) -> None:
    """The server is down longer than the liveness bound: no heartbeat could be written, so
    when it is back every heartbeat is stale. The first worker back must not take the leases
    of a worker that is alive (its heartbeat thread beats again); a worker that is really
    dead is still found, once the live ones have had the time to beat."""
    options = {"heartbeat_seconds": 0.3, "dead_after_seconds": 3.0,
               "busy_timeout_seconds": 120.0}
    w1, w2 = make(**options), make(**options)
    for store, worker in ((w1, "host-1:1:1:a"), (w2, "host-2:1:1:b")):
        store.open(fingerprinter="f", identity=SHOP)
        store.begin_session(worker, "auto")
    w1.commit(UnitOfWork(requests=[req(f"p{n}") for n in range(4)]), "host-1:1:1:a")
    assert len(w1.commit(UnitOfWork(claim=2), "host-1:1:1:a").leased) == 2
    assert len(w2.commit(UnitOfWork(claim=2), "host-2:1:1:b").leased) == 2
    postgres_cluster.stop("immediate")
    wait_for(lambda: _stale_for(w1, 4.0), 60,
             "an outage longer than the bound")
    postgres_cluster.start()
    with pytest.raises(StoreBusy):  # the connection the outage broke
        w1.reclaim_expired()
    assert w1.reclaim_expired() == 0  # back, but heartbeats are not judged yet
    leased = f"SELECT worker FROM \"{schema_for(SHOP)}\".requests WHERE state = 'leased'"
    assert sorted(r[0] for r in sql(postgres_url, leased)) == [
        "host-1:1:1:a", "host-1:1:1:a", "host-2:1:1:b", "host-2:1:1:b"]
    # w2 really dies (its heartbeat stops): once judged, its leases come back, not w1's own
    w2._stop_heartbeat()
    wait_for(lambda: w1.reclaim_expired() == 2, 120, "w2's leases reclaimed")
    assert sorted(r[0] for r in sql(postgres_url, leased)) == ["host-1:1:1:a", "host-1:1:1:a"]


def _stale_for(store: PostgreSQLStore, seconds: float) -> bool:
    """Whether ``seconds`` have passed since the store's last (re)connection."""
    return store.clock() - store._connected_since > seconds


class _Recorder:
    """A cursor that keeps the statements sent to it (nothing reaches the server)."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, Any]] = []
        self.connection = self

    def cursor(self) -> _Recorder:
        return self

    def execute(self, statement: str, params: Any = None, **_: Any) -> _Recorder:
        self.statements.append((statement, params))
        return self

    def fetchall(self) -> list[Any]:
        return []


def plans(store: PostgreSQLStore, recorder: _Recorder, *settings: str) -> list[str]:
    """The server's plan (EXPLAIN) of each statement ``recorder`` kept, in ``store``'s
    schema, after ``settings`` (statements such as ``SET ...``)."""
    with psycopg.connect(store.url) as conn:
        conn.execute(f'SET search_path TO "{store.schema}"')
        for setting in settings:
            conn.execute(setting)
        found = ["\n".join(row[0] for row in conn.execute("EXPLAIN " + statement, params))
                 for statement, params in recorder.statements]
        conn.rollback()
    return found


def test_a_commit_finds_journal_entries_by_their_key_index(
        make: Callable[..., PostgreSQLStore]) -> None:
    # The journal's and the requests' keys differ in collation ("C" for the requests' key):
    # a comparison of the two that is not in the index's collation cannot use the index, and
    # each commit read the whole journal (or the requests) table. With sequential scans
    # priced out, every journal deletion a commit sends is planned on an index.
    store = make(clock=FakeClock())
    store.open(fingerprinter="x", identity=SHOP)
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=[req(f"k{i}") for i in range(8)]), "w1")
    keys = [leased.key for leased in store.commit(UnitOfWork(claim=4), "w1").leased]
    recorder = _Recorder()
    store._send_finishes(recorder, [Completion(k, RequestState.DONE) for k in keys[:2]],
                         "w1", T0)
    store._end_journal(recorder, keys[2:], "w1")
    assert len(recorder.statements) == 2
    for plan in plans(store, recorder, "SET enable_seqscan = off"):
        assert "Seq Scan on responses" not in plan, plan
        assert "Seq Scan on requests" not in plan, plan


def test_statements_on_a_commits_keys_are_planned_on_the_key_index(
        make: Callable[..., PostgreSQLStore]) -> None:
    # The lease check of a commit's requests and the updates of its leases name their keys
    # and "leased by this worker". Planned on the leased requests' index (worker), they read
    # every entry the worker's past leases left in it; here the statistics favour that index
    # (one lease of the worker's, a thousand keys asked), and the keys' index must decide.
    store = make(clock=FakeClock())
    store.open(fingerprinter="x", identity=SHOP)
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=[req(f"k{i:04d}") for i in range(2000)]), "w1")
    (leased,) = store.commit(UnitOfWork(claim=1), "w1").leased
    asked = sorted({leased.key, *(f"k{i:04d}" for i in range(1000))})
    with psycopg.connect(store.url, autocommit=True) as conn:
        conn.execute(f'ANALYZE "{store.schema}".requests')
    recorder = _Recorder()
    store._send_fence(recorder, UnitOfWork(started=asked), "w1")
    store._leased_update(recorder, "unfinished = unfinished + 1", asked, "w1")
    store._send_finishes(recorder, [Completion(k, RequestState.DONE) for k in asked], "w1", T0)
    assert len(recorder.statements) == 3
    for plan in plans(store, recorder):
        assert "_leased" not in plan, plan  # (requests_leased, requests_slot_leased)


# -- request keys as bytes (schema 22) ------------------------------------------------------


def test_keys_are_stored_as_their_bytes_and_read_back_as_hex(
        make: Callable[..., PostgreSQLStore], postgres_url: str, real_key_codec: None) -> None:
    url = postgres_url + "?schema=keys"
    store = make(url, heartbeat_seconds=None, clock=FakeClock())
    store.open(fingerprinter="f", identity=SHOP)
    store.begin_session("w", "auto")
    parent, child, other = "00" * 19 + "ff", "ab" * 20, "0123456789abcdef" * 2 + "01234567"
    store.commit(UnitOfWork(requests=[req(parent)]), "w")
    store.commit(UnitOfWork(requests=[
        NewRequest(key=child, fingerprint=child, url="https://shop.example/c", priority=0,
                   data="{}", parent_key=parent),
        NewRequest(key=other, fingerprint=child, url="https://shop.example/c", priority=0,
                   data="{}", parent_key=parent, filter_fingerprint=False)]), "w")
    assert sql(postgres_url, "SELECT key, fingerprint, parent_key FROM keys.requests"
               " ORDER BY key") == [
        (bytes.fromhex(parent), None, None),
        (bytes.fromhex(other), bytes.fromhex(child), bytes.fromhex(parent)),
        (bytes.fromhex(child), None, bytes.fromhex(parent))]
    assert [(e.key, e.fingerprint, e.parent_key) for e in store.entries()] == [
        (parent, parent, None), (other, child, parent), (child, child, parent)]
    assert [e.key for e in store.entries(after=parent, limit=1)] == [other]
    # a link to the child again, in another commit: a duplicate by key and by fingerprint
    result = store.commit(UnitOfWork(requests=[req(child)]), "w")
    assert (result.requests_added, result.requests_duplicate) == (0, 1)
    assert store.known_request(child) == "duplicate"
    leased = store.commit(UnitOfWork(claim=3), "w").leased
    assert sorted((r.key, r.fingerprint) for r in leased) == sorted(
        [(parent, parent), (child, child), (other, child)])
    assert sorted(store.renew_leases("w")) == sorted([parent, child, other])
    # a journaled response ends with its request's completion
    store.commit(UnitOfWork(responses=[(child, "{}", b"body")]), "w")
    assert store.journaled_response(child) == ("{}", b"body")
    store.commit(UnitOfWork(completions=[Completion(child, RequestState.DONE),
                                         Completion(other, RequestState.FAILED,
                                                    error_kind="http_status")]), "w")
    assert store.journaled_response(child) is None
    assert [(f.key, f.parent_key) for f in store.failed_requests()] == [(other, parent)]
    assert store.anomalies()["orphan_journal"] == 0


@pytest.mark.parametrize("key", ["k1", "AB" * 20, "abc", "ab cd", ""])
def test_a_key_that_is_not_hex_digits_is_refused_and_nothing_is_stored(
        make: Callable[..., PostgreSQLStore], postgres_url: str, real_key_codec: None,
        key: str) -> None:
    # stored as bytes, it would not read back as the same key: refused, not mangled
    url = postgres_url + "?schema=keys"
    store = make(url, heartbeat_seconds=None, clock=FakeClock())
    store.open(fingerprinter="f", identity=SHOP)
    store.begin_session("w", "auto")
    for requests in ([req(key)], [req("ab"), NewRequest(
            key="cd", fingerprint="cd", url="https://shop.example/c", priority=0, data="{}",
            parent_key=key)]):
        with pytest.raises(StoreError, match="not lowercase hexadecimal"):
            store.commit(UnitOfWork(requests=requests), "w")
    assert sql(postgres_url, "SELECT count(*) FROM keys.requests") == [(0,)]
    with pytest.raises(StoreError, match="not lowercase hexadecimal"):
        store.entry(key)


def test_a_text_parameter_compared_with_a_key_is_an_error_not_a_miss(
        make: Callable[..., PostgreSQLStore], postgres_url: str, real_key_codec: None) -> None:
    # PostgreSQL reads a literal of unknown type compared with bytea as escape-format bytea
    # (40 hex digits: their 40 ASCII bytes), finding nothing; the store sends str as text,
    # so a statement that forgot to convert its key fails
    url = postgres_url + "?schema=keys"
    store = make(url, heartbeat_seconds=None, clock=FakeClock())
    store.open(fingerprinter="f", identity=SHOP)
    store.begin_session("w", "auto")
    store.commit(UnitOfWork(requests=[req("ab" * 20)]), "w")
    with pytest.raises(StoreError, match="operator does not exist: bytea = text"):
        store._select("SELECT 1 FROM requests WHERE key = ?", ("ab" * 20,))
    assert store._select("SELECT 1 FROM requests WHERE key = ?", (store._key("ab" * 20),)) == [
        (1,)]
