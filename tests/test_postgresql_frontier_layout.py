"""The PostgreSQL frontier's storage layout: its pages filled (no free room kept), its pending
indexes holding the queue reversed (the head at the right end, where last-in-first-out
requests are appended; the start flag folded into the order's bigint, the slot's index keyed
by the slot's hash) and read backward by both claims, in order, without a sort; two slots of
one hash never mixed; and databases of the schemas before migrated to it with their pending
requests kept in order."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest

from helpers import named_keys
from scrapy_idempotent._order import queue_position
from scrapy_idempotent.exceptions import StoreError
from scrapy_idempotent.store import (
    CommitResult,
    Completion,
    NewRequest,
    RequestState,
    UnitOfWork,
)
from scrapy_idempotent.store.base import SlotLimits
from scrapy_idempotent.store.packing import unpack

psycopg = pytest.importorskip("psycopg")
from scrapy_idempotent.store.postgresql import SCHEMA_VERSION, PostgreSQLStore  # noqa: E402

SCHEMA = "layout"


@pytest.fixture
def url(postgres_url: str) -> str:
    return f"{postgres_url}?schema={SCHEMA}"


def _store(url: str) -> PostgreSQLStore:
    return PostgreSQLStore(url, clock=lambda: 100.0, heartbeat_seconds=None,
                           dead_after_seconds=None)


def sql(postgres_url: str, statement: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"SET search_path TO {SCHEMA}")
        cur = conn.execute(statement)
        return cur.fetchall() if cur.description else []


def _options(postgres_url: str) -> list[str]:
    [(options,)] = sql(postgres_url, "SELECT reloptions FROM pg_class"
                                     f" WHERE oid = '{SCHEMA}.requests'::regclass")
    return list(options)


def _requests(count: int, start: int = 0) -> list[NewRequest]:
    return [NewRequest(key=f"k{n:03}", fingerprint=f"k{n:03}", url=f"https://s{n % 3}/{n}",
                       priority=n % 2, data="{}", slot=f"s{n % 3}")
            for n in range(start, start + count)]


@pytest.fixture
def store(url: str) -> Iterator[PostgreSQLStore]:
    store = _store(url)
    store.open()
    store.begin_session("w1", "resume")
    yield store
    store.close()


def test_a_new_frontier_fills_its_pages(store: PostgreSQLStore, postgres_url: str) -> None:
    assert "fillfactor=100" in _options(postgres_url)


def _plan(postgres_url: str, statement: str, generic: bool) -> str:
    """``EXPLAIN`` of ``statement`` (its parameters ``$1``: the slot, ``$2``: the limit) as
    the server plans it for these values, or (``generic``) for any, as a statement the
    driver prepared may be planned."""
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"SET search_path TO {SCHEMA}")
        conn.execute("ANALYZE requests")
        conn.execute("SET plan_cache_mode = "
                     + ("force_generic_plan" if generic else "force_custom_plan"))
        conn.execute(f"PREPARE claim (text, bigint) AS {statement}")
        return "\n".join(row[0] for row in conn.execute("EXPLAIN EXECUTE claim ('s1', 8)"))


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
@pytest.mark.parametrize("by_slot", [False, True], ids=["worker", "crawl"])
def test_claims_read_the_pending_index_backward_without_a_sort(
        store: PostgreSQLStore, postgres_url: str, by_slot: bool, generic: bool) -> None:
    """The claims' statements (PostgreSQLStore._claim_rows: IDEMPOTENT_POLITENESS "worker";
    SqlPoliteness._claim_by_slot: "crawl") on a frontier of 3,000 requests of 3 slots: an
    index scan backward that stops at the limit, planned for the slot or for any slot."""
    for start in range(0, 3000, 500):
        store.commit(UnitOfWork(requests=_requests(500, start=start)), "w1")
    where = (store._of_slot(slot="$1") + " AND state = 'pending'" if by_slot
             else "state = 'pending' AND $1::text IS NOT NULL")
    plan = _plan(postgres_url, f"SELECT id FROM requests WHERE {where}"
                               f" ORDER BY {store.PENDING_ORDER} LIMIT $2{store.SKIP_LOCKED}",
                 generic)
    index = "requests_slot_pending" if by_slot else "requests_pending"
    assert plan.startswith("Limit"), plan
    assert f"Index Scan Backward using {index} on requests" in plan, plan
    assert "Sort" not in plan, plan


#: The slots of the order tests: requests of several sites interleaved in one index.
SLOTS = ("a.example", "b.example", "c.example")


@pytest.mark.parametrize("by_slot", [False, True], ids=["worker", "crawl"])
def test_both_claims_take_scrapys_order(store: PostgreSQLStore, by_slot: bool) -> None:
    """Priorities, start requests (FIFO) and the others (LIFO) mixed, FIFO among the others
    too, over three slots: the claims give them in rules.queue_position's order, over all
    (by worker), or per slot (by the crawl's slot limits: the slots take turns, each one's
    requests in that order)."""
    if by_slot:
        store.keep_slot_limits(SlotLimits(concurrency=1000))
    requests = [NewRequest(key=f"k{n:03}", fingerprint=f"k{n:03}", url=f"https://s/{n}",
                           priority=n % 3 - 1, data="{}", is_start=n % 4 == 0,
                           fifo=n % 4 == 0 or n % 7 == 0, slot=SLOTS[n % 5 % 3])
                for n in range(180)]
    for start in range(0, 180, 30):
        store.commit(UnitOfWork(requests=requests[start:start + 30]), "w1")
    expected = [r.key for _, r in sorted(
        enumerate(requests), key=lambda e: queue_position(e[1].priority, e[1].is_start,
                                                           e[1].fifo, e[0]))]
    # every kind of request is there, in every slot
    assert {(r.slot, r.priority, r.is_start, r.fifo) for r in requests} == {
        (slot, priority, is_start, fifo) for slot in SLOTS for priority in (-1, 0, 1)
        for is_start, fifo in ((True, True), (False, False), (False, True))}
    claimed = _claim_all(store)
    assert sorted(claimed) == sorted(expected)
    if not by_slot:
        assert claimed == expected
    slot_of = {r.key: r.slot for r in requests}
    for slot in SLOTS:
        assert [k for k in claimed if slot_of[k] == slot] == [
            k for k in expected if slot_of[k] == slot], slot


#: Two download slots whose ``hashtext`` is the same (found by a search of generated names;
#: the test checks it): their entries lie side by side in the slot's pending index.
SAME_HASH = ("host-24319.test", "host-244961.test")


def test_two_slots_of_one_hash_never_mix(store: PostgreSQLStore, postgres_url: str) -> None:
    """The slot's pending index is keyed by the slot's hash: a claim of one slot takes none of
    the requests of another slot of the same hash, though they are interleaved in the index,
    the other slot's ahead in the queue; the slots' counts are each its own."""
    few, many = SAME_HASH
    [(first, second)] = sql(postgres_url, f"SELECT hashtext('{few}'), hashtext('{many}')")
    assert first == second
    # ``few`` may hold 2 leases at once, ``many`` 1,000; their requests alternate, those of
    # ``many`` at the higher priority (and ahead of ``few``'s in the index, read backward)
    store.keep_slot_limits(SlotLimits(concurrency=1000, per_slot=((few, 2, None),)))
    requests = [NewRequest(key=f"k{n:03}", fingerprint=f"k{n:03}",
                           url=f"https://{SAME_HASH[n % 2]}/{n}", priority=n % 2,
                           data="{}", slot=SAME_HASH[n % 2]) for n in range(40)]
    store.commit(UnitOfWork(requests=requests), "w1")
    slot_of = {r.key: r.slot for r in requests}
    assert {s.slot: s.pending for s in store.slots()} == {few: 20, many: 20}
    leased = store.commit(UnitOfWork(claim=100), "w1").leased
    assert sorted((lease.slot, slot_of[lease.key]) for lease in leased) == (
        [(few, few)] * 2 + [(many, many)] * 20)
    # ``few``'s two newest (LIFO): the head of its own queue
    assert sorted(lease.key for lease in leased if lease.slot == few) == ["k036", "k038"]
    assert {s.slot: (s.pending, s.leased) for s in store.slots()} == {
        few: (18, 2), many: (0, 20)}


#: Schema step 20 undone: the slots' flags of pending requests, their index and triggers.
SLOT_FLAG_UNDO = ("DROP TRIGGER requests_pending_added ON requests",
                  "DROP TRIGGER requests_pending_again ON requests",
                  "DROP FUNCTION slots_pending_added(), slots_pending_again()",
                  "DROP INDEX slots_pending", "ALTER TABLE slots DROP COLUMN has_pending")


#: a named key's name (``helpers.named_keys``), in SQL
NAME = f"encode(substr(key, {len(named_keys.MARK) + 1}), 'escape')"

#: Schema step 22 undone: the requests' keys as text, their hex digits.
KEYS_AS_TEXT = ("ALTER TABLE requests"
                " ALTER COLUMN key TYPE text COLLATE \"C\" USING encode(key, 'hex'),"
                " ALTER COLUMN parent_key TYPE text USING encode(parent_key, 'hex'),"
                " ALTER COLUMN fingerprint TYPE text USING encode(fingerprint, 'hex'),"
                " ALTER COLUMN run_id TYPE bigint")


def _as_schema(postgres_url: str, version: int) -> None:
    """The database as schema ``version`` (15, 17, 18, 20 or 21) left it: the steps before
    15 are unchanged; 16 took the free room of the table's pages, 18 made the key the primary
    key, 19 keyed the slot's pending index by the slot's hash and folded the start flag into
    the order of both pending indexes, 20 flagged the slots with pending requests, 21 packed
    the requests (their rows of text), 22 stored the keys as bytes (text before: the hex
    digits; a named key of ``helpers.named_keys`` the hex digits of its bytes)."""
    sql(postgres_url, KEYS_AS_TEXT)
    sql(postgres_url, f"UPDATE meta SET value = '{version}' WHERE key = 'schema_version'")
    if version == 21:
        return
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"SET search_path TO {SCHEMA}")
        conn.cursor().executemany("UPDATE requests SET data = %s WHERE key = %s", [
            (unpack(packed, row_url, key), key) for key, row_url, packed in conn.execute(
                "SELECT key, url, packed FROM requests WHERE packed IS NOT NULL")])
        conn.execute("ALTER TABLE requests DROP COLUMN packed")
    if version == 20:
        return
    for statement in SLOT_FLAG_UNDO:
        sql(postgres_url, statement)
    sql(postgres_url, "DROP STATISTICS requests_slot_hash")
    if version <= 17:
        sql(postgres_url, "ALTER TABLE requests DROP CONSTRAINT requests_key_key, ADD"
                          " CONSTRAINT requests_key_key UNIQUE (key), ADD CONSTRAINT"
                          " requests_pkey PRIMARY KEY (id)")
    if version == 15:
        sql(postgres_url, "ALTER TABLE requests SET (fillfactor = 80)")
    order = ("priority DESC, is_start, (CASE WHEN fifo THEN id ELSE -id END)" if version == 15
             else "priority, is_start DESC, (CASE WHEN fifo THEN -id ELSE id END)")
    for index, slot in (("requests_pending", ""), ("requests_slot_pending", "slot, ")):
        sql(postgres_url, f"DROP INDEX {index}")
        sql(postgres_url, f"CREATE INDEX {index} ON requests ({slot}{order})"
                          " WHERE state = 'pending'")
    sql(postgres_url, f"UPDATE meta SET value = '{version}' WHERE key = 'schema_version'")


def _claim_all(store: PostgreSQLStore) -> list[str]:
    claimed: list[str] = []
    while leased := store.commit(UnitOfWork(claim=7), "w1").leased:
        claimed.extend(lease.key for lease in leased)
    return claimed


#: The pending indexes of the current schema (as pg_indexes shows them, spaces collapsed).
PENDING_INDEXES = [
    f"CREATE INDEX requests_pending ON {SCHEMA}.requests USING btree (priority,"
    " (( CASE WHEN fifo THEN (- id) ELSE id END - CASE WHEN is_start THEN"
    " '4611686018427387904'::bigint ELSE (0)::bigint END)))"
    " WHERE (state = 'pending'::text)",
    f"CREATE INDEX requests_slot_pending ON {SCHEMA}.requests USING btree (hashtext(slot),"
    " priority, (( CASE WHEN fifo THEN (- id) ELSE id END - CASE WHEN is_start THEN"
    " '4611686018427387904'::bigint ELSE (0)::bigint END)))"
    " WHERE (state = 'pending'::text)"]


def _pending_indexes(postgres_url: str) -> list[str]:
    indexes = sql(postgres_url, "SELECT indexdef FROM pg_indexes WHERE"
                  f" schemaname = '{SCHEMA}' AND tablename = 'requests'"
                  " AND indexname LIKE '%pending'"
                  " ORDER BY indexname")
    return [" ".join(d.split()) for (d,) in indexes]


def _slot_statistics(postgres_url: str) -> list[tuple[Any, ...]]:
    """The statistics objects of the schema: name, kinds, and whether ANALYZE built them."""
    return sql(postgres_url, "SELECT s.stxname, s.stxkind::text, d.stxddependencies IS NOT NULL"
                             " FROM pg_statistic_ext s LEFT JOIN pg_statistic_ext_data d"
                             " ON d.stxoid = s.oid"
                             f" WHERE s.stxnamespace = '{SCHEMA}'::regnamespace")


def test_a_schema_15_frontier_is_migrated_with_its_requests_in_order(
        url: str, postgres_url: str) -> None:
    first = _store(url)
    first.open()
    first.begin_session("w1", "resume")
    first.commit(UnitOfWork(requests=_requests(40)), "w1")
    first.close()
    _as_schema(postgres_url, 15)
    assert "fillfactor=80" in _options(postgres_url)
    store = _store(url)
    store.open()
    try:
        assert store.meta()["schema_version"] == str(SCHEMA_VERSION) == "22"
        assert "fillfactor=100" in _options(postgres_url)
        assert _pending_indexes(postgres_url) == PENDING_INDEXES
        store.begin_session("w1", "resume")
        store.commit(UnitOfWork(requests=_requests(20, start=40)), "w1")
        # Scrapy's order: the highest priority first, then the newest first (LIFO)
        assert _claim_all(store) == [f"k{n:03}" for n in
                                     sorted(range(60), key=lambda n: (-(n % 2), -n))]
    finally:
        store.close()


def _primary_key(postgres_url: str) -> list[tuple[Any, ...]]:
    """The requests' primary key: its name and its index's definition."""
    return [(name, " ".join(definition.split())) for name, definition in sql(
        postgres_url, "SELECT c.conname, pg_get_indexdef(c.conindid) FROM pg_constraint c"
        f" WHERE c.conrelid = '{SCHEMA}.requests'::regclass AND c.contype = 'p'")]


def _request_indexes(postgres_url: str) -> list[str]:
    return [name for (name,) in sql(postgres_url, "SELECT indexname FROM pg_indexes WHERE"
                                    f" schemaname = '{SCHEMA}' AND tablename = 'requests'"
                                    " ORDER BY indexname")]


def test_a_schema_17_frontier_gets_its_key_as_primary_key(url: str, postgres_url: str) -> None:
    """Schema 18: the requests' primary key is their key, and ``id`` (still an identity)
    has no index of its own but the redirected requests'. The requests of schema 17 keep
    their ids and their order; a done request found again by its key is due again."""
    first = _store(url)
    first.open()
    first.begin_session("w1", "resume")
    first.commit(UnitOfWork(requests=_requests(40)), "w1")
    first.close()
    _as_schema(postgres_url, 17)
    assert _primary_key(postgres_url) == [
        ("requests_pkey", f"CREATE UNIQUE INDEX requests_pkey ON {SCHEMA}.requests"
                          " USING btree (id)")]
    ids = sql(postgres_url, "SELECT key, id FROM requests ORDER BY key")
    store = _store(url)
    store.open()
    try:
        assert store.meta()["schema_version"] == str(SCHEMA_VERSION) == "22"
        assert _primary_key(postgres_url) == [
            ("requests_key_key", f"CREATE UNIQUE INDEX requests_key_key ON {SCHEMA}.requests"
                                 " USING btree (key)")]
        assert "requests_pkey" not in _request_indexes(postgres_url)
        assert sql(postgres_url, "SELECT encode(key, 'hex'), id FROM requests"
                                 " ORDER BY key") == ids
        [(identity,)] = sql(postgres_url, "SELECT attidentity FROM pg_attribute WHERE"
                            f" attrelid = '{SCHEMA}.requests'::regclass AND attname = 'id'")
        assert identity == "d"
        store.begin_session("w1", "resume")
        store.commit(UnitOfWork(requests=_requests(20, start=40)), "w1")
        [(lowest_new,)] = sql(postgres_url,
                             f"SELECT min(id) FROM requests WHERE {NAME} >= 'k040'")
        assert lowest_new > max(i for _, i in ids)
        # Scrapy's order: the highest priority first, then the newest first (LIFO)
        assert _claim_all(store) == [f"k{n:03}" for n in
                                     sorted(range(60), key=lambda n: (-(n % 2), -n))]
    finally:
        store.close()



@pytest.mark.parametrize("by_slot", [False, True], ids=["worker", "crawl"])
def test_a_schema_18_frontier_is_migrated_with_its_requests_in_order(
        url: str, postgres_url: str, by_slot: bool) -> None:
    """Schema 19 keys the slot's pending index by the slot's hash and folds the start flag
    into the order of both pending indexes (with the planner's statistics of the hash,
    built by the migration): the requests pending before are claimed in Scrapy's order, the
    new ones among them."""
    requests = [NewRequest(key=f"k{n:03}", fingerprint=f"k{n:03}", url=f"https://s/{n}",
                           priority=n % 2, data="{}", is_start=n % 5 == 0,
                           fifo=n % 5 == 0 or n % 7 == 0, slot=SLOTS[n % 3])
                for n in range(90)]
    first = _store(url)
    first.open()
    first.begin_session("w1", "resume")
    first.commit(UnitOfWork(requests=requests[:60]), "w1")
    first.close()
    _as_schema(postgres_url, 18)
    assert _slot_statistics(postgres_url) == []
    store = _store(url)
    store.open()
    try:
        assert store.meta()["schema_version"] == str(SCHEMA_VERSION) == "22"
        assert _pending_indexes(postgres_url) == PENDING_INDEXES
        assert _slot_statistics(postgres_url) == [("requests_slot_hash", "{f,e}", True)]
        store.begin_session("w1", "resume")
        if by_slot:
            store.keep_slot_limits(SlotLimits(concurrency=1000))
        store.commit(UnitOfWork(requests=requests[60:]), "w1")
        expected = [r.key for _, r in sorted(
            enumerate(requests), key=lambda e: queue_position(e[1].priority, e[1].is_start,
                                                               e[1].fifo, e[0]))]
        claimed = _claim_all(store)
        if by_slot:  # per slot
            slot_of = {r.key: r.slot for r in requests}
            assert sorted(claimed) == sorted(expected)
            claimed, expected = ([k for slot in SLOTS for k in keys if slot_of[k] == slot]
                                 for keys in (claimed, expected))
        assert claimed == expected
    finally:
        store.close()


class _Recording:
    """The store's cursor, keeping the statements sent through it."""

    def __init__(self, cur: Any) -> None:
        self.cur = cur
        self.statements: list[tuple[str, Any]] = []

    def execute(self, statement: str, params: Any = None, **options: Any) -> _Recording:
        self.statements.append((statement, params))
        self.cur.execute(statement, params, **options)
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cur, name)


