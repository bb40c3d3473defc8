"""A small, deterministic test shop served from the standard library.

The shop is the target of the example spider, of the kill demo and of the test suite. It has
``listing_pages`` listing pages, each linking ``products_per_page`` product pages, so with the
defaults (25 x 20) a complete crawl fetches 525 pages and yields 500 products.

Pages:

* ``/`` answers 302 with ``Location: /list/1``.
* ``/list/<n>`` links products ``(n-1)*per_page+1 .. n*per_page`` (``/product/SKU-00001``, ...),
  the next listing page if there is one, and always ``/list/1`` (so links are rediscovered).
* ``/product/<sku>`` shows ``<h1 class="name">``, ``<span class="sku">``, ``<span class="price">``.
* ``GET /__stats__`` returns ``{"requests": N, "by_path": {path: n}}``; ``POST`` or ``GET``
  ``/__reset__`` zeroes the counters. Neither of these two is counted.
* Anything else is a 404; a product listed in ``products_failing`` answers 503.

Everything is deterministic: product ``i`` (1-based) has SKU ``SKU-{i:05d}``, a name derived from
``i`` and a price derived from ``i`` and ``price_version`` (any other version changes every price).

Use it from Python::

    with ShopSite(port=0) as site:
        print(site.url, site.request_count)

or from the command line (from ``example_project/``)::

    python -m shop.site --port 8000

This module uses the standard library only, so tests can import it without Scrapy.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

__all__ = [
    "ShopSite",
    "listing_html",
    "product_html",
    "product_name",
    "product_price",
    "product_sku",
]

STATS_PATH = "/__stats__"
RESET_PATH = "/__reset__"

_ADJECTIVES = (
    "Sturdy",
    "Compact",
    "Deluxe",
    "Classic",
    "Portable",
    "Quiet",
    "Bright",
    "Rugged",
    "Slim",
    "Vintage",
    "Smart",
)
_NOUNS = (
    "Kettle",
    "Lamp",
    "Backpack",
    "Toaster",
    "Umbrella",
    "Headphones",
    "Blender",
    "Notebook",
    "Thermos",
    "Skillet",
    "Bicycle Bell",
    "Desk Fan",
    "Tent",
)
_LIST_RE = re.compile(r"/list/([0-9]+)")
_PRODUCT_RE = re.compile(r"/product/(SKU-[0-9]{5})")


def product_sku(number: int) -> str:
    """Return the SKU of product ``number`` (1-based), e.g. ``SKU-00042``."""
    return f"SKU-{number:05d}"


def product_name(number: int) -> str:
    """Return the deterministic display name of product ``number``."""
    adjective = _ADJECTIVES[number % len(_ADJECTIVES)]
    noun = _NOUNS[(number // len(_ADJECTIVES)) % len(_NOUNS)]
    return f"{adjective} {noun} #{number}"


def product_price(number: int, price_version: int = 0) -> str:
    """Return the price of product ``number`` as a string such as ``"12.34"``.

    The base price is spread over 5.00 .. 99.99 by a fixed permutation of ``number``; each
    ``price_version`` step adds 1.00, so two different versions never give a product the same
    price.
    """
    cents = 500 + (number * 7919 + 31) % 9500 + 100 * price_version
    return f"{cents // 100}.{cents % 100:02d}"


class _ShopServer(ThreadingHTTPServer):
    """The HTTP server: holds the catalogue options and the request counters."""

    daemon_threads = True
    # Many short-lived loopback connections: do not let a small backlog refuse them.
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        *,
        listing_pages: int,
        products_per_page: int,
        price_version: int,
        delay: float,
        products_failing: frozenset[int],
        verbose: bool,
    ) -> None:
        self.listing_pages = listing_pages
        self.products_per_page = products_per_page
        self.price_version = price_version
        self.delay = delay
        self.products_failing = products_failing
        self.verbose = verbose
        self.counts_lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.in_flight = 0  #: counted requests received and not yet answered
        #: (path, other requests in flight when it arrived), in arrival order
        self.arrivals: list[tuple[str, int]] = []
        super().__init__(address, _ShopHandler)

    @property
    def product_count(self) -> int:
        return self.listing_pages * self.products_per_page

    def count(self, path: str) -> None:
        with self.counts_lock:
            self.counts[path] += 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Ignore clients that went away (a killed crawler resets its connections)."""
        if isinstance(sys.exc_info()[1], ConnectionError) and not self.verbose:
            return
        super().handle_error(request, client_address)


