"""A shop of static files, for the conditional-request tests: served as a real site serves
static files, with ``ETag`` and ``Last-Modified``, answering ``304 Not Modified`` to a request
whose validators match.

* :func:`write_shop`: ``/list/<n>.html`` pages linking their products
  ``/product/<sku>.html`` and the next listing page; every product page carries ``filler``
  characters of description (a product page's usual weight);
  :func:`change_products` rewrites some products with a new price (and a later mtime);
* :class:`StaticSite`: serves a directory with nginx when it is installed (as Debian ships
  it: ``ETag`` and ``Last-Modified``, both honoured; ``IDEMPOTENT_TESTS_NGINX=0`` in the
  environment does without), else with the tests' local site
  answering as nginx does; with ``honour_validators=False`` a site that ignores the
  validators it is sent and always answers 200;
* :class:`StaticShopSpider`: crawls the listing pages and yields one product item per
  product page (natural key: ``sku``);
* ``python tests/static_shop.py --url URL --db DB [-s NAME=JSON] [--clock-offset S]`` runs
  that spider with the add-on in a ``CrawlerProcess`` of its own (the kill tests'
  subprocess); with ``--clock-offset`` the store's clock is ``S`` seconds ahead of the wall
  clock (adaptive revisits' rounds, days apart).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import scrapy
from scrapy.spiders import SitemapSpider

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_site import LocalSite, Received

#: product pages' mtime steps: a changed page's Last-Modified differs from its old one
_MTIME_STEP = 10


def sku(n: int) -> str:
    return f"SKU-{n:05d}"


def _product_page(n: int, price: int, filler: int) -> str:
    text = ("A fine product, described at length. " * (filler // 37 + 1))[:filler]
    return (f'<html><body><span class="sku">{sku(n)}</span><h1>Product {n}</h1>'
            f'<span class="price">{price}</span><p>{text}</p></body></html>')


def write_shop(root: Path, *, listings: int, per_page: int, filler: int = 8000) -> list[str]:
    """Write the shop under ``root``; returns every SKU."""
    (root / "list").mkdir(parents=True, exist_ok=True)
    (root / "product").mkdir(exist_ok=True)
    skus: list[str] = []
    old = time.time() - 3600  # files an hour old: a change later gets a later mtime
    for page in range(1, listings + 1):
        numbers = range((page - 1) * per_page + 1, page * per_page + 1)
        links = "".join(f'<a class="product" href="/product/{sku(n)}.html">{n}</a>\n'
                        for n in numbers)
        if page < listings:
            links += f'<a class="next" href="/list/{page + 1}.html">next</a>\n'
        path = root / "list" / f"{page}.html"
        path.write_text(f"<html><body>{links}</body></html>")
        os.utime(path, (old, old))
        for n in numbers:
            product = root / "product" / f"{sku(n)}.html"
            product.write_text(_product_page(n, 100 + n, filler))
            os.utime(product, (old, old))
            skus.append(sku(n))
    return skus


def change_products(root: Path, numbers: list[int], *, filler: int = 8000) -> None:
    """Give the products ``numbers`` a new price (their files a later mtime)."""
    for n in numbers:
        product = root / "product" / f"{sku(n)}.html"
        before = product.stat().st_mtime
        product.write_text(_product_page(n, 5000 + n, filler))
        os.utime(product, (before + _MTIME_STEP, before + _MTIME_STEP))


def write_sitemap(root: Path, url: str, lastmods: dict[str, str]) -> None:
    """``/sitemap.xml`` listing the product pages of ``lastmods`` (sku -> lastmod) of the
    shop served at ``url``."""
    entries = "".join(f"<url><loc>{url}/product/{code}.html</loc><lastmod>{lastmod}</lastmod>"
                      "</url>\n" for code, lastmod in lastmods.items())
    (root / "sitemap.xml").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">\n{entries}</urlset>\n')


def new_price(n: int) -> int:
    return 5000 + n


def old_price(n: int) -> int:
    return 100 + n


# -- the server ------------------------------------------------------------------------------

_NGINX_CONF = """\
{user}
worker_processes 1;
error_log {conf_dir}/error.log warn;
pid {conf_dir}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    access_log {conf_dir}/access.log;
    client_body_temp_path {conf_dir}/client_body;
    proxy_temp_path {conf_dir}/proxy;
    fastcgi_temp_path {conf_dir}/fastcgi;
    uwsgi_temp_path {conf_dir}/uwsgi;
    scgi_temp_path {conf_dir}/scgi;
    types {{ text/html html; }}
    default_type text/html;
    keepalive_requests 1000000;
    {validators}
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ }}
    }}
}}
"""


def nginx_path() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(p)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _file_responder(root: Path, path: str, honour_validators: bool) -> Any:
    """A responder of the local site serving the file at ``path`` under ``root`` as a static
    file server does: ``ETag`` (mtime and size, as nginx makes it) and ``Last-Modified``, a
    304 when the request's validators match (unless ``honour_validators`` is False)."""
    from email.utils import formatdate, parsedate_to_datetime

    def answer(request: Received) -> tuple[int, dict[str, str], bytes]:
        file = root / path.lstrip("/")
        if not file.is_file():
            return 404, {"Content-Type": "text/html"}, b"not found"
        stat = file.stat()
        etag = f'"{int(stat.st_mtime):x}-{stat.st_size:x}"'
        headers = {"Content-Type": "text/xml" if path.endswith(".xml") else "text/html",
                   "ETag": etag,
                   "Last-Modified": formatdate(int(stat.st_mtime), usegmt=True)}
        if honour_validators:
            if request.headers.get("If-None-Match") == etag:
                return 304, headers, b""
            since = request.headers.get("If-Modified-Since")
            if since and "If-None-Match" not in request.headers \
                    and parsedate_to_datetime(since).timestamp() >= int(stat.st_mtime):
                return 304, headers, b""
        return 200, headers, file.read_bytes()

    return answer


