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
from collections.abc import Collection, Sequence
from typing import Any

from .base import CommitResult, Completion, NewRequest, PageValidators, Record, RequestState

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
                         run_id: int, now: float) -> None:
        """Write the validators of the pages ``completions`` finished (with the records and
        the requests each produced), forget those of pages that ended otherwise, and renew
        the row of each unchanged page (it was confirmed in this run)."""
        keep: list[tuple[Any, ...]] = []
        forget: list[str] = []
        confirmed: list[str] = []
        for done in completions:
            if done.key in lost:
                continue
            if done.not_modified:
                confirmed.append(done.key)
            elif done.validators is None:
                continue
            elif done.state is RequestState.DONE:
                keep.append(self._validators_row(done.key, done.validators, requests,
                                                 records, run_id, now))
            else:
                forget.append(done.key)
        if keep:
            cur.executemany(self._q(
                "INSERT INTO page_validators (key, etag, last_modified, body_hash, record_ids,"
                " children, run_id, stored_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (key) DO UPDATE SET etag = excluded.etag,"
                " last_modified = excluded.last_modified, body_hash = excluded.body_hash,"
                " record_ids = excluded.record_ids, children = excluded.children,"
                " run_id = excluded.run_id, stored_at = excluded.stored_at"), sorted(keep))
        if forget:
            where, param = self._any("key", sorted(forget))
            cur.execute(self._q(f"DELETE FROM page_validators WHERE {where}"), (param,))
        if confirmed:
            where, param = self._any("key", sorted(confirmed))
            cur.execute(self._q(f"UPDATE page_validators SET run_id = ?, stored_at = ?"
                                f" WHERE {where}"), (run_id, now, param))

    @staticmethod
    def _validators_row(key: str, validators: PageValidators, requests: Sequence[NewRequest],
                        records: Sequence[tuple[Record, str | None]], run_id: int,
                        now: float) -> tuple[Any, ...]:
        record_ids = list(dict.fromkeys(r.record_id for r, owner in records if owner == key))
        children = [_child_row(new) for new in requests if new.parent_key == key]
        return (key, validators.etag, validators.last_modified, validators.body_hash,
                json.dumps(record_ids, separators=(",", ":")),
                json.dumps(children, ensure_ascii=False, separators=(",", ":")), run_id, now)

    def _load_validators(self, cur: Any, result: CommitResult) -> None:
        """Give the requests this transaction's claim leased their page's validators."""
        if not self.claims_load_validators or not result.leased:
            return
        where, param = self._any("key", sorted({r.key for r in result.leased}))
        found = {key: PageValidators(etag, last_modified, body_hash, float(stored_at))
                 for key, etag, last_modified, body_hash, stored_at in self._lookup(
                     cur, "SELECT key, etag, last_modified, body_hash, stored_at"
                          f" FROM page_validators WHERE {where}", (param,))}
        if found:
            result.leased[:] = [dataclasses.replace(r, validators=found[r.key])
                                if r.key in found else r for r in result.leased]
