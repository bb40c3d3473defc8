"""Local feeds written while the crawl runs, exact through kills (:class:`FeedStream`).

A streamed feed follows the run's records in the order their transactions committed (the
records' sequence of first sight in the run, see :attr:`.FrontierStore.STREAMS_FEEDS`) and
writes each one through Scrapy's own feed slot: its exporter (built by Scrapy from the feed's
options, ``FEED_EXPORT_FIELDS``, ``item_export_kwargs`` ...) and its item filter. The database
keeps per run and feed a :class:`~.FeedMark`: the last record sequence written, the file's
size after it and the batch. Each write (:meth:`.FrontierStore.stream_feed`, one transaction
holding the feed's claim) cuts the file back to the mark, appends the records committed
since, writes the format's closing bytes (JSON's ``]``, XML's ``</items>``) after them so the
file is valid between writes, syncs it, and only then records the new mark (the size before
the closing bytes). A process killed at any point leaves bytes past the mark only; the next
write cuts them. So the file ends with one entry per record of the run, whatever was killed
when.

The exporter of a file that already holds entries (a later process of the run) is brought to
the state Scrapy's would be in after them by exporting into a scratch buffer: the format's
start and the file's first entry (CSV's header comes from it), then it writes to the file.
The closing bytes are found the same way: what ``finish_exporting`` writes after an entry.

A batched feed (``batch_item_count``) moves to the next batch file (named as Scrapy names it,
``%(batch_id)d``, ``%(batch_time)s``) in a write of its own once a file is full, so the next
file's base (its size before, for an appended feed) is durable before it is written to.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from scrapy.extensions import feedexport
from scrapy.extensions.feedexport import FeedSlot, FileFeedStorage, StdoutFeedStorage

from .workers import worker_is_dead

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from scrapy.exporters import BaseItemExporter
    from scrapy.extensions.feedexport import ItemFilter
    from scrapy.settings import BaseSettings

    from .store.base import FeedMark, FrontierStore, RunRecord, SeqRecord

__all__ = ["FeedFileLost", "FeedStream", "StreamedFile", "streamable"]

logger = logging.getLogger(__name__)

#: Records read from the store per query while a feed is written.
PAGE = 500


class FeedFileLost(OSError):
    """A streamed feed's file is not what the feed's mark says was durably written: deleted
    (or its directory), cut below the mark, or replaced by another file while this process
    had it open. The mark was moved back to the start of that file (in the same transaction
    that found it), so the next write rewrites the file's entries from the run's records."""


def streamable(storage: object, options: dict[str, Any]) -> bool:
    """True for a feed written to a local file without post-processing (a file can be cut
    back and continued; a compressed stream or a remote object cannot)."""
    return (isinstance(storage, FileFeedStorage) and not isinstance(storage, StdoutFeedStorage)
            and not options.get("postprocessing"))


@dataclass(frozen=True)
class StreamedFile:
    """A feed file completed by a write (a full batch, or the file of a closing worker)."""

    uri: str
    format: str
    items: int
    slot: FeedSlot | None
    target: FeedTarget | None = None


@dataclass(frozen=True)
class FeedTarget:
    """One file of a feed: its URI as Scrapy renders it, its path, and whether Scrapy
    appends to it (``overwrite`` false)."""

    uri: str
    path: Path
    append: bool
    #: the feed's Scrapy storage of this file (its ``store`` is called once the file is
    #: complete, as Scrapy does: a custom ``FEED_STORAGES`` class sees it)
    storage: Any = None


class _Sink(io.RawIOBase):
    """The file object the exporter writes to: what it writes goes to ``target`` (the feed's
    file, or a scratch buffer while the exporter is brought to its state)."""

    def __init__(self) -> None:
        super().__init__()
        self.target: Any = io.BytesIO()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.target.write(data)
        return len(data)

    def close(self) -> None:  # an exporter's wrapper closing us never closes the file
        pass


class _SinkStorage:
    """A feed storage whose file is a :class:`_Sink` (the stream stores the file itself)."""

    def __init__(self, sink: _Sink) -> None:
        self.sink = sink

    def open(self, spider: Spider) -> Any:
        return self.sink

    def store(self, file: Any) -> None:
        return None


@dataclass(frozen=True)
class SlotFactory:
    """What Scrapy's ``FeedSlot`` needs, from the feed exporter."""

    options: dict[str, Any]
    uri_template: str
    filter: ItemFilter
    spider: Spider
    exporters: dict[str, type[BaseItemExporter]]
    settings: BaseSettings
    crawler: Crawler

    def slot(self, sink: _Sink, uri: str, batch_id: int) -> FeedSlot:
        return feedexport.FeedSlot(
            storage=cast("Any", _SinkStorage(sink)), uri=uri, format=self.options["format"],
            store_empty=self.options["store_empty"], batch_id=batch_id,
            uri_template=self.uri_template, filter=self.filter, feed_options=self.options,
            spider=self.spider, exporters=self.exporters, settings=self.settings,
            crawler=self.crawler)


