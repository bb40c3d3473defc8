"""Workers started at once on one SQLite file: while one creates or migrates it (a
transaction a schema step), another judging whether the file is this package's reads its
version and its tables of one moment, so it never takes a file being migrated for another
application's."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

from scrapy_idempotent.store.sqlite import _MIGRATIONS, APPLICATION_ID, SCHEMA_VERSION, SQLiteStore


def at_version(path: Path, version: int) -> None:
    """A database file as a release of schema ``version`` left it (WAL, incremental vacuum)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("BEGIN")
    for step in _MIGRATIONS[:version]:
        for statement in step:
            conn.execute(statement)
    conn.execute(f"PRAGMA user_version = {version}")
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute("COMMIT")
    conn.close()


class MigratedMeanwhile:
    """A connection on which another worker migrates the file to the newest schema just
    before the tables are listed (after the version was read)."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self.conn, self.path, self.migrated = conn, path, False

    @property
    def in_transaction(self) -> bool:
        return self.conn.in_transaction

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if "sqlite_master" in sql and not self.migrated:
            self.migrated = True
            other = SQLiteStore(str(self.path), busy_timeout_seconds=30)
            other.open()
            other.close()
        return self.conn.execute(sql, *args)


def test_the_ownership_check_reads_one_moment_of_a_file_being_migrated(tmp_path: Path) -> None:
    path = tmp_path / "frontier.sqlite3"
    at_version(path, 3)
    conn = sqlite3.connect(path, isolation_level=None)
    racing = MigratedMeanwhile(conn, path)
    version, new = SQLiteStore(str(path))._check_ownership(racing)  # type: ignore[arg-type]
    conn.close()
    assert racing.migrated
    assert (version, new) == (3, False)  # what it read was of one moment
    check = sqlite3.connect(path)
    assert check.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    check.close()


OPEN = """
import sys
from scrapy_idempotent.store.sqlite import SQLiteStore
store = SQLiteStore(sys.argv[1], busy_timeout_seconds=60)
store.open()
store.close()
"""


def test_workers_opening_a_new_file_at_once_all_open_it(tmp_path: Path) -> None:
    for round_ in range(3):
        path = tmp_path / f"frontier{round_}.sqlite3"
        openers = [subprocess.Popen([sys.executable, "-c", OPEN, str(path)],
                                    stderr=subprocess.PIPE, text=True) for _ in range(4)]
        errors = [opener.communicate()[1] for opener in openers]
        assert [opener.returncode for opener in openers] == [0] * 4, errors
