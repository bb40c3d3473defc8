"""Temporary files of the local files store (``<store>/.partial/<worker id>.<token>``): a crawl
removes those of gone workers of its host and PID namespace only, never those of another host
or container sharing the store (``check`` lists them); and each file is fsynced before its
rename, its directory after, when the crawl's commits survive power loss."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from image_shop import ImageShopSpider, image_settings, serve_product_images
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import run_crawl
from helpers.stored import stored_products
from scrapy_idempotent.files import PARTIAL_DIR, partial_owner
from scrapy_idempotent.workers import WorkerId, pid_namespace

pytest.importorskip("PIL", reason="ImagesPipeline needs Pillow (pip install pillow)")

#: A process that prints its worker id and lives until its stdin is closed.
PRINT_ID_AND_WAIT = ("import sys; from scrapy_idempotent.workers import new_worker_id; "
                     "print(new_worker_id(), flush=True); sys.stdin.read()")


@pytest.fixture
def shop() -> Iterator[LocalSite]:
    """The shop of 20 products, with their images."""
    with LocalSite(listing_pages=2, products_per_page=10) as site:
        serve_product_images(site)
        yield site


def partial_name(worker: str, token: str = "0123456789abcdef") -> str:
    return f"{worker.replace(':', '+')}.{token}"


def settings(db: str, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {**image_settings(db, str(tmp_path / "images")),
            "LOG_LEVEL": "INFO", **extra}


def check_orphans(db: str, store: Path) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "scrapy", "idempotent", "check", "--db", db, "--json",
         "-s", f"IMAGES_STORE={store}"], cwd=store.parent, capture_output=True, text=True,
        timeout=120, check=False)
    [files] = [c for c in json.loads(done.stdout)["checks"] if c["check"] == "files"]
    return list(files["orphans"])


def in_new_pid_namespace_id() -> str | None:
    """The worker id of a process of another PID namespace (gone by now), or None where
    ``unshare --pid --fork --mount-proc`` cannot run (not Linux, not root)."""
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return None
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                           sys.executable, "-c", PRINT_ID_AND_WAIT], input="",
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


@deferred_f_from_coro_f
async def test_a_crawl_removes_the_partials_of_its_gone_workers_only(
        shop: LocalSite, tmp_path: Path, crawl_database: str,
        caplog: pytest.LogCaptureFixture) -> None:
    db, store = crawl_database, tmp_path / "images"
    partials = store / PARTIAL_DIR
    partials.mkdir(parents=True)
    host = socket.gethostname()
    exited = subprocess.run([sys.executable, "-c", PRINT_ID_AND_WAIT], input="",
                            capture_output=True, text=True, check=True).stdout.strip()
    with subprocess.Popen([sys.executable, "-c", PRINT_ID_AND_WAIT], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as live:
        assert live.stdout is not None and live.stdin is not None
        writing = live.stdout.readline().strip()
        workers = {
            "dead here": exited,
            "live here": writing,
            # a live crawl on another host sharing the store (NFS): its pid means nothing here
            "other host": str(WorkerId(f"not-{host}", os.getpid(), "1", "0a0b0c0d",
                                       pid_namespace())),
        }
        other_namespace = in_new_pid_namespace_id()
        if other_namespace is not None:  # a container sharing the host name and the store
            workers["other namespace"] = other_namespace
        names = {kind: partial_name(worker) for kind, worker in workers.items()}
        assert {kind: partial_owner(name) for kind, name in names.items()} == workers
        # an earlier release's name (<pid>-<uuid>), of a pid that is not running here: it may
        # be another host's
        names["earlier release"] = f"{WorkerId.parse(exited).pid}-{'e' * 32}"  # type: ignore[union-attr]
        assert partial_owner(names["earlier release"]) is None
        for name in names.values():
            (partials / name).write_bytes(b"half a file")

        caplog.set_level("INFO", "scrapy_idempotent.files")
        crawler = await run_crawl(ImageShopSpider, settings(db, tmp_path), url=shop.url)
        assert crawler.stats.get_value("idempotent/records/inserted") == 20
        assert "removed 1 partial file(s) of killed crawls" in caplog.text

        left = {name for name in names.values() if (partials / name).exists()}
        assert left == {v for k, v in names.items() if k != "dead here"}
        # check lists what no crawl here will remove, not what a live worker here writes
        orphans = check_orphans(db, store)
        assert orphans == sorted(f"{PARTIAL_DIR}/{v}" for k, v in names.items()
                                 if k not in ("dead here", "live here"))
        live.stdin.close()
    # the writer is gone now: its partial is an orphan, and the next crawl removes it
    assert f"{PARTIAL_DIR}/{names['live here']}" in check_orphans(db, store)
    await run_crawl(ImageShopSpider, settings(db, tmp_path), url=shop.url)
    assert not (partials / names["live here"]).exists()
    files = sorted(p.relative_to(store).as_posix() for p in store.rglob("*")
                   if p.is_file() and PARTIAL_DIR not in p.parts)
    assert len(files) == 20


class FileSyncs:
    """What the files store does on disk, in order: ``("fsync", path)`` for a file or
    directory flushed, ``("replace", source, target)`` for a rename (the real calls are made:
    only the order is recorded; power loss itself cannot be tested)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, ...]] = []
        fsync, replace = os.fsync, os.replace

        def recorded_fsync(fd: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            fsync(fd)

        def recorded_replace(source: Any, target: Any) -> None:
            self.events.append(("replace", str(source), str(target)))
            replace(source, target)

        monkeypatch.setattr(os, "fsync", recorded_fsync)
        monkeypatch.setattr(os, "replace", recorded_replace)

    def of_store(self, store: Path) -> list[tuple[str, ...]]:
        root = str(store.resolve())
        return [e for e in self.events if e[1].startswith(root)]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
@pytest.mark.parametrize("synchronous", ["FULL", "NORMAL"])
@deferred_f_from_coro_f
async def test_a_file_is_fsynced_before_its_rename_and_its_directory_after_with_full(
        shop: LocalSite, tmp_path: Path, crawl_database: str, monkeypatch: pytest.MonkeyPatch,
        synchronous: str) -> None:
    from scrapy_idempotent.store.registry import sqlite_path

    # a database server's commits survive power loss whatever IDEMPOTENT_SYNCHRONOUS says
    synced = synchronous == "FULL" or sqlite_path(crawl_database) is None
    tmp_path = tmp_path.resolve()
    store = tmp_path / "images"
    syncs = FileSyncs(monkeypatch)
    await run_crawl(ImageShopSpider,
                    settings(crawl_database, tmp_path, IDEMPOTENT_SYNCHRONOUS=synchronous),
                    url=shop.url)
    events = syncs.of_store(store)
    renames = [e for e in events if e[0] == "replace"]
    assert len(renames) == 20
    paths = {product["images"][0]["path"] for product in stored_products(crawl_database)}
    assert {str(Path(e[2]).relative_to(store)) for e in renames} == paths
    if not synced:  # NORMAL on SQLite: a commit survives the process, not an OS crash
        assert [e for e in events if e[0] == "fsync"] == []
        return
    for _, partial, final in renames:
        at = events.index(("replace", partial, final))
        assert ("fsync", partial) in events[:at]  # the content is on disk before the name
        after = events[at + 1:]
        record_dir = Path(final).parent
        assert ("fsync", str(record_dir)) in after  # the new name is on disk
        assert ("fsync", str(record_dir.parent)) in after  # and the new record's directory
