"""Outbox targets for the tests: the docs' broker example (Redis Streams, docs/outbox.rst), as
written there, a target that refuses or defers some announcements, and one that hangs."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, ClassVar

import redis
from scrapy.utils.defer import maybe_deferred_to_future
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThread

from scrapy_idempotent import DeliveryRefused, DeliveryRetry, OutboxTarget


class RedisStreamTarget(OutboxTarget):
    def __init__(self, url: str, stream: str) -> None:
        # a call must end within IDEMPOTENT_OUTBOX_TIMEOUT_SECONDS: a thread cannot be cancelled
        self.client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self.stream = stream

    @classmethod
    def from_crawler(cls, crawler):
        return cls(crawler.settings["REDIS_URL"], crawler.settings.get("REDIS_STREAM", "records"))

    async def deliver(self, announcement):
        # consumers deduplicate by the "key" field, as a webhook receiver does
        fields = {"key": announcement.key, "body": json.dumps(announcement.payload)}
        message_id = await maybe_deferred_to_future(
            deferToThread(self.client.xadd, self.stream, fields))
        return message_id.decode()

    async def close(self):
        self.client.close()


class PickyTarget(OutboxTarget):
    """Refuses records whose SKU ends in 1, asks to retry (once each) those ending in 2, and
    acknowledges the rest; every call is counted in ``CALLS`` (one process)."""

    CALLS: ClassVar[list[tuple[str, int]]] = []

    async def deliver(self, announcement: Any) -> str:
        sku = announcement.payload["record"]["sku"]
        attempt = announcement.entry.attempts
        self.CALLS.append((sku, attempt))
        if sku.endswith("1"):
            raise DeliveryRefused(f"{sku}: not for us")
        if sku.endswith("2") and attempt == 0:
            raise DeliveryRetry("busy", retry_after_seconds=0)
        return f"took {sku}"


class StuckTarget(OutboxTarget):
    """A broker client that hangs: while ``ANSWER`` is False, ``deliver`` never returns and
    ignores cancellation (it waits again); with ``ANSWER`` True it acknowledges at once.
    ``FIRST_STUCK``: the first attempt of each announcement hangs until cancelled (then it
    ends at once), the others acknowledge at once. ``CALLS`` counts
    calls per key, ``MOST_AT_ONCE`` the most calls in flight at once per key; ``release()``
    ends the hung calls (at the end of a test)."""

    ANSWER: ClassVar[bool] = False
    FIRST_STUCK: ClassVar[bool] = False
    CALLS: ClassVar[Counter[str]] = Counter()
    IN_FLIGHT: ClassVar[Counter[str]] = Counter()
    MOST_AT_ONCE: ClassVar[Counter[str]] = Counter()
    WAITS: ClassVar[list[Deferred[None]]] = []
    RELEASED: ClassVar[list[bool]] = []

    @classmethod
    def reset(cls, *, answer: bool = False, first_stuck: bool = False) -> None:
        cls.ANSWER, cls.FIRST_STUCK = answer, first_stuck
        for counter in (cls.CALLS, cls.IN_FLIGHT, cls.MOST_AT_ONCE):
            counter.clear()
        cls.WAITS.clear()
        cls.RELEASED.clear()

    @classmethod
    def release(cls) -> None:
        cls.RELEASED.append(True)
        for wait in cls.WAITS:
            if not wait.called:
                wait.callback(None)

    async def deliver(self, announcement: Any) -> str:
        key = announcement.key
        self.CALLS[key] += 1
        self.IN_FLIGHT[key] += 1
        self.MOST_AT_ONCE[key] = max(self.MOST_AT_ONCE[key], self.IN_FLIGHT[key])
        try:
            if self.ANSWER and self.FIRST_STUCK and announcement.entry.attempts == 0:
                await maybe_deferred_to_future(Deferred())  # until cancelled
            while not self.ANSWER and not self.RELEASED:
                wait: Deferred[None] = Deferred()
                self.WAITS.append(wait)
                try:
                    await maybe_deferred_to_future(wait)
                except BaseException:  # a client that ignores cancellation
                    continue
            return f"took {key}"
        finally:
            self.IN_FLIGHT[key] -= 1
