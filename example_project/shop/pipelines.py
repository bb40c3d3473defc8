"""The naive baseline pipeline: what a typical tutorial pipeline does.

:class:`NaiveInsertPipeline` inserts every item as a new row and commits it. It is here to be
compared with ``scrapy_idempotent``: with Scrapy's default in-memory scheduler, every restart of
an interrupted crawl fetches and inserts everything again, so the table fills with duplicates.
It is not used unless a run enables it::

    scrapy crawl shop -s ADDONS={} \\
        -s 'ITEM_PIPELINES={"shop.pipelines.NaiveInsertPipeline": 300}' \\
        -s NAIVE_DATABASE=/tmp/naive.sqlite3
"""

from __future__ import annotations

import sqlite3
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from itemadapter import ItemAdapter

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

SCHEMA = """
CREATE TABLE IF NOT EXISTS products (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    sku TEXT,
    name TEXT,
    price TEXT,
    url TEXT,
    scraped_at TEXT
)
"""


class NaiveInsertPipeline:
    """Insert each item into the SQLite table ``products`` and commit, one item at a time.

    Settings:
        NAIVE_DATABASE: path of the SQLite file (required).
    """

    def __init__(self, database: str) -> None:
        self.database = database
        self.connection: sqlite3.Connection | None = None

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> NaiveInsertPipeline:
        database = crawler.settings.get("NAIVE_DATABASE")
        if not database:
            raise ValueError(
                "NaiveInsertPipeline needs the NAIVE_DATABASE setting (the path of an SQLite "
                "file), e.g. -s NAIVE_DATABASE=/tmp/naive.sqlite3"
            )
        return cls(str(database))

    # ``spider``: Scrapy 2.13 passes it to pipeline methods, later releases do not.
    def open_spider(self, spider: Any = None) -> None:
        self.connection = sqlite3.connect(self.database)
        self.connection.execute(SCHEMA)
        self.connection.commit()

    def close_spider(self, spider: Any = None) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None

    #: The statement each item runs (subclasses change it, not the rest).
    INSERT = "INSERT INTO products (sku, name, price, url, scraped_at) VALUES (?, ?, ?, ?, ?)"

    def process_item(self, item: Any, spider: Any = None) -> Any:
        assert self.connection is not None, "open_spider() was not called"
        adapter = ItemAdapter(item)
        self.connection.execute(
            self.INSERT,
            (
                adapter.get("sku"),
                adapter.get("name"),
                adapter.get("price"),
                adapter.get("url"),
                datetime.now(timezone.utc).isoformat(),
            ),
        )
        self.connection.commit()
        return item


class UpsertBySkuPipeline(NaiveInsertPipeline):
    """Like :class:`NaiveInsertPipeline`, but one row per SKU (``INSERT ... ON CONFLICT``): the
    usual fix for duplicates, paired in the demo with Scrapy's ``JOBDIR`` to resume."""

    def open_spider(self, spider: Any = None) -> None:
        super().open_spider()
        assert self.connection is not None
        self.connection.execute(
            "CREATE UNIQUE INDEX IF NOT EXISTS products_sku ON products (sku)")
        self.connection.commit()

    INSERT = (
        NaiveInsertPipeline.INSERT
        + " ON CONFLICT (sku) DO UPDATE SET name = excluded.name, price = excluded.price,"
        " url = excluded.url, scraped_at = excluded.scraped_at"
    )
