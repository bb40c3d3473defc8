"""``scrapy idempotent migrate``: copy the crawl into another, empty database (``--to``),
e.g. from SQLite to PostgreSQL, to continue it there."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .. import workers
from ..config import store_options
from ..exceptions import StoreError
from ..store import CrawlIdentity, open_store
from ..store.registry import redacted
from ._common import iso, plural, print_report

if TYPE_CHECKING:
    import argparse

    from ._common import Opened

DESCRIPTION = ("copy the crawl (frontier, records, runs, rejects) into another, empty database "
               "(--to URL), e.g. from SQLite to PostgreSQL, to continue it there")

#: The tables copied -> how the summary counts their rows (singular, plural).
_ROW_WORDS = {"runs": ("run", "runs"), "requests": ("request", "requests"),
              "records": ("record", "records"), "rejects": ("reject", "rejects"),
              "responses": ("response", "responses")}


def run(opened: Opened, opts: argparse.Namespace) -> int:
    """Copy the crawl into ``--to`` (opened as a crawl of the same identity would open
    it, created if needed, refused when it holds another crawl or this one already), in
    one transaction there. The source is only read, under its write lock from the check
    until the target has committed (:meth:`~.FrontierStore.frozen`): one consistent
    state is copied, and nothing lands in the source meanwhile. Refused while a crawl of
    the source runs (a session not ended of a live worker, or an unexpired lease of a worker
    not known dead): stop every crawl of it first. The leases of a killed crawl of this host
    (its process gone) do not wait for their expiry: they arrive pending, as the next crawl
    would take them back."""
    if opts.undo:
        return undo(opened, opts)
    store, path = opened.store, opened.path
    with store.frozen():
        now = time.time()
        running = store.live_workers()
        if running:
            raise StoreError(
                f"{path} is in use by the crawl of {', '.join(running[:3])}"
                f"{' and others' if len(running) > 3 else ''} (a session that has not "
                "ended, of a process that runs): stop every crawl of it before migrating")
        live = [h for h in store.lease_holders()
                if h.leased_until >= now and not workers.worker_is_dead(h.worker)]
        if live:
            raise StoreError(
                f"{path} has leases held by {', '.join(h.worker for h in live[:3])} until "
                f"{iso(max(h.leased_until for h in live))}: stop every crawl of it before "
                "migrating (a graceful stop releases its leases at once)")
        meta = store.meta()
        identity = (CrawlIdentity(project=meta.get("project", ""), spider=meta["spider"],
                                  source=meta.get("source", ""))
                    if meta.get("spider") else None)
        target = open_store(opts.to, **store_options(opened.command_settings))
        try:
            target.open(fingerprinter=meta.get("fingerprinter", ""), identity=identity)
            written = target.load(store.dump())
        finally:
            target.close()
        marked = store.mark_migrated(redacted(opts.to))
    moved = {table: written.get(table, 0) for table in
             ("runs", "requests", "records", "rejects", "responses")}
    report = {"database": path, "to": redacted(opts.to), "rows": moved, "marked": marked}
    print_report(opts, report, [
        f"Migrated {path} to {redacted(opts.to)}: "
        + ", ".join(plural(n, _ROW_WORDS[table][0], _ROW_WORDS[table][1])
                    for table, n in moved.items())
        + "; set IDEMPOTENT_DATABASE to it to continue the crawl there"
        + (f" (a crawl of {path} is refused from now on; `migrate --undo` allows it again)"
           if marked else "")])
    return 0


def undo(opened: Opened, opts: argparse.Namespace) -> int:
    """``migrate --undo``: forget that the database was migrated, so crawls of it are
    allowed again (the copy is left as it is)."""
    to = opened.store.unmark_migrated()
    if to is None:
        raise StoreError(f"{opened.path} was not migrated (no mark of `scrapy idempotent "
                         "migrate` in it): nothing to undo")
    print_report(opts, {"database": opened.path, "was_migrated_to": to}, [
        f"{opened.path} is no longer marked migrated to {to}: crawls of it are allowed again "
        f"(the copy in {to} is left as it is; crawling both makes two copies that diverge)"])
    return 0
