"""Request keys of any text on PostgreSQL, for the tests written with keys that name what
they stand for (``"a"``, ``"child1"``, ``"fp-a"``): the PostgreSQL store keeps a request key
as its bytes (schema 22: a key is lowercase hex digits, Python's ``.hex()``) and refuses any
other key. The ``named_keys`` fixture (``tests/conftest.py``, on for every test of the test
process unless a test asks for ``real_key_codec``) gives the store a codec that keeps hex
keys as the package does and any other text (ASCII, no backslash: read in SQL as
``escape``-format bytea, whose functions are immutable: plans as the package's) as its
bytes after a marker no key of 20
random bytes begins with in practice: the statements, their conversions and the
``bytea`` columns are the package's own, only the name's bytes differ.
``test_postgresql_store.py`` checks the package's own codec (a non-hex key refused, every
key of a crawl 20 bytes)."""

from __future__ import annotations

import re
from typing import Any

#: what a named key's bytes begin with: 0xff 0x00 "name:"
MARK = b"\xff\x00name:"
_MARK_SQL = "'\\x" + MARK.hex() + "'::bytea"
_HEX = re.compile(r"(?:[0-9a-f]{2})+")


def key(self: Any, value: str | None) -> bytes | None:
    if value is None:
        return None
    if _HEX.fullmatch(value):
        return bytes.fromhex(value)
    assert value.isascii() and "\\" not in value, value
    return MARK + value.encode()


def key_read(self: Any, value: Any) -> str | None:
    if value is None:
        return None
    raw = bytes(value)
    return raw[len(MARK):].decode() if raw.startswith(MARK) else raw.hex()


KEY_TEXT = (f"CASE WHEN substr({{c}}, 1, {len(MARK)}) = {_MARK_SQL}"
            f" THEN encode(substr({{c}}, {len(MARK) + 1}), 'escape')"
            " ELSE encode({c}, 'hex') END")
KEY_OF_TEXT = ("CASE WHEN {c} ~ '^([0-9a-f]{{2}})+$' THEN decode({c}, 'hex')"
               f" ELSE {_MARK_SQL} || decode({{c}}, 'escape') END")


def install(monkeypatch: Any) -> None:
    """The named-key codec on :class:`~.PostgreSQLStore` (undone with ``monkeypatch``)."""
    from scrapy_idempotent.store.postgresql import PostgreSQLStore

    monkeypatch.setattr(PostgreSQLStore, "_key", key)
    monkeypatch.setattr(PostgreSQLStore, "_key_read", key_read)
    monkeypatch.setattr(PostgreSQLStore, "KEY_TEXT", KEY_TEXT)
    monkeypatch.setattr(PostgreSQLStore, "KEY_OF_TEXT", KEY_OF_TEXT)
