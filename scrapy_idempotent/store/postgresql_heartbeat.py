"""Worker liveness across hosts in the PostgreSQL store (see the module docstring of
:mod:`.postgresql`, **Worker liveness across hosts**): :class:`PostgreSQLHeartbeat` (mixed
into :class:`~.postgresql.PostgreSQLStore`) writes this session's heartbeat from a thread of
its own, and says whether this worker may judge others dead by theirs."""

from __future__ import annotations

import logging
import threading

from .postgresql_connection import PostgreSQLConnections

__all__ = ["PostgreSQLHeartbeat"]

logger = logging.getLogger("scrapy_idempotent.store.postgresql")


class PostgreSQLHeartbeat(PostgreSQLConnections):
    """This session's heartbeat (a mixin of ``PostgreSQLStore``, whose constructor sets the
    attributes below)."""

    session_id: int | None
    heartbeat_seconds: float | None
    dead_after_seconds: float | None
    _beats: tuple[float, float] | None
    _beat_thread: threading.Thread | None
    _beat_stop: threading.Event | None

    # -- heartbeat --------------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Write this session's heartbeat now (one statement)."""
        if self.session_id is None:
            return
        now = self.clock()
        try:
            with self._write("writing the heartbeat") as cur:
                cur.execute("UPDATE sessions SET heartbeat_at = %s WHERE session_id = %s",
                            (now, self.session_id))
        except BaseException:
            self._beats = None  # no judging of others until this worker beats again
            raise
        self._beaten(now)

    def _beaten(self, written: float) -> None:
        """A heartbeat stamped ``written`` is in the database now: the series of this
        worker's beats goes on, or starts again after a gap (or a beat that took long: it
        waited for the server) of more than two heartbeat periods."""
        done = self.clock()
        period = 2 * (self.heartbeat_seconds or 0.0)
        first, latest = self._beats or (done, done)
        if done - latest > period or done - written > period:
            first = done
        self._beats = (first, done)

    def _judges(self, now: float) -> bool:
        """Whether this worker may judge others by their heartbeats now. After an outage of
        the server (or of this worker's network) no worker could beat, so stale heartbeats
        say nothing until the live ones have had the time to beat again: a worker judges once
        its own heartbeats have been written for two heartbeat periods without a gap (a live
        peer beats within one period of the server being reachable again), and only while
        they go on. Its own liveness, not its connection's age: a worker started just after
        a peer was killed takes the peer's leases once the peer's heartbeat is
        :attr:`dead_after_seconds` old, or two periods after its own start if that is later.
        Without a heartbeat thread (beats written by hand) it judges once connected for
        :attr:`dead_after_seconds`."""
        if self.dead_after_seconds is None:
            return False
        if self.heartbeat_seconds is None:
            return now - self._connected_since >= self.dead_after_seconds
        beats, period = self._beats, 2 * self.heartbeat_seconds
        return beats is not None and now - beats[1] <= period and beats[1] - beats[0] >= period

    def _start_heartbeat(self) -> None:
        if self.heartbeat_seconds is None or self._beat_thread is not None:
            return
        stop = threading.Event()
        interval = self.heartbeat_seconds

        def beat() -> None:
            failing = False
            while not stop.wait(interval):
                try:
                    self.heartbeat()
                except Exception as exc:  # the next beat tries again, on a new connection
                    if not failing:
                        logger.warning("scrapy_idempotent: cannot write the heartbeat: %s", exc)
                    failing = True
                else:
                    failing = False
            conn = getattr(self._local, "conn", None)
            if conn is not None:
                self._drop(conn)

        self._beat_stop = stop
        self._beat_thread = threading.Thread(target=beat, name="scrapy_idempotent heartbeat",
                                             daemon=True)
        self._beat_thread.start()

    def _stop_heartbeat(self) -> None:
        if self._beat_stop is not None:
            self._beat_stop.set()
        if self._beat_thread is not None and self._beat_thread is not threading.current_thread():
            self._beat_thread.join(timeout=30)
        self._beat_stop = self._beat_thread = None
