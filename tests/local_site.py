"""The local site every test crawls: one HTTP server on 127.0.0.1 (port 0: any free port), in
a background thread of the test process. Standard library only; spiders in subprocesses reach
it over HTTP.

    with LocalSite(listing_pages=1, products_per_page=10, delay=0.05) as site:
        crawl(site.url); site.hits("/list/1"); site.counts_by_path()

Pages (a test's own routes first, then the shop, then the route families, else 404):

* Routes added by the test: :meth:`LocalSite.add` (any body, status, content type, headers;
  optionally a delay, or held until :meth:`LocalSite.release`), :meth:`LocalSite.add_json`,
  :meth:`LocalSite.add_catalogue` (``/list`` linking ``/item/1`` .. ``/item/<n>``), and
  :meth:`LocalSite.add_responder` (a function of the request received answers it: a webhook
  receiver, an API with state). A route with a query matches that exact URL; one without
  matches its path whatever the query.
* The shop of the example project (its pages, ``shop.site``): ``/`` redirects to ``/list/1``;
  ``/list/<n>`` links ``products_per_page`` products ``/product/SKU-00001``... and the next
  listing page; ``/product/<sku>`` shows its name, SKU and price (``price_version`` changes
  every price), or answers 503 when listed in ``products_failing``.
* Route families (``<name>`` is any word, so each test uses distinct URLs):

  * ``/robots.txt``: ``Disallow: /private/``.
  * ``/ok/<name>``, ``/private/<name>``: 200 HTML; ``?links=/a,/b`` renders ``<a href>`` links.
  * ``/status/<code>/<name>``: that status, small HTML body.
  * ``/flaky/<n>/<name>``: 503 for the first ``n`` requests of that path, then 200.
  * ``/slow/<seconds>/<name>``: sleeps, then 200.
  * ``/reset/<name>``: closes the socket without answering (RST, SO_LINGER 0).
  * ``/redirect/<code>/<name>?to=<url>``: ``code`` with ``Location: <url>``.
  * ``/refresh/<name>?to=<url>``: 200 HTML with a ``<meta http-equiv="refresh">`` to ``url``.
  * ``/chain/<n>/<name>``: 302 to ``/chain/<n-1>/<name>``; ``/chain/0/<name>`` is 200.
  * ``/self/<n>/<name>``: 302 to itself (setting a cookie) for the first ``n`` requests,
    then 200 (a cookie check).
  * ``/loop/<name>/<n>``: 302 to ``/loop/<name>/<1 - n>`` (a redirect loop).
  * ``/echo/<name>``: 200 JSON of what was received: method, path, query, headers, body
    (text and base64), cookies.
  * ``/block/<name>``: held until :meth:`LocalSite.release` (or ``/__release__``), then 200.

* Control pages, never counted: ``/__stats__`` (JSON: ``requests``, ``by_path``,
  ``by_full_path``, ``by_method``), ``/__reset__`` (zeroes the counters), ``/__release__``.

Every other request is counted by path (``hits("/ok/a")``), by path with query
(``hits("/ok/a?x=1")``) and by method (``hits("/ok/a", "POST")``); the site also keeps the
headers of every request, the arrival order with the number of requests in flight at each
arrival, the arrival times and the most requests in flight at once (what a site's politeness
is measured by: :meth:`LocalSite.intervals`, :attr:`LocalSite.most_in_flight`), and the
traceback of any failure of its own (:attr:`LocalSite.errors`, which the fixtures check is
empty). Several sites of one test bind ``host`` addresses of their own (``127.0.0.2``,
``127.0.0.3``, ...: all of 127/8 is loopback on Linux), so each is its own host name, as
Scrapy's download slots see them. ``delay`` makes every counted request wait before it is answered.

Connections: ``keep_alive=True`` (the default) speaks HTTP/1.1 with keep-alive, as a real
site does; ``keep_alive=False`` speaks HTTP/1.0 with ``Connection: close``, one connection per
request, so Twisted never reuses a connection, never retries a request by itself, and the
counters are exact (the request-outcome tests need that).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import itertools
import json
import re
import socket
import struct
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlsplit

EXAMPLE_PROJECT = Path(__file__).resolve().parent.parent / "example_project"
if str(EXAMPLE_PROJECT) not in sys.path:
    sys.path.insert(0, str(EXAMPLE_PROJECT))

from shop.site import (  # noqa: E402 (the example project's shop pages)
    listing_html,
    product_html,
    product_name,
    product_price,
    product_sku,
)

__all__ = ["LocalSite", "Received", "Responder", "free_port"]

STATS_PATH = "/__stats__"
RESET_PATH = "/__reset__"
RELEASE_PATH = "/__release__"
ROBOTS_TXT = "User-agent: *\nDisallow: /private/\n"
#: The longest a held request waits for a release (stopping the site releases it too).
HOLD_SECONDS = 300
_LIST_RE = re.compile(r"/list/([0-9]+)")
_PRODUCT_RE = re.compile(r"/product/SKU-([0-9]{5})")


def free_port() -> int:
    """A loopback port with nothing listening on it (connection refused)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return int(port)


