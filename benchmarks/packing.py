"""What packing a frontier row's request costs and saves (``store/packing.py``).

    python benchmarks/packing.py

* bytes and microseconds: the request of ``depth.py`` (a link with a ``Referer`` and a
  depth) as PostgreSQL's row stores it (without its URL) and as SQLite's does (whole): its
  text and packed size; packing and unpacking it, best of 7 runs of 20,000;
* worker CPU per page: page commits as ``depth.py`` makes them (8 links stored, a
  completion, a claim of 1) on one SQLite store, packing on and off in alternating blocks of
  ``--pages`` (the median of ``--blocks`` blocks each: both under the same load).

The machine's load average is printed before and after. ``PYTHONPATH=/path/to/copy``
measures a copy of the package.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def micro(count: int = 20000) -> None:
    from scrapy_idempotent.store.packing import pack, unpack
    from scrapy_idempotent.store.rules import request_data, stored_request_data

    url = "https://shop7.example.com/product/12345-widget-30.html"
    whole = ('{"url":"' + url + '","callback":"parse","headers":{"Referer":'
             '["https://shop7.example.com/category/345?page=25"]},"meta":{"depth":2}}')
    text = stored_request_data(whole, url)
    packed, packed_whole = pack(text, url), pack(whole, url)
    assert packed is not None and packed_whole is not None

    def best(f: Any) -> float:
        return min(timeit.repeat(f, number=count, repeat=7)) / count * 1e6

    print(f"PostgreSQL: {len(text)} bytes of text, {len(packed)} packed; SQLite: "
          f"{len(whole)} bytes of text, {len(packed_whole)} packed")
    print(f"PostgreSQL store: URL left out {best(lambda: stored_request_data(whole, url)):.2f}"
          f" us, and packed {best(lambda: pack(stored_request_data(whole, url), url)):.2f} us")
    print(f"PostgreSQL read: {best(lambda: request_data(text, url)):.2f} us, unpacked first "
          f"{best(lambda: request_data(unpack(packed, url), url)):.2f} us")
    print(f"SQLite: packed {best(lambda: pack(whole, url)):.2f} us, unpacked "
          f"{best(lambda: unpack(packed_whole, url)):.2f} us")


def pages(blocks: int, per_block: int) -> None:
    import depth

    from scrapy_idempotent.store import (
        Completion,
        RequestState,
        SQLiteStore,
        UnitOfWork,
        sql_dialect,
    )

    real = sql_dialect.pack
    builder = depth.Builder()
    store = SQLiteStore(os.path.join(tempfile.mkdtemp(), "packing.sqlite3"))
    store.open(fingerprinter="f")
    store.begin_session("w", "auto")
    store.commit(UnitOfWork(requests=[builder.request(n) for n in range(1000)]), "w")
    n = 1000
    leased = list(store.commit(UnitOfWork(claim=1), "w").leased)
    cpu: dict[bool, list[float]] = {True: [], False: []}
    try:
        for block in range(2 * blocks):
            on = block % 2 == 0
            sql_dialect.pack = real if on else (lambda text, url: None)  # type: ignore[assignment]
            children = [[builder.request(n + 8 * p + i) for i in range(8)]
                        for p in range(per_block)]
            n += 8 * per_block
            t0 = time.process_time()
            for links in children:
                lease = leased.pop()
                leased.extend(store.commit(UnitOfWork(requests=links, completions=[
                    Completion(lease.key, RequestState.DONE)], claim=1), "w").leased)
            cpu[on].append(1000 * (time.process_time() - t0) / per_block)
    finally:
        sql_dialect.pack = real
        store.close()
    for on in (False, True):
        print(f"packing {'on ' if on else 'off'}: worker CPU {statistics.median(cpu[on]):.3f}"
              f" ms a page (median of {blocks} blocks of {per_block} pages)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--pages", type=int, default=200)
    args = parser.parse_args()
    print("load average before:", os.getloadavg())
    micro()
    pages(args.blocks, args.pages)
    print("load average after:", os.getloadavg())


if __name__ == "__main__":
    main()
