"""The tests' PostgreSQL cluster dies with the test process that started it: a pytest
killed with SIGKILL (a CI timeout, a developer's kill -9) leaves no server running and no
data directory behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from crawling import wait_for

TESTS = Path(__file__).resolve().parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def test_a_killed_pytest_leaves_no_server_behind(tmp_path: Path,
                                                 postgres_cluster: Any) -> None:
    # postgres_cluster: binaries and psycopg are there (else this skips, as the others do)
    started = tmp_path / "started"
    (tmp_path / "test_holds_a_cluster.py").write_text(textwrap.dedent(f"""
        import sys, threading
        sys.path.insert(0, {str(TESTS)!r})
        from postgres_server import find_binaries, running_cluster

        def test_holds_a_cluster():
            with running_cluster(find_binaries()) as cluster:
                pid = (cluster.data / "postmaster.pid").read_text().split()[0]
                with open({str(started)!r} + ".tmp", "w") as out:
                    out.write(f"{{pid}} {{cluster.base}}")
                import os
                os.replace({str(started)!r} + ".tmp", {str(started)!r})
                threading.Event().wait()  # until killed
    """))
    pytest_run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(tmp_path / "test_holds_a_cluster.py")],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: started.exists() or pytest_run.poll() is not None, 600,
                 "the other pytest's cluster to start")
        assert pytest_run.poll() is None, "the other pytest ended before its cluster started"
        pid_text, base_text = started.read_text().split(" ", 1)
        postmaster, base = int(pid_text), Path(base_text)
        assert _alive(postmaster) and base.is_dir()
    finally:
        pytest_run.send_signal(signal.SIGKILL)
        pytest_run.wait()
    wait_for(lambda: not _alive(postmaster) and not base.exists(), 300,
             "the killed pytest's server to stop and its directory to go")
