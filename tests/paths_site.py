"""A small configurable HTTP site for the request-path tests (tests/test_paths.py).

Standard library only (the kill tests' spider module, tests/paths_spiders.py, runs in a
subprocess and reaches it over HTTP). Every route answers GET and POST; every request is
counted by path (``hits('/ok/a')``) and by path with query (``hits('/ok/a?x=1')``).

Routes (``<name>`` is any word, so each test uses distinct URLs):

* ``/robots.txt``: ``Disallow: /private/``.
* ``/ok/<name>``, ``/private/<name>``: 200 HTML; ``?links=/a,/b`` renders ``<a href>`` links.
* ``/status/<code>/<name>``: that status, small HTML body.
* ``/flaky/<n>/<name>``: 503 for the first ``n`` requests of that path, then 200.
* ``/slow/<seconds>/<name>``: sleeps, then 200.
* ``/reset/<name>``: closes the socket without answering (RST, SO_LINGER 0).
* ``/redirect/<code>/<name>?to=<url>``: ``code`` with ``Location: <url>``.
* ``/refresh/<name>?to=<url>``: 200 HTML with a ``<meta http-equiv="refresh">`` to ``url``.
* ``/chain/<n>/<name>``: 302 to ``/chain/<n-1>/<name>``; ``/chain/0/<name>`` is 200.
* ``/self/<n>/<name>``: 302 to itself (setting a cookie) for the first ``n`` requests, then
  200 (a cookie check).
* ``/loop/<name>/<n>``: 302 to ``/loop/<name>/<1 - n>`` (a redirect loop).
* ``/echo/<name>``: 200 JSON of what was received: method, path, query, headers, body (text and
  base64), cookies.
* ``/block/<name>``: waits until :meth:`PathsSite.release` (or ``/__release__``), then 200.
* ``/__stats__``: JSON ``{"by_path": {...}, "by_full_path": {...}}``; ``/__release__``; neither
  is counted.
* anything else: 404.

HTTP/1.0 with ``Connection: close`` (one connection per request), so Twisted never reuses a
connection, never retries a request by itself, and the counters are exact.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Sequence
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["PathsSite", "free_port"]


def free_port() -> int:
    """A loopback port with nothing listening on it (connection refused)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return int(port)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    site: PathsSite

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that gave up (timeouts) is expected; anything else is kept for the tests
        import sys
        import traceback

        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            self.site.errors.append("".join(traceback.format_exc()))


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    disable_nagle_algorithm = True
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    # -- answers ------------------------------------------------------------------------

    def _send(self, status: int, body: bytes | str, content_type: str = "text/html",
              headers: dict[str, str] | None = None) -> None:
        data = body.encode() if isinstance(body, str) else body
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            # no keep-alive: Twisted would otherwise pool the connection this HTTP/1.0
            # server closes, and a POST on the dead connection fails (it is not retried)
            self.send_header("Connection", "close")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client gave up

    def _html(self, title: str, links: Sequence[str] = (), status: int = 200,
              extra_head: str = "") -> None:
        anchors = "".join(f'<a href="{link}">{link}</a>\n' for link in links)
        self._send(status, f"<html><head><title>{title}</title>{extra_head}</head><body>"
                           f'<h1 class="path">{title}</h1>\n{anchors}</body></html>')

    def _handle(self) -> None:
        site = self.server.site
        split = urlsplit(self.path)
        path, query = split.path, parse_qs(split.query)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if path == "/__stats__":
            self._send(200, json.dumps(site.stats()), "application/json")
            return
        if path == "/__release__":
            site.release()
            self._send(200, "released", "text/plain")
            return
        hits = site._count(self.command, path, self.path)
        parts = [p for p in path.split("/") if p]
        head = parts[0] if parts else ""
        links = [link for value in query.get("links", []) for link in value.split(",") if link]
        to = query.get("to", [""])[0]
        if path == "/robots.txt":
            self._send(200, "User-agent: *\nDisallow: /private/\n", "text/plain")
        elif head in ("ok", "private") and len(parts) >= 2:
            self._html(path, links)
        elif head == "status" and len(parts) >= 3:
            self._html(path, links, status=int(parts[1]))
        elif head == "flaky" and len(parts) >= 3:
            self._html(path, links, status=503 if hits <= int(parts[1]) else 200)
        elif head == "slow" and len(parts) >= 3:
            time.sleep(float(parts[1]))
            self._html(path, links)
        elif head == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
        elif head == "redirect" and len(parts) >= 3:
            self._send(int(parts[1]), f'<a href="{to}">moved</a>',
                       headers={"Location": to})
        elif head == "refresh" and len(parts) >= 2:
            self._html(path, extra_head=f'<meta http-equiv="refresh" content="0; url={to}">')
        elif head == "chain" and len(parts) >= 3:
            left = int(parts[1])
            if left > 0:
                target = "/chain/" + "/".join([str(left - 1), *parts[2:]])
                self._send(302, "moved", headers={"Location": target})
            else:
                self._html(path, links)
        elif head == "self" and len(parts) >= 3:
            if hits <= int(parts[1]):
                self._send(302, "again", headers={
                    "Location": path, "Set-Cookie": f"visited={hits}; Path=/"})
            else:
                self._html(path, links)
        elif head == "loop" and len(parts) >= 3:
            target = f"/loop/{parts[1]}/{(int(parts[2]) + 1) % 2}"
            self._send(302, "moved", headers={"Location": target})
        elif head == "echo":
            cookies = SimpleCookie(self.headers.get("Cookie") or "")
            self._send(200, json.dumps({
                "method": self.command,
                "path": path,
                "query": split.query,
                "headers": {k: v for k, v in self.headers.items()},
                "body": body.decode("utf-8", "replace"),
                "body_b64": base64.b64encode(body).decode("ascii"),
                "cookies": {k: m.value for k, m in cookies.items()},
            }), "application/json")
        elif head == "block":
            site._released.wait(60)
            self._html(path, links)
        else:
            self._html(f"not found: {path}", status=404)


