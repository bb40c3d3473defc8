"""Shared fixtures: the local test shop, real crawls in this process, frontier databases."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

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
