"""The Redis hash of the duplicate check's fast layer, read beside the crawl's frontier."""

from __future__ import annotations

from typing import Any

from scrapy_idempotent import redis_dedup


def frontier_holds_every_field(database: str, server: Any, run_id: int) -> int:
    """How many fields the hash of run ``run_id`` of the crawl's frontier has; each is the
    fingerprint or the key of a frontier entry (the hash never knows what the database
    lacks)."""
    import psycopg
    import redis

    with psycopg.connect(database) as conn:
        [schema] = [name for (name,) in conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'idempotent%'")]
        conn.execute("SELECT set_config('search_path', %s, false)", (schema,))
        # (PostgreSQL keeps the keys as their bytes: schema 22)
        known = {value for row in conn.execute(
            "SELECT encode(key, 'hex'), encode(fingerprint, 'hex') FROM requests")
            for value in row}
        [(frontier,)] = conn.execute("SELECT value FROM meta WHERE key = 'frontier_id'")
    key = f"{redis_dedup.KEY_PREFIX}:{frontier}:{run_id}:none"
    fields = {field.hex() for field in redis.Redis.from_url(server.url).hkeys(key)}
    assert fields <= known, sorted(fields - known)[:5]
    return len(fields)
