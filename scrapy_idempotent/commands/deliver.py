"""``scrapy idempotent deliver``: sends the outbox's pending announcements to the configured
targets (what a killed crawl, or a receiver that was down, left), for at most
``IDEMPOTENT_OUTBOX_DRAIN_SECONDS``; exit code 1 when some are left."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..exceptions import IdempotentError
from ..outbox import target_label
from ._common import print_report, table

if TYPE_CHECKING:
    import argparse

    from ..config import IdempotentConfig
    from ..store.base import FrontierStore
    from ._common import Opened

DESCRIPTION = ("send the outbox's pending announcements to IDEMPOTENT_OUTBOX_TARGETS; exit 1 "
               "if some are left")


def run(opened: Opened, opts: argparse.Namespace) -> int:
    store, config, settings = opened.store, opened.config, opened.settings
    if not config.outbox_targets:
        raise IdempotentError(
            "IDEMPOTENT_OUTBOX_TARGETS is empty: there is nowhere to deliver to")
    from scrapy.utils.defer import deferred_from_coro
    from scrapy.utils.reactor import install_reactor, is_reactor_installed

    if not is_reactor_installed():
        install_reactor(settings["TWISTED_REACTOR"] or
                        "twisted.internet.asyncioreactor.AsyncioSelectorReactor",
                        settings["ASYNCIO_EVENT_LOOP"])
    from twisted.internet import reactor as installed

    reactor: Any = installed
    outcome: list[Any] = []

    def finish(result: Any) -> None:
        outcome.append(result)
        reactor.stop()

    def start() -> None:
        deferred_from_coro(_deliver_all(store, config, settings)).addBoth(finish)

    reactor.callWhenRunning(start)
    reactor.run()
    if not outcome:  # the reactor was stopped from outside (a signal)
        raise IdempotentError("interrupted; what was not recorded as delivered is sent "
                              "again by the next `deliver` or crawl")
    from twisted.python.failure import Failure

    if isinstance(outcome[0], Failure):
        outcome[0].raiseException()
    counts, left = outcome[0]
    report = {"database": opened.path, **counts, "pending": left,
              "outbox": store.outbox_counts()}
    lines = [f"Delivered {counts['delivered']}, retried {counts['pending']}, failed "
             f"{counts['failed']}; {left} still pending"]
    lines += table(["target", "pending", "delivered", "failed"],
                   [[target_label(target), n["pending"], n["delivered"], n["failed"]]
                    for target, n in report["outbox"].items()])
    print_report(opts, report, lines)
    return 1 if left else 0


async def _deliver_all(store: FrontierStore, config: IdempotentConfig,
                       settings: Any) -> tuple[dict[str, int], int]:
    from scrapy import Spider
    from scrapy.crawler import Crawler

    from ..outbox import Deliverer, build_targets

    crawler = Crawler(Spider, settings)
    deliverer = Deliverer(store, build_targets(config, crawler),
                          concurrency=config.outbox_concurrency,
                          timeout_seconds=config.outbox_timeout_seconds,
                          retry_seconds=config.outbox_retry_seconds,
                          retry_max_seconds=config.outbox_retry_max_seconds)
    try:
        left = await deliverer.drain(config.outbox_drain_seconds)
    finally:
        await deliverer.close()
    return deliverer.counts, left