class _ShopHandler(BaseHTTPRequestHandler):
    """Serves one connection (HTTP/1.1 keep-alive) of the shop."""

    server: _ShopServer
    protocol_version = "HTTP/1.1"
    server_version = "ShopSite/1.0"
    # Without TCP_NODELAY, loopback responses stall ~40 ms on delayed ACKs.
    disable_nagle_algorithm = True
    # Close idle keep-alive connections eventually so handler threads do not pile up.
    timeout = 30

    # --- request entry points -------------------------------------------------------------

    def do_GET(self) -> None:
        self._handle(send_body=True)

    def do_HEAD(self) -> None:
        self._handle(send_body=False)

    def do_POST(self) -> None:
        self._discard_request_body()
        path = self._path()
        if path == RESET_PATH:
            self._reset(send_body=True)
        else:
            self.server.count(path)
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, "text/plain", b"method not allowed\n")

    # --- routing ---------------------------------------------------------------------------

    def _path(self) -> str:
        return self.path.split("?", 1)[0].split("#", 1)[0]

    def _handle(self, *, send_body: bool) -> None:
        path = self._path()
        if path == STATS_PATH:
            self._stats(send_body=send_body)
            return
        if path == RESET_PATH:
            self._reset(send_body=send_body)
            return
        self.server.count(path)
        with self.server.counts_lock:
            self.server.arrivals.append((path, self.server.in_flight))
            self.server.in_flight += 1
        try:
            self._answer(path, send_body)
        finally:
            with self.server.counts_lock:
                self.server.in_flight -= 1

    def _answer(self, path: str, send_body: bool) -> None:
        if self.server.delay > 0:
            time.sleep(self.server.delay)
        if path == "/":
            self._send(HTTPStatus.FOUND, "text/plain", b"", send_body, location="/list/1")
            return
        match = _LIST_RE.fullmatch(path)
        if match:
            page = int(match.group(1))
            if 1 <= page <= self.server.listing_pages:
                self._send_html(self._listing_html(page), send_body=send_body)
                return
        match = _PRODUCT_RE.fullmatch(path)
        if match:
            number = int(match.group(1)[4:])
            if 1 <= number <= self.server.product_count:
                if number in self.server.products_failing:
                    body = b"temporarily unavailable\n"
                    self._send(HTTPStatus.SERVICE_UNAVAILABLE, "text/plain", body, send_body)
                else:
                    self._send_html(self._product_html(number), send_body=send_body)
                return
        self._send(HTTPStatus.NOT_FOUND, "text/plain", b"not found\n", send_body=send_body)

    def _stats(self, *, send_body: bool) -> None:
        with self.server.counts_lock:
            by_path = dict(sorted(self.server.counts.items()))
        payload = {"requests": sum(by_path.values()), "by_path": by_path}
        body = json.dumps(payload).encode()
        self._send(HTTPStatus.OK, "application/json", body, send_body=send_body)

    def _reset(self, *, send_body: bool) -> None:
        with self.server.counts_lock:
            self.server.counts.clear()
        body = b'{"requests": 0, "by_path": {}}'
        self._send(HTTPStatus.OK, "application/json", body, send_body=send_body)

    # --- pages -----------------------------------------------------------------------------

    def _listing_html(self, page: int) -> str:
        return listing_html(page, self.server.listing_pages, self.server.products_per_page)

    def _product_html(self, number: int) -> str:
        return product_html(number, self.server.price_version)

    # --- low-level I/O ---------------------------------------------------------------------

    def _send_html(self, text: str, *, send_body: bool) -> None:
        self._send(HTTPStatus.OK, "text/html; charset=utf-8", text.encode(), send_body=send_body)

    def _send(
        self,
        status: HTTPStatus,
        content_type: str,
        body: bytes,
        send_body: bool = True,
        location: str | None = None,
    ) -> None:
        """Write status line, headers and body in one ``write`` (one TCP segment when small)."""
        headers = [
            f"{self.protocol_version} {status.value} {status.phrase}",
            f"Server: {self.server_version}",
            f"Date: {self.date_time_string()}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
        ]
        if location is not None:
            headers.append(f"Location: {location}")
        if self.close_connection:
            headers.append("Connection: close")
        head = ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1")
        self.wfile.write(head + body if send_body else head)
        if self.server.verbose:
            self.log_request(status.value, len(body))

    def _discard_request_body(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > 0:
            self.rfile.read(length)

    def log_message(self, format: str, *args: Any) -> None:
        """Log to stderr only with ``--verbose``; errors are always logged."""
        if self.server.verbose:
            super().log_message(format, *args)

    def log_error(self, format: str, *args: Any) -> None:
        # Timeouts of idle keep-alive connections are routine; report the rest.
        if self.server.verbose or "timed out" not in format % args:
            super().log_message(format, *args)


def _page(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f"<title>{title}</title></head>\n<body>\n{body}\n</body></html>\n"
    )


def listing_html(page: int, listing_pages: int, products_per_page: int) -> str:
    """The HTML of listing page ``page`` (1-based) of a shop of ``listing_pages`` pages."""
    first = (page - 1) * products_per_page + 1
    items = "\n".join(
        f'    <li><a class="product" href="/product/{product_sku(n)}">'
        f"{html.escape(product_name(n))}</a></li>"
        for n in range(first, first + products_per_page)
    )
    nav = ['<a class="listing first" href="/list/1">first page</a>']
    if page < listing_pages:
        nav.append(f'<a class="listing next" href="/list/{page + 1}">next page</a>')
    return _page(
        f"Products, page {page}",
        f'<h1>Products, page {page}</h1>\n<ul class="products">\n{items}\n</ul>\n'
        f"<nav>{' '.join(nav)}</nav>",
    )


def product_html(number: int, price_version: int = 0) -> str:
    """The HTML of product ``number``'s page."""
    name = html.escape(product_name(number))
    price = product_price(number, price_version)
    return _page(
        name,
        f'<div class="product">\n<h1 class="name">{name}</h1>\n'
        f'<p>SKU: <span class="sku">{product_sku(number)}</span></p>\n'
        f'<p>Price: <span class="price">{price}</span> EUR</p>\n</div>\n'
        '<nav><a class="listing first" href="/list/1">all products</a></nav>',
    )


class ShopSite:
    """The shop server, run in a background thread.

    Args:
        host: address to bind.
        port: port to bind; 0 picks a free one (read it back from :attr:`url`).
        listing_pages: number of listing pages.
        products_per_page: products linked from each listing page.
        price_version: changes every price when changed (for change-detection tests).
        delay: seconds each counted request sleeps before it is answered.
        products_failing: product numbers (1-based) that answer 503.
        verbose: log every request to stderr.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        listing_pages: int = 25,
        products_per_page: int = 20,
        price_version: int = 0,
        delay: float = 0.0,
        products_failing: Iterable[int] = (),
        verbose: bool = False,
    ) -> None:
        if listing_pages < 1 or products_per_page < 1:
            raise ValueError("listing_pages and products_per_page must be at least 1")
        if price_version < 0:
            raise ValueError(f"price_version must be >= 0, got {price_version}")
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        self.host = host
        self.port = port
        self.listing_pages = listing_pages
        self.products_per_page = products_per_page
        self.price_version = price_version
        self.delay = delay
        self.products_failing = frozenset(products_failing)
        self.verbose = verbose
        self._server: _ShopServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> ShopSite:
        """Bind and serve in a daemon thread; returns ``self``."""
        if self._server is not None:
            raise RuntimeError("ShopSite is already running")
        server = _ShopServer(
            (self.host, self.port),
            listing_pages=self.listing_pages,
            products_per_page=self.products_per_page,
            price_version=self.price_version,
            delay=self.delay,
            products_failing=self.products_failing,
            verbose=self.verbose,
        )
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"ShopSite:{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> ShopSite:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- information -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL without a trailing slash, e.g. ``http://127.0.0.1:8000``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def product_count(self) -> int:
        """Number of products in the catalogue."""
        return self.listing_pages * self.products_per_page

    @property
    def page_count(self) -> int:
        """Number of pages a complete crawl from ``/list/1`` fetches."""
        return self.listing_pages + self.product_count

    @property
    def request_count(self) -> int:
        """Requests served since the last reset, not counting ``/__stats__`` and ``/__reset__``."""
        return sum(self.counts_by_path().values())

    def counts_by_path(self) -> dict[str, int]:
        """Requests served per path since the last reset."""
        server = self._require_server()
        with server.counts_lock:
            return dict(server.counts)

    @property
    def in_flight(self) -> int:
        """Counted requests received and not yet answered."""
        server = self._require_server()
        with server.counts_lock:
            return server.in_flight

    def arrivals(self) -> list[tuple[str, int]]:
        """``(path, other requests in flight when it arrived)`` of every counted request, in
        arrival order (since the last reset)."""
        server = self._require_server()
        with server.counts_lock:
            return list(server.arrivals)

    def set_price_version(self, price_version: int) -> None:
        """Change every price from now on (the site changes while it is being crawled)."""
        if price_version < 0:
            raise ValueError(f"price_version must be >= 0, got {price_version}")
        self.price_version = price_version
        self._require_server().price_version = price_version

    def set_products_failing(self, products_failing: Iterable[int]) -> None:
        """Make these products (and only these) answer 503 from now on (a site that
        recovers, on the same address)."""
        self.products_failing = frozenset(products_failing)
        self._require_server().products_failing = self.products_failing

    def reset_counts(self) -> None:
        """Zero the request counters."""
        server = self._require_server()
        with server.counts_lock:
            server.counts.clear()
            server.arrivals.clear()

    def expected_products(self) -> dict[str, dict[str, str]]:
        """What a correct crawl stores: ``{sku: {"sku": ..., "name": ..., "price": ...}}``.

        Products in ``products_failing`` are included: they exist, the site just fails them.
        """
        return {
            product_sku(n): {
                "sku": product_sku(n),
                "name": product_name(n),
                "price": product_price(n, self.price_version),
            }
            for n in range(1, self.product_count + 1)
        }

    def _require_server(self) -> _ShopServer:
        if self._server is None:
            raise RuntimeError("ShopSite is not running; call start() first")
        return self._server

    def __repr__(self) -> str:
        state = "running" if self._server is not None else "stopped"
        return f"<ShopSite {self.url} {state}>"


def _parse_numbers(text: str) -> list[int]:
    """Parse ``"3,7,10-12"`` into ``[3, 7, 10, 11, 12]``."""
    numbers: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, sep, high = part.partition("-")
        numbers.extend(range(int(low), int(high) + 1) if sep else [int(low)])
    return numbers


def main(argv: list[str] | None = None) -> int:
    """Command line entry point: serve the shop until Ctrl+C."""
    parser = argparse.ArgumentParser(
        prog="python -m shop.site", description="Serve the local test shop."
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (0 = any free port)")
    parser.add_argument("--listing-pages", type=int, default=25, help="listing pages (25)")
    parser.add_argument(
        "--products-per-page", type=int, default=20, help="products per listing page (20)"
    )
    parser.add_argument(
        "--price-version", type=int, default=0, help="change every price by picking another (0)"
    )
    parser.add_argument(
        "--delay", type=float, default=0.0, help="seconds to wait before each answer (0)"
    )
    parser.add_argument(
        "--fail",
        default="",
        metavar="NUMBERS",
        help="product numbers that answer 503, e.g. 3,7,10-12",
    )
    parser.add_argument("--verbose", action="store_true", help="log every request")
    args = parser.parse_args(argv)
    try:
        site = ShopSite(
            args.host,
            args.port,
            listing_pages=args.listing_pages,
            products_per_page=args.products_per_page,
            price_version=args.price_version,
            delay=args.delay,
            products_failing=_parse_numbers(args.fail),
            verbose=args.verbose,
        )
    except ValueError as exc:
        parser.error(str(exc))
    with site:
        print(f"Shop serving at {site.url}/list/1 ({site.page_count} pages); Ctrl+C to stop")
        sys.stdout.flush()
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            print(f"\nstopped after {site.request_count} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
