"""A password in IDEMPOTENT_DATABASE is never shown: neither the one before the host nor
those libpq takes as query parameters (``?password=``, ``?sslpassword=``), in every form a
libpq URI allows."""

from __future__ import annotations

import pytest

from scrapy_idempotent.exceptions import StoreError
from scrapy_idempotent.store.registry import redacted


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://h/db?user=u&password=secret", "postgresql://h/db?user=u&password=***"),
    ("postgresql://u@h/db?password=secret", "postgresql://u@h/db?password=***"),
    ("postgres://h:5432/db?password=secret&sslmode=require",
     "postgres://h:5432/db?password=***&sslmode=require"),
    ("postgresql://h/db?sslmode=verify-full&sslpassword=secret&sslkey=/k.pem",
     "postgresql://h/db?sslmode=verify-full&sslpassword=***&sslkey=/k.pem"),
    ("postgresql://u:secret@h/db?sslpassword=secret&schema=crawl",
     "postgresql://u:***@h/db?sslpassword=***&schema=crawl"),
    ("postgresql://h/db?pass%77ord=secret", "postgresql://h/db?pass%77ord=***"),
    ("postgresql://h/db?password=secret#x", "postgresql://h/db?password=***#x"),
    ("postgresql://h/db?password=", "postgresql://h/db?password=***"),
    ("postgresql:///db?host=/run/postgresql&password=sec%26ret",
     "postgresql:///db?host=/run/postgresql&password=***"),
])
def test_every_form_of_a_url_password_is_hidden(url: str, shown: str) -> None:
    assert redacted(url) == shown
    assert "secret" not in redacted(url) and "sec%26ret" not in redacted(url)


@pytest.mark.parametrize("unchanged", [
    "postgresql://u@h/db?sslmode=require&application_name=password",
    "/srv/crawl?password=x.sqlite3",  # a path, not a URL: nothing in it is a password
    "sqlite:///data/x.sqlite3",
])
def test_what_is_not_a_password_is_shown_as_given(unchanged: str) -> None:
    assert redacted(unchanged) == unchanged


def test_the_store_never_shows_a_query_password(postgres_cluster: object) -> None:
    pytest.importorskip("psycopg")
    from scrapy_idempotent.store.postgresql import PostgreSQLStore

    port = postgres_cluster.port  # type: ignore[attr-defined]
    url = f"postgresql://127.0.0.1:{port}/postgres?user=postgres&password=wr0ngsecret"
    store = PostgreSQLStore(url, heartbeat_seconds=None)
    assert "wr0ngsecret" not in store.shown_url
    with pytest.raises(StoreError, match="password authentication failed") as raised:
        store.open(fingerprinter="f")
    assert "wr0ngsecret" not in str(raised.value)
    assert "password=***" in str(raised.value)
