"""``scrapy idempotent export`` writes every stored value, in every format, by one rule:
a lone surrogate (text that is not valid Unicode, stored by the codec as it came) is exported
as U+FFFD, and NaN or an infinite number as null (an empty cell in CSV). A real process
(``python -m scrapy idempotent export``) on a real database."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from scrapy_idempotent.records import RecordIdentity
from scrapy_idempotent.store import CrawlIdentity, UnitOfWork, open_store

ITEMS = [
    {"sku": "A", "name": "lone \ud800 surrogate", "price": float("nan"),
     "stock": float("inf"), "tags": ["ok", "bad \udfff", float("-inf")],
     "nested": {"k\ud83d": 1.5, "deep": [float("nan")]}},
    {"sku": "B", "name": "plain", "price": 9.5, "stock": 3, "tags": [], "nested": {}},
]


def _no_constants(name: str) -> Any:
    raise ValueError(f"not valid JSON: {name}")


@pytest.fixture
def database(crawl_database: str) -> str:
    store = open_store(crawl_database)
    store.open(fingerprinter="x", identity=CrawlIdentity("p", "s", "s"))
    store.begin_session("w1", "auto")
    identity = RecordIdentity(source="s", natural_keys={"dict": ("sku",)})
    records = []
    for item in ITEMS:
        keys = identity.natural_key(item, None)
        records.append((identity.record(item, identity.record_id(keys, "dict"), keys), None))
    store.commit(UnitOfWork(records=records), "w1")
    store.end_session("w1", "finished")
    store.close()
    return crawl_database


@pytest.mark.parametrize("fmt", ["jsonlines", "json", "csv"])
def test_every_stored_value_exports_in_every_format(database: str, tmp_path: Path,
                                                    fmt: str) -> None:
    out = tmp_path / f"out.{fmt}"
    done = subprocess.run(
        [sys.executable, "-m", "scrapy", "idempotent", "export", "--db", database,
         "--format", fmt, "-o", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    text = out.read_bytes().decode("utf-8")  # valid UTF-8
    if fmt == "csv":
        rows = {r["sku"]: r for r in csv.DictReader(io.StringIO(text))}
        assert rows["A"]["name"] == "lone \ufffd surrogate"
        assert rows["A"]["price"] == "" and rows["A"]["stock"] == ""
        assert json.loads(rows["A"]["tags"], parse_constant=_no_constants) == [
            "ok", "bad \ufffd", None]
        assert rows["B"]["price"] == "9.5"
        return
    if fmt == "jsonlines":
        exported = [json.loads(line, parse_constant=_no_constants)
                    for line in text.splitlines()]
    else:
        exported = json.loads(text, parse_constant=_no_constants)
    by_sku = {r["sku"]: r for r in exported}
    a = by_sku["A"]
    assert a["name"] == "lone \ufffd surrogate"
    assert a["price"] is None and a["stock"] is None
    assert a["tags"] == ["ok", "bad \ufffd", None]
    assert a["nested"] == {"k\ufffd": 1.5, "deep": [None]}
    assert by_sku["B"]["price"] == 9.5
