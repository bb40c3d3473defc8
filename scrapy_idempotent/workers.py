"""Worker identity and liveness: who works on a database, and whether that worker is gone.

A worker is one open scheduler. Its id is ``host:pid:start:nonce:namespace``
(:class:`WorkerId`): the host name, the process id, the process start time in clock ticks
since boot (so a pid reused by another process is told apart), a random nonce (so two crawls
of one process are told apart) and the PID namespace the pid belongs to (:func:`pid_namespace`:
containers sharing one host name, ``--uts=host`` or a compose file's ``hostname:``, have pids
of their own, and one container cannot see whether another's pid lives).

Only a worker of this host AND of this process's PID namespace can be declared dead here (its
process is gone, or it is this process and its scheduler closed); a worker of another host or
of another PID namespace ends by lease expiry (and, on PostgreSQL, by its heartbeat). Ids
written by older releases (``host:pid:start`` and ``host:pid:start:nonce``) do not say their
namespace: they are never declared dead here either.

Plain Python (no Scrapy): the scheduler takes an id and declares it live, the store tells
live sessions from dead ones, the feed exporter and the files store tell whose temporary file
it is, the queue input whose pending messages to take over, and the ``scrapy idempotent``
commands describe lease holders and sessions, all through here.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "WorkerId",
    "WorkerState",
    "declare_live",
    "forget_live",
    "new_worker_id",
    "pid_namespace",
    "process_start_ticks",
    "worker_id",
    "worker_is_dead",
    "worker_state",
]

#: How a worker id is seen from this process: ``alive`` and ``dead`` for a worker of this
#: host and PID namespace; ``other host``; ``other namespace`` for a worker of this host name
#: in another PID namespace (another container), or an id of an older release that does not
#: say its namespace; ``unknown`` for a text that is not a worker id.
WorkerState = Literal["alive", "dead", "other host", "other namespace", "unknown"]

#: The namespace part of an id made where the PID namespace cannot be told (Linux without
#: /proc): never equal to this process's, so no worker of it is declared dead by pid.
UNKNOWN_NAMESPACE = "-"

#: Worker ids of the schedulers open in this process (see :func:`declare_live`).
_LIVE: set[str] = set()
#: (pid, start, namespace) of this process, computed once per process (see :func:`_this`).
_THIS: dict[int, tuple[str, str]] = {}


@dataclass(frozen=True)
class WorkerId:
    """The parts of a worker id; ``str()`` gives the id back.

    ``nonce`` and ``namespace`` are empty in ids written by older releases."""

    host: str
    pid: int
    start: str  #: process start time (clock ticks since boot, or a Unix time without /proc)
    nonce: str = ""
    namespace: str = ""  #: see :func:`pid_namespace`

    def __str__(self) -> str:
        parts = [self.host, str(self.pid), self.start]
        if self.nonce or self.namespace:
            parts.append(self.nonce)
        if self.namespace:
            parts.append(self.namespace)
        return ":".join(parts)

    @classmethod
    def parse(cls, text: str) -> WorkerId | None:
        """The parts of ``text``, or None when it is not a worker id (fewer than three or
        more than five ``:``-separated parts, or a pid that is not a number). The nonce and
        the namespace are optional (ids written by older releases have neither, or no
        namespace)."""
        parts = text.split(":")
        if not 3 <= len(parts) <= 5 or not parts[1].isdigit():
            return None
        return cls(host=parts[0], pid=int(parts[1]), start=parts[2],
                   nonce=parts[3] if len(parts) > 3 else "",
                   namespace=parts[4] if len(parts) > 4 else "")


def process_start_ticks(pid: int) -> str | None:
    """Start time of a process in clock ticks since boot (Linux), to tell a pid reused by
    another process from the process that took a lease. None where /proc is not available,
    or not of this process's PID namespace (then a pid of this namespace cannot be looked up
    in it)."""
    if not _proc_is_this_namespace():
        return None
    return _start_ticks(str(pid))


def _start_ticks(entry: str) -> str | None:
    try:
        with open(f"/proc/{entry}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _proc_is_this_namespace() -> bool:
    """True when /proc shows this process's PID namespace (``/proc/self`` is our pid): a
    container given the host's /proc, or ``unshare --pid`` without ``--mount-proc``, sees
    another namespace's pids there."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def pid_namespace() -> str:
    """Which PID namespace this process's pid belongs to: 8 hex digits of a hash of the boot
    id (``/proc/sys/kernel/random/boot_id``) and of the namespace's inode
    (``/proc/self/ns/pid``), so two containers of one host (or one host before and after a
    reboot) differ. Where /proc is absent: ``host`` on a system without PID namespaces (macOS,
    the BSDs, Windows: the host is the namespace), :data:`UNKNOWN_NAMESPACE` on Linux."""
    try:
        ns = os.stat("/proc/self/ns/pid")
    except OSError:
        return UNKNOWN_NAMESPACE if sys.platform.startswith("linux") else "host"
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return hashlib.sha256(f"{boot}:{ns.st_dev}:{ns.st_ino}".encode()).hexdigest()[:8]


def _this() -> tuple[str, str]:
    """``(start, namespace)`` of this process, computed once per process (a forked child
    computes its own)."""
    pid = os.getpid()
    this = _THIS.get(pid)
    if this is None:
        start = _start_ticks("self") if os.path.exists("/proc/self/stat") else None
        this = _THIS[pid] = (start or str(int(time.time())), pid_namespace())
    return this


def new_worker_id() -> str:
    """A fresh ``host:pid:start:nonce:namespace``: unique on a host, never equal to the id of
    a dead process that had the same pid (the process start time is part of it), one per
    scheduler (so a second crawl in the same process tells its predecessor's leases from its
    own), and naming its PID namespace (so a process of another container of the same host
    name is never taken for a gone process of this one)."""
    start, namespace = _this()
    return str(WorkerId(socket.gethostname(), os.getpid(), start, secrets.token_hex(4),
                        namespace))


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
    """True only when ``worker`` ran on this host, in this process's PID namespace, and is
    gone: its process no longer exists (or the pid is another process's now), or it is this
    process and no scheduler of that id is open. Workers of other hosts or other PID
    namespaces, ids of older releases (no namespace) and texts that are not worker ids are
    never declared dead here: their leases end by expiry."""
    return worker_state(worker) == "dead"


def worker_state(worker: str) -> WorkerState:
    """How ``worker`` is seen from here (see :data:`WorkerState`)."""
    parsed = WorkerId.parse(worker)
    if parsed is None:
        return "unknown"
    if parsed.host != socket.gethostname():
        return "other host"
    namespace = _this()[1]
    if worker in _LIVE:
        return "alive"
    if parsed.namespace != namespace or namespace == UNKNOWN_NAMESPACE:
        return "other namespace"
    if parsed.pid == os.getpid():
        # this process with that scheduler closed, or an earlier process that had this pid
        return "dead"
    return "dead" if _pid_gone(parsed.pid, parsed.start) else "alive"


def _pid_gone(pid: int, start: str) -> bool:
    """Whether process ``pid`` (of this PID namespace), started at ``start``, is gone."""
    current = process_start_ticks(pid)
    if current is not None:
        return current != start  # the pid now belongs to another process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False
