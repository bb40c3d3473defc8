"""Outbox targets for the tests: the README's broker example (Redis Streams), as written
there, and a target that refuses or defers some announcements."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import redis
from scrapy.utils.defer import maybe_deferred_to_future
from twisted.internet.threads import deferToThread

from scrapy_idempotent import DeliveryRefused, DeliveryRetry, OutboxTarget


class RedisStreamTarget(OutboxTarget):
    def __init__(self, url: str, stream: str) -> None:
        self.client = redis.Redis.from_url(url)
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
