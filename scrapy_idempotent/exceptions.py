"""Exceptions raised by scrapy_idempotent.

Every error the package raises derives from :class:`IdempotentError`, so callers can catch
them all at once. At the Scrapy boundary the components translate them into Scrapy's own
exceptions (``DropItem``, a spider close with a clear reason) where Scrapy expects those.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DeliveryRefused",
    "DeliveryRetry",
    "FeedNotStored",
    "IdempotentError",
    "MissingNaturalKey",
    "NaturalKeyChanged",
    "StoreBusy",
    "StoreError",
    "UnstorableRequest",
    "UnsupportedScrapy",
]


class IdempotentError(Exception):
    """Base class of every error raised by scrapy_idempotent."""

    #: True once the error was logged for the operator (a ``ConfigError`` at the start of a
    #: crawl: one CRITICAL line), so that it is not logged again with a traceback
    reported: bool = False


class ConfigError(IdempotentError, ValueError):
    """A setting has a wrong value.

    Raised while the crawl is being set up, before any request is fetched. The message names
    the setting, the value found and what is allowed.
    """

    def __init__(self, setting: str, value: object, allowed: str) -> None:
        self.setting = setting
        self.value = value
        self.allowed = allowed
        super().__init__(f"{setting}={value!r} is not valid: {allowed}")


class UnsupportedScrapy(IdempotentError, RuntimeError):
    """The running Scrapy lacks an internal hook that exact request completion relies on."""


class UnstorableRequest(IdempotentError, ValueError):
    """A request cannot be stored in the frontier as data.

    ``path`` names the offending value inside the request (for example ``cb_kwargs['rows']``),
    ``request`` is the ``repr`` of the request. Raised at enqueue time so the fault is seen
    where it was made (Scrapy's disk queues instead fall back silently to memory).
    """

    def __init__(self, request: str, path: str, reason: str) -> None:
        self.request = request
        self.path = path
        self.reason = reason
        super().__init__(f"cannot store {request}: {path}: {reason}")


class MissingNaturalKey(IdempotentError, KeyError):
    """An item lacks the field(s) its natural key is made of (missing, None or empty)."""

    def __init__(self, item_type: str, field: str, detail: str = "") -> None:
        self.item_type = item_type
        self.field = field
        message = f"{item_type} item has no natural key: field {field!r} is missing or empty"
        if detail:
            message = f"{message} ({detail})"
        super().__init__(message)

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def describe_key(fields: tuple[str, ...]) -> str:
    """A natural key as users read it: ``sku``, ``sku + color``, or ``the page URL`` for
    none configured (the page URL, or the content of an item of no page)."""
    return " + ".join(fields) if fields else "the page URL"


class NaturalKeyChanged(MissingNaturalKey):
    """An item's record type was stored under other natural key fields than the crawl's
    settings give it now: stored under the new key it would be a second record of the same
    thing. The records are moved to the new key by ``scrapy idempotent rekey``."""

    def __init__(self, record_type: str, stored: tuple[str, ...],
                 configured: tuple[str, ...]) -> None:
        self.record_type = record_type
        self.stored = stored
        self.configured = configured
        field = configured[0] if configured else "<page url>"
        super().__init__(record_type, field)
        self.args = (changed_key_message(record_type, stored, configured),)


def changed_key_message(record_type: str, stored: tuple[str, ...],
                        configured: tuple[str, ...]) -> str:
    """The one line that refuses a crawl whose natural key of ``record_type`` changed."""
    return (f"the records of {record_type} are keyed by {describe_key(stored)}, the settings "
            f"now key it by {describe_key(configured)}: run `scrapy idempotent rekey` to move "
            "the records to the new key (or restore the old key)")


class StoreError(IdempotentError, RuntimeError):
    """The frontier database failed in a way retrying did not cure."""


class StoreBusy(StoreError):
    """Another process held the database's lock longer than the busy timeout allows: the one
    store error worth retrying."""


class DeliveryRefused(IdempotentError):
    """An outbox target refused an announcement for good (a webhook's 4xx answer other than
    408, 409 and 429): the entry is parked as failed with this message as its answer."""


class DeliveryRetry(IdempotentError):
    """An outbox target asks to try an announcement again later (a 5xx, 408, 409 or 429
    answer); ``retry_after_seconds``: the wait it asked for (``Retry-After``), if any."""

    def __init__(self, message: str, retry_after_seconds: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


class FeedNotStored(IdempotentError):
    """Feeds of the run could not be stored (each cause was logged once, with its traceback,
    when it happened): the run is left unfinished, so the next crawl writes them again."""

    reported = True
    #: the close reason the crawl reports (``finish_reason``, ``Spider closed (...)``)
    close_reason = "idempotent_feed_error"

    def __init__(self, failed: list[str]) -> None:
        super().__init__(
            f"{len(failed)} feed(s) not stored: {'; '.join(failed)}; the run is left "
            "unfinished, and the next `scrapy crawl` of the run writes the feeds again")
        self.failed = failed
