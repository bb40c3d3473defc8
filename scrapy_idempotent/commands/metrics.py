"""``scrapy idempotent metrics --listen HOST:PORT``: the whole crawl's figures for Prometheus
at ``http://HOST:PORT/metrics``, read from the database at each scrape
(:class:`~scrapy_idempotent.metrics.StoreCollector`), so any host that reaches the database
can serve them, and a killed worker's figures are not lost. A database that does not exist
yet (the exporter started before the first crawl) is ``idempotent_store_up 0`` until a crawl
creates it. Runs until SIGINT or SIGTERM."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

from scrapy.exceptions import UsageError

from ..exceptions import StoreError
from ._common import open_crawl_store

if TYPE_CHECKING:
    import argparse

    from ..store.base import FrontierStore
    from ._common import Located

DESCRIPTION = ("serve the whole crawl's figures, read from the database at each scrape, for "
               "Prometheus (--listen HOST:PORT, path /metrics)")

#: Where ``--listen`` serves by default.
LISTEN = "127.0.0.1:9810"


def listen_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as a host and a port number; raises
    :class:`~scrapy.exceptions.UsageError` for anything else."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--listen {text!r}: give HOST:PORT, e.g. 0.0.0.0:9810")
    return host, int(port)


def serve(located: Located, command_settings: Any, opts: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; the exit code. ``located``: the crawl's store, not
    opened (each scrape opens its own, read-only)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise StoreError("the metrics command needs prometheus_client: pip install "
                         "'scrapy_idempotent[metrics]'") from None
    from ..metrics import StoreCollector

    spider, db = opts.spider, opts.db

    def open_store() -> FrontierStore:  # one per scrape, on the HTTP server's thread
        opened = open_crawl_store(command_settings, spider, db)
        try:
            info = opened.store.open_existing(readonly=True, identity=opened.identity)
            if not info.current:
                raise StoreError(
                    f"{opened.path} has schema version {info.version}; this "
                    f"scrapy_idempotent reads version {info.supported}")
        except BaseException:
            opened.store.close()
            raise
        return opened.store

    probe = None
    queue = located.config.queue
    if queue is not None:  # the queue input's depth, read in the background
        from ..metrics import QueueProbe
        from ..queue_input import broker_for

        probe = QueueProbe(lambda: broker_for(queue, "scrapy-idempotent-metrics"))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(open_store, queue=probe))
    host, port = listen_address(opts.listen or LISTEN)
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise StoreError(f"cannot listen on {host}:{port}: {exc}") from None
    print(f"scrapy idempotent metrics: serving {located.path} at "
          f"http://{host}:{server.server_port}/metrics", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown())
    try:
        thread.join()
    except KeyboardInterrupt:
        server.shutdown()
    server.server_close()
    if probe is not None:
        probe.close()
    return 0
