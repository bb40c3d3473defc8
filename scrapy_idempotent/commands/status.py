"""``scrapy idempotent status``: where the crawl stands: runs, frontier by state, leases and
their owners, records, outbox deliveries by target and state, failures by kind, repeated
requests, totals over all runs."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from ..exceptions import StoreError
from ..outbox import target_label
from ..workers import worker_state
from ._common import WORKER_STATES, expiry, iso, pairs, print_report, table, tally

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

    from ..store.base import (
        EngineSetting,
        FrontierStore,
        RunSummary,
        SchemaInfo,
        SessionInfo,
    )
    from ._common import Opened

DESCRIPTION = "where the crawl stands: runs, frontier, leases, records, failures"


def run(opened: Opened, opts: argparse.Namespace) -> int:
    if opts.watch is not None:
        from .watch import watch

        return watch(opened.store, opened.path, opts.watch)
    if opts.chart is not None:
        from .chart import write_chart

        return write_chart(opened.store, opened.path, opts.chart)
    engine = opened.store.engine_settings()
    report = _status_report(opened.store, opened.path, opened.info, engine)
    print_report(opts, report, [] if opts.json else _status_lines(report, engine))
    return 0


def _status_report(store: FrontierStore, path: str, info: SchemaInfo,
                   engine: Sequence[EngineSetting]) -> dict[str, Any]:
    """What ``status`` reports (its ``--json`` form): the database, its runs, frontier,
    leases, download slots, records, outbox, failures, repeated requests and totals."""
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
        "created_at": iso(float(meta["created_at"])) if "created_at" in meta else None,
        "fingerprinter": meta.get("fingerprinter"),
        "run": current,
        "runs": run_rows,
        "frontier": {**counts, "total": sum(counts.values())},
        "leases": _lease_report(store),
        "slots": _slot_report(store),
        "records": {
            "stored": records,
            "inserted": current["records_inserted"] if current else 0,
            "updated": current["records_updated"] if current else 0,
            "unchanged": current["records_unchanged"] if current else 0,
            "rejected": current["rejects"] if current else 0,
        },
        "failures": store.failure_counts(),
        "outbox": store.outbox_counts(),
        "revisits": _revisit_report(store),
        "repeated": _repeated_report(store, current, records),
        "totals": _totals_report(runs, run_rows, [e for run_ends in ends.values()
                                                  for e in run_ends]),
    }


def _lease_report(store: FrontierStore) -> list[dict[str, Any]]:
    now = time.time()
    return [{"worker": h.worker, "leases": h.leases, "leased_until": iso(h.leased_until),
             "expires_in_seconds": round(h.leased_until - now, 1),
             "worker_state": worker_state(h.worker)}
            for h in store.lease_holders()]


def _slot_report(store: FrontierStore) -> list[dict[str, Any]]:
    """The download slots with requests leased or pending, or paused (see the politeness
    docs): the crawl's per-site limits as every worker keeps them."""
    now = time.time()
    try:
        slots = store.slots()
    except StoreError:  # a database of an earlier schema, read as it is: no slots yet
        return []
    return [{"slot": s.slot, "leased": s.leased, "pending": s.pending,
             "paused_until": iso(s.paused_until) if s.paused_until > now else None,
             "paused_for_seconds": round(max(s.paused_until - now, 0.0), 1),
             "backoffs": s.backoffs, "crawl_delay": s.crawl_delay}
            for s in slots if s.slot]


def _revisit_report(store: FrontierStore) -> dict[str, Any] | None:
    """The pages kept for conditional requests and adaptive revisits (None: none kept)."""
    try:
        revisits = store.revisits()
    except StoreError:  # a database of an earlier schema, read as it is
        return None
    if revisits is None or not revisits.pages:
        return None
    return {
        "pages": revisits.pages, "scheduled": revisits.scheduled, "due": revisits.due,
        "next_due_at": iso(revisits.next_due_at) if revisits.next_due_at else None,
        "run_id": revisits.run_id, "fetched": revisits.fetched,
        "not_modified": revisits.not_modified, "not_due": revisits.not_due,
        "requests_saved": revisits.requests_saved, "bytes_saved": revisits.bytes_saved,
    }


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
        "crawls_by_end": tally(all_ends),
        **{name: sum(int(r[name]) for r in run_rows) for name in _RUN_COUNTERS},
    }


def _status_lines(report: dict[str, Any], engine: Sequence[EngineSetting]) -> list[str]:
    """The text form of :func:`_status_report`, one section after the other."""
    current = report["run"]
    run_label = f"in run {current['run_id']}" if current else "in this run"
    lines = _status_head(report, engine)
    for section in (_runs_section(report["runs"]), _frontier_section(report["frontier"]),
                    _leases_section(report["leases"]), _slots_section(report["slots"]),
                    _records_section(report["records"], run_label),
                    _revisits_section(report["revisits"]),
                    _outbox_section(report["outbox"]), _failures_section(report["failures"]),
                    _repeated_section(report["repeated"], run_label),
                    _totals_section(report["totals"])):
        if section:
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
    return ["Runs", *table(
        ["run", "started", "finished", "state", "crawls", "leased", "done", "failed",
         "redirected", "inserted", "updated", "unchanged", "stale", "rejects", "reclaimed",
         "lost"],
        [[r["run_id"], r["started_at"], r["finished_at"] or "-", r["state"],
          r["crawls"], r["leased"], r["done"], r["failed"], r["redirected"],
          r["records_inserted"], r["records_updated"], r["records_unchanged"],
          r["records_stale"], r["rejects"], r["leases_reclaimed"], r["leases_lost"]]
         for r in run_rows])]


