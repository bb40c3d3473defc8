"""Conditional requests' statements, shared by the SQL backends: :class:`SqlPageValidators`
is mixed into :class:`~.sql.SqlStore` (which gives it its connections and dialect).

Per done request the ``page_validators`` table keeps what its page answered with (``ETag``,
``Last-Modified``, the body's hash) and what the page produced when it was fetched: the
record IDs of its items and the requests it added to the frontier. A claim loads the
validators of the requests it leases; a page that answers ``304 Not Modified`` is completed
in its page transaction from that row: its records are marked seen in the run and its
requests are enqueued again (see ``docs/recrawls.rst``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection, Sequence
from typing import Any

from .base import (
    CommitResult,
    Completion,
    NewRequest,
    PageValidators,
    Record,
    RequestState,
    RevisitBounds,
)
from .reads import RevisitReport
from .rules import next_revisit, revisit_due, revisit_due_at

__all__ = ["SqlPageValidators"]


def _child_row(new: NewRequest) -> list[Any]:
    return [new.key, new.fingerprint, new.url, new.priority, new.data, new.is_start,
            new.filter_fingerprint, new.fifo, new.slot]


def _child_of(row: Sequence[Any], parent_key: str) -> NewRequest:
    key, fingerprint, url, priority, data, is_start, filter_fingerprint, fifo, slot = row
    return NewRequest(key=key, fingerprint=fingerprint, url=url, priority=int(priority),
                      data=data, parent_key=parent_key, is_start=bool(is_start),
                      filter_fingerprint=bool(filter_fingerprint), fifo=bool(fifo),
                      slot=slot)


class SqlPageValidators:
    """Keeping, loading and answering from pages' validators (a mixin of ``SqlStore``)."""

    #: claims load the validators of what they lease (``FrontierStore``'s)
    claims_load_validators: bool
    #: adaptive revisits' bounds (``FrontierStore``'s; None: off)
    revisit_bounds: RevisitBounds | None
    clock: Callable[[], float]

    def _select(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        raise NotImplementedError

    def _q(self, sql: str) -> str:
        raise NotImplementedError

    def _any(self, column: str, values: Collection[Any], *,
             sql_type: str = "text") -> tuple[str, Any]:
        raise NotImplementedError

    def _lookup(self, cur: Any, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        raise NotImplementedError

    def _read_records(self, cur: Any, run_id: int, count: int, record_ids: list[str]
                      ) -> tuple[float | None, list[int], list[Any]]:
        raise NotImplementedError

    def _unchanged_pages(self, cur: Any, completions: Sequence[Completion]
                         ) -> dict[str, tuple[list[str], list[NewRequest]]]:
        """Per page of ``completions`` answered ``304 Not Modified``: the record IDs and the
        requests it produced when it was last fetched (read in the page transaction)."""
        keys = sorted({c.key for c in completions if c.not_modified})
        if not keys:
            return {}
        where, param = self._any("key", keys)
        rows = self._lookup(cur, "SELECT key, record_ids, children FROM page_validators"
                                 f" WHERE {where}", (param,))
        return {key: (json.loads(record_ids), [_child_of(row, key)
                                               for row in json.loads(children)])
                for key, record_ids, children in rows}

    def _see_unchanged(self, cur: Any, pages: dict[str, tuple[list[str], list[NewRequest]]],
                       run_id: int, now: float, result: CommitResult) -> None:
        """Mark the stored records of unchanged ``pages`` seen in ``run_id`` (in the order
        their page yielded them, after the records the run saw so far), as a page that
        yields them unchanged does; count them unchanged."""
        ids = list(dict.fromkeys(rid for record_ids, _ in pages.values()
                                 for rid in record_ids))
        if not ids:
            return
        _, seqs, rows = self._read_records(cur, run_id, len(ids), sorted(ids))
        seen = {row[0]: row[2] for row in rows}  # record ID -> the run that last saw it
        updates = [(run_id, now, seq, rid) for rid, seq in zip(ids, seqs, strict=True)
                   if rid in seen and seen[rid] != run_id]
        if updates:
            cur.executemany(self._q("UPDATE records SET seen_run_id = ?, seen_at = ?,"
                                    " seen_seq = ? WHERE record_id = ?"), updates)
        result.records_unchanged += len(seen)

    def _keep_validators(self, cur: Any, completions: Sequence[Completion],
                         requests: Sequence[NewRequest],
                         records: Sequence[tuple[Record, str | None]], lost: Collection[str],
                         changed: Collection[str], run_id: int, now: float) -> None:
        """Write the validators of the pages ``completions`` finished (with the records and
        the requests each produced), forget those of pages that ended otherwise, and renew
        the row of each unchanged page (it was confirmed in this run); a page not fetched
        because its revisit was not due keeps its row as it was, but for the run that
        reached it. With adaptive revisits, each page's next revisit follows whether its
        records changed (``changed``: the record IDs this transaction inserted or
        updated)."""
        keep: list[tuple[Any, ...]] = []
        forget: list[str] = []
        confirmed: list[str] = []
        not_due: list[str] = []
        for done in completions:
            if done.key in lost:
                continue
            if done.not_due:
                not_due.append(done.key)
            elif done.not_modified:
                confirmed.append(done.key)
            elif done.validators is None:
                continue
            elif done.state is RequestState.DONE:
                keep.append(self._validators_row(done.key, done.validators, requests,
                                                 records, run_id, now))
            else:
                forget.append(done.key)
        revisits = (self._next_revisits(cur, keep, confirmed, changed, run_id)
                    if self.revisit_bounds is not None and (keep or confirmed) else {})
        if keep:
            cur.executemany(self._q(
                "INSERT INTO page_validators (key, etag, last_modified, body_hash, record_ids,"
                " children, run_id, stored_at, body_bytes, revisit_seconds, due_at, outcome)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'fetched')"
                " ON CONFLICT (key) DO UPDATE SET etag = excluded.etag,"
                " last_modified = excluded.last_modified, body_hash = excluded.body_hash,"
                " record_ids = excluded.record_ids, children = excluded.children,"
                " run_id = excluded.run_id, stored_at = excluded.stored_at,"
                " body_bytes = excluded.body_bytes, revisit_seconds = excluded.revisit_seconds,"
                " due_at = excluded.due_at, outcome = excluded.outcome"),
                sorted((*row, *revisits.get(row[0], (None, None))) for row in keep))
        if forget:
            where, param = self._any("key", sorted(forget))
            cur.execute(self._q(f"DELETE FROM page_validators WHERE {where}"), (param,))
        if confirmed and revisits:
            cur.executemany(self._q(
                "UPDATE page_validators SET run_id = ?, stored_at = ?, revisit_seconds = ?,"
                " due_at = ?, outcome = 'not_modified' WHERE key = ?"),
                [(run_id, now, *revisits.get(key, (None, None)), key)
                 for key in sorted(confirmed)])
        elif confirmed:
            where, param = self._any("key", sorted(confirmed))
            cur.execute(self._q(f"UPDATE page_validators SET run_id = ?, stored_at = ?,"
                                f" outcome = 'not_modified' WHERE {where}"),
                        (run_id, now, param))
        if not_due:
            where, param = self._any("key", sorted(not_due))
            cur.execute(self._q(f"UPDATE page_validators SET run_id = ?, outcome = 'not_due'"
                                f" WHERE {where}"), (run_id, param))

    def _next_revisits(self, cur: Any, keep: Sequence[tuple[Any, ...]],
                       confirmed: Sequence[str], changed: Collection[str], run_id: int
                       ) -> dict[str, tuple[float | None, float | None]]:
        """Per page fetched (``keep``: its new row) or confirmed unchanged, its next revisit
        interval and time (None, None for a page that yields no records: a listing is how
        new pages are found, it is due every run). A fetched page changed when one of its
        records was inserted or updated, or its records are not those of its last fetch;
        the interval counts from the start of this run (:func:`.rules.revisit_due_at`)."""
        bounds = self.revisit_bounds
        assert bounds is not None
        keys = sorted({row[0] for row in keep} | set(confirmed))
        where, param = self._any("key", keys)
        stored = {key: (record_ids, seconds) for key, record_ids, seconds in self._lookup(
            cur, "SELECT key, record_ids, revisit_seconds FROM page_validators"
                 f" WHERE {where}", (param,))}
        started = self._run_started_at(cur, run_id)
        out: dict[str, tuple[float | None, float | None]] = {}
        for row in keep:
            key, record_ids = row[0], row[4]
            if record_ids == "[]":
                continue
            before_ids, before = stored.get(key, (None, None))
            page_changed = (before_ids != record_ids
                            or any(rid in changed for rid in json.loads(record_ids)))
            seconds = next_revisit(None if before is None else float(before), page_changed,
                                   bounds)
            out[key] = (seconds, revisit_due_at(started, seconds, key, run_id))
        for key in confirmed:
            before_ids, before = stored.get(key, ("[]", None))
            if before_ids == "[]":
                continue
            seconds = next_revisit(None if before is None else float(before), False, bounds)
            out[key] = (seconds, revisit_due_at(started, seconds, key, run_id))
        return out

    def _run_started_at(self, cur: Any, run_id: int) -> float:
        """When run ``run_id`` started (unix seconds, the store's clock)."""
        known: dict[int, float] = self.__dict__.setdefault("_run_starts", {})  # (per store)
        if run_id not in known:
            [(started,)] = self._lookup(cur, "SELECT started_at FROM runs WHERE run_id = ?",
                                        (run_id,))
            known[run_id] = float(started)
        return known[run_id]

    @staticmethod
    def _validators_row(key: str, validators: PageValidators, requests: Sequence[NewRequest],
                        records: Sequence[tuple[Record, str | None]], run_id: int,
                        now: float) -> tuple[Any, ...]:
        record_ids = list(dict.fromkeys(r.record_id for r, owner in records if owner == key))
        children = [_child_row(new) for new in requests if new.parent_key == key]
        return (key, validators.etag, validators.last_modified, validators.body_hash,
                json.dumps(record_ids, separators=(",", ":")),
                json.dumps(children, ensure_ascii=False, separators=(",", ":")), run_id, now,
                validators.body_bytes)

    def _load_validators(self, cur: Any, result: CommitResult) -> None:
        """Give the requests this transaction's claim leased their page's validators (and,
        with adaptive revisits, whether the page is due: a start request always is)."""
        if not self.claims_load_validators or not result.leased:
            return
        where, param = self._any("key", sorted({r.key for r in result.leased}))
        now = result.claimed_at[0]
        bounds = self.revisit_bounds
        found = {key: PageValidators(etag, last_modified, body_hash, float(stored_at),
                                     int(body_bytes), revisit_due(due_at, now, bounds))
                 for key, etag, last_modified, body_hash, stored_at, body_bytes, due_at
                 in self._lookup(
                     cur, "SELECT key, etag, last_modified, body_hash, stored_at, body_bytes,"
                          f" due_at FROM page_validators WHERE {where}", (param,))}
        if found:
            result.leased[:] = [
                dataclasses.replace(r, validators=found[r.key] if not r.is_start
                                    else dataclasses.replace(found[r.key], due=True))
                if r.key in found else r for r in result.leased]

    def revisits(self) -> RevisitReport:
        """See :meth:`.FrontierStore.revisits` (one pass over the pages kept)."""
        now = self.clock()
        early = self.revisit_bounds.early_seconds if self.revisit_bounds is not None else 0.0
        [(run_id,)] = self._select("SELECT max(run_id) FROM runs")
        [(pages, scheduled, due, next_due)] = self._select(
            "SELECT count(*), count(due_at), coalesce(sum(CASE WHEN due_at <= ? THEN 1"
            " ELSE 0 END), 0), min(CASE WHEN due_at > ? THEN due_at END)"
            " FROM page_validators", (now + early, now + early))
        outcomes = {outcome: (int(n), int(saved or 0)) for outcome, n, saved in self._select(
            "SELECT outcome, count(*), sum(CASE WHEN outcome = 'fetched' THEN 0"
            " ELSE body_bytes END) FROM page_validators WHERE run_id = ? GROUP BY outcome",
            (run_id if run_id is not None else -1,))}
        return RevisitReport(
            read_at=now, pages=int(pages), scheduled=int(scheduled), due=int(due),
            next_due_at=None if next_due is None else float(next_due), run_id=run_id,
            fetched=outcomes.get("fetched", (0, 0))[0],
            not_modified=outcomes.get("not_modified", (0, 0))[0],
            not_due=outcomes.get("not_due", (0, 0))[0],
            bytes_saved=sum(saved for _, saved in outcomes.values()))
