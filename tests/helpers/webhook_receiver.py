"""A real webhook receiver for the outbox tests, served by the local test site
(:meth:`local_site.LocalSite.add_responder` at ``/hook``, HTTP/1.1 keep-alive): it records
every POST it gets (idempotency key, JSON body, the status it answered) and can be down (503,
optionally with ``Retry-After``) or refuse some records (400)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from types import TracebackType
from typing import Any

from local_site import LocalSite, Received

__all__ = ["Delivery", "WebhookReceiver"]


class Delivery:
    """One POST as received."""

    def __init__(self, key: str | None, body: dict[str, Any], status: int,
                 headers: dict[str, str]) -> None:
        self.key = key
        self.body = body
        self.status = status
        self.headers = headers


class WebhookReceiver:
    """``with WebhookReceiver() as hook:`` ... ``hook.url``; ``hook.deliveries`` lists
    every POST. ``down`` (bool) answers 503 to everything; ``down_for(n)`` to the next
    ``n`` POSTs; ``retry_after`` is sent with each 503 when set; ``refuse`` holds record IDs
    answered 400."""

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.down = False
        self.retry_after: str | None = None
        self.refuse: set[str] = set()
        self._down_left = 0
        self.site = LocalSite()
        self.site.add_responder("/hook", self._receive)

    @property
    def url(self) -> str:
        return f"{self.site.url}/hook"

    def down_for(self, posts: int) -> None:
        with self.lock:
            self._down_left = posts

    def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, str]]:
        with self.lock:
            if self._down_left > 0:
                self._down_left -= 1
                down = True
            else:
                down = self.down
        if down:
            return 503, {"Retry-After": self.retry_after} if self.retry_after else {}
        if body.get("record_id") in self.refuse:
            return 400, {}
        return 200, {}

    def _receive(self, request: Received) -> tuple[int, dict[str, str], bytes]:
        try:
            body = json.loads(request.body)
        except ValueError:  # cut short (a client killed while sending): not acknowledged
            body = {"unreadable": request.body.decode("utf-8", "replace")}
        status, extra = self.answer(body) if "unreadable" not in body else (400, {})
        with self.lock:
            self.deliveries.append(Delivery(request.headers.get("Idempotency-Key"), body,
                                            status, request.headers))
            self.changed.notify_all()
        payload = b'{"ok": true}' if status < 300 else b'{"error": "not now"}'
        return status, {**extra, "Content-Type": "application/json"}, payload

    def acknowledged(self) -> list[Delivery]:
        with self.lock:
            return [d for d in self.deliveries if 200 <= d.status < 300]

    def keys_acknowledged(self) -> Counter[str]:
        return Counter(d.key for d in self.acknowledged() if d.key is not None)

    def __enter__(self) -> WebhookReceiver:
        self.site.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.site.stop()
        assert self.site.errors == [], self.site.errors
