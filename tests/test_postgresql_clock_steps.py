"""The PostgreSQL store's clock is the server's, whatever this host's wall clock does: a
wall clock stepped while a worker runs (an NTP step of +30 s or -30 s) moves neither its
heartbeats nor its leases, so another worker never takes a live worker's leases, and a dead
worker's heartbeat ages from its real last beat."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from scrapy_idempotent.store import CrawlIdentity, NewRequest, UnitOfWork

psycopg = pytest.importorskip("psycopg")
from scrapy_idempotent.store.postgresql import PostgreSQLStore  # noqa: E402

SHOP = CrawlIdentity(project="p", spider="shop", source="shop")


@pytest.fixture
def make(postgres_url: str) -> Iterator[Callable[..., PostgreSQLStore]]:
    made: list[PostgreSQLStore] = []

    def make_store(**options: Any) -> PostgreSQLStore:
        store = PostgreSQLStore(postgres_url, heartbeat_seconds=None, **options)
        store.open(fingerprinter="f", identity=SHOP)
        made.append(store)
        return store

    yield make_store
    for store in made:
        store.close()


def server_now(url: str) -> float:
    with psycopg.connect(url, autocommit=True) as conn:
        (now,) = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8"
                              ).fetchone() or (0,)
    return float(now)


@pytest.mark.parametrize("step", [30.0, -30.0])
def test_a_stepped_wall_clock_moves_no_heartbeat_and_no_lease(
        make: Callable[..., PostgreSQLStore], postgres_url: str,
        monkeypatch: pytest.MonkeyPatch, step: float) -> None:
    stepped, other = make(), make(dead_after_seconds=15.0)
    stepped.begin_session("stepped", "resume")
    other.begin_session("other", "resume")
    stepped.commit(UnitOfWork(requests=[
        NewRequest(key=f"k{n}", fingerprint=f"k{n}", url=f"https://shop.example/{n}",
                   priority=0, data="{}") for n in range(3)]), "stepped")
    assert len(stepped.commit(UnitOfWork(claim=3), "stepped").leased) == 3
    # the wall clock is stepped (the monotonic clock is not, as with NTP)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + step)
    stepped.heartbeat()
    assert sorted(stepped.renew_leases("stepped")) == ["k0", "k1", "k2"]
    now = server_now(postgres_url)
    assert abs(stepped.heartbeats()["stepped"] - now) < 2.0
    leased = {h.worker: h.leased_until for h in stepped.lease_holders()}
    assert abs(leased["stepped"] - (now + stepped.lease_seconds)) < 2.0
    # the other worker, judging heartbeats, takes nothing of the live one
    other._connected_since = other.clock() - 60.0  # connected long enough to judge
    assert other.reclaim_expired() == 0
