"""``scrapy idempotent <command>``: see where a crawl stands, why requests failed, put them
back, get the records out and check the database, without opening SQLite by hand.

Registered as a Scrapy command through the ``scrapy.commands`` entry point (``setup.cfg``);
Scrapy has no sub-commands, so the first argument names one, and each is a module of this
package (as Scrapy's own commands are modules of ``scrapy.commands``), with its
``DESCRIPTION`` and ``run(opened, opts)`` returning the exit code (``metrics``, which
waits for a database not created yet, has ``serve(located, settings, opts)`` instead);
``_common`` opens the store and prints:

* ``status``: runs, frontier by state, leases and their owners, records, outbox deliveries
  by target and state, failures by kind, repeated requests, totals over all runs;
* ``failed``: failed requests with URL, error kind, message and attempts;
* ``retry``: failed requests back to pending (one transaction), so the next crawl fetches them;
  with ``--rejects`` the pages of the last run's rejected items;
* ``rejects``: items that could not become records (type, reason, page, time);
* ``export``: records to JSON Lines, CSV or JSON through Scrapy's item exporters;
* ``check``: integrity, schema version, WAL mode, leases of dead workers, impossible states;
  exit code 1 for a problem that needs a person (what heals itself, such as the leases of a
  killed crawl, is reported and exits 0);
* ``deliver``: sends the outbox's pending announcements to the configured targets (what a
  killed crawl, or a receiver that was down, left), for at most
  ``IDEMPOTENT_OUTBOX_DRAIN_SECONDS``; exit code 1 when some are left;
* ``migrate``: copy the crawl into another, empty database (``--to``), e.g. from SQLite to
  PostgreSQL, to continue it there;
* ``rekey``: re-derive every record's ID from its stored data under the current settings
  (a natural key changed, an item class renamed), merging records that now share an ID, in
  one transaction; ``--dry-run`` prints what would change;
* ``metrics``: serves the whole crawl's figures for Prometheus (``--listen HOST:PORT``),
  read from the database at each scrape (``idempotent_store_up 0`` until it exists).

The database is the one the scheduler uses for ``SPIDER`` in the current project
(``IDEMPOTENT_DATABASE``, ``{spider}`` replaced, default ``.scrapy/idempotent/<spider>.sqlite3``
in the project data dir), or ``--db PATH`` anywhere. Every command but ``retry``,
``deliver`` and ``rekey`` opens it read-only; none creates or migrates it, and all but
``metrics`` stop when it does not exist. ``--json`` prints one JSON document for scripts.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING

from scrapy.commands import ScrapyCommand
from scrapy.exceptions import UsageError

from .. import scrapy_compat
from ..exceptions import IdempotentError, StoreError
from ..store.base import SchemaInfo
from . import check, deliver, export, failed, metrics, migrate, rejects, rekey, retry, status
from ._common import FAILED_LIMIT, Opened, UnknownSpider, open_crawl_store
from .export import FORMATS

if TYPE_CHECKING:
    import argparse
    from types import ModuleType

__all__ = ["SUBCOMMANDS", "Command"]

#: Sub-command -> its module (``DESCRIPTION``, ``run(opened, opts) -> exit code``).
_MODULES: dict[str, ModuleType] = {
    "status": status, "failed": failed, "retry": retry, "rejects": rejects, "export": export,
    "check": check, "deliver": deliver, "migrate": migrate, "rekey": rekey,
    "metrics": metrics,
}

#: Sub-command -> one-line description.
SUBCOMMANDS: dict[str, str] = {name: module.DESCRIPTION for name, module in _MODULES.items()}

#: Sub-commands that write to the database (``migrate`` locks the source it copies, writing
#: nothing); the others open it read-only.
_WRITING = ("retry", "deliver", "migrate", "rekey")

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
    "undo": ("migrate",),
    "dry_run": ("rekey",),
    "keep_file_paths": ("rekey",),
    "listen": ("metrics",),
    "watch": ("status",),
    "chart": ("status",),
}


class Command(ScrapyCommand):
    """The ``idempotent`` Scrapy command; see the module docstring."""

    requires_project = False
    requires_crawler_process = False

    def syntax(self) -> str:
        return f"<{'|'.join(SUBCOMMANDS)}> [SPIDER] [options]"

    def short_desc(self) -> str:
        return "Inspect and operate a scrapy_idempotent frontier: " + ", ".join(SUBCOMMANDS)

    def long_desc(self) -> str:
        commands = "; ".join(f"{name}: {desc}" for name, desc in SUBCOMMANDS.items())
        return (
            f"Operator tools for a scrapy_idempotent frontier database. {commands}. The "
            "database is the one of SPIDER in the current project (IDEMPOTENT_DATABASE), or "
            "--db PATH. Only retry, deliver and rekey write to it."
        )

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        super().add_options(parser)
        group = parser.add_argument_group("Database and output")
        group.add_argument("--db", metavar="PATH",
                           help="the frontier database, a path or a database URL (instead of a "
                                "spider name); a relative path is from the project directory, "
                                "as in IDEMPOTENT_DATABASE")
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
                           help=f"failed, rejects: list at most N (default {FAILED_LIMIT}; "
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
        group.add_argument("--undo", action="store_true", default=None,
                           help="forget that the database was migrated: crawls of it are "
                                "allowed again")
        group = parser.add_argument_group("rekey")
        group.add_argument("--dry-run", action="store_true", default=None,
                           help="print what would change (new IDs, merges, files), change "
                                "nothing")
        group.add_argument("--keep-file-paths", action="store_true", default=None,
                           help="re-identify records whose files are in a remote files store "
                                "(S3, GCS, FTP) and keep their paths")
        group = parser.add_argument_group("status")
        group.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                           help="a live view redrawn in place every SECONDS (default 2), with "
                                "rates per minute, until Ctrl+C")
        group.add_argument("--chart", metavar="OUT.html",
                           help="draw the latest run's pages done, failed, repeats and records "
                                "changed per minute into a self-contained HTML page")
        group = parser.add_argument_group("metrics")
        group.add_argument("--listen", metavar="HOST:PORT",
                           help=f"where to serve /metrics (default {metrics.LISTEN}; port 0: "
                                "any free port, printed at start)")

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
        if subcommand == "migrate" and opts.undo and opts.to:
            raise UsageError("migrate --undo takes no --to (it forgets the mark of a "
                             "migration in --db)")
        if subcommand == "migrate" and not opts.to and not opts.undo:
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
        opts.since_time = export.parse_time(opts.since) if opts.since is not None else None
        opts.spider = args[1] if len(args) > 1 else None
        if opts.watch is not None and (opts.watch <= 0 or opts.json):
            raise UsageError("--watch takes a number of seconds > 0, and no --json")
        if subcommand == "metrics":
            metrics.listen_address(opts.listen or metrics.LISTEN)

    def run(self, args: list[str], opts: argparse.Namespace) -> None:
        subcommand = args[0]
        assert self.settings is not None
        try:
            located = open_crawl_store(self.settings, args[1] if len(args) > 1 else None,
                                       opts.db)
            store, path = located.store, located.path
            if subcommand == "metrics":  # serves before the database exists (store_up 0)
                store.close()
                self.exitcode = metrics.serve(located, self.settings, opts)
                return
            try:
                # only retry and deliver write (and migrate locks the source it copies,
                # writing nothing): they refuse, untouched, a file that is not ours or
                # another crawl's (known from the spider's settings; with --db, only the
                # former)
                info = store.open_existing(readonly=subcommand not in _WRITING,
                                           identity=located.identity)
                if subcommand == "rekey" and info.version < info.supported:
                    # the schema migrated forward as a crawl's open would (no data changes):
                    # the records of an older release are what rekey is for
                    fingerprinter = store.meta().get("fingerprinter", "")
                    store.close()
                    store.open(fingerprinter=fingerprinter, identity=located.identity)
                    info = SchemaInfo(version=info.supported, supported=info.supported)
                if subcommand != "check" and not info.current:
                    raise StoreError(
                        f"{path} has schema version {info.version}; this "
                        f"scrapy_idempotent reads version {info.supported}"
                        " (a crawl migrates an older database; a newer one needs a newer "
                        "scrapy_idempotent)")
                opened = Opened(store=store, path=path, info=info, config=located.config,
                                settings=located.settings, command_settings=self.settings)
                self.exitcode = _MODULES[subcommand].run(opened, opts)
            finally:
                store.close()
        except UnknownSpider as exc:
            print(f"scrapy idempotent {subcommand}: {exc}", file=sys.stderr)
            self.exitcode = 2
        except IdempotentError as exc:
            print(f"scrapy idempotent {subcommand}: {exc}", file=sys.stderr)
            self.exitcode = 1
        except BrokenPipeError:  # the reader went away (| head): not an error of ours
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