class FeedStream:
    """One local feed of the run, written while the crawl runs (see the module docstring).

    ``target(batch_id)`` gives a batch's file; ``item_of(record)`` rebuilds a record's item
    as the crawl stored it. :meth:`advance` runs where the store may be used (the crawl's
    writer thread, or the closing thread)."""

    def __init__(self, factory: SlotFactory, target: Callable[[int], FeedTarget],
                 item_of: Callable[[RunRecord], Any]) -> None:
        self.factory = factory
        self.key = "stream " + factory.uri_template
        self.batch_item_count = int(factory.options.get("batch_item_count") or 0)
        self._target = target
        self._targets: dict[int, FeedTarget] = {}
        self._item_of = item_of
        self._sink = _Sink()
        self._slot: FeedSlot | None = None  # the exporter of the open file
        self._file: BinaryIO | None = None
        self._file_batch = 0
        self._closing: bytes | None = None  # what the format writes after its last entry
        #: the feed cannot be written by this process any more (its file failed)
        self.error: Exception | None = None
        #: the files completed by the last :meth:`advance` (for the caller to report)
        self.completed: list[StreamedFile] = []
        self.mark: FeedMark | None = None  # the last mark this process wrote or read
        self._more = False
        self._touched = False  # the file was cut back to the mark by this write
        self._lost: FeedFileLost | None = None  # found by the last write (see _check_file)
        #: at the last close, another live worker held the feed (it writes the rest)
        self.held = False
        self.format = str(factory.options["format"])

    def reset(self) -> None:
        """Another run from now on: its own mark, files and exporter."""
        self._close_file()
        self._targets = {}
        self.mark = None
        self.held = False

    def target(self, batch_id: int) -> FeedTarget:
        if batch_id not in self._targets:
            self._targets = {batch_id: self._target(batch_id)}
        return self._targets[batch_id]

    @property
    def uri(self) -> str:
        return self.target(self.mark.batch_id if self.mark is not None else 1).uri

    # -- one step ---------------------------------------------------------------------------

    def advance(self, store: FrontierStore, run_id: int, worker: str, lease_seconds: float,
                *, final: bool = False) -> bool:
        """Write what the run committed since the feed's mark (every batch it fills), as
        ``worker``; ``final``: this worker closes (its file is closed, the claim given up, an
        empty feed written if Scrapy would store one). False when another live worker holds
        the feed (it writes it). OSError: the file cannot be written."""
        self.completed = []
        while True:
            self._more = False
            self._lost = None
            mark = store.stream_feed(
                run_id, self.key, worker, lease_seconds=lease_seconds, base=self._base,
                holder_gone=worker_is_dead,
                write=lambda mark, fetch: self._write(mark, fetch, final))
            if mark is None:
                self._close_file()
                return False
            self.mark = mark
            if self._lost is not None:  # its mark moved back: the next crawl rewrites it
                self._close_file()
                self.completed = []
                raise self._lost
            if not self._more:
                break
        if final:
            self._close_file()
            store.stream_feed(run_id, self.key, worker, lease_seconds=lease_seconds,
                              base=self._base, holder_gone=worker_is_dead,
                              write=lambda mark, fetch: mark, release=True)
        return True

    def _base(self) -> int:
        """The size the first file has before the run writes to it: kept when appended."""
        first = self.target(1)
        if not first.append:
            return 0
        try:
            return first.path.stat().st_size
        except FileNotFoundError:
            return 0

    def _write(self, mark: FeedMark, fetch: Callable[[int, int], list[SeqRecord]],
               final: bool) -> FeedMark:
        """From ``mark``: the records committed since, then the closing bytes, synced; the
        new mark. Stops after a full batch (the caller writes the next one)."""
        self._touched = False
        lost = self._check_file(mark)
        if lost is not None:
            self._lost = FeedFileLost(lost)
            return self._restart_file(mark)
        rows = fetch(mark.seq, PAGE)
        while rows:
            for row in rows:
                before = mark
                mark = self._one(mark, row, fetch)
                if mark.batch_id != before.batch_id:
                    self._more = True
                    return mark
            rows = fetch(mark.seq, PAGE) if len(rows) == PAGE else []
        if self._touched and mark.items:  # the file was cut back: closed again
            file = self._open(mark)
            file.write(self._closing_of(mark, fetch))
            self._sync(file)
        if final and mark.items:
            self.completed.append(self._file_done(mark, self._slot))
        elif final and not mark.total and mark.batch_id == 1 and self.factory.options[
                "store_empty"]:
            # Scrapy stores an empty feed (store_empty): written past the mark, so the
            # run's first entry cuts it
            file = self._open(mark)
            slot = self.factory.slot(self._sink, self.target(1).uri, 1)
            self._sink.target = file
            slot.start_exporting()
            slot.finish_exporting()
            self._sync(file)
            self.completed.append(StreamedFile(self.target(1).uri, self.format, 0, slot,
                                               self.target(1)))
        return mark

    def _one(self, mark: FeedMark, row: SeqRecord,
             fetch: Callable[[int, int], list[SeqRecord]]) -> FeedMark:
        """One record into the feed: exported (if the feed's filter accepts it) after the
        mark's file position; the mark after it."""
        item = self._item_of(row.record)
        try:
            accepted = self.factory.filter.accepts(item)
        except Exception:  # as Scrapy: this item is not in this feed, the feed goes on
            logger.error("Error exporting record %s to the feed %s", row.record.record_id,
                         self.target(mark.batch_id).uri, exc_info=True)
            accepted = False
        if not accepted:
            return replace(mark, seq=row.seq)
        file = self._open(mark)
        first_seq = mark.first_seq
        if not mark.items:
            self._slot = self.factory.slot(self._sink, self.target(mark.batch_id).uri,
                                           mark.batch_id)
            self._sink.target = file
            self._slot.start_exporting()
            first_seq = row.seq
        elif self._slot is None:
            self._slot = self._resumed_slot(mark, fetch)
        self._sink.target = file
        slot = self._slot
        assert slot.exporter is not None
        try:
            slot.exporter.export_item(item)
        except OSError:
            raise
        except Exception:  # as Scrapy: this item is not in this feed, the feed goes on
            logger.error("Error exporting record %s to the feed %s", row.record.record_id,
                         self.target(mark.batch_id).uri, exc_info=True)
            return replace(mark, seq=row.seq, first_seq=first_seq)
        if self._closing is None:
            self._closing = self._closing_bytes(item, mark.batch_id)
        mark = replace(mark, seq=row.seq, items=mark.items + 1, total=mark.total + 1,
                       first_seq=first_seq)
        if self.batch_item_count and mark.items >= self.batch_item_count:
            file.write(self._closing)
            self._sync(file)
            self.completed.append(self._file_done(mark, slot))
            self._close_file()
            following = self.target(mark.batch_id + 1)
            base = 0
            if following.append:
                with contextlib.suppress(FileNotFoundError):
                    base = following.path.stat().st_size
            mark = replace(mark, offset=base, batch_id=mark.batch_id + 1, items=0,
                           first_seq=0, base=base)
        else:
            mark = replace(mark, offset=file.tell())
        return mark

    def _resumed_slot(self, mark: FeedMark,
                      fetch: Callable[[int, int], list[SeqRecord]]) -> FeedSlot:
        """An exporter in the state of one that wrote the file up to the mark: the format's
        start and the file's first entry exported into a scratch buffer."""
        slot = self.factory.slot(self._sink, self.target(mark.batch_id).uri, mark.batch_id)
        self._sink.target = io.BytesIO()
        slot.start_exporting()
        first = fetch(mark.first_seq - 1, 1)
        if first:
            assert slot.exporter is not None
            slot.exporter.export_item(self._item_of(first[0].record))
        return slot

    def _closing_of(self, mark: FeedMark,
                    fetch: Callable[[int, int], list[SeqRecord]]) -> bytes:
        """The closing bytes, found with the file's first entry when none was exported by
        this process yet."""
        if self._closing is None:
            first = fetch(mark.first_seq - 1, 1)
            if not first:
                return b""
            self._closing = self._closing_bytes(self._item_of(first[0].record), mark.batch_id)
        return self._closing

    def _closing_bytes(self, item: Any, batch_id: int) -> bytes:
        """What the format writes after its last entry (``finish_exporting``)."""
        sink = _Sink()
        buffer = io.BytesIO()
        sink.target = buffer
        slot = self.factory.slot(sink, self.target(batch_id).uri, batch_id)
        slot.start_exporting()
        assert slot.exporter is not None
        slot.exporter.export_item(item)
        before = buffer.tell()
        slot.finish_exporting()
        return buffer.getvalue()[before:]

    def _file_done(self, mark: FeedMark, slot: FeedSlot | None) -> StreamedFile:
        target = self.target(mark.batch_id)
        return StreamedFile(target.uri, self.format, mark.items, slot, target)

    # -- the file ---------------------------------------------------------------------------

    def _check_file(self, mark: FeedMark) -> str | None:
        """Why the file of the mark's batch is not what the mark says was durably written
        (None: it is). The file this process has open must still be the one at its path (a
        file deleted, or renamed over, would take every later entry with it while the crawl
        reports them stored); any other must exist and hold at least the mark's bytes. One
        ``stat`` per write (about once a second)."""
        path = self.target(mark.batch_id).path
        try:
            found = os.stat(path)
        except FileNotFoundError:
            found = None
        if self._file is not None and self._file_batch == mark.batch_id:
            opened = os.fstat(self._file.fileno())
            if found is None or (found.st_dev, found.st_ino) != (opened.st_dev,
                                                                   opened.st_ino):
                return (f"the feed file {path} was "
                        f"{'deleted' if found is None else 'replaced'} while the crawl was "
                        "writing it")
            return None
        if mark.offset and (found is None or found.st_size < mark.offset):
            return (f"the feed file {path} holds {found.st_size if found else 0} bytes, "
                    f"fewer than the {mark.offset} written to it durably: it was "
                    f"{'deleted' if found is None else 'cut or replaced'}")
        return None

    def _restart_file(self, mark: FeedMark) -> FeedMark:
        """The mark of the file of ``mark``'s batch written again from its first entry: the
        records from that entry on are exported again (an appended feed's first file keeps
        what it held before the run, as far as it still holds it)."""
        self._close_file()
        target = self.target(mark.batch_id)
        base = 0
        if target.append and mark.batch_id == 1:
            with contextlib.suppress(FileNotFoundError):
                base = min(mark.base, target.path.stat().st_size)
        seq = mark.first_seq - 1 if mark.items and mark.first_seq else mark.seq
        return replace(mark, seq=seq, offset=base, items=0, first_seq=0,
                       total=mark.total - mark.items)

    def _open(self, mark: FeedMark) -> BinaryIO:
        """The file of the mark's batch, cut back to the mark and positioned there."""
        self._touched = True
        if self._file is None or self._file_batch != mark.batch_id:
            self._close_file()
            path = self.target(mark.batch_id).path
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            self._file = os.fdopen(fd, "r+b")
            self._file_batch = mark.batch_id
            size = os.fstat(fd).st_size
            if size < mark.offset:
                self._close_file()
                raise OSError(f"the feed file {path} holds {size} bytes, fewer than the "
                              f"{mark.offset} written to it durably: it was cut or replaced")
            self._file.seek(mark.offset)
            self._file.truncate()
        elif self._file.tell() != mark.offset:
            self._file.seek(mark.offset)
            self._file.truncate()
        return self._file

    @staticmethod
    def _sync(file: BinaryIO) -> None:
        file.flush()
        os.fsync(file.fileno())

    def close(self) -> None:
        """Close the file (the process stops writing the feed)."""
        self._close_file()

    def _close_file(self) -> None:
        self._slot = None
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
            self._file_batch = 0
