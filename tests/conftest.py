"""Shared fixtures: the local test site, frontier databases, a PostgreSQL cluster, the store
contract's stores and the scheduler harness."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_PROJECT = ROOT / "example_project"
if str(EXAMPLE_PROJECT) not in sys.path:
    sys.path.insert(0, str(EXAMPLE_PROJECT))

from local_site import LocalSite  # noqa: E402

from helpers.scheduler_harness import Harness  # noqa: E402
from helpers.stores import LEASE_SECONDS  # noqa: E402
from scrapy_idempotent.store import FrontierStore, open_store  # noqa: E402

#: Test modules that exercise no Scrapy and no Twisted: the stores at their interface (no
#: crawler, no Scrapy request or response, no ``scrapy`` process), the tests' own servers and
#: the repository's rules. Their tests are marked ``scrapy_independent``; CI runs them with
#: the newest Scrapy only (``.ci/run``: the oldest Scrapy's fast suite deselects them). A
#: module goes here only when none of its tests builds a crawler or starts a Scrapy process.
SCRAPY_INDEPENDENT_MODULES = frozenset({
    "test_claim_rank", "test_codec_plain", "test_import_graph", "test_layout", "test_lifeline",
    "test_module_size", "test_operator_queries", "test_outbox_store", "test_page_validators",
    "test_postgres_server", "test_postgres_server_cleanup", "test_postgresql_clock_steps",
    "test_postgresql_deadlocks", "test_postgresql_pipeline", "test_postgresql_record_times",
    "test_postgresql_frontier_layout", "test_postgresql_round_trips",
    "test_postgresql_server_version", "test_postgresql_store", "test_postgresql_url",
    "test_repository", "test_retry_after", "test_runs", "test_slot_flags",
    "test_sqlite_open_race", "test_sqlite_store", "test_store_boundary", "test_store_contract",
    "test_store_errors", "test_store_metrics", "test_url_redaction", "test_worker_ids",
})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the ``scrapy_independent`` tests, and runs the ``slow`` tests (minutes each)
    first: with ``-n`` (and ``--dist worksteal``, pyproject.toml: a worker with nothing left
    takes tests queued for another), the suite then ends on short tests, not on one worker
    going through kill tests while the others have nothing left to take."""
    for item in items:
        if item.path.stem in SCRAPY_INDEPENDENT_MODULES:
            item.add_marker(pytest.mark.scrapy_independent)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable


@pytest.fixture(autouse=True)
def _shutdown_signals_restored() -> Iterator[None]:
    """Each test leaves SIGINT and SIGTERM as it found them (a crawl run in the test process
    may ignore them after a second signal): an ignored signal is inherited by the processes
    later tests start, which then cannot be stopped by it."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in before.items():
        if handler is not None and signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)


@pytest.fixture(autouse=True)
def named_keys(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Request keys of any text on PostgreSQL in this process (``helpers.named_keys``: the
    tests name their keys), but for a test asking for ``real_key_codec``: the package's own
    codec, hex keys only. Crawls in processes of their own use the package's codec."""
    if "real_key_codec" not in request.fixturenames:
        from helpers import named_keys as codec

        codec.install(monkeypatch)


@pytest.fixture
def real_key_codec() -> None:
    """The PostgreSQL store's own key codec in this test (see ``named_keys``)."""


@pytest.fixture
def shop() -> Iterator[LocalSite]:
    """The local site with its default shop (25 listing pages, 500 products), HTTP/1.1
    keep-alive as a real site; a fresh one per test."""
    with LocalSite() as site:
        yield site
    assert site.errors == []


@pytest.fixture
def site() -> Iterator[LocalSite]:
    """The local site with one HTTP/1.0 connection per request (exact counters: Twisted never
    reuses or retries a connection by itself); a fresh one (fresh counters) per test."""
    with LocalSite(keep_alive=False) as local:
        yield local
    assert local.errors == []


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "frontier.sqlite3"


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[object]:
    """A PostgreSQL cluster of its own for the test session (tests/postgres_server.py); the
    tests that use it skip, naming what to install, when no server binaries or no psycopg
    are found."""
    pytest.importorskip("psycopg", reason="psycopg is not installed: pip install "
                        "'scrapy-idempotent[postgresql]'")
    from postgres_server import INSTALL_HINT, find_binaries, running_cluster

    bindir = find_binaries()
    if bindir is None:
        pytest.skip(INSTALL_HINT)
    with running_cluster(bindir) as cluster:
        yield cluster