class PathsSite:
    """The site on ``127.0.0.1`` (port 0: any free port), in a background thread.

    ``with PathsSite() as site: site.url``; ``site.hits(path)``; ``site.reset_counts()``;
    ``site.release()`` lets ``/block/...`` requests finish.
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self._server = _Server((host, port), _Handler)
        self._server.site = self
        self.host = host
        self.port: int = self._server.server_address[1]
        self._lock = threading.Lock()
        self._by_path: Counter[str] = Counter()
        self._by_full_path: Counter[str] = Counter()
        self._by_method: Counter[str] = Counter()
        self._released = threading.Event()
        self.errors: list[str] = []  #: tracebacks of handler failures (none expected)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> PathsSite:
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._released.set()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> PathsSite:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- counters -----------------------------------------------------------------------

    def _count(self, method: str, path: str, full_path: str) -> int:
        with self._lock:
            self._by_path[path] += 1
            self._by_full_path[full_path] += 1
            self._by_method[f"{method} {path}"] += 1
            return self._by_path[path]

    def hits(self, path: str, method: str | None = None) -> int:
        """Requests received for ``path`` (with a ``?query``: for exactly that URL; with
        ``method``: of that method only)."""
        with self._lock:
            if method is not None:
                return self._by_method[f"{method} {path}"]
            if "?" in path:
                return self._by_full_path[path]
            return self._by_path[path]

    def counts_by_path(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_path)

    def total(self) -> int:
        with self._lock:
            return sum(self._by_path.values())

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"by_path": dict(self._by_path), "by_full_path": dict(self._by_full_path),
                    "by_method": dict(self._by_method)}

    def reset_counts(self) -> None:
        with self._lock:
            self._by_path.clear()
            self._by_full_path.clear()
            self._by_method.clear()

    def release(self) -> None:
        self._released.set()

    def block(self) -> None:
        """Make ``/block/...`` requests wait again (until the next :meth:`release`)."""
        self._released.clear()
