"""Adaptive revisits over simulated rounds, and the size of the pages kept for them.

Rounds (the store alone, no Scrapy, no network: ``tests/helpers/revisit_rounds.py``): a site
of one listing page linking ``--products`` product pages, crawled once a day for
``--rounds`` days on a clock moved by the script, with ``IDEMPOTENT_ADAPTIVE_REVISIT``'s rule
(intervals from ``--min-days`` to ``--max-days``). A tenth of the products change every day,
half never, the others each day with a 2% chance. Prints per round: pages changed, requests
sent (200 and 304 answers), pages not due (no request), changes found and how many rounds
late the latest found was; then the requests of the last 20 rounds against the pages they
changed, and the latest any change was found.

Size (``--size N``): N pages kept as a shop's crawl keeps them (listing pages of 99
products each: a listing's row holds the keys of its 99 links, ``linked_requests`` the
requests, a product's row its one record ID), then the bytes of the ``page_validators`` and
``linked_requests`` tables and their indexes per page: SQLite's ``dbstat``, PostgreSQL's
``pg_total_relation_size``.

    python benchmarks/revisits.py [--products 1000] [--rounds 80] [--postgres]
    python benchmarks/revisits.py --size 100000 [--postgres]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))

from helpers.revisit_rounds import simulate_rounds  # noqa: E402
from scrapy_idempotent.store import (  # noqa: E402
    Completion,
    FrontierStore,
    NewRequest,
    Record,
    RequestState,
    UnitOfWork,
    open_store,
)
from scrapy_idempotent.store.base import PageValidators, RevisitBounds  # noqa: E402

DAY = 86400.0


def changes(n: int, number: int) -> bool:
    """A tenth of the products change every round, half never, the rest now and then."""
    if n % 10 == 0:
        return True
    if n % 2 == 1:
        return False
    return random.Random(n * 1000 + number).random() < 0.02


@contextmanager
def database(postgres: bool) -> Iterator[str]:
    if not postgres:
        with tempfile.TemporaryDirectory(prefix="idempotent-revisits-") as tmp:
            yield str(Path(tmp) / "revisits.sqlite3")
        return
    from postgres_server import INSTALL_HINT, find_binaries, running_cluster

    bindir = find_binaries()
    if bindir is None:
        raise SystemExit(INSTALL_HINT)
    with running_cluster(bindir) as cluster:
        yield cluster.new_database()


def rounds(args: argparse.Namespace, db: str) -> None:
    now = [0.0]
    options = ({"heartbeat_seconds": None, "dead_after_seconds": None}
               if db.startswith("postgresql") else {})

    def store_of() -> FrontierStore:
        store = open_store(db, clock=lambda: now[0], **options)
        store.open(fingerprinter="f")
        return store

    started = time.monotonic()
    results = simulate_rounds(store_of, lambda t: now.__setitem__(0, t), products=args.products,
                              rounds=args.rounds, round_seconds=DAY,
                              bounds=RevisitBounds(args.min_days * DAY, args.max_days * DAY),
                              changes=changes)
    print("round changed requests   200   304 not_due found latest_late")
    for r in results:
        print(f"{r.number:5d} {r.changed:7d} {r.requests:8d} {r.full:5d} {r.not_modified:5d}"
              f" {r.not_due:7d} {r.detected:5d} {max(r.late, default=0):11d}")
    last = results[-20:]
    requests, changed = sum(r.requests for r in last), sum(r.changed for r in last)
    worst = max(r.requests / r.changed for r in last if r.changed)
    print(f"last 20 rounds: {requests} requests for {changed} pages changed"
          f" ({requests / changed:.2f}x; the worst round {worst:.2f}x);"
          f" without adaptive revisits: {sum(args.products + 1 for _ in last)}")
    print(f"latest change found: {max(d for r in results for d in r.late)} rounds after it"
          f" (the longest interval: {args.max_days:g} days);"
          f" {time.monotonic() - started:.1f} s")


def size(args: argparse.Namespace, db: str) -> None:
    postgres = db.startswith("postgresql")
    store = open_store(db, **({"heartbeat_seconds": None, "dead_after_seconds": None}
                              if postgres else {}))
    store.open(fingerprinter="f")
    store.load_validators_with_claims(True, revisit=RevisitBounds(DAY, 30 * DAY))
    store.begin_session("size", "auto")
    listings = max(1, args.size // 100)
    per_listing = 99
    store.commit(UnitOfWork(requests=[
        NewRequest(key=f"l{n:039x}", fingerprint=f"l{n:039x}",
                   url=f"https://shop.example/list/{n}.html", priority=0,
                   data=f'{{"url":"https://shop.example/list/{n}.html"}}', parent_key=None,
                   is_start=True) for n in range(listings)]), "size")
    valid = PageValidators('"6752e0a1-1f40"', "Sun, 06 Dec 2026 10:00:00 GMT", "ab" * 32,
                           body_bytes=8000)
    started = time.monotonic()
    while leased := store.commit(UnitOfWork(claim=256), "size").leased:
        completions, records, requests = [], [], []
        for page in leased:
            links: list[NewRequest] = []
            if page.key.startswith("l"):
                base = int(page.key[1:], 16) * per_listing
                links = [NewRequest(
                    key=f"p{base + i:039x}", fingerprint=f"p{base + i:039x}",
                    url=f"https://shop.example/product/SKU-{base + i:07d}.html", priority=0,
                    data=f'{{"url":"https://shop.example/product/SKU-{base + i:07d}.html",'
                         '"callback":"parse_product"}', parent_key=page.key)
                    for i in range(per_listing)]
                requests += links
            else:
                sku = f"SKU-{int(page.key[1:], 16):07d}"
                records.append((Record(
                    record_id=f"{hash(sku) & (2**128 - 1):032x}", source="shop",
                    natural_key=f'["{sku}"]', item_type="Product",
                    data=f'{{"sku":"{sku}","price":100}}', content_hash="cd" * 32), page.key))
            completions.append(Completion(page.key, RequestState.DONE, validators=valid,
                                          links=tuple(r.key for r in links)))
        store.commit(UnitOfWork(completions=completions, records=records, requests=requests),
                     "size")
    store.end_session("size", "finished")
    pages = store.revisits()
    assert pages is not None
    kept = pages.pages
    if postgres:
        [(table,)] = store._select(  # type: ignore[attr-defined]
            "SELECT pg_total_relation_size('page_validators')"
            " + pg_total_relation_size('linked_requests')")
        [(heap,)] = store._select(  # type: ignore[attr-defined]
            "SELECT pg_relation_size('page_validators')")
        [(toast,)] = store._select(  # type: ignore[attr-defined]
            "SELECT coalesce(pg_total_relation_size(reltoastrelid), 0) FROM pg_class"
            " WHERE oid = 'page_validators'::regclass")
        detail = f"heap {heap / kept:.0f} B, TOAST {toast / kept:.0f} B per page"
    else:
        [(table,)] = store._select(  # type: ignore[attr-defined]
            "SELECT sum(pgsize) FROM dbstat"
            " WHERE name IN ('page_validators', 'linked_requests')")
        detail = "two WITHOUT ROWID b-trees"
    [(children,)] = store._select(  # type: ignore[attr-defined]
        "SELECT sum(length(links)) + sum(length(record_ids)) FROM page_validators")
    store.close()
    print(f"{'PostgreSQL' if postgres else 'SQLite'}: {kept} pages kept"
          f" ({listings} listings of {per_listing} products) in"
          f" {time.monotonic() - started:.0f} s; page_validators and linked_requests"
          f" {table / 2**20:.1f} MiB, {table / kept:.0f} B per page ({detail}); the pages'"
          f" record IDs and links {children / kept:.0f} B per page")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--products", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--min-days", type=float, default=1.0)
    parser.add_argument("--max-days", type=float, default=32.0)
    parser.add_argument("--size", type=int, default=0,
                        help="measure the size of this many pages kept instead")
    parser.add_argument("--postgres", action="store_true",
                        help="on a throwaway PostgreSQL cluster (tests/postgres_server.py)")
    args = parser.parse_args()
    with database(args.postgres) as db:
        (size if args.size else rounds)(args, db)


if __name__ == "__main__":
    main()
