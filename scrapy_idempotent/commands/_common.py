"""What the ``scrapy idempotent`` sub-commands share: finding and opening the crawl's
database as the scheduler would (:func:`open_crawl_store`), what a sub-command is handed
(:class:`Opened`), printing a report as text or JSON, and the text helpers of the tables."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from .. import scrapy_compat
from ..config import IdempotentConfig, resolve_database, store_options
from ..exceptions import IdempotentError
from ..store import CrawlIdentity, open_store
from ..store.registry import redacted, sqlite_path

if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterator, Sequence

    from ..store.base import FrontierStore, SchemaInfo, StoredRecord

#: What ``failed`` and ``rejects`` list without ``--limit``.
FAILED_LIMIT = 50
_PAGE = 1000
_MESSAGE_WIDTH = 80

#: :func:`~scrapy_idempotent.workers.worker_state` -> how the tables say it.
WORKER_STATES = {
    "alive": "running on this host",
    "dead": "dead: process gone",
    "other host": "on another host",
    "other namespace": "on this host name, in another PID namespace (container) or of an "
                       "older release",
    "unknown": "unknown worker id",
}


class UnknownSpider(IdempotentError):
    """No spider given in a project of several, an unknown spider, or no project at all."""


@dataclass
class Opened:
    """What a sub-command's ``run(opened, opts)`` is handed: the open store, its name as
    shown (``path``, a URL's password redacted), its schema, the crawl's config, the settings
    it was read from (the command's, with the spider's own applied) and the command's
    settings as given (``command_settings``)."""

    store: FrontierStore
    path: str
    info: SchemaInfo
    config: IdempotentConfig
    settings: Any
    command_settings: Any


@dataclass
class Located:
    """The store of a crawl, not opened yet, with what :class:`Opened` carries of it."""

    store: FrontierStore
    path: str
    identity: CrawlIdentity | None
    config: IdempotentConfig
    settings: Any


def open_crawl_store(command_settings: Any, spider: str | None, db: str | None) -> Located:
    """The store of ``--db`` or of the spider's settings, as the scheduler resolves it,
    and the identity of that spider's crawl (None with ``--db``). Without a spider name,
    the only spider of the project. Raises :class:`UnknownSpider` when there is no spider
    to name the database."""
    settings = command_settings.copy()
    if db is not None:
        config = IdempotentConfig.from_settings(
            settings, SimpleNamespace(name=spider or "spider"))  # type: ignore[arg-type]
        # a relative --db is taken as a relative IDEMPOTENT_DATABASE is: from the project
        # directory (else the current one), and shown absolute
        database = resolve_database(db, spider or "spider")
        return Located(open_store(database, **store_options(settings)), redacted(database),
                       None, config, settings)
    from scrapy.utils.project import inside_project

    if not inside_project():
        if spider is None or settings.get("IDEMPOTENT_DATABASE") in (None, ""):
            raise UnknownSpider(
                f"not inside a Scrapy project (no scrapy.cfg in {os.getcwd()} or above): "
                "run it in the project's directory, or give the database with --db PATH")
        named: Any = SimpleNamespace(name=spider)
        config = IdempotentConfig.from_settings(settings, named)
        return _located(config, settings, spider)
    loader = scrapy_compat.spider_loader(settings)
    known = sorted(loader.list())
    spidercls: Any
    if spider is None:
        if len(known) != 1:
            raise UnknownSpider(
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
            raise UnknownSpider(
                f"unknown spider {spider!r}; the spiders of this project: "
                f"{', '.join(known) or 'none'} (no database at {path} either)") from None
    else:
        spidercls.update_settings(settings)
        config = IdempotentConfig.from_settings(settings, spidercls)
    return _located(config, settings, spider)


def _located(config: IdempotentConfig, settings: Any, spider: str) -> Located:
    return Located(open_store(config.database, **config.store_options()),
                   redacted(config.database), crawl_identity(settings, spider, config), config,
                   settings)


def crawl_identity(settings: Any, spider: str, config: IdempotentConfig) -> CrawlIdentity:
    """The identity a crawl of ``spider`` with these settings gives its database (as the
    scheduler builds it)."""
    return CrawlIdentity(project=str(settings.get("BOT_NAME") or ""), spider=spider,
                         source=config.source)


def print_report(opts: argparse.Namespace, report: dict[str, Any], lines: list[str]) -> None:
    """``report`` as one JSON document with ``--json``, else ``lines``."""
    if opts.json:
        print(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        print("\n".join(lines))


def request_filters(opts: argparse.Namespace) -> dict[str, Any]:
    """``--kind`` and ``--url`` as the store's filter arguments."""
    return {"kinds": opts.kind, "url_glob": opts.url_glob, "url_regex": opts.url_regex}


def describe_filters(opts: argparse.Namespace) -> str:
    parts = []
    if opts.kind:
        parts.append(f"of kind {' or '.join(opts.kind)}")
    if opts.url is not None:
        parts.append(f"with URL matching {opts.url!r}")
    return (" " + " ".join(parts)) if parts else ""


def all_records(store: FrontierStore, filters: dict[str, Any]) -> Iterator[StoredRecord]:
    """Every matching record, one page at a time (memory does not grow with the table)."""
    after = None
    while True:
        page = store.records_page(after=after, limit=_PAGE, **filters)
        yield from page
        if len(page) < _PAGE:
            return
        after = page[-1].record_id


def plural(count: int, word: str, words: str | None = None) -> str:
    """``count`` and the word for it: ``1 run``, ``2 runs`` (``words`` when the plural is not
    ``word`` + ``s``)."""
    return f"{count} {word if count == 1 else (words or word + 's')}"


def tally(values: Sequence[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


def iso(seconds: object) -> str | None:
    """Unix seconds as ISO 8601 UTC to the second (``2026-05-04T10:00:00Z``), None as None.
    Truncated, so ``--since`` with a time shown here includes the record shown with it."""
    if seconds is None:
        return None
    assert isinstance(seconds, (int, float))
    moment = datetime.fromtimestamp(seconds, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def expiry(seconds: float) -> str:
    return f"in {seconds:.0f} s" if seconds >= 0 else f"expired {-seconds:.0f} s ago"


def shorten(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MESSAGE_WIDTH else text[:_MESSAGE_WIDTH - 3] + "..."


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *,
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


def pairs(rows: Sequence[tuple[Any, ...]]) -> list[str]:
    """``(label, value[, note])`` as aligned lines, values right-aligned."""
    width = max(len(row[0]) for row in rows)
    value_width = max(len(str(row[1])) for row in rows)
    return [(f"  {row[0].ljust(width)}  {str(row[1]).rjust(value_width)}  "
             f"{row[2] if len(row) > 2 else ''}").rstrip() for row in rows]
