"""Files named by identity: ``ImagesPipeline`` (replaced by the add-on) writes a product's
image to ``full/<record_id>/<url key>.png``, whatever tracking parameters the URL carries,
before the record referencing it is committed; ``check`` lists files no record references."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from image_shop import ImageShopSpider, image_downloads, image_settings, serve_product_images
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import run_crawl
from helpers.stored import stored_records
from scrapy_idempotent.config import DEFAULT_URL_IGNORE_PARAMS
from scrapy_idempotent.files import (
    IdempotentImagesPipeline,
    orphan_files,
    url_key,
)

pytest.importorskip("PIL", reason="ImagesPipeline needs Pillow (pip install pillow)")


@pytest.fixture
def small_shop() -> Any:
    """The shop of 50 products, with their images."""
    with LocalSite(listing_pages=5, products_per_page=10) as site:
        serve_product_images(site)
        yield site


def files_on_disk(store: Path) -> list[str]:
    return sorted(p.relative_to(store).as_posix() for p in store.rglob("*") if p.is_file())


def stored_images(db: str) -> dict[str, list[dict[str, Any]]]:
    return {record.record_id: json.loads(record.data).get("images")
            for record in stored_records(db)}


def check(db: str, store: Path) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "scrapy", "idempotent", "check", "--db", db, "--json",
         "-s", f"IMAGES_STORE={store}"],
        cwd=store.parent, capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout)
    [files] = [c for c in report["checks"] if c["check"] == "files"]
    return done.returncode, files


def settings(db: str, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {**image_settings(db, str(tmp_path / "images")),
            "LOG_LEVEL": "WARNING", **extra}


@deferred_f_from_coro_f
async def test_an_image_is_named_by_its_record_and_stored_once_whatever_its_tracking(
        small_shop: LocalSite, tmp_path: Path, crawl_database: str) -> None:
    db, store = crawl_database, tmp_path / "images"
    crawler = await run_crawl(ImageShopSpider, settings(db, tmp_path), url=small_shop.url,
                              tracking="first")
    assert IdempotentImagesPipeline in [type(p) for p in
                                        crawler.engine.scraper.itemproc.middlewares]
    assert crawler.stats.get_value("idempotent/records/inserted") == 50
    by_record = stored_images(db)
    expected = {}
    for record_id, [image] in by_record.items():
        assert set(image) == {"url", "path", "checksum", "status"}  # Scrapy's result
        key = url_key(image["url"], DEFAULT_URL_IGNORE_PARAMS)
        assert image["path"] == f"full/{record_id}/{key}.jpg"  # ImagesPipeline saves JPEG
        expected[image["path"]] = image["checksum"]
    assert files_on_disk(store) == sorted(expected)
    assert image_downloads(small_shop) == 50

    # another crawl (a new run), the image URLs with other tracking parameters: the same
    # paths, found on disk (no download), no second copy
    # the same pages again: the files are there already (Scrapy's status "uptodate", was
    # "downloaded"); the status is not part of the record's content: no record changed
    again = await run_crawl(ImageShopSpider, settings(db, tmp_path), url=small_shop.url,
                            tracking="first")
    assert again.stats.get_value("idempotent/records/updated", 0) == 0
    assert again.stats.get_value("idempotent/records/unchanged") == 50
    assert {i[0]["status"] for i in stored_images(db).values()} == {"downloaded"}
    assert image_downloads(small_shop) == 50
    await run_crawl(ImageShopSpider, settings(db, tmp_path), url=small_shop.url,
                    tracking="second")
    assert files_on_disk(store) == sorted(expected)
    assert image_downloads(small_shop) == 50
    assert {i[0]["path"] for i in stored_images(db).values()} == set(expected)
    code, files = check(db, store)
    assert (code, files["ok"], files["orphans"]) == (0, True, [])


def test_check_lists_files_no_record_references(tmp_path: Path, crawl_database: str) -> None:
    from helpers.stores import fetch_page, rec
    from scrapy_idempotent.store import open_store

    db, store = crawl_database, tmp_path / "images"
    frontier = open_store(db)
    frontier.open(fingerprinter="x")
    try:
        frontier.begin_session("w1", "auto")
        data = json.dumps({"sku": "A1", "images": [{"url": "u", "path": "full/r1/k.png",
                                                    "checksum": "c"}]})
        fetch_page(frontier, "a", rec("r1", "h1", data=data), targets=())
    finally:
        frontier.close()
    for name in ("full/r1/k.png", "full/r2/k.png", "thumbs/small/r1/k.jpg",
                 "thumbs/small/r2/k.jpg", ".partial/99999999-x"):
        (store / name).parent.mkdir(parents=True, exist_ok=True)
        (store / name).write_bytes(b"x")
    assert orphan_files(store, {"full/r1/k.png"}) == [
        ".partial/99999999-x", "full/r2/k.png", "thumbs/small/r2/k.jpg"]
    code, files = check(db, store)
    assert code == 1 and not files["ok"]
    assert files["orphans"] == [".partial/99999999-x", "full/r2/k.png",
                                "thumbs/small/r2/k.jpg"]
