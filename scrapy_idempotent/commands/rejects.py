"""``scrapy idempotent rejects``: items that could not become records (type, reason, page,
time; ``--limit``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ._common import FAILED_LIMIT, iso, print_report, shorten, table

if TYPE_CHECKING:
    import argparse

    from ._common import Opened

DESCRIPTION = "items that could not become records, with type, reason, page and time"


def run(opened: Opened, opts: argparse.Namespace) -> int:
    store = opened.store
    limit = FAILED_LIMIT if opts.limit is None else opts.limit
    total = store.count_rejects()
    rows = store.rejects(limit=limit or None)
    rejects = [{**dataclasses.asdict(row), "created_at": iso(row.created_at),
                "retried_at": iso(row.retried_at)} for row in rows]
    report = {"database": opened.path, "total": total, "listed": len(rejects),
              "rejects": rejects}
    lines = [f"{total} rejected item{'s' * (total != 1)}"
             + (f", the latest {len(rejects)} listed (--limit 0 lists all)"
                if len(rejects) < total else "")]
    if rejects:
        lines += table(
            ["run", "rejected at", "type", "page", "reason", "put back"],
            [[r["run_id"], r["created_at"], r["item_type"], r["page_url"] or "-",
              shorten(str(r["reason"])), r["retried_at"] or "-"] for r in rejects])
        lines.append("Fix the spider or IDEMPOTENT_NATURAL_KEYS, then `scrapy idempotent "
                     "retry --rejects` puts their pages back for the next crawl.")
    print_report(opts, report, lines)
    return 0
