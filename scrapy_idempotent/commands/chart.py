"""``scrapy idempotent status --chart OUT.html``: a picture of the latest run: pages done,
pages failed, repeats and records inserted or changed, per minute, one self-contained HTML page
(inline SVG, no script, nothing fetched).

Drawn from the run's progress samples (:meth:`~.FrontierStore.samples`: the run's counters,
cumulative over every worker, stored every ``IDEMPOTENT_SAMPLE_SECONDS`` by the first worker to
reach the interval and at each worker's close), so every worker's part is in it, a killed
worker's too, at a cost that does not grow with the frontier. A run without samples (stored
by an older release, or with ``IDEMPOTENT_SAMPLE_SECONDS = 0``) is counted from the stored rows
instead (when each request finished, when each record last changed): a pass over the
frontier and the records."""

from __future__ import annotations

import html
import math
import time
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..store.base import FrontierStore, RunSummary, Sample

#: Series -> colour.
SERIES = {"pages done": "#2b7bb9", "pages failed": "#d62728", "repeats": "#ff7f0e",
          "records changed": "#2ca02c"}
_PAGE = 1000
_WIDTH, _HEIGHT, _LEFT, _BOTTOM, _TOP, _RIGHT = 900, 360, 60, 40, 20, 20

#: Per series: minute (unix seconds // 60) -> events in that minute.
Series = dict[str, Counter[int]]


def per_minute(store: FrontierStore) -> tuple[int | None, Series]:
    """The latest run's id and, per series, events per minute (minute: unix seconds // 60):
    from the run's samples when it has any, else counted from the stored rows."""
    runs = store.runs()
    if not runs:
        return None, {name: Counter() for name in SERIES}
    run = runs[-1]
    samples = store.samples(run.run_id)
    if samples:
        return run.run_id, from_samples(run, samples)
    return run.run_id, from_rows(store, run.run_id)


def _repeats(s: Sample | None) -> int:
    """Leases counted (claims, less those given back unstarted) and neither completed nor
    held any more: taken back from expired or dead workers, each is leased again, a repeat."""
    if s is None:
        return 0
    return s.leased - s.done - s.failed - s.redirected - s.in_flight


