"""Secrets out of URLs shown in logs and errors: the password before the host, and the
query parameters that carry one."""

from __future__ import annotations

import re
from collections.abc import Callable
from urllib.parse import unquote

__all__ = ["redact_url"]

#: the password of ``scheme://user:password@host...``
_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^/?#@:]*:)[^/?#]*@")


def redact_url(url: str, secret: Callable[[str], bool]) -> str:
    """``url`` with the password before its host, and the value of every query parameter
    whose (unquoted) name ``secret`` accepts, replaced by ``***``."""
    shown = _PASSWORD.sub(r"\1***@", url, count=1)
    base, mark, rest = shown.partition("?")
    if not mark:
        return shown
    query, hash_, fragment = rest.partition("#")
    parts = []
    for part in query.split("&"):
        name, equals, _ = part.partition("=")
        if equals and secret(unquote(name)):
            part = f"{name}=***"
        parts.append(part)
    return f"{base}?{'&'.join(parts)}{hash_}{fragment}"
