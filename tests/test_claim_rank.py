"""A claimed request carries its place in its queue (``LeasedRequest.rank``), so requests
from separate claims merge into Scrapy's order (``leases.queue_rank``, as the lease buffer
merges them) on every store backend, with requests joining the frontier between the claims
and keys that do not sort in the order they joined."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

import pytest

from scrapy_idempotent._order import queue_position
from scrapy_idempotent.leases import queue_rank
from scrapy_idempotent.store import FrontierStore, LeasedRequest, NewRequest, UnitOfWork


def _request(n: int, rng: random.Random) -> NewRequest:
    key = hashlib.sha1(str(n).encode()).hexdigest()  # key order is not the joining order
    return NewRequest(key=key, fingerprint=key, url=f"https://example.com/{n}",
                      priority=rng.choice((0, 0, 1)), data="{}",
                      is_start=rng.random() < 0.3, fifo=rng.random() < 0.5)


@pytest.mark.parametrize("seed", [1, 2])
def test_separate_claims_merge_by_rank_into_the_queue_order(
        store_factory: Callable[..., FrontierStore], seed: int) -> None:
    rng = random.Random(seed)
    store = store_factory()
    store.open(fingerprinter="x")
    store.begin_session("w1", "auto")
    joined: list[NewRequest] = []
    claimed: list[LeasedRequest] = []
    for _ in range(8):  # requests join between claims, several per page commit
        new = [_request(len(joined) + i, rng) for i in range(rng.randint(1, 6))]
        joined.extend(new)
        claimed.extend(store.commit(UnitOfWork(requests=new, claim=rng.randint(1, 4)),
                                    "w1").leased)
    position = {r.key: queue_position(r.priority, r.is_start, r.fifo, n)
                for n, r in enumerate(joined)}
    expected = sorted((lease.key for lease in claimed), key=position.__getitem__)
    assert [lease.key for lease in sorted(claimed, key=queue_rank)] == expected


def test_a_newer_request_of_a_lifo_queue_claimed_later_goes_first(
        store_factory: Callable[..., FrontierStore]) -> None:
    store = store_factory()
    store.open(fingerprinter="x")
    store.begin_session("w1", "auto")

    def new(key: str) -> NewRequest:
        return NewRequest(key=key, fingerprint=key, url=f"https://example.com/{key}",
                          priority=0, data="{}")

    first = store.commit(UnitOfWork(requests=[new("m"), new("z")], claim=1), "w1").leased
    second = store.commit(UnitOfWork(requests=[new("a")], claim=2), "w1").leased
    assert [r.key for r in first] == ["z"] and [r.key for r in second] == ["a", "m"]
    # the lease buffer holds z when a and m come: a, the newest, goes before it
    assert [r.key for r in sorted([*first, *second], key=queue_rank)] == ["a", "z", "m"]
