"""The Kafka broker of the queue input (``IDEMPOTENT_QUEUE_URL = "kafka://host:port/topic"``;
confluent-kafka, that is librdkafka).

Each worker is a member of the consumer group ``IDEMPOTENT_QUEUE_GROUP`` subscribed to the
topic; the group hands each partition to one member. Offsets are committed by the queue input
only (``enable.auto.commit`` off), per partition, and only up to the oldest message of that
partition whose request is not done: a message's request is done once its page, records and
completion are committed to the frontier (or it was done already), its bad message parked, or
its stop message's crawl finished. Messages complete out of order (a slow page, a request
another worker holds); the committed offset waits for the oldest one, then jumps past every
message done behind it. So a committed offset never passes a message whose page is not
durable; what a kill or a rebalance repeats is what was read after the oldest unfinished
message of each partition, and the frontier makes that harmless (a done request is
acknowledged without a fetch).

Commits are asynchronous while the partitions are this worker's (a failed one is sent again
at the next poll), synchronous when they are given up: in a rebalance (``on_revoke``: what
may be committed is, then the messages held are forgotten, delivered again to the partition's
next owner) and at the close. Partitions lost without a revoke (``on_lost``: the session
timed out) commit nothing.

The consumer is called at every poll of the queue input (``IDEMPOTENT_QUEUE_POLL_SECONDS``),
whatever the pages do, which keeps the member within ``max.poll.interval.ms``: while the
worker holds ``IDEMPOTENT_QUEUE_PREFETCH`` messages, or reads nothing more (a stop message
read), its partitions are paused and the poll only serves the group (heartbeats,
rebalances). librdkafka keeps a partition paused across a revoke, so after every assignment
the next poll pauses or resumes the whole assignment (a partition paused before a rebalance
and assigned again would otherwise never be read). A message the client returns that the
worker has no room for is kept here, unacknowledged, until there is.

Each commit is logged at DEBUG, its answer too; the first offset read from each partition
after an assignment, each revoke with the offsets committed by then, and a commit refused
because a rebalance moved on, at INFO. ``group.instance.id`` (static membership) is refused:
every worker reads the same URL, so all would be one static member.

A bad message is produced to the topic ``<topic>-parked`` (created if missing) as JSON,
``{"id", "topic", "partition", "offset", "key", "body", "error", "consumer"}``, waited for
(acknowledged by the broker), then counted as done. A parked message that could not be sent
is sent again at the next poll: its offset holds its partition's commit until then.

The client is used on the queue input's thread only; librdkafka's own log lines go to the
``scrapy_idempotent.queue_input.kafka.librdkafka`` logger at DEBUG. An error the client
reports by itself (it recovers from most) makes the next poll ask for the topic's metadata;
only if that fails too is it the poll's error (logged once by the queue input, counted in
``idempotent/queue/kafka_errors``), as a failed read or commit is.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from .._kafka_url import RESERVED_OPTIONS, parse_kafka_url, redacted_kafka_url
from ..config import QueueConfig
from ..exceptions import ConfigError
from .broker import Fields, QueueBroker, Taken, fields_from_body

__all__ = ["KafkaBroker"]

logger = logging.getLogger("scrapy_idempotent.queue_input")

#: Options of the consumer alone: not given to the producer that parks bad messages (it would
#: log that it ignores them).
_CONSUMER_ONLY = frozenset({
    "session.timeout.ms", "heartbeat.interval.ms", "max.poll.interval.ms",
    "auto.offset.reset", "partition.assignment.strategy", "group.instance.id",
    "group.protocol", "group.protocol.type", "group.remote.assignor", "isolation.level",
    "enable.partition.eof", "check.crcs", "fetch.wait.max.ms", "fetch.min.bytes",
    "fetch.max.bytes", "fetch.message.max.bytes", "fetch.error.backoff.ms",
    "fetch.queue.backoff.ms", "queued.min.messages", "queued.max.messages.kbytes",
    "coordinator.query.interval.ms", "auto.commit.interval.ms", "allow.auto.create.topics"})
#: Commit errors of a member whose partitions a rebalance moved on: not errors (the
#: partitions' next owner commits them).
_REBALANCED = frozenset({"REBALANCE_IN_PROGRESS", "ILLEGAL_GENERATION", "UNKNOWN_MEMBER_ID",
                         "_ASSIGNMENT_LOST", "_NO_OFFSET", "FENCED_INSTANCE_ID",
                         "STALE_MEMBER_EPOCH"})
#: The longest a metadata request (is the cluster reachable, does the topic exist) waits.
_METADATA_SECONDS = 5.0
#: The longest a parked message's delivery, or the commits at a rebalance or the close, wait.
_DELIVERY_SECONDS = 10.0


@dataclass
class _Partition:
    """An assigned partition's reading: what is held, how far it was read and committed."""

    #: offsets of messages read and not done (handed to the crawl, or kept here for lack of
    #: room): the committed offset never passes the lowest
    held: set[int] = field(default_factory=set)
    next_offset: int | None = None  #: the offset after the last message read
    committed: int | None = None  #: the offset last sent to be committed (None: none yet)


