"""The garbage collector while a crawl runs (``IDEMPOTENT_GC_FREEZE``).

Most of a crawl process's objects are made before its spider opens (modules, classes,
Scrapy's components, the settings, the store) and live as long as the crawl. CPython walks
all of them again at every full collection, and a crawl with a frontier triggers full
collections often: a page's objects live until its transaction commits, long enough to be
promoted to the oldest generation, whose growth by a quarter starts the next full
collection. When the first crawl of the process with the setting on opens, one collection
clears what is already garbage and :func:`gc.freeze` moves everything still alive to the
permanent generation, which collections skip; when the last such crawl closes,
:func:`gc.unfreeze` gives it back (so a process that runs crawls one after another keeps
nothing of a closed crawl frozen). The reactor's thread only.
"""

from __future__ import annotations

import gc
import logging

__all__ = ["freeze", "thaw"]

logger = logging.getLogger(__name__)

#: the crawls of this process that froze (or joined a freeze) and have not closed yet
_open_crawls = 0


def freeze() -> None:
    """A crawl opens: freeze what is alive, unless an open crawl of this process already
    did (its objects made since then stay collectable)."""
    global _open_crawls
    if _open_crawls == 0:
        gc.collect()
        gc.freeze()
        logger.debug("scrapy_idempotent: %d objects frozen for the crawl",
                     gc.get_freeze_count())
    _open_crawls += 1


def thaw() -> None:
    """A crawl that called :func:`freeze` closes: the last one unfreezes."""
    global _open_crawls
    if _open_crawls <= 0:
        return
    _open_crawls -= 1
    if _open_crawls == 0:
        gc.unfreeze()
