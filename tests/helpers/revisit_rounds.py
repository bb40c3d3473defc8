"""Adaptive revisits over simulated rounds, at the store level (no Scrapy, no network): a
site of one listing page (a start request) linking ``products`` product pages, crawled once
per round on an injected clock, as the crawl's components would crawl it against a site
that answers conditional requests:

* a page claimed whose revisit is not due is completed as unchanged without a request
  (``not_due``, as ``ConditionalRequestMiddleware`` does);
* a page due is a request: answered ``304`` when it did not change since its last fetch,
  else ``200`` with its record at its new version.

Which pages change in which round is the caller's (``changes(page, round)``). Used by
``tests/test_revisits.py`` and ``benchmarks/revisits.py``; nothing is asserted here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from scrapy_idempotent.store import (
    Completion,
    FrontierStore,
    NewRequest,
    Record,
    RequestState,
    UnitOfWork,
)
from scrapy_idempotent.store.base import PageValidators, RevisitBounds

#: the size of a product page's body (bytes), for the bytes saved
BODY_BYTES = 8000


@dataclass
class Round:
    """One simulated round (one run): what the site changed and what the crawl did."""

    number: int
    changed: int  #: product pages the site changed before this round
    requests: int = 0  #: requests sent (answered 200 or 304)
    full: int = 0  #: answered 200 (downloaded in full)
    not_modified: int = 0  #: answered 304
    not_due: int = 0  #: not sent: their revisit was not due
    detected: int = 0  #: changes found (a changed page downloaded in full)
    #: per change found in this round, how many rounds after it happened
    late: list[int] = field(default_factory=list)
    records_updated: int = 0


def _product(n: int) -> str:
    return f"p{n:06d}"


def _record(n: int, version: int) -> Record:
    return Record(record_id=f"r{n:06d}", source="shop", natural_key=f'["{n}"]',
                  item_type="Product", data=f'{{"sku": {n}, "version": {version}}}',
                  content_hash=f"h{n}-{version}")


def _validators(version: int) -> PageValidators:
    return PageValidators(f'"v{version}"', None, f"{version:064x}", body_bytes=BODY_BYTES)


def simulate_rounds(store_of: Callable[[], FrontierStore], set_clock: Callable[[float], None],
                    *, products: int, rounds: int, round_seconds: float,
                    bounds: RevisitBounds, changes: Callable[[int, int], bool],
                    batch: int = 64, start: float = 1_000_000.0) -> list[Round]:
    """Crawl the site ``rounds`` times, one run per round, ``round_seconds`` apart on the
    clock ``set_clock`` sets; the site changes product ``n`` before round ``r`` when
    ``changes(n, r)`` (round 0 is the first crawl: nothing is known yet). ``store_of``
    opens the store (each round a new store, as each scheduled crawl is a new process)."""
    version = [0] * products  # the site's version of each product page
    fetched = [-1] * products  # the version each product page was last fetched at
    changed_at: list[int | None] = [None] * products  # the round of the oldest change unseen
    results: list[Round] = []
    for number in range(rounds):
        set_clock(start + number * round_seconds)
        changed = 0
        if number:
            for n in range(products):
                if changes(n, number):
                    version[n] += 1
                    changed += 1
                    if changed_at[n] is None:
                        changed_at[n] = number
        result = Round(number, changed)
        store = store_of()
        store.load_validators_with_claims(True, revisit=bounds)
        store.begin_session("sim", "auto")
        store.commit(UnitOfWork(requests=[NewRequest(
            key="list", fingerprint="list", url="https://shop.example/list", priority=0,
            data='{"url": "list"}', parent_key=None, is_start=True)]), "sim")
        while True:
            leased = store.commit(UnitOfWork(claim=batch), "sim").leased
            if not leased:
                break
            completions: list[Completion] = []
            records: list[tuple[Record, str | None]] = []
            requests: list[NewRequest] = []
            for page in leased:
                valid = page.validators
                if valid is not None and not valid.due:
                    result.not_due += 1
                    completions.append(Completion(page.key, RequestState.DONE,
                                                  not_modified=True, not_due=True))
                    continue
                result.requests += 1
                if page.key == "list":
                    if valid is not None:
                        result.not_modified += 1
                        completions.append(Completion(page.key, RequestState.DONE,
                                                      not_modified=True))
                        continue
                    result.full += 1
                    requests = [NewRequest(key=_product(n), fingerprint=_product(n),
                                           url=f"https://shop.example/{_product(n)}",
                                           priority=0, data=f'{{"n": {n}}}',
                                           parent_key="list") for n in range(products)]
                    completions.append(Completion(page.key, RequestState.DONE,
                                                  validators=PageValidators('"l"', None, "0")))
                    continue
                n = int(page.key[1:])
                if valid is not None and fetched[n] == version[n]:
                    result.not_modified += 1
                    completions.append(Completion(page.key, RequestState.DONE,
                                                  not_modified=True))
                    continue
                result.full += 1
                if fetched[n] >= 0 and changed_at[n] is not None:
                    result.detected += 1
                    result.late.append(number - changed_at[n])
                changed_at[n] = None
                fetched[n] = version[n]
                records.append((_record(n, version[n]), page.key))
                completions.append(Completion(page.key, RequestState.DONE,
                                              validators=_validators(version[n])))
            result.records_updated += store.commit(UnitOfWork(
                completions=completions, records=records, requests=requests),
                "sim").records_updated
        store.end_session("sim", "finished")
        store.close()
        results.append(result)
    return results
