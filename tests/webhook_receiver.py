"""A real webhook receiver for the outbox tests: an HTTP server on 127.0.0.1 (port 0) that
records every POST it gets (idempotency key, JSON body, the status it answered) and can be
down (503, optionally with ``Retry-After``) or refuse some records (400)."""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

__all__ = ["Delivery", "WebhookReceiver"]


class Delivery:
    """One POST as received."""

    def __init__(self, key: str | None, body: dict[str, Any], status: int,
                 headers: dict[str, str]) -> None:
        self.key = key
        self.body = body
        self.status = status
        self.headers = headers


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default 5 overflows (connections reset) under load
    receiver: WebhookReceiver

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client killed mid-request (the kill tests) resets its connection: expected
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        receiver = self.server.receiver
        try:
            body = json.loads(raw)
        except ValueError:  # cut short (a client killed while sending): not acknowledged
            body = {"unreadable": raw.decode("utf-8", "replace")}
        status, extra = receiver.answer(body) if "unreadable" not in body else (400, {})
        with receiver.lock:
            receiver.deliveries.append(Delivery(self.headers.get("Idempotency-Key"), body,
                                                status, dict(self.headers.items())))
            receiver.changed.notify_all()
        payload = b'{"ok": true}' if status < 300 else b'{"error": "not now"}'
        self.send_response(status)
        for name, value in extra.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


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
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.receiver = self
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/hook"

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

    def acknowledged(self) -> list[Delivery]:
        with self.lock:
            return [d for d in self.deliveries if 200 <= d.status < 300]

    def keys_acknowledged(self) -> Counter[str]:
        return Counter(d.key for d in self.acknowledged() if d.key is not None)

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
