"""A shop spider that hands items to its callbacks: a ``scrapy.Item`` in ``cb_kwargs``, a
dataclass and an attrs item in ``meta``. Each product's record says whether its callback got
back items equal to those its request was given, of their classes. Run in the test process,
or by ``scrapy runspider`` (the site's URL in ``-a url=...``)."""

from __future__ import annotations

import dataclasses
import decimal
from collections.abc import Iterator
from typing import Any

import attrs
import scrapy


class Listing(scrapy.Item):
    page = scrapy.Field()
    rank = scrapy.Field()


@dataclasses.dataclass
class Seed:
    sku: str
    floor: decimal.Decimal
    tags: tuple[str, ...] = ()
    seen: int = dataclasses.field(default=0, init=False)


@attrs.define
class Origin:
    listing: Listing
    _hops: int = 1


def seed_of(url: str) -> Seed:
    seed = Seed(sku=url.rsplit("/", 1)[-1], floor=decimal.Decimal("0.50"), tags=("a", "b"))
    seed.seen = len(url)
    return seed


class ItemArgsSpider(scrapy.Spider):
    name = "item_args"

    def __init__(self, url: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start_urls = [f"{url}/list/1"]

    def parse(self, response: Any) -> Iterator[Any]:
        for rank, link in enumerate(response.css("a.product::attr(href)").getall()):
            url = response.urljoin(link)
            listing = Listing(page=response.url, rank=rank)
            yield scrapy.Request(
                url, callback=self.parse_product, cb_kwargs={"listing": listing},
                meta={"seed": seed_of(url), "origin": Origin(listing=Listing(listing))})
        yield from response.follow_all(css="a.listing.next")

    def parse_product(self, response: Any, listing: Listing) -> Iterator[Any]:
        seed, origin = response.meta["seed"], response.meta["origin"]
        yield {
            "url": response.url,
            "sku": response.css(".sku::text").get(),
            "listing": listing["page"],
            "args_equal": (type(listing) is Listing and type(seed) is Seed
                           and type(origin) is Origin and type(origin.listing) is Listing
                           and seed == seed_of(response.url) and seed.seen == len(response.url)
                           and origin == Origin(listing=Listing(listing))
                           and listing["page"].startswith("http")),
        }
