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
written to a temporary file in ``<store>/.partial/`` and renamed into place, so a kill never
leaves a truncated file under a final name; temporary files of dead processes are removed
when a crawl opens the store.

The result field (``files``/``images``) is Scrapy's (``url``, ``path``, ``checksum``,
``status``); the record's content hash leaves ``status`` (``downloaded``/``uptodate``/
``cached``) out: it says how this process got the file, not what the file is, and would make
every later run look like a change of the record.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import uuid
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, ClassVar

from scrapy.pipelines.files import FilesPipeline, FSFilesStore
from scrapy.pipelines.images import ImagesPipeline

from .records import page_key

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


def url_key(url: str, ignore_params: tuple[str, ...]) -> str:
    """16 hex digits naming ``url`` without its ignored query parameters and fragment."""
    return hashlib.sha1(page_key(url, ignore_params).encode()).hexdigest()[:16]


class AtomicFSFilesStore(FSFilesStore):
    """Scrapy's local files store, writing each file whole: to ``<store>/.partial/<pid>-...``
    then renamed over its path (same file system), so a reader, or a crawl after a kill,
    never sees a truncated file under a final name."""

    def persist_file(self, path: str | os.PathLike[str], buf: BytesIO,
                     info: MediaPipeline.SpiderInfo, meta: dict[str, Any] | None = None,
                     headers: dict[str, str] | None = None) -> None:
        final = self._get_filesystem_path(path)
        self._mkdir(final.parent, info)
        partial_dir = Path(self.basedir, PARTIAL_DIR)
        partial_dir.mkdir(parents=True, exist_ok=True)
        partial = partial_dir / f"{os.getpid()}-{uuid.uuid4().hex}"
        try:
            partial.write_bytes(buf.getvalue())
            os.replace(partial, final)
        except BaseException:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise

    def remove_dead_partials(self) -> int:
        """Remove temporary files of processes that no longer exist (killed while writing).
        Returns how many."""
        removed = 0
        partial_dir = Path(self.basedir, PARTIAL_DIR)
        with contextlib.suppress(FileNotFoundError):
            for entry in partial_dir.iterdir():
                pid = entry.name.split("-", 1)[0]
                if pid.isdigit() and not _alive(int(pid)):
                    with contextlib.suppress(OSError):
                        entry.unlink()
                        removed += 1
        return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _IdentityPaths:
    """What both pipelines share: the record ID of the item, the URL key, the result."""

    crawler: Any
    _warned_no_record = False

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


class IdempotentFilesPipeline(_IdentityPaths, FilesPipeline):
    """Scrapy's ``FilesPipeline`` with files named by record ID (see the module docstring).
    The add-on puts it in the place of ``FilesPipeline`` in ``ITEM_PIPELINES``."""

    STORE_SCHEMES: ClassVar[dict[str, Any]] = _atomic_schemes(FilesPipeline.STORE_SCHEMES)

    def open_spider(self, spider: Any = None) -> Any:
        _remove_dead_partials(self.store)
        return super().open_spider(spider) if spider is not None else super().open_spider()

    def file_path(self, request: Request, response: Response | None = None,
                  info: MediaPipeline.SpiderInfo | None = None, *, item: Any = None) -> str:
        default = super().file_path(request, response, info, item=item)
        return self._identity_path(default, "full", request, item)


class IdempotentImagesPipeline(_IdentityPaths, ImagesPipeline):
    """Scrapy's ``ImagesPipeline`` with images and thumbnails named by record ID (see the
    module docstring). The add-on puts it in the place of ``ImagesPipeline``."""

    STORE_SCHEMES: ClassVar[dict[str, Any]] = _atomic_schemes(ImagesPipeline.STORE_SCHEMES)

    def open_spider(self, spider: Any = None) -> Any:
        _remove_dead_partials(self.store)
        return super().open_spider(spider) if spider is not None else super().open_spider()

    def file_path(self, request: Request, response: Response | None = None,
                  info: MediaPipeline.SpiderInfo | None = None, *, item: Any = None) -> str:
        default = super().file_path(request, response, info, item=item)
        return self._identity_path(default, "full", request, item)

    def thumb_path(self, request: Request, thumb_id: str, response: Response | None = None,
                   info: MediaPipeline.SpiderInfo | None = None, *, item: Any = None) -> str:
        default = super().thumb_path(request, thumb_id, response, info, item=item)
        return self._identity_path(default, f"thumbs/{thumb_id}", request, item, ".jpg")


def _remove_dead_partials(store: Any) -> None:
    if isinstance(store, AtomicFSFilesStore):
        removed = store.remove_dead_partials()
        if removed:
            logger.info("scrapy_idempotent: removed %d partial file(s) of killed crawls from "
                        "%s", removed, Path(store.basedir, PARTIAL_DIR))


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
    is not referenced; everything under ``.partial/`` (a write cut short). Paths relative to
    ``basedir``, sorted."""
    root = Path(basedir)
    full_stems = {str(PurePosixPath(p).with_suffix(""))[len("full/"):]
                  for p in referenced if p.startswith("full/")}
    orphans: list[str] = []
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        relative = path.relative_to(root).as_posix()
        parts = relative.split("/")
        if parts[0] == PARTIAL_DIR or (parts[0] == "full" and relative not in referenced):
            orphans.append(relative)
        elif parts[0] == "thumbs" and len(parts) > 2:
            stem = str(PurePosixPath(*parts[2:]).with_suffix(""))
            if stem not in full_stems:
                orphans.append(relative)
    return orphans
