"""The store writer (scrapy_idempotent.writer) against a real store of each backend: group
commit, order of writes, errors, drain and stop; the reactor keeps running while the writer
waits for another process's lock on a SQLite file."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from scrapy.utils.defer import deferred_f_from_coro_f, maybe_deferred_to_future
from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred

from helpers.stored import change_stored, frontier_entries
from scrapy_idempotent.commits import retry_busy
from scrapy_idempotent.exceptions import StoreBusy, StoreError
from scrapy_idempotent.store.base import (
    CommitResult,
    Completion,
    FrontierStore,
    NewRequest,
    Record,
    RequestState,
    UnitOfWork,
)
from scrapy_idempotent.store.sqlite import SQLiteStore
from scrapy_idempotent.writer import WriterThread, merge_work

reactor: Any = _reactor
WORKER = "host:1:1"


def new(i: int, parent: str | None = None) -> NewRequest:
    return NewRequest(key=f"k{i}", fingerprint=f"k{i}", url=f"http://example.com/{i}",
                      priority=0, data="{}", parent_key=parent)


def open_store(store_factory: Callable[..., FrontierStore], **kwargs: Any) -> FrontierStore:
    """A store of the test's backend (``store_factory``), opened for :data:`WORKER`."""
    store = store_factory(**kwargs)
    store.open(fingerprinter="f")
    store.begin_session(WORKER, "auto")
    return store


def open_sqlite_store(path: Path, **kwargs: Any) -> SQLiteStore:
    store = SQLiteStore(str(path), **kwargs)
    store.open(fingerprinter="f")
    store.begin_session(WORKER, "auto")
    return store


def stored_states(database: str) -> list[tuple[str, str]]:
    """(key, state) of every frontier request, in key order."""
    return [(entry.key, entry.state) for entry in frontier_entries(database)]


async def turn() -> None:
    """One reactor turn."""
    d: Deferred[None] = Deferred()
    reactor.callLater(0, d.callback, None)
    await maybe_deferred_to_future(d)


class Recorder:
    def __init__(self) -> None:
        self.committed: list[tuple[UnitOfWork, CommitResult]] = []
        self.failed: list[tuple[UnitOfWork, BaseException]] = []
        self.threads: set[str] = set()

    def on_committed(self, work: UnitOfWork, result: CommitResult) -> None:
        self.threads.add(threading.current_thread().name)
        self.committed.append((work, result))

    def on_failed(self, work: UnitOfWork, exc: BaseException) -> None:
        self.failed.append((work, exc))


def make_writer(store: FrontierStore, recorder: Recorder, **kwargs: Any) -> WriterThread:
    writer = WriterThread(store, WORKER, committed=recorder.on_committed,
                         failed=recorder.on_failed, **kwargs)
    writer.start()
    return writer


async def block(writer: WriterThread) -> threading.Event:
    """Keep the writer's thread busy until the returned event is set."""
    release = threading.Event()
    started = threading.Event()

    def wait(store: Any) -> None:
        started.set()
        release.wait()

    writer.call("blocking", wait)
    while not started.is_set():
        await turn()
    return release


