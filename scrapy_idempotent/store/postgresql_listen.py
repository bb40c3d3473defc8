"""Waking idle workers on PostgreSQL: a thread of its own ``LISTEN``\\ s on the crawl's
channel, on a connection of its own, and calls back when another worker says requests became
claimable (``NOTIFY`` from a commit, see ``PostgreSQLStore._notify``).

The thread sleeps in ``select()`` on two things: the connection's socket and the read end of a
pipe. Stopping writes to the pipe, so a closing store never waits for a poll interval to end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Any

from ..exceptions import StoreError

logger = logging.getLogger(__name__)

__all__ = ["WorkListener"]

#: How long the thread waits for a notification before it checks its connection again.
IDLE_SECONDS = 5.0
#: How long it waits before opening a connection again after one was lost or refused.
RETRY_SECONDS = 1.0


class WorkListener:
    """Call ``callback`` for each batch of notifications on ``channel`` whose payload is not
    ``own`` (a worker ignores its own). A lost connection is opened again and ``callback``
    called once (what was sent while it was down is lost)."""

    def __init__(self, connect: Callable[[], Any], drop: Callable[[Any], None], channel: str,
                 own: str, callback: Callable[[], object]) -> None:
        self._connect = connect
        self._drop = drop
        self._channel = channel
        self._own = own
        self._callback = callback
        self._stop = threading.Event()
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._run, name="scrapy_idempotent listener",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (its connection closed) unless called from it."""
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"\0")
        if self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(timeout=30)
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _wait(self, conn: Any | None, seconds: float) -> None:
        """Sleep until ``conn`` has something to read, :meth:`stop` is called, or
        ``seconds`` pass."""
        watched = [self._wake_read] if conn is None else [self._wake_read, conn.fileno()]
        with contextlib.suppress(OSError, ValueError):
            select.select(watched, [], [], seconds)

    def _run(self) -> None:
        listened = False
        while not self._stop.is_set():
            try:
                conn = self._connect()
            except StoreError as exc:
                logger.debug("scrapy_idempotent: cannot listen for work: %s", exc)
                self._wait(None, RETRY_SECONDS)
                continue
            try:
                conn.execute(f'LISTEN "{self._channel}"')
                if listened:  # what was sent while the connection was down is lost
                    self._callback()
                listened = True
                while not self._stop.is_set():
                    # drained in one go: one call for all; none for this worker's own
                    received = list(conn.notifies(timeout=0.0))
                    if any(n.payload != self._own for n in received):
                        self._callback()
                    if not received:
                        self._wait(conn, IDLE_SECONDS)
            except Exception as exc:
                if not self._stop.is_set():
                    logger.debug("scrapy_idempotent: listening for work: %s", exc)
                    self._wait(None, RETRY_SECONDS / 2)
            finally:
                self._drop(conn)
