"""A real RabbitMQ broker for the tests: Debian's ``rabbitmq-server`` started on free loopback
ports, as a node of its own (its own RABBITMQ_NODENAME, RABBITMQ_MNESIA_BASE, log directory
and Erlang cookie under a temporary directory), stopped after. Without the package (or pika)
the tests using it are skipped, naming what to install."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lifeline import Lifeline

SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
CTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"
INSTALL = ("no RabbitMQ broker: install Debian's package (apt-get install rabbitmq-server) "
           "and pika (pip install -e '.[test]')")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RabbitMQServer:
    """One RabbitMQ node; ``url`` is its ``amqp://`` URL (the guest user, from loopback)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = 0
        self.node = f"test{uuid.uuid4().hex[:8]}@localhost"
        self.process: subprocess.Popen[bytes] | None = None
        self._lifeline: Lifeline | None = None
        self.started = False  # once started, the node keeps its ports (its clients' URLs)
        self.environment = {
            **os.environ, "HOME": str(directory), "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_MNESIA_BASE": str(directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(directory / "log"),
            "RABBITMQ_CONFIG_FILE": str(directory / "rabbitmq"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(directory / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(directory / "rabbitmq.pid")}
        self._choose_ports()

    def _choose_ports(self) -> None:
        self.port = _free_port()
        self.environment["RABBITMQ_NODE_PORT"] = str(self.port)
        self.environment["RABBITMQ_DIST_PORT"] = str(_free_port())

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    def start(self) -> RabbitMQServer:
        """Start the node; a node that ends before it answers (one of its free ports taken by
        another process before it bound it) is started again on other ports, and the error
        after the last attempt quotes what the node printed (its directory is removed with
        the fixture). A node started before keeps its ports."""
        for _attempt in range(1 if self.started else 3):
            output = self.directory / "server.out"
            with output.open("ab") as out:
                self.process = subprocess.Popen(
                    [SERVER], env=self.environment, cwd=self.directory,
                    start_new_session=True, stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT)
            self._lifeline = Lifeline(self.process.pid, self.directory)
            deadline = time.monotonic() + 180
            while not self._ready():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            else:
                self.started = True
                return self
            ended = self.process.poll() is not None
            self.stop()
            if not ended:
                break  # running but not answering: another attempt would not help
            self._choose_ports()
        printed = (self.directory / "server.out").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"rabbitmq-server did not start on port {self.port}; it printed:\n"
                           f"{printed}")

    def _ready(self) -> bool:
        import pika

        try:
            pika.BlockingConnection(pika.URLParameters(self.url)).close()
        except Exception:
            return False
        return True

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        deadline = time.monotonic() + 60
        while self._ready() and time.monotonic() < deadline:
            time.sleep(0.1)  # the node's children gone with the group
        if self._lifeline is not None:
            self._lifeline.release()
            self._lifeline = None

    def ctl(self, *arguments: str) -> str:
        return subprocess.run([CTL, "-n", self.node, "-q", *arguments], env=self.environment,
                              check=True, capture_output=True, text=True).stdout

    def close_all_connections(self) -> None:
        """Every client connection cut by the broker (as a network cut or a failover)."""
        self.ctl("close_all_connections", "cut by the test")

    def queue_counts(self, queue: str) -> tuple[int, int]:
        """(ready, unacknowledged) messages of ``queue``."""
        for line in self.ctl("list_queues", "name", "messages_ready",
                             "messages_unacknowledged").splitlines():
            parts = line.split("\t")
            if parts[0] == queue:
                return int(parts[1]), int(parts[2])
        return 0, 0


class AmqpKillQueue:
    """A queue of the broker, with what the kill tests ask of it (checked at the broker)."""

    def __init__(self, server: RabbitMQServer) -> None:
        import pika

        self.server = server
        self.name = f"q-{uuid.uuid4().hex[:12]}"
        base = server.url
        self.url = base
        self._pika = pika
        connection = pika.BlockingConnection(pika.URLParameters(base))
        channel = connection.channel()
        # declared as the queue input declares it, so its messages survive a broker restart
        channel.exchange_declare(f"{self.name}:parked", exchange_type="fanout", durable=True)
        channel.queue_declare(self.name, durable=True,
                              arguments={"x-dead-letter-exchange": f"{self.name}:parked"})
        connection.close()

    def _channel(self) -> Any:
        connection = self._pika.BlockingConnection(self._pika.URLParameters(self.server.url))
        return connection, connection.channel()

    def push(self, body: str | dict[str, Any]) -> None:
        self.push_many([body])

    def push_many(self, bodies: list[str | dict[str, Any]]) -> None:
        connection, channel = self._channel()
        channel.confirm_delivery()
        for body in bodies:
            text = body if isinstance(body, str) else json.dumps(body)
            channel.basic_publish("", self.name, text.encode(),
                                  properties=self._pika.BasicProperties(delivery_mode=2))
        connection.close()

    def in_flight(self) -> int:
        return self.server.queue_counts(self.name)[1]

    def remaining(self) -> int:
        return sum(self.server.queue_counts(self.name))

    def all_acknowledged(self) -> bool:
        return self.remaining() == 0

    def held_urls(self) -> set[str] | None:
        return None  # RabbitMQ shows a queue's messages only to a consumer

    def settings(self) -> tuple[str, ...]:
        return (f"IDEMPOTENT_QUEUE_KEY={self.name}",)

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server.start()


@pytest.fixture(scope="session")
def rabbitmq_server() -> Iterator[RabbitMQServer]:
    pytest.importorskip("pika", reason=INSTALL)
    if not (Path(SERVER).exists() and shutil.which("erl")):
        pytest.skip(INSTALL)
    with tempfile.TemporaryDirectory(prefix="rabbitmq-test-") as directory:
        server = RabbitMQServer(Path(directory)).start()
        try:
            yield server
        finally:
            server.stop()
