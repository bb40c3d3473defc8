"""``scrapy idempotent status|failed|retry|export|check --db postgresql://...`` on the database
of a real crawl of the example shop on PostgreSQL."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, run_crawl
from helpers.commands import idempotent, idempotent_json
from shop.site import product_sku
from shop.spiders.shop import ShopSpider

psycopg = pytest.importorskip("psycopg")

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


@deferred_f_from_coro_f
async def test_operator_commands_on_postgresql(
        postgres_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    failing = {3, 7, 42}
    settings = crawl_settings(postgres_url, **NATURAL_KEYS)  # type: ignore[arg-type]
    site = LocalSite(products_failing=failing).start()
    request.addfinalizer(site.stop)
    await run_crawl(ShopSpider, settings, url=site.url)
    db = postgres_url  # one crawl in the database: its schema is found

    status = idempotent_json("status", "--db", db)
    assert status["run"]["run_id"] == 1 and status["run"]["state"] == "finished"
    assert status["frontier"] == {"pending": 0, "leased": 0, "done": 522, "failed": 3,
                                  "redirected": 0, "total": 525}
    assert status["records"]["stored"] == status["records"]["inserted"] == 497
    assert status["leases"] == []
    assert "***@" in json.dumps(status) and ":" + postgres_url.split(":")[2].split("@")[0] \
        + "@" not in json.dumps(status)  # the password is never shown

    failed = idempotent_json("failed", "--db", db, "--kind", "http_status", "--url",
                             "*/SKU-0000[37]")
    assert failed["matching"] == 2
    assert {r["url"] for r in failed["failed"]} == {
        f"{site.url}/product/{product_sku(n)}" for n in (3, 7)}
    assert idempotent_json("failed", "--db", db, "--url", "re:00042$")["matching"] == 1

    code, out, _ = idempotent("retry", "--db", db, "--url", "*/SKU-00042")
    assert code == 0 and out.startswith("Put 1 failed request with URL matching")
    assert idempotent_json("retry", "--db", db)["retried"] == 2
    assert idempotent_json("status", "--db", db)["frontier"]["pending"] == 3
    code, out, _ = idempotent("check", "--db", db)
    assert code == 0, out

    site.set_products_failing(())
    site.reset_counts()
    crawler = await run_crawl(ShopSpider, settings, url=site.url)
    assert site.counts_by_path() == {f"/product/{product_sku(n)}": 1 for n in failing}
    assert crawler.stats.get_value("idempotent/records/inserted") == 3

    out_path = tmp_path / "records.jsonl"
    code, out, _ = idempotent("export", "--db", db, "-o", str(out_path))
    assert (code, out) == (0, f"Exported 500 records to {out_path} (jsonlines)\n")
    rows = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert {r["sku"]: (r["name"], r["price"]) for r in rows} == {
        sku: (p["name"], p["price"]) for sku, p in site.expected_products().items()}

    # a second crawl in the same database: --db must name its schema
    other = crawl_settings(postgres_url, IDEMPOTENT_SOURCE="other",  # type: ignore[arg-type]
                           **NATURAL_KEYS)
    await run_crawl(ShopSpider, other, url=site.url)
    code, _, err = idempotent("status", "--db", db)
    assert code == 1 and re.search(r"several crawls \(schemas idempotent_shop_\w+, "
                                   r"idempotent_shop_\w+\): name one with \?schema=NAME", err)
    schema = re.findall(r"idempotent_shop_\w+", err)[0]
    assert idempotent_json("status", "--db", f"{db}?schema={schema}")["records"]["stored"] \
        == 500
