"""``SerialThread``: blocking calls run one after the other on a thread of their own, their
results delivered to the reactor thread as Deferreds (the reactor never waits on them)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from twisted.internet.defer import Deferred

__all__ = ["SerialThread"]

_T = TypeVar("_T")


class _Stop:
    """Sentinel: the thread ends when it takes this from its queue."""


class SerialThread:
    """Runs each submitted call on one daemon thread, strictly in the order submitted (a
    call starts once the one before it returned), and fires its Deferred on the reactor
    thread (``reactor.callFromThread``) with the result or the exception. The thread starts
    with the first call; :meth:`stop` ends it after everything submitted before."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def __call__(self, action: Callable[[], _T]) -> Deferred[_T]:
        """Run ``action()`` on the thread after everything submitted before. Raises
        RuntimeError once :meth:`stop` was called."""
        if self._stopped:
            raise RuntimeError(f"{self.name}: stopped")
        if self._thread is None:
            from twisted.internet import reactor  # the one Scrapy installed

            self._thread = threading.Thread(target=self._run, args=(reactor,),
                                            name=self.name, daemon=True)
            self._thread.start()
        d: Deferred[_T] = Deferred()
        self._jobs.put((action, d))
        return d

    def stop(self) -> Deferred[None]:
        """No more calls; fires (on the reactor thread) once every call submitted before has
        run (the thread then ends)."""
        self._stopped = True
        d: Deferred[None] = Deferred()
        if self._thread is None:
            d.callback(None)
            return d
        self._jobs.put((_Stop, d))
        return d

    def shutdown(self) -> None:
        """No more calls; returns once every call submitted before has run and the thread
        is gone (the caller waits: not on the reactor thread while a call may wait for
        it)."""
        self._stopped = True
        if self._thread is None:
            return
        self._jobs.put((_Stop, None))
        self._thread.join()

    def _run(self, reactor: Any) -> None:
        while True:
            action, d = self._jobs.get()
            if action is _Stop:
                if d is not None:
                    reactor.callFromThread(d.callback, None)
                return
            try:
                result = action()
            except BaseException as exc:  # the reactor thread decides
                reactor.callFromThread(d.errback, exc)
            else:
                reactor.callFromThread(d.callback, result)
