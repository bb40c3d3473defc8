"""A module the security tests must never see imported: a stored request or response naming
it (``_class``) is data from the database, and data must not make the crawl import code.

Importing it leaves a trace in ``sys.modules`` and in :data:`IMPORTED`.
"""

from __future__ import annotations

import scrapy
from scrapy.http import HtmlResponse

IMPORTED = True


class EvilRequest(scrapy.Request):
    """A request subclass that is not allow-listed."""


class EvilResponse(HtmlResponse):
    """A response subclass outside ``scrapy.http.response``."""


def touch(*args: object, **kwargs: object) -> None:
    raise AssertionError("never_imported.touch was called")