@deferred_f_from_coro_f
async def test_pages_of_one_turn_are_one_transaction(
        store_factory: Callable[..., FrontierStore], store_database: str) -> None:
    store = open_store(store_factory)
    recorder = Recorder()
    writer = make_writer(store, recorder)
    try:
        first = await maybe_deferred_to_future(writer.call(
            "seeding", lambda s: s.commit(UnitOfWork(requests=[new(1), new(2), new(3)],
                                                     claim=3), WORKER)))
        assert [r.key for r in first.leased] == ["k3", "k2", "k1"]
        before = store.transactions
        seqs = {writer.commit(UnitOfWork(requests=[new(10 + i, parent=f"k{i}")],
                                         completions=[Completion(f"k{i}", RequestState.DONE)]))
                for i in (1, 2, 3)}
        assert len(seqs) == 1  # one batch
        waiting = writer.durable(seqs.pop())
        assert waiting is not None
        await maybe_deferred_to_future(waiting)
        assert store.transactions == before + 1
        assert len(recorder.committed) == 1
        work, result = recorder.committed[0]
        assert [c.key for c in work.completions] == ["k1", "k2", "k3"]
        assert result.completed == {"done": 3} and result.requests_added == 3
        # the reactor thread got the result
        assert recorder.threads == {threading.current_thread().name}
        assert writer.pages == 3 and writer.batches == 1
    finally:
        await maybe_deferred_to_future(writer.drain())
        writer.stop()
        store.close()
    assert stored_states(store_database) == [
        ("k1", "done"), ("k11", "pending"), ("k12", "pending"), ("k13", "pending"),
        ("k2", "done"), ("k3", "done")]


@deferred_f_from_coro_f
async def test_work_arriving_while_a_batch_is_in_flight_rides_on_the_next_one(
        store_factory: Callable[..., FrontierStore]) -> None:
    store = open_store(store_factory)
    recorder = Recorder()
    writer = make_writer(store, recorder)
    try:
        release = await block(writer)
        writer.commit(UnitOfWork(requests=[new(1)]))
        await turn()  # the first batch is sent (it waits behind the blocking call)
        assert writer.open_seq == 2
        later = [writer.commit(UnitOfWork(requests=[new(i)])) for i in (2, 3, 4)]
        for _ in range(3):
            await turn()
        assert later == [2, 2, 2]
        assert writer.open_seq == 2  # not sent: one batch in flight at a time
        before = store.transactions
        release.set()
        waiting = writer.durable(2)
        assert waiting is not None
        await maybe_deferred_to_future(waiting)
        assert store.transactions == before + 2  # the first batch and one for the three
        assert [len(work.requests) for work, _ in recorder.committed] == [1, 3]
        assert writer.durable(1) is None and writer.durable(2) is None
    finally:
        await maybe_deferred_to_future(writer.drain())
        writer.stop()
        store.close()


@deferred_f_from_coro_f
async def test_prepare_adds_to_the_batch_and_an_empty_batch_writes_nothing(
        store_factory: Callable[..., FrontierStore]) -> None:
    store = open_store(store_factory)
    recorder = Recorder()
    buffered: list[NewRequest] = []

    def prepare(work: UnitOfWork, seq: int) -> None:
        work.requests.extend(buffered)
        buffered.clear()

    writer = WriterThread(store, WORKER, prepare=prepare, committed=recorder.on_committed)
    writer.start()
    try:
        before = store.transactions
        seq = writer.commit()
        await maybe_deferred_to_future(writer.drain())
        assert writer.durable(seq) is None
        assert store.transactions == before and recorder.committed == []
        buffered.append(new(1))
        writer.commit()
        await maybe_deferred_to_future(writer.drain())
        assert store.transactions == before + 1
        assert [r.key for r in recorder.committed[0][0].requests] == ["k1"]
    finally:
        writer.stop()
        store.close()


@deferred_f_from_coro_f
async def test_calls_run_in_order_with_the_batches(
        store_factory: Callable[..., FrontierStore]) -> None:
    store = open_store(store_factory, lease_seconds=60)
    recorder = Recorder()
    writer = make_writer(store, recorder)
    try:
        writer.commit(UnitOfWork(requests=[new(1), new(2)], claim=2))
        await turn()  # sent
        renewed = await maybe_deferred_to_future(
            writer.call("renewing leases", lambda s: s.renew_leases(WORKER)))
        # the renewal ran after the batch that claimed the leases
        assert sorted(renewed) == ["k1", "k2"]
        assert len(recorder.committed) == 1
    finally:
        await maybe_deferred_to_future(writer.drain())
        writer.stop()
        store.close()


