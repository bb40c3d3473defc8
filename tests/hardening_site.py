"""A tiny local site for the hardening tests: fixed routes served by a stdlib
``ThreadingHTTPServer`` on 127.0.0.1, port 0, with a count of requests per path.

Standard library only. Routes are added by the tests (:meth:`LocalSite.add`); a catalogue of
``n`` item pages linked from ``/list`` is one call (:meth:`LocalSite.add_catalogue`).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

__all__ = ["LocalSite"]


class _Handler(BaseHTTPRequestHandler):
    disable_nagle_algorithm = True
    server: _Server

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self._answer()

    def _answer(self) -> None:
        site = self.server.site
        path = self.path
        with site.lock:
            site.counts[path] += 1
            site.headers_seen.append(dict(self.headers.items()))
        if site.delay_seconds:
            time.sleep(site.delay_seconds)
        route = site.routes.get(path)
        if route is None:
            status, content_type, body = 404, "text/plain", b"not found"
        else:
            status, content_type, body = route
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    site: LocalSite


class LocalSite:
    """``with LocalSite() as site: site.add("/a", "<html>..</html>"); site.url``."""

    def __init__(self, delay_seconds: float = 0.0) -> None:
        self.delay_seconds = delay_seconds  #: every answer waits this long
        self.routes: dict[str, tuple[int, str, bytes]] = {}
        self.counts: Counter[str] = Counter()
        self.headers_seen: list[dict[str, str]] = []
        self.lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- routes ---------------------------------------------------------------------------

    def add(self, path: str, body: str | bytes, content_type: str = "text/html; charset=utf-8",
            status: int = 200) -> None:
        data = body.encode("utf-8") if isinstance(body, str) else body
        self.routes[path] = (status, content_type, data)

    def add_json(self, path: str, value: Any) -> None:
        self.add(path, json.dumps(value), "application/json")

    def add_catalogue(self, count: int, *, filler: int = 0) -> None:
        """``/list`` links ``/item/1`` .. ``/item/<count>``; item ``i`` shows SKU ``S-<i>``,
        a name, and ``filler`` characters of text (to make records big)."""
        links = "".join(f'<a class="item" href="/item/{i}">{i}</a>\n'
                        for i in range(1, count + 1))
        self.add("/list", f"<html><body>{links}</body></html>")
        for i in range(1, count + 1):
            self.add(f"/item/{i}",
                     f'<html><body><span class="sku">S-{i}</span><h1>Item {i}</h1>'
                     f'<p class="text">{"x" * filler}</p></body></html>')

    # -- counts ---------------------------------------------------------------------------

    @property
    def request_count(self) -> int:
        with self.lock:
            return sum(self.counts.values())

    def count(self, path: str) -> int:
        with self.lock:
            return self.counts[path]

    # -- life -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> LocalSite:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.site = self
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self) -> LocalSite:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
