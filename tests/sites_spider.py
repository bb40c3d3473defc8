"""A spider of several sites at once: the politeness tests run it with ``scrapy runspider``,
one process per worker, on one frontier (``-a sites=URL,URL,...`` the sites' base URLs,
``-a pages=N`` pages per site, or ``N,M,...`` one count per site, ``/ok/p<n>`` of the local
site), with their own ``-s`` settings (per-site concurrency, delay, the database) over the
few set here (the politeness is the default, the crawl's). Every worker yields
the same start requests; the frontier takes each once."""

from typing import Any, ClassVar

import scrapy


class SitesSpider(scrapy.Spider):
    name = "sites"
    custom_settings: ClassVar[dict[str, Any]] = {
        "ADDONS": {"scrapy_idempotent.Addon": 0}, "ROBOTSTXT_OBEY": False,
        "TELNETCONSOLE_ENABLED": False, "MEMUSAGE_ENABLED": False,
        "IDEMPOTENT_NATURAL_KEYS": {"dict": "url"}}

    def __init__(self, sites, pages="20", **kwargs):
        super().__init__(**kwargs)
        self.sites = sites.split(",")
        counts = [int(count) for count in pages.split(",")]
        self.pages = counts * len(self.sites) if len(counts) == 1 else counts

    async def start(self):
        for n in range(max(self.pages)):  # the sites interleaved, as a seed list would be
            for site, pages in zip(self.sites, self.pages, strict=True):
                if n < pages:
                    yield scrapy.Request(f"{site}/ok/p{n}", dont_filter=True)

    def parse(self, response):
        yield {"url": response.url}
