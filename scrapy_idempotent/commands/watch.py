"""``scrapy idempotent status --watch [SECONDS]``: a live view of the crawl in the terminal,
redrawn in place every SECONDS (default 2) from :meth:`~.FrontierStore.crawl_metrics`, with
rates per minute measured between two redraws. Runs until Ctrl+C (exit code 0)."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from ._common import pairs, table

if TYPE_CHECKING:
    from ..store.base import CrawlMetrics, FrontierStore

#: Clear the screen and go home (ANSI): the view is redrawn in place.
CLEAR = "\x1b[H\x1b[2J"
#: The current run's counters shown with a rate per minute.
_RATED = ("done", "failed", "redirected", "records_inserted", "records_updated",
          "records_unchanged", "records_stale", "rejects", "leases_reclaimed", "leases_lost")


def watch(store: FrontierStore, path: str, seconds: float) -> int:
    previous: tuple[float, dict[str, float]] | None = None
    try:
        while True:
            metrics = store.crawl_metrics()
            now = time.monotonic()
            figures = _figures(metrics)
            sys.stdout.write(CLEAR + "\n".join(view(metrics, path, figures, previous, now))
                             + "\n")
            sys.stdout.flush()
            previous = (now, figures)
            time.sleep(seconds)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 0


def _figures(m: CrawlMetrics) -> dict[str, float]:
    run = m.runs[-1] if m.runs else None
    figures = {name: float(getattr(run, name)) if run else 0.0 for name in _RATED}
    figures["downloads"] = float(m.summary.downloads)
    figures["downloaded_again"] = float(m.summary.downloaded_again)
    return figures


def view(m: CrawlMetrics, path: str, figures: dict[str, float],
         previous: tuple[float, dict[str, float]] | None, now: float) -> list[str]:
    """The lines of one redraw; rates from ``previous`` (monotonic time, figures), "-" on
    the first."""
    def rate(name: str) -> str:
        if previous is None or now <= previous[0]:
            return "-"
        return f"{(figures[name] - previous[1][name]) / (now - previous[0]) * 60:.0f}/min"

    run = m.runs[-1] if m.runs else None
    if run is None:
        head = "no run yet"
    else:
        end = run.finished_at if run.finished_at is not None else m.read_at
        state = f"finished ({run.reason})" if run.finished_at is not None else "running"
        head = f"run {run.run_id}, {state}, {_duration(end - run.started_at)}"
    lines = [f"scrapy idempotent status --watch  {path}",
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}  {head}  (Ctrl+C to stop)", ""]
    lines += ["Frontier", *pairs([(state, n) for state, n in m.requests.items() if n]
                                 or [("empty", 0)])]
    lines += ["", "This run", *table(
        ["", "total", "rate"],
        [[label, int(figures[name]), rate(name)] for name, label in (
            ("done", "pages done"), ("failed", "pages failed"), ("redirected", "redirected"),
            ("records_inserted", "records inserted"), ("records_updated", "records updated"),
            ("records_unchanged", "records unchanged"), ("records_stale", "records stale"),
            ("rejects", "items rejected"), ("leases_reclaimed", "leases reclaimed"),
            ("leases_lost", "leases lost"), ("downloads", "downloads (all runs)"),
            ("downloaded_again", "downloaded again (all runs)"))])]
    lines += ["", f"Workers  {len(m.live_workers)} alive, {m.summary.expired_leases} "
                  f"expired lease{'s' * (m.summary.expired_leases != 1)}"]
    lines += table(["worker", "leases", "lease expires in"],
                   [[h.worker, h.leases, f"{h.leased_until - m.read_at:.0f} s"]
                    for h in m.leases]) if m.leases else ["  no leases held"]
    beats = {w: at for w, at in m.heartbeats.items() if w in m.live_workers}
    if beats:
        lines += ["", "Heartbeats", *pairs([(w, f"{max(0.0, m.read_at - at):.0f} s ago")
                                            for w, at in sorted(beats.items())])]
    if m.outbox_backlog:
        lines += ["", "Outbox pending", *table(
            ["target", "entries", "oldest"],
            [[target, b.entries, _duration(m.read_at - b.oldest_at)]
             for target, b in sorted(m.outbox_backlog.items())])]
    return lines


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else \
        f"{rest // 60}m{rest % 60:02d}s"
