"""Files named by identity: Scrapy's ``FilesPipeline`` and ``ImagesPipeline`` whose paths
derive from the record ID of the item that references them.

Scrapy names a downloaded file by the SHA1 of its URL, so the same picture linked as
``/img/1.jpg`` and ``/img/1.jpg?utm_source=x`` is stored twice, and nothing ties a file to its
record. Here a file's path is ``full/<record_id>/<url key><extension>`` (thumbnails:
``thumbs/<thumb id>/<record_id>/<url key>.jpg``), where the URL key is the SHA1 (16 hex
digits) of the URL without the query parameters of ``IDEMPOTENT_URL_IGNORE_PARAMS``, fragment
dropped:

* a page replayed after a kill, or fetched again in a later run, writes the same path (and
  Scrapy's expiry check, ``FILES_EXPIRES``, finds the file already there: no download);
* a URL that differs only in tracking parameters is the same file;
* a record's files are found by its record ID, and a file no stored record references is an
  orphan (``scrapy idempotent check`` lists them).

Why the record ID rather than the content hash: the path is known before the download, so a
replay skips downloads of files already stored (Scrapy's expiry check needs the path before
the download), and a file belongs to one record, so files of a record can be listed and a
leftover found. A content-hash name would share one file between records using the same
picture, but every replay would download it again to learn its name.

The write happens in the pipeline, before the item reaches ``UpsertPipeline``, so the record
that references a file is committed after the file is written: a stored record never points
at a missing file. Local files (``FILES_STORE``/``IMAGES_STORE`` a path or ``file://``) are
written to a temporary file ``<store>/.partial/<worker id>.<token>`` (``:`` of the worker id
as ``+``) and renamed into place, so a kill never leaves a truncated file under a final name.
When a crawl opens the store it removes the temporary files of workers that are gone (of this
host and PID namespace, :func:`~.workers.worker_is_dead`); those of other hosts or containers
sharing the store (NFS) are never removed here, and ``scrapy idempotent check`` lists them.
Where the crawl's commits survive power loss (``IDEMPOTENT_SYNCHRONOUS = "FULL"``, or a
database server), each file is fsynced before its rename and its directory after, so a
committed record never references a file an OS crash lost.

The result field (``files``/``images``) is Scrapy's (``url``, ``path``, ``checksum``,
``status``); the record's content hash leaves ``status`` (``downloaded``/``uptodate``/
``cached``) out: it says how this process got the file, not what the file is, and would make
every later run look like a change of the record.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, ClassVar

from scrapy.pipelines.files import FilesPipeline, FSFilesStore
from scrapy.pipelines.images import ImagesPipeline

from .records import url_key
from .workers import declare_live, forget_live, new_worker_id, worker_is_dead, worker_state

if TYPE_CHECKING:
    from io import BytesIO

    from scrapy import Request
    from scrapy.http import Response
    from scrapy.pipelines.media import MediaPipeline

__all__ = [
    "PARTIAL_DIR",
    "AtomicFSFilesStore",
    "IdempotentFilesPipeline",
    "IdempotentImagesPipeline",
    "url_key",
]

logger = logging.getLogger(__name__)

#: The directory of a files store holding files being written (renamed into place when done).
PARTIAL_DIR = ".partial"


class AtomicFSFilesStore(FSFilesStore):
    """Scrapy's local files store, writing each file whole: to
    ``<store>/.partial/<worker id>.<token>`` (see :func:`partial_owner`), then renamed over
    its path (same file system), so a reader, or a crawl after a kill, never sees a truncated
    file under a final name.

    The store has a worker id of its own (:func:`~.workers.new_worker_id`), live from its
    creation to :meth:`close`. With :attr:`fsync`, each file is flushed to disk before its
    rename, and the directories it was renamed into (and those created for it) after."""

    #: fsync every file and its directory (set by the pipelines when commits survive power
    #: loss); without it a file survives the death of the process, not an OS crash
    fsync = False

    def __init__(self, basedir: str | os.PathLike[str]) -> None:
        super().__init__(basedir)
        self.worker = new_worker_id()
        declare_live(self.worker)

    def close(self) -> None:
        """The store's writes are over: its worker counts as gone from now on."""
        forget_live(self.worker)

    def persist_file(self, path: str | os.PathLike[str], buf: BytesIO,
                     info: MediaPipeline.SpiderInfo, meta: dict[str, Any] | None = None,
                     headers: dict[str, str] | None = None) -> None:
        final = self._get_filesystem_path(path)
        base = Path(self.basedir)
        created = [d for d in (final.parent, *final.parent.parents)
                   if d.is_relative_to(base) and d != base and not d.exists()]
        self._mkdir(final.parent, info)
        partial_dir = base / PARTIAL_DIR
        partial_dir.mkdir(parents=True, exist_ok=True)
        owner = self.worker.replace(":", _COLON)
        partial = partial_dir / f"{owner}.{secrets.token_hex(8)}"
        try:
            with open(partial, "wb") as f:
                f.write(buf.getvalue())
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(partial, final)
        except BaseException:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise
        if self.fsync:
            # the new name, and the names of the directories made for it
            for directory in {final.parent, *(d.parent for d in created)}:
                _fsync_directory(directory)

    def remove_dead_partials(self) -> int:
        """Remove the temporary files of workers that are gone (of this host and PID
        namespace: killed while writing). Those of other hosts or PID namespaces, and those
        of earlier releases (named by pid only), are left (``check`` lists them). Returns
        how many were removed."""
        removed = 0
        partial_dir = Path(self.basedir, PARTIAL_DIR)
        with contextlib.suppress(FileNotFoundError):
            for entry in partial_dir.iterdir():
                owner = partial_owner(entry.name)
                if owner is not None and worker_is_dead(owner):
                    with contextlib.suppress(OSError):
                        entry.unlink()
                        removed += 1
        return removed


