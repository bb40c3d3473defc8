"""``scrapy idempotent <command>``: see where a crawl stands, why requests failed, put them
back, get the records out and check the database, without opening SQLite by hand.

Registered as a Scrapy command through the ``scrapy.commands`` entry point (``setup.cfg``);
Scrapy has no sub-commands, so the first argument names one:

* ``status``: runs, frontier by state, leases and their owners, records, outbox deliveries
  by target and state, failures by kind, repeated requests, totals over all runs;
* ``failed``: failed requests with URL, error kind, message and attempts;
* ``retry``: failed requests back to pending (one transaction), so the next crawl fetches them;
  with ``--rejects`` the pages of the last run's rejected items;
* ``rejects``: items that could not become records (type, reason, page, time);
* ``export``: records to JSON Lines, CSV or JSON through Scrapy's item exporters;
* ``check``: integrity, schema version, WAL mode, leases of dead workers, impossible states;
  exit code 1 when something is wrong;
* ``deliver``: sends the outbox's pending announcements to the configured targets (what a
  killed crawl, or a receiver that was down, left), for at most
  ``IDEMPOTENT_OUTBOX_DRAIN_SECONDS``; exit code 1 when some are left;
* ``migrate``: copy the crawl into another, empty database (``--to``), e.g. from SQLite to
  PostgreSQL, to continue it there.

The database is the one the scheduler uses for ``SPIDER`` in the current project
(``IDEMPOTENT_DATABASE``, ``{spider}`` replaced, default ``.scrapy/idempotent/<spider>.sqlite3``
in the project data dir), or ``--db PATH`` anywhere. Every command but ``retry`` and
``deliver`` opens it read-only; none creates or migrates it. ``--json`` prints one JSON
document for scripts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from scrapy.commands import ScrapyCommand
from scrapy.exceptions import UsageError

from . import scrapy_compat
from .codec import plain_value
from .config import IdempotentConfig, store_options
from .exceptions import IdempotentError, StoreError
from .outbox import target_label
from .store import CrawlIdentity, open_store
from .store.registry import redacted, sqlite_path
from .workers import worker_state

if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterator, Sequence

    from .store.base import (
        EngineSetting,
        FrontierStore,
        RunSummary,
        SchemaInfo,
        SessionInfo,
        StoredRecord,
    )

__all__ = ["SUBCOMMANDS", "Command"]

#: Sub-command -> one-line description.
SUBCOMMANDS: dict[str, str] = {
    "status": "where the crawl stands: runs, frontier, leases, records, failures",
    "failed": "failed requests with URL, error kind, message and attempts",
    "retry": "put failed requests (or with --rejects the pages of rejected items) back to "
             "pending; the next crawl fetches them",
    "rejects": "items that could not become records, with type, reason, page and time",
    "export": "records to JSON Lines, CSV or JSON (-o FILE, default stdout)",
    "check": "integrity, schema, WAL, dead workers' leases, impossible rows; exit 1 if wrong",
    "deliver": "send the outbox's pending announcements to IDEMPOTENT_OUTBOX_TARGETS; exit 1 "
               "if some are left",
    "migrate": "copy the crawl (frontier, records, runs, rejects) into another, empty database "
               "(--to URL), e.g. from SQLite to PostgreSQL, to continue it there",
}

#: Options that only some sub-commands take (option dest -> sub-commands).
_OPTION_SCOPE: dict[str, tuple[str, ...]] = {
    "kind": ("failed", "retry"),
    "url": ("failed", "retry"),
    "limit": ("failed", "rejects"),
    "rejects": ("retry",),
    "output": ("export",),
    "format": ("export",),
    "since": ("export",),
    "run": ("export",),
    "to": ("migrate",),
}

#: ``--format`` values -> Scrapy exporter class name; a missing format is taken from the
#: output file's extension (``.jsonl``, ``.jl``, ``.csv``, ``.json``), else JSON Lines.
FORMATS: dict[str, str] = {
    "jsonlines": "JsonLinesItemExporter",
    "jsonl": "JsonLinesItemExporter",
    "jl": "JsonLinesItemExporter",
    "csv": "CsvItemExporter",
    "json": "JsonItemExporter",
}

#: Fields the export puts before the item's own.
EXPORT_FIELDS = ("record_id", "first_seen", "last_changed")

_FAILED_LIMIT = 50
_PAGE = 1000
_MESSAGE_WIDTH = 80


class Command(ScrapyCommand):
    """The ``idempotent`` Scrapy command; see the module docstring."""

    requires_project = False
    requires_crawler_process = False
    _config: IdempotentConfig
    _settings: Any

    def syntax(self) -> str:
        return f"<{'|'.join(SUBCOMMANDS)}> [SPIDER] [options]"

    def short_desc(self) -> str:
        return "Inspect and operate a scrapy_idempotent frontier: " + ", ".join(SUBCOMMANDS)

    def long_desc(self) -> str:
        commands = "; ".join(f"{name}: {desc}" for name, desc in SUBCOMMANDS.items())
        return (
            f"Operator tools for a scrapy_idempotent frontier database. {commands}. The "
            "database is the one of SPIDER in the current project (IDEMPOTENT_DATABASE), or "
            "--db PATH. Only retry and deliver write to it."
        )

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        super().add_options(parser)
        group = parser.add_argument_group("Database and output")
        group.add_argument("--db", metavar="PATH",
                           help="the frontier database, a path or a database URL (instead of a "
                                "spider name)")
        group.add_argument("--json", action="store_true",
                           help="print one JSON document instead of tables")
        group = parser.add_argument_group("failed and retry")
        group.add_argument(
            "--kind", action="append", metavar="KIND",
            help="only this error kind, or a kind prefix ending before a '/' "
                 "(download_error matches download_error/DownloadTimeoutError); may be repeated")
        group.add_argument(
            "--url", metavar="PATTERN",
            help="only URLs matching a glob on the whole URL ('*/product/*'), or a regular "
                 "expression searched in it when prefixed with 're:' ('re:SKU-0000[1-5]$')")
        group.add_argument("--limit", type=int, metavar="N",
                           help=f"failed, rejects: list at most N (default {_FAILED_LIMIT}; "
                                "0: all)")
        group.add_argument(
            "--rejects", action="store_true", default=None,
            help="retry: put back the pages of the last run's rejected items (fix the spider "
                 "or IDEMPOTENT_NATURAL_KEYS first)")
        group = parser.add_argument_group("export")
        group.add_argument("-o", "--output", metavar="FILE",
                           help="write to FILE (replaced when complete); default stdout")
        group.add_argument("--format", choices=sorted(FORMATS),
                           help="default: from the FILE extension, else jsonlines")
        group.add_argument(
            "--since", metavar="TIME",
            help="only records inserted or changed at or after TIME (ISO 8601, e.g. "
                 "2026-05-04 or 2026-05-04T10:00:00Z; UTC unless an offset is given)")
        group.add_argument("--run", type=int, metavar="N",
                           help="only records inserted or changed in run N or later")
        group = parser.add_argument_group("migrate")
        group.add_argument("--to", metavar="DATABASE",
                           help="the database to copy the crawl into (a postgresql:// URL); "
                                "it must not hold this crawl yet")

    def process_options(self, args: list[str], opts: argparse.Namespace) -> None:
        super().process_options(args, opts)
        assert self.settings is not None
        scrapy_compat.quiet_command(self.settings)
        unknown = [a for a in args if a.startswith("-") and a != "-"]
        if unknown:
            raise UsageError(f"unknown option {unknown[0]}")
        if not args or args[0] not in SUBCOMMANDS:
            given = f"unknown command {args[0]!r}; " if args else ""
            raise UsageError(f"{given}choose one of {', '.join(SUBCOMMANDS)}")
        if len(args) > 2:
            raise UsageError(f"unexpected argument {args[2]!r}")
        subcommand = args[0]
        for dest, scope in _OPTION_SCOPE.items():
            if getattr(opts, dest) is not None and subcommand not in scope:
                raise UsageError(f"--{dest} applies to {' and '.join(scope)}, not {subcommand}")
        if len(args) == 2 and opts.db:
            raise UsageError("give a spider name or --db PATH, not both")
        if opts.rejects and (opts.kind or opts.url is not None):
            raise UsageError("--rejects puts back pages of rejected items; --kind and --url "
                             "select failed requests: use one or the other")
        if opts.limit is not None and opts.limit < 0:
            raise UsageError("--limit must be 0 (all) or more")
        if subcommand == "migrate" and not opts.to:
            raise UsageError("migrate needs --to DATABASE (where to copy the crawl)")
        opts.url_glob = opts.url_regex = None
        if opts.url is not None:
            if opts.url.startswith("re:"):
                try:
                    re.compile(opts.url[3:])
                except re.error as exc:
                    raise UsageError(f"--url {opts.url!r}: bad regular expression: {exc}"
                                     ) from None
                opts.url_regex = opts.url[3:]
            else:
                opts.url_glob = opts.url
        opts.since_time = _parse_time(opts.since) if opts.since is not None else None

    def run(self, args: list[str], opts: argparse.Namespace) -> None:
        subcommand = args[0]
        try:
            store, path, identity = self._store(args[1] if len(args) > 1 else None,
                                                opts.db)
            try:
                # only retry and deliver write (and migrate locks the source it copies,
                # writing nothing): they refuse, untouched, a file that is not ours or
                # another crawl's (known from the spider's settings; with --db, only the
                # former)
                info = store.open_existing(
                    readonly=subcommand not in ("retry", "deliver", "migrate"),
                    identity=identity)
                if subcommand != "check" and not info.current:
                    raise StoreError(
                        f"{path} has schema version {info.version}; this "
                        f"scrapy_idempotent reads version {info.supported}"
                        " (a crawl migrates an older database; a newer one needs a newer "
                        "scrapy_idempotent)")
                getattr(self, f"_{subcommand}")(store, path, info, opts)
            finally:
                store.close()
        except _UnknownSpider as exc:
            print(f"scrapy idempotent {subcommand}: {exc}", file=sys.stderr)
            self.exitcode = 2
        except IdempotentError as exc:
            print(f"scrapy idempotent {subcommand}: {exc}", file=sys.stderr)
            self.exitcode = 1
        except BrokenPipeError:  # the reader went away (| head): not an error of ours
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

    # -- the database -----------------------------------------------------------------------

    def _store(self, spider: str | None,
               db: str | None) -> tuple[FrontierStore, str, CrawlIdentity | None]:
        """The store of ``--db`` or of the spider's settings, as the scheduler resolves it,
        and the identity of that spider's crawl (None with ``--db``). Without a spider name,
        the only spider of the project."""
        assert self.settings is not None
        settings = self.settings.copy()
        self._settings = settings
        if db is not None:
            self._config = IdempotentConfig.from_settings(
                settings, SimpleNamespace(name=spider or "spider"))  # type: ignore[arg-type]
            return open_store(db, **store_options(settings)), redacted(db), None
        from scrapy.utils.project import inside_project

        if not inside_project():
            if spider is None or settings.get("IDEMPOTENT_DATABASE") in (None, ""):
                raise _UnknownSpider(
                    f"not inside a Scrapy project (no scrapy.cfg in {os.getcwd()} or above): "
                    "run it in the project's directory, or give the database with --db PATH")
            named: Any = SimpleNamespace(name=spider)
            config = IdempotentConfig.from_settings(settings, named)
            return self._of(config, settings, spider)
        loader = scrapy_compat.spider_loader(settings)
        known = sorted(loader.list())
        spidercls: Any
        if spider is None:
            if len(known) != 1:
                raise _UnknownSpider(
                    "give a spider name: this project has "
                    + (f"{len(known)} spiders ({', '.join(known)})" if known else "no spider"))
            spider = known[0]
        try:
            spidercls = loader.load(spider)
        except KeyError:
            # not a spider of this project (any more): its database may still be there
            spidercls = SimpleNamespace(name=spider)
            config = IdempotentConfig.from_settings(settings, spidercls)
            path = sqlite_path(config.database)
            if path is not None and not os.path.exists(path):
                raise _UnknownSpider(
                    f"unknown spider {spider!r}; the spiders of this project: "
                    f"{', '.join(known) or 'none'} (no database at {path} either)") from None
        else:
            spidercls.update_settings(settings)
            config = IdempotentConfig.from_settings(settings, spidercls)
        return self._of(config, settings, spider)

    def _of(self, config: IdempotentConfig, settings: Any,
            spider: str) -> tuple[FrontierStore, str, CrawlIdentity | None]:
        self._config = config
        return (open_store(config.database, **config.store_options()),
                redacted(config.database), _identity(settings, spider, config))

    def _print(self, opts: argparse.Namespace, report: dict[str, Any], lines: list[str]) -> None:
        if opts.json:
            print(json.dumps(report, indent=2, ensure_ascii=False))
        else:
            print("\n".join(lines))

    # -- status -----------------------------------------------------------------------------

    def _status(self, store: FrontierStore, path: str, info: SchemaInfo,
                opts: argparse.Namespace) -> None:
        engine = store.engine_settings()
        report = _status_report(store, path, info, engine)
        self._print(opts, report, [] if opts.json else _status_lines(report, engine))

    # -- failed and retry -------------------------------------------------------------------

    def _failed(self, store: FrontierStore, path: str, info: SchemaInfo,
                opts: argparse.Namespace) -> None:
        filters = _filters(opts)
        limit = _FAILED_LIMIT if opts.limit is None else opts.limit
        total = store.count_failed(**filters)
        rows = store.failed_requests(**filters, limit=limit or None)
        failed = [{**dataclasses.asdict(row), "finished_at": _iso(row.finished_at)}
                  for row in rows]
        report = {"database": path, "matching": total, "listed": len(failed), "failed": failed}
        described = _describe_filters(opts)
        lines = [f"{total} failed request{'s' * (total != 1)}{described}"
                 + (f", the latest {len(failed)} listed (--limit 0 lists all)"
                    if len(failed) < total else "")]
        if failed:
            lines += _table(
                ["kind", "attempts", "failed at", "url", "message"],
                [[r["error_kind"] or "-", r["attempts"], r["finished_at"] or "-", r["url"],
                  _shorten(str(r["error_message"] or ""))] for r in failed])
        self._print(opts, report, lines)

    def _retry(self, store: FrontierStore, path: str, info: SchemaInfo,
               opts: argparse.Namespace) -> None:
        if opts.rejects:
            self._retry_rejects(store, path, opts)
            return
        result = store.retry_failed(**_filters(opts))
        retried = result.retried
        report = {"database": path, **dataclasses.asdict(result)}
        described = _describe_filters(opts)
        if not retried:
            lines = [f"No failed request{described}: nothing changed."]
        else:
            run = result.run_id
            how = (f"run {run} reopened: the next crawl resumes it" if result.reopened
                   else f"run {run} is unfinished: the next crawl resumes it")
            lines = [f"Put {retried} failed request{'s' * (retried != 1)}{described} back to "
                     f"pending; {how} and fetches them (unless IDEMPOTENT_RUN_MODE is fresh)."]
        self._print(opts, report, lines)

    def _retry_rejects(self, store: FrontierStore, path: str, opts: argparse.Namespace) -> None:
        result = store.retry_rejects()
        pages, without = result.pages, result.without_page
        report = {"database": path, **dataclasses.asdict(result)}
        run = result.run_id
        if not pages:
            lines = [f"No page of a rejected item of run {run} to put back: nothing changed."
                     if run is not None else "No run yet: nothing changed."]
        else:
            how = (f"run {run} reopened: the next crawl resumes it" if result.reopened
                   else f"run {run} is unfinished: the next crawl resumes it")
            lines = [f"Put {pages} page{'s' * (pages != 1)} of {result.rejects} rejected "
                     f"item{'s' * (result.rejects != 1)} back to pending; {how} and fetches "
                     "them again (unless IDEMPOTENT_RUN_MODE is fresh)."]
        if without:
            lines.append(f"{without} rejected item{'s' * (without != 1)} of run {run} "
                         f"{'have' if without != 1 else 'has'} no page in the frontier (from "
                         "start(), or the page is still pending): nothing to put back.")
        self._print(opts, report, lines)

    # -- rejects ----------------------------------------------------------------------------

    def _rejects(self, store: FrontierStore, path: str, info: SchemaInfo,
                 opts: argparse.Namespace) -> None:
        limit = _FAILED_LIMIT if opts.limit is None else opts.limit
        total = store.count_rejects()
        rows = store.rejects(limit=limit or None)
        rejects = [{**dataclasses.asdict(row), "created_at": _iso(row.created_at),
                    "retried_at": _iso(row.retried_at)} for row in rows]
        report = {"database": path, "total": total, "listed": len(rejects),
                  "rejects": rejects}
        lines = [f"{total} rejected item{'s' * (total != 1)}"
                 + (f", the latest {len(rejects)} listed (--limit 0 lists all)"
                    if len(rejects) < total else "")]
        if rejects:
            lines += _table(
                ["run", "rejected at", "type", "page", "reason", "put back"],
                [[r["run_id"], r["created_at"], r["item_type"], r["page_url"] or "-",
                  _shorten(str(r["reason"])), r["retried_at"] or "-"] for r in rejects])
            lines.append("Fix the spider or IDEMPOTENT_NATURAL_KEYS, then `scrapy idempotent "
                         "retry --rejects` puts their pages back for the next crawl.")
        self._print(opts, report, lines)

    # -- export -----------------------------------------------------------------------------

    def _export(self, store: FrontierStore, path: str, info: SchemaInfo,
                opts: argparse.Namespace) -> None:
        from scrapy.utils.misc import load_object

        fmt = opts.format or _format_of(opts.output) or "jsonlines"
        fmt = {"jsonl": "jsonlines", "jl": "jsonlines"}.get(fmt, fmt)
        exporter_cls = load_object(f"scrapy.exporters.{FORMATS[fmt]}")
        to_stdout = opts.output in (None, "-")
        filters = {"changed_since": opts.since_time, "changed_since_run": opts.run}
        kwargs: dict[str, Any] = {"encoding": "utf-8"}
        if fmt == "csv":  # one header for every record: the union of their fields
            fields: dict[str, None] = {}
            for record in _records(store, filters):
                fields.update(dict.fromkeys(_export_row(record, flat=True)))
            kwargs["fields_to_export"] = [*EXPORT_FIELDS,
                                          *sorted(f for f in fields if f not in EXPORT_FIELDS)]
        elif fmt == "json":
            kwargs["indent"] = 0  # one record per line
        partial = f"{opts.output}.partial"
        stream: Any = sys.stdout.buffer if to_stdout else open(partial, "wb")  # noqa: SIM115
        count = 0
        try:
            exporter = exporter_cls(stream, **kwargs)
            exporter.start_exporting()
            for record in _records(store, filters):
                exporter.export_item(_export_row(record, flat=fmt == "csv"))
                count += 1
            exporter.finish_exporting()
            if fmt == "json":
                stream.write(b"\n")
            stream.flush()
        finally:
            if not to_stdout:
                stream.close()
        if not to_stdout:
            os.replace(partial, opts.output)
        report = {"database": path, "exported": count, "format": fmt,
                  "output": None if to_stdout else opts.output,
                  "since": _iso(opts.since_time), "run": opts.run}
        where = "stdout" if to_stdout else opts.output
        line = f"Exported {count} record{'s' * (count != 1)} to {where} ({fmt})"
        if to_stdout:  # keep stdout for the data
            print(json.dumps(report) if opts.json else line, file=sys.stderr)
        else:
            self._print(opts, report, [line])

    def _file_checks(self, store: FrontierStore) -> list[dict[str, Any]]:
        """Orphans of the local files stores of ``FILES_STORE`` and ``IMAGES_STORE``: files
        no stored record references (left by a kill, a page that failed for good, an item
        dropped after its files were written, a file URL that changed)."""
        from .files import orphan_files, referenced_paths

        settings = self._settings
        stores = {settings.get(name) for name in ("FILES_STORE", "IMAGES_STORE")}
        local = sorted(str(s).split("://", 1)[-1] for s in stores
                       if s and ("://" not in str(s) or str(s).startswith("file://")))
        if not local:
            return []
        fields = (settings.get("FILES_RESULT_FIELD") or "files",
                  settings.get("IMAGES_RESULT_FIELD") or "images")
        referenced: set[str] = set()
        for record in _records(store, {}):
            data = json.loads(record.data)
            if isinstance(data, dict):
                referenced |= referenced_paths(data, fields)
        checks = []
        for basedir in local:
            orphans = orphan_files(basedir, referenced) if os.path.isdir(basedir) else []
            shown = ", ".join(orphans[:10]) + (" ..." if len(orphans) > 10 else "")
            checks.append({
                "check": "files", "ok": not orphans,
                "detail": (f"{len(orphans)} file(s) in {basedir} that no stored record "
                           f"references: {shown}") if orphans else
                          f"every file in {basedir} is referenced by a stored record",
                "orphans": orphans})
        return checks

    # -- deliver ----------------------------------------------------------------------------

    def _deliver(self, store: FrontierStore, path: str, info: SchemaInfo,
                 opts: argparse.Namespace) -> None:
        config = self._config
        if not config.outbox_targets:
            raise IdempotentError(
                "IDEMPOTENT_OUTBOX_TARGETS is empty: there is nowhere to deliver to")
        from scrapy.utils.defer import deferred_from_coro
        from scrapy.utils.reactor import install_reactor, is_reactor_installed

        if not is_reactor_installed():
            install_reactor(self._settings["TWISTED_REACTOR"] or
                            "twisted.internet.asyncioreactor.AsyncioSelectorReactor",
                            self._settings["ASYNCIO_EVENT_LOOP"])
        from twisted.internet import reactor as installed

        reactor: Any = installed
        outcome: list[Any] = []

        def finish(result: Any) -> None:
            outcome.append(result)
            reactor.stop()

        def start() -> None:
            deferred_from_coro(self._deliver_all(store, config)).addBoth(finish)

        reactor.callWhenRunning(start)
        reactor.run()
        if not outcome:  # the reactor was stopped from outside (a signal)
            raise IdempotentError("interrupted; what was not recorded as delivered is sent "
                                  "again by the next `deliver` or crawl")
        from twisted.python.failure import Failure

        if isinstance(outcome[0], Failure):
            outcome[0].raiseException()
        counts, left = outcome[0]
        report = {"database": path, **counts, "pending": left,
                  "outbox": store.outbox_counts()}
        self.exitcode = 1 if left else 0
        lines = [f"Delivered {counts['delivered']}, retried {counts['pending']}, failed "
                 f"{counts['failed']}; {left} still pending"]
        lines += _table(["target", "pending", "delivered", "failed"],
                        [[target_label(target), n["pending"], n["delivered"], n["failed"]]
                         for target, n in report["outbox"].items()])
        self._print(opts, report, lines)

    async def _deliver_all(self, store: FrontierStore,
                           config: IdempotentConfig) -> tuple[dict[str, int], int]:
        from scrapy import Spider
        from scrapy.crawler import Crawler

        from .outbox import Deliverer, build_targets

        crawler = Crawler(Spider, self._settings)
        deliverer = Deliverer(store, build_targets(config, crawler),
                              concurrency=config.outbox_concurrency,
                              timeout_seconds=config.outbox_timeout_seconds,
                              retry_seconds=config.outbox_retry_seconds,
                              retry_max_seconds=config.outbox_retry_max_seconds)
        try:
            left = await deliverer.drain(config.outbox_drain_seconds)
        finally:
            await deliverer.close()
        return deliverer.counts, left
    # -- migrate ----------------------------------------------------------------------------

    def _migrate(self, store: FrontierStore, path: str, info: SchemaInfo,
                 opts: argparse.Namespace) -> None:
        """Copy the crawl into ``--to`` (opened as a crawl of the same identity would open
        it, created if needed, refused when it holds another crawl or this one already), in
        one transaction there. The source is only read, under its write lock from the check
        until the target has committed (:meth:`~.FrontierStore.frozen`): one consistent
        state is copied, and nothing lands in the source meanwhile. Refused while a crawl of
        the source runs (a session not ended of a live worker, or an unexpired lease): stop
        every crawl of it first."""
        assert self.settings is not None
        with store.frozen():
            now = time.time()
            running = store.live_workers()
            if running:
                raise StoreError(
                    f"{path} is in use by the crawl of {', '.join(running[:3])}"
                    f"{' and others' if len(running) > 3 else ''} (a session that has not "
                    "ended, of a process that runs): stop every crawl of it before migrating")
            live = [h for h in store.lease_holders() if h.leased_until >= now]
            if live:
                raise StoreError(
                    f"{path} has leases held by {', '.join(h.worker for h in live[:3])} until "
                    f"{_iso(max(h.leased_until for h in live))}: stop every crawl of it before "
                    "migrating (a graceful stop releases its leases at once)")
            meta = store.meta()
            identity = (CrawlIdentity(project=meta.get("project", ""), spider=meta["spider"],
                                      source=meta.get("source", ""))
                        if meta.get("spider") else None)
            target = open_store(opts.to, **store_options(self.settings))
            try:
                target.open(fingerprinter=meta.get("fingerprinter", ""), identity=identity)
                written = target.load(store.dump())
            finally:
                target.close()
        moved = {table: written.get(table, 0) for table in
                 ("runs", "requests", "records", "rejects", "responses")}
        report = {"database": path, "to": redacted(opts.to), "rows": moved}
        self._print(opts, report, [
            f"Migrated {path} to {redacted(opts.to)}: "
            + ", ".join(f"{n} {table}" for table, n in moved.items())
            + "; set IDEMPOTENT_DATABASE to it to continue the crawl there"])

    # -- check ------------------------------------------------------------------------------

    def _check(self, store: FrontierStore, path: str, info: SchemaInfo,
               opts: argparse.Namespace) -> None:
        checks: list[dict[str, Any]] = []

        def add(name: str, ok: bool, detail: str) -> None:
            checks.append({"check": name, "ok": ok, "detail": detail})

        integrity = store.integrity_check()
        add("integrity", integrity.ok,
            f"{integrity.method}: " + ("; ".join(integrity.problems[:10]) or "ok"))
        add("schema_version", info.current,
            f"schema version {info.version}" + (
                "" if info.current else f", this scrapy_idempotent reads {info.supported}"))
        for setting in store.engine_settings():
            add(setting.name, setting.ok, f"{setting.label} {setting.value}" + (
                "" if setting.ok else f" (expected {setting.expected})"))
        if info.current:
            now = time.time()
            holders = store.lease_holders()
            if not holders:
                add("leases", True, "no leases held")
            for holder in holders:
                state = worker_state(holder.worker)
                plural = "s" * (holder.leases != 1)
                if state == "dead":
                    add("leases", False,
                        f"{holder.leases} lease{plural} held by {holder.worker}, a process of "
                        "this host that no longer exists (the next crawl on this host takes "
                        "them back at once)")
                elif holder.leased_until < now:
                    add("leases", False,
                        f"{holder.leases} lease{plural} of {holder.worker} expired "
                        f"{now - holder.leased_until:.0f} s ago ({_WORKER_STATES[state]}; the "
                        "next crawl takes them back)")
                else:
                    add("leases", True,
                        f"{holder.leases} lease{plural} held by {holder.worker} "
                        f"({_WORKER_STATES[state]}) until {_iso(holder.leased_until)}")
            anomalies = store.anomalies()
            wrong = {name: n for name, n in anomalies.items() if n}
            add("rows", not wrong,
                "; ".join(f"{n} {_ANOMALIES[name]}" for name, n in wrong.items())
                if wrong else "no rows in impossible states")
            for check in self._file_checks(store):
                checks.append(check)
        problems = sum(1 for c in checks if not c["ok"])
        self.exitcode = 1 if problems else 0
        report = {"database": path, "ok": not problems, "problems": problems,
                  "checks": checks}
        lines = [f"Checking {path}"]
        lines += _table(["", "check", "detail"],
                        [["ok" if c["ok"] else "PROBLEM", c["check"], c["detail"]]
                         for c in checks], header=False)
        lines.append(f"{problems} problem{'s' * (problems != 1)} found" if problems
                     else "No problem found")
        self._print(opts, report, lines)


# -- status -------------------------------------------------------------------------------


def _status_report(store: FrontierStore, path: str, info: SchemaInfo,
                   engine: Sequence[EngineSetting]) -> dict[str, Any]:
    """What ``status`` reports (its ``--json`` form): the database, its runs, frontier,
    leases, records, outbox, failures, repeated requests and totals."""
    meta = store.meta()
    runs = store.runs()
    sessions = store.sessions()
    counts = store.counts()
    ends: dict[int, list[str]] = {}
    for session in sessions:
        ends.setdefault(session.run_id, []).append(_session_end(session))
    records = counts.pop("records")
    run_rows = [_run_report(run, ends.get(run.run_id, [])) for run in runs]
    current = run_rows[-1] if run_rows else None
    return {
        "database": path,
        "schema_version": info.version,
        **{setting.name: setting.value for setting in engine},
        "created_at": _iso(float(meta["created_at"])) if "created_at" in meta else None,
        "fingerprinter": meta.get("fingerprinter"),
        "run": current,
        "runs": run_rows,
        "frontier": {**counts, "total": sum(counts.values())},
        "leases": _lease_report(store),
        "records": {
            "stored": records,
            "inserted": current["records_inserted"] if current else 0,
            "updated": current["records_updated"] if current else 0,
            "unchanged": current["records_unchanged"] if current else 0,
            "rejected": current["rejects"] if current else 0,
        },
        "failures": store.failure_counts(),
        "outbox": store.outbox_counts(),
        "repeated": _repeated_report(store, current, records),
        "totals": _totals_report(runs, run_rows, [e for run_ends in ends.values()
                                                  for e in run_ends]),
    }


def _lease_report(store: FrontierStore) -> list[dict[str, Any]]:
    now = time.time()
    return [{"worker": h.worker, "leases": h.leases, "leased_until": _iso(h.leased_until),
             "expires_in_seconds": round(h.leased_until - now, 1),
             "worker_state": worker_state(h.worker)}
            for h in store.lease_holders()]


def _repeated_report(store: FrontierStore, current: dict[str, Any] | None,
                     records: int) -> dict[str, Any]:
    summary = store.request_summary()
    return {
        "requests": summary.repeated,
        "downloaded_again": summary.downloaded_again,
        "downloads": summary.downloads,
        "replays": summary.replays,
        "most_attempts": summary.most_attempts,
        "leased": current["leased"] if current else 0,
        "leases_per_record": (round(current["leased"] / records, 3)
                              if current and records else None),
        "top": [dataclasses.asdict(row) for row in store.repeated_requests(10)],
    }


_RUN_COUNTERS = ("leased", "done", "failed", "redirected", "records_inserted",
                 "records_updated", "records_unchanged", "rejects")


def _totals_report(runs: Sequence[RunSummary], run_rows: list[dict[str, Any]],
                   all_ends: list[str]) -> dict[str, Any]:
    return {
        "runs": len(runs),
        "finished_runs": sum(1 for run in runs if run.finished_at is not None),
        "crawls": len(all_ends),
        "crawls_by_end": _tally(all_ends),
        **{name: sum(int(r[name]) for r in run_rows) for name in _RUN_COUNTERS},
    }


def _status_lines(report: dict[str, Any], engine: Sequence[EngineSetting]) -> list[str]:
    """The text form of :func:`_status_report`, one section after the other."""
    current = report["run"]
    run_label = f"in run {current['run_id']}" if current else "in this run"
    lines = _status_head(report, engine)
    for section in (_runs_section(report["runs"]), _frontier_section(report["frontier"]),
                    _leases_section(report["leases"]),
                    _records_section(report["records"], run_label),
                    _outbox_section(report["outbox"]), _failures_section(report["failures"]),
                    _repeated_section(report["repeated"], run_label),
                    _totals_section(report["totals"])):
        lines += ["", *section]
    return lines


def _status_head(report: dict[str, Any], engine: Sequence[EngineSetting]) -> list[str]:
    current = report["run"]
    lines = [f"Database  {report['database']}",
             f"          schema {report['schema_version']}"
             + "".join(f", {setting.label} {setting.value}" for setting in engine)
             + f", created {report['created_at'] or '-'}"]
    if current is None:
        lines.append("No run yet: no crawl has used this database.")
    else:
        lines.append(f"Run {current['run_id']}     {_run_sentence(current)}")
    return lines


def _runs_section(run_rows: list[dict[str, Any]]) -> list[str]:
    return ["Runs", *_table(
        ["run", "started", "finished", "state", "crawls", "leased", "done", "failed",
         "redirected", "inserted", "updated", "unchanged", "rejects"],
        [[r["run_id"], r["started_at"], r["finished_at"] or "-", r["state"],
          r["crawls"], r["leased"], r["done"], r["failed"], r["redirected"],
          r["records_inserted"], r["records_updated"], r["records_unchanged"],
          r["rejects"]] for r in run_rows])]


def _frontier_section(frontier: dict[str, int]) -> list[str]:
    return ["Frontier (requests by state)",
            *_table(["state", "requests"], [[k, v] for k, v in frontier.items()])]


def _leases_section(leases: list[dict[str, Any]]) -> list[str]:
    if not leases:
        return ["Leases", "  none"]
    return ["Leases", *_table(
        ["worker", "leases", "until", "worker state"],
        [[lease["worker"], lease["leases"],
          f"{lease['leased_until']} ({_expiry(lease['expires_in_seconds'])})",
          _WORKER_STATES[lease["worker_state"]]] for lease in leases])]


def _records_section(rec: dict[str, Any], run_label: str) -> list[str]:
    return ["Records", *_pairs([
        ("stored", rec["stored"]), (f"inserted {run_label}", rec["inserted"]),
        (f"updated {run_label}", rec["updated"]),
        (f"unchanged {run_label}", rec["unchanged"]),
        (f"rejected {run_label}", rec["rejected"])])]


def _outbox_section(outbox: dict[str, Any]) -> list[str]:
    title = "Outbox (announcements of record changes, by target)"
    if not outbox:
        return [title, "  none (no IDEMPOTENT_OUTBOX_TARGETS when records changed)"]
    return [title, *_table(["target", "pending", "delivered", "failed"],
                           [[target_label(target), n["pending"], n["delivered"],
                             n["failed"]] for target, n in outbox.items()])]


def _failures_section(failures: dict[str, int]) -> list[str]:
    if not failures:
        return ["Failures by kind", "  none"]
    return ["Failures by kind",
            *_table(["kind", "requests"], [[k or "-", v] for k, v in failures.items()])]


def _repeated_section(rep: dict[str, Any], run_label: str) -> list[str]:
    lines = ["Repeated requests", *_pairs([
        ("downloaded more than once", rep["downloaded_again"],
         "(retries, and requests in flight when a crawl was killed)"),
        ("leased more than once", rep["requests"],
         f"(includes {rep['replays']} answered from the response journal: not downloads)"
         if rep["replays"] else ""),
        ("most leases of one request", rep["most_attempts"]),
        ("downloads", rep["downloads"]),
        (f"leases {run_label}", rep["leased"]),
        ("leases per stored record",
         "-" if rep["leases_per_record"] is None else f"{rep['leases_per_record']:.3f}"),
    ])]
    if rep["top"]:
        lines += _table(["attempts", "state", "url"],
                        [[r["attempts"], r["state"], r["url"]] for r in rep["top"]])
    return lines


def _totals_section(totals: dict[str, Any]) -> list[str]:
    crawls_by_end = ", ".join(f"{n} {end}" for end, n in totals["crawls_by_end"].items())
    return [f"Totals over {totals['runs']} run{'s' * (totals['runs'] != 1)}", *_pairs([
        ("runs finished", totals["finished_runs"]),
        ("crawls", totals["crawls"], f"({crawls_by_end})" if crawls_by_end else ""),
        ("requests leased", totals["leased"]),
        ("requests done", totals["done"]),
        ("requests failed", totals["failed"]),
        ("requests redirected", totals["redirected"]),
        ("records inserted", totals["records_inserted"]),
        ("records updated", totals["records_updated"]),
        ("records unchanged", totals["records_unchanged"]),
        ("items rejected", totals["rejects"]),
    ])]


# -- helpers ------------------------------------------------------------------------------


def _identity(settings: Any, spider: str, config: IdempotentConfig) -> CrawlIdentity:
    """The identity a crawl of ``spider`` with these settings gives its database (as the
    scheduler builds it)."""
    return CrawlIdentity(project=str(settings.get("BOT_NAME") or ""), spider=spider,
                         source=config.source)


class _UnknownSpider(IdempotentError):
    """No spider given in a project of several, an unknown spider, or no project at all."""


_WORKER_STATES = {
    "alive": "running on this host",
    "dead": "dead: process gone",
    "other host": "on another host",
    "other namespace": "on this host name, in another PID namespace (container) or of an "
                       "older release",
    "unknown": "unknown worker id",
}

_ANOMALIES = {
    "unknown_state": "requests in an unknown state",
    "leased_without_owner": "leased requests without a worker or lease time",
    "owner_without_lease": "requests not leased but with a worker or lease time",
    "finished_without_time": "finished requests without a finish time",
    "unfinished_with_time": "pending or leased requests with a finish time",
    "failed_without_kind": "failed requests without an error kind",
    "finished_never_leased": "finished requests never leased",
    "orphan_journal": "journaled responses of requests that are not pending or leased",
    "record_times": "records changed before they were first seen",
}


def _session_end(session: SessionInfo) -> str:
    """How a crawl process ended: its close reason, or ``running``/``killed``/``unknown``
    when it never closed."""
    if session.ended_at is not None:
        return session.reason or "closed"
    state = worker_state(session.worker)
    return {"alive": "running", "dead": "killed"}.get(state, "not closed")


def _run_report(run: RunSummary, ends: list[str]) -> dict[str, Any]:
    report: dict[str, Any] = {**dataclasses.asdict(run), "started_at": _iso(run.started_at),
                              "finished_at": _iso(run.finished_at),
                              "crawls": len(ends), "crawls_by_end": _tally(ends)}
    if run.finished_at is not None:
        report["state"] = run.reason or "finished"
    elif "running" in ends:
        report["state"] = "running"
    else:
        report["state"] = f"open ({ends[-1]})" if ends else "open"
    return report


def _run_sentence(run: dict[str, Any]) -> str:
    if run["finished_at"] is not None:
        return (f"finished at {run['finished_at']}: the next crawl starts run "
                f"{run['run_id'] + 1} (IDEMPOTENT_RUN_MODE auto)")
    if run["state"] == "running":
        return "running"
    last = run["state"][len("open ("):-1] if run["state"].startswith("open (") else "none"
    return f"unfinished (last crawl: {last}): the next crawl resumes it"


def _tally(values: Sequence[str]) -> dict[str, int]:
    tally: dict[str, int] = {}
    for value in values:
        tally[value] = tally.get(value, 0) + 1
    return tally


def _filters(opts: argparse.Namespace) -> dict[str, Any]:
    return {"kinds": opts.kind, "url_glob": opts.url_glob, "url_regex": opts.url_regex}


def _describe_filters(opts: argparse.Namespace) -> str:
    parts = []
    if opts.kind:
        parts.append(f"of kind {' or '.join(opts.kind)}")
    if opts.url is not None:
        parts.append(f"with URL matching {opts.url!r}")
    return (" " + " ".join(parts)) if parts else ""


def _records(store: FrontierStore, filters: dict[str, Any]) -> Iterator[StoredRecord]:
    """Every matching record, one page at a time (memory does not grow with the table)."""
    after = None
    while True:
        page = store.records_page(after=after, limit=_PAGE, **filters)
        yield from page
        if len(page) < _PAGE:
            return
        after = page[-1].record_id


def _export_row(record: StoredRecord, *, flat: bool) -> dict[str, Any]:
    """The exported form of a record: ``record_id``, ``first_seen``, ``last_changed``, then
    the item's fields as plain JSON values (tuples and sets as lists, datetimes and dates as
    ISO 8601 text, Decimals as text, bytes as base64 text). With ``flat`` (CSV), lists and
    objects become JSON text."""
    row: dict[str, Any] = {"record_id": record.record_id,
                           "first_seen": _iso(record.first_seen),
                           "last_changed": _iso(record.last_changed)}
    data = _plain(json.loads(record.data))
    for name, value in (data.items() if isinstance(data, dict) else [("data", data)]):
        if flat and isinstance(value, (list, dict)):
            value = json.dumps(value, ensure_ascii=False, sort_keys=True)
        row.setdefault(name, value)
    return row


def _plain(value: Any) -> Any:
    """Tagged JSON (see :mod:`~.codec`, which owns the tags) to plain JSON values that every
    export format can write: text with a lone surrogate (not valid Unicode; the codec stores
    it as it came) has each lone surrogate replaced by U+FFFD, and a NaN or infinite number
    becomes None (null in JSON, an empty cell in CSV), as JavaScript's ``JSON.stringify``
    does."""
    return plain_value(value, _export_leaf)


def _export_leaf(value: Any) -> Any:
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _text(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD (valid UTF-8 in any format)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)
    return text


def _format_of(output: str | None) -> str | None:
    if not output or output == "-":
        return None
    extension = os.path.splitext(output)[1].lower().lstrip(".")
    return extension if extension in FORMATS else None


def _parse_time(text: str) -> float:
    """ISO 8601 date or date and time to unix seconds; UTC unless an offset is given."""
    value = text.strip()
    if value[-1:] in ("Z", "z"):
        value = value[:-1] + "+00:00"
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise UsageError(f"--since {text!r}: not an ISO 8601 date or time (2026-05-04, "
                         "2026-05-04T10:00:00Z, 2026-05-04T12:00:00+02:00)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _iso(seconds: object) -> str | None:
    """Unix seconds as ISO 8601 UTC to the second (``2026-05-04T10:00:00Z``), None as None.
    Truncated, so ``--since`` with a time shown here includes the record shown with it."""
    if seconds is None:
        return None
    assert isinstance(seconds, (int, float))
    moment = datetime.fromtimestamp(seconds, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _expiry(seconds: float) -> str:
    return f"in {seconds:.0f} s" if seconds >= 0 else f"expired {-seconds:.0f} s ago"


def _shorten(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MESSAGE_WIDTH else text[:_MESSAGE_WIDTH - 3] + "..."


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *,
           header: bool = True) -> list[str]:
    """Rows as aligned text columns, two spaces apart, numbers right-aligned."""
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    shown = [list(headers), *cells] if header else cells
    widths = [max(len(r[i]) for r in shown) for i in range(len(headers))]
    numeric = [bool(rows) and all(isinstance(row[i], (int, float))
                                  and not isinstance(row[i], bool) for row in rows)
               for i in range(len(headers))]
    lines = []
    for row in shown:
        parts = [cell.rjust(widths[i]) if numeric[i] else cell.ljust(widths[i])
                 for i, cell in enumerate(row)]
        lines.append(("  " + "  ".join(parts)).rstrip())
    return lines


def _pairs(pairs: Sequence[tuple[Any, ...]]) -> list[str]:
    """``(label, value[, note])`` as aligned lines, values right-aligned."""
    width = max(len(pair[0]) for pair in pairs)
    value_width = max(len(str(pair[1])) for pair in pairs)
    return [(f"  {pair[0].ljust(width)}  {str(pair[1]).rjust(value_width)}  "
             f"{pair[2] if len(pair) > 2 else ''}").rstrip() for pair in pairs]
