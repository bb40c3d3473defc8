"""The servers the tests start (Redis, RabbitMQ, tansu) die with the test process: a process
holding a :class:`lifeline.Lifeline` killed with SIGKILL leaves no server process group and
no server directory behind; a released lifeline touches nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from crawling import wait_for

TESTS = Path(__file__).resolve().parent


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _holder(tmp_path: Path, *, release: bool) -> tuple[int, Path]:
    """A process that starts a "server" (a sleep in a session of its own), holds its
    lifeline, and then dies by SIGKILL (or releases the lifeline first): the server's pid."""
    directory = tmp_path / "server"
    directory.mkdir()
    script = textwrap.dedent(f"""
        import os, signal, subprocess, sys
        sys.path.insert(0, {str(TESTS)!r})
        from lifeline import Lifeline
        server = subprocess.Popen(["sleep", "600"], start_new_session=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        lifeline = Lifeline(server.pid, {str(directory)!r})
        if {release!r}:
            lifeline.release()
        print(server.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    return int(done.stdout.split()[0]), directory


def test_a_killed_test_process_leaves_no_server_behind(tmp_path: Path) -> None:
    pid, directory = _holder(tmp_path, release=False)
    wait_for(lambda: not _group_alive(pid) and not directory.exists(), timeout=120,
             what="the watchdog to stop the server and remove its directory")


def test_a_released_lifeline_leaves_the_server_alone(tmp_path: Path) -> None:
    pid, directory = _holder(tmp_path, release=True)
    try:
        assert _group_alive(pid) and directory.exists()
    finally:
        os.killpg(pid, signal.SIGKILL)