@dataclasses.dataclass(frozen=True)
class _Route:
    status: int
    content_type: str
    body: bytes
    headers: dict[str, str]
    delay: float  #: seconds to wait before answering
    held: bool  #: answered only once the site is released


@dataclasses.dataclass(frozen=True)
class Received:
    """A request as the site received it (what a responder is given)."""

    method: str
    path: str  #: without the query
    query: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


#: Answers a request: ``(status, headers, body)``.
Responder = Callable[[Received], "tuple[int, dict[str, str], bytes | str]"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Many short-lived loopback connections: do not let a small backlog refuse them.
    request_queue_size = 128
    site: LocalSite

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that went away (timeouts, a killed crawler) is expected; anything else is
        # a fault of the site, kept for the tests
        if not isinstance(sys.exc_info()[1], OSError):
            self.site.errors.append(traceback.format_exc())


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "LocalSite/1.0"
    # Without TCP_NODELAY, loopback responses stall ~40 ms on delayed ACKs.
    disable_nagle_algorithm = True
    # Idle keep-alive connections are closed eventually, so handler threads do not pile up.
    timeout = 30

    def setup(self) -> None:
        self.protocol_version = "HTTP/1.1" if self.server.site.keep_alive else "HTTP/1.0"
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    # -- answers ------------------------------------------------------------------------

    def _send(self, status: int, body: bytes | str, content_type: str = "text/html",
              headers: dict[str, str] | None = None) -> None:
        """Status line, headers and body in one write (one TCP segment when small)."""
        data = body.encode() if isinstance(body, str) else body
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        lines = [f"{self.protocol_version} {status} {phrase}",
                 f"Server: {self.server_version}",
                 f"Date: {self.date_time_string()}",
                 f"Content-Type: {content_type}",
                 f"Content-Length: {len(data)}"]
        if not self.server.site.keep_alive:
            # no keep-alive: Twisted would otherwise pool the connection this HTTP/1.0
            # server closes, and a POST on the dead connection fails (it is not retried)
            lines.append("Connection: close")
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        with contextlib.suppress(OSError):  # the client gave up
            self.wfile.write(head if self.command == "HEAD" else head + data)

    def _html(self, title: str, links: Sequence[str] = (), status: int = 200,
              extra_head: str = "") -> None:
        anchors = "".join(f'<a href="{link}">{link}</a>\n' for link in links)
        self._send(status, f"<html><head><title>{title}</title>{extra_head}</head><body>"
                           f'<h1 class="path">{title}</h1>\n{anchors}</body></html>')

    def _handle(self) -> None:
        site = self.server.site
        split = urlsplit(self.path)
        path = split.path
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if path == STATS_PATH:
            self._send(200, json.dumps(site.stats()), "application/json")
            return
        if path == RESET_PATH:
            site.reset_counts()
            self._send(200, json.dumps(site.stats()), "application/json")
            return
        if path == RELEASE_PATH:
            site.release()
            self._send(200, "released", "text/plain")
            return
        headers = dict(self.headers.items())
        hits = site._arrived(self.command, path, self.path, headers)
        try:
            if site._holding:
                site._released.wait(HOLD_SECONDS)
            if site.delay:
                time.sleep(site.delay)
            self._answer(path, parse_qs(split.query), body, hits)
        finally:
            site._answered(headers.get("User-Agent", ""))

    def _answer(self, path: str, query: dict[str, list[str]], body: bytes, hits: int) -> None:
        site = self.server.site
        full_path = self.path.split("#", 1)[0]
        responder = site.responders.get(full_path) or site.responders.get(path)
        if responder is not None:
            received = Received(
                self.command, path, urlsplit(full_path).query, dict(self.headers.items()), body)
            status, headers, answer = responder(received)
            self._send(status, answer, headers.get("Content-Type", "application/json"),
                       {k: v for k, v in headers.items() if k != "Content-Type"})
            if site.on_answered is not None:
                site.on_answered(received, status)
            return
        route = site.routes.get(full_path) or site.routes.get(path)
        if route is not None:
            if route.delay:
                time.sleep(route.delay)
            if route.held:
                site._released.wait(HOLD_SECONDS)
            self._send(route.status, route.body, route.content_type, route.headers)
            return
        if self._shop(path):
            return
        self._family(path, query, body, hits)

    def _shop(self, path: str) -> bool:
        """Answers a page of the shop; False when ``path`` is not one."""
        site = self.server.site
        if path == "/":
            self._send(302, b"", "text/plain", {"Location": "/list/1"})
            return True
        match = _LIST_RE.fullmatch(path)
        if match and 1 <= int(match.group(1)) <= site.listing_pages:
            self._send(200, listing_html(int(match.group(1)), site.listing_pages,
                                         site.products_per_page), "text/html; charset=utf-8")
            return True
        match = _PRODUCT_RE.fullmatch(path)
        if match and 1 <= int(match.group(1)) <= site.product_count:
            number = int(match.group(1))
            if number in site.products_failing:
                self._send(503, b"temporarily unavailable\n", "text/plain")
            else:
                self._send(200, product_html(number, site.price_version),
                           "text/html; charset=utf-8")
            return True
        return False

    def _family(self, path: str, query: dict[str, list[str]], body: bytes, hits: int) -> None:
        site = self.server.site
        parts = [p for p in path.split("/") if p]
        head = parts[0] if parts else ""
        links = [link for value in query.get("links", []) for link in value.split(",") if link]
        to = query.get("to", [""])[0]
        if path == "/robots.txt":
            self._send(200, ROBOTS_TXT, "text/plain")
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
            self._send(int(parts[1]), f'<a href="{to}">moved</a>', headers={"Location": to})
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
                "query": urlsplit(self.path).query,
                "headers": dict(self.headers.items()),
                "body": body.decode("utf-8", "replace"),
                "body_b64": base64.b64encode(body).decode("ascii"),
                "cookies": {k: m.value for k, m in cookies.items()},
            }), "application/json")
        elif head == "block":
            site._released.wait(HOLD_SECONDS)
            self._html(path, links)
        else:
            self._html(f"not found: {path}", status=404)


