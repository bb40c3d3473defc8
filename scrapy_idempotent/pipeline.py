"""``UpsertPipeline``: items become records, committed with their request's completion.

Put it last (the highest number in ``ITEM_PIPELINES``; the add-on uses 1000), so what it stores
is what every other pipeline let through. A record is inserted the first time its record ID
is seen, updated only when its content hash changed (``last_changed`` moves, ``first_seen``
never does), and otherwise left alone. The write happens in the transaction that marks the
producing request done, so a crash leaves either both or neither.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from itemadapter import is_item
from scrapy.exceptions import DropItem

from . import scrapy_compat
from .codec import EncodeError, dumps
from .crawl import inflight_tracker
from .records import item_type_name
from .store.base import Reject

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from typing_extensions import Self

    from .inflight import InflightTracker

__all__ = ["UpsertPipeline"]

logger = logging.getLogger(__name__)


class UpsertPipeline:
    """Item pipeline: upsert every item as a record keyed by its record ID.

    An item without its natural key (missing, None or empty), or with a value that has no
    JSON form, is kept in the ``rejects`` table, counted (``idempotent/records/rejected``) and
    dropped with a :class:`~scrapy.exceptions.DropItem` naming the item type and field.
    """

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        self.tracker: InflightTracker | None = None
        self._not_items: set[str] = set()  # types warned about

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        return cls(crawler)

    # ``spider``: Scrapy 2.13 passes it; later releases do not (see :mod:`.scrapy_compat`).
    def open_spider(self, spider: Spider | None = None) -> None:
        with scrapy_compat.start_failure_exits_nonzero(self.crawler):
            self.tracker = inflight_tracker(self.crawler, type(self).__name__)

    def process_item(self, item: Any, spider: Spider | None = None) -> Any:
        tracker = self.tracker
        if tracker is None:  # outside a crawl (see scrapy_idempotent.crawl)
            return item
        if not is_item(item):
            # Scrapy passes any object yielded as an item to the pipelines; one that no
            # itemadapter adapter knows has no fields to key or store
            name = item_type_name(item)
            if name not in self._not_items:
                self._not_items.add(name)
                logger.warning("scrapy_idempotent: %s objects are not items (no itemadapter "
                               "adapter knows them): passed on, not stored", name)
            return item
        origin = tracker.take_item(item)
        reason: str | None = None
        if origin.error is not None:
            reason = str(origin.error)
        else:
            assert origin.record_id is not None and origin.key_values is not None
            try:
                record = tracker.identity.record(item, origin.record_id, origin.key_values)
            except EncodeError as exc:
                reason = f"{item_type_name(item)} item: {exc}"
            else:
                tracker.add_record(origin, record)
                return item
        try:
            data = dumps(item, items=True)
        except EncodeError:
            data = repr(item)
        tracker.add_reject(origin, Reject(
            item_type=item_type_name(item), reason=reason, data=data,
            request_key=origin.producer.key if origin.producer is not None else None,
            page_url=origin.page_url,
        ))
        raise DropItem(f"scrapy_idempotent: {reason}; kept in the rejects table")
