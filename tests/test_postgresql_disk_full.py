"""A full disk on the PostgreSQL server: the crawl's tables live on a small file system of
their own (a tmpfs mounted for the test, the database's default tablespace) that fills
part-way through the crawl. The crawl stops with an error naming the cause, nothing of a page
is committed without the rest of it, and once space is freed the next crawl finishes the
work, every record once. Needs root (to mount); skipped where mounting is not permitted."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from local_site import LocalSite
from scrapy import signals
from scrapy.utils.defer import deferred_f_from_coro_f
from scrapy.utils.test import get_crawler

from crawling import crawl_settings, crawl_to_end, run_crawl
from helpers.catalogue_spider import CatalogueSpider

psycopg = pytest.importorskip("psycopg")

pytestmark = pytest.mark.slow

#: Items of the catalogue; the tablespace has room for part of them only.
COUNT = 400
#: Bytes left free on the tablespace's file system when the crawl starts.
FREE = 600 * 1024
KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"dict": "sku"}}


class SmallDisk:
    """A tmpfs owned by the server's user, a tablespace on it, and a ballast file that
    leaves :data:`FREE` bytes; :meth:`free_space` deletes the ballast."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.base = Path(tempfile.mkdtemp(prefix="idempotent-small-disk-"))
        self.mount = self.base / "mnt"
        self.mount.mkdir()
        self.name = f"small_{os.getpid()}"
        self.mounted = False

    def __enter__(self) -> SmallDisk:
        uid = getattr(self.cluster, "_uid", None)
        if os.geteuid() != 0 or uid is None:
            pytest.skip("mounting a small file system for the server needs root")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs",
                               str(self.mount)], capture_output=True, text=True, check=False)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        self.mounted = True
        os.chmod(self.base, 0o755)
        os.chown(self.mount, uid, -1)
        with psycopg.connect(self.cluster.url(), autocommit=True) as conn:
            conn.execute(f"CREATE TABLESPACE {self.name} LOCATION '{self.mount}'")
        return self

    def database(self) -> str:
        """A new database whose tables are created on the small file system."""
        url = str(self.cluster.new_database())
        self.dbname = urlsplit(url).path.lstrip("/")
        with psycopg.connect(self.cluster.url(), autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{self.dbname}" SET default_tablespace = {self.name}')
        return url

    def fill(self) -> None:
        stat = os.statvfs(self.mount)
        ballast = stat.f_bavail * stat.f_frsize - FREE
        with open(self.mount / "ballast", "wb") as f:
            f.write(os.urandom(ballast))

    def free_space(self) -> None:
        (self.mount / "ballast").unlink()

    def __exit__(self, *exc: object) -> None:
        with psycopg.connect(self.cluster.url(), autocommit=True) as conn:
            if getattr(self, "dbname", None):
                conn.execute(f'DROP DATABASE IF EXISTS "{self.dbname}" WITH (FORCE)')
            conn.execute(f"DROP TABLESPACE IF EXISTS {self.name}")
        if self.mounted:
            subprocess.run(["umount", str(self.mount)], check=False)
        with contextlib.suppress(OSError):
            self.mount.rmdir()
            self.base.rmdir()


@pytest.fixture
def small_disk(postgres_cluster: Any) -> Iterator[SmallDisk]:
    with SmallDisk(postgres_cluster) as disk:
        yield disk


def crawl_rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        (schema,) = conn.execute("SELECT nspname FROM pg_namespace"
                                 " WHERE nspname LIKE 'idempotent%'").fetchone() or ("",)
        conn.execute("SELECT set_config('search_path', %s, false)", (schema,))
        return [tuple(row) for row in conn.execute(sql).fetchall()]


def assert_done_means_stored(url: str) -> set[str]:
    """Done is the last write of a page: each done item page has its one record, the done
    listing has all its children, every record belongs to a done page. Returns the paths
    done."""
    rows = crawl_rows(url, "SELECT encode(key, 'hex'), url, state FROM requests")
    state_of = {key: state for key, _, state in rows}
    records: dict[str, list[str]] = {}
    for data, request_key in crawl_rows(url, "SELECT data, request_key FROM records"):
        records.setdefault(json.loads(data)["sku"], []).append(request_key)
    done = set()
    for key, page, state in rows:
        path = urlsplit(page).path
        if state == "done":
            done.add(path)
            if path.startswith("/item/"):
                assert records.get(f"S-{path.rsplit('/', 1)[1]}") == [key], path
            else:
                assert len(rows) == COUNT + 1
    for sku, keys in records.items():
        assert len(keys) == 1 and state_of.get(keys[0]) == "done", sku
    return done


@deferred_f_from_coro_f
async def test_a_full_disk_on_the_server_stops_the_crawl_and_the_next_one_finishes(
        small_disk: SmallDisk) -> None:
    url = small_disk.database()
    with LocalSite() as site:
        site.add_catalogue(COUNT, filler=1000)
        settings = crawl_settings(url, CONCURRENT_REQUESTS=4,  # type: ignore[arg-type]
                                  **KEYS)
        full = get_crawler(CatalogueSpider, settings)
        # once the crawl's schema is made and its session begun, the disk fills
        full.signals.connect(lambda spider: small_disk.fill(), signal=signals.spider_opened,
                             weak=False)
        await crawl_to_end(full, url=site.url)
        stats = full.stats.get_stats()
        assert stats["finish_reason"] == "idempotent_store_error", stats
        error = stats["idempotent/error"]
        assert "disk of the database server" in error and "is full" in error, error
        assert "free some space on the server" in error, error
        done = assert_done_means_stored(url)
        assert "/list" in done and 2 <= len(done) < COUNT + 1  # part-way through
        fetched = site.request_count

        small_disk.free_space()
        site.reset_counts()
        resumed = await run_crawl(CatalogueSpider, settings, url=site.url)
        stats = resumed.stats.get_stats()
        assert stats["finish_reason"] == "finished", stats
        assert len(assert_done_means_stored(url)) == COUNT + 1
        skus = sorted(json.loads(d)["sku"] for (d,) in crawl_rows(url,
                                                                    "SELECT data FROM records"))
        assert skus == sorted(f"S-{i}" for i in range(1, COUNT + 1))
        # pages done before the disk filled are not fetched again
        assert not [path for path in done if path.startswith("/item/") and site.hits(path)]
        assert fetched + site.request_count <= COUNT + 1 + 2 * 4
