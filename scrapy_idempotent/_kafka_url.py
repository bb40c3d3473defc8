"""What a ``kafka://`` queue URL says: the bootstrap servers, the topic, and the client's own
options (librdkafka's names, as query parameters); and the URL as logs show it, secrets
hidden. Imports nothing from the package (read by the configuration and by the Kafka
broker)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

from ._redact import redact_url

__all__ = ["RESERVED_OPTIONS", "KafkaUrl", "parse_kafka_url", "redacted_kafka_url"]

#: Options the queue input sets itself: the URL may not name them. Offsets are committed by
#: the input only, once the messages before them are done (never by the client on a timer).
RESERVED_OPTIONS = {
    "bootstrap.servers": "the URL's host part",
    "metadata.broker.list": "the URL's host part",
    "group.id": "IDEMPOTENT_QUEUE_GROUP",
    "enable.auto.commit": "the queue input commits offsets itself",
    "enable.auto.offset.store": "the queue input commits offsets itself",
}

#: librdkafka options whose value is a secret (hidden in logs).
_SECRET = re.compile(r"password|secret|\.pem$|private", re.IGNORECASE)


@dataclass(frozen=True)
class KafkaUrl:
    """The parts of a ``kafka://user:password@host:port,host2:port/topic?option=value`` URL."""

    servers: str  #: ``bootstrap.servers``: ``host:port,host2:port``
    topic: str  #: the path (empty: none named)
    #: the query parameters (librdkafka's option names), and ``sasl.username`` /
    #: ``sasl.password`` from a user and password before the host
    options: dict[str, str] = field(default_factory=dict)


def parse_kafka_url(url: str) -> KafkaUrl:
    """The parts of ``url`` (no checks beyond splitting it: the client checks its options)."""
    parts = urlsplit(url)
    userinfo, _, servers = parts.netloc.rpartition("@")
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    if userinfo:
        user, _, password = userinfo.partition(":")
        options.setdefault("sasl.username", unquote(user))
        if password:
            options.setdefault("sasl.password", unquote(password))
    return KafkaUrl(servers=servers, topic=parts.path.strip("/"), options=options)


def redacted_kafka_url(url: str) -> str:
    """``url`` as logs and errors show it: the password before the host and every secret
    option (``sasl.password``, ``ssl.key.password``, ...) replaced by ``***``."""
    return redact_url(url, lambda name: bool(_SECRET.search(name)))
