"""The shop with product images, for the files-named-by-identity tests.

* :class:`ImageSite`: an HTTP server on 127.0.0.1 (port 0) answering ``/img/<sku>.png`` with a
  small PNG of that product (any query string), counting requests per path;
* :class:`ImageShopSpider`: the example shop's spider whose product items also carry
  ``image_urls`` (the product's image, with a tracking parameter that differs per crawl
  process: ``?utm_source=<pid>``) and an ``images`` field for ``ImagesPipeline``'s result;
* ``python tests/image_shop.py --url SHOP --images IMAGES --db DB --store DIR [-s NAME=JSON]``
  runs that spider with the add-on and ``ImagesPipeline`` in a ``CrawlerProcess`` of its own
  (the kill tests' subprocess).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any

import scrapy

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent / "example_project"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from shop.spiders.shop import ShopSpider  # noqa: E402


def product_png(sku: str) -> bytes:
    """A 16x16 PNG whose colour derives from ``sku``."""
    from PIL import Image

    digest = int(hashlib.sha1(sku.encode()).hexdigest()[:6], 16)
    colour = (digest & 255, (digest >> 8) & 255, (digest >> 16) & 255)
    out = io.BytesIO()
    Image.new("RGB", (16, 16), colour).save(out, format="PNG")
    return out.getvalue()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        with self.server.lock:
            self.server.hits[path] += 1
        if not (path.startswith("/img/") and path.endswith(".png")):
            self.send_error(404)
            return
        body = product_png(path[len("/img/"):-len(".png")])
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hits: Counter[str]
    lock: threading.Lock


class ImageSite:
    """``with ImageSite() as images:`` ... ``images.url``; ``images.hits`` counts requests
    by path (without the query)."""

    def __init__(self) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.hits = Counter()
        self._server.lock = threading.Lock()
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def hits(self) -> Counter[str]:
        with self._server.lock:
            return Counter(self._server.hits)

    def __enter__(self) -> ImageSite:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class ProductImageItem(scrapy.Item):
    sku = scrapy.Field()
    name = scrapy.Field()
    price = scrapy.Field()
    url = scrapy.Field()
    image_urls = scrapy.Field()
    images = scrapy.Field()


class ImageShopSpider(ShopSpider):
    """The shop spider; each product also has its image (``-a images=URL``)."""

    name = "image_shop"

    def __init__(self, url: str = "", images: str = "", tracking: str = "",
                 **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.images = images.rstrip("/")
        self.tracking = tracking or str(os.getpid())

    def parse_product(self, response: Any) -> Iterator[Any]:
        for product in super().parse_product(response):
            yield ProductImageItem(
                **dict(product),
                image_urls=[f"{self.images}/img/{product['sku']}.png"
                            f"?utm_source={self.tracking}"])


def image_settings(db: str, store: str) -> dict[str, Any]:
    return {
        "ADDONS": {"scrapy_idempotent.Addon": 0},
        "IDEMPOTENT_DATABASE": db,
        "IDEMPOTENT_NATURAL_KEYS": {"image_shop.ProductImageItem": "sku"},
        "ITEM_PIPELINES": {"scrapy.pipelines.images.ImagesPipeline": 1},
        "IMAGES_STORE": store,
        "ROBOTSTXT_OBEY": False,
        "TELNETCONSOLE_ENABLED": False,
        "MEMUSAGE_ENABLED": False,
        "RETRY_ENABLED": False,
        "CONCURRENT_REQUESTS": 16,
        "CONCURRENT_REQUESTS_PER_DOMAIN": 16,
    }


def main(argv: list[str] | None = None) -> None:
    from scrapy.crawler import CrawlerProcess

    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--images", required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("-s", dest="settings", action="append", default=[])
    args = parser.parse_args(argv)
    settings = image_settings(args.db, args.store)
    settings["LOG_LEVEL"] = "INFO"
    for pair in args.settings:
        name, _, value = pair.partition("=")
        settings[name] = json.loads(value)
    process = CrawlerProcess(settings)
    process.crawl(ImageShopSpider, url=args.url, images=args.images)
    process.start()


if __name__ == "__main__":
    import image_shop  # the spider and item classes under their module name

    image_shop.main()