@deferred_f_from_coro_f
async def test_a_busy_database_is_waited_for_on_the_writer_thread_while_the_reactor_runs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # SQLite only: a SQLite file's write lock held by another process
    path = tmp_path / "db.sqlite3"
    store = open_sqlite_store(path, busy_timeout_seconds=0.05)
    recorder = Recorder()
    # a lock held by another process (sqlite3 in a subprocess), released on our word
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sqlite3, sys\n"
         f"c = sqlite3.connect({str(path)!r}, isolation_level=None)\n"
         "c.execute('BEGIN IMMEDIATE')\n"
         "print('locked', flush=True)\n"
         "sys.stdin.readline()\n"
         "c.execute('ROLLBACK')\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    writer = make_writer(store, recorder, attempts=1000)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "locked"
        caplog.set_level(logging.WARNING, logger="scrapy_idempotent.writer")
        seq = writer.commit(UnitOfWork(requests=[new(1)]))
        turns = 0
        # the reactor keeps turning while the writer retries the locked database
        while sum("database busy" in r.getMessage() for r in caplog.records) < 3:
            await turn()
            turns += 1
        assert turns >= 1 and recorder.committed == []
        # reads on the read connection do not wait for the lock either
        assert store.counts()["pending"] == 0
        holder.stdin.write("\n")
        holder.stdin.flush()
        waiting = writer.durable(seq)
        assert waiting is not None
        await maybe_deferred_to_future(waiting)
        assert len(recorder.committed) == 1 and recorder.failed == []
        assert store.counts()["pending"] == 1
    finally:
        if holder.stdin is not None:
            if holder.poll() is None:
                holder.stdin.write("\n")
            holder.stdin.close()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
        await maybe_deferred_to_future(writer.drain())
        writer.stop()
        store.close()


@deferred_f_from_coro_f
async def test_an_error_fails_the_batch_releases_waiters_and_stops_writing(
        store_factory: Callable[..., FrontierStore], store_database: str) -> None:
    store = open_store(store_factory)
    recorder = Recorder()
    writer = make_writer(store, recorder)
    try:
        release = await block(writer)
        good = writer.commit(UnitOfWork(requests=[new(1)]))
        await turn()  # sent: it waits behind the blocking call
        # the records table is gone by the time the next batch runs: not a busy database,
        # so not retried
        change_stored(store_database, "DROP TABLE records")
        release.set()
        waiting = writer.durable(good)
        assert waiting is not None
        await maybe_deferred_to_future(waiting)
        assert len(recorder.committed) == 1
        record = Record(record_id="r" * 32, source="s", natural_key="[]", item_type="dict",
                        data="{}", content_hash="h")
        bad = writer.commit(UnitOfWork(requests=[new(2)], records=[(record, None)]))
        waiting = writer.durable(bad)
        assert waiting is not None
        await maybe_deferred_to_future(waiting)  # released, although nothing was written
        assert len(recorder.failed) == 1
        assert isinstance(recorder.failed[0][1], StoreError)
        assert "schema" in str(recorder.failed[0][1])
        assert isinstance(writer.error, StoreError)
        # nothing more is written, and nobody waits for it
        after = writer.commit(UnitOfWork(requests=[new(3)]))
        await maybe_deferred_to_future(writer.drain())
        assert writer.durable(after) is None
        assert len(recorder.failed) == 1 and len(recorder.committed) == 1
    finally:
        await maybe_deferred_to_future(writer.drain())
        writer.stop()
        store.close()
    assert [key for key, _ in stored_states(store_database)] == ["k1"]


