"""What keeping every link of a page costs (``IDEMPOTENT_CONDITIONAL_REQUESTS``).

The store alone (no Scrapy, no network), on SQLite or PostgreSQL (``--postgres``): a first
listing page adds ``--seed`` products, then ``--pages`` listing pages each link ``--links``
products of which ``--new`` are new (the page adds them) and the others known already (added
by an earlier page: refused as duplicates, kept among the page's links only). Then a second
run in which every listing page answers ``304``, each enqueuing every product it links
again. Prints, for conditional requests off and on:

* the bytes the crawl keeps for them per listing page (after the first): ``page_validators``
  and ``linked_requests`` (SQLite's ``dbstat``, PostgreSQL's ``pg_total_relation_size``);
* the time of a listing page's commit in the first run (median and 90th percentile);
* the time of a listing page's ``304`` commit in the second run.

``--package PATH`` measures another copy of the package (one without ``links``: only the
pages' own additions are kept).

    python benchmarks/links.py [--pages 500] [--links 100] [--new 5] [--postgres]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
for i, arg in enumerate(sys.argv):
    if arg == "--package" and i + 1 < len(sys.argv):
        sys.path.insert(0, sys.argv[i + 1])
        break
else:
    sys.path.insert(0, str(HERE.parent))

from scrapy_idempotent.store import (  # noqa: E402
    Completion,
    FrontierStore,
    NewRequest,
    RequestState,
    UnitOfWork,
    open_store,
)
from scrapy_idempotent.store.base import PageValidators  # noqa: E402

_path = list(sys.path)  # (revisits.py puts its own copy first: after this one is imported)
from revisits import database  # noqa: E402

sys.path[:] = _path

WORKER = "links"
VALIDATORS = PageValidators('"6752e0a1-1f40"', "Sun, 06 Dec 2026 10:00:00 GMT", "ab" * 32,
                            body_bytes=20000)
#: whether this copy of the package keeps every link (else: only what a page added)
KEEPS_LINKS = "links" in Completion.__dataclass_fields__


def key(kind: str, n: int) -> str:
    return f"{kind}{n:039x}"


def product(n: int, parent: str) -> NewRequest:
    url = f"https://shop.example/product/SKU-{n:07d}.html"
    return NewRequest(key=key("b", n), fingerprint=key("b", n), url=url, priority=0,
                      data=f'{{"url":"{url}","callback":"parse_product","meta":{{"depth":1}},'
                           '"encoding":"utf-8"}', parent_key=parent, slot="shop.example")


def listing(n: int) -> NewRequest:
    url = f"https://shop.example/list/{n}.html"
    return NewRequest(key=key("a", n), fingerprint=key("a", n), url=url, priority=1,
                      data=f'{{"url":"{url}"}}', is_start=True, slot="shop.example")


def done(page: str, links: list[str], conditional: bool) -> Completion:
    if not conditional:
        return Completion(page, RequestState.DONE)
    if KEEPS_LINKS:
        return Completion(page, RequestState.DONE, validators=VALIDATORS, links=tuple(links))
    return Completion(page, RequestState.DONE, validators=VALIDATORS)


def claim(store: FrontierStore, page: str) -> None:
    (leased,) = store.commit(UnitOfWork(claim=1), WORKER).leased
    assert leased.key == page, (leased.key, page)
    store.commit(UnitOfWork(started=[page]), WORKER)


def run(db: str, args: argparse.Namespace, conditional: bool) -> str:
    postgres = db.startswith("postgresql")
    store = open_store(db, **({"heartbeat_seconds": None, "dead_after_seconds": None}
                              if postgres else {}))
    store.open(fingerprinter="f")
    store.load_validators_with_claims(conditional)
    store.begin_session(WORKER, "auto")
    rng = random.Random(7)
    pages = args.pages + 1
    added = 0
    commits: list[float] = []
    seeded = 0
    for n in range(pages):
        page = key("a", n)
        store.commit(UnitOfWork(requests=[listing(n)]), WORKER)
        claim(store, page)
        fresh = args.seed if n == 0 else args.new
        new = [product(added + i, page) for i in range(fresh)]
        known = [key("b", m) for m in rng.sample(range(added), args.links - fresh)] \
            if n else []
        added += fresh
        links = [r.key for r in new] + known
        rng.shuffle(links)
        started = time.perf_counter()
        store.commit(UnitOfWork(requests=new, completions=[done(page, links, conditional)]),
                     WORKER)
        if n:
            commits.append(time.perf_counter() - started)
        else:
            seeded = kept_bytes(store, postgres)
    # the products themselves are not fetched: the second run starts over the listings
    store.end_session(WORKER, "finished")
    size = kept_bytes(store, postgres) - seeded  # (the listing pages after the first)
    relinks: list[float] = []
    if conditional:
        store.begin_session(WORKER, "fresh")
        for n in range(1, pages):
            store.commit(UnitOfWork(requests=[listing(n)]), WORKER)
            claim(store, key("a", n))
            started = time.perf_counter()
            store.commit(UnitOfWork(completions=[
                Completion(key("a", n), RequestState.DONE, not_modified=True)]), WORKER)
            relinks.append(time.perf_counter() - started)
    store.close()
    line = (f"conditional {'on ' if conditional else 'off'}: kept {size / args.pages:6.0f} B per"
            f" listing page; a listing page's commit {ms(commits)}")
    if relinks:
        line += f"; its 304 {ms(relinks)}"
    return line


def ms(times: list[float]) -> str:
    ordered = sorted(times)
    return (f"{statistics.median(ordered) * 1000:.2f} ms median,"
            f" {ordered[int(len(ordered) * 0.9)] * 1000:.2f} ms p90")


def kept_bytes(store: FrontierStore, postgres: bool) -> int:
    tables = ["page_validators"] + (["linked_requests"] if KEEPS_LINKS else [])
    total = 0
    for table in tables:
        if postgres:
            [(size,)] = store._select(  # type: ignore[attr-defined]
                f"SELECT pg_total_relation_size('{table}')")
        else:
            [(size,)] = store._select(  # type: ignore[attr-defined]
                f"SELECT coalesce(sum(pgsize), 0) FROM dbstat WHERE name = '{table}'")
        total += int(size)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=500)
    parser.add_argument("--links", type=int, default=100)
    parser.add_argument("--new", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--postgres", action="store_true",
                        help="on a throwaway PostgreSQL cluster (tests/postgres_server.py)")
    parser.add_argument("--package", help="measure the package found at this path")
    args = parser.parse_args()
    print(f"{args.pages} listing pages of {args.links} links, {args.new} of them new;"
          f" {'PostgreSQL' if args.postgres else 'SQLite'};"
          f" {'every link kept' if KEEPS_LINKS else 'the links a page added kept'}")
    for conditional in (False, True):
        with database(args.postgres) as db:
            print(run(db, args, conditional))


if __name__ == "__main__":
    main()
