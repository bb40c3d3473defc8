"""``scrapy idempotent failed``: failed requests with URL, error kind, message and attempts
(``--kind``, ``--url``, ``--limit``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ._common import (
    FAILED_LIMIT,
    describe_filters,
    iso,
    print_report,
    request_filters,
    shorten,
    table,
)

if TYPE_CHECKING:
    import argparse

    from ._common import Opened

DESCRIPTION = "failed requests with URL, error kind, message and attempts"


def run(opened: Opened, opts: argparse.Namespace) -> int:
    store = opened.store
    filters = request_filters(opts)
    limit = FAILED_LIMIT if opts.limit is None else opts.limit
    total = store.count_failed(**filters)
    rows = store.failed_requests(**filters, limit=limit or None)
    failed = [{**dataclasses.asdict(row), "finished_at": iso(row.finished_at)}
              for row in rows]
    report = {"database": opened.path, "matching": total, "listed": len(failed),
              "failed": failed}
    described = describe_filters(opts)
    lines = [f"{total} failed request{'s' * (total != 1)}{described}"
             + (f", the latest {len(failed)} listed (--limit 0 lists all)"
                if len(failed) < total else "")]
    if failed:
        lines += table(
            ["kind", "attempts", "failed at", "url", "message"],
            [[r["error_kind"] or "-", r["attempts"], r["finished_at"] or "-", r["url"],
              shorten(str(r["error_message"] or ""))] for r in failed])
    print_report(opts, report, lines)
    return 0
