"""Cookies kept across a resume: a crawl that logged in resumes logged in.

Scrapy's ``CookiesMiddleware`` keeps its cookie jars (one per ``cookiejar`` meta value) in
memory: a killed or stopped crawl forgets them, and a resumed crawl does not log in again,
since the login page is done. Here the jars are copied into the crawl's database (``meta``
row ``cookies``) with the crawl's transactions, at most once per :data:`SNAPSHOT_SECONDS`
and only when a cookie changed, and put back into the middleware's jars when a crawl opens,
session cookies included (expired ones are left out). With several workers each one writes
its own jars: a crawl opening takes the last written (the workers of one crawl usually share
one login). Turned off by ``IDEMPOTENT_KEEP_COOKIES = False`` (nothing of the cookies is
written to the database then).
"""

from __future__ import annotations

import http.cookiejar
import json
import logging
import time
from typing import Any

from .codec import decode_value, encode_value

__all__ = ["SNAPSHOT_SECONDS", "CookieKeeper", "cookies_middleware"]

logger = logging.getLogger(__name__)

#: The jars are copied at most this often (seconds): a cookie set in the last second before a
#: kill may be lost.
SNAPSHOT_SECONDS = 1.0

#: The attributes of :class:`http.cookiejar.Cookie` kept (its constructor's arguments).
_FIELDS = ("version", "name", "value", "port", "port_specified", "domain",
           "domain_specified", "domain_initial_dot", "path", "path_specified", "secure",
           "expires", "discard", "comment", "comment_url", "rfc2109")


def cookies_middleware(crawler: Any) -> Any:
    """The crawl's enabled ``CookiesMiddleware`` (or a subclass), or None."""
    from scrapy.downloadermiddlewares.cookies import CookiesMiddleware

    downloader = getattr(getattr(crawler, "engine", None), "downloader", None)
    manager = getattr(downloader, "middleware", None)
    for middleware in getattr(manager, "middlewares", ()):
        if isinstance(middleware, CookiesMiddleware) and isinstance(
                getattr(middleware, "jars", None), dict):
            return middleware
    return None


class CookieKeeper:
    """Copies the cookie jars of the crawl's ``CookiesMiddleware`` to and from their stored
    form (the middleware is found at :meth:`restore`, once the engine is built)."""

    def __init__(self, crawler: Any, clock: Any = time.monotonic) -> None:
        self.crawler = crawler
        self.clock = clock
        self.middleware: Any = None
        self._last_text: str | None = None
        self._last_at = float("-inf")

    def restore(self, stored: str | None) -> int:
        """Find the middleware and put the stored cookies into its jars; returns how many
        (expired ones left out)."""
        self.middleware = cookies_middleware(self.crawler)
        if not stored or self.middleware is None:
            return 0
        now = time.time()
        restored = 0
        for jar_key, cookies in json.loads(stored):
            jar = self.middleware.jars[decode_value(jar_key)]
            for fields in cookies:
                cookie = http.cookiejar.Cookie(
                    **{name: fields.get(name) for name in _FIELDS if name != "rfc2109"},
                    rest=fields.get("rest") or {}, rfc2109=bool(fields.get("rfc2109")))
                if cookie.is_expired(int(now)):
                    continue
                jar.jar.set_cookie(cookie)
                restored += 1
        self._last_text = stored
        return restored

    def changed(self, *, force: bool = False) -> str | None:
        """The jars' stored form when a cookie changed since the last call that returned
        one (at most once per :data:`SNAPSHOT_SECONDS` unless ``force``), else None."""
        if self.middleware is None:
            return None
        now = self.clock()
        if not force and now - self._last_at < SNAPSHOT_SECONDS:
            return None
        self._last_at = now
        jars = []
        for jar_key, jar in self.middleware.jars.items():
            cookies = [{**{name: getattr(c, name) for name in _FIELDS},
                        "rest": dict(getattr(c, "_rest", {}) or {})} for c in jar.jar]
            if cookies:
                try:
                    jars.append([encode_value(jar_key), cookies])
                except Exception:
                    continue
        text = json.dumps(jars, sort_keys=True, separators=(",", ":"))
        if text == self._last_text or (self._last_text is None and not jars):
            return None
        self._last_text = text
        return text
