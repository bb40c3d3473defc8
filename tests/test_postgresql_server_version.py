"""The PostgreSQL store needs a server of version 14 or later: an older one is refused at the
first connection, with the version found and the one needed, before anything is written."""

from __future__ import annotations

import pytest

from scrapy_idempotent.exceptions import StoreError
from scrapy_idempotent.store import CrawlIdentity

psycopg = pytest.importorskip("psycopg")
from scrapy_idempotent.store import postgresql_connection  # noqa: E402
from scrapy_idempotent.store.postgresql import (  # noqa: E402
    MIN_SERVER_VERSION,
    PostgreSQLStore,
    check_server_version,
)

URL = "postgresql://crawler:***@db.example/crawl"


@pytest.mark.parametrize(("version_num", "shown"), [
    (130011, "13.11"), (120000, "12.0"), (90624, "9.6.24"), (139999, "13.9999")])
def test_a_server_older_than_14_is_refused_naming_both_versions(version_num: int,
                                                                 shown: str) -> None:
    with pytest.raises(StoreError) as raised:
        check_server_version(version_num, URL)
    message = str(raised.value)
    assert f"is version {shown};" in message
    assert "needs PostgreSQL 14 or later" in message and URL in message


@pytest.mark.parametrize("version_num", [140000, 140010, 150004, 170002])
def test_a_server_of_14_or_later_is_accepted(version_num: int) -> None:
    check_server_version(version_num, URL)


def test_the_tests_server_passes_and_an_older_one_is_refused_before_any_write(
        postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    identity = CrawlIdentity(project="p", spider="shop", source="shop")
    with psycopg.connect(postgres_url) as conn:
        found = conn.info.server_version
    assert found >= MIN_SERVER_VERSION
    # the same server, as if the store needed a newer one than it is
    monkeypatch.setattr(postgresql_connection, "MIN_SERVER_VERSION", found + 10000)
    store = PostgreSQLStore(postgres_url, heartbeat_seconds=None)
    with pytest.raises(StoreError, match=rf"is version {found // 10000}\.{found % 10000};"):
        store.open(fingerprinter="f", identity=identity)
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT count(*) FROM pg_namespace"
                            " WHERE nspname LIKE 'idempotent%'").fetchone() == (0,)
    monkeypatch.undo()
    store = PostgreSQLStore(postgres_url, heartbeat_seconds=None)
    try:
        store.open(fingerprinter="f", identity=identity)
    finally:
        store.close()
