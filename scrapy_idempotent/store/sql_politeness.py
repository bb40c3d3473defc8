"""Politeness kept crawl-wide by the SQL store: :class:`SqlPoliteness` (mixed into
:class:`~.sql.SqlStore`) holds the download slots' limits, pauses and crawl delays in the
``slots`` table, claims by them over all workers (:meth:`SqlPoliteness._claim_by_slot`, the
claim's path when slot limits are kept), and keeps the robots.txt files workers fetched."""

from __future__ import annotations

from time import perf_counter
from typing import Any

from ..exceptions import StoreBusy
from .base import CommitResult, RobotsTxt, SlotLimits, SlotState
from .rules import (
    SLOT_WANTED_RECHECK_SECONDS,
    SLOT_WANTED_SECONDS,
    claimed_columns,
    pause_seconds,
    send_margin,
    slot_share,
)
from .sql_dialect import SqlDialect

__all__ = ["SqlPoliteness"]


def _limits_of(limits: SlotLimits, slot: str) -> tuple[int, float]:
    """``(concurrency, delay_seconds)`` of ``slot`` under ``limits``."""
    for name, concurrency, delay in limits.per_slot:
        if name == slot:
            return (concurrency if concurrency is not None else limits.concurrency,
                    delay if delay is not None else limits.delay_seconds)
    return limits.concurrency, limits.delay_seconds


#: times a worker's start tries to write the crawl's limits into the slots when the server
#: ends its transaction (a deadlock with a claim, limits changed meanwhile)
SLOT_LIMITS_ATTEMPTS = 3

#: A claim that found nothing to take repairs the slots' flags of pending requests; after a
#: repair that took FLAGS_REPAIR_SLOW_SECONDS or more (some 80,000 sites), the worker's
#: claims repair again only once FLAGS_REPAIR_SHARE times as long has passed: at most a
#: twentieth of its claims' and commits' time, however many sites the crawl has. (A
#: request whose slot lost its flag to the race waits that long at most.)
FLAGS_REPAIR_SHARE = 20
FLAGS_REPAIR_SLOW_SECONDS = 0.05


