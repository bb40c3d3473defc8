"""Record upsert micro-benchmark: what marking a record "seen in this run" costs.

    python benchmarks/records.py [--records 100000] [--per-txn 1,10] [--repeat 3]

A run's feeds hold the records it inserted, updated or saw unchanged, so the page transaction
writes an unchanged record once per run (``seen_run_id`` and its place in the run), where it
used to only read it. For each batch size B (records per transaction, as one page's items),
in a new database, ``SQLiteStore.commit`` is timed for N records:

    inserted                  run 1, N new records
    unchanged, first in run   run 2, the same N records, same content (read + one write each)
    unchanged, again in run   run 2 again, the same observation time (read only)
    unchanged, observed later run 2 again, observed later (a read and one write each: the
                              observation time moves forward, so older data stays refused)
    feed read                 ``run_records(2)``: the N records of run 2, streamed

and the report gives microseconds per record (the best of ``--repeat`` databases).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

WORKER = "bench-host:1:1"


def _records(n: int, observed_at: float = 1.0) -> list[tuple[object, None]]:
    from scrapy_idempotent.store.base import Record

    out = []
    for i in range(n):
        data = {"sku": f"SKU-{i:08d}", "name": f"Product number {i}", "price": f"{i % 997}.99",
                "url": f"http://127.0.0.1:8080/product/SKU-{i:08d}",
                "description": "lorem ipsum dolor sit amet " * 6}
        text = json.dumps(data, separators=(",", ":"))
        out.append((Record(record_id=hashlib.sha256(str(i).encode()).hexdigest()[:32],
                           source="bench", natural_key=json.dumps([data["sku"]]),
                           item_type="bench.Product", data=text,
                           content_hash=hashlib.sha256(text.encode()).hexdigest(),
                           observed_at=observed_at), None))
    return out


def _measure(n: int, per_txn: int, db: Path) -> dict[str, float]:
    from scrapy_idempotent.store import SQLiteStore
    from scrapy_idempotent.store.base import UnitOfWork

    records = _records(n)
    store = SQLiteStore(str(db))
    store.open(fingerprinter="benchmarks.records")
    result: dict[str, float] = {}

    def timed(name: str) -> None:
        t0 = time.perf_counter()
        for start in range(0, n, per_txn):
            store.commit(UnitOfWork(records=records[start:start + per_txn]), WORKER)  # type: ignore[arg-type]
        result[name] = (time.perf_counter() - t0) / n * 1e6

    store.begin_session(WORKER, "fresh")
    timed("inserted")
    store.begin_session(WORKER, "fresh")
    timed("unchanged, first in run")
    timed("unchanged, again in run")
    records = _records(n, observed_at=2.0)
    timed("unchanged, observed later")
    t0 = time.perf_counter()
    count = sum(1 for _ in store.run_records(2))
    result["feed read"] = (time.perf_counter() - t0) / n * 1e6
    assert count == n
    store.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--per-txn", default="1,10")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    batches = [int(b) for b in args.per_txn.split(",")]
    best: dict[int, dict[str, float]] = {}
    for per_txn in batches:
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                got = _measure(args.records, per_txn, Path(tmp) / "bench.sqlite3")
            best[per_txn] = {k: min(v, best.get(per_txn, {}).get(k, v)) for k, v in got.items()}
    names = list(next(iter(best.values())))
    print(f"{args.records} records, microseconds per record (best of {args.repeat})")
    print("| operation | " + " | ".join(f"{b} per transaction" for b in batches) + " |")
    print("|---|" + "---:|" * len(batches))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{best[b][name]:.1f}" for b in batches) + " |")
    for b in batches:
        extra = best[b]["unchanged, first in run"] - best[b]["unchanged, again in run"]
        print(f"seen-in-run write, {b} per transaction: {extra:+.1f} us per unchanged record "
              "(first sight in a run only)")
        later = best[b]["unchanged, observed later"] - best[b]["unchanged, again in run"]
        print(f"observation-time write, {b} per transaction: {later:+.1f} us per unchanged record "
              "(seen again, observed later)")


if __name__ == "__main__":
    main()
