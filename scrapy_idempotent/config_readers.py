"""Readers of one ``IDEMPOTENT_*`` setting's value, each refusing a wrong value with a
:class:`~.ConfigError` naming the setting (the parser, :mod:`.config`, builds the crawl's
configuration from them; the defaults are :mod:`.default_settings`'s)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .default_settings import SETTINGS
from .exceptions import ConfigError
from .redis_dedup import redis_client, shown_url
from .store.registry import sqlite_path

if TYPE_CHECKING:
    from scrapy.settings import BaseSettings

__all__: list[str] = []


def _seconds_or_off(settings: BaseSettings, name: str, least: float, off: str) -> float:
    """An interval setting: 0 turns it off, else seconds from ``least`` to a day."""
    interval = _number(settings, name, minimum=0.0, maximum=_DAY)
    if 0 < interval < least:
        raise ConfigError(name, _get(settings, name),
                          f"{off} or a number of seconds >= {least} and <= 86400")
    return interval


def _get(settings: BaseSettings, name: str) -> Any:
    return settings.get(name, SETTINGS[name])


_TRUE = ("1", "true", "True")
_FALSE = ("0", "false", "False")


def _boolean(settings: BaseSettings, name: str) -> bool:
    """What Scrapy's ``getbool`` accepts, with an error naming the setting otherwise."""
    raw = settings.get(name, SETTINGS[name])
    if isinstance(raw, bool):
        return raw
    if raw in (0, 1) or raw in _TRUE or raw in _FALSE:
        return raw in (1, *_TRUE)
    raise ConfigError(name, raw, "a boolean: True or False (1 or 0, 'true' or 'false')")


#: Upper bounds of the number settings: each is far above any sensible value, and keeps what
#: the databases store (lease times, SQLite's busy timeout in milliseconds, batch sizes in one
#: statement) finite and within range.
_HOUR = 3600.0
_DAY = 86400.0
_WEEK = 7 * _DAY
_YEAR = 365 * _DAY
_MAX_BATCH = 10_000


def _number(settings: BaseSettings, name: str, *, minimum: float, maximum: float,
            integer: bool = False) -> float:
    """The number setting ``name``, in ``[minimum, maximum]`` (so never NaN or infinite), an
    integer with ``integer``; :class:`~.ConfigError` naming the setting and the range
    otherwise."""
    raw = _get(settings, name)
    try:
        value = float(raw)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int past a float
        value = float("nan")
    kind = "an integer" if integer else "a number"
    if (isinstance(raw, bool) or not minimum <= value <= maximum
            or (integer and value != int(value))):
        raise ConfigError(name, raw, f"{kind} >= {minimum:g} and <= {maximum:g}")
    return value


def _names(settings: BaseSettings, name: str) -> list[str]:
    raw = settings.get(name, SETTINGS[name])
    if isinstance(raw, str) and raw.lstrip().startswith("["):  # a JSON list given with -s
        try:
            raw = json.loads(raw)
        except ValueError:
            raise ConfigError(name, raw, "a list of non-empty strings") from None
    elif isinstance(raw, str):
        raw = [part.strip() for part in raw.split(",") if part.strip()]
    if not isinstance(raw, (list, tuple, set, frozenset)) or not all(
        isinstance(v, str) and v for v in raw
    ):
        raise ConfigError(name, raw, "a list of non-empty strings (or a comma-separated string)")
    return list(raw)


def _headers(settings: BaseSettings, name: str) -> tuple[tuple[str, str], ...]:
    raw = settings.get(name, SETTINGS[name])
    if isinstance(raw, str):  # a JSON object given with -s
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raw = None
    if hasattr(raw, "copy_to_dict"):  # a Scrapy BaseSettings
        raw = raw.copy_to_dict()
    if not isinstance(raw, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str) for k, v in raw.items()):
        raise ConfigError(name, raw, "a dict of header names to string values")
    return tuple(raw.items())


_DEDUP_REDIS_URL = "IDEMPOTENT_DEDUP_REDIS_URL"


def _dedup_redis_url(settings: BaseSettings, database: str) -> str | None:
    """``IDEMPOTENT_DEDUP_REDIS_URL``: None (off), or a Redis URL redis-py reads, with a
    PostgreSQL ``database`` only (the layer saves reads of a server; a SQLite read is local
    and cheaper than a round trip to Redis)."""
    url = _get(settings, _DEDUP_REDIS_URL)
    if url in (None, ""):
        return None
    allowed = ("None (off), or a Redis URL: redis://host:port/db, rediss://host:port/db or "
               "unix:///path/to/redis.sock")
    if not isinstance(url, str) or urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(_DEDUP_REDIS_URL, url if not isinstance(url, str)
                          else shown_url(url), allowed)
    if sqlite_path(database) is not None:
        raise ConfigError(_DEDUP_REDIS_URL, shown_url(url),
                          "None with a SQLite IDEMPOTENT_DATABASE: the Redis layer is for "
                          "the PostgreSQL store (a SQLite read costs less than a round trip "
                          "to Redis)")
    try:
        redis_client(url)
    except ImportError:
        raise ConfigError(_DEDUP_REDIS_URL, shown_url(url),
                          "a Redis URL once the redis client is installed: pip install "
                          "'scrapy-idempotent[redis]'") from None
    except ValueError as exc:
        raise ConfigError(_DEDUP_REDIS_URL, shown_url(url), f"{allowed} ({exc})") from None
    return url
