"""The outbox's statements, shared by the SQL backends: :class:`SqlOutbox` is mixed into
:class:`~.sql.SqlStore` (which gives it its connections and dialect). The outbox entries
themselves are written in the page transaction (``SqlStore._write_outbox``); here they are
claimed by a delivering worker, settled, and read."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Sequence
from typing import Any

from .base import OutboxBacklog, OutboxEntry, OutboxOutcome, OutboxRow, OutboxState

__all__ = ["SqlOutbox"]


class SqlOutbox:
    """Claiming, settling and reading outbox entries (a mixin of ``SqlStore``)."""

    #: the dialect's clause skipping rows another transaction locked (see ``SqlStore``)
    SKIP_LOCKED = ""
    clock: Callable[[], float]

    def _write(self, doing: str = "writing") -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def _select(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        raise NotImplementedError

    def _crawl_select(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        raise NotImplementedError

    def _q(self, sql: str) -> str:
        raise NotImplementedError

    def _any(self, column: str, values: Collection[Any], *,
             sql_type: str = "text") -> tuple[str, Any]:
        raise NotImplementedError

    def claim_outbox(self, targets: Sequence[str], limit: int, hold_seconds: float, *,
                     exclude: Collection[int] = ()) -> list[OutboxEntry]:
        if not targets or limit <= 0:
            return []
        now = self.clock()
        where, param = self._any("target", list(targets))
        skip, skipped = self._any("id", list(exclude), sql_type="bigint")
        with self._write("claiming outbox entries") as cur:
            rows = cur.execute(self._q(
                "UPDATE outbox SET due_at = ? WHERE id IN (SELECT id FROM outbox"
                f"  WHERE state = 'pending' AND {where} AND due_at <= ? AND NOT ({skip})"
                f"  ORDER BY due_at, id LIMIT ?{self.SKIP_LOCKED})"
                " RETURNING id, target, idempotency_key, kind, record_id, content_hash,"
                " item_type, source, natural_key, data, run_id, created_at, attempts, due_at"),
                (now + hold_seconds, param, now, skipped, limit)).fetchall()
        rows.sort(key=lambda r: r[0])  # RETURNING gives no order
        return [OutboxEntry(entry_id=r[0], target=r[1], key=r[2], kind=r[3], record_id=r[4],
                            content_hash=r[5], item_type=r[6], source=r[7],
                            natural_key=r[8], data=r[9] or "{}", run_id=r[10],
                            created_at=r[11], attempts=r[12], held_until=r[13])
                for r in rows]

    def settle_outbox(self, outcomes: Sequence[OutboxOutcome]) -> list[OutboxOutcome]:
        if not outcomes:
            return []
        now = self.clock()
        settled: list[OutboxOutcome] = []
        # only a pending entry, and only while the claim that sent it holds it
        held = (" WHERE id = ? AND state = 'pending' AND (CAST(? AS DOUBLE PRECISION) IS NULL"
                " OR due_at = CAST(? AS DOUBLE PRECISION))")
        with self._write("recording deliveries") as cur:
            for outcome in outcomes:
                token = (outcome.entry_id, outcome.held_until, outcome.held_until)
                if outcome.state is OutboxState.PENDING:
                    cur.execute(self._q(
                        "UPDATE outbox SET attempts = attempts + 1, due_at = ?, detail = ?"
                        + held), (outcome.retry_at if outcome.retry_at is not None else now,
                                  outcome.detail, *token))
                else:
                    cur.execute(self._q(
                        "UPDATE outbox SET state = ?, attempts = attempts + 1,"
                        " settled_at = ?, detail = ?,"
                        " data = CASE WHEN ? THEN NULL ELSE data END" + held),
                        (outcome.state.value, now, outcome.detail,
                         outcome.state is OutboxState.DELIVERED, *token))
                if cur.rowcount:
                    settled.append(outcome)
        return settled

    def outbox_next_due(self, targets: Sequence[str]) -> float | None:
        if not targets:
            return None
        where, param = self._any("target", list(targets))
        due = self._select(f"SELECT min(due_at) FROM outbox WHERE state = 'pending' AND {where}",
                           (param,))[0][0]
        return float(due) if due is not None else None

    def outbox_entries(self, *, after: int | None = None, limit: int = 1000) -> list[OutboxRow]:
        return [OutboxRow(*row) for row in self._select(
            "SELECT id, target, idempotency_key, kind, record_id, state, attempts, detail, data"
            " FROM outbox WHERE id > ? ORDER BY id LIMIT ?", (after or 0, limit))]

    def outbox_counts(self) -> dict[str, dict[str, int]]:
        counts: dict[str, dict[str, int]] = {}
        for target, state, n in self._select(
                "SELECT target, state, count(*) FROM outbox GROUP BY target, state"
                " ORDER BY target"):
            by_state = counts.setdefault(target, {s.value: 0 for s in OutboxState})
            by_state[state] = int(n)
        return counts

    def outbox_backlog(self) -> dict[str, OutboxBacklog]:
        # the pending entries only (the partial index's rows), whatever was delivered
        return {target: OutboxBacklog(entries=int(n), oldest_at=float(oldest))
                for target, n, oldest in self._crawl_select(
                    "SELECT target, count(*), min(created_at) FROM outbox"
                    " WHERE state = 'pending' GROUP BY target ORDER BY target")}
