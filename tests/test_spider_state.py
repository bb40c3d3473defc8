"""``spider.state`` kept in the crawl's database: changes committed with the pages whose
callbacks made them, restored at open; after kills it holds exactly the committed pages'
changes; several workers' counters add up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f
from state_spider import StateSpider

from crawling import crawl_settings, kill_crawls, run_crawl, wait_for
from helpers.stored import reading, stored_records
from scrapy_idempotent.spider_state import state_changes
from scrapy_idempotent.store.base import StateChange
from scrapy_idempotent.store.rules import apply_state_changes

STATE_SPIDER = Path(__file__).parent / "state_spider.py"


def stored_state(database: str) -> dict[str, Any]:
    with reading(database) as store:
        state: dict[str, Any] = store.spider_state()
    return state


# -- the rule -------------------------------------------------------------------------------


def test_numbers_are_added_other_values_set_and_removed_keys_deleted() -> None:
    old = {"pages": 3, "cursor": "a", "gone": 1, "nested": {"x": 1, "y": "k"}, "flag": True}
    new = {"pages": 5, "cursor": "b", "nested": {"x": 4, "z": [1]}, "flag": 1, "new": 2,
           "fresh": {"n": 1, "s": "t"}}
    assert state_changes(old, new) == [
        ("delete", ("gone",), None),
        ("add", ("pages",), 2),
        ("set", ("cursor",), "b"),
        ("delete", ("nested", "y"), None),
        ("add", ("nested", "x"), 3),
        ("set", ("nested", "z"), [1]),
        ("set", ("flag",), 1),  # a boolean is no counter
        ("add", ("new",), 2),  # a counter that starts: added to what is stored
        ("add", ("fresh", "n"), 1),
        ("set", ("fresh", "s"), "t"),
    ]


def test_changes_of_two_workers_add_up_and_the_last_set_wins() -> None:
    """Worker A and worker B both started from pages 10: A counted 3 more, B 2 more; both
    set the cursor, B's commit came last."""
    stored: dict[str, Any] = {"pages": 10, "cursor": "a"}
    a = [StateChange("add", ("pages",), 3), StateChange("set", ("cursor",), "from a")]
    b = [StateChange("add", ("pages",), 2), StateChange("set", ("cursor",), "from b"),
         StateChange("add", ("per", "site"), 1), StateChange("delete", ("nothing",))]
    assert apply_state_changes(apply_state_changes(stored, a), b) == {
        "pages": 15, "cursor": "from b", "per": {"site": 1}}


# -- crawls -----------------------------------------------------------------------------------


@pytest.fixture
def small_shop() -> Any:
    with LocalSite(listing_pages=3, products_per_page=20) as site:
        yield site


@deferred_f_from_coro_f
async def test_spider_state_is_committed_and_restored_by_the_next_crawl(
        small_shop: LocalSite, crawl_database: str) -> None:
    crawler = await run_crawl(StateSpider, crawl_settings(crawl_database), url=small_shop.url)
    assert crawler.stats.get_value("finish_reason") == "finished"
    state = stored_state(crawl_database)
    assert state["products"] == 60 and state["listings"] == 3
    assert sum(state["by_digit"].values()) == 60
    assert state["last_sku"].startswith("SKU-")
    # the next crawl (a new run over the same records) starts from the stored state
    second = await run_crawl(StateSpider, crawl_settings(crawl_database), url=small_shop.url)
    assert second.spider.state["products"] == 120
    assert stored_state(crawl_database)["products"] == 120


@pytest.mark.slow
def test_spider_state_after_kills_matches_the_committed_pages(
        small_shop: LocalSite, crawl_database: str, tmp_path: Path) -> None:
    """5 SIGKILLs at moments given by the crawl's progress, then a resume to the end: the
    stored page counts equal the pages committed (60 products, 3 listings), though the
    site served more (the pages in flight at each kill, fetched again)."""
    import random

    command = [sys.executable, "-m", "scrapy", "runspider", str(STATE_SPIDER),
               "-a", f"url={small_shop.url}", "-s", f"IDEMPOTENT_DATABASE={crawl_database}",
               "-s", 'ADDONS={"scrapy_idempotent.Addon": 0}', "-s", "ROBOTSTXT_OBEY=False",
               "-s", "TELNETCONSOLE_ENABLED=False", "-s", "CONCURRENT_REQUESTS=8"]
    small_shop.delay = 0.05
    kill_crawls(small_shop, command, tmp_path, random.Random(40), 5, more=(4, 10))
    state = stored_state(crawl_database)
    assert len(stored_records(crawl_database)) == 60
    assert (state["products"], state["listings"]) == (60, 3)
    assert sum(state["by_digit"].values()) == 60
    served = sum(n for path, n in small_shop.counts_by_path().items()
                 if path.startswith("/product/"))
    assert served >= 60  # (more when a kill caught pages in flight)


@pytest.mark.slow
def test_two_postgresql_workers_add_their_counts_up(
        small_shop: LocalSite, postgres_url: str, tmp_path: Path) -> None:
    """Two workers crawl one frontier at once: each counts its own pages in its
    ``spider.state``; the stored state holds the sum (60 products), the cursor one of
    theirs."""
    small_shop.delay = 0.05
    database = f"{postgres_url}?schema=state_workers"
    command = [sys.executable, "-m", "scrapy", "runspider", str(STATE_SPIDER),
               "-a", f"url={small_shop.url}", "-s", f"IDEMPOTENT_DATABASE={database}",
               "-s", 'ADDONS={"scrapy_idempotent.Addon": 0}', "-s", "ROBOTSTXT_OBEY=False",
               "-s", "TELNETCONSOLE_ENABLED=False", "-s", "CONCURRENT_REQUESTS=4"]
    small_shop.hold()  # nothing is answered until both workers run in the run
    workers = [subprocess.Popen([*command, "-s", f"LOG_FILE={tmp_path / f'w{n}.log'}"],
                                cwd=tmp_path, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
               for n in range(2)]
    try:
        for n in range(2):
            log = tmp_path / f"w{n}.log"
            wait_for(lambda log=log: log.exists() and " run 1 in " in log.read_text(  # type: ignore[misc]
                errors="replace"), 300, f"worker {n} in run 1", log)
    finally:
        small_shop.release()
    codes = [worker.wait(timeout=300) for worker in workers]
    logs = [(tmp_path / f"w{n}.log").read_text(errors="replace") for n in range(2)]
    assert codes == [0, 0], "\n".join(log[-2000:] for log in logs)
    state = stored_state(database)
    assert (state["products"], state["listings"]) == (60, 3)
    assert sum(state["by_digit"].values()) == 60
    # both workers did some of the work (else the sum proves nothing)
    assert all("'idempotent/requests/done'" in log for log in logs), logs