class StaticSite:
    """``root`` served on 127.0.0.1 (see the module docstring); a context manager."""

    def __init__(self, root: Path, conf_dir: Path, *, honour_validators: bool = True,
                 use_nginx: bool = os.environ.get("IDEMPOTENT_TESTS_NGINX") != "0") -> None:
        self.root = root
        self.conf_dir = conf_dir
        self.honour_validators = honour_validators
        self.nginx = nginx_path() if use_nginx else None
        self.kind = "nginx" if self.nginx else "the tests' local site"
        self.url = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._site: LocalSite | None = None

    @property
    def request_count(self) -> int:
        """Requests the site answered so far."""
        if self.nginx:
            log = self.conf_dir / "access.log"
            return log.read_bytes().count(b"\n") if log.exists() else 0
        return self._site.request_count if self._site is not None else 0

    def __enter__(self) -> StaticSite:
        if self.nginx:
            self._start_nginx(self.nginx)
        else:
            self._site = LocalSite().start()
            paths = {"/" + str(f.relative_to(self.root)) for f in self.root.rglob("*")
                     if f.is_file()} | {"/sitemap.xml"}
            for path in paths:
                self._site.add_responder(path, _file_responder(self.root, path,
                                                               self.honour_validators))
            self.url = self._site.url
        return self

    def _start_nginx(self, nginx: str) -> None:
        port = _free_port()
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        conf = self.conf_dir / "nginx.conf"
        validators = "" if self.honour_validators else "etag off; if_modified_since off;"
        # as root, nginx's workers would be ``nobody``, who cannot read a test's directory
        user = "user root;" if os.geteuid() == 0 else ""
        conf.write_text(_NGINX_CONF.format(user=user, conf_dir=self.conf_dir, port=port,
                                           root=self.root, validators=validators))
        self._proc = subprocess.Popen(
            [nginx, "-p", str(self.conf_dir), "-e", str(self.conf_dir / "error.log"),
             "-c", str(conf), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:  # wait for its socket, not for a time
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                return
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start: {self.conf_dir / 'error.log'}")
            time.sleep(0.05)

    def __exit__(self, *exc: Any) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
        if self._site is not None:
            self._site.stop()


# -- the spider ------------------------------------------------------------------------------


class StaticShopSpider(scrapy.Spider):
    name = "static_shop"
    custom_settings: ClassVar[dict[str, Any]] = {"IDEMPOTENT_NATURAL_KEYS": {"dict": "sku"}}

    def __init__(self, url: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start_urls = [f"{url}/list/1.html"]

    def parse(self, response: Any) -> Iterator[Any]:
        for href in response.css("a.product::attr(href)").getall():
            yield response.follow(href, self.parse_product)
        for href in response.css("a.next::attr(href)").getall():
            yield response.follow(href, self.parse)

    def parse_product(self, response: Any) -> Iterator[Any]:
        yield {"sku": response.css(".sku::text").get(),
               "price": int(response.css(".price::text").get())}


class SitemapShopSpider(SitemapSpider):
    """The shop's products, found through its sitemap."""

    name = "sitemap_shop"
    custom_settings: ClassVar[dict[str, Any]] = {"IDEMPOTENT_NATURAL_KEYS": {"dict": "sku"}}
    sitemap_rules: ClassVar[list[tuple[str, str]]] = [("/product/", "parse_product")]

    def __init__(self, url: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sitemap_urls = [f"{url}/sitemap.xml"]

    parse_product = StaticShopSpider.parse_product


def shop_settings(db: str, **extra: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "ADDONS": {"scrapy_idempotent.Addon": 0},
        "IDEMPOTENT_DATABASE": db,
        "IDEMPOTENT_CONDITIONAL_REQUESTS": True,
        "ROBOTSTXT_OBEY": False,
        "LOG_LEVEL": "WARNING",
        "TELNETCONSOLE_ENABLED": False,
        "MEMUSAGE_ENABLED": False,
        "RETRY_ENABLED": False,
        "CONCURRENT_REQUESTS": 16,
        "CONCURRENT_REQUESTS_PER_DOMAIN": 16,
    }
    settings.update(extra)
    return settings


def _setting(text: str) -> tuple[str, Any]:
    name, value = text.split("=", 1)
    try:
        return name, json.loads(value)
    except ValueError:  # a plain string (LOG_FILE=...)
        return name, value


def clock_ahead(seconds: float) -> None:
    """The stores the crawl opens from now on keep time ``seconds`` ahead of the wall
    clock (a crawl's components never read the wall clock for revisits)."""
    import scrapy_idempotent.scheduler as scheduler_module

    opened = scheduler_module.open_store

    def store_ahead(database: str, **options: Any) -> Any:
        return opened(database, **{**options, "clock": lambda: time.time() + seconds})

    scheduler_module.open_store = store_ahead  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("-s", action="append", default=[], metavar="NAME=JSON")
    parser.add_argument("--clock-offset", type=float, default=0.0)
    args = parser.parse_args()
    extra = dict(_setting(s) for s in args.s)
    if args.clock_offset:
        clock_ahead(args.clock_offset)
    from scrapy.crawler import CrawlerProcess

    process = CrawlerProcess(shop_settings(args.db, **{"LOG_LEVEL": "INFO", **extra}))
    process.crawl(StaticShopSpider, url=args.url)
    process.start()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