@dataclass(frozen=True)
class _Held:
    """A message held: as read (to park it)."""

    partition: int
    offset: int
    key: bytes | None
    body: bytes


class _DebugLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """librdkafka's log lines, at DEBUG whatever their level: its errors reach the queue
    input through the error callback (logged once, counted)."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        super().log(logging.DEBUG, msg, *args, **kwargs)


def _message_id(topic: str, partition: int, offset: int) -> str:
    return f"{topic}/{partition}/{offset}"


def _offsets(partitions: list[Any]) -> str:
    """``partition:offset, ...`` of TopicPartitions, for log lines."""
    return ", ".join(f"{tp.partition}:{tp.offset}" for tp in partitions)


class KafkaBroker(QueueBroker):
    """A member of a Kafka consumer group reading one topic (see the module docstring)."""

    kind = "Kafka"
    error_stat = "idempotent/queue/kafka_errors"

    def __init__(self, config: QueueConfig, consumer: str, options: dict[str, str]) -> None:
        super().__init__(consumer)
        self.config = config
        self.topic = config.key
        self.parked_topic = config.parked_key
        self.options = options  #: the client's options (the URL's, with the servers)
        self.client: Any = None  #: the confluent_kafka Consumer, made at the first take
        self._producer: Any = None
        self._partitions: dict[int, _Partition] = {}
        self._held: dict[str, _Held] = {}  #: read, not done: by id
        self._kept: list[tuple[str, Fields]] = []  #: read, no room for them yet (held)
        self._lost: list[str] = []  #: ids handed out and given up since the last take
        self._settled = False  #: an assignment is known (after a revoke: once assigned again)
        self._paused = False
        self._errors: list[Any] = []  #: errors met since the last take (reads, commits)
        #: the last error the client reported by itself (a broker not reachable, a failed
        #: authentication...): a metadata request must answer before reading on
        self._client_error: Any = None
        self._check_reachable = False
        self._owed_parks: dict[str, str] = {}  #: bad messages not parked yet: id -> error

    @classmethod
    def from_config(cls, config: QueueConfig, consumer: str) -> KafkaBroker:
        """The broker of ``config``: its URL's options checked by the client now (a
        :class:`~.ConfigError` naming ``IDEMPOTENT_QUEUE_URL`` for a wrong one), before the
        crawl starts."""
        from confluent_kafka import Consumer, KafkaException  # type: ignore[import-untyped,import-not-found,unused-ignore]

        url = parse_kafka_url(config.url)
        for name in url.options:
            if name in RESERVED_OPTIONS:
                raise ConfigError("IDEMPOTENT_QUEUE_URL", redacted_kafka_url(config.url),
                                  f"the option {name} is the queue input's own "
                                  f"({RESERVED_OPTIONS[name]})")
        if "group.instance.id" in url.options:
            raise ConfigError("IDEMPOTENT_QUEUE_URL", redacted_kafka_url(config.url),
                              "no group.instance.id (static membership): every worker reads "
                              "the same URL, so all would join as one static member and the "
                              "group would fence all but one of them out")
        options = {"bootstrap.servers": url.servers, "client.id": consumer,
                   "auto.offset.reset": "earliest", **url.options}
        broker = cls(config, consumer, options)
        try:  # the client checks every option's name and value (no connection yet)
            Consumer(broker._consumer_options()).close()
        except (KafkaException, ValueError, TypeError) as exc:
            raise ConfigError("IDEMPOTENT_QUEUE_URL", redacted_kafka_url(config.url),
                              f"options the Kafka client takes (librdkafka's): {exc}") from None
        return broker

    @property
    def name(self) -> str:
        return self.topic

    @property
    def parked_name(self) -> str:
        return f"the topic {self.parked_topic!r}"

    def describe(self) -> str:
        return (f"the Kafka topic {self.topic!r} (group {self.config.group!r}, consumer "
                f"{self.consumer}, bootstrap {self.options['bootstrap.servers']})")

    # -- the contract -----------------------------------------------------------------------

    def take(self, room: int, read: bool, known: frozenset[str]) -> Taken:
        """Up to ``room`` messages; the consumer is polled whatever happens before (the group
        served, within ``max.poll.interval.ms``), its partitions paused when nothing is to be
        read."""
        taken = Taken()
        try:
            self._open()
            reachable = self._reachable(taken)
            if reachable:
                self._park_owed(taken)
                self._commit_due()
                if read and room > 0 and self._kept:
                    handed, self._kept = self._kept[:room], self._kept[room:]
                    taken.entries += handed
                    room -= len(handed)
            self._read(room if read and reachable else 0, taken)
        except Exception as exc:
            taken.error = taken.error or exc
        self._after_call(taken)
        return taken

    def upkeep(self) -> Taken:
        """Serve the group (heartbeats, rebalances) with every partition paused: the crawl
        reads nothing more, and the member stays within ``max.poll.interval.ms``."""
        taken = Taken()
        try:
            if self.client is not None:
                if self._reachable(taken):
                    self._park_owed(taken)
                    self._commit_due()
                self._read(0, taken)
        except Exception as exc:
            taken.error = taken.error or exc
        self._after_call(taken)
        return taken

    def ack(self, ids: list[str]) -> int:
        acked = sum(1 for message_id in ids if self._done(message_id))
        if acked and self.client is not None:
            self._commit_due()
        return acked

    def park(self, message_id: str, fields: Fields, error: str) -> None:
        if message_id not in self._held:
            return  # given up in a rebalance: delivered again to the partition's owner
        self._owed_parks[message_id] = error
        taken = Taken()
        self._park_owed(taken)
        if taken.error is not None:
            raise taken.error

    def close(self) -> None:
        """Commit what may be committed (waiting for it), then leave the group (the
        partitions go to the other members at once)."""
        consumer, self.client = self.client, None
        try:
            if consumer is not None:
                self._commit_due(consumer, wait=True)
        except Exception as exc:
            logger.warning("scrapy_idempotent: Kafka topic %r: cannot commit the offsets of "
                           "the messages done before closing (%s): they will be read again",
                           self.topic, exc)
        finally:
            if consumer is not None:
                self._close(consumer)
            if self._producer is not None:
                self._producer.flush(_DELIVERY_SECONDS)
                self._producer = None

    # -- Kafka ------------------------------------------------------------------------------

    def _consumer_options(self) -> dict[str, Any]:
        return {**self.options, "group.id": self.config.group,
                "enable.auto.commit": False, "enable.auto.offset.store": False,
                "on_commit": self._on_commit, "error_cb": self._on_error,
                "logger": _DebugLog(logging.getLogger(f"{__name__}.librdkafka"), {})}

    def _open(self) -> None:
        if self.client is not None:
            return
        from confluent_kafka import Consumer

        self.client = Consumer(self._consumer_options())
        self.client.subscribe([self.topic], on_assign=self._on_assign,
                              on_revoke=self._on_revoke, on_lost=self._on_lost)
        self._settled = self._paused = False

    def _read(self, room: int, taken: Taken) -> None:
        """Up to ``room`` messages into ``taken`` (none: every partition paused, the group
        served); any more the client returns are kept for a later take."""
        assert self.client is not None
        self._pause(room <= 0)
        if room > 0:
            messages = self.client.consume(num_messages=room, timeout=0)
        else:
            message = self.client.poll(0)
            messages = [] if message is None else [message]
        for message in messages:
            error = message.error()
            if error is not None:
                self._errors.append(error)
                continue
            entry = self._hold(message)
            if entry is None:
                continue
            if room > 0:
                taken.entries.append(entry)
                room -= 1
            else:
                self._kept.append(entry)

    def _hold(self, message: Any) -> tuple[str, Fields] | None:
        partition = self._partitions.get(message.partition())
        if partition is None:
            return None  # not this member's (a revoke raced the fetch): not committed here
        offset = int(message.offset())
        body = message.value() or b""
        message_id = _message_id(self.topic, message.partition(), offset)
        if partition.next_offset is None:
            logger.info("scrapy_idempotent: Kafka topic %r: partition %d read from offset %d",
                        self.topic, message.partition(), offset)
        partition.held.add(offset)
        partition.next_offset = max(offset + 1, partition.next_offset or 0)
        self._held[message_id] = _Held(message.partition(), offset, message.key(), body)
        return message_id, fields_from_body(body)

    def _pause(self, pause: bool) -> None:
        """Pause every assigned partition (again at every poll: a partition assigned since
        may be unpaused), or resume them all once room is back (and after any assignment:
        librdkafka keeps a partition paused across a revoke, so a partition paused before a
        rebalance comes back paused; see :meth:`_on_assign`)."""
        assert self.client is not None
        if pause:
            assignment = self.client.assignment()
            if assignment:
                self.client.pause(assignment)
            self._paused = True
        elif self._paused:
            assignment = self.client.assignment()
            if assignment:
                self.client.resume(assignment)
                self._paused = False  # (none assigned: resumed once some are)

    def _done(self, message_id: str) -> bool:
        """Forget the held message ``message_id`` (its request done, or it is parked):
        whether it was held."""
        held = self._held.pop(message_id, None)
        if held is None:
            return False  # given up in a rebalance (or done already)
        partition = self._partitions.get(held.partition)
        if partition is not None:
            partition.held.discard(held.offset)
        return True

    def _commit_due(self, consumer: Any = None, *, wait: bool = False,
                    partitions: list[int] | None = None) -> None:
        """Commit, for each partition (of ``partitions``, default all assigned), the offset
        of its oldest held message, or the one after the last read when none is held, if it
        moved. Asynchronous (a failure is sent again at the next poll) unless ``wait``."""
        from confluent_kafka import TopicPartition

        consumer = consumer or self.client
        offsets = []
        for number in self._partitions if partitions is None else partitions:
            partition = self._partitions.get(number)
            if partition is None:
                continue
            target = min(partition.held) if partition.held else partition.next_offset
            # (waited for: sent again even if sent before, an asynchronous commit's answer
            # may not be back yet)
            if target is not None and (wait or partition.committed is None
                                       or target > partition.committed):
                offsets.append(TopicPartition(self.topic, number, target))
                partition.committed = target
        if not offsets:
            return
        logger.debug("scrapy_idempotent: Kafka topic %r: committing offset(s) %s%s",
                     self.topic, _offsets(offsets), " (waited for)" if wait else "")
        if not wait:
            consumer.commit(offsets=offsets, asynchronous=True)
            return
        # (a synchronous commit raises for the request's error, and returns each
        # partition's own)
        failed = [tp for tp in consumer.commit(offsets=offsets, asynchronous=False) or ()
                  if tp.error is not None]
        if failed:
            from confluent_kafka import KafkaException

            for tp in failed:
                self._uncommitted(tp)
            raise KafkaException(failed[0].error)

    def _on_commit(self, error: Any, partitions: list[Any]) -> None:
        """A commit's answer (served by the poll): a partition whose commit failed is sent
        again at the next poll, while it is this member's. A commit refused because a
        rebalance moved on (the partitions' next owner commits them) is not an error."""
        failed = [tp for tp in partitions if error is not None or tp.error is not None]
        done = [tp for tp in partitions if error is None and tp.error is None]
        if done:
            logger.debug("scrapy_idempotent: Kafka topic %r: offset(s) %s committed",
                         self.topic, _offsets(done))
        for tp in failed:
            self._uncommitted(tp)
        reason = error or (failed[0].error if failed else None)
        if reason is None:
            return
        if reason.name() == "_NO_OFFSET":
            return  # nothing was due
        if reason.name() in _REBALANCED:
            logger.info("scrapy_idempotent: Kafka topic %r: the commit of offset(s) %s was "
                        "refused (%s, a rebalance): sent again while the partitions are "
                        "this worker's", self.topic, _offsets(failed), reason.name())
        else:
            self._errors.append(reason)

    def _uncommitted(self, tp: Any) -> None:
        """The commit of ``tp`` failed: its partition's offset, if still this worker's and
        not committed further since, is sent again at the next poll."""
        partition = self._partitions.get(tp.partition)
        if partition is not None and partition.committed is not None \
                and partition.committed <= tp.offset:
            partition.committed = None  # not known committed: sent again

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        for tp in partitions:
            self._partitions[tp.partition] = _Partition()
        self._settled = True
        # a partition this consumer paused before a revoke is assigned again paused (the
        # client keeps the pause): the next read resumes the assignment, or pauses it all
        self._paused = True
        if partitions:
            logger.info("scrapy_idempotent: Kafka topic %r: partition(s) %s assigned to this "
                        "worker", self.topic, ", ".join(str(tp.partition) for tp in partitions))

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        """A rebalance takes ``partitions``: commit what may be committed, waiting for it,
        then give up the messages held (delivered again to the partitions' next owner)."""
        numbers = [tp.partition for tp in partitions]
        try:
            self._commit_due(consumer, wait=True, partitions=numbers)
        except Exception as exc:
            logger.warning("scrapy_idempotent: Kafka topic %r: cannot commit the offsets of "
                           "the messages done before a rebalance (%s): they will be read "
                           "again", self.topic, exc)
        committed = ", ".join(
            f"{number}:{self._partitions[number].committed}" for number in numbers
            if number in self._partitions and self._partitions[number].committed is not None)
        held = self._give_up(numbers)
        if numbers:
            logger.info("scrapy_idempotent: Kafka topic %r: partition(s) %s revoked (a "
                        "rebalance or the close; offsets committed: %s): %d message(s) held "
                        "are left to their next owner", self.topic,
                        ", ".join(map(str, numbers)), committed or "none", held)

    def _on_lost(self, consumer: Any, partitions: list[Any]) -> None:
        """``partitions`` were lost (this member's session timed out: they may be another's
        already): nothing is committed, the messages held are given up."""
        logger.warning("scrapy_idempotent: Kafka topic %r: partition(s) %s lost (this "
                       "worker's group session timed out): their messages are read again",
                       self.topic, ", ".join(str(tp.partition) for tp in partitions))
        self._give_up([tp.partition for tp in partitions])

    def _give_up(self, numbers: list[int]) -> int:
        """Forget the partitions ``numbers`` and the messages held from them (those handed
        out are reported lost at the end of the take); how many were held."""
        self._settled = False  # until the rebalance assigns partitions again
        count = 0
        gone = set(numbers)
        for number in numbers:
            self._partitions.pop(number, None)
        kept = {message_id for message_id, _ in self._kept
                if self._held[message_id].partition in gone}
        self._kept = [entry for entry in self._kept if entry[0] not in kept]
        for message_id, held in list(self._held.items()):
            if held.partition in gone:
                del self._held[message_id]
                count += 1
                self._owed_parks.pop(message_id, None)
                if message_id not in kept:
                    self._lost.append(message_id)
        return count

    def _on_error(self, error: Any) -> None:
        """An error the client reports by itself (a broker that cannot be reached, a wrong
        password; mostly recovered from by the client): the next take asks for the cluster's
        metadata before reading on, and reports this error if that fails too."""
        self._client_error = error
        self._check_reachable = True
        if error.fatal():
            self._errors.append(error)

    def _reachable(self, taken: Taken) -> bool:
        """Whether the cluster answers and knows the topic, asked only after the client
        reported an error (a metadata request, at most ``_METADATA_SECONDS``): if not, the
        error goes in ``taken``."""
        if not self._check_reachable:
            return True
        try:
            self._metadata()
        except Exception as exc:
            from confluent_kafka import KafkaException

            taken.error = KafkaException(self._client_error) \
                if self._client_error is not None else exc
            return False
        self._check_reachable = False
        self._client_error = None
        return True

    def _after_call(self, taken: Taken) -> None:
        """What every take ends with: the messages given up, the client's errors, whether the
        group is still settling (no assignment yet: not an empty queue)."""
        errors, self._errors = self._errors, []
        if errors:
            self._check_reachable = True
            if taken.error is None:
                from confluent_kafka import KafkaException

                taken.error = KafkaException(errors[-1])
            if any(error.fatal() for error in errors):
                self._reopen()
        taken.lost, self._lost = taken.lost + self._lost, []
        taken.settling = taken.error is None and not self._settled

    def _metadata(self) -> None:
        """Raise unless the cluster answers and knows the topic."""
        from confluent_kafka import KafkaException

        assert self.client is not None
        metadata = self.client.list_topics(self.topic, timeout=_METADATA_SECONDS)
        topic = metadata.topics.get(self.topic)
        if topic is None or topic.error is not None:
            raise KafkaException(topic.error if topic is not None else
                                 f"the topic {self.topic!r} does not exist")

    def _park_owed(self, taken: Taken) -> None:
        """Produce the bad messages owed to the parked topic, each waited for, then done; an
        error goes in ``taken`` (the messages are sent again at the next poll)."""
        if not self._owed_parks:
            return
        try:
            self._produce_owed()
        except Exception as exc:
            self._producer = None  # made again for the next attempt
            taken.error = exc

    def _produce_owed(self) -> None:
        producer = self._parking_producer()
        delivered: dict[str, Any] = {}
        for message_id, error in list(self._owed_parks.items()):
            held = self._held[message_id]
            value = json.dumps({
                "id": message_id, "topic": self.topic, "partition": held.partition,
                "offset": held.offset,
                "key": None if held.key is None else held.key.decode("utf-8", "replace"),
                "body": held.body.decode("utf-8", "replace"), "error": error,
                "consumer": self.consumer})
            producer.produce(self.parked_topic, value=value.encode(), key=held.key,
                             on_delivery=lambda err, _, i=message_id: delivered.__setitem__(
                                 i, err))
        producer.flush(_DELIVERY_SECONDS)
        failures = []
        for message_id in list(self._owed_parks):
            if message_id in delivered and delivered[message_id] is None:
                del self._owed_parks[message_id]
                self._done(message_id)
            else:
                failures.append(delivered.get(message_id) or "not delivered in time")
        if failures:
            raise RuntimeError(f"cannot park {len(failures)} message(s) in "
                               f"{self.parked_topic!r} yet ({failures[0]}): sent again at "
                               "the next poll")
        self._commit_due()

    def _parking_producer(self) -> Any:
        """The producer of the parked topic (idempotent, acknowledged by every replica),
        the topic created first when missing."""
        if self._producer is not None:
            return self._producer
        from confluent_kafka import KafkaException, Producer
        from confluent_kafka.admin import (  # type: ignore[attr-defined,import-not-found,unused-ignore]
            AdminClient,
            NewTopic,
        )

        options: dict[str, Any] = {name: value for name, value in self.options.items()
                                   if name not in _CONSUMER_ONLY}
        options["logger"] = _DebugLog(logging.getLogger(f"{__name__}.librdkafka"), {})
        admin = AdminClient(options)
        # every topic listed (a request naming the topic may create it with the broker's
        # default partitions where topics are created on first use)
        topics = admin.list_topics(timeout=_METADATA_SECONDS).topics
        if self.parked_topic not in topics:
            future = admin.create_topics([NewTopic(self.parked_topic, num_partitions=1,
                                                   replication_factor=-1)])[self.parked_topic]
            try:
                future.result(timeout=_METADATA_SECONDS)
            except KafkaException as exc:
                if exc.args[0].code() != 36:  # TOPIC_ALREADY_EXISTS: another worker made it
                    raise
        self._producer = Producer({**options, "enable.idempotence": True, "acks": "all"})
        return self._producer

    def _reopen(self) -> None:
        """A fatal client error: the consumer is closed (its messages given up) and made
        again at the next take."""
        consumer, self.client = self.client, None
        self._give_up(list(self._partitions))
        if consumer is not None:
            self._close(consumer)

    def _close(self, consumer: Any) -> None:
        try:
            consumer.close()  # revokes (committing what is due), then leaves the group
        except Exception as exc:
            logger.debug("scrapy_idempotent: Kafka consumer close: %s", exc)
        self._partitions.clear()

