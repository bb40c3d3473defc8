"""Which store a database string names: :func:`open_store`, the one place a backend is chosen.

A database string (``IDEMPOTENT_DATABASE``, ``scrapy idempotent --db``) is either

* a file path: the SQLite store on that file;
* ``sqlite:///PATH``: the same, as a URL (everything after ``sqlite:///`` is the path, so
  ``sqlite:///data/shop.sqlite3`` is the relative path ``data/shop.sqlite3`` and
  ``sqlite:////var/lib/shop.sqlite3`` the absolute ``/var/lib/shop.sqlite3``, as in
  SQLAlchemy's database URLs);
* ``SCHEME://...``: the backend registered for ``SCHEME`` (:data:`BACKENDS`), which receives
  the whole string.

A backend is registered as ``"module:attribute"`` (imported on first use, so that the driver
of a backend nobody uses need not be installed) or as a callable; either way it is called as
``factory(database, **options)`` and returns a :class:`~.FrontierStore` that is not open yet.
Nothing here imports a database driver.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from .._redact import redact_url
from ..exceptions import ConfigError
from .base import FrontierStore

__all__ = ["BACKENDS", "DRIVERS", "StoreFactory", "check_driver", "database_scheme",
           "open_store", "redacted", "register_backend", "sqlite_path"]

#: ``factory(database, **options) -> FrontierStore``
StoreFactory = Callable[..., FrontierStore]

#: URL scheme (lower case) -> the backend's store factory, or ``"module:attribute"`` naming it.
BACKENDS: dict[str, StoreFactory | str] = {
    "sqlite": "scrapy_idempotent.store.sqlite:SQLiteStore",
    # psycopg is imported only when such a database is opened (the postgresql extra)
    "postgresql": "scrapy_idempotent.store.postgresql:PostgreSQLStore",
    "postgres": "scrapy_idempotent.store.postgresql:PostgreSQLStore",
}

#: URL scheme -> (the driver module its backend imports, the extra of this package that
#: installs it): checked when the settings are read (:func:`check_driver`), so a missing
#: driver is one line naming the extra, before the crawl starts.
DRIVERS: dict[str, tuple[str, str]] = {
    "postgresql": ("psycopg", "postgresql"),
    "postgres": ("psycopg", "postgresql"),
}
#: What to install for a driver module by itself (its extra's requirement in setup.cfg).
_REQUIREMENTS = {"psycopg": "psycopg[binary]>=3.2"}

#: ``scheme://`` at the start of a database string (RFC 3986 scheme characters).
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SQLITE_PREFIX = "sqlite:///"
SETTING = "IDEMPOTENT_DATABASE"


def register_backend(scheme: str, factory: StoreFactory | str) -> None:
    """Make ``scheme://...`` database strings open with ``factory`` (a callable, or
    ``"module:attribute"`` imported when such a database is first opened)."""
    BACKENDS[scheme.lower()] = factory


def database_scheme(database: str) -> str | None:
    """The URL scheme of ``database`` in lower case, or None for a file path. Raises
    :class:`~.ConfigError` (naming ``IDEMPOTENT_DATABASE``) for a scheme no backend is
    registered for."""
    match = _SCHEME.match(database)
    if match is None:
        return None
    scheme = match.group(1).lower()
    if scheme not in BACKENDS:
        known = ", ".join(f"{name}://" for name in sorted(BACKENDS))
        raise ConfigError(SETTING, redacted(database),
                          f"a file path, or a URL of a known database ({known}); no backend "
                          f"is registered for {scheme}://")
    return scheme


def check_driver(database: str) -> None:
    """Raise :class:`~.ConfigError` (naming ``IDEMPOTENT_DATABASE`` and the extra to install)
    when the database driver of ``database``'s backend cannot be imported."""
    scheme = database_scheme(database)
    driver = DRIVERS.get(scheme or "")
    if driver is None:
        return
    module, extra = driver
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(SETTING, redacted(database),
                          f"a {scheme}:// database needs {module}, which cannot be imported "
                          f"({exc}): pip install 'scrapy-idempotent[{extra}]' (from a clone: "
                          f"pip install './scrapy_idempotent[{extra}]'; or pip install "
                          f"'{_REQUIREMENTS.get(module, module)}')") from None


def sqlite_path(database: str) -> str | None:
    """The file of a SQLite database string (a path, or a ``sqlite:///PATH`` URL), as
    written (not resolved); None for another backend's URL."""
    scheme = database_scheme(database)
    if scheme is None:
        return database
    if scheme != "sqlite":
        return None
    if not database.lower().startswith(_SQLITE_PREFIX) or database == _SQLITE_PREFIX:
        raise ConfigError(SETTING, redacted(database),
                          "a SQLite URL is sqlite:///PATH: three slashes, then a relative path "
                          "(sqlite:///data/shop.sqlite3), or four for an absolute one "
                          "(sqlite:////var/lib/shop.sqlite3)")
    return database[len(_SQLITE_PREFIX):]


def redacted(database: str) -> str:
    """``database`` as shown in logs and reports: every password of a URL replaced by
    ``***``, the one before the host (``postgresql://crawler:***@db.internal/shop``) and
    those libpq takes as query parameters (``?password=***``, ``?sslpassword=***``)."""
    if not _URL.match(database):
        return database  # a path: nothing in it is a password
    return redact_url(database, lambda name: name.lower() in _SECRET_PARAMETERS)


#: ``scheme://...``
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
#: the query parameters of a libpq URI that carry a secret
_SECRET_PARAMETERS = frozenset({"password", "sslpassword"})


def open_store(database: str, **options: Any) -> FrontierStore:
    """The store of ``database`` (see the module docstring), constructed with ``options``
    (``lease_seconds``, ``max_attempts``, ``synchronous``, ``busy_timeout_seconds``,
    ``recrawl_seconds``, ``clock``) and not open yet: call its :meth:`~.FrontierStore.open`
    (a crawl) or :meth:`~.FrontierStore.open_existing` (the commands).

    Raises :class:`~.ConfigError` naming ``IDEMPOTENT_DATABASE`` for a scheme no backend is
    registered for, or a backend (or its driver, :data:`DRIVERS`) that cannot be loaded."""
    scheme = database_scheme(database)
    path = sqlite_path(database)
    check_driver(database)
    factory = _factory(scheme or "sqlite", database)
    return factory(path if path is not None else database, **options)


def _factory(scheme: str, database: str) -> StoreFactory:
    factory = BACKENDS[scheme]
    if not isinstance(factory, str):
        return factory
    module_name, _, attribute = factory.partition(":")
    try:
        loaded: Any = importlib.import_module(module_name)
        for name in attribute.split("."):
            loaded = getattr(loaded, name)
    except ImportError as exc:
        raise ConfigError(SETTING, redacted(database),
                          f"a database whose backend can be loaded: {scheme}:// needs "
                          f"{module_name}, which failed to import ({exc})") from exc
    if not callable(loaded):
        raise TypeError(f"the store backend of {scheme}:// ({factory}) is not callable")
    return loaded  # type: ignore[no-any-return]
