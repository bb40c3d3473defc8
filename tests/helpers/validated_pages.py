"""Pages with validators and links at the store level, shared by the tests of conditional
requests and of the migration that carries them."""

from __future__ import annotations

from typing import Any

from scrapy_idempotent.store import (
    Completion,
    FrontierStore,
    NewRequest,
    RequestState,
    UnitOfWork,
)
from scrapy_idempotent.store.base import PageValidators, Record

VALIDATORS = PageValidators('"5f-1a2b"', "Sat, 05 Dec 2026 10:00:00 GMT", "ab" * 32)


def new(name: str, parent: str | None = None) -> NewRequest:
    return NewRequest(key=name, fingerprint=name, url=f"https://example.com/{name}",
                      priority=0, data=f'{{"url": "{name}"}}', parent_key=parent,
                      is_start=parent is None)


def record(n: int, price: int = 1) -> Record:
    return Record(record_id=f"r{n}", source="s", natural_key=f'["{n}"]', item_type="Product",
                  data=f'{{"sku": "{n}", "price": {price}}}', content_hash=f"h{n}-{price}")


def claim_one(store: FrontierStore, worker: str = "w1") -> Any:
    (leased,) = store.commit(UnitOfWork(claim=1), worker).leased
    store.commit(UnitOfWork(started=[leased.key]), worker)
    return leased


def two_listings_sharing_a_product(store: FrontierStore) -> None:
    """Run 1: listing ``a`` adds product ``p``; listing ``b`` links ``p`` too, known by then
    (refused as a duplicate: not among its requests, only among its links); ``p`` done."""
    store.commit(UnitOfWork(requests=[new("a"), new("b")]), "w1")
    assert sorted([claim_one(store).key, claim_one(store).key]) == ["a", "b"]
    store.commit(UnitOfWork(requests=[new("p", "a")], completions=[
        Completion("a", RequestState.DONE, validators=VALIDATORS, links=("p",))]), "w1")
    store.commit(UnitOfWork(completions=[
        Completion("b", RequestState.DONE, validators=VALIDATORS, links=("p",))]), "w1")
    assert claim_one(store).key == "p"
    store.commit(UnitOfWork(records=[(record(1), "p")], completions=[
        Completion("p", RequestState.DONE, validators=VALIDATORS)]), "w1")
    store.end_session("w1", "finished")
