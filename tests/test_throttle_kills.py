"""A site's 429 and the kill of the worker that got it, sampled from the campaign of
``benchmarks/throttle_kills.py`` (``tests/helpers/throttle_kills.py``): 3 workers on one
frontier with the crawl's politeness, one of 3 sites (a limit of 1 each) answers 429 with
``Retry-After: 5``, and 429 again to whatever comes within those 5 s. Whether the worker
that got the 429 lives or is SIGKILLed 0, 10 or 100 ms after the answer (before or after it
read the answer and wrote the pause: a starved machine decides), no request goes to that
site within the 5 s on either store: the pause was written, or the dead worker's lease held
the site's one place until the transaction that took it back paused the site for the first
backoff (see docs/politeness.rst, "A site's pause, exactly")."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.throttle_kills import throttled_run
from scrapy_idempotent.store.registry import sqlite_path

pytestmark = pytest.mark.slow

RUNS = 2


@pytest.mark.parametrize("kill_after", [None, 0.0, 0.01, 0.1],
                         ids=["no-kill", "kill-0ms", "kill-10ms", "kill-100ms"])
def test_no_request_to_a_throttled_site_before_its_retry_after(
        tmp_path: Path, crawl_database: str, request: pytest.FixtureRequest,
        kill_after: float | None) -> None:
    databases = [crawl_database]
    for n in range(1, RUNS):
        databases.append(str(tmp_path / f"run{n}.sqlite3")
                         if sqlite_path(crawl_database) is not None
                         else request.getfixturevalue("postgres_cluster").new_database())
    runs = [throttled_run(database, tmp_path / f"run{n}", kill_after)
            for n, database in enumerate(databases)]
    for run in runs:
        assert run.killed == (kill_after is not None)
        assert run.earliest is not None, runs  # the site was fetched again after the pause
        assert not run.early, runs
        assert run.within == 0, runs