@deferred_f_from_coro_f
async def test_drain_then_stop_gives_the_connection_back(
        store_factory: Callable[..., FrontierStore]) -> None:
    def writer_threads() -> int:
        return sum(t.name == "scrapy_idempotent-writer" for t in threading.enumerate())

    store = open_store(store_factory)
    before = writer_threads()
    writer = make_writer(store, Recorder())
    assert writer_threads() == before + 1
    writer.commit(UnitOfWork(requests=[new(1)]))
    writer.call("renewing leases", lambda s: s.renew_leases(WORKER))
    await maybe_deferred_to_future(writer.drain())
    assert not writer.busy
    writer.stop()
    assert not writer.running and writer_threads() == before  # joined
    # the store is this thread's again
    store.end_session(WORKER, "finished")
    assert store.counts()["pending"] == 1
    store.close()
    with pytest.raises(StoreError, match="not running"):
        writer.call("late", lambda s: None)


def test_retry_busy_tries_again_then_raises() -> None:
    calls: list[int] = []
    sleeps: list[float] = []

    def action() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise StoreBusy("locked")
        return "ok"

    assert retry_busy("testing", action, sleep=sleeps.append) == "ok"
    assert sleeps == [0.05, 0.1]

    def always() -> str:
        raise StoreBusy("locked")

    with pytest.raises(StoreBusy):
        retry_busy("testing", always, attempts=3, sleep=sleeps.append)

    def broken() -> str:
        calls.append(1)
        raise StoreError("disk full")

    calls.clear()
    with pytest.raises(StoreError, match="disk full"):
        retry_busy("testing", broken, sleep=sleeps.append)
    assert len(calls) == 1  # not retried


def test_merge_keeps_every_page_whole() -> None:
    a = UnitOfWork(requests=[new(1, "p")], completions=[Completion("p", RequestState.DONE)],
                   started=["s1"], claim=2, give_back=["g1"])
    b = UnitOfWork(requests=[new(2, "q")], completions=[Completion("q", RequestState.DONE)],
                   started=["s2"], claim=5, give_back=["g1", "g2"])
    merge_work(a, b)
    assert [r.key for r in a.requests] == ["k1", "k2"]
    assert [c.key for c in a.completions] == ["p", "q"]
    assert a.started == ["s1", "s2"] and a.claim == 5 and a.give_back == ["g1", "g2"]


@deferred_f_from_coro_f
async def test_both_commit_paths_call_the_followers_of_commits_that_stored_records(
        store_factory: Callable[..., FrontierStore]) -> None:
    """The streamed feeds follow every commit that stored records: a batch sent by the
    reactor's wait (``commit_now``) as well as a batch sent at the next turn."""
    store = open_store(store_factory)
    recorder = Recorder()
    writer = make_writer(store, recorder)
    followed: list[str] = []
    writer.follow_commits(lambda s: followed.append(threading.current_thread().name))
    try:
        await maybe_deferred_to_future(writer.call(
            "seeding", lambda s: s.commit(UnitOfWork(requests=[new(1), new(2), new(3)],
                                                     claim=3), WORKER)))

        def page(i: int) -> UnitOfWork:
            record = Record(record_id=f"product:{i}", source="test", natural_key=f'["{i}"]',
                            item_type="dict", data=f'{{"sku": "{i}"}}',
                            content_hash=f"{i:064x}")
            return UnitOfWork(records=[(record, f"k{i}")],
                              completions=[Completion(f"k{i}", RequestState.DONE)])

        writer.commit(page(1))
        assert writer.commit_now(timeout=600)  # waits for its batch on this thread
        assert len(followed) == 1
        writer.commit(UnitOfWork(completions=[Completion("k2", RequestState.DONE)]))
        await maybe_deferred_to_future(writer.drain())
        assert len(followed) == 1  # no record stored: not followed
        seq = writer.commit(page(3))
        waiting = writer.durable(seq)
        assert waiting is not None
        await maybe_deferred_to_future(waiting)
        assert len(followed) == 2
        assert threading.current_thread().name not in followed  # the writer's thread
        assert [result.records_inserted for _, result in recorder.committed] == [1, 0, 1]
    finally:
        await maybe_deferred_to_future(writer.drain())
        writer.stop()
        store.close()
