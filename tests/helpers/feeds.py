"""Feeds of the shop's products compared with what the database holds: the rows of products,
the records stored so far, and what ``scrapy idempotent export`` writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from crawling import EXAMPLE_PROJECT, db_rows

FIELDS = ("sku", "name", "price", "url")


def product_rows(items: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    return sorted(tuple(str(item[f]) for f in FIELDS) for item in items)


def read_jsonlines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def record_count(db: Path) -> int:
    """Records stored so far in SQLite database ``db`` (0 before it is created or while it
    is migrated)."""
    if not db.exists():
        return 0
    try:
        return int(db_rows(db, "SELECT count(*) FROM records")[0][0])
    except Exception:  # not created yet, or being migrated
        return 0


def exported_rows(db: Path, tmp_path: Path) -> list[tuple[str, ...]]:
    """The product rows ``scrapy idempotent export`` writes of ``db``."""
    out = tmp_path / "export.jsonl"
    subprocess.run([sys.executable, "-m", "scrapy", "idempotent", "export", "--db", str(db),
                    "-o", str(out)], cwd=EXAMPLE_PROJECT, check=True,
                   stdout=subprocess.DEVNULL)
    return product_rows(read_jsonlines(out))
