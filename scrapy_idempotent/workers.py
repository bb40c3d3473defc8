"""Worker identity and liveness: who works on a database, and whether that worker is gone.

A worker is one open scheduler. Its id is ``host:pid:start:nonce`` (:class:`WorkerId`): the
host name, the process id, the process start time in clock ticks since boot (so a pid reused
by another process is told apart) and a random nonce (so two crawls of one process are told
apart). Only a worker of this host can be declared dead here (its process is gone, or it is
this process and its scheduler closed); a worker of another host ends by lease expiry.

Plain Python (no Scrapy): the scheduler takes an id and declares it live, the store tells
live sessions from dead ones, the feed exporter tells whose temporary file it is, and the
``scrapy idempotent`` commands describe lease holders and sessions, all through here.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "WorkerId",
    "WorkerState",
    "declare_live",
    "forget_live",
    "new_worker_id",
    "process_start_ticks",
    "worker_id",
    "worker_is_dead",
    "worker_state",
]

#: How a worker id is seen from this process: ``alive`` and ``dead`` for a worker of this
#: host, ``other host``, or ``unknown`` for a text that is not a worker id.
WorkerState = Literal["alive", "dead", "other host", "unknown"]

#: Worker ids of the schedulers open in this process (see :func:`declare_live`).
_LIVE: set[str] = set()


@dataclass(frozen=True)
class WorkerId:
    """The parts of a worker id; ``str()`` gives the id back."""

    host: str
    pid: int
    start: str  #: process start time (clock ticks since boot, or a Unix time without /proc)
    nonce: str = ""

    def __str__(self) -> str:
        parts = [self.host, str(self.pid), self.start]
        return ":".join([*parts, self.nonce] if self.nonce else parts)

    @classmethod
    def parse(cls, text: str) -> WorkerId | None:
        """The parts of ``text``, or None when it is not a worker id (fewer than three
        ``:``-separated parts, or a pid that is not a number). The nonce is optional (ids
        written by older releases have none)."""
        parts = text.split(":")
        if len(parts) < 3 or not parts[1].isdigit():
            return None
        return cls(host=parts[0], pid=int(parts[1]), start=parts[2],
                   nonce=parts[3] if len(parts) > 3 else "")


def process_start_ticks(pid: int) -> str | None:
    """Start time of a process in clock ticks since boot (Linux), to tell a pid reused by
    another process from the process that took a lease. None where /proc is not available."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def new_worker_id() -> str:
    """A fresh ``host:pid:start:nonce``: unique on a host, never equal to the id of a dead
    process that had the same pid (the process start time is part of it), and one per
    scheduler, so a second crawl in the same process tells its predecessor's leases from its
    own."""
    pid = os.getpid()
    start = process_start_ticks(pid) or str(int(time.time()))
    return str(WorkerId(socket.gethostname(), pid, start, secrets.token_hex(4)))


#: The name used before :func:`new_worker_id`.
worker_id = new_worker_id


def declare_live(worker: str) -> None:
    """``worker`` (of this process) is open: :func:`worker_is_dead` answers False for it
    until :func:`forget_live`."""
    _LIVE.add(worker)


def forget_live(worker: str) -> None:
    """``worker`` (of this process) has closed: from now on it is dead."""
    _LIVE.discard(worker)


def worker_is_dead(worker: str) -> bool:
    """True only when ``worker`` ran on this host and is gone: its process no longer exists,
    or it is this process and no scheduler of that id is open. Workers of other hosts (and
    texts that are not worker ids) are never declared dead here: their leases end by
    expiry."""
    parsed = WorkerId.parse(worker)
    if parsed is None or parsed.host != socket.gethostname():
        return False
    current = process_start_ticks(parsed.pid)
    if current is not None and current != parsed.start:
        return True  # the pid now belongs to another process
    if parsed.pid == os.getpid():
        return worker not in _LIVE
    if current is not None:
        return False
    try:
        os.kill(parsed.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def worker_state(worker: str) -> WorkerState:
    """How ``worker`` is seen from here (see :data:`WorkerState`)."""
    parsed = WorkerId.parse(worker)
    if parsed is None:
        return "unknown"
    if parsed.host != socket.gethostname():
        return "other host"
    return "dead" if worker_is_dead(worker) else "alive"