#: Stands for ``:`` of the worker id in the name of a temporary file.
_COLON = "+"


def partial_owner(name: str) -> str | None:
    """The worker id that wrote the temporary file ``name`` (``<worker id, ':' as
    '+'>.<token>``), or None for a name that is not one (those of earlier releases were
    ``<pid>-<uuid>``)."""
    owner, dot, _ = name.rpartition(".")
    if not dot:
        return None
    worker = owner.replace(_COLON, ":")
    return worker if worker_state(worker) != "unknown" else None


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _IdentityPaths(FilesPipeline):
    """What both pipelines share: the record ID of the item, the URL key, the local store's
    temporary files and durability."""

    crawler: Any
    _warned_no_record = False

    def open_spider(self, spider: Any = None) -> Any:
        if isinstance(self.store, AtomicFSFilesStore):
            from .config import config_for
            from .store.registry import sqlite_path

            config = config_for(self.crawler)
            # as durable as the commit of the record that references the file
            self.store.fsync = (config.synchronous == "FULL"
                                or sqlite_path(config.database) is None)
            removed = self.store.remove_dead_partials()
            if removed:
                logger.info("scrapy_idempotent: removed %d partial file(s) of killed crawls "
                            "from %s", removed, Path(self.store.basedir, PARTIAL_DIR))
        return super().open_spider(spider) if spider is not None else super().open_spider()

    def close_spider(self, spider: Any = None) -> None:
        if isinstance(self.store, AtomicFSFilesStore):
            self.store.close()

    def file_path(self, request: Request, response: Response | None = None,
                  info: MediaPipeline.SpiderInfo | None = None, *, item: Any = None) -> str:
        default = super().file_path(request, response, info, item=item)
        return self._identity_path(default, "full", request, item)

    def _ignore_params(self) -> tuple[str, ...]:
        from .config import config_for

        return config_for(self.crawler).url_ignore_params

    def _record_id(self, item: Any) -> str | None:
        """The record ID the crawl gives ``item`` (None outside a crawl with the package's
        scheduler, or for an item without a natural key: the default path is used)."""
        if item is None:
            return None
        from .crawl import inflight_tracker

        tracker = inflight_tracker(self.crawler, type(self).__name__)
        if tracker is None:
            return None
        record_id = tracker.record_id_of(item)
        if record_id is None and not self._warned_no_record:
            type(self)._warned_no_record = True
            logger.warning("scrapy_idempotent: %s: an item without a record ID (no natural "
                           "key): its files keep Scrapy's URL-hash names", type(self).__name__)
        return record_id

    def _identity_path(self, default: str, prefix: str, request: Request, item: Any,
                       suffix: str | None = None) -> str:
        record_id = self._record_id(item)
        if record_id is None:
            return default
        ext = PurePosixPath(default).suffix if suffix is None else suffix
        return f"{prefix}/{record_id}/{url_key(request.url, self._ignore_params())}{ext}"


