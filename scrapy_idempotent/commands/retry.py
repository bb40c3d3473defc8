"""``scrapy idempotent retry``: failed requests (``--kind``, ``--url``) back to pending in one
transaction, so the next crawl fetches them; with ``--rejects`` the pages of the last run's
rejected items."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ._common import describe_filters, plural, print_report, request_filters

if TYPE_CHECKING:
    import argparse

    from ._common import Opened

DESCRIPTION = ("put failed requests (or with --rejects the pages of rejected items) back to "
               "pending; the next crawl fetches them")


def run(opened: Opened, opts: argparse.Namespace) -> int:
    if opts.rejects:
        _retry_rejects(opened, opts)
        return 0
    result = opened.store.retry_failed(**request_filters(opts))
    retried = result.retried
    report = {"database": opened.path, **dataclasses.asdict(result)}
    described = describe_filters(opts)
    if not retried:
        lines = [f"No failed request{described}: nothing changed."]
    else:
        run_id = result.run_id
        how = (f"run {run_id} reopened: the next crawl resumes it" if result.reopened
               else f"run {run_id} is unfinished: the next crawl resumes it")
        lines = [f"Put {plural(retried, 'failed request')}{described} back to pending; "
                 f"{how} and fetches {'it' if retried == 1 else 'them'} (unless "
                 "IDEMPOTENT_RUN_MODE is fresh)."]
    print_report(opts, report, lines)
    return 0


def _retry_rejects(opened: Opened, opts: argparse.Namespace) -> None:
    result = opened.store.retry_rejects()
    pages, without = result.pages, result.without_page
    report = {"database": opened.path, **dataclasses.asdict(result)}
    run_id = result.run_id
    if not pages:
        lines = [f"No page of a rejected item of run {run_id} to put back: nothing changed."
                 if run_id is not None else "No run yet: nothing changed."]
    else:
        how = (f"run {run_id} reopened: the next crawl resumes it" if result.reopened
               else f"run {run_id} is unfinished: the next crawl resumes it")
        lines = [f"Put {plural(pages, 'page')} of {plural(result.rejects, 'rejected item')} "
                 f"back to pending; {how} and fetches {'it' if pages == 1 else 'them'} again "
                 "(unless IDEMPOTENT_RUN_MODE is fresh)."]
    if without:
        lines.append(f"{plural(without, 'rejected item')} of run {run_id} "
                     f"{'have' if without != 1 else 'has'} no page in the frontier (from "
                     "start(), or the page is still pending): nothing to put back.")
    print_report(opts, report, lines)
