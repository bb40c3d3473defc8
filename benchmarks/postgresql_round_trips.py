"""Round trips of a PostgreSQL page commit: how often the client waits for the server.

    python benchmarks/postgresql_round_trips.py [--pages 100] [--latency-ms 2]

On a throwaway PostgreSQL cluster (the tests' ``tests/postgres_server.py``), a store commits
pages of two shapes: what the scheduler commits per page (1 completion + 8 new child
requests + a claim of 1), and the same with 4 new records. For each shape it reports

* **waits per page**: counted in libpq's protocol trace of the store's connection (each Sync
  or Flush the client sends, or simple Query, is a wait for the server; a Flush right after a
  Sync is the same wait): exact, whatever the machine's load;
* **ms per page** straight to the server (loopback), and through a TCP proxy that delays
  every byte from the client by ``--latency-ms`` (a delay line: a burst of statements costs
  the delay once), as a network between worker and database would; the difference divided
  by the delay is the waits again, measured as time.

The package is imported from the environment: ``PYTHONPATH=/path/to/copy`` measures a copy
(an earlier commit, for a before/after comparison).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import queue
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
SHAPES = {"1 completion + 8 children + claim 1": 0, "the same + 4 new records": 4}


class DelayLine:
    """A TCP proxy to 127.0.0.1:``port`` delaying the client's bytes by ``delay`` seconds."""

    def __init__(self, port: int, delay: float) -> None:
        self.target = ("127.0.0.1", port)
        self.delay = delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            line: queue.Queue[tuple[float, bytes]] = queue.Queue()
            threading.Thread(target=self._receive, args=(client, line), daemon=True).start()
            threading.Thread(target=self._send_later, args=(line, server), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client), daemon=True).start()

    def _receive(self, sock: socket.socket, line: queue.Queue[tuple[float, bytes]]) -> None:
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            line.put((time.monotonic() + self.delay, data))
            if not data:
                return

    @staticmethod
    def _send_later(line: queue.Queue[tuple[float, bytes]], sock: socket.socket) -> None:
        while True:
            due, data = line.get()
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                if not data:
                    sock.close()
                    return
                sock.sendall(data)
            except OSError:
                return

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        while True:
            try:
                data = source.recv(65536)
                if not data:
                    sink.close()
                    return
                sink.sendall(data)
            except OSError:
                return


def _waits(trace: str) -> int:
    sent = [line.split("\t")[3] for line in trace.splitlines() if line.split("\t")[1:2] == ["F"]]
    return sum(1 for n, kind in enumerate(sent)
               if kind in ("Sync", "Query") or (kind == "Flush" and sent[n - 1] != "Sync"))


def _measure(url: str, pages: int, label: str) -> dict[str, tuple[float, float]]:
    """Per shape: (ms per page, waits per page)."""
    from scrapy_idempotent.store.base import (
        Completion,
        NewRequest,
        Record,
        RequestState,
        UnitOfWork,
    )
    from scrapy_idempotent.store.postgresql import PostgreSQLStore

    store: Any = PostgreSQLStore(url + f"?schema=bench_{label}", heartbeat_seconds=None,
                                 dead_after_seconds=None)
    store.open(fingerprinter="benchmarks.round_trips")
    store.begin_session("bench-host:1:1", "fresh")
    counter = 0

    def new() -> NewRequest:
        nonlocal counter
        counter += 1
        key = hashlib.sha1(f"{counter}".encode()).hexdigest()
        return NewRequest(key=key, fingerprint=key, url=f"http://127.0.0.1/p/{counter}.html",
                          priority=0, data="{}")

    store.commit(UnitOfWork(requests=[new() for _ in range(3 * pages * len(SHAPES))]),
                 "bench-host:1:1")
    leased = [r.key for r in store.commit(UnitOfWork(claim=2 * pages * len(SHAPES)),
                                          "bench-host:1:1").leased]
    store.commit(UnitOfWork(started=leased), "bench-host:1:1")

    def page(records: int) -> UnitOfWork:
        key = leased.pop()
        return UnitOfWork(
            completions=[Completion(key, RequestState.DONE)],
            requests=[new() for _ in range(8)], claim=1,
            records=[(Record(record_id=f"{key}-{n}", source="bench", natural_key=f'["{n}"]',
                             item_type="dict", data="{}", content_hash="h"), key)
                     for n in range(records)])

    out: dict[str, tuple[float, float]] = {}
    for shape, records in SHAPES.items():
        start = time.perf_counter()
        for _ in range(pages):
            store.commit(page(records), "bench-host:1:1")
        elapsed = (time.perf_counter() - start) / pages
        with tempfile.TemporaryFile("w+") as trace:
            store.conn.pgconn.trace(trace.fileno())
            store.commit(page(records), "bench-host:1:1")
            store.conn.pgconn.untrace()
            trace.seek(0)
            waits = _waits(trace.read())
        out[shape] = (elapsed * 1000, float(waits))
    store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=100, help="pages per shape and run")
    parser.add_argument("--latency-ms", type=float, default=2.0,
                        help="delay added to the client's bytes in the second run")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent.parent / "tests"))
    from postgres_server import INSTALL_HINT, find_binaries, running_cluster

    bindir = find_binaries()
    if bindir is None:
        sys.exit(INSTALL_HINT)
    import scrapy_idempotent

    with running_cluster(bindir) as cluster:
        url = cluster.new_database()
        direct = _measure(url, args.pages, "direct")
        proxy = DelayLine(cluster.port, args.latency_ms / 1000)
        delayed = _measure(url.replace(f":{cluster.port}/", f":{proxy.port}/"), args.pages,
                           "delayed")
    print(f"PostgreSQLStore from {Path(scrapy_idempotent.__file__).parent}, {args.pages} pages "
          f"per shape, load average {os.getloadavg()[0]:.2f}")
    print(f"| page | waits per page (trace) | ms/page direct | ms/page at "
          f"+{args.latency_ms:g} ms | waits per page (timed) |")
    print("|---|---:|---:|---:|---:|")
    for shape in SHAPES:
        (ms, waits), (slow_ms, _) = direct[shape], delayed[shape]
        print(f"| {shape} | {waits:.0f} | {ms:.2f} | {slow_ms:.2f} | "
              f"{(slow_ms - ms) / args.latency_ms:.1f} |")


if __name__ == "__main__":
    main()
