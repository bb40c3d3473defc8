"""Sessions' ends and leases in the SQL store: :class:`SqlLeases` (mixed into
:class:`~.sql.SqlStore`) ends a worker's session (its leases given back, its claims ahead
uncounted, the run finished when nothing is left), releases the leases of workers gone, and
reads who holds leases and whether anything is claimable."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import FrontierStatus, LeaseHolder
from .sql_dialect import _PENDING_AGAIN, SqlDialect

__all__ = ["SqlLeases"]


class SqlLeases(SqlDialect):
    """A session's end and the leases' release and reads (a mixin of ``SqlStore``)."""

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
                (busy,) = cur.execute(
                    "SELECT EXISTS (SELECT 1 FROM requests WHERE state IN"
                    " ('pending', 'leased'))").fetchall()[0]
                if not busy:
                    cur.execute(self._q("UPDATE runs SET finished_at = ?, reason = ?"
                                        " WHERE run_id = ? AND finished_at IS NULL"),
                                (now, reason, self.run_id))
        return released

    def status(self, worker: str) -> FrontierStatus:
        claimable, elsewhere = self._crawl_select(
            "SELECT EXISTS (SELECT 1 FROM requests WHERE state = 'pending'),"
            " EXISTS (SELECT 1 FROM requests WHERE state = 'leased'"
            "  AND (worker <> ? OR leased_until < ?))", (worker, self.clock()))[0]
        return FrontierStatus(claimable=bool(claimable), leased_elsewhere=bool(elsewhere))

    def release_leases(self, workers: list[str]) -> int:
        if not workers:
            return 0
        with self._write("releasing leases") as cur:
            released = self._release(cur, workers)
            self._add_to_counter(cur, "leases_reclaimed", released)
            return released

    def _stopping(self, cur: Any, worker: str, inflight: Sequence[str]) -> int:
        """Before a clean stop releases ``worker``'s leases: those in ``inflight`` (handed
        out, unfinished) did not kill it, their unfinished count is taken back; the others
        were claimed ahead and never handed out, their claim's attempt is taken back.
        Returns how many were claimed ahead."""
        where, param = self._any("key", list(inflight))
        owned = " AND state = 'leased' AND worker = ?"
        if inflight:
            cur.execute(self._q(f"UPDATE requests SET unfinished = unfinished - 1 WHERE {where}"
                                f"{owned} AND unfinished > 0"), (param, worker))
        cur.execute(self._q(f"UPDATE requests SET attempts = attempts - 1 WHERE NOT ({where})"
                            f"{owned} AND attempts > 0"), (param, worker))
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
