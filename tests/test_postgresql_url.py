"""The PostgreSQL database URL: the package's own `schema` parameter is taken out, and every
other parameter reaches libpq exactly as written (libpq decodes %XX but not "+")."""

from __future__ import annotations

import pytest

psycopg = pytest.importorskip("psycopg")
from scrapy_idempotent.store.postgresql import PostgreSQLStore, _split_url  # noqa: E402


def test_the_schema_parameter_is_taken_out_and_the_others_are_left_as_written() -> None:
    url = "postgresql://h/db?options=-c%20work_mem%3D7MB&schema=crawl_a&password=a+b%2Bc"
    assert _split_url(url) == (
        "postgresql://h/db?options=-c%20work_mem%3D7MB&password=a+b%2Bc", "crawl_a")
    assert _split_url("postgresql://h/db?sslmode=disable") == (
        "postgresql://h/db?sslmode=disable", None)
    assert _split_url("postgresql://h/db") == ("postgresql://h/db", None)


def test_a_server_option_with_a_space_reaches_the_server(postgres_url: str) -> None:
    joiner = "&" if "?" in postgres_url else "?"
    store = PostgreSQLStore(postgres_url + joiner + "options=-c%20work_mem%3D7777kB",
                            heartbeat_seconds=None)
    store.open()
    try:
        assert store.conn.execute("SHOW work_mem").fetchone() == ("7777kB",)
    finally:
        store.close()
