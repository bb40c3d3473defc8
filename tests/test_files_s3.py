"""Files named by identity in an S3 bucket: Scrapy's ``FilesPipeline`` (replaced by the add-on)
with an ``s3://`` ``FILES_STORE``, against moto's S3 server (a real HTTP server on 127.0.0.1,
port 0; Scrapy's own S3 store talks to it with botocore), on each store backend. Skipped
without botocore or moto (``pip install 'moto[server]'``, in the test extra)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("botocore", reason="Scrapy's S3 files store needs botocore")
pytest.importorskip("moto.server", reason="an S3 server for the test: pip install 'moto[server]'")

from image_shop import (
    FileShopSpider,
    file_settings,
    image_downloads,
    serve_product_images,
)
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import run_crawl
from helpers.stored import stored_records
from scrapy_idempotent.config import DEFAULT_URL_IGNORE_PARAMS
from scrapy_idempotent.files import IdempotentFilesPipeline, url_key
from scrapy_idempotent.scrapy_compat import scrapy_version

pytestmark = pytest.mark.skipif(
    scrapy_version() < (2, 15),
    reason="Scrapy before 2.15 does not wait for a file's upload before the item goes on (the "
           "record can be committed before its file is in the bucket)")

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_REGION_NAME": "us-east-1"}


class Bucket:
    """A bucket of a local S3 server."""

    def __init__(self, endpoint: str, name: str) -> None:
        import botocore.session

        self.endpoint, self.name = endpoint, name
        self.client = botocore.session.get_session().create_client(
            "s3", endpoint_url=endpoint, region_name=CREDENTIALS["AWS_REGION_NAME"],
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
        self.client.create_bucket(Bucket=name)

    def keys(self) -> list[str]:
        listed = self.client.list_objects_v2(Bucket=self.name)
        return sorted(entry["Key"] for entry in listed.get("Contents", []))

    def body(self, key: str) -> bytes:
        return bytes(self.client.get_object(Bucket=self.name, Key=key)["Body"].read())

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def bucket() -> Iterator[Bucket]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    bucket = Bucket(f"http://{host}:{port}", f"files-{secrets.token_hex(4)}")
    try:
        yield bucket
    finally:
        bucket.close()
        server.stop()


@pytest.fixture
def shop() -> Iterator[LocalSite]:
    """The shop of 20 products, with their images."""
    with LocalSite(listing_pages=2, products_per_page=10) as site:
        serve_product_images(site)
        yield site


def settings(db: str, bucket: Bucket, **extra: Any) -> dict[str, Any]:
    return {**file_settings(db, f"s3://{bucket.name}/crawl/"),
            **CREDENTIALS, "AWS_ENDPOINT_URL": bucket.endpoint, "AWS_USE_SSL": False,
            "LOG_LEVEL": "WARNING", **extra}


def stored_files(db: str) -> dict[str, list[dict[str, Any]]]:
    return {record.record_id: json.loads(record.data)["files"]
            for record in stored_records(db)}


@deferred_f_from_coro_f
async def test_files_land_in_s3_under_their_record_and_a_replay_overwrites_the_same_key(
        shop: LocalSite, bucket: Bucket, crawl_database: str) -> None:
    db = crawl_database
    first = await run_crawl(FileShopSpider, settings(db, bucket), url=shop.url,
                            tracking="first")
    assert IdempotentFilesPipeline in [type(p) for p in
                                       first.engine.scraper.itemproc.middlewares]
    assert first.stats.get_value("idempotent/records/inserted") == 20
    assert first.stats.get_value("file_status_count/downloaded") == 20
    paths = {}
    for record_id, [file] in stored_files(db).items():
        key = url_key(file["url"], DEFAULT_URL_IGNORE_PARAMS)
        assert file["path"] == f"full/{record_id}/{key}.png"
        paths[file["path"]] = file["checksum"]
    keys = sorted(f"crawl/{path}" for path in paths)
    assert bucket.keys() == keys
    sku_of = {record.record_id: json.loads(record.data)["sku"]
              for record in stored_records(db)}
    from image_shop import product_png

    for path in paths:
        assert bucket.body(f"crawl/{path}") == product_png(sku_of[path.split("/")[1]])

    # the same pages again (a new run), with FILES_EXPIRES = 0 so every file is fetched and
    # written again, as a page replayed after a kill writes its files again: the same keys
    # are overwritten, no second copy, no record changed
    again = await run_crawl(FileShopSpider, settings(db, bucket, FILES_EXPIRES=0),
                            url=shop.url, tracking="first")
    assert again.stats.get_value("file_status_count/downloaded") == 20
    assert image_downloads(shop) == 40
    assert again.stats.get_value("idempotent/records/unchanged") == 20
    assert bucket.keys() == keys

    # the images linked with other tracking parameters, Scrapy's expiry (90 days): a new run
    # finds each file in the bucket under its record, nothing is downloaded or written
    third = await run_crawl(FileShopSpider, settings(db, bucket), url=shop.url,
                            tracking="second")
    assert third.stats.get_value("file_status_count/uptodate") == 20
    assert image_downloads(shop) == 40
    assert bucket.keys() == keys
    assert {f["path"] for [f] in stored_files(db).values()} == set(paths)
