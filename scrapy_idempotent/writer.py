"""The store writer: the crawl's database writes run on a thread of their own.

While a crawl runs, :class:`WriterThread` owns the store's write connection: page commits,
journal rows, start marks, lease renewals and every other write are queued to its thread and
run there one after the other, in the order they were submitted; their results come back to
the reactor thread (``reactor.callFromThread``) as Deferreds and callbacks. The reactor never
waits on the database: a write lock held by another process, a slow disk or a retry wait
only delay the writes, while downloads that need no write go on. Reads the reactor must
answer at once use the store's read connection (in WAL mode readers do not wait on writers).

Group commit: page commits (:meth:`WriterThread.commit`) are merged into the batch being
filled, and one batch at a time is with the thread. A batch is sent at the next reactor turn
when none is in flight, else as soon as the one in flight returns, with everything that
arrived meanwhile: one write transaction per batch, fewer than one per page when pages
complete faster than a transaction takes. Writes that need not be durable at once (the
start of an attempt, a journaled response) ride on the next batch; when something waits
for them and no page completes, their batch is sent after :data:`LINGER_SECONDS`. A batch is one
:class:`~.store.base.UnitOfWork` and :meth:`~.store.base.FrontierStore.commit` writes it in
ONE transaction: several pages may share a transaction, a page is never split over two, so
"done is the last write" and the lease fence hold per page as before.

Errors: a busy database (:class:`~.StoreBusy`) is tried again with back-off on the writer's
thread (:func:`retry_busy`); any other error, or busy past the last attempt, fails
the batch: the ``failed`` callback gets the error (the scheduler closes the spider), waiters
are released, and nothing more is written. At close, :meth:`WriterThread.drain` waits until
everything submitted is written, then :meth:`WriterThread.stop` ends the thread and the store
is the caller's again.

With ``threaded=False`` the same writes run at once on the caller's thread, each commit its
own transaction, results delivered before :meth:`WriterThread.commit` returns: a scheduler
driven by hand, outside a running crawl, sees every write done when its call returns.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

from .exceptions import StoreBusy, StoreError
from .store.base import CommitResult, FrontierStore, UnitOfWork

__all__ = [
    "COMMIT_ATTEMPTS",
    "LINGER_SECONDS",
    "STALL_SECONDS",
    "WriterThread",
    "merge_work",
    "retry_busy",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: A batch in flight longer than this (seconds) is waiting for the database (another
#: process's lock, a slow disk): see :attr:`WriterThread.stalled`.
STALL_SECONDS = 0.5
#: How long (seconds) a batch with no page's completion in it waits for one to join it
#: (:meth:`WriterThread.commit` with ``linger``): a response waiting for its journal row
#: is then written with the completion of another page rather than in a transaction of
#: its own.
LINGER_SECONDS = 0.003


#: Attempts at a write transaction before the crawl is closed (database locked by another
#: process).
COMMIT_ATTEMPTS = 5


def retry_busy(what: str, action: Callable[[], _T], *, attempts: int = COMMIT_ATTEMPTS,
               sleep: Callable[[float], object] = time.sleep) -> _T:
    """``action()``, tried again with back-off while another process holds the database
    locked (:class:`~.StoreBusy`), at most ``attempts`` times (back-off 0.05 s, doubling,
    through ``sleep``); any other store error (disk full, read-only, not our schema, an I/O
    error) is raised at once, as retrying cannot cure it. Blocks the calling thread: each
    attempt waits up to IDEMPOTENT_BUSY_TIMEOUT_SECONDS for the lock (the writer's thread
    while a crawl runs; the reactor's only when the store is opened and closed). ``what``:
    the action, for the log (``"committing"``)."""
    delay = 0.05
    for attempt in range(1, attempts):
        try:
            return action()
        except StoreBusy as exc:
            logger.warning("scrapy_idempotent: database busy while %s (%s), "
                           "retrying (%d/%d)", what, exc, attempt, attempts)
            sleep(delay)
            delay *= 2
    return action()


def merge_work(into: UnitOfWork, work: UnitOfWork) -> None:
    """Add ``work`` to ``into``: one transaction then writes both. Each page's records,
    children and completion stay together (the store fences them by the page's key)."""
    into.requests.extend(work.requests)
    into.records.extend(work.records)
    into.rejects.extend(work.rejects)
    into.completions.extend(work.completions)
    into.started.extend(work.started)
    into.responses.extend(work.responses)
    into.replayed.extend(work.replayed)
    into.downloaded.extend(work.downloaded)
    into.state_changes.extend(work.state_changes)
    into.meta.update(work.meta)
    into.claim = max(into.claim, work.claim)
    for key in work.give_back:
        if key not in into.give_back:
            into.give_back.append(key)
    if work.outbox_targets:
        into.outbox_targets = work.outbox_targets


class _Stop:
    """Sentinel: the thread ends when it takes this from its queue."""


class _Waiting:
    """A job whose caller waits for it on its own thread, for a while
    (:meth:`WriterThread.commit_now`): the writer's thread hands its outcome to the waiting
    caller, or, once the caller stopped waiting, to the reactor thread like any other job."""

    def __init__(self, deferred: Deferred[Any]) -> None:
        self.deferred = deferred
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._abandoned = False
        self.result: Any = None
        self.error: BaseException | None = None

    def settle(self, result: Any, error: BaseException | None) -> bool:
        """On the writer's thread: the job's outcome. False when the caller no longer waits
        (its Deferred is then the reactor thread's to fire)."""
        with self._lock:
            if self._abandoned:
                return False
            self.result, self.error = result, error
            self._done.set()
            return True

    def wait(self, timeout: float) -> bool:
        """On the caller's thread: wait up to ``timeout`` seconds for the outcome. True when
        it came (in :attr:`result` / :attr:`error`); False when the caller stopped waiting,
        and then never True later: the outcome fires :attr:`deferred` on the reactor."""
        self._done.wait(timeout)
        with self._lock:
            if self._done.is_set():
                return True
            self._abandoned = True
            return False


class WriterThread:
    """A thread that runs the store's writes, with group commit of page work.

    :param store: an open store; its write connection is used only by this thread from
        :meth:`start` to :meth:`stop` (the store must allow its use from another thread).
    :param worker: the worker id commits are made for (the lease fence).
    :param prepare: ``prepare(work, seq)``, on the reactor thread, just before batch number
        ``seq`` is sent:
        adds what is buffered elsewhere (start marks, journal rows, the lease claim). A batch
        still empty after it is not written.
    :param committed: ``committed(work, result)``, on the reactor thread, once the batch's
        transaction is committed (durable for the store's ``synchronous`` level).
    :param failed: ``failed(work, error)``, on the reactor thread, when a batch could not be
        written: nothing of it was, and nothing more will be.
    :param threaded: False: no thread, every write runs at once on the caller's thread (see
        the module docstring).
    """

    def __init__(self, store: FrontierStore, worker: str, *,
                 prepare: Callable[[UnitOfWork, int], None] | None = None,
                 committed: Callable[[UnitOfWork, CommitResult], None] | None = None,
                 failed: Callable[[UnitOfWork, BaseException], None] | None = None,
                 attempts: int = COMMIT_ATTEMPTS, threaded: bool = True) -> None:
        self.store = store
        self.worker = worker
        self._prepare = prepare
        self._committed = committed
        self._failed = failed
        self._attempts = attempts
        self.threaded = threaded
        self._running = False
        self._sent_at = 0.0  #: when the batch in flight was sent (time.monotonic())
        self._progress_at = 0.0  #: when the thread last finished a write, or got one to do
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._reactor: Any = None
        self._open: UnitOfWork | None = None  #: the batch being filled
        self._open_urgent = False  #: something joined it without linger
        self._open_seq = 1  #: its number (batches are numbered in the order they are sent)
        self._durable_seq = 0  #: every batch up to this number is written (or given up)
        self._batch_inflight = False
        self._dispatch_call: Any = None
        self._calls_inflight = 0
        self._waiters: list[tuple[int, Deferred[None]]] = []
        self._drains: list[Deferred[None]] = []
        #: the error that failed a batch; from then on nothing more is written
        self.error: BaseException | None = None
        self._followers: list[Callable[[FrontierStore], None]] = []
        self._durable_hooks: list[Callable[[UnitOfWork, CommitResult, float], None]] = []
        self.batches = 0  #: batches committed
        self.pages = 0  #: completions in those batches

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._running

    def start(self) -> None:
        """Start the thread; from now on only it uses the store's write connection."""
        from twisted.internet import reactor  # the one Scrapy installed

        self._reactor = reactor
        self._running = True
        if self.threaded:
            self._thread = threading.Thread(target=self._run, name="scrapy_idempotent-writer",
                                            daemon=True)
            self._thread.start()

    def drain(self) -> Deferred[None]:
        """Fires once everything submitted so far is written (or given up after an error):
        the open batch is sent at once rather than at the next reactor turn."""
        if self._idle():
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._drains.append(d)
        if self._open is not None and not self._batch_inflight:
            self._dispatch()
        return d

    def stop(self) -> None:
        """End the thread (after :meth:`drain`: it then has nothing left to run, and this
        returns at once); the store's write connection is the caller's again."""
        thread, self._thread = self._thread, None
        self._running = False
        if self._dispatch_call is not None and self._dispatch_call.active():
            self._dispatch_call.cancel()
        self._dispatch_call = None
        if thread is not None:
            self._jobs.put(_Stop)
            thread.join()

    # -- any write ------------------------------------------------------------------------------

    def call(self, what: str, action: Callable[[FrontierStore], _T]) -> Deferred[_T]:
        """Run ``action(store)`` on the writer's thread, after everything submitted before,
        retrying while the database is busy. The Deferred fires on the reactor thread with
        its result, or fails with its error (a :class:`~.StoreError`, usually)."""
        if not self._running:
            raise StoreError("the store writer is not running")
        d: Deferred[_T] = Deferred()
        if not self._calls_inflight:
            self._progress_at = time.monotonic()
        self._calls_inflight += 1
        d.addBoth(self._call_done)
        if self._thread is not None:
            self._jobs.put((what, action, d))
            return d
        try:
            result = retry_busy(what, lambda: action(self.store), attempts=self._attempts)
        except Exception as exc:
            d.errback(exc)
        else:
            d.callback(result)
        return d

    def _call_done(self, result: Any) -> Any:
        self._calls_inflight -= 1
        self._progress_at = time.monotonic()
        self._check_drained()
        return result

    def _run(self) -> None:
        reactor = self._reactor
        while True:
            job = self._jobs.get()
            if job is _Stop:
                return
            what, action, d = job
            result: Any = None
            error: BaseException | None = None
            try:
                result = retry_busy(what, lambda: action(self.store),  # noqa: B023
                                    attempts=self._attempts)
            except BaseException as exc:  # delivered to the reactor thread, which decides
                error = exc
            if isinstance(d, _Waiting):  # its caller may still wait for it (commit_now)
                if d.settle(result, error):
                    continue
                d = d.deferred
            if error is not None:
                reactor.callFromThread(d.errback, error)
            else:
                reactor.callFromThread(d.callback, result)

    # -- group commit -------------------------------------------------------------------------

    @property
    def open_seq(self) -> int:
        """The number of the batch being filled: what is buffered now is written by it."""
        return self._open_seq

    def commit(self, work: UnitOfWork | None = None, *, linger: float = 0.0) -> int:
        """Add ``work`` (may be None: only what ``prepare`` adds) to the batch being filled,
        and have it sent at the next reactor turn, or when the batch in flight returns.
        With ``linger`` (seconds), it is sent that late at the latest, and at once when the
        batch in flight returns only if something without linger joined it. Returns the
        batch's number (see :meth:`durable`)."""
        if self._open is None:
            self._open = UnitOfWork()
        if work is not None:
            merge_work(self._open, work)
        seq = self._open_seq
        if not self.threaded:
            self._dispatch()
            return seq
        if not linger:
            self._open_urgent = True
        if not self._batch_inflight:
            self._dispatch_in(linger)
        return seq

    def _dispatch_in(self, delay: float) -> None:
        call = self._dispatch_call
        if call is None or not call.active():
            self._dispatch_call = self._reactor.callLater(delay, self._dispatch)
        elif call.getTime() > self._reactor.seconds() + delay:
            call.reset(delay)

    @property
    def idle(self) -> bool:
        """Nothing in flight on the thread (a batch being filled may wait)."""
        return not self._batch_inflight and self._calls_inflight == 0

    def commit_now(self, timeout: float = STALL_SECONDS) -> bool:
        """Send the batch being filled (with what ``prepare`` adds) at once and wait for it
        on the calling thread up to ``timeout`` seconds: when it is written in that time,
        its ``committed`` (or ``failed``) callback has run when this returns True. Past that
        (another process holds the lock, a slow disk or network) the batch goes on like any
        other (:meth:`commit`: its callbacks run on the reactor thread when it is done) and
        this returns False: the wait of the reactor is bounded, never a wait on the
        database. Only when the thread is :attr:`idle` (else False, nothing done): the one
        wait of the reactor, when it has nothing to hand out but what this batch claims (a
        claim of its own keeps Scrapy's order among requests enqueued meanwhile)."""
        if not self.idle or not self._running:
            return False
        if not self.threaded:
            self._dispatch()
            return True
        batch = self._take_batch()
        if batch is None:
            return True
        work, seq = batch
        self._batch_inflight = True
        self._sent_at = time.monotonic()
        d: Deferred[CommitResult] = Deferred()
        self._calls_inflight += 1
        self._progress_at = time.monotonic()
        d.addBoth(self._call_done)
        d.addCallbacks(self._batch_done, self._batch_failed, callbackArgs=(work, seq),
                       errbackArgs=(work, seq))
        waiting = _Waiting(d)
        self._jobs.put(("committing", lambda store: self._commit_then_follow(store, work),
                        waiting))
        if not waiting.wait(timeout):
            return False  # on its way: its callbacks run on the reactor thread
        if waiting.error is not None:
            d.errback(waiting.error)
        else:
            d.callback(waiting.result)
        return True

    def durable(self, seq: int) -> Deferred[None] | None:
        """None when batch ``seq`` is written already, else a Deferred that fires (with None)
        when it is, or when it was given up after an error."""
        if seq <= self._durable_seq:
            return None
        d: Deferred[None] = Deferred()
        self._waiters.append((seq, d))
        return d

    @property
    def durable_seq(self) -> int:
        """Every batch up to this number is written (or was given up after an error)."""
        return self._durable_seq

    @property
    def busy(self) -> bool:
        """Whether a batch is in flight or being filled."""
        return self._batch_inflight or self._open is not None

    @property
    def stalled(self) -> bool:
        """Whether the thread's writes wait for the database longer than a transaction takes
        (no write done for :data:`STALL_SECONDS` while some are in flight): another process
        holds the lock, or the disk stalls."""
        return (self._calls_inflight > 0
                and time.monotonic() - self._progress_at > STALL_SECONDS)

    def _dispatch(self) -> None:
        if self._batch_inflight or not self._running:
            self._cancel_dispatch()
            return
        batch = self._take_batch()
        if batch is None:
            return
        work, seq = batch
        self._batch_inflight = True
        self._sent_at = time.monotonic()
        d = self.call("committing", lambda store: self._commit_then_follow(store, work))
        d.addCallbacks(self._batch_done, self._batch_failed, callbackArgs=(work, seq),
                       errbackArgs=(work, seq))

    def follow_commits(self, hook: Callable[[FrontierStore], None]) -> None:
        """Call ``hook(store)`` on the writer's thread after each batch that stored records,
        before its result reaches the reactor (the streamed feeds are written there, so a
        record is in them before what its page yielded is handed out). Its errors are
        logged, never retried with the commit."""
        self._followers.append(hook)

    def follow_durable(self, hook: Callable[[UnitOfWork, CommitResult, float], None]) -> None:
        """Call ``hook(work, result, began)`` on the writer's thread after each batch
        committed (``began``: the store's clock before its transaction began, no later than
        the time the commit wrote), before its result reaches the reactor: what the batch
        made durable, told to a cache outside the database (see :mod:`.redis_dedup`) only
        once it is. A kill between the commit and the hook only leaves the cache short.
        Its errors are logged, never retried with the commit."""
        self._durable_hooks.append(hook)

    def _commit_durably(self, store: FrontierStore, work: UnitOfWork) -> CommitResult:
        began = store.clock() if self._durable_hooks else 0.0
        result = store.commit(work, self.worker)
        for hook in self._durable_hooks:
            try:
                hook(work, result, began)
            except Exception:  # the commit is done: never retried because of this
                logger.info("scrapy_idempotent: after a commit: %s", hook, exc_info=True)
        return result

    def _commit_then_follow(self, store: FrontierStore, work: UnitOfWork) -> CommitResult:
        result = self._commit_durably(store, work)
        if self._followers and (result.records_inserted or result.records_updated
                                or result.records_unchanged):
            for hook in self._followers:
                try:
                    hook(store)
                except Exception:  # the commit is done: never retried because of this
                    logger.info("scrapy_idempotent: after a commit: %s", hook, exc_info=True)
        return result

    def _cancel_dispatch(self) -> None:
        if self._dispatch_call is not None and self._dispatch_call.active():
            self._dispatch_call.cancel()
        self._dispatch_call = None

    def _take_batch(self) -> tuple[UnitOfWork, int] | None:
        """The batch being filled, numbered, with what ``prepare`` adds, to be sent now; None
        when there is nothing to send (it was empty, or nothing is written after an error:
        it is settled, or given up)."""
        self._cancel_dispatch()
        work, self._open = self._open or UnitOfWork(), None
        self._open_urgent = False
        seq = self._open_seq
        self._open_seq += 1
        if self.error is None and self._prepare is not None:
            try:
                self._prepare(work, seq)
            except Exception as exc:
                self._give_up(work, seq, exc)
                return None
        if self.error is not None or not work:
            self._settle(seq)
            return None
        return work, seq

    def _batch_done(self, result: CommitResult, work: UnitOfWork, seq: int) -> None:
        self._batch_inflight = False
        self.batches += 1
        self.pages += len(work.completions)
        if self._committed is not None:
            try:
                self._committed(work, result)
            except Exception:
                logger.exception("scrapy_idempotent: error after a commit")
        self._settle(seq)
        if self._open is not None and self._running:
            if self._open_urgent or self._drains:
                self._dispatch()
            else:
                self._dispatch_in(LINGER_SECONDS)

    def _batch_failed(self, failure: Failure, work: UnitOfWork, seq: int) -> None:
        self._batch_inflight = False
        error = failure.value
        self._give_up(work, seq, error if error is not None else StoreError(str(failure)))

    def _give_up(self, work: UnitOfWork, seq: int, exc: BaseException) -> None:
        first = self.error is None
        if first:
            self.error = exc
        if first and self._failed is not None:
            try:
                self._failed(work, exc)
            except Exception:
                logger.exception("scrapy_idempotent: error handling a failed commit")
        # nothing more is written: the batch being filled is given up too
        self._open = None
        self._settle(self._open_seq)
        self._open_seq += 1

    def _settle(self, seq: int) -> None:
        self._durable_seq = max(self._durable_seq, seq)
        ready = [d for s, d in self._waiters if s <= self._durable_seq]
        if ready:
            self._waiters = [(s, d) for s, d in self._waiters if s > self._durable_seq]
            for d in ready:
                d.callback(None)
        self._check_drained()

    def _idle(self) -> bool:
        return (self._open is None and not self._batch_inflight
                and self._calls_inflight == 0)

    def _check_drained(self) -> None:
        if self._drains and self._idle():
            drains, self._drains = self._drains, []
            for d in drains:
                d.callback(None)
