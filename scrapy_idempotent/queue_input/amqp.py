"""The RabbitMQ broker of the queue input (``IDEMPOTENT_QUEUE_URL = "amqp://..."``; pika).

The worker consumes the queue ``IDEMPOTENT_QUEUE_KEY`` (declared durable if missing, with the
dead-letter exchange ``<key>:parked``, a fanout bound to the queue ``<key>:parked``) with
manual acknowledgements and a prefetch of ``IDEMPOTENT_QUEUE_PREFETCH`` (``basic.qos``): the
broker never hands it more unacknowledged messages than that. A message is acknowledged
(``basic.ack``) only once its request is done, after the commit; a bad message is rejected
without requeueing (``basic.nack``), so RabbitMQ dead-letters it to the parked queue (its
``x-death`` header says why; the error is in the worker's log). A queue that exists already
with other arguments is consumed as it is: bad messages then go to its own dead-letter
exchange, if it has one.

RabbitMQ hands a message out again by itself once its consumer's connection or channel is
gone (a killed worker, a cut connection, a broker restart): marked ``redelivered``, it is a
request the frontier knows (no second record). A connection lost is opened again at the next
poll, the messages held on it forgotten (acknowledging them on a new channel is impossible:
they come again, with new delivery tags). A consumer cancelled by the broker (its queue
deleted, a node of a cluster gone) is declared and consumed again.

pika's ``BlockingConnection`` is used on the queue input's thread only (it is not thread
safe); every poll processes its I/O events, which also answers the broker's heartbeats.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from ..config import QueueConfig
from .broker import Fields, QueueBroker, QueueDepth, Taken, fields_from_body

__all__ = ["AmqpBroker"]

logger = logging.getLogger("scrapy_idempotent.queue_input")

#: The longest wait between two attempts to connect again (from 0.5 s, doubled each time).
_LONGEST_RECONNECT_WAIT = 5.0


class AmqpBroker(QueueBroker):
    """A consumer of a RabbitMQ queue (see the module docstring)."""

    kind = "RabbitMQ"
    error_stat = "idempotent/queue/amqp_errors"

    def __init__(self, config: QueueConfig, consumer: str, parameters: Any) -> None:
        super().__init__(consumer)
        self.config = config
        self.parameters = parameters
        self.queue = config.key
        self.dead_letter_exchange = config.parked_key
        self.parked_queue = config.parked_key
        self._connection: Any = None
        self._channel: Any = None
        self._generation = 0  #: of the connection: a message id is "<generation>.<tag>"
        self._opened_before = False
        self._cancelled = False
        self._buffer: list[tuple[str, Fields]] = []  #: delivered, not handed out yet
        self._redelivered: set[str] = set()
        self._held: set[str] = set()  #: delivered on this connection, not settled
        self._reconnect_at = 0.0  #: no attempt to connect before (monotonic)
        self._reconnect_wait = 0.0
        self._connect_error: BaseException | None = None

    @classmethod
    def from_config(cls, config: QueueConfig, consumer: str) -> AmqpBroker:
        import pika  # type: ignore[import-untyped,import-not-found,unused-ignore]

        parameters = pika.URLParameters(config.url)
        parameters.connection_attempts = 1
        parameters.socket_timeout = 10
        parameters.blocked_connection_timeout = 30
        parameters.client_properties = {"connection_name": consumer}
        return cls(config, consumer, parameters)

    @property
    def name(self) -> str:
        return self.queue

    @property
    def parked_name(self) -> str:
        return (f"the dead-letter exchange {self.dead_letter_exchange!r} (queue "
                f"{self.parked_queue!r})")

    def describe(self) -> str:
        return f"the RabbitMQ queue {self.queue!r} (consumer {self.consumer})"

    # -- the contract -----------------------------------------------------------------------

    def take(self, room: int, read: bool, known: frozenset[str]) -> Taken:
        taken = Taken()
        try:
            if self._connection is None or not self._connection.is_open:
                taken.lost += self._lose()
                if self._connect_error is not None and time.monotonic() < self._reconnect_at:
                    taken.error = self._connect_error  # not again yet (backing off)
                    return taken
                try:
                    self._open()
                except Exception as exc:
                    self._reconnect_wait = min(_LONGEST_RECONNECT_WAIT,
                                               max(0.5, self._reconnect_wait * 2))
                    self._reconnect_at = time.monotonic() + self._reconnect_wait
                    self._connect_error = exc
                    raise
                self._connect_error, self._reconnect_wait = None, 0.0
            elif self._cancelled:
                logger.warning("scrapy_idempotent: RabbitMQ queue %r: the broker cancelled "
                               "this consumer (the queue deleted, or its node gone): "
                               "declaring and consuming it again", self.queue)
                self._consume()
            self._connection.process_data_events(time_limit=0)
        except Exception as exc:
            taken.error = exc
            taken.lost += self._lose()
            return taken
        if read and room > 0:
            handed, self._buffer = self._buffer[:room], self._buffer[room:]
            taken.entries = handed
            taken.claimed = sum(1 for message_id, _ in handed
                                if message_id in self._redelivered)
            self._redelivered.difference_update(i for i, _ in handed)
        return taken

    def ack(self, ids: list[str]) -> int:
        acked = 0
        try:
            for message_id in ids:
                tag = self._current_tag(message_id)
                if tag is None:
                    continue  # held on a lost connection: delivered again, acked then
                self._channel.basic_ack(delivery_tag=tag)
                self._held.discard(message_id)
                acked += 1
        except Exception:
            self._lose()
            raise
        return acked

    def park(self, message_id: str, fields: Fields, error: str) -> None:
        tag = self._current_tag(message_id)
        if tag is None:
            return  # held on a lost connection: delivered again (and parked then)
        try:
            self._channel.basic_nack(delivery_tag=tag, requeue=False)
        except Exception:
            self._lose()
            raise
        self._held.discard(message_id)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing only
            if self._connection is not None and self._connection.is_open:
                self._connection.close()
        self._connection = self._channel = None

    def depth(self) -> QueueDepth:
        """The ready messages of the queue and of the parked queue (passive declares on a
        connection of its own, closed after; a queue not declared yet holds none). RabbitMQ
        tells unacknowledged messages only through its management API: not read."""
        import pika

        connection = pika.BlockingConnection(self.parameters)
        try:
            counts = []
            channel = connection.channel()
            for queue in (self.queue, self.parked_queue):
                try:
                    counts.append(int(channel.queue_declare(
                        queue, passive=True).method.message_count))
                except pika.exceptions.ChannelClosedByBroker as exc:
                    if exc.reply_code != 404:  # NOT_FOUND: not declared yet
                        raise
                    counts.append(0)
                    channel = connection.channel()
        finally:
            with contextlib.suppress(Exception):  # closing only
                connection.close()
        return QueueDepth(waiting=counts[0], parked=counts[1])

    # -- RabbitMQ ---------------------------------------------------------------------------

    def _open(self) -> None:
        import pika

        self._generation += 1
        self._connection = pika.BlockingConnection(self.parameters)
        channel = self._connection.channel()
        channel.exchange_declare(self.dead_letter_exchange, exchange_type="fanout",
                                 durable=True)
        channel.queue_declare(self.parked_queue, durable=True)
        channel.queue_bind(self.parked_queue, self.dead_letter_exchange)
        self._channel = channel
        self._declare()
        self._channel.basic_qos(prefetch_count=self.config.prefetch)
        self._channel.add_on_cancel_callback(self._on_cancel)
        self._consume(declare=False)
        if self._opened_before:
            logger.info("scrapy_idempotent: RabbitMQ queue %r: connected again",
                        self.queue)
        self._opened_before = True

    def _declare(self) -> None:
        import pika

        try:
            self._channel.queue_declare(
                self.queue, durable=True,
                arguments={"x-dead-letter-exchange": self.dead_letter_exchange})
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != 406:  # PRECONDITION_FAILED: declared with other arguments
                raise
            self._channel = self._connection.channel()
            self._channel.queue_declare(self.queue, passive=True)
            logger.warning("scrapy_idempotent: RabbitMQ queue %r exists with arguments of its "
                           "own: it is consumed as it is, and bad messages go to its own "
                           "dead-letter exchange (none: RabbitMQ drops them)", self.queue)

    def _consume(self, declare: bool = True) -> None:
        if declare:
            self._declare()
        self._cancelled = False
        self._channel.basic_consume(self.queue, self._on_message, auto_ack=False)

    def _on_message(self, channel: Any, method: Any, properties: Any, body: bytes) -> None:
        message_id = f"{self._generation}.{method.delivery_tag}"
        self._held.add(message_id)
        if method.redelivered:
            self._redelivered.add(message_id)
        self._buffer.append((message_id, fields_from_body(body)))

    def _on_cancel(self, frame: Any) -> None:
        self._cancelled = True

    def _current_tag(self, message_id: str) -> int | None:
        generation, _, tag = message_id.partition(".")
        if int(generation) != self._generation or self._channel is None \
                or not self._channel.is_open:
            return None
        return int(tag)

    def _lose(self) -> list[str]:
        """The connection is gone (or broken: closed now): the messages it held, which the
        broker delivers again."""
        lost = sorted(self._held)
        self._held.clear()
        self._buffer.clear()
        self._redelivered.clear()
        with contextlib.suppress(Exception):
            if self._connection is not None and self._connection.is_open:
                self._connection.close()
        self._connection = self._channel = None
        return lost
