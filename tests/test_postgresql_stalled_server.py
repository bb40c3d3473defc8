"""A PostgreSQL server that stops answering without closing the connection (a paused machine
or container, packets dropped on the way): the reactor's reads are made by the store's reader
thread, so the reactor gets StoreBusy within the read deadline instead of waiting for the
server, and reads are answered again once it answers. The server's processes are stopped
with SIGSTOP and continued with SIGCONT."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest

from crawling import wait_for
from scrapy_idempotent.exceptions import StoreBusy

psycopg = pytest.importorskip("psycopg")
from scrapy_idempotent.store.postgresql import APPLICATION, PostgreSQLStore  # noqa: E402


def store_processes(url: str) -> list[int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [pid for (pid,) in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (APPLICATION,))]


def test_the_reactors_reads_do_not_wait_for_a_server_that_stopped_answering(
        postgres_url: str) -> None:
    store = PostgreSQLStore(postgres_url, heartbeat_seconds=None, dead_after_seconds=None)
    store.open()
    answers: list[Any] = []
    asked = threading.Event()
    marked = threading.Event()

    def reactor_like() -> None:
        store.counts()  # connected, as the reactor is after the store's open
        store.never_wait_here()
        answers.append(store.known_request("f" * 40))  # the reader's connection is opened
        marked.set()
        asked.wait()
        for _ in range(2):
            try:
                answers.append(store.known_request("f" * 40))
            except StoreBusy as exc:
                answers.append(exc)

    thread = threading.Thread(target=reactor_like, daemon=True)
    thread.start()
    assert marked.wait(60)
    stopped = store_processes(postgres_url)
    assert stopped  # the store's server processes, the reader's included
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        asked.set()
        thread.join(120)  # bounded by the read deadline; 120 only if the fix is missing
        assert not thread.is_alive(), "a read on the reactor's thread waited for the server"
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert answers[0] is None  # not known
    first, second = answers[1:]
    assert isinstance(first, StoreBusy) and "did not answer a read" in str(first)
    assert isinstance(second, StoreBusy) and "has not answered a read" in str(second)

    # once the server answers, so do reads on that thread
    def answered() -> bool:
        result: list[Any] = []

        def ask() -> None:
            store.never_wait_here()
            try:
                result.append(store.known_request("f" * 40))
            except StoreBusy:
                result.append("busy")

        asking = threading.Thread(target=ask)
        asking.start()
        asking.join()
        return result == [None]

    wait_for(answered, 60, "reads answered after the server continued")
    store.close()
