"""``scrapy idempotent export``: records to JSON Lines, CSV or JSON through Scrapy's item
exporters (``-o FILE``, ``--format``, ``--since``, ``--run``)."""

from __future__ import annotations

import json
import math
import os
import sys
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from scrapy.exceptions import UsageError

from ..codec import plain_value
from ._common import all_records, iso, print_report

if TYPE_CHECKING:
    import argparse

    from ..store.base import StoredRecord
    from ._common import Opened

DESCRIPTION = "records to JSON Lines, CSV or JSON (-o FILE, default stdout)"

#: ``--format`` values -> Scrapy exporter class name; a missing format is taken from the
#: output file's extension (``.jsonl``, ``.jl``, ``.csv``, ``.json``), else JSON Lines.
FORMATS: dict[str, str] = {
    "jsonlines": "JsonLinesItemExporter",
    "jsonl": "JsonLinesItemExporter",
    "jl": "JsonLinesItemExporter",
    "csv": "CsvItemExporter",
    "json": "JsonItemExporter",
}

#: Fields the export puts before the item's own.
EXPORT_FIELDS = ("record_id", "first_seen", "last_changed")


def run(opened: Opened, opts: argparse.Namespace) -> int:
    from scrapy.utils.misc import load_object

    store = opened.store
    fmt = opts.format or _format_of(opts.output) or "jsonlines"
    fmt = {"jsonl": "jsonlines", "jl": "jsonlines"}.get(fmt, fmt)
    exporter_cls = load_object(f"scrapy.exporters.{FORMATS[fmt]}")
    to_stdout = opts.output in (None, "-")
    filters = {"changed_since": opts.since_time, "changed_since_run": opts.run}
    kwargs: dict[str, Any] = {"encoding": "utf-8"}
    if fmt == "csv":  # one header for every record: the union of their fields
        fields: dict[str, None] = {}
        for record in all_records(store, filters):
            fields.update(dict.fromkeys(_export_row(record, flat=True)))
        kwargs["fields_to_export"] = [*EXPORT_FIELDS,
                                      *sorted(f for f in fields if f not in EXPORT_FIELDS)]
    elif fmt == "json":
        kwargs["indent"] = 0  # one record per line
    partial = f"{opts.output}.partial"
    stream: Any = sys.stdout.buffer if to_stdout else open(partial, "wb")  # noqa: SIM115
    count = 0
    try:
        exporter = exporter_cls(stream, **kwargs)
        exporter.start_exporting()
        for record in all_records(store, filters):
            exporter.export_item(_export_row(record, flat=fmt == "csv"))
            count += 1
        exporter.finish_exporting()
        if fmt == "json":
            stream.write(b"\n")
        stream.flush()
    finally:
        if not to_stdout:
            stream.close()
    if not to_stdout:
        os.replace(partial, opts.output)
    report = {"database": opened.path, "exported": count, "format": fmt,
              "output": None if to_stdout else opts.output,
              "since": iso(opts.since_time), "run": opts.run}
    where = "stdout" if to_stdout else opts.output
    line = f"Exported {count} record{'s' * (count != 1)} to {where} ({fmt})"
    if to_stdout:  # keep stdout for the data
        print(json.dumps(report) if opts.json else line, file=sys.stderr)
    else:
        print_report(opts, report, [line])
    return 0


def parse_time(text: str) -> float:
    """``--since``: ISO 8601 date or date and time to unix seconds; UTC unless an offset is
    given."""
    value = text.strip()
    if value[-1:] in ("Z", "z"):
        value = value[:-1] + "+00:00"
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise UsageError(f"--since {text!r}: not an ISO 8601 date or time (2026-05-04, "
                         "2026-05-04T10:00:00Z, 2026-05-04T12:00:00+02:00)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _export_row(record: StoredRecord, *, flat: bool) -> dict[str, Any]:
    """The exported form of a record: ``record_id``, ``first_seen``, ``last_changed``, then
    the item's fields as plain JSON values (tuples and sets as lists, datetimes and dates as
    ISO 8601 text, Decimals as text, bytes as base64 text). With ``flat`` (CSV), lists and
    objects become JSON text."""
    row: dict[str, Any] = {"record_id": record.record_id,
                           "first_seen": iso(record.first_seen),
                           "last_changed": iso(record.last_changed)}
    data = _plain(json.loads(record.data))
    for name, value in (data.items() if isinstance(data, dict) else [("data", data)]):
        if flat and isinstance(value, (list, dict)):
            value = json.dumps(value, ensure_ascii=False, sort_keys=True)
        row.setdefault(name, value)
    return row


def _plain(value: Any) -> Any:
    """Tagged JSON (see :mod:`~.codec`, which owns the tags) to plain JSON values that every
    export format can write: text with a lone surrogate (not valid Unicode; the codec stores
    it as it came) has each lone surrogate replaced by U+FFFD, and a NaN or infinite number
    becomes None (null in JSON, an empty cell in CSV), as JavaScript's ``JSON.stringify``
    does."""
    return plain_value(value, _export_leaf)


def _export_leaf(value: Any) -> Any:
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _text(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD (valid UTF-8 in any format)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)
    return text


def _format_of(output: str | None) -> str | None:
    if not output or output == "-":
        return None
    extension = os.path.splitext(output)[1].lower().lstrip(".")
    return extension if extension in FORMATS else None
