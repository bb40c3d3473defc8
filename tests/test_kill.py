"""Kill-and-resume with real processes: ``scrapy crawl`` of the example project, SIGKILLed
at random moments, then run to completion (the docs' demo, smaller)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from local_site import LocalSite

from crawling import db_rows, frontier_counts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "example_project"))
import demo

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_and_resume_stores_each_product_once(tmp_path: Path, seed: int) -> None:
    # One request at a time, a shop answering in 10 ms: a kill may repeat only the request on
    # the wire, so the bound is exact (525 + kills).
    with LocalSite(delay=0.01) as site:
        result = demo.run_mode("idempotent", site, kills=4, rng=random.Random(seed),
                               workdir=tmp_path, kill_min=0.2, kill_max=1.0, progress=False,
                               concurrency=1)
    assert result["kills"] == 4, result["runs"]
    assert result["rows"] == 500
    assert result["distinct"] == 500
    assert result["correct"] == 500
    assert result["requests"] <= 525 + result["kills"], result["repeated_paths"]
    assert result["finish_reason"] == "finished"
    db = tmp_path / "idempotent.sqlite3"
    assert frontier_counts(db) == {"done": 525}
    assert db_rows(db, "SELECT count(*) FROM runs") == [(1,)]  # one run, resumed each time
    assert db_rows(db, "SELECT count(*) FROM responses") == [(0,)]  # journal emptied


def test_sigkill_at_full_concurrency_repeats_at_most_what_was_on_the_wire(
    tmp_path: Path,
) -> None:
    with LocalSite(delay=0.01) as site:
        result = demo.run_mode("idempotent", site, kills=3, rng=random.Random(3),
                               workdir=tmp_path, kill_min=0.2, kill_max=0.6, progress=False,
                               concurrency=16)
    assert result["kills"] == 3, result["runs"]
    assert result["rows"] == result["correct"] == 500
    assert result["requests"] <= 525 + 3 * 16, result["repeated_paths"]
