"""Scrapy settings for the example ``shop`` project.

Only the last block is about ``scrapy_idempotent``: one add-on line and the natural key of each
item type. Everything else is an ordinary Scrapy project.
"""

from __future__ import annotations

BOT_NAME = "shop"

SPIDER_MODULES = ["shop.spiders"]
NEWSPIDER_MODULE = "shop.spiders"

# The test shop is local and has no robots.txt.
ROBOTSTXT_OBEY = False

LOG_LEVEL = "INFO"

CONCURRENT_REQUESTS = 16
CONCURRENT_REQUESTS_PER_DOMAIN = 16
DOWNLOAD_DELAY = 0

TELNETCONSOLE_ENABLED = False

FEED_EXPORT_ENCODING = "utf-8"

# --- crash safety and idempotency -------------------------------------------------------------
# The add-on installs the durable scheduler, the record-ID spider middleware and the upsert
# pipeline. The records database defaults to a file under this project's .scrapy/ directory;
# set IDEMPOTENT_DATABASE to put it elsewhere.
ADDONS = {"scrapy_idempotent.Addon": 0}
IDEMPOTENT_NATURAL_KEYS = {"shop.items.ProductItem": "sku"}