def _frontier_section(frontier: dict[str, int]) -> list[str]:
    return ["Frontier (requests by state)",
            *table(["state", "requests"], [[k, v] for k, v in frontier.items()])]


def _leases_section(leases: list[dict[str, Any]]) -> list[str]:
    if not leases:
        return ["Leases", "  none"]
    return ["Leases", *table(
        ["worker", "leases", "until", "worker state"],
        [[lease["worker"], lease["leases"],
          f"{lease['leased_until']} ({expiry(lease['expires_in_seconds'])})",
          WORKER_STATES[lease["worker_state"]]] for lease in leases])]


def _slots_section(slots: list[dict[str, Any]]) -> list[str]:
    """The busiest download slots (shown only while some have work or are paused)."""
    if not slots:
        return []
    shown = slots[:20]
    rows = [[slot["slot"], slot["leased"], slot["pending"],
             f"{slot['paused_until']} ({slot['paused_for_seconds']} s, backoff "
             f"{slot['backoffs']})" if slot["paused_until"] else "",
             slot["crawl_delay"] or ""] for slot in shown]
    more = [f"  ... and {len(slots) - len(shown)} more"] if len(slots) > len(shown) else []
    return ["Download slots (whole crawl)", *table(
        ["slot", "leased", "pending", "paused until", "crawl delay"], rows), *more]


def _records_section(rec: dict[str, Any], run_label: str) -> list[str]:
    return ["Records", *pairs([
        ("stored", rec["stored"]), (f"inserted {run_label}", rec["inserted"]),
        (f"updated {run_label}", rec["updated"]),
        (f"unchanged {run_label}", rec["unchanged"]),
        (f"rejected {run_label}", rec["rejected"])])]


def _revisits_section(rev: dict[str, Any] | None) -> list[str]:
    """Conditional requests and adaptive revisits (shown once pages are kept for them)."""
    if rev is None:
        return []
    run = f"in run {rev['run_id']}"
    return ["Revisits (pages kept for conditional requests)", *pairs([
        ("pages kept", rev["pages"]),
        ("with a revisit time", rev["scheduled"], "(pages with records, adaptive revisits)"),
        ("due now", rev["due"]),
        ("next due", rev["next_due_at"] or "-"),
        (f"downloaded {run}", rev["fetched"]),
        (f"unchanged (304) {run}", rev["not_modified"]),
        (f"not due {run}", rev["not_due"], "(no request sent)"),
        (f"requests saved {run}", rev["requests_saved"]),
        (f"bytes saved {run}", rev["bytes_saved"],
         "(the bodies not downloaded, at their last size)"),
    ])]


def _outbox_section(outbox: dict[str, Any]) -> list[str]:
    title = "Outbox (announcements of record changes, by target)"
    if not outbox:
        return [title, "  none (no IDEMPOTENT_OUTBOX_TARGETS when records changed)"]
    return [title, *table(["target", "pending", "delivered", "failed"],
                           [[target_label(target), n["pending"], n["delivered"],
                             n["failed"]] for target, n in outbox.items()])]


def _failures_section(failures: dict[str, int]) -> list[str]:
    if not failures:
        return ["Failures by kind", "  none"]
    return ["Failures by kind",
            *table(["kind", "requests"], [[k or "-", v] for k, v in failures.items()])]


def _repeated_section(rep: dict[str, Any], run_label: str) -> list[str]:
    lines = ["Repeated requests", *pairs([
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
        lines += table(["attempts", "state", "url"],
                        [[r["attempts"], r["state"], r["url"]] for r in rep["top"]])
    return lines


def _totals_section(totals: dict[str, Any]) -> list[str]:
    crawls_by_end = ", ".join(f"{n} {end}" for end, n in totals["crawls_by_end"].items())
    return [f"Totals over {totals['runs']} run{'s' * (totals['runs'] != 1)}", *pairs([
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


def _session_end(session: SessionInfo) -> str:
    """How a crawl process ended: its close reason, or ``running``/``killed``/``unknown``
    when it never closed."""
    if session.ended_at is not None:
        return session.reason or "closed"
    state = worker_state(session.worker)
    return {"alive": "running", "dead": "killed"}.get(state, "not closed")


def _run_report(run: RunSummary, ends: list[str]) -> dict[str, Any]:
    report: dict[str, Any] = {**dataclasses.asdict(run), "started_at": iso(run.started_at),
                              "finished_at": iso(run.finished_at),
                              "crawls": len(ends), "crawls_by_end": tally(ends)}
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
