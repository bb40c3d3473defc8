"""Servers the tests start die with the test process, however it ends.

:class:`Lifeline` starts a watchdog (this file run as a script, in a session of its own so a
signal to the test's process group does not reach it) holding the read end of a pipe whose
write end only the test process has. The test stops its server and then releases the
lifeline (a byte written, the pipe closed): the watchdog ends and touches nothing. When the
test process ends first (SIGKILL, an interrupted run), the pipe closes unreleased: the
watchdog stops the server's process group (SIGTERM, then SIGKILL after 10 s) and removes the
server's directory. The PostgreSQL cluster has a watchdog of its own (postgres_server.py:
``pg_ctl`` stops it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["Lifeline"]

#: After SIGTERM, the watchdog waits this long (seconds) for the group before SIGKILL.
TERM_SECONDS = 10.0


class Lifeline:
    """The watchdog of the server process group ``pgid`` (a process started with
    ``start_new_session=True``: its pid) and of its ``directory``, if given."""

    def __init__(self, pgid: int, directory: Path | None = None) -> None:
        read, self._write = os.pipe()  # the write end is not inherited by children
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, __file__, str(pgid), str(directory or "")], stdin=read,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(read)

    def release(self) -> None:
        """The server was stopped by the test: the watchdog ends, touching nothing."""
        if self._write < 0:
            return
        os.write(self._write, b"released")
        os.close(self._write)
        self._write = -1
        self._watchdog.wait(60)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch(pgid: int, directory: str) -> None:
    if sys.stdin.buffer.read():
        return  # released
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_SECONDS
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), sys.argv[2])