@pytest.fixture
def postgres_url(postgres_cluster: Any) -> str:
    """The URL of an empty database of its own on the session's PostgreSQL cluster."""
    return str(postgres_cluster.new_database())


def _harness(database: str | Path) -> Iterator[Harness]:
    h = Harness(database)
    yield h
    for scheduler in list(h.open):
        h.close(scheduler)


@pytest.fixture
def harness(db_path: Path) -> Iterator[Harness]:
    """Schedulers opened by hand in real crawlers on this test's SQLite file
    (``helpers.scheduler_harness``); every one still open is closed after the test."""
    yield from _harness(db_path)


@pytest.fixture
def crawl_harness(crawl_database: str) -> Iterator[Harness]:
    """As ``harness``, on ``crawl_database``: a new, empty database of each store backend in
    turn (read what was stored through ``helpers.stored``)."""
    yield from _harness(crawl_database)


# -- store backends: the contract tests run against each -----------------------------------

#: Unix seconds the store tests start at.
T0 = 1_700_000_000.0


class FakeClock:
    """Unix seconds that only move when a test says so."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@dataclass(frozen=True)
class StoreBackend:
    """How the store tests get a database of one backend: ``database(request, tmp_path)``
    gives the database string (``IDEMPOTENT_DATABASE``) of a new, empty database for one
    test; ``options`` are given to every store of it (unless the test gives its own)."""

    database: Callable[[pytest.FixtureRequest, Path], str]
    options: dict[str, Any] = field(default_factory=dict)


#: One param per store backend: every test taking ``store_factory`` runs against each.
STORE_BACKENDS = [
    pytest.param(StoreBackend(lambda request, tmp_path: str(tmp_path / "frontier.sqlite3")),
                 id="sqlite"),
    # time is the fake clock's: no heartbeat thread, no death by heartbeat
    pytest.param(StoreBackend(lambda request, tmp_path: request.getfixturevalue("postgres_url"),
                              {"heartbeat_seconds": None, "dead_after_seconds": None}),
                 id="postgresql"),
]


@pytest.fixture(params=STORE_BACKENDS)
def store_backend(request: pytest.FixtureRequest) -> StoreBackend:
    backend: StoreBackend = request.param
    return backend


@pytest.fixture(params=STORE_BACKENDS)
def crawl_database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """``IDEMPOTENT_DATABASE`` of a new, empty database of each store backend in turn: a
    crawl test taking it runs on every backend, and reads what the crawl stored through the
    store interface (``helpers.stored``)."""
    backend: StoreBackend = request.param
    return backend.database(request, tmp_path)


@pytest.fixture
def second_crawl_database(crawl_database: str, request: pytest.FixtureRequest,
                          tmp_path: Path) -> str:
    """Another new, empty database of ``crawl_database``'s backend: a test comparing two
    crawls' databases."""
    from scrapy_idempotent.store.registry import sqlite_path

    if sqlite_path(crawl_database) is not None:
        return str(tmp_path / "second.sqlite3")
    return str(request.getfixturevalue("postgres_cluster").new_database())


@pytest.fixture
def store_database(store_backend: StoreBackend, request: pytest.FixtureRequest,
                   tmp_path: Path) -> str:
    """The database string of a new, empty database of each store backend in turn."""
    return store_backend.database(request, tmp_path)


@pytest.fixture
def store_factory(store_backend: StoreBackend, store_database: str,
                  clock: FakeClock) -> Iterator[Callable[..., FrontierStore]]:
    """``store_factory(**options)``: an unopened store on this test's database, chosen by
    ``open_store`` as a crawl chooses it, with the test's clock (``clock=`` overrides it);
    stores made by one test share its database (as two processes would). Every store made is
    closed after the test."""
    made: list[FrontierStore] = []

    def make(**options: Any) -> FrontierStore:
        store = open_store(store_database, **{**store_backend.options, "clock": clock,
                                              **options})
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


# -- the store contract's stores (helpers.stores: what the tests do with them) -------------


@pytest.fixture
def make_store(store_factory: Callable[..., FrontierStore]) -> Callable[..., Any]:
    """``make_store(**options)``: an unopened store on this test's database (leases of
    ``LEASE_SECONDS`` unless given)."""

    def make(**options: Any) -> Any:
        options.setdefault("lease_seconds", LEASE_SECONDS)
        return store_factory(**options)

    return make


@pytest.fixture
def store(make_store: Callable[..., Any]) -> Any:
    """An opened store on a new database, with worker ``w1`` in run 1."""
    store = make_store()
    store.open(fingerprinter="x")
    store.begin_session("w1", "auto")
    return store