def _plans_without_seq_scans(postgres_url: str,
                             statements: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    """Each statement on the requests of ``statements`` with its plan, planned with
    sequential scans priced out (so any index that serves a statement is taken)."""
    with psycopg.connect(postgres_url) as conn:
        conn.execute(f"SET search_path TO {SCHEMA}")
        conn.execute("ANALYZE requests")
        conn.execute("SET enable_seqscan = off")
        return [(statement, "\n".join(
                    row[0] for row in conn.execute("EXPLAIN " + statement, params)))
                for statement, params in statements if "requests" in statement]


def test_claims_and_the_take_back_find_their_rows_by_an_index(
        store: PostgreSQLStore, postgres_url: str) -> None:
    """The statements that found rows by their ``id`` (which has no index since schema 18)
    find them by the primary key: the claim's update of the rows it locked, the claim by
    slot and the take-back of expired leases before it. None reads the table through."""
    store.commit(UnitOfWork(requests=_requests(3000)), "w1")
    assert len(store.commit(UnitOfWork(claim=20), "w1").leased) == 20
    with store._write("claiming") as cur:
        recording = _Recording(cur)
        assert len(store._claim_rows(recording, "w1", 8, 200.0)) == 8
    store.keep_slot_limits(SlotLimits(concurrency=1000, dead_worker_pause_seconds=5))
    with store._write("taking back") as cur:
        # the 28 leases expired: taken back, their slots paused
        recording.cur = cur
        result = CommitResult()
        assert store._claim_by_slot(recording, "w1", 8, 2e8, 1e8, result, {}, {}) == []
        assert result.reclaimed is not None and result.reclaimed.expired == 28
    with store._write("claiming by slot") as cur:
        recording.cur = cur
        assert len(store._claim_by_slot(recording, "w1", 8, 3e8, 2e8, CommitResult(), {},
                                        {})) == 8
    by_row = f"{store.REQUEST_ROW} IN (SELECT {store.REQUEST_ROW}"
    planned = _plans_without_seq_scans(postgres_url, recording.statements)
    # the claim; the take-back's slots and its update; the claim by slot
    assert sum(by_row in s or "FROM head" in s for s, _ in planned) == 4
    for statement, plan in planned:
        assert "Seq Scan on requests" not in plan, plan
        if by_row in statement or "FROM head" in statement:
            assert "requests_key_key on requests" in plan, plan


def _linked(n: int) -> NewRequest:
    """A link with a ``Referer`` and a depth, as Scrapy's middlewares leave it."""
    url = f"https://s{n % 3}/product/{n}"
    return NewRequest(key=f"k{n:03}", fingerprint=f"k{n:03}", url=url, priority=0,
                      data=f'{{"url":"{url}","callback":"parse","headers":{{"Referer":'
                           f'["https://s{n % 3}/category/{n % 7}"]}},"meta":{{"depth":2}}}}',
                      slot=f"s{n % 3}")


def test_a_schema_20_frontier_gets_its_requests_packed_without_a_rewrite(
        url: str, postgres_url: str) -> None:
    """Schema 21 adds the requests' packed column, a change of the catalog only: its rows of
    text stay as they are and are read as they are (schema 22 then rewrites the table, its
    keys as bytes: the rows as they were); the rows written from then on are packed
    (``data`` then '')."""
    requests = [_linked(n) for n in range(40)]
    first = _store(url)
    first.open()
    first.begin_session("w1", "resume")
    first.commit(UnitOfWork(requests=requests[:20]), "w1")
    assert sql(postgres_url, "SELECT count(*) FROM requests WHERE packed IS NOT NULL"
                             " AND data = ''") == [(20,)]
    first.close()
    _as_schema(postgres_url, 20)
    texts = sql(postgres_url, "SELECT key, data FROM requests ORDER BY key")
    assert [data for _, data in texts] == [r.data.replace(f'"url":"{r.url}",', "")
                                           for r in requests[:20]]
    store = _store(url)
    store.open()
    try:
        assert store.meta()["schema_version"] == str(SCHEMA_VERSION) == "22"
        assert sql(postgres_url, "SELECT encode(key, 'hex'), data, packed FROM requests"
                                 " ORDER BY key") == [
            (key, data, None) for key, data in texts]
        store.begin_session("w1", "resume")
        store.commit(UnitOfWork(requests=requests[20:]), "w1")
        new = sql(postgres_url,
                  f"SELECT data, length(packed) FROM requests WHERE {NAME} >= 'k020'")
        assert len(new) == 20
        assert all(data == "" and 0 < size < 50 for data, size in new), new
        given = {r.key: r.data for r in requests}
        assert {e.key: e.data for e in store.entries()} == given
        assert {r.key: r.data for r in store.commit(UnitOfWork(claim=40), "w1").leased} == given
    finally:
        store.close()


def _key(name: str) -> str:
    """A request key as the package makes them: 40 lowercase hex digits."""
    return hashlib.sha1(name.encode()).hexdigest()


def _key_columns(postgres_url: str) -> list[tuple[Any, ...]]:
    return sql(postgres_url, "SELECT column_name, data_type FROM information_schema.columns"
                             f" WHERE table_schema = '{SCHEMA}' AND table_name = 'requests'"
                             " AND column_name IN ('key', 'parent_key', 'fingerprint', 'run_id')"
                             " ORDER BY column_name")


def test_a_schema_21_frontier_reads_the_same_entries_with_its_keys_as_bytes(
        url: str, postgres_url: str, real_key_codec: None) -> None:
    # a start request (no parent, its fingerprint its key: NULL), two of its links (one done),
    # and a dont_filter request whose key is not its fingerprint (stored apart)
    page, child, done, again = _key("page"), _key("child"), _key("done"), _key("again")
    first = _store(url)
    first.open()
    first.begin_session("w1", "resume")
    first.commit(UnitOfWork(requests=[NewRequest(key=page, fingerprint=page,
                                                 url="https://s0/", priority=0, data="{}",
                                                 is_start=True, slot="s0")]), "w1")
    first.commit(UnitOfWork(requests=[
        NewRequest(key=k, fingerprint=f, url=f"https://s0/{n}", priority=n, data="{}",
                   parent_key=page, slot="s0", filter_fingerprint=k == f)
        for n, (k, f) in enumerate(((child, child), (done, done), (again, child)))]), "w1")
    (leased,) = first.commit(UnitOfWork(claim=1), "w1").leased
    assert leased.key == again
    first.commit(UnitOfWork(completions=[Completion(again, RequestState.DONE)]), "w1")
    before = first.entries()
    first.close()
    _as_schema(postgres_url, 21)
    assert _key_columns(postgres_url) == [("fingerprint", "text"), ("key", "text"),
                                          ("parent_key", "text"), ("run_id", "bigint")]
    assert sql(postgres_url, "SELECT count(*) FROM requests WHERE fingerprint IS NULL"
                             " AND parent_key IS NULL") == [(1,)]
    store = _store(url)
    store.open()
    try:
        assert store.meta()["schema_version"] == str(SCHEMA_VERSION) == "22"
        assert _key_columns(postgres_url) == [("fingerprint", "bytea"), ("key", "bytea"),
                                              ("parent_key", "bytea"), ("run_id", "integer")]
        assert store.entries() == before
        assert [(e.key, e.fingerprint, e.parent_key, e.state) for e in before] == sorted([
            (page, page, None, "pending"), (child, child, page, "pending"),
            (done, done, page, "pending"), (again, child, page, "done")])
        assert sql(postgres_url, "SELECT octet_length(key), octet_length(fingerprint),"
                                 " octet_length(parent_key) FROM requests ORDER BY key") == [
            (20, 20 if k == again else None, None if k == page else 20)
            for k in sorted((page, child, done, again))]
        for key in (page, child, done, again):
            assert store.entry(key) == next(e for e in before if e.key == key)
        # the same keys are still duplicates: by key, and by the fingerprint of the
        # dont_filter request's row
        store.begin_session("w1", "resume")
        result = store.commit(UnitOfWork(requests=[
            NewRequest(key=k, fingerprint=k, url="https://s0/x", priority=0, data="{}",
                       slot="s0") for k in (child, done)]), "w1")
        assert (result.requests_added, result.requests_duplicate) == (0, 2)
        assert store.known_request(child) == "duplicate"
        assert store.known_request(again, key=again) == "already_done"
        assert sorted(store.known_keys([page, again, _key("never")])) == sorted([page, again])
        claimed = []
        while leased_now := store.commit(UnitOfWork(claim=2), "w1").leased:
            claimed += [(r.key, r.fingerprint) for r in leased_now]
        assert sorted(claimed) == sorted([(page, page), (child, child), (done, done)])
    finally:
        store.close()


def test_a_schema_21_frontier_holding_a_key_that_is_not_hex_is_not_migrated(
        url: str, postgres_url: str, real_key_codec: None) -> None:
    # a row written by hand with a key that is not hex digits: it would not read back as
    # its key, so the step fails, and nothing is changed
    first = _store(url)
    first.open()
    first.close()
    _as_schema(postgres_url, 21)
    sql(postgres_url, "INSERT INTO requests (key, fingerprint, url, priority, state, data,"
                      " enqueued_at, run_id) VALUES ('k1', 'k1', 'https://s0/', 0, 'pending',"
                      " '{}', 0, 1)")
    store = _store(url)
    with pytest.raises(StoreError, match="invalid hexadecimal"):
        store.open()
    store.close()
    assert sql(postgres_url, "SELECT value FROM meta WHERE key = 'schema_version'") == [
        ("21",)]
    assert _key_columns(postgres_url) == [("fingerprint", "text"), ("key", "text"),
                                          ("parent_key", "text"), ("run_id", "bigint")]
    assert sql(postgres_url, "SELECT key FROM requests") == [("k1",)]
