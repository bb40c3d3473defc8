"""Sessions' ends and leases in the SQL store: :class:`SqlLeases` (mixed into
:class:`~.sql.SqlStore`) ends a worker's session (its leases given back, its claims ahead
uncounted, the run finished when nothing is left), releases the leases of workers gone, and
reads who holds leases and whether anything is claimable."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .base import CommitResult, FrontierStatus, LeaseHolder, Reclaimed, SlotLimits
from .sql_dialect import _PENDING_AGAIN, SqlDialect

__all__ = ["SqlLeases"]


class SqlLeases(SqlDialect):
    """A session's end and the leases' release and reads (a mixin of ``SqlStore``)."""

    slot_limits: SlotLimits | None

    #: whether any request is pending or leased: one probe of each state's partial index
    #: (``state IN (...)`` is neither's condition: it read the table, every done request of
    #: it; a count reads every entry of them)
    UNFINISHED = ("SELECT EXISTS (SELECT 1 FROM requests WHERE state = 'pending')"
                  " OR EXISTS (SELECT 1 FROM requests WHERE state = 'leased')")

    def _lock_frontier(self, cur: Any) -> None:
        raise NotImplementedError

    def end_session(self, worker: str, reason: str, inflight: Sequence[str] = (), *,
                    finish_run: bool = True) -> int:
        now = self.clock()
        with self._write("closing") as cur:
            finishing = reason == "finished" and finish_run and self.run_id is not None
            if finishing:
                self._lock_frontier(cur)
            unstarted = self._stopping(cur, worker, inflight)
            self._add_to_counter(cur, "leased", -unstarted)
            released = self._release(cur, [worker])
            cur.execute(self._q("UPDATE sessions SET ended_at = ?, reason = ?"
                                " WHERE worker = ? AND ended_at IS NULL"), (now, reason, worker))
            if finishing:
                (busy,) = cur.execute(self.UNFINISHED).fetchall()[0]
                if not busy:
                    cur.execute(self._q("UPDATE runs SET finished_at = ?, reason = ?"
                                        " WHERE run_id = ? AND finished_at IS NULL"),
                                (now, reason, self.run_id))
        return released

    def unfinished(self) -> bool:
        (busy,) = self._crawl_select(self.UNFINISHED)[0]
        return bool(busy)

    def status(self, worker: str) -> FrontierStatus:
        claimable, elsewhere = self._crawl_select(
            "SELECT EXISTS (SELECT 1 FROM requests WHERE state = 'pending'),"
            " EXISTS (SELECT 1 FROM requests WHERE state = 'leased'"
            "  AND (worker <> ? OR leased_until < ?))", (worker, self.clock()))[0]
        return FrontierStatus(claimable=bool(claimable), leased_elsewhere=bool(elsewhere))

    def release_leases(self, workers: list[str]) -> int:
        return self.reclaim_leases(workers, expired=False).released

    def reclaim_expired(self) -> int:
        return self.reclaim_leases((), expired=True).expired

    def reclaim_leases(self, dead: Sequence[str] = (), *, expired: bool = True,
                       is_dead: Callable[[str], bool] | None = None,
                       starting: bool = False) -> Reclaimed:
        dead = list(dead)
        if is_dead is not None:
            # on the calling thread's own connection, outside a transaction: a read, and no
            # write transaction unless a holder is dead (an idle worker asks every second)
            dead.extend(sorted(w for (w,) in self._select(
                "SELECT DISTINCT worker FROM requests WHERE state = 'leased'")
                if w not in dead and is_dead(w)))
        if not dead and not expired:
            return Reclaimed()
        with self._write("reclaiming leases") as cur:
            # read once the connection of this transaction is there (PostgreSQL: the
            # heartbeats are judged only on a connection that has been up a while)
            now = self.clock()
            paused: dict[str, set[str]] = {}
            released = taken = 0
            if dead:
                where, param = self._any("worker", dead)
                released = self._take_back(cur, where, (param,), now, paused, starting)
            if expired:
                where, params = self._expired_leases(now)
                taken = self._take_back(cur, where, params, now, paused, starting)
            if released or taken:
                self._notify(cur, force=True)
            self._add_to_counter(cur, "leases_reclaimed", released + taken)
        return self._reclaimed(released, taken, paused, dead if released else [])

    def _reclaimed(self, released: int, expired: int, paused: dict[str, set[str]],
                   dead: Sequence[str] = ()) -> Reclaimed:
        return Reclaimed(released=released, expired=expired, dead=tuple(dead),
                         paused={w: tuple(sorted(s)) for w, s in sorted(paused.items()) if s},
                         paused_seconds=self._dead_worker_pause_seconds())

    def _expired_leases(self, now: float) -> tuple[str, tuple[Any, ...]]:
        """The condition of the leases :meth:`reclaim_expired` takes back, and its
        parameters: their time is up."""
        return "leased_until < ?", (now,)

    def _take_back(self, cur: Any, where: str, params: Sequence[Any], now: float,
                   paused: dict[str, set[str]], starting: bool = False) -> int:
        """Put the leases matching ``where`` back to pending, their slots paused first
        (:meth:`_pause_dead_slots`). Returns how many."""
        self._pause_dead_slots(cur, where, params, now, paused, starting)
        # (rows returned, not a row count: a pipelined transaction's cursor has none yet)
        return len(cur.execute(self._q(
            f"{_PENDING_AGAIN} WHERE state = 'leased' AND ({where}) RETURNING id"),
            params).fetchall())

    def _live_workers_in(self, cur: Any) -> list[str]:
        """The workers whose sessions may still run (:meth:`live_workers`), read in the
        transaction of ``cur``."""
        raise NotImplementedError

    def _others_alive(self, cur: Any, holders: set[str]) -> bool:
        """Whether a worker of the crawl other than this store's own and the ``holders``
        of the leases taken back may be alive (and so have been sending to their slots
        while this one started)."""
        others = set(self._live_workers_in(cur)) - holders
        others.discard(self._worker or "")
        return bool(others)

    def _dead_worker_pause_seconds(self) -> float:
        limits = self.slot_limits
        return limits.dead_worker_pause_seconds if limits is not None else 0.0

    def _pause_dead_slots(self, cur: Any, where: str, params: Sequence[Any], now: float,
                          paused: dict[str, set[str]], starting: bool = False) -> None:
        """With the crawl's limits, pause every download slot of a lease matching ``where``
        (taken back from a worker that is dead or whose time is up) for
        :attr:`.SlotLimits.dead_worker_pause_seconds` from ``now``, unless it is paused
        longer: the worker may have got a 429 for that slot and died before writing the
        pause. Not when ``starting`` (a worker's take-back at its start) and no other worker
        of the crawl is alive: a lone worker's restart (:meth:`_others_alive`). Adds the
        slots paused to ``paused`` under the worker that held the lease."""
        seconds = self._dead_worker_pause_seconds()
        if seconds <= 0:
            return
        held = cur.execute(self._q(
            "SELECT DISTINCT worker, slot FROM requests WHERE state = 'leased'"
            f" AND ({where}) AND slot <> ''"), params).fetchall()
        if not held or (starting and not self._others_alive(cur, {w for w, _ in held})):
            return
        until = now + seconds
        done: set[str] = set()
        for slot in sorted({slot for _, slot in held}):  # one lock order for every worker
            if cur.execute(self._q("UPDATE slots SET paused_until = ? WHERE slot = ?"
                                   " AND paused_until < ? RETURNING slot"),
                           (until, slot, until)).fetchall():
                done.add(slot)
        for worker, slot in held:
            if slot in done:
                paused.setdefault(worker, set()).add(slot)

    def _take_back_expired(self, cur: Any, now: float, result: CommitResult) -> None:
        """Before a claim by the slots' limits: leases whose time is up, of a worker that
        died or stopped elsewhere, no longer count against their slots; put them back to
        pending here, their slots paused (:meth:`_pause_dead_slots`), so that no claim
        sends to such a slot before its cautious pause holds (nothing when none expired:
        one read of the leased requests)."""
        if self._dead_worker_pause_seconds() <= 0 or cur.execute(self._q(
                "SELECT 1 FROM requests WHERE state = 'leased' AND leased_until < ? LIMIT 1"),
                (now,)).fetchone() is None:
            return
        paused: dict[str, set[str]] = {}
        where = (f"{self.REQUEST_ROW} IN (SELECT {self.REQUEST_ROW} FROM requests"
                 f" WHERE state = 'leased' AND leased_until < ?{self.SKIP_LOCKED})")
        taken = self._take_back(cur, where, (now,), now, paused)
        if taken:
            self._notify(cur, force=True)
            self._add_to_counter(cur, "leases_reclaimed", taken)
            result.reclaimed = self._reclaimed(0, taken, paused)

    def _stopping(self, cur: Any, worker: str, inflight: Sequence[str]) -> int:
        """Before a clean stop releases ``worker``'s leases: those in ``inflight`` (handed
        out, unfinished) did not kill it, their unfinished count is taken back; the others
        were claimed ahead and never handed out, their claim's attempt is taken back.
        Returns how many were claimed ahead."""
        where, param = self._any_key("key", list(inflight))
        if inflight:  # (these by the key's index: LEASED_BY)
            cur.execute(self._q(f"UPDATE requests SET unfinished = unfinished - 1 WHERE {where}"
                                f" AND {self.LEASED_BY} AND unfinished > 0"), (param, worker))
        # (all the worker's leases but those: by the index of its leases)
        cur.execute(self._q(f"UPDATE requests SET attempts = attempts - 1 WHERE NOT ({where})"
                            " AND state = 'leased' AND worker = ? AND attempts > 0"),
                    (param, worker))
        unstarted: int = cur.rowcount
        return unstarted

    def _release(self, cur: Any, workers: list[str]) -> int:
        where, param = self._any("worker", list(workers))
        cur.execute(self._q(f"{_PENDING_AGAIN} WHERE state = 'leased' AND {where}"), (param,))
        released: int = cur.rowcount
        if released:
            self._notify(cur, force=True)
        return released

    def lease_holders(self) -> list[LeaseHolder]:
        return [LeaseHolder(worker=w, leases=int(n), leased_until=u) for w, n, u in
                self._crawl_select("SELECT worker, count(*), max(leased_until) FROM requests"
                                   " WHERE state = 'leased' GROUP BY worker ORDER BY worker")]