class SqlPoliteness(SqlDialect):
    """The crawl-wide download slots and robots.txt files (a mixin of ``SqlStore``)."""

    slot_limits: SlotLimits | None
    #: when (the store's clock) this worker's claims may repair the flags again
    _flags_repair_at: float = float("-inf")

    def _take_back_expired(self, cur: Any, now: float, result: CommitResult) -> None:
        raise NotImplementedError  # SqlLeases' (before this class in SqlStore's bases)

    def _claim_by_slot(self, cur: Any, worker: str, count: int, until: float, now: float,
                       result: CommitResult, send_by: dict[Any, float],
                       slot_of: dict[Any, str]) -> list[Any]:
        """Lease up to ``count`` requests keeping every slot's limits over all workers: from
        the slots that may send now (not paused, their delay waited out, fewer leased than
        their concurrency), the longest waiting first, each slot's first pending requests in
        queue order (one for a slot with a delay, to be sent within its margin:
        :func:`.rules.send_margin`). Claims of several workers on one slot are serialised by
        the slot's row (SQLite: by the write lock); on PostgreSQL a claim skips the row of a
        slot another claim holds, and when it took nothing while it left out a slot with
        pending requests, it asks again soon (:data:`.rules.SLOT_WANTED_RECHECK_SECONDS`).

        A slot's places are spread over the workers that want them: a worker whose claim
        finds the slot full while it holds less than its share (:func:`.rules.slot_share`
        of the workers holding its leases, itself and the one that wants them) records that
        it wants them, and asks again soon; while that is recent, another worker's claim
        takes no more than its own share, so its next completions leave places to it."""
        self._take_back_expired(cur, now, result)
        slots = self._pending_slots(cur, 2 * count + 8, now)
        if slots and self.SKIP_LOCKED_SLOTS:
            # the slots' rows are locked now: a count taken after the lock sees every claim
            # of them another worker committed (the first may have been read before)
            where, param = self._any("slot", [row[0] for row in slots])
            leased = dict(cur.execute(self._q(
                f"SELECT slot, count(*) FROM requests WHERE {where} AND state = 'leased'"
                " AND leased_until >= ? GROUP BY slot"), (param, now)).fetchall())
            slots = [(row[0], row[1], leased.get(row[0], 0), *row[3:]) for row in slots]
        rows: list[Any] = []
        sent: list[tuple[float, str]] = []
        waiting: list[float] = []
        wanted: list[tuple[str, float, str]] = []
        share_held = False  # a slot read holds this worker's share of its places
        for (slot, concurrency, in_flight, delay, crawl_delay, next_send, paused, wanted_by,
             wanted_at) in slots:
            if next_send > now or paused > now:
                waiting.append(max(float(next_send), float(paused)))
                continue
            wait = max(float(delay), float(crawl_delay))
            free = int(concurrency) - int(in_flight)
            take = min(count - len(rows), 1 if wait > 0 else count)
            wanted_elsewhere = (wanted_by is not None and wanted_by != worker
                                and float(wanted_at) >= now - SLOT_WANTED_SECONDS)
            if free <= 0 < take or wanted_elsewhere:  # (a lone worker's refill: neither)
                share_left = self._share_left(cur, slot, int(concurrency), worker,
                                              wanted_by if wanted_elsewhere else None, now)
                share_held = share_held or share_left <= 0
                if free < min(take, share_left):
                    # the slot's limit, not this worker's share, stops it: it wants places
                    waiting.append(now + SLOT_WANTED_RECHECK_SECONDS)
                    if wanted_by != worker or float(wanted_at) < now - SLOT_WANTED_SECONDS / 2:
                        wanted.append((worker, now, slot))
                if wanted_elsewhere:
                    take = min(take, share_left)
            take = min(take, free)
            if take <= 0:
                continue
            taken = cur.execute(self._q(
                "UPDATE requests SET state = 'leased', worker = ?, leased_until = ?,"
                f" attempts = attempts + 1 WHERE {self.REQUEST_ROW} IN (SELECT"
                f" {self.REQUEST_ROW} FROM requests WHERE {self._of_slot()}"
                " AND state = 'pending'"
                f" ORDER BY {self.PENDING_ORDER} LIMIT ?{self.SKIP_LOCKED})"
                f" RETURNING {claimed_columns(data=self.DATA_READ)}"),
                (worker, until, *self._slot_params(slot), take)).fetchall()
            if not taken:
                continue
            rows.extend(taken)
            slot_of.update((row[0], slot) for row in taken)
            if wait > 0:  # sent by now + margin, so the next one after that + delay
                margin = send_margin(wait)
                send_by.update((row[0], now + margin) for row in taken)
                sent.append((now + margin + wait, slot))
                waiting.append(now + margin + wait)
            elif len(slots) > 1:  # served now: the others have waited longer
                sent.append((now, slot))
        soon = now + SLOT_WANTED_RECHECK_SECONDS
        if (not rows and self.SKIP_LOCKED_SLOTS and not share_held
                and not any(when <= soon for when in waiting)):
            # Nothing taken, no claim soon: a slot left out because another worker's claim
            # holds its row (skipped, not waited for) may have places; told there is
            # nothing, this worker would wait for the next notification, and the other keep
            # every place. (A worker holding its share of a slot claims again when one of
            # those pages commits; one that asks again soon anyway needs no read more.)
            # A slot whose flag a race left cleared (see _clear_pending_flags) is flagged
            # again here, and claimed at once: it waited, it is not forgotten. That reads
            # every slot not flagged (0.6 s at a million sites, this worker's commits
            # waiting meanwhile): after a slow one, a worker repairs again only once
            # FLAGS_REPAIR_SHARE times as long has passed, and asks again then.
            if now >= self._flags_repair_at:
                started = perf_counter()
                if self._flag_pending_slots(cur):
                    waiting.append(now)
                took = perf_counter() - started
                if took >= FLAGS_REPAIR_SLOW_SECONDS:
                    self._flags_repair_at = now + FLAGS_REPAIR_SHARE * took
            else:  # a slow repair a moment ago: again when this worker may repair
                waiting.append(self._flags_repair_at)
            skipped = self._skipped_slots_ready_at(cur, [row[0] for row in slots])
            if skipped is not None:
                waiting.append(max(skipped, soon))
        if sent:
            cur.executemany(self._q("UPDATE slots SET next_send_at = ? WHERE slot = ?"), sent)
        if wanted:
            cur.executemany(self._q("UPDATE slots SET wanted_by = ?, wanted_at = ?"
                                    " WHERE slot = ?"), wanted)
        if len(rows) < count and waiting:
            result.claim_again_in = max(0.0, min(waiting) - now)
        return rows

    def _pending_slots(self, cur: Any, limit: int, now: float) -> list[Any]:
        """The first ``limit`` slots with pending requests in the claim's order: those that
        may send now first, the longest waiting first, then by when they may send (their
        delay or pause over), with their leases (an expired lease does not count: its worker
        lost it, stopped or dead elsewhere, and may no longer send it); locked where rows
        are (other claims' skipped).

        Read at the head of the index of the flagged slots (``slots_pending``): about
        ``limit`` slot rows, however many sites the frontier holds. A flagged slot found
        without pending requests (its last ones claimed) has its flag cleared, and the read
        is made again while it was full of them."""
        while True:
            read: list[Any] = cur.execute(self._q(self._pending_slots_sql()),
                                          (now, limit)).fetchall()
            empty = [row[0] for row in read if not row[9]]
            if empty:
                self._clear_pending_flags(cur, empty)
            if not empty or len(read) < limit:
                return [row[:9] for row in read if row[9]]

    def _pending_slots_sql(self) -> str:
        """The read of :meth:`_pending_slots` (parameters: now, the limit): the flagged
        slots' rows, their unexpired leases counted, whether they have pending requests
        (1 or NULL). (A scalar subquery, not EXISTS: PostgreSQL may plan an EXISTS of the
        select list as one hashed pass over every pending request, where the statistics of
        a frontier not yet analyzed make it look small; this is a probe of the slot's
        pending index per slot read.)"""
        return ("SELECT s.slot, s.concurrency, (SELECT count(*) FROM requests l"
                "  WHERE l.slot = s.slot AND l.state = 'leased' AND l.leased_until >= ?),"
                " s.delay, s.crawl_delay, s.next_send_at, s.paused_until, s.wanted_by,"
                " s.wanted_at, (SELECT 1 FROM requests r"
                f"  WHERE {self._of_slot('r.', 's.slot')} AND r.state = 'pending' LIMIT 1)"
                f" FROM slots s WHERE s.has_pending ORDER BY {self.SLOT_READY_AT}, s.slot"
                f" LIMIT ?{self.SKIP_LOCKED_SLOTS}")

    def _clear_pending_flags(self, cur: Any, slots: list[str]) -> None:
        """Clear the flag of pending requests of ``slots``, read without any (this claim
        holds their rows where rows are locked); a slot given a pending request since (a
        commit this statement sees) keeps it.

        On PostgreSQL, under READ COMMITTED, a transaction adding a request to one of these
        slots that has not committed when this statement runs is not seen, and its trigger
        found the slot flagged (the flag's committed value) and wrote nothing: the request
        is pending, its slot not flagged. The claim that then finds nothing to take and
        nothing soon flags it again (:meth:`_flag_pending_slots`). SQLite writes one
        transaction at a time: no such race."""
        where, param = self._any("slots.slot", slots)
        cur.execute(self._q(
            f"UPDATE slots SET has_pending = FALSE WHERE {where} AND"
            f" (SELECT 1 FROM requests r WHERE {self._of_slot('r.', 'slots.slot')}"
            "  AND r.state = 'pending' LIMIT 1) IS NULL"), (param,))

    def _flag_pending_slots(self, cur: Any) -> bool:
        """Flag every slot with pending requests whose flag is not set (a race of a claim
        clearing it with a commit adding a request: :meth:`_clear_pending_flags`); whether
        any was. Reads every slot not flagged (a probe of its pending index each, not a
        join a planner could make a pass over every pending request): only a claim that
        found nothing to take and nothing soon makes it, as a claim read every slot before."""
        return bool(cur.execute(self._q(
            "UPDATE slots SET has_pending = TRUE WHERE NOT has_pending AND"
            f" (SELECT 1 FROM requests r WHERE {self._of_slot('r.', 'slots.slot')}"
            "  AND r.state = 'pending' LIMIT 1) IS NOT NULL RETURNING slot")).fetchall())

    def _skipped_slots_ready_at(self, cur: Any, seen: list[str]) -> float | None:
        """When the first of the flagged slots (with pending requests) that a claim's read of
        the slots left out (locked by another worker's claim, or past its limit) may send,
        as their committed rows say (None: there are none): the head of their index."""
        where, param = self._any("s.slot", seen)
        row = cur.execute(self._q(
            f"SELECT {self.SLOT_READY_AT} FROM slots s WHERE s.has_pending AND NOT ({where})"
            f" ORDER BY {self.SLOT_READY_AT} LIMIT 1"), (param,)).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def _share_left(self, cur: Any, slot: str, concurrency: int, worker: str,
                    wanted_by: str | None, now: float) -> int:
        """How many more of ``slot``'s places ``worker`` may hold: its share of them among
        the workers holding leases of the slot (unexpired), itself and ``wanted_by`` (a
        worker that wants them), less the leases it holds."""
        holders = dict(cur.execute(self._q(
            "SELECT worker, count(*) FROM requests WHERE slot = ? AND state = 'leased'"
            " AND leased_until >= ? GROUP BY worker"), (slot, now)).fetchall())
        sharing = set(holders) | {worker} | ({wanted_by} if wanted_by is not None else set())
        return slot_share(concurrency, len(sharing)) - int(holders.get(worker, 0))

    # -- download slots -------------------------------------------------------------------

    def keep_slot_limits(self, limits: SlotLimits | None) -> None:
        """Claim by ``limits`` from now on (None: by the frontier's head alone), and write
        them into every slot's row (one transaction): the crawl's limits are those of the
        worker that started last."""
        self.slot_limits = limits
        if limits is None:
            return
        # Only the rows whose limits differ are written (and locked): a worker starting with
        # the crawl's limits writes none, so workers starting together neither wait for
        # each other nor for the claims, and a start does not rewrite every slot of a broad
        # crawl. Limits that change can still meet a claim's locks in another order: the
        # server ends one of the two, and this is tried again.
        own = sorted({slot for slot, _, _ in limits.per_slot})
        for attempt in range(1, SLOT_LIMITS_ATTEMPTS + 1):
            try:
                with self._write("setting the download slots' limits") as cur:
                    cur.execute(self._q(
                        "UPDATE slots SET concurrency = ?, delay = ? WHERE slot <> ''"
                        + (f" AND slot NOT IN ({', '.join('?' * len(own))})" if own else "")
                        + " AND (concurrency <> ? OR delay <> ?)"),
                        (limits.concurrency, limits.delay_seconds, *own, limits.concurrency,
                         limits.delay_seconds))
                    for slot in own:  # (in one order: the slots' locks taken in it)
                        cur.execute(self._q(
                            "INSERT INTO slots (slot, concurrency, delay) VALUES (?, ?, ?)"
                            " ON CONFLICT (slot) DO UPDATE SET concurrency = excluded.concurrency,"
                            " delay = excluded.delay WHERE slots.concurrency <>"
                            " excluded.concurrency OR slots.delay <> excluded.delay"),
                            (slot, *_limits_of(limits, slot)))
                return
            except StoreBusy:
                if attempt == SLOT_LIMITS_ATTEMPTS:
                    raise

    def pause_slot(self, slot: str, *, retry_after: float | None, first_seconds: float,
                   max_seconds: float, jitter: float = 0.0) -> float:
        now = self.clock()
        with self._write("pausing a download slot") as cur:
            cur.execute(self._q("INSERT INTO slots (slot, concurrency, delay) VALUES (?, ?, ?)"
                                " ON CONFLICT (slot) DO NOTHING"),
                        (slot, *_limits_of(self.slot_limits or SlotLimits(0), slot)))
            row = cur.execute(self._q("SELECT paused_until, backoffs FROM slots WHERE slot = ?"
                                      + self.LOCK_ROWS), (slot,)).fetchone()
            paused_until, backoffs = float(row[0]), int(row[1])
            # answers to requests sent before the pause began are one answer, not a row of
            # them: they do not double the backoff again
            again = paused_until <= now
            seconds = pause_seconds(retry_after, backoffs if again else max(backoffs - 1, 0),
                                    first_seconds, max_seconds, jitter)
            until = max(paused_until, now + seconds)
            cur.execute(self._q("UPDATE slots SET paused_until = ?, backoffs = backoffs + ?"
                                " WHERE slot = ?"), (until, int(again), slot))
        return until - now

    def slot_answered(self, slot: str) -> None:
        with self._write("ending a download slot's backoff") as cur:
            cur.execute(self._q("UPDATE slots SET backoffs = 0 WHERE slot = ? AND backoffs > 0"),
                        (slot,))

    def set_slot_delay(self, slot: str, delay_seconds: float) -> None:
        with self._write("keeping a download slot's crawl delay") as cur:
            cur.execute(self._q(
                "INSERT INTO slots (slot, concurrency, delay, crawl_delay) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (slot) DO UPDATE SET crawl_delay = excluded.crawl_delay"),
                (slot, *_limits_of(self.slot_limits or SlotLimits(0), slot), delay_seconds))

    def slots(self) -> list[SlotState]:
        now = self.clock()
        return [SlotState(slot=row[0], leased=int(row[1]), pending=int(row[2]),
                          next_send_at=float(row[3]), paused_until=float(row[4]),
                          backoffs=int(row[5]), crawl_delay=float(row[6]))
                for row in self._select(
                    "SELECT slot, leased, pending, next_send_at, paused_until, backoffs,"
                    " crawl_delay FROM (SELECT s.slot, (SELECT count(*) FROM requests r"
                    "  WHERE r.slot = s.slot AND r.state = 'leased') AS leased,"
                    f" {self.SLOT_PENDING} AS pending, s.next_send_at, s.paused_until,"
                    f" s.backoffs, s.crawl_delay FROM slots s{self.SLOT_PENDING_JOIN}) AS t"
                    " WHERE leased > 0 OR pending > 0 OR paused_until > ?"
                    f" ORDER BY leased DESC, pending DESC, slot{self.TEXT_ORDER}", (now,))]

    # -- robots.txt -------------------------------------------------------------------------

    def robots_txt(self, netloc: str) -> RobotsTxt | None:
        rows = self._crawl_select(
            "SELECT netloc, url, status, body, fetched_at FROM robots WHERE netloc = ?",
            (netloc,))
        return self._robots_of(rows[0], self.clock()) if rows else None

    def keep_robots_txt(self, netloc: str, url: str, status: int, body: bytes, *,
                        max_age_seconds: float) -> RobotsTxt:
        now = self.clock()
        with self._write("keeping a robots.txt") as cur:
            # insert if absent, replace only a row too old to use: two workers fetching at
            # once both end with the first one's (the same file, or one moment apart)
            cur.execute(self._q(
                "INSERT INTO robots (netloc, url, status, body, fetched_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (netloc) DO UPDATE"
                " SET url = excluded.url, status = excluded.status, body = excluded.body,"
                " fetched_at = excluded.fetched_at WHERE robots.fetched_at < ?"),
                (netloc, url, status, body, now, now - max_age_seconds))
            row = cur.execute(self._q(
                "SELECT netloc, url, status, body, fetched_at FROM robots WHERE netloc = ?"),
                (netloc,)).fetchone()
        return self._robots_of(row, now)

    @staticmethod
    def _robots_of(row: Any, now: float) -> RobotsTxt:
        return RobotsTxt(netloc=row[0], url=row[1], status=int(row[2]), body=bytes(row[3]),
                         age_seconds=max(0.0, now - float(row[4])))