def _atomic_schemes(schemes: dict[str, Any]) -> dict[str, Any]:
    return {**schemes, "": AtomicFSFilesStore, "file": AtomicFSFilesStore}


class IdempotentFilesPipeline(_IdentityPaths):
    """Scrapy's ``FilesPipeline`` with files named by record ID (see the module docstring).
    The add-on puts it in the place of ``FilesPipeline`` in ``ITEM_PIPELINES``."""

    STORE_SCHEMES: ClassVar[dict[str, Any]] = _atomic_schemes(FilesPipeline.STORE_SCHEMES)


class IdempotentImagesPipeline(_IdentityPaths, ImagesPipeline):
    """Scrapy's ``ImagesPipeline`` with images and thumbnails named by record ID (see the
    module docstring). The add-on puts it in the place of ``ImagesPipeline``."""

    STORE_SCHEMES: ClassVar[dict[str, Any]] = _atomic_schemes(ImagesPipeline.STORE_SCHEMES)

    def thumb_path(self, request: Request, thumb_id: str, response: Response | None = None,
                   info: MediaPipeline.SpiderInfo | None = None, *, item: Any = None) -> str:
        default = super().thumb_path(request, thumb_id, response, info, item=item)
        return self._identity_path(default, f"thumbs/{thumb_id}", request, item, ".jpg")


def referenced_paths(record_data: dict[str, Any], fields: tuple[str, ...]) -> set[str]:
    """The file paths a stored record references in its result ``fields`` (``files``,
    ``images``: lists of dicts with a ``path``)."""
    paths: set[str] = set()
    for name in fields:
        value = record_data.get(name)
        if isinstance(value, list):
            paths.update(str(entry["path"]) for entry in value
                         if isinstance(entry, dict) and isinstance(entry.get("path"), str))
    return paths


def orphan_files(basedir: str | os.PathLike[str], referenced: set[str]) -> list[str]:
    """Files of a local files store that no stored record references: under ``full/``, the
    files whose path is not referenced; under ``thumbs/<id>/``, thumbnails of an image that
    is not referenced; the temporary files under ``.partial/`` but those a live worker of
    this host is writing (a write cut short, here or on another host sharing the store).
    Paths relative to ``basedir``, sorted."""
    root = Path(basedir)
    full_stems = {str(PurePosixPath(p).with_suffix(""))[len("full/"):]
                  for p in referenced if p.startswith("full/")}
    orphans: list[str] = []
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        relative = path.relative_to(root).as_posix()
        parts = relative.split("/")
        if parts[0] == PARTIAL_DIR:
            owner = partial_owner(parts[-1])
            if owner is None or worker_state(owner) != "alive":  # alive: being written now
                orphans.append(relative)
        elif parts[0] == "full" and relative not in referenced:
            orphans.append(relative)
        elif parts[0] == "thumbs" and len(parts) > 2:
            stem = str(PurePosixPath(*parts[2:]).with_suffix(""))
            if stem not in full_stems:
                orphans.append(relative)
    return orphans
