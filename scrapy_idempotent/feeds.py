"""``IdempotentFeedExporter``: feeds (``FEEDS``, ``-o``, ``-O``) that survive kills.

Scrapy's ``FeedExporter`` writes each item as it is scraped, from a process that can be
killed: after a SIGKILL and a resume a feed holds some items twice, lacks others (the killed
process's buffer), or is not valid JSON at all. With the add-on, a feed is a view of the run:

* a local feed (a path or ``file://``, no post-processing) on a store whose record sequence
  is in commit order (SQLite) is written while the crawl runs, record by record as their
  transactions commit, exact through kills (:mod:`.feed_stream`); unless
  ``IDEMPOTENT_FEED_STREAMING`` is off, the rest below applies to the other feeds only;
* when a crawl process closes (the run finished, or a graceful stop: Ctrl+C, SIGTERM,
  ``CLOSESPIDER_*``), every feed is written from the database: one entry per record the run
  inserted, updated or saw unchanged, in the order the run first stored them, through Scrapy's
  own feed storages, exporters, filters and batches (every ``FEEDS`` option applies);
* this happens after the crawl's last records are committed and before the run is marked
  finished, so a kill while the feeds are being written leaves the run unfinished, and the next
  ``scrapy crawl`` (which has nothing left to fetch) writes them again;
* a local file is written to a temporary file next to it, named after the worker writing it
  (``.NAME.<worker>.<token>.partial``), and renamed over it once complete, so a kill never
  leaves a half-written file in its place; a temporary file is removed only once the worker
  that wrote it is gone, so workers closing at the same time never remove each other's;
* a feed that cannot be stored (a storage, exporter or rename error; a streamed file that
  cannot be written, or was deleted, cut or replaced under the crawl) is logged at ERROR,
  leaves the run unfinished and makes ``scrapy crawl`` exit with 1 (a streamed one stops
  the crawl at once: :data:`FEED_ERROR_REASON`): the next ``scrapy crawl`` writes the feeds
  again, as after a kill while writing them.

``overwrite`` keeps Scrapy's meaning, applied per run: ``-O`` (overwrite) replaces the file
with the run's records; ``-o`` (append) leaves what the file held before the run started and
appends the run's records once, however many processes the run took (the size the file had
before the run first wrote to it is kept in the database). A remote feed that can only be
appended to (FTP with ``overwrite: False``) is written once, when the run finishes.

``%(time)s`` in a feed URI is the run's start time (every process of a run writes the same
file), ``%(batch_time)s`` that time plus ``batch_id - 1`` microseconds.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import inspect
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from itemadapter import ItemAdapter
from scrapy import signals
from scrapy.extensions import feedexport
from scrapy.extensions.feedexport import (
    BlockingFeedStorage,
    FeedExporter,
    FeedSlot,
    FileFeedStorage,
    StdoutFeedStorage,
)
from scrapy.extensions.postprocessing import PostProcessingManager
from scrapy.utils.defer import maybe_deferred_to_future
from scrapy.utils.misc import load_object
from twisted.internet.defer import Deferred
from twisted.internet.task import LoopingCall

from . import engine_hooks, scrapy_compat
from .codec import loads
from .crawl import FeedSession, feed_session
from .exceptions import FeedNotStored
from .feed_stream import (
    FeedFileLost,
    FeedStream,
    FeedTarget,
    SlotFactory,
    StreamedFile,
    streamable,
)
from .workers import worker_is_dead

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from typing_extensions import Self

    from .store.base import FrontierStore, RunRecord

__all__ = ["FEED_ERROR_REASON", "FeedNotStored", "IdempotentFeedExporter"]

logger = logging.getLogger(__name__)


class IdempotentFeedExporter(FeedExporter):
    """Scrapy's ``FeedExporter``, writing each feed from the run's records when a crawl
    process closes instead of item by item (see the module docstring).

    Without :class:`~.IdempotentScheduler` (no run to read) it behaves exactly as Scrapy's.
    """

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        exporter = cls(crawler)  # NotConfigured without FEEDS
        crawler.signals.connect(exporter.open_spider, signals.spider_opened)
        crawler.signals.connect(exporter.close_spider, signals.spider_closed)
        return exporter

    def __init__(self, crawler: Crawler) -> None:
        super().__init__(crawler)
        self._spider: Spider | None = None
        self._record_id_field: str | None = None
        self._from_run = False  # the scheduler calls export_run before the run is closed
        self._worker = ""  # the scheduler's worker id: the owner of our temporary files
        self._failed: list[str] = []  # the feeds of this close that could not be stored
        self._finishing = False  # this close ends the run: its feeds are complete
        self._session: FeedSession | None = None
        self._streams: dict[str, FeedStream] = {}  # by URI template: written while crawling
        self._run_start: datetime | None = None
        self._loop: LoopingCall | None = None
        self._streaming: Deferred[Any] | None = None  # a write of the streams under way
        self._streams_run: int | None = None  # the run the streams write
        self._stream_failures: list[str] = []  # streamed files whose storage failed
        self._streamed_at = 0.0  # when the streams were last written (time.monotonic())

    def open_spider(self, spider: Spider) -> None:
        self._spider = spider
        session = feed_session(self.crawler)
        if session is None:
            # No run to read the records from: Scrapy's own behaviour, item by item.
            self.crawler.signals.connect(self.item_scraped, signals.item_scraped)
            super().open_spider(spider)
            return
        self._from_run = True
        self._session = session
        self._record_id_field = session.record_id_field
        self._worker = session.worker
        unformattable = self._unformattable_uris(spider)
        if unformattable:
            # Scrapy logs its KeyError and crawls without the feed; written from the run at
            # the close, it would fail every close and keep the run open for ever: stop now
            logger.error("%s; the crawl stops before fetching anything and the run stays "
                         "open: correct FEEDS and crawl again", "; ".join(unformattable),
                         extra={"spider": spider})
            session.close_before_fetching(FEED_ERROR_REASON, failed=True)
            return
        session.before_session_end(self.export_run)
        if session.streaming and session.store.STREAMS_FEEDS:
            self._open_streams(spider)

    async def close_spider(self, spider: Spider) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        for stream in self._streams.values():  # after a failed close, no file left open
            stream.close()
        if not self._from_run:
            await super().close_spider(spider)
            return
        await scrapy_compat.send_signal(self.crawler, signals.feed_exporter_closed)

    # -- feeds written while the crawl runs ---------------------------------------------------

    def _open_streams(self, spider: Spider) -> None:
        """A :class:`~.FeedStream` for each local feed (every ``STREAM_INTERVAL_SECONDS``
        the records committed since are written on the crawl's writer thread)."""
        now = datetime.now(timezone.utc)
        for uri_template, options in self.feeds.items():
            params = self._run_uri_params(spider, options["uri_params"], now, 1)
            storage = self._get_storage(scrapy_compat.feed_uri(uri_template, params), options)
            if not streamable(storage, options):
                continue
            factory = SlotFactory(options=options, uri_template=uri_template,
                                  filter=self.filters[uri_template], spider=spider,
                                  exporters=self.exporters, settings=self.settings,
                                  crawler=self.crawler)
            self._streams[uri_template] = FeedStream(
                factory, functools.partial(self._target, uri_template, options), self._item)
        if self._streams:
            session = self._session
            assert session is not None
            session.follow_commits(self._after_commit)
            self._loop = LoopingCall(self._stream_tick)
            self._loop.start(STREAM_INTERVAL_SECONDS, now=False)

    def _after_commit(self, store: FrontierStore) -> None:
        """On the writer thread after a commit that stored records: the feeds written now
        unless they were less than ``STREAM_INTERVAL_SECONDS`` ago (the next tick writes
        them then), so a full batch is delivered before the page's children are handed out,
        as in Scrapy."""
        session = self._session
        if session is None or time.monotonic() - self._streamed_at < STREAM_INTERVAL_SECONDS:
            return
        run_id = session.current_run()
        if run_id is None:
            return
        completed = self._write_streams(store, run_id)
        if completed:
            from twisted.internet import reactor

            reactor.callFromThread(self._report_streamed, completed)

    def _target(self, uri_template: str, options: dict[str, Any],
                batch_id: int) -> FeedTarget:
        spider = self._spider
        assert spider is not None and self._run_start is not None
        params = self._run_uri_params(spider, options["uri_params"], self._run_start, batch_id)
        uri = scrapy_compat.feed_uri(uri_template, params)
        storage = self._get_storage(uri, options)
        assert isinstance(storage, FileFeedStorage)
        path = Path(storage.path)
        _remove_orphans(path)  # a snapshot's temporary files left by a killed worker
        return FeedTarget(uri, path, storage.write_mode == "ab", storage)

    def _stream_tick(self) -> None:
        session = self._session
        if self._streaming is not None or session is None:
            return  # the last write is still under way
        run_id = session.current_run()
        if run_id is None:
            return
        self._streaming = session.call("writing the feeds",
                                       lambda store: self._write_streams(store, run_id))
        self._streaming.addCallbacks(self._report_streamed, self._stream_not_written)
        self._streaming.addBoth(self._stream_done)

    def _stream_done(self, _: Any) -> None:
        self._streaming = None

    def _stream_not_written(self, failure: Any) -> None:
        # the store busy or the writer stopping: the next write (or the close) goes on
        logger.info("Feeds not written this time: %s", failure.getErrorMessage(),
                    extra={"spider": self._spider})

    def _write_streams(self, store: FrontierStore, run_id: int, *,
                       final: bool = False) -> list[StreamedFile]:
        """Advance every streamed feed (where the store may be used); the files completed.
        A feed whose file cannot be written (deleted, cut or replaced: :class:`FeedFileLost`;
        a full disk) is given up for this process, its cause logged once, and the crawl is
        stopped (:meth:`_stop_crawl`) unless it is closing already; the others go on."""
        session = self._session
        assert session is not None
        if run_id != self._streams_run:  # the first write, or this crawl moved to a newer run
            for stream in self._streams.values():
                stream.reset()
            self._streams_run = run_id
            self._run_start = self._run_start_of(store, run_id)
        self._streamed_at = time.monotonic()
        completed: list[StreamedFile] = []
        for stream in self._streams.values():
            if stream.error is not None:
                continue
            try:
                held = not stream.advance(store, run_id, session.worker,
                                          session.lease_seconds, final=final)
            except OSError as exc:
                # a file found deleted, cut or replaced is its message; an I/O error (a full
                # disk) its traceback
                logger.error("Error writing the feed %s: the crawl stops, and the run is left "
                             "unfinished (the other feeds get the records committed so far); "
                             "the next crawl of the run goes on with this feed: %s",
                             stream.uri, exc, exc_info=not isinstance(exc, FeedFileLost),
                             extra={"spider": self._spider})
                stream.error = exc
                stream.close()
                if not final:
                    from twisted.internet import reactor

                    reactor.callFromThread(self._stop_crawl)
                continue
            completed.extend(stream.completed)
            if held and final:
                stream.held = True
        return completed

    def _stop_crawl(self) -> None:
        """A streamed feed could not be written (logged): the spider is closed with
        :data:`FEED_ERROR_REASON` and ``scrapy crawl`` exits with 1 (the close leaves the
        run unfinished: the feed is in ``_failed``)."""
        engine_hooks.close_spider_failed(self.crawler, FEED_ERROR_REASON)

    def _report_streamed(self, completed: list[StreamedFile]) -> Deferred[None]:
        from scrapy.utils.defer import deferred_from_coro

        return deferred_from_coro(self._store_streamed(completed))

    async def _store_streamed(self, completed: list[StreamedFile]) -> None:
        """Each file completed through its Scrapy storage's ``store`` (as Scrapy stores a
        finished local file), with Scrapy's log line, stats and signal."""
        for done in completed:
            what = f"{done.format} feed ({done.items} items) in: {done.uri}"
            storage = done.target.storage if done.target is not None else None
            name = type(storage).__name__ if storage is not None else "FileFeedStorage"
            try:
                if storage is not None and done.target is not None:
                    # "r+b": a file gone since it was written is an error, never created empty
                    await _wait(storage.store(done.target.path.open("r+b")))
            except Exception as exc:
                logger.error("Error storing %s", what, exc_info=True,
                             extra={"spider": self._spider})
                self.crawler.stats.inc_value(f"feedexport/failed_count/{name}")
                self._stream_failures.append(f"{done.uri} ({type(exc).__name__}: {exc})")
            else:
                logger.info("Stored %s", what, extra={"spider": self._spider})
                self.crawler.stats.inc_value(f"feedexport/success_count/{name}")
            if done.slot is not None:
                await scrapy_compat.send_signal(self.crawler, signals.feed_slot_closed,
                                                slot=done.slot)

    async def _close_streams(self, store: FrontierStore, run_id: int) -> None:
        """At the close: the last records into every streamed feed, its claim given up."""
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        if self._streaming is not None:
            with contextlib.suppress(Exception):
                await maybe_deferred_to_future(self._streaming)
        if not self._streams:
            return
        for stream in self._streams.values():
            stream.held = False
        await self._store_streamed(self._write_streams(store, run_id, final=True))
        for stream in self._streams.values():
            if stream.error is not None:
                self.crawler.stats.inc_value("feedexport/failed_count/FileFeedStorage")
                self._failed.append(f"{stream.uri} ({type(stream.error).__name__}: "
                                    f"{stream.error})")
            elif stream.held and self._finishing:
                # another worker of the run writes it: the run is finished by the last one
                self._failed.append(f"{stream.uri} (being written by another worker)")
            elif self._finishing:
                # complete: a snapshot written at another process's close never replaces it
                for batch_id in range(1, (stream.mark.batch_id if stream.mark else 1) + 1):
                    store.store_feed(run_id, stream.target(batch_id).uri, _COMPLETE,
                                     lambda: None)

    @staticmethod
    def _run_start_of(store: FrontierStore, run_id: int) -> datetime:
        started = next((run.started_at for run in store.runs() if run.run_id == run_id), None)
        return (datetime.fromtimestamp(started, timezone.utc) if started is not None
                else datetime.now(timezone.utc))

    # -- writing the run's feeds -------------------------------------------------------------

    async def export_run(self, store: FrontierStore, run_id: int, finishing: bool) -> None:
        """Write every feed from the records of run ``run_id`` (see the module docstring).
        ``finishing``: this process ends the run (a feed that can only be appended to is
        written only then)."""
        spider = self._spider
        assert spider is not None
        self._failed = []
        self._finishing = finishing
        await self._close_streams(store, run_id)
        # a streamed file whose storage failed (during the crawl or now): not stored
        self._failed.extend(self._stream_failures)
        self._stream_failures = []
        run_start = self._run_start_of(store, run_id)
        slots: list[_RunSlot] = []
        for uri_template, options in self.feeds.items():
            if uri_template in self._streams:
                continue
            slot = self._run_slot(run_start, uri_template, options, 1)
            if slot.append_only_remote and not finishing:
                logger.info("Feed %s is appended to remotely: it is written when the run "
                            "finishes, not at this stop", slot.slot.uri)
                continue
            slots.append(slot)
        if not slots:
            if self._failed:
                raise FeedNotStored(self._failed)
            return
        try:
            # run_records holds no read transaction between its pages: the base of an
            # appended feed (a write) never meets a stale snapshot.
            for row in store.run_records(run_id):
                await self._export_item(self._item(row), row.record_id, slots, store, run_id,
                                        run_start)
            for slot in slots:
                await self._store_slot(slot, store, run_id)
        finally:
            for slot in slots:  # after an error: no file left open, no temporary file left
                slot.discard()
        if self._failed:
            raise FeedNotStored(self._failed)

    async def _export_item(self, item: Any, record_id: str, slots: list[_RunSlot],
                           store: FrontierStore, run_id: int, run_start: datetime) -> None:
        """One item into every feed that accepts it (what Scrapy's ``item_scraped`` does),
        a batch stored and the next one started when it is full. An item that a feed's
        filter or exporter fails on is logged and left out of that feed, as in Scrapy; a feed
        whose file cannot be written (an ``OSError``: a full disk) is given up for this
        close, its cause logged once. Either way the other feeds get every item."""
        for index, slot in enumerate(slots):
            feed = slot.slot
            if slot.error is not None:
                continue
            try:
                if not feed.filter.accepts(item) or not slot.prepare(store, run_id):
                    continue
                feed.start_exporting()
                assert feed.exporter is not None
                feed.exporter.export_item(item)
            except OSError as exc:  # the file cannot be written (a full disk): given up
                logger.error("Error exporting record %s to the feed %s: this feed is not "
                             "stored by this process (the other feeds are)", record_id,
                             feed.uri, exc_info=True, extra={"spider": self._spider})
                slot.error = exc
                slot.error_reported = True
                continue
            except Exception:  # as Scrapy: this item is not in this feed, the feed goes on
                logger.error("Error exporting record %s to the feed %s", record_id, feed.uri,
                             exc_info=True, extra={"spider": self._spider})
                continue
            feed.itemcount += 1
            options = self.feeds[feed.uri_template]
            if options["batch_item_count"] and feed.itemcount >= options["batch_item_count"]:
                await self._store_slot(slot, store, run_id)
                slots[index] = self._run_slot(run_start, feed.uri_template, options,
                                              feed.batch_id + 1)

    def _run_slot(self, run_start: datetime, uri_template: str, options: dict[str, Any],
                  batch_id: int) -> _RunSlot:
        """A slot of Scrapy's (its storage, exporter, filter); a local file's storage writes
        to a temporary file next to it, created when the slot is first written to."""
        spider = self._spider
        assert spider is not None
        params = self._run_uri_params(spider, options["uri_params"], run_start, batch_id)
        uri = scrapy_compat.feed_uri(uri_template, params)
        storage = self._get_storage(uri, options)
        target = partial = None
        append = False
        if isinstance(storage, FileFeedStorage):
            target = Path(storage.path)
            owner = self._worker.replace(":", _COLON)
            partial = target.with_name(
                f".{target.name}.{owner}.{secrets.token_hex(4)}{_PARTIAL}")
            append = storage.write_mode == "ab"
            storage = self._get_storage(str(partial), options)
        slot = feedexport.FeedSlot(
            storage=storage, uri=uri, format=options["format"],
            store_empty=options["store_empty"], batch_id=batch_id, uri_template=uri_template,
            filter=self.filters[uri_template], feed_options=options, spider=spider,
            exporters=self.exporters, settings=self.settings, crawler=self.crawler,
        )
        run_slot = _RunSlot(slot, target, partial, append)
        run_slot.append_only_remote = (target is None
                                       and getattr(storage, "overwrite", True) is False)
        return run_slot

    def _unformattable_uris(self, spider: Spider) -> list[str]:
        """Why each feed URI template of FEEDS cannot be formatted for ``spider`` (a
        placeholder that is neither a spider attribute nor one of Scrapy's, nor set by the
        feed's ``uri_params`` function)."""
        now = datetime.now(timezone.utc)
        problems = []
        for uri_template, options in self.feeds.items():
            try:
                scrapy_compat.feed_uri(uri_template, self._run_uri_params(
                    spider, options["uri_params"], now, 1))
            except KeyError as exc:
                problems.append(
                    f"FEEDS: the feed URI {uri_template!r} names %({exc.args[0]})s, which is "
                    "not an attribute of the spider, nor time, batch_time or batch_id, nor "
                    "set by the feed's uri_params function")
            except (TypeError, ValueError) as exc:
                problems.append(f"FEEDS: the feed URI {uri_template!r} cannot be formatted: "
                                f"{exc}")
        return problems

    def _run_uri_params(self, spider: Spider, function: Any, run_start: datetime,
                        batch_id: int) -> dict[str, Any]:
        params = {name: getattr(spider, name) for name in dir(spider)}
        params["time"] = run_start.replace(microsecond=0).isoformat().replace(":", "-")
        batch_time = run_start + timedelta(microseconds=batch_id - 1)
        params["batch_time"] = batch_time.isoformat().replace(":", "-")
        params["batch_id"] = batch_id
        if function:
            changed = load_object(function)(params, spider)
            if changed is not None:
                params = changed
        return params

    async def _store_slot(self, run_slot: _RunSlot, store: FrontierStore, run_id: int) -> None:
        """Finish the slot's file and store it (Scrapy's log line, stats and signal); a local
        file is renamed over its target once stored."""
        slot = run_slot.slot
        spider = self._spider
        what = f"{slot.format} feed ({slot.itemcount} items) in: {slot.uri}"
        storage_name = type(slot.storage).__name__
        try:
            if run_slot.error is not None:
                raise run_slot.error
            if slot.itemcount:
                slot.finish_exporting()
            elif slot.store_empty and slot.batch_id == 1:
                if not run_slot.prepare(store, run_id):
                    assert run_slot.error is not None
                    raise run_slot.error
                slot.start_exporting()
                slot.finish_exporting()
            else:
                run_slot.discard()
                return
            # a version of the run's feed at least this new, or the complete one, may have
            # been stored by another crawl process meanwhile: an older one never replaces it
            level = _COMPLETE if self._finishing else slot.itemcount
            # a remote storage: fenced before its upload (a slower upload of an older version
            # started earlier can still end last)
            remote = run_slot.target is None and not isinstance(slot.storage, StdoutFeedStorage)
            if remote and not store.store_feed(run_id, slot.uri, level, lambda: None):
                run_slot.discard()
                self._log_newer(slot.uri)
                return
            await _wait(slot.storage.store(_file_of(slot)))
            if not run_slot.commit(lambda replace: store.store_feed(run_id, slot.uri, level,
                                                                    replace)):
                self._log_newer(slot.uri)
                return
        except Exception as exc:
            run_slot.discard()
            # a cause logged already (preparing or exporting) is named, not logged again
            if run_slot.error_reported:
                logger.error("Error storing %s: %r (logged above)", what, exc,
                             extra={"spider": spider})
            else:
                logger.error("Error storing %s", what, exc_info=True, extra={"spider": spider})
            self.crawler.stats.inc_value(f"feedexport/failed_count/{storage_name}")
            self._failed.append(f"{slot.uri} ({type(exc).__name__}: {exc})")
        else:
            logger.info("Stored %s", what, extra={"spider": spider})
            self.crawler.stats.inc_value(f"feedexport/success_count/{storage_name}")
        await scrapy_compat.send_signal(self.crawler, signals.feed_slot_closed, slot=slot)

    def _log_newer(self, uri: str) -> None:
        logger.info("Feed %s not replaced: a newer version of the run's feed (more items, or "
                    "the finished run's) was stored by another crawl process meanwhile", uri,
                    extra={"spider": self._spider})

    def _item(self, row: RunRecord) -> Any:
        """The item a record was stored from, as far as it can be rebuilt: an instance of its
        class when that class is loaded in this process and accepts the fields, else a dict;
        the record ID stamped into ``IDEMPOTENT_RECORD_ID_FIELD`` as the crawl stamps it."""
        data = loads(row.data)
        item: Any = data
        cls = _loaded_class(row.item_type)
        if isinstance(data, dict) and cls is not None and cls is not dict:
            with contextlib.suppress(Exception):
                from scrapy import Item

                item = cls(data) if issubclass(cls, Item) else cls(**data)
        if self._record_id_field is not None:
            with contextlib.suppress(KeyError, TypeError, AttributeError):
                ItemAdapter(item)[self._record_id_field] = row.record_id
        return item


#: The close reason of a crawl stopped because a streamed feed could not be written (its
#: file deleted, cut or replaced, a full disk), and the one a crawl that would have closed
#: as ``finished`` reports when a feed could not be stored at its close (the
#: ``finish_reason`` stat, Scrapy's ``Spider closed (...)`` line): ``scrapy crawl`` exits
#: with 1.
FEED_ERROR_REASON = FeedNotStored.close_reason

#: How often the records committed since are written into the streamed feeds: the most a
#: committed record waits to be in them (plus the write itself).
STREAM_INTERVAL_SECONDS = 1.0

#: Temporary files of a feed: ``.NAME.<worker id, ':' as '+'>.<token>.partial``.
_PARTIAL = ".partial"
_COLON = "+"
#: The level (see :meth:`~.FrontierStore.store_feed`) of a feed written by the close that
#: ends the run: above any snapshot's item count.
_COMPLETE = 1 << 62


class _RunSlot:
    """A feed slot and, for a local file, the temporary file it is written to."""

    def __init__(self, slot: FeedSlot, target: Path | None, partial: Path | None,
                 append: bool) -> None:
        self.slot = slot
        self.target = target
        self.partial = partial
        self.append = append
        self.append_only_remote = False
        self._prepared = False
        self._done = False
        #: Why the slot cannot be stored (its preparation or an export failed): nothing
        #: more is written to it, and storing it reports this error.
        self.error: Exception | None = None
        #: ``error`` was logged with its traceback when it happened
        self.error_reported = False

    def prepare(self, store: FrontierStore, run_id: int) -> bool:
        """Before the first write: the directory, and for an appended file (``-o``) the part
        of it that was there before the run (its size then is kept in the database). False
        when that failed: the slot is discarded (its temporary file removed) and ``error``
        set, so no later item goes into a file missing what the target held."""
        if self._prepared or self.error is not None:
            return self.error is None
        if self.target is None or self.partial is None:
            self._prepared = True
            return True
        try:
            self._prepare_file(self.target, self.partial, store, run_id)
        except Exception as exc:
            logger.error("Error preparing the feed %s: it is not written by this process",
                         self.slot.uri, exc_info=True)
            self.error = exc
            self.error_reported = True
            self.discard()
            return False
        self._prepared = True
        return True

    def _prepare_file(self, target: Path, partial: Path, store: FrontierStore,
                      run_id: int) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_orphans(target)
        if self.append:
            size = target.stat().st_size if target.exists() else 0
            base = min(store.feed_base(run_id, self.slot.uri, size), size)
            with open(partial, "wb") as copy:
                if base:
                    with target.open("rb") as source:
                        _copy_bytes(source, copy, base)

    def commit(self, fence: Callable[[Callable[[], object]], bool]) -> bool:
        """Rename the complete temporary file over the target, through ``fence`` (the
        store's :meth:`~.FrontierStore.store_feed`: the rename happens inside its
        transaction, unless a newer version was stored); an error when the file is gone (the
        feed was not written, whatever the storage said). False: not renamed (a newer
        version is in place), the temporary file removed."""
        self._done = True
        partial, target = self.partial, self.target
        if partial is None or target is None:
            return True
        if not partial.exists():
            self.partial = None
            raise FileNotFoundError(
                f"the temporary file {partial} of the feed {target} is gone before its "
                "rename: removed by another process?")

        def replace() -> None:
            _copy_mode(target, partial)
            os.replace(partial, target)

        if fence(replace):
            self.partial = None
            return True
        self.discard()
        return False

    def discard(self) -> None:
        """After an error or with nothing to store: close the file the slot opened (never a
        stream it was given, such as stdout) and remove the temporary file."""
        file = self.slot.file
        ours = self.target is not None or isinstance(self.slot.storage, BlockingFeedStorage)
        if not self._done and ours and file is not None and not file.closed:
            with contextlib.suppress(Exception):
                file.close()
        self._done = True
        if self.partial is not None:
            with contextlib.suppress(OSError):
                self.partial.unlink()
            self.partial = None


def _remove_orphans(target: Path) -> None:
    """Remove the temporary files of ``target`` left by workers killed while writing it:
    only those whose worker is gone, never one a live worker (of this host or another) is
    still writing."""
    prefix = f".{target.name}."
    for stale in target.parent.glob(f"{glob.escape(prefix)}*{_PARTIAL}"):
        middle = stale.name[len(prefix):-len(_PARTIAL)]
        owner = middle.rpartition(".")[0].replace(_COLON, ":")
        if owner and worker_is_dead(owner):
            with contextlib.suppress(OSError):
                stale.unlink()


def _file_of(slot: FeedSlot) -> Any:
    """The file to hand to the storage (a post-processing wrapper is closed first)."""
    if isinstance(slot.file, PostProcessingManager):
        slot.file.close()
        return slot.file.file
    return slot.file


async def _wait(result: Any) -> None:
    """Wait for what a storage's ``store`` returned: None, a Deferred or an awaitable."""
    if isinstance(result, Deferred):
        await maybe_deferred_to_future(result)
    elif inspect.isawaitable(result):
        await result


def _loaded_class(path: str) -> type | None:
    """The class named ``module.QualName`` if its module is already imported: the database
    never makes this process import a module."""
    module_name, _, name = path.rpartition(".")
    if path == "dict":
        return dict
    module = sys.modules.get(module_name)
    if module is None:
        return None
    obj: Any = module
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, type) and ItemAdapter.is_item_class(obj) else None


def _copy_bytes(source: Any, target: Any, count: int) -> None:
    while count > 0:
        chunk = source.read(min(count, 1 << 20))
        if not chunk:
            return
        target.write(chunk)
        count -= len(chunk)


def _copy_mode(target: Path, partial: Path) -> None:
    """The file keeps its permissions; a new one gets the usual ones (0666 minus umask),
    not the 0600 of a temporary file."""
    try:
        mode = target.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    with contextlib.suppress(OSError):
        os.chmod(partial, mode)

