"""The shop with product images, for the files-named-by-identity tests.

* :func:`serve_product_images`: the local site (``local_site.LocalSite``, the shop) answers
  ``/img/<sku>.png`` with a small PNG of that product (any query string);
  :func:`image_downloads` counts those requests;
* :class:`ImageShopSpider`: the example shop's spider whose product items also carry
  ``image_urls`` (the product's image, with a tracking parameter that differs per crawl
  process: ``?utm_source=<pid>``) and an ``images`` field for ``ImagesPipeline``'s result;
* :class:`FileShopSpider`: the same, the image as a plain file for ``FilesPipeline``
  (``file_urls``, ``files``);
* ``python tests/image_shop.py --url SHOP --db DB --store DIR [--images URL] [-s NAME=JSON]``
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import scrapy

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent / "example_project"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from local_site import LocalSite  # noqa: E402

from shop.site import product_sku  # noqa: E402
from shop.spiders.shop import ShopSpider  # noqa: E402


def product_png(sku: str) -> bytes:
    """A 16x16 PNG whose colour derives from ``sku``."""
    from PIL import Image

    digest = int(hashlib.sha1(sku.encode()).hexdigest()[:6], 16)
    colour = (digest & 255, (digest >> 8) & 255, (digest >> 16) & 255)
    out = io.BytesIO()
    Image.new("RGB", (16, 16), colour).save(out, format="PNG")
    return out.getvalue()


def serve_product_images(site: LocalSite) -> None:
    """Have ``site`` (the shop) answer ``/img/<sku>.png`` of each of its products, whatever
    the query string, with that product's PNG."""
    for number in range(1, site.product_count + 1):
        sku = product_sku(number)
        site.add(f"/img/{sku}.png", product_png(sku), "image/png")


def image_downloads(site: LocalSite) -> int:
    """Requests of product images ``site`` received (since its last counter reset)."""
    return sum(count for path, count in site.counts_by_path().items()
               if path.startswith("/img/"))


class ProductImageItem(scrapy.Item):
    sku = scrapy.Field()
    name = scrapy.Field()
    price = scrapy.Field()
    url = scrapy.Field()
    image_urls = scrapy.Field()
    images = scrapy.Field()


class ImageShopSpider(ShopSpider):
    """The shop spider; each product also has its image (on the site of ``-a images=URL``,
    by default the shop's own)."""

    name = "image_shop"

    def __init__(self, url: str = "", images: str = "", tracking: str = "",
                 **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.images = (images or url).rstrip("/")
        self.tracking = tracking or str(os.getpid())

    def parse_product(self, response: Any) -> Iterator[Any]:
        for product in super().parse_product(response):
            yield ProductImageItem(
                **dict(product),
                image_urls=[f"{self.images}/img/{product['sku']}.png"
                            f"?utm_source={self.tracking}"])


class ProductFileItem(scrapy.Item):
    sku = scrapy.Field()
    name = scrapy.Field()
    price = scrapy.Field()
    url = scrapy.Field()
    file_urls = scrapy.Field()
    files = scrapy.Field()


class FileShopSpider(ImageShopSpider):
    """The same shop, each product's image a plain file (``FilesPipeline``'s ``file_urls``
    and ``files``)."""

    name = "file_shop"

    def parse_product(self, response: Any) -> Iterator[Any]:
        for product in super().parse_product(response):
            data = dict(product)
            urls = data.pop("image_urls")
            yield ProductFileItem(**data, file_urls=urls)


def file_settings(db: str, store: str) -> dict[str, Any]:
    """The settings of :class:`FileShopSpider`: ``FilesPipeline`` into ``store``."""
    settings = image_settings(db, store)
    del settings["IMAGES_STORE"]
    return {**settings, "FILES_STORE": store,
            "IDEMPOTENT_NATURAL_KEYS": {"image_shop.ProductFileItem": "sku"},
            "ITEM_PIPELINES": {"scrapy.pipelines.files.FilesPipeline": 1}}


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
    parser.add_argument("--images", default="")
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
