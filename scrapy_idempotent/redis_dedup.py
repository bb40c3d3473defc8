"""A shared fast layer for the duplicate check of links: a Redis positive cache of the requests
the frontier holds durably (``IDEMPOTENT_DEDUP_REDIS_URL``).

Most links a crawl meets are rediscovered: the page they lead to is known to the frontier
(pending, leased or done). The scheduler refuses a known link without writing it; to know,
it asks the worker's memory of known entries, then the database (one read for a page's
links). :class:`RedisKnownRequests` sits between the two: a Redis hash, shared by every worker
of the crawl, of the fingerprints the frontier is known to hold. "Known" from Redis refuses
the link with no database read; anything else (not in the hash, Redis unreachable) goes on to
the database as without the layer. So the layer can only save reads, never admit or refuse
a link the database would answer otherwise, as long as the hash never says "known" for an
entry the database would answer "new". What makes that hold:

* A fingerprint enters the hash only after the transaction that made its entry durable has
  committed (:meth:`RedisKnownRequests.committed`, on the writer's thread right after the
  commit), or after a read of the database found it. A kill between the commit and the
  write leaves the hash short, and the database answers. (Marking a link "seen" before its
  page's commit, as ``SET NX`` designs do, loses it for good when the worker dies before
  the commit: every worker then refuses a link the database never got.)
* The hash is named by the frontier's id (:meth:`~.FrontierStore.frontier_id`: one per
  database or PostgreSQL schema; a copy made by ``migrate`` has its own), the run (a new run
  empties the frontier: its hash starts empty) and the recrawl window. Within one run the
  crawl removes no entry from the frontier; the operator commands that write put entries
  back to pending (``retry``), which stay known.
* With a recrawl window (``IDEMPOTENT_RECRAWL_SECONDS``), a done entry is due again once the
  window it finished in is over: each fingerprint's value holds the end of the window its
  entry was known in (at the latest, the one its commit began in), past which the hash no
  longer answers for it. Without a window, known stays known for the run.
* Values say ``done`` (already done: the refusal sends ``request_done`` as the database's
  answer would) or ``pending``; a pending one never replaces a done one (``HSETNX``).

Errors: any Redis error (unreachable, timeout, out of memory) is logged once as a WARNING and
counted (``idempotent/dedup/redis_errors``); for :data:`RETRY_SECONDS` every link goes to the
database, then Redis is tried again. Nothing is lost meanwhile: the hash is only short (the
writes it missed), and the database answers.

Stale hashes (old runs, old windows) expire :data:`KEY_TTL_SECONDS` after their last write.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from twisted.python import threadable

from ._redact import redact_url
from .store.base import CommitResult, FrontierStore, UnitOfWork

__all__ = ["BATCH", "BATCH_SECONDS", "KEY_PREFIX", "KEY_TTL_SECONDS", "RETRY_SECONDS",
           "SOCKET_TIMEOUT_SECONDS", "RedisKnownRequests", "redis_client"]

logger = logging.getLogger(__name__)

#: The hashes' names: ``<prefix>:<frontier id>:<run>:<window seconds, or "none">``.
KEY_PREFIX = "scrapy_idempotent:known"
#: A hash expires this long (seconds) after its last write (old runs' and windows' hashes).
KEY_TTL_SECONDS = 7 * 86400
#: After a Redis error, links go to the database for this long (seconds) before Redis is
#: tried again.
RETRY_SECONDS = 30.0
#: A page's links announced before they are enqueued are read from Redis in one command of
#: at most this many fingerprints ...
BATCH = 500
#: ... whose answers are used for this long (seconds): the links of a page are enqueued
#: right after its callback yielded them.
BATCH_SECONDS = 1.0
#: How long (seconds) one Redis command may take (connecting included) unless the URL says
#: otherwise (``?socket_timeout=``): the reactor waits that long at most for a lookup.
SOCKET_TIMEOUT_SECONDS = 1.0
#: The window a value names ends this long (seconds) before the one of the clock read before
#: the commit, when they differ: no clock step between workers can make it later.
_CLOCK_MARGIN_SECONDS = 1.0
#: How often (seconds) a hash's expiry is pushed back by the writes to it.
_EXPIRE_EVERY_SECONDS = 60.0

#: At most this many answers of the database wait for the next commit to be written.
_LEARNED_AT_MOST = 10_000

_DONE = "already_done"
_PENDING = "duplicate"


def redis_client(url: str) -> Any:
    """A redis-py client for ``url`` (``redis://``, ``rediss://``, ``unix://``) with short
    timeouts and no retries of its own (an error sends the links to the database). Raises
    ImportError without the ``redis`` extra, ValueError for a URL redis-py cannot read.
    Connects only when first used."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    options: dict[str, Any] = {"retry": Retry(NoBackoff(), 0)}
    if "socket_timeout=" not in url:
        options["socket_timeout"] = SOCKET_TIMEOUT_SECONDS
    if "socket_connect_timeout=" not in url:
        options["socket_connect_timeout"] = SOCKET_TIMEOUT_SECONDS
    return redis.Redis.from_url(url, **options)


def _field(fingerprint: str) -> bytes:
    """A fingerprint (or key) as stored in a hash: its 20 bytes (about 81 bytes of Redis
    memory a field with its value; as 40 hex characters, 17 more)."""
    try:
        return bytes.fromhex(fingerprint)
    except ValueError:  # (not hex: kept as it is)
        return fingerprint.encode()


def shown_url(url: str) -> str:
    """``url`` as logged: its password replaced by ``***``."""
    return redact_url(url, lambda name: name.lower() == "password")


class RedisKnownRequests:
    """The store's duplicate check (:meth:`known_request`, :meth:`expect_lookups`) with a
    Redis hash in front of the database (see the module docstring). ``count(name, n)`` adds
    to a stat (``idempotent/dedup/...``). Lookups run on the reactor's thread,
    :meth:`committed` on the writer's."""

    def __init__(self, store: FrontierStore, client: Any, *, url: str,
                 recrawl_seconds: float | None,
                 count: Callable[[str, int], None] | None = None) -> None:
        self.store = store
        self.client = client
        self.url = shown_url(url)
        self.recrawl_seconds = recrawl_seconds
        self._count = count or (lambda name, n: None)
        self._frontier: str | None = None
        self._expected: set[str] = set()  #: fingerprints announced, not read yet
        #: the last batch read's values (None: not in the hash, or no longer valid)
        self._read: dict[str, bytes | None] = {}
        self._read_at = 0.0
        self._lock = threading.Lock()
        #: what reads of the database found known, to be written with the next commit's
        #: fingerprints: (hash, fingerprint, value, done)
        self._learned: list[tuple[str, str, bytes, bool]] = []
        self._down_until = 0.0  #: time.monotonic() before which Redis is not asked
        self._warned = False
        self._expiry_pushed: dict[str, float] = {}

    def open(self) -> None:
        """Once the store is open (its frontier has an id): name the hashes by it."""
        self._frontier = self.store.frontier_id()

    def close(self) -> None:
        """Close the client's connections (at the crawl's close)."""
        try:
            self.client.close()
        except Exception:  # (closing: nothing to do about it)
            logger.debug("scrapy_idempotent: closing the Redis client", exc_info=True)

    def key(self, run_id: int | None) -> str:
        """The hash of run ``run_id`` of this frontier (for this recrawl window)."""
        window = "none" if self.recrawl_seconds is None else f"{self.recrawl_seconds:g}"
        return f"{KEY_PREFIX}:{self._frontier}:{run_id}:{window}"

    # -- lookups (the reactor's thread) -------------------------------------------------------

    def expect_lookups(self, fingerprints: Collection[str]) -> None:
        """The links of a page, announced before they are enqueued: those the worker's
        memory does not hold are read from Redis in one command when the first is asked;
        while Redis is not asked, the store reads them in one statement."""
        if not self._usable():
            self.store.expect_lookups(fingerprints)
            return
        for fingerprint in fingerprints:
            if len(self._expected) >= BATCH:
                return
            if self.store.remembered_request(fingerprint) is None:
                self._expected.add(fingerprint)

    def known_request(self, fingerprint: str, *, key: str | None = None) -> str | None:
        """As :meth:`~.FrontierStore.known_request`: the worker's memory, then Redis (known:
        answered with no read), then the database."""
        if key is not None:
            return self.store.known_request(fingerprint, key=key)
        answer = self.store.remembered_request(fingerprint)
        if answer is not None:
            return answer
        if self._usable():
            run_id = self.store.run_id
            answer = self._cached(fingerprint, run_id)
            if answer is not None:
                self._count("idempotent/dedup/redis_hits", 1)
                return answer
            if self._frontier is not None and self._usable():
                self._count("idempotent/dedup/redis_misses", 1)
        began = self.store.clock()
        run_id = self.store.run_id
        answer = self.store.known_request(fingerprint)
        if answer is not None and self._frontier is not None \
                and len(self._learned) < _LEARNED_AT_MOST:
            done = answer == _DONE
            with self._lock:  # written with the next commit's fingerprints
                self._learned.append((self.key(run_id), fingerprint,
                                      self._value(done, began), done))
        return answer

    def _cached(self, fingerprint: str, run_id: int | None) -> str | None:
        """Redis's answer for ``fingerprint``: from the read of its page's links (made now
        when it was announced), else one ``HGET``; None when it does not know it."""
        if self._frontier is None:
            return None
        now = time.monotonic()
        if fingerprint in self._expected:
            self._read_expected(run_id, now)
        value: bytes | None
        if fingerprint in self._read and now - self._read_at < BATCH_SECONDS:
            value = self._read.pop(fingerprint)
        else:
            value = self._ask(lambda: self.client.hget(self.key(run_id), _field(fingerprint)))
        return None if value is None else self._answer(value)

    def _read_expected(self, run_id: int | None, now: float) -> None:
        fingerprints = sorted(self._expected)
        self._expected.clear()
        values = self._ask(lambda: self.client.hmget(
            self.key(run_id), [_field(fingerprint) for fingerprint in fingerprints]))
        self._read_at = now
        if values is None:  # Redis failed: the database reads them in one statement
            self._read = {}
            self.store.expect_lookups(fingerprints)
            return
        self._read = dict(zip(fingerprints, values, strict=True))
        misses = [fingerprint for fingerprint, value in self._read.items()
                  if value is None or self._answer(value) is None]
        if misses:
            self.store.expect_lookups(misses)

    def _ask(self, command: Callable[[], Any]) -> Any:
        """``command()``, or None after a Redis error (see :meth:`_failed`)."""
        try:
            return command()
        except Exception as exc:  # redis.RedisError, and an OSError redis-py let through
            self._failed(exc)
            return None

    # -- values -------------------------------------------------------------------------------

    def _value(self, done: bool, at: float) -> bytes:
        """The value of an entry known (``done``: finished) at ``at`` or later: without a
        window ``1`` (done) or ``0``; with one, twice the number of the window after it, plus
        one when done."""
        if self.recrawl_seconds is None:
            return b"1" if done else b"0"
        ends = math.floor((at - _CLOCK_MARGIN_SECONDS) / self.recrawl_seconds) + 1
        return str(2 * ends + done).encode()

    def _answer(self, value: bytes) -> str | None:
        """``known_request``'s answer a value gives now: None once its window is over (or
        for a value this layer did not write)."""
        try:
            number = int(value)
        except ValueError:
            return None
        if self.recrawl_seconds is not None and \
                (number >> 1) * self.recrawl_seconds <= self.store.clock():
            return None
        return _DONE if number & 1 else _PENDING

    # -- writes (the writer's thread) ----------------------------------------------------------

    def committed(self, work: UnitOfWork, result: CommitResult, began: float) -> None:
        """After ``work`` committed (``began``: the store's clock before its transaction):
        the fingerprints of the requests it holds durably now (added, or known already),
        and the entries it finished, are written to the run's hash, with those reads found
        known meanwhile. One round trip; a Redis error leaves the hash short."""
        with self._lock:
            learned, self._learned = self._learned, []
        if self._frontier is None or not self._usable():
            return
        key = self.key(self.store.run_id)  # the run the commit wrote in (it may move it)
        lost = set(result.lost)
        pending = self._value(False, began)
        done = self._value(True, began)
        adds = [(key, r.fingerprint, pending, False) for r in work.requests
                if r.parent_key not in lost]
        adds += [(key, c.key, done, True) for c in work.completions
                 if c.state.terminal and c.key not in lost]
        self._write([*learned, *adds])

    def _write(self, adds: Sequence[tuple[str, str, bytes, bool]]) -> None:
        if not adds:
            return
        pipe = self.client.pipeline(transaction=False)
        finished: dict[str, dict[bytes, bytes]] = {}
        for key, fingerprint, value, done in adds:
            if done:
                finished.setdefault(key, {})[_field(fingerprint)] = value
            else:
                pipe.hsetnx(key, _field(fingerprint), value)  # never over a done one
        for key, values in finished.items():
            pipe.hset(key, mapping=values)
        now = time.monotonic()
        for key in {add[0] for add in adds}:
            if now - self._expiry_pushed.get(key, -math.inf) >= _EXPIRE_EVERY_SECONDS:
                self._expiry_pushed[key] = now
                pipe.expire(key, KEY_TTL_SECONDS)
        self._ask(pipe.execute)

    # -- errors -----------------------------------------------------------------------------

    def _usable(self) -> bool:
        down = self._down_until
        if not down:
            return True
        if time.monotonic() < down:
            return False
        with self._lock:
            if self._down_until:
                self._down_until = 0.0
                logger.info("scrapy_idempotent: asking the Redis dedup cache at %s again",
                            self.url)
        return True

    def _failed(self, exc: BaseException) -> None:
        with self._lock:  # (the reactor's or the writer's thread: their own state stays)
            self._down_until = time.monotonic() + RETRY_SECONDS
            self._learned = []
            first, self._warned = not self._warned, True
        if threadable.isInIOThread():  # type: ignore[no-untyped-call]
            self._count("idempotent/dedup/redis_errors", 1)
        else:  # Scrapy's stats are the reactor thread's: a new key from here could break
            from twisted.internet import reactor  # a reader iterating them meanwhile

            reactor.callFromThread(self._count, "idempotent/dedup/redis_errors", 1)
        if first:
            logger.warning(
                "scrapy_idempotent: the Redis dedup cache at %s failed (%s): links are checked "
                "against the database meanwhile (nothing is lost), and Redis is asked again "
                "every %g s", self.url, exc, RETRY_SECONDS)
        else:
            logger.info("scrapy_idempotent: the Redis dedup cache at %s failed again (%s)",
                        self.url, exc)

