"""Shared fixtures: the local test shop, real crawls in this process, frontier databases."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_PROJECT = ROOT / "example_project"
if str(EXAMPLE_PROJECT) not in sys.path:
    sys.path.insert(0, str(EXAMPLE_PROJECT))

from shop.site import ShopSite  # noqa: E402


@pytest.fixture
def shop() -> Iterator[ShopSite]:
    """The example shop (25 listing pages, 500 products) on 127.0.0.1, a fresh one per test."""
    with ShopSite(port=0) as site:
        yield site


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "frontier.sqlite3"


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[object]:
    """A PostgreSQL cluster of its own for the test session (tests/postgres_server.py); the
    tests that use it skip, naming what to install, when no server binaries or no psycopg
    are found."""
    pytest.importorskip("psycopg", reason="psycopg is not installed: pip install "
                        "'scrapy-idempotent[postgresql]'")
    from postgres_server import INSTALL_HINT, find_binaries, running_cluster

    bindir = find_binaries()
    if bindir is None:
        pytest.skip(INSTALL_HINT)
    with running_cluster(bindir) as cluster:
        yield cluster


@pytest.fixture
def postgres_url(postgres_cluster: Any) -> str:
    """The URL of an empty database of its own on the session's PostgreSQL cluster."""
    return str(postgres_cluster.new_database())
