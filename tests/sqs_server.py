"""An SQS server for the tests: moto's server mode (a real HTTP server on 127.0.0.1, its queues
kept in this process, so a server stopped and started again on its port keeps them: an SQS
endpoint that goes away and comes back). Skipped without moto (``pip install
'moto[server]'``, in the test extra) or boto3."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

INSTALL = "an SQS server for the tests: pip install 'moto[server]' boto3 (the test extra)"
#: credentials and region for moto (the worker processes get them in their environment)
ENVIRONMENT = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


class SqsServer:
    """moto's SQS on a free port; :meth:`restart` stops it and starts it on the same port."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server_class = ThreadedMotoServer
        self.server: Any = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.host, self.port = self.server.get_host_and_port()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def client(self) -> Any:
        import boto3

        return boto3.client("sqs", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def stop(self) -> None:
        self.server.stop()

    def start_again(self) -> None:
        self.server = self._server_class(ip_address="127.0.0.1", port=self.port,
                                         verbose=False)
        self.server.start()


class SqsQueue:
    """One queue of the server, with what the tests ask of it (checked at the broker)."""

    def __init__(self, server: SqsServer, fifo: bool = False, redrive: bool = False) -> None:
        self.server = server
        self.client = server.client()
        self.fifo = fifo
        self.name = f"q-{uuid.uuid4().hex[:12]}" + (".fifo" if fifo else "")
        attributes = {"FifoQueue": "true"} if fifo else {}
        self.dead_letter_url: str | None = None
        if redrive:
            dead = self.client.create_queue(
                QueueName=f"dl-{uuid.uuid4().hex[:12]}" + (".fifo" if fifo else ""),
                Attributes=attributes)["QueueUrl"]
            arn = self.client.get_queue_attributes(
                QueueUrl=dead, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
            attributes = {**attributes, "RedrivePolicy": json.dumps(
                {"deadLetterTargetArn": arn, "maxReceiveCount": "2"})}
            self.dead_letter_url = dead
        self.url = self.client.create_queue(QueueName=self.name,
                                            Attributes=attributes)["QueueUrl"]
        self.sent = 0

    def push(self, body: str | dict[str, Any], group: str | None = None) -> str:
        text = body if isinstance(body, str) else json.dumps(body)
        extra: dict[str, str] = {}
        if self.fifo:
            extra = {"MessageGroupId": group or uuid.uuid4().hex,
                     "MessageDeduplicationId": uuid.uuid4().hex}
        self.sent += 1
        return str(self.client.send_message(QueueUrl=self.url, MessageBody=text,
                                            **extra)["MessageId"])

    def counts(self) -> tuple[int, int]:
        """(visible, in flight) messages of the queue, as moto counts them at this moment:
        exact only while no message's visibility timeout runs out (see :meth:`remaining`)."""
        attributes = self.client.get_queue_attributes(QueueUrl=self.url, AttributeNames=[
            "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
        return (int(attributes["ApproximateNumberOfMessages"]),
                int(attributes["ApproximateNumberOfMessagesNotVisible"]))

    def remaining(self, timeout: float = 120) -> int:
        """Messages not deleted (not acknowledged), with no consumer running (after a kill,
        after a crawl). moto counts the visible messages, then those in flight, reading the
        clock again for each message: a message whose visibility timeout runs out in
        between is in neither count (a killed worker's messages all do, in the timeout
        after the kill). So the count is taken once no message is in flight: then every
        message is visible and stays so, and the count is exact."""
        from crawling import wait_for

        wait_for(lambda: self.counts()[1] == 0, timeout,
                 "the messages in flight visible again (their visibility timeout run out)")
        return self.counts()[0]

    def held_bodies(self) -> list[str]:
        """The bodies of the messages not deleted, from moto's own list (its server runs in
        this process): what the queue holds, without a receive that would change it."""
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.sqs.models import sqs_backends

        queue = sqs_backends[DEFAULT_ACCOUNT_ID][self.client.meta.region_name].queues[self.name]
        return [message.body for message in list(queue._messages)]

    def all_acknowledged(self) -> bool:
        """Every message deleted (no consumer running): none counted now, nor once none is
        in flight (:meth:`remaining`)."""
        return self.counts() == (0, 0) and self.remaining() == 0

    def receive_all(self, url: str) -> list[dict[str, Any]]:
        """Every message of another queue (the parked one, the dead-letter one)."""
        found: list[dict[str, Any]] = []
        while True:
            messages = self.client.receive_message(
                QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=60).get("Messages", [])
            if not messages:
                return found
            found += messages


@pytest.fixture(scope="session")
def sqs_server() -> Iterator[SqsServer]:
    pytest.importorskip("boto3", reason=INSTALL)
    pytest.importorskip("moto.server", reason=INSTALL)
    saved = {name: os.environ.get(name) for name in ENVIRONMENT}
    os.environ.update(ENVIRONMENT)
    server = SqsServer()
    try:
        yield server
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
