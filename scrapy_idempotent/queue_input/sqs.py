"""The SQS broker of the queue input (``IDEMPOTENT_QUEUE_URL = "sqs://name"`` or the queue's
``https://`` URL; boto3).

Messages are received with long polling (``WaitTimeSeconds``: ``IDEMPOTENT_QUEUE_WAIT_SECONDS``,
at most 20, so a poll is bounded) and a visibility timeout of
``IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS``. While a message's request is in progress its
visibility timeout is extended again (``ChangeMessageVisibilityBatch``) every third of that
time: the heartbeat AWS recommends, so a request slower than the timeout keeps its message,
and a worker that dies stops extending it: the message is received again by another worker
(or the next one) once the timeout runs out. A message is deleted (``DeleteMessageBatch``)
only once its request is done, after the commit. Standard and FIFO queues alike (a FIFO
queue hands out a message group's next message only once the one before is deleted).

A message that is not a request is left to the queue's redrive policy when it has one (made
visible again at once, so its receive count reaches ``maxReceiveCount`` and SQS moves it to
the dead-letter queue); otherwise it is sent to the parked queue ``<name>-parked`` (FIFO:
``<name>-parked.fifo``, created if missing) as a JSON body ``{"id", "body", "error",
"consumer"}``, then deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..config import QueueConfig
from .broker import Fields, QueueBroker, QueueDepth, Taken, fields_from_body

__all__ = ["SqsBroker", "sqs_queue_location"]

logger = logging.getLogger("scrapy_idempotent.queue_input")

#: SQS's most messages per receive, delete or visibility call.
_BATCH = 10
#: SQS's longest visibility timeout (12 hours).
_LONGEST_VISIBILITY = 43200
_AWS_HOST = re.compile(r"^(?:sqs\.([a-z0-9-]+)|([a-z0-9-]+)\.queue)\.amazonaws\.com(?:\.cn)?$")


def sqs_queue_location(url: str) -> tuple[str, str | None, str | None, str | None]:
    """``(name, queue_url, region, endpoint_url)`` of an ``IDEMPOTENT_QUEUE_URL``:
    ``sqs://name[?region=...&endpoint_url=...]`` (its queue URL asked of SQS), or a queue URL
    ``https://sqs.<region>.amazonaws.com/<account>/<name>`` (any other host is taken as the
    endpoint: LocalStack, moto)."""
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if parts.scheme == "sqs":
        name = (parts.netloc + parts.path).strip("/").split("/")[-1]
        return name, None, query.get("region"), query.get("endpoint_url")
    name = parts.path.strip("/").split("/")[-1]
    queue_url = f"{parts.scheme}://{parts.netloc}{parts.path}"
    aws = _AWS_HOST.match(parts.hostname or "")
    if aws:
        return name, queue_url, aws.group(1) or aws.group(2), None
    return name, queue_url, query.get("region"), f"{parts.scheme}://{parts.netloc}"


class SqsBroker(QueueBroker):
    """A consumer of an SQS queue (see the module docstring)."""

    kind = "SQS"
    error_stat = "idempotent/queue/sqs_errors"

    def __init__(self, config: QueueConfig, consumer: str, client: Any, name: str,
                 queue_url: str | None) -> None:
        super().__init__(consumer)
        self.config = config
        self.client = client
        self.queue_name = name
        self.queue_url = queue_url
        self.fifo = name.endswith(".fifo")
        self.visibility = min(_LONGEST_VISIBILITY, max(1, math.ceil(config.claim_idle_seconds)))
        self._handles: dict[str, str] = {}  #: message id -> its latest receipt handle
        self._bodies: dict[str, str] = {}  #: message id -> body (to park it)
        self._groups: dict[str, str] = {}  #: message id -> MessageGroupId (FIFO)
        self._extended_at: dict[str, float] = {}  #: message id -> when made invisible
        self._redrive: bool | None = None  #: the queue has a redrive policy (None: not asked)
        self._parked_url: str | None = None

    @classmethod
    def from_config(cls, config: QueueConfig, consumer: str) -> SqsBroker:
        import boto3  # type: ignore[import-untyped,import-not-found,unused-ignore]
        from botocore.config import Config  # type: ignore[import-untyped,import-not-found,unused-ignore]

        name, queue_url, region, endpoint = sqs_queue_location(config.url)
        if region is None and not (os.environ.get("AWS_REGION")
                                   or os.environ.get("AWS_DEFAULT_REGION")):
            session_region = boto3.session.Session().region_name
            region = session_region or ("us-east-1" if endpoint else None)
        client = boto3.client(
            "sqs", region_name=region, endpoint_url=endpoint,
            config=Config(connect_timeout=10, read_timeout=config.wait_seconds + 10,
                          retries={"max_attempts": 2, "mode": "standard"}))
        return cls(config, consumer, client, name, queue_url)

    @property
    def name(self) -> str:
        return self.queue_name

    @property
    def parked_name(self) -> str:
        if self._redrive:
            return "the dead-letter queue of its redrive policy (left to it)"
        return repr(self._parked_queue_name())

    def _parked_queue_name(self) -> str:
        base = self.queue_name[:-len(".fifo")] if self.fifo else self.queue_name
        return f"{base}-parked" + (".fifo" if self.fifo else "")

    # -- the contract -----------------------------------------------------------------------

    def take(self, room: int, read: bool, known: frozenset[str]) -> Taken:
        taken = Taken()
        try:
            self._open()
            wait = int(self.config.wait_seconds)
            held = set(known)  # held already, or taken by this call
            while read and room > 0:
                if wait == 0:
                    # the receives before may have taken longer than a third of the timeout
                    self.extend(sorted(held))
                reply = self.client.receive_message(
                    QueueUrl=self.queue_url, MaxNumberOfMessages=min(_BATCH, room),
                    WaitTimeSeconds=wait, VisibilityTimeout=self.visibility,
                    MessageSystemAttributeNames=["ApproximateReceiveCount", "MessageGroupId"])
                messages = reply.get("Messages", [])
                now = time.monotonic()
                new = 0
                for message in messages:
                    message_id = message["MessageId"]
                    # the latest receipt's handle: the one that deletes it
                    self._handles[message_id] = message["ReceiptHandle"]
                    self._extended_at[message_id] = now
                    if message_id in held:
                        # received again while this worker holds it (its timeout ran out
                        # before an extension): still this worker's, taken once
                        continue
                    held.add(message_id)
                    body = message.get("Body", "")
                    self._bodies[message_id] = body
                    attributes = message.get("Attributes", {})
                    if "MessageGroupId" in attributes:
                        self._groups[message_id] = attributes["MessageGroupId"]
                    if int(attributes.get("ApproximateReceiveCount", "1")) > 1:
                        taken.claimed += 1  # a dead (or too slow) consumer's, delivered again
                    taken.entries.append((message_id, fields_from_body(body)))
                    room -= 1
                    new += 1
                if len(messages) < _BATCH or not new:
                    break  # no more for now (or only those held again)
                wait = 0  # more at once: no waiting for the rest
        except Exception as exc:
            taken.error = exc
        return taken

    def extend(self, ids: list[str]) -> None:
        now = time.monotonic()
        due = [i for i in ids if i in self._handles
               and now - self._extended_at.get(i, 0.0) >= self.visibility / 3]
        for start in range(0, len(due), _BATCH):
            chunk = due[start:start + _BATCH]
            reply = self.client.change_message_visibility_batch(
                QueueUrl=self.queue_url, Entries=[
                    {"Id": str(n), "ReceiptHandle": self._handles[i],
                     "VisibilityTimeout": self.visibility} for n, i in enumerate(chunk)])
            for entry in reply.get("Successful", []):
                self._extended_at[chunk[int(entry["Id"])]] = now
            for entry in reply.get("Failed", []):
                logger.warning("scrapy_idempotent: SQS queue %r: cannot extend the visibility "
                               "of message %s (%s): another worker may receive it (its "
                               "request is one frontier entry all the same)", self.queue_name,
                               chunk[int(entry["Id"])], entry.get("Message") or entry["Code"])

    def ack(self, ids: list[str]) -> int:
        held = [i for i in ids if i in self._handles]
        acked = 0
        for start in range(0, len(held), _BATCH):
            chunk = held[start:start + _BATCH]
            reply = self.client.delete_message_batch(
                QueueUrl=self.queue_url, Entries=[
                    {"Id": str(n), "ReceiptHandle": self._handles[i]}
                    for n, i in enumerate(chunk)])
            for entry in reply.get("Successful", []):
                self._drop(chunk[int(entry["Id"])])
                acked += 1
            retry = []
            for entry in reply.get("Failed", []):
                message_id = chunk[int(entry["Id"])]
                if entry.get("SenderFault") and entry["Code"] != "InternalError":
                    # a receipt handle no longer valid: the message was received again
                    # elsewhere, which deletes it after its own request is done
                    logger.warning("scrapy_idempotent: SQS queue %r: message %s not deleted "
                                   "(%s)", self.queue_name, message_id,
                                   entry.get("Message") or entry["Code"])
                    self._drop(message_id)
                else:
                    retry.append(message_id)
            if retry:
                raise RuntimeError(f"SQS could not delete {len(retry)} message(s) now")
        return acked

    def park(self, message_id: str, fields: Fields, error: str) -> None:
        self._open()
        if self._redrive:
            # visible again at once: received again until its receive count moves it to the
            # dead-letter queue
            self.client.change_message_visibility(
                QueueUrl=self.queue_url, ReceiptHandle=self._handles[message_id],
                VisibilityTimeout=0)
            self._drop(message_id)
            return
        if self._parked_url is None:
            attributes = {"FifoQueue": "true"} if self.fifo else {}
            self._parked_url = self.client.create_queue(
                QueueName=self._parked_queue_name(), Attributes=attributes)["QueueUrl"]
        body = json.dumps({"id": message_id, "body": self._bodies.get(message_id, ""),
                           "error": error, "consumer": self.consumer}, sort_keys=True)
        extra: dict[str, str] = {}
        if self.fifo:
            extra = {"MessageGroupId": self._groups.get(message_id, "parked"),
                     "MessageDeduplicationId": hashlib.sha256(
                         message_id.encode()).hexdigest()}
        self.client.send_message(QueueUrl=self._parked_url, MessageBody=body, **extra)
        self.client.delete_message(QueueUrl=self.queue_url,
                                   ReceiptHandle=self._handles[message_id])
        self._drop(message_id)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing only
            self.client.close()

    def depth(self) -> QueueDepth:
        """The queue's approximate counts (visible: waiting; in flight: held), and those of
        the parked queue or of the redrive policy's dead-letter queue (0 while it does not
        exist): at most three calls."""
        self._open()
        attributes = self.client.get_queue_attributes(
            QueueUrl=self.queue_url, AttributeNames=[
                "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
                "RedrivePolicy"]).get("Attributes", {})
        policy = attributes.get("RedrivePolicy")
        parked_name = (str(json.loads(policy).get("deadLetterTargetArn", "")).rpartition(":")[2]
                       if policy else self._parked_queue_name())
        try:
            parked_url = self.client.get_queue_url(QueueName=parked_name)["QueueUrl"]
        except self.client.exceptions.QueueDoesNotExist:
            parked = 0
        else:
            counts = self.client.get_queue_attributes(
                QueueUrl=parked_url, AttributeNames=[
                    "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
            ).get("Attributes", {})
            parked = sum(int(counts.get(name, 0)) for name in (
                "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"))
        return QueueDepth(waiting=int(attributes.get("ApproximateNumberOfMessages", 0)),
                          held=int(attributes.get("ApproximateNumberOfMessagesNotVisible", 0)),
                          parked=parked)

    # -- SQS --------------------------------------------------------------------------------

    def _open(self) -> None:
        """The queue URL (asked for ``sqs://name``) and whether it has a redrive policy."""
        if self.queue_url is None:
            self.queue_url = self.client.get_queue_url(QueueName=self.queue_name)["QueueUrl"]
        if self._redrive is None:
            attributes = self.client.get_queue_attributes(
                QueueUrl=self.queue_url, AttributeNames=["RedrivePolicy"]).get("Attributes", {})
            self._redrive = bool(attributes.get("RedrivePolicy"))

    def _drop(self, message_id: str) -> None:
        for held in (self._handles, self._bodies, self._groups, self._extended_at):
            held.pop(message_id, None)

    def describe(self) -> str:
        return (f"the SQS queue {self.queue_name!r} ({'FIFO' if self.fifo else 'standard'}; "
                f"consumer {self.consumer})")
