"""``scrapy idempotent status --chart OUT.html``: a picture of the latest run, drawn from the
rows the crawl stored (when each request finished, when each record was first stored or last
changed), so it holds every worker's part, a killed worker's too: pages done, pages failed,
repeats (pages fetched more than once) and records inserted or changed, per minute. One
self-contained HTML page (inline SVG, no script, nothing fetched)."""

from __future__ import annotations

import html
import math
import time
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..store.base import FrontierStore

#: Series -> colour.
SERIES = {"pages done": "#2b7bb9", "pages failed": "#d62728", "repeats": "#ff7f0e",
          "records changed": "#2ca02c"}
_PAGE = 1000
_WIDTH, _HEIGHT, _LEFT, _BOTTOM, _TOP, _RIGHT = 900, 360, 60, 40, 20, 20


def per_minute(store: FrontierStore) -> tuple[int | None, dict[str, Counter[int]]]:
    """The latest run's id and, per series, events per minute (minute: unix seconds // 60)."""
    runs = store.runs()
    run_id = runs[-1].run_id if runs else None
    series: dict[str, Counter[int]] = {name: Counter() for name in SERIES}
    after: str | None = None
    while run_id is not None:
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
    while run_id is not None:
        records = store.records_page(after=after, limit=_PAGE, changed_since_run=run_id)
        if not records:
            break
        for record in records:
            series["records changed"][int(record.last_changed // 60)] += 1
        after = records[-1].record_id
    return run_id, series


def render(run_id: int | None, series: dict[str, Counter[int]], title: str) -> str:
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