def from_samples(run: RunSummary, samples: list[Sample]) -> Series:
    """Each interval's growth of the counters, spread evenly over the minutes the interval
    ends in (the run's counters are 0 when the run starts)."""
    series: Series = {name: Counter() for name in SERIES}
    before: Sample | None = None
    since = run.started_at
    for name in SERIES:
        series[name][int(since // 60)] += 0
    for sample in samples:
        first, last = int(since // 60), int(sample.at // 60)
        minutes = range(first + 1, last + 1) if last > first else range(last, last + 1)
        growth = {
            "pages done": sample.done - (before.done if before else 0),
            "pages failed": sample.failed - (before.failed if before else 0),
            "records changed": sample.records_inserted + sample.records_updated
            - (before.records_inserted + before.records_updated if before else 0),
            "repeats": max(0, _repeats(sample) - _repeats(before)),
        }
        for name, n in growth.items():
            share, rest = divmod(max(0, n), len(minutes))
            for i, minute in enumerate(minutes):
                series[name][minute] += share + (1 if i < rest else 0)
        before, since = sample, max(since, sample.at)
    return series


def from_rows(store: FrontierStore, run_id: int) -> Series:
    """Counted from when each request of the run finished and each record last changed."""
    series: Series = {name: Counter() for name in SERIES}
    after: str | None = None
    while True:
        entries = store.entries(after=after, limit=_PAGE)
        if not entries:
            break
        for entry in entries:
            if entry.run_id != run_id or entry.finished_at is None:
                continue
            minute = int(entry.finished_at // 60)
            if entry.state == "done":
                series["pages done"][minute] += 1
            elif entry.state == "failed":
                series["pages failed"][minute] += 1
            if entry.attempts - entry.replays > 1:
                series["repeats"][minute] += 1
        after = entries[-1].key
    after = None
    while True:
        records = store.records_page(after=after, limit=_PAGE, changed_since_run=run_id)
        if not records:
            break
        for record in records:
            series["records changed"][int(record.last_changed // 60)] += 1
        after = records[-1].record_id
    return series


def render(run_id: int | None, series: Series, title: str) -> str:
    """The HTML page of :func:`per_minute`'s figures."""
    minutes = [m for counts in series.values() for m in counts]
    first, last = (min(minutes), max(minutes)) if minutes else (0, 0)
    span = max(1, last - first)
    top = _nice(max([n for counts in series.values() for n in counts.values()] or [1]))
    plot_w, plot_h = _WIDTH - _LEFT - _RIGHT, _HEIGHT - _TOP - _BOTTOM

    def x(minute: int) -> float:
        return _LEFT + (minute - first) / span * plot_w

    def y(n: float) -> float:
        return _TOP + plot_h - n / top * plot_h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
             f'viewBox="0 0 {_WIDTH} {_HEIGHT}" font-family="sans-serif" font-size="12">',
             f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" fill="#fafafa" '
             'stroke="#999"/>']
    for i in range(5):
        value = top * i / 4
        parts.append(f'<line x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{y(value):.1f}" '
                     f'y2="{y(value):.1f}" stroke="#ddd"/><text x="{_LEFT - 6}" '
                     f'y="{y(value) + 4:.1f}" text-anchor="end">{value:g}</text>')
    ticks = min(span, 6)
    for i in range(ticks + 1):
        minute = first + round(span * i / ticks)
        label = time.strftime("%H:%M", time.gmtime(minute * 60))
        parts.append(f'<text x="{x(minute):.1f}" y="{_TOP + plot_h + 18}" '
                     f'text-anchor="middle">{label}</text>')
    parts.append(f'<text x="{_LEFT + plot_w / 2}" y="{_HEIGHT - 4}" text-anchor="middle">'
                 'time (UTC), per minute</text>')
    for name, colour in SERIES.items():
        counts = series[name]
        points = " ".join(f"{x(m):.1f},{y(counts.get(m, 0)):.1f}"
                          for m in range(first, last + 1))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" '
                     f'points="{points}"><title>{html.escape(name)}</title></polyline>')
        parts += [f'<circle cx="{x(m):.1f}" cy="{y(counts.get(m, 0)):.1f}" r="3" '
                  f'fill="{colour}"/>' for m in range(first, last + 1)]
    parts.append("</svg>")
    legend = "".join(
        f'<li><span style="background:{colour}"></span>{html.escape(name)}: '
        f'{sum(series[name].values())}</li>' for name, colour in SERIES.items())
    heading = f"Run {run_id}" if run_id is not None else "No run yet"
    return (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>body{{font-family:sans-serif;margin:20px}}"
        "ul{list-style:none;padding:0;display:flex;gap:24px}"
        "li span{display:inline-block;width:14px;height:14px;margin-right:6px;"
        "vertical-align:middle}</style></head><body>"
        f"<h1>{html.escape(heading)}: progress per minute</h1>"
        f"<p>{html.escape(title)}</p><ul>{legend}</ul>{''.join(parts)}</body></html>\n")


def _nice(n: float) -> float:
    """The round number at or above ``n`` the value axis ends at."""
    magnitude = 10.0 ** math.floor(math.log10(max(n, 1)))
    return float(next(step * magnitude for step in (1, 2, 2.5, 5, 10)
                      if step * magnitude >= n))


def write_chart(store: FrontierStore, path: str, output: str) -> int:
    run_id, series = per_minute(store)
    page = render(run_id, series, f"scrapy_idempotent crawl of {path}")
    with open(output, "w", encoding="utf-8") as out:
        out.write(page)
    print(f"scrapy idempotent status: run {run_id} drawn in {output}")
    return 0
