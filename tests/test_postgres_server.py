"""The tests' own PostgreSQL cluster (tests/postgres_server.py): started with no manual step,
password-checked over TCP, restartable on the same port."""

from __future__ import annotations

from typing import Any

import pytest

psycopg = pytest.importorskip("psycopg")


def test_a_fresh_database_per_test_on_a_private_cluster(postgres_url: str,
                                                        postgres_cluster: Any) -> None:
    with psycopg.connect(postgres_url) as conn:
        name, = conn.execute("SELECT current_database()").fetchone()
        tables, = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()
    assert name.startswith("test_") and tables == 0
    assert postgres_url != postgres_cluster.new_database()
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(postgres_cluster.url(password="wrong"))


def test_the_cluster_restarts_on_its_port_with_its_data(postgres_url: str,
                                                         postgres_cluster: Any) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (n int)")
        conn.execute("INSERT INTO kept VALUES (1)")
    port = postgres_cluster.port
    postgres_cluster.stop("immediate")  # as a crash: recovery at the next start
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(postgres_url, connect_timeout=5)
    postgres_cluster.start()
    assert postgres_cluster.port == port
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT n FROM kept").fetchall() == [(1,)]
