"""The queue-input contract: what :class:`~scrapy_idempotent.queue_input.QueueInput` asks of a
broker, and the message format every broker shares.

A broker (:class:`QueueBroker`) is called only on the queue input's own thread, one call after
the other in the order they were made, never on the reactor; its calls block. It:

* **takes a batch** (:meth:`~QueueBroker.take`): up to ``room`` messages this consumer holds
  unacknowledged from then on, taking over the messages of dead consumers where the broker
  does not hand them out again by itself (Redis streams: ``XCLAIM``/``XAUTOCLAIM``; SQS hands
  out a message again once its visibility timeout expires, RabbitMQ once its consumer's
  connection is gone);
* **extends** (:meth:`~QueueBroker.extend`) the invisibility of the messages whose requests are
  still in progress, so a slow request (or one waiting long in the frontier) keeps its
  message: SQS, the visibility timeout; Redis, the pending entry's idle time, by which
  another consumer's ``XAUTOCLAIM`` takes messages over; a no-op for RabbitMQ, where a held
  message is handed out again only once its consumer's connection is gone;
* **acknowledges** (:meth:`~QueueBroker.ack`) a message once its request is done, that is
  after the :data:`~scrapy_idempotent.signals.request_done` signal, so after the commit, never
  before;
* **parks** (:meth:`~QueueBroker.park`) a message that is not a request this crawl can make,
  with its error, where operators find it (a parked stream, a parked queue, a dead-letter
  exchange, a parked topic), and no longer holds it.

A message is read as fields (:data:`Fields`): ``{"url": URL}``, ``{"request": JSON object}``
or ``{"stop": ...}``; :func:`fields_from_body` turns a message body (SQS, RabbitMQ, Kafka)
into them.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

__all__ = ["Fields", "QueueBroker", "QueueDepth", "Taken", "fields_from_body"]

#: A message as fields (a Redis stream entry's, or a body's: :func:`fields_from_body`).
Fields = Mapping[str, str]


@dataclass
class Taken:
    """What :meth:`QueueBroker.take` got."""

    #: the messages taken, (id, fields), held by this consumer until acknowledged or parked
    entries: list[tuple[str, Fields]] = field(default_factory=list)
    claimed: int = 0  #: how many of them were taken over from another consumer
    #: ids held before that this consumer no longer holds (a connection lost: the broker
    #: delivers them again); never acknowledged
    lost: list[str] = field(default_factory=list)
    error: BaseException | None = None  #: the broker error that ended the take early
    #: the broker cannot tell yet whether messages wait for this consumer (a Kafka group
    #: rebalancing, or joined and not assigned yet): not an empty queue
    settling: bool = False


@dataclass(frozen=True)
class QueueDepth:
    """What a broker tells of its queue (:meth:`QueueBroker.depth`); None: it cannot tell."""

    waiting: int | None = None  #: messages no consumer has taken yet
    held: int | None = None  #: taken by a consumer, not acknowledged yet
    parked: int | None = None  #: messages parked (the parked stream or queue, the DLQ)


class QueueBroker(abc.ABC):
    """One broker's side of the queue input (see the module docstring). Every method runs
    on the queue input's thread, never on the reactor."""

    #: the broker's name in log lines ("Redis queue 'key': ...")
    kind: ClassVar[str]
    #: the stat counting its failed calls
    error_stat: ClassVar[str]

    def __init__(self, consumer: str) -> None:
        self.consumer = consumer  #: this worker's consumer name (a worker id)

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The queue's name in log lines."""

    @property
    @abc.abstractmethod
    def parked_name(self) -> str:
        """Where parked messages go, for log lines."""

    def describe(self) -> str:
        """The queue and this consumer, for the log line at start."""
        return f"the {self.kind} queue {self.name!r} (consumer {self.consumer})"

    @abc.abstractmethod
    def take(self, room: int, read: bool, known: frozenset[str]) -> Taken:
        """Up to ``room`` messages (``room`` may be 0: then only the broker's own upkeep);
        new ones only when ``read``; none of ``known`` (held already). Never raises: an
        error is returned in :attr:`Taken.error` with what was taken until then."""

    def extend(self, ids: list[str]) -> None:  # noqa: B027  (a no-op unless overridden)
        """Keep the held messages ``ids`` (their requests in progress) from being handed to
        another consumer. Called every poll; a broker extends only those that need it."""

    @abc.abstractmethod
    def ack(self, ids: list[str]) -> int:
        """Acknowledge ``ids`` (their requests are committed); how many were."""

    @abc.abstractmethod
    def park(self, message_id: str, fields: Fields, error: str) -> None:
        """Move the bad message ``message_id`` where operators find it, with ``error``; it
        is no longer held by this consumer."""

    def upkeep(self) -> Taken:
        """Called at every poll that takes nothing (the crawl is finishing): the broker's own
        upkeep (Kafka serves its consumer group there, which it must keep doing). Messages
        held that the broker gave up come back in :attr:`Taken.lost`. Never raises."""
        return Taken()

    def close(self) -> None:  # noqa: B027  (nothing to close unless overridden)
        """Close the connection (after the last acknowledgements)."""

    def depth(self) -> QueueDepth:
        """How many messages wait, are held and are parked, as far as the broker tells, read
        with a few cheap calls (for monitoring: ``scrapy idempotent metrics``). Raises the
        broker's error when it cannot be reached."""
        return QueueDepth()


def fields_from_body(body: bytes | str) -> dict[str, str]:
    """The fields of a message body: a JSON object is a request (``{"url": ..., "callback":
    ...}``, the keys of a ``request`` field), ``{"stop": ...}`` the stop message; any other
    text is a URL. A body that starts like JSON but does not parse is a request that
    :func:`~scrapy_idempotent.queue_input.request_from_message` refuses (parked)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return {"url": stripped}
    try:
        data = json.loads(stripped)
    except ValueError:
        return {"request": stripped}
    if isinstance(data, dict) and set(data) == {"stop"}:
        return {"stop": "1"}
    return {"request": stripped}
