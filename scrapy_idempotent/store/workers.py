"""Who works on a database: worker ids, and whether the worker of an id is gone (plain
Python: the store uses it too, to tell live sessions from those of dead processes)."""

from __future__ import annotations

import os
import secrets
import socket
import time

__all__ = ["LIVE_WORKERS", "process_start_ticks", "worker_id", "worker_is_dead"]


def process_start_ticks(pid: int) -> str | None:
    """Start time of a process in clock ticks since boot (Linux), to tell a pid reused by
    another process from the process that took a lease. None where /proc is not available."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


#: Worker ids of the schedulers open in this process.
LIVE_WORKERS: set[str] = set()


def worker_id() -> str:
    """``host:pid:start:nonce``: unique on a host, never equal to the id of a dead process
    that had the same pid (the process start time is part of it), and one per scheduler, so
    a second crawl in the same process tells its predecessor's leases from its own."""
    pid = os.getpid()
    start = process_start_ticks(pid) or int(time.time())
    return f"{socket.gethostname()}:{pid}:{start}:{secrets.token_hex(4)}"


def worker_is_dead(worker: str) -> bool:
    """True only when ``worker`` ran on this host and is gone: its process no longer exists,
    or it is this process and no scheduler of that id is open. Workers of other hosts are
    never declared dead here: their leases end by expiry."""
    parts = worker.split(":")
    try:
        host, pid, start = parts[0], int(parts[1]), parts[2]
    except (IndexError, ValueError):
        return False
    if host != socket.gethostname():
        return False
    current = process_start_ticks(pid)
    if current is not None and current != start:
        return True  # the pid now belongs to another process
    if pid == os.getpid():
        return worker not in LIVE_WORKERS
    if current is not None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False
