"""The Redis stream broker of the queue input (``IDEMPOTENT_QUEUE_URL = "redis://..."``).

Each worker reads the stream ``IDEMPOTENT_QUEUE_KEY`` as a consumer of the group
``IDEMPOTENT_QUEUE_GROUP`` (``XREADGROUP``, without ``BLOCK``): a message read is pending for
that consumer in the stream's pending entries list until it is acknowledged (``XACK``). A
message of a dead consumer is taken over at once from a consumer of the same host whose
process is gone (``XCLAIM``), or with ``XAUTOCLAIM`` once it has been idle
``IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS`` (and the consumer, once it holds nothing and has
been idle that long, is removed from the group); so that a message held here is never idle
that long
while its request is in progress, its idle time is reset (``XCLAIM`` to this consumer,
``JUSTID``) once it reaches a third of that time. A bad message is added to the stream
``<IDEMPOTENT_QUEUE_KEY>:parked`` with its id, fields and error, and acknowledged, in one
``MULTI``.

A read whose answer is lost (the connection cut, Redis stopped, after the command ran) leaves
its messages pending for this consumer, unknown to it: after any failed take, the next one
first reads this consumer's own pending entries (``XREADGROUP ... 0``) and takes those it
does not hold, before anything new.

Why a stream and not a list with a processing list: the stream's pending entries list keeps,
per message, its consumer, its idle time and its delivery count, so a message of a dead worker
is found and claimed by any worker (``XAUTOCLAIM``) without a list per worker, and several
workers share one stream through the group; acknowledging is ``XACK`` by id (O(1)), where a
processing list needs an ``LREM`` scan and only its own worker knows to recover it.

A Redis server restarted without persistence (or a stream deleted) loses the consumer group:
the next command answers ``NOGROUP``; the group is created again (at the stream's start, so
every message added since is read) and the log says so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

from ..config import QueueConfig
from ..workers import worker_is_dead
from .broker import Fields, QueueBroker, QueueDepth, Taken

__all__ = ["RedisStreamBroker"]

logger = logging.getLogger("scrapy_idempotent.queue_input")

#: How often the consumers of the group are checked for dead ones of this host.
_DEAD_CHECK_SECONDS = 5.0
#: Pending entries read (XPENDING) or claimed again (XCLAIM) per call when extending.
_EXTEND_BATCH = 500


#: Removes a consumer only while nothing is pending for it (check and removal atomic).
_DELETE_IF_IDLE = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


def _is_nogroup(exc: BaseException) -> bool:
    import redis

    return isinstance(exc, redis.ResponseError) and str(exc).startswith("NOGROUP")


class RedisStreamBroker(QueueBroker):
    """A consumer of a Redis stream's consumer group (see the module docstring)."""

    kind = "Redis"
    error_stat = "idempotent/queue/redis_errors"

    def __init__(self, config: QueueConfig, consumer: str, client: Any) -> None:
        super().__init__(consumer)
        self.config = config
        self.client = client
        self._group_ready = False
        self._claimed_dead_at = 0.0
        self._autoclaimed_at = 0.0
        self._autoclaim_cursor = "0-0"  #: where XAUTOCLAIM goes on (kept between polls)
        self._extend_at = 0.0  #: no extension before (monotonic)
        #: this consumer's pending entries to read again (a take failed: a read's answer
        #: may be lost, its messages pending here unknown); the id to go on after
        self._own_from: str | None = None
        self._delete_script: Any = None  #: registered on first use

    @classmethod
    def from_config(cls, config: QueueConfig, consumer: str) -> RedisStreamBroker:
        import redis  # checked by the caller (ConfigError naming the extra)

        client = redis.Redis.from_url(config.url, decode_responses=True,
                                      socket_timeout=10, socket_connect_timeout=10)
        return cls(config, consumer, client)

    @property
    def name(self) -> str:
        return self.config.key

    @property
    def parked_name(self) -> str:
        return self.config.parked_key

    def describe(self) -> str:
        return (f"the Redis stream {self.config.key!r} (group {self.config.group!r}, "
                f"consumer {self.consumer})")

    def depth(self) -> QueueDepth:
        """The group's lag (entries not delivered to it yet: Redis 7) and pending entries
        (``XINFO GROUPS``), and the parked stream's length: three O(1) commands."""
        import redis

        key = self.config.key
        try:
            groups = self.client.xinfo_groups(key)
        except redis.ResponseError:  # no such stream yet: nothing waits
            groups = []
        group = next((g for g in groups if g.get("name") == self.config.group), None)
        if group is None:
            waiting: int | None = int(self.client.xlen(key))
            held: int | None = 0
        else:
            lag = group.get("lag")
            waiting = None if lag is None else int(lag)
            held = int(group.get("pending", 0))
        return QueueDepth(waiting=waiting, held=held,
                          parked=int(self.client.xlen(self.config.parked_key)))

    # -- the contract -----------------------------------------------------------------------

    def take(self, room: int, read: bool, known: frozenset[str]) -> Taken:
        taken = Taken()
        try:
            try:
                self._take(room, read, known, taken)
            except Exception as exc:
                if not _is_nogroup(exc):
                    raise
                self._group_lost()
                self._take(room - len(taken.entries), read, known, taken)
        except Exception as exc:
            taken.error = exc
            self._own_from = "0"  # a read may have run without its answer: read them again
        return taken

    def _take(self, room: int, read: bool, known: frozenset[str], taken: Taken) -> None:
        now = time.monotonic()
        if not self._group_ready:
            self._create_group()
            self._group_ready = True
        if self._own_from is not None and room > 0:
            room -= self._read_own(room, known, taken)
        if now >= self._claimed_dead_at:
            if room > 0:
                dead_left = self._claim_from_dead(room, taken)
                room -= taken.claimed
            else:
                dead_left = True  # not checked: no room
            if not dead_left:
                self._claimed_dead_at = now + _DEAD_CHECK_SECONDS  # all taken: check later
        if now >= self._autoclaimed_at and room > 0:
            room -= self._autoclaim(room, known, taken)
        if read and room > 0:
            reply = self.client.xreadgroup(self.config.group, self.consumer,
                                           {self.config.key: ">"}, count=room)
            for _, stream_entries in reply or []:
                taken.entries += stream_entries

    def extend(self, ids: list[str]) -> None:
        """Reset the idle time of the held messages ``ids`` once they have been pending a
        third of ``IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS`` (checked every sixth of it): each is
        claimed again by this consumer (``XCLAIM ... JUSTID``: its delivery count unchanged),
        so a peer's ``XAUTOCLAIM`` by that idle time never takes the message of a request in
        progress here, however long it waits in the frontier or its page takes. Only the
        entries still pending for this consumer (``XPENDING ... IDLE ... <consumer>``) are
        claimed, each only if still that idle: one a peer took over stays the peer's."""
        now = time.monotonic()
        if not ids or now < self._extend_at:
            return
        claim_idle = self.config.claim_idle_seconds
        self._extend_at = now + claim_idle / 6
        due_ms = max(1, int(claim_idle * 1000 / 3))
        held = set(ids)
        try:
            due = self._pending_here(due_ms, held)
            for start in range(0, len(due), _EXTEND_BATCH):
                self.client.xclaim(self.config.key, self.config.group, self.consumer, due_ms,
                                   due[start:start + _EXTEND_BATCH], justid=True)
        except Exception as exc:
            if not _is_nogroup(exc):
                raise
            self._group_lost()  # nothing held any more: the group is new

    def _pending_here(self, min_idle_ms: int, held: set[str]) -> list[str]:
        """The ids of ``held`` pending for this consumer, idle ``min_idle_ms`` or more."""
        due: list[str] = []
        start = "-"
        while True:
            page = self.client.xpending_range(
                self.config.key, self.config.group, min=start, max="+", count=_EXTEND_BATCH,
                consumername=self.consumer, idle=min_idle_ms)
            due += [p["message_id"] for p in page if p["message_id"] in held]
            if len(page) < _EXTEND_BATCH:
                return due
            start = f"({page[-1]['message_id']}"  # after the last one

    def ack(self, ids: list[str]) -> int:
        if not ids:
            return 0
        try:
            self.client.xack(self.config.key, self.config.group, *ids)
        except Exception as exc:
            if not _is_nogroup(exc):
                raise
            self._group_lost()
            return 0  # the group is gone, and its pending entries with it
        return len(ids)

    def park(self, message_id: str, fields: Fields, error: str) -> None:
        entry = {"id": message_id, "fields": json.dumps(dict(fields), sort_keys=True),
                 "error": error, "consumer": self.consumer}
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.config.parked_key, entry)
        pipe.xack(self.config.key, self.config.group, message_id)
        pipe.execute()

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing only
            self.client.close()

    # -- Redis ------------------------------------------------------------------------------

    def _group_lost(self) -> None:
        """NOGROUP: the consumer group is gone (a Redis restarted without persistence, the
        stream deleted). Created again at once, at the stream's start."""
        logger.warning("scrapy_idempotent: Redis queue %r: the consumer group %r is gone "
                       "(Redis restarted without persistence, or the stream was deleted): "
                       "creating it again; messages held from before are not acknowledged "
                       "(nothing left to acknowledge)", self.config.key, self.config.group)
        self._group_ready = False
        self._autoclaim_cursor = "0-0"
        self._own_from = None  # nothing is pending in a new group
        self._create_group()
        self._group_ready = True

    def _create_group(self) -> None:
        import redis

        try:
            self.client.xgroup_create(self.config.key, self.config.group, id="0",
                                      mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _read_own(self, room: int, known: frozenset[str], taken: Taken) -> int:
        """Up to ``room`` of this consumer's own pending messages it does not hold (``known``):
        those of a read whose answer was lost. Read from where the last call stopped; done
        once the list is read to its end. Returns how many were taken."""
        count = 0
        while self._own_from is not None and count < room:
            reply = self.client.xreadgroup(self.config.group, self.consumer,
                                           {self.config.key: self._own_from},
                                           count=room - count)
            entries = [e for _, stream_entries in reply or [] for e in stream_entries]
            if not entries:
                self._own_from = None  # all read
                break
            self._own_from = entries[-1][0]
            gone = [e[0] for e in entries if not e[1]]
            if gone:  # deleted from the stream meanwhile: nothing to do for them
                self.client.xack(self.config.key, self.config.group, *gone)
            new = [e for e in entries if e[0] not in known and e[1]]
            taken.entries += new
            count += len(new)
        return count

    def _claim_from_dead(self, room: int, taken: Taken) -> bool:
        """Take at once up to ``room`` pending messages of consumers that ran on this host,
        in this process's PID namespace, and are gone (their process no longer exists), and
        remove such a consumer once it has none left. Whether a dead consumer still has
        pending messages left for the next poll."""
        count = 0
        dead_left = False
        for consumer in self.client.xinfo_consumers(self.config.key, self.config.group):
            name = consumer["name"]
            if name == self.consumer or not worker_is_dead(name):
                continue
            if count >= room:
                dead_left = True
                break
            want = room - count
            pending = self.client.xpending_range(self.config.key, self.config.group,
                                                 min="-", max="+", count=want,
                                                 consumername=name)
            if pending:
                ids = [p["message_id"] for p in pending]
                entries = [e for e in self.client.xclaim(self.config.key, self.config.group,
                                                         self.consumer, 0, ids)
                           if e[1] is not None]
                taken.entries += entries
                count += len(entries)
                taken.claimed += len(entries)
                gone = set(ids) - {e[0] for e in entries}
                if gone:  # deleted from the stream meanwhile: nothing to do for them
                    self.client.xack(self.config.key, self.config.group, *gone)
                if len(pending) == want:  # it may have more: taken at the next poll
                    dead_left = True
                    break
            self.client.xgroup_delconsumer(self.config.key, self.config.group, name)
            logger.info("scrapy_idempotent: consumer %s is gone: its pending messages are "
                        "delivered again here", name)
        return dead_left

    def _autoclaim(self, room: int, known: frozenset[str], taken: Taken) -> int:
        """Up to ``room`` messages pending for ``IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS`` with
        any consumer (a worker on another host that died, or that is too slow), delivered
        again here; the scan goes on from where the last one stopped, and stops where the
        room is full (the next poll goes on from there). Returns how many were taken."""
        min_idle_ms = int(self.config.claim_idle_seconds * 1000)
        count = 0
        cursor = self._autoclaim_cursor
        while count < room:
            reply = self.client.xautoclaim(self.config.key, self.config.group, self.consumer,
                                           min_idle_ms, start_id=cursor, count=room - count)
            cursor, entries = reply[0], reply[1]
            new = [e for e in entries if e[0] not in known and e[1] is not None]
            taken.entries += new
            count += len(new)
            taken.claimed += len(new)
            if cursor in ("0-0", b"0-0"):  # the pending list was scanned to its end
                self._autoclaim_cursor = "0-0"
                self._autoclaimed_at = time.monotonic() + max(
                    1.0, self.config.claim_idle_seconds / 4)
                self._remove_idle_consumers()
                return count
            self._autoclaim_cursor = cursor  # more to scan: at the next poll
            if not entries:
                break
        return count

    def _remove_idle_consumers(self) -> None:
        """Remove from the group every other consumer that holds nothing and has not been
        heard of for ``IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS``: a worker of another host (or
        PID namespace) that died, once :meth:`_autoclaim` took its pending messages over (a
        dead one of this host goes at once, :meth:`_claim_from_dead`). Without this the
        group keeps one consumer per dead worker for ever. The check and the removal are one
        script, so a consumer that took a message meanwhile keeps it; a live worker that was
        only idle is a consumer again at its next read."""
        min_idle_ms = int(self.config.claim_idle_seconds * 1000)
        for consumer in self.client.xinfo_consumers(self.config.key, self.config.group):
            name = consumer["name"]
            if (name == self.consumer or int(consumer.get("pending", 0))
                    or int(consumer.get("idle", 0)) < min_idle_ms):  # since it last asked
                continue
            if self._delete_if_idle(keys=[self.config.key],
                                    args=[self.config.group, name]) == 1:
                logger.info("scrapy_idempotent: consumer %s has held nothing for %d s or "
                            "more: removed from the group", name,
                            self.config.claim_idle_seconds)

    @property
    def _delete_if_idle(self) -> Any:
        """The script removing consumer ``ARGV[2]`` of group ``ARGV[1]`` of stream
        ``KEYS[1]`` only while nothing is pending for it: 1 when removed, else 0."""
        if self._delete_script is None:
            self._delete_script = self.client.register_script(_DELETE_IF_IDLE)
        return self._delete_script
