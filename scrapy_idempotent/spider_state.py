"""``spider.state`` kept in the crawl's database, committed with the pages that changed it.

Scrapy's ``SpiderState`` extension (with ``JOBDIR``) loads ``spider.state`` at open and saves
it at a clean close only: after a kill, the work of the killed process is missing from it.
Here the state is the crawl's: restored from the database when the crawl opens (the add-on
turns Scrapy's extension off, so ``JOBDIR`` has no say over it), and every change a callback
makes is committed in the transaction of that callback's page, so that after any kill the
state holds exactly the changes of the committed pages.

How a change is attributed: the spider middleware compares the state with the state it last
saw at each step of a callback (before it runs, and after each output it yields), and gives
what changed to that callback's page (:class:`StateTracker`). Changes made elsewhere (an
errback of a download error, a signal handler, ``start()``) go with the next transaction.
A change is a list of :class:`~.store.base.StateChange`: a number that changed is an
``add`` of the difference, and a number that appears an ``add`` of itself (so counters of
pages committed add up, whatever the order, and those of several workers too), a dict is
compared key by key (keys that are strings), and any other value is ``set`` (the last
committed write wins); a removed key is a ``delete``.

Values are stored as tagged JSON (:mod:`.codec`: numbers, text, lists, dicts, sets,
dates, ``Decimal``...); a value with no data form is not stored (one warning, counted in
``idempotent/state/unstorable``). Each comparison costs a walk over the state: keep it small
(counters, cursors, a few IDs), not a set of everything seen (the frontier already knows
what was fetched).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from .codec import EncodeError, decode_value, encode_value
from .store.base import StateChange

__all__ = ["StateTracker", "state_changes"]

logger = logging.getLogger(__name__)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _walkable(value: Any) -> bool:
    """A dict compared key by key: a plain dict of string keys (none tagged-JSON-like)."""
    return type(value) is dict and all(
        isinstance(key, str) and not key.startswith("$") for key in value)


def state_changes(old: dict[str, Any], new: dict[str, Any],
                  path: tuple[str, ...] = ()) -> list[tuple[str, tuple[str, ...], Any]]:
    """What turned ``old`` into ``new``: ``(op, path, value)`` with ``value`` a Python
    value (encoded later), in key order of ``new`` after the removals."""
    found: list[tuple[str, tuple[str, ...], Any]] = []
    for key in old:
        if key not in new:
            found.append(("delete", (*path, key), None))
    for key, value in new.items():
        if key in old:
            before = old[key]
            if type(before) is type(value) and before == value:
                continue
            if _number(before) and _number(value):
                found.append(("add", (*path, key), value - before))
                continue
            if _walkable(before) and _walkable(value):
                found.extend(state_changes(before, value, (*path, key)))
                continue
        elif _number(value):  # a counter that starts (from 0: another worker's adds up)
            found.append(("add", (*path, key), value))
            continue
        elif _walkable(value):  # a dict that starts: its keys one by one (counters add)
            found.extend(state_changes({}, value, (*path, key)))
            continue
        found.append(("set", (*path, key), value))
    return found


class StateTracker:
    """The spider's state as last seen, and what changed since (see the module docstring)."""

    def __init__(self, stats: Any) -> None:
        self.stats = stats
        self.spider: Any = None
        self._seen: dict[str, Any] = {}
        self._warned: set[str] = set()

    def restore(self, spider: Any, stored: dict[str, Any]) -> None:
        """Give ``spider`` its committed ``state`` (tagged JSON as stored)."""
        self.spider = spider
        state = decode_value(stored) if stored else {}
        spider.state = state if isinstance(state, dict) else {}
        self._seen = copy.deepcopy(spider.state)

    def changes(self) -> list[StateChange]:
        """What changed since the last call (nothing before :meth:`restore`)."""
        spider = self.spider
        if spider is None:
            return []
        state = getattr(spider, "state", None)
        if not isinstance(state, dict):
            self._warn("replaced", "spider.state is no dict any more: its changes are not "
                                   "stored (keep it a dict and change its keys)")
            return []
        if state == self._seen:
            return []
        found = state_changes(self._seen, state)
        self._seen = copy.deepcopy(state)
        changes = []
        for op, path, value in found:
            if op == "set":
                try:
                    value = encode_value(value)
                except EncodeError as exc:
                    self.stats.inc_value("idempotent/state/unstorable")
                    self._warn(f"value:{'/'.join(path)}",
                               f"spider.state[{']['.join(map(repr, path))}] holds "
                               f"{exc.type_name}, which has no data form: it is not stored")
                    continue
            changes.append(StateChange(op, path, value))
        return changes

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("scrapy_idempotent: %s", message)