class LocalSite:
    """The site, configured for a test (see the module's documentation for its pages).

    Args:
        listing_pages: listing pages of the shop.
        products_per_page: products linked from each listing page.
        price_version: changes every price of the shop when changed.
        delay: seconds every counted request waits before it is answered.
        products_failing: product numbers (1-based) that answer 503.
        keep_alive: HTTP/1.1 keep-alive (True) or one HTTP/1.0 connection per request.
        host, port: the address to bind; port 0 picks a free one (read it from :attr:`url`).
    """

    def __init__(
        self,
        *,
        listing_pages: int = 25,
        products_per_page: int = 20,
        price_version: int = 0,
        delay: float = 0.0,
        products_failing: Iterable[int] = (),
        keep_alive: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        self.set_catalogue(listing_pages, products_per_page)
        self.set_price_version(price_version)
        self.set_products_failing(products_failing)
        self.delay = delay
        self.keep_alive = keep_alive
        self.host = host
        self.port = port
        self.routes: dict[str, _Route] = {}
        self.responders: dict[str, Responder] = {}
        self.headers_seen: list[dict[str, str]] = []  #: headers of every counted request
        self.errors: list[str] = []  #: tracebacks of the site's own failures (none expected)
        #: called with the request and the status once a responder's answer is written (on
        #: the handler thread): what a test does the moment a client has its answer
        self.on_answered: Callable[[Received, int], None] | None = None
        self._lock = threading.Lock()
        self._by_path: Counter[str] = Counter()
        self._by_full_path: Counter[str] = Counter()
        self._by_method: Counter[str] = Counter()
        self._arrivals: list[tuple[str, int]] = []
        self._arrival_times: list[float] = []  #: time.monotonic() of each counted arrival
        self._in_flight = 0
        self._in_flight_by_agent: Counter[str] = Counter()  #: by User-Agent header
        self._most_in_flight = 0
        self._released = threading.Event()
        self._holding = False  #: every request held (see :meth:`hold`)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- life -----------------------------------------------------------------------------

    def start(self) -> LocalSite:
        """Bind and serve in a daemon thread; returns ``self``."""
        if self._server is not None:
            raise RuntimeError("the site is already running")
        server = _Server((self.host, self.port), _Handler)
        server.site = self
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name=f"LocalSite:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (held requests are released) and close the listening socket."""
        self._released.set()
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self) -> LocalSite:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """Base URL without a trailing slash, e.g. ``http://127.0.0.1:8000`` (the address
        the site had, once stopped; the port is known once started)."""
        return f"http://{self.host}:{self.port}"

    # -- the shop ---------------------------------------------------------------------------

    def set_catalogue(self, listing_pages: int, products_per_page: int) -> None:
        """The shop's size, from now on (the same site grows or shrinks between crawls)."""
        if listing_pages < 1 or products_per_page < 1:
            raise ValueError("listing_pages and products_per_page must be at least 1")
        self.listing_pages = listing_pages
        self.products_per_page = products_per_page

    def set_price_version(self, price_version: int) -> None:
        """Change every price from now on (the site changes while it is being crawled)."""
        if price_version < 0:
            raise ValueError(f"price_version must be >= 0, got {price_version}")
        self.price_version = price_version

    def set_products_failing(self, products_failing: Iterable[int]) -> None:
        """Make these products (and only these) answer 503 from now on (a site that
        recovers, on the same address)."""
        self.products_failing = frozenset(products_failing)

    @property
    def product_count(self) -> int:
        """Number of products in the shop."""
        return self.listing_pages * self.products_per_page

    @property
    def page_count(self) -> int:
        """Number of pages a complete crawl of the shop from ``/list/1`` fetches."""
        return self.listing_pages + self.product_count

    def expected_products(self) -> dict[str, dict[str, str]]:
        """What a correct crawl of the shop stores: ``{sku: {"sku", "name", "price"}}``
        (products in ``products_failing`` included: they exist, the site just fails them)."""
        return {
            product_sku(n): {"sku": product_sku(n), "name": product_name(n),
                             "price": product_price(n, self.price_version)}
            for n in range(1, self.product_count + 1)
        }

    # -- a test's own routes ----------------------------------------------------------------

    def add(self, path: str, body: str | bytes, content_type: str = "text/html; charset=utf-8",
            status: int = 200, *, headers: dict[str, str] | None = None, delay: float = 0.0,
            held: bool = False) -> None:
        """Serve ``body`` at ``path``; ``delay``: seconds to wait first; ``held``: answer only
        once the site is released (:meth:`release`)."""
        data = body.encode("utf-8") if isinstance(body, str) else body
        self.routes[path] = _Route(status, content_type, data, dict(headers or {}), delay, held)

    def add_responder(self, path: str, responder: Responder) -> None:
        """Answer requests of ``path`` (any method) with ``responder(received)``, which returns
        ``(status, headers, body)`` (a ``Content-Type`` among the headers, else JSON). It runs
        on the site's handler thread: state it shares with the test needs a lock."""
        self.responders[path] = responder

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

    def release(self) -> None:
        """Let held requests (``/block/...``, routes added with ``held``, every request after
        :meth:`hold`) be answered."""
        self._holding = False
        self._released.set()

    def hold(self) -> None:
        """Hold every request arriving from now on, the shop's pages too, until
        :meth:`release`: a crawler's progress stopped while its requests are on the wire."""
        self._released.clear()
        self._holding = True

    def block(self) -> None:
        """Hold ``/block/...`` requests and held routes again (until the next release)."""
        self._released.clear()

    # -- counters ---------------------------------------------------------------------------

    def _arrived(self, method: str, path: str, full_path: str, headers: dict[str, str]) -> int:
        """Counts a request; returns how many requests of its path arrived so far."""
        with self._lock:
            self._by_path[path] += 1
            self._by_full_path[full_path] += 1
            self._by_method[f"{method} {path}"] += 1
            self.headers_seen.append(headers)
            self._arrivals.append((path, self._in_flight))
            self._arrival_times.append(time.monotonic())
            self._in_flight += 1
            self._in_flight_by_agent[headers.get("User-Agent", "")] += 1
            self._most_in_flight = max(self._most_in_flight, self._in_flight)
            return self._by_path[path]

    def _answered(self, agent: str) -> None:
        with self._lock:
            self._in_flight -= 1
            self._in_flight_by_agent[agent] -= 1

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
        """Requests received per path (without query) since the last reset."""
        with self._lock:
            return dict(self._by_path)

    @property
    def request_count(self) -> int:
        """Requests received since the last reset (control pages not counted)."""
        with self._lock:
            return sum(self._by_path.values())

    @property
    def in_flight(self) -> int:
        """Requests received and not yet answered."""
        with self._lock:
            return self._in_flight

    def arrivals(self) -> list[tuple[str, int]]:
        """``(path, other requests in flight when it arrived)`` of every request, in arrival
        order (since the last reset)."""
        with self._lock:
            return list(self._arrivals)

    def in_flight_of(self, user_agent: str) -> int:
        """Requests received with that ``User-Agent`` header and not yet answered (one
        crawler's, when each crawler has its own)."""
        with self._lock:
            return self._in_flight_by_agent[user_agent]

    @property
    def most_in_flight(self) -> int:
        """The most requests in flight at once (received, not yet answered) since the last
        reset."""
        with self._lock:
            return self._most_in_flight

    def arrival_times(self) -> list[float]:
        """``time.monotonic()`` of every counted arrival, in arrival order (since the last
        reset): the site's own clock, comparable across the sites of one test process."""
        with self._lock:
            return list(self._arrival_times)

    def intervals(self) -> list[float]:
        """Seconds between two consecutive arrivals (the starts of two requests as the site
        saw them), in arrival order; the site's resolution is its accept loop's, about a
        millisecond."""
        times = self.arrival_times()
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"requests": sum(self._by_path.values()), "by_path": dict(self._by_path),
                    "by_full_path": dict(self._by_full_path),
                    "by_method": dict(self._by_method)}

    def reset_counts(self) -> None:
        """Zero the counters (and forget the headers and arrivals seen so far)."""
        with self._lock:
            self._by_path.clear()
            self._by_full_path.clear()
            self._by_method.clear()
            self._arrivals.clear()
            self._arrival_times.clear()
            self._most_in_flight = self._in_flight
            self.headers_seen.clear()

    def __repr__(self) -> str:
        state = "running" if self._server is not None else "stopped"
        return f"<LocalSite {self.host}:{self.port} {state}>"
