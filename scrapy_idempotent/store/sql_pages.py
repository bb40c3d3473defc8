"""Conditional requests' statements, shared by the SQL backends: :class:`SqlPageValidators`
is mixed into :class:`~.sql.SqlStore` (which gives it its connections and dialect).

Per done request the ``page_validators`` table keeps what its page answered with (``ETag``,
``Last-Modified``, the body's hash) and what the page produced when it was fetched: the
record IDs of its items and the keys of every request it linked (those it added and those
another page had added first), packed in one value (:func:`pack_keys`). The requests
themselves are kept once each, in ``linked_requests``, written by the commit that adds them
to the frontier and kept from run to run. A claim loads the validators of the requests it
leases; a page that answers ``304 Not Modified`` is completed in its page transaction from
that row: its records are marked seen in the run and every request it linked is enqueued
again (see ``docs/recrawls.rst``)."""

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

__all__ = ["SqlPageValidators", "pack_keys", "unpack_keys"]

#: the first byte of a packed list of keys: keys in hex, each as its bytes after its length
_PACKED_HEX = b"\x01"
#: the first byte of a packed list of keys: any keys, as a JSON list
_PACKED_JSON = b"\x00"


def pack_keys(keys: Sequence[str]) -> bytes:
    """``keys`` in one value (``page_validators.links``): each key of lowercase hex (the
    package's request keys are fingerprints and hashes in hex) as its bytes, after a byte of
    their length (21 bytes for a 40-character key); other keys as a JSON list."""
    try:
        raws = [bytes.fromhex(key) for key in keys]
    except ValueError:
        raws = None
    if raws is not None and all(len(raw) < 256 and raw.hex() == key
                                for raw, key in zip(raws, keys, strict=True)):
        return _PACKED_HEX + b"".join(bytes((len(raw),)) + raw for raw in raws)
    return _PACKED_JSON + json.dumps(list(keys), separators=(",", ":")).encode()


def unpack_keys(packed: bytes) -> list[str]:
    """The keys :func:`pack_keys` packed, in their order."""
    packed = bytes(packed)
    if packed[:1] != _PACKED_HEX:
        return list(json.loads(packed[1:]))
    keys: list[str] = []
    at = 1
    while at < len(packed):
        size = packed[at]
        keys.append(packed[at + 1:at + 1 + size].hex())
        at += 1 + size
    return keys


def _linked_row(new: NewRequest) -> tuple[Any, ...]:
    """``new`` as a row of ``linked_requests`` (its fingerprint NULL when it is its key)."""
    return (new.key, None if new.fingerprint == new.key else new.fingerprint, new.url,
            new.priority, new.data, new.filter_fingerprint, new.fifo, new.slot)


def _linked_of(row: Sequence[Any], parent_key: str) -> NewRequest:
    """The request of a ``linked_requests`` row, enqueued again by ``parent_key``."""
    key, fingerprint, url, priority, data, filter_fingerprint, fifo, slot = row
    return NewRequest(key=key, fingerprint=key if fingerprint is None else fingerprint,
                      url=url, priority=int(priority), data=data, parent_key=parent_key,
                      filter_fingerprint=bool(filter_fingerprint), fifo=bool(fifo),
                      slot=slot)


def _child_of(row: Sequence[Any], parent_key: str) -> NewRequest:
    """A request of a ``children`` list (rows written before links were kept)."""
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
    #: the recrawl window (``FrontierStore``'s; None: none)
    recrawl_seconds: float | None
    clock: Callable[[], float]
    #: the dialect's (SqlDialect.KEY_OF_TEXT)
    KEY_OF_TEXT: str

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
        requests it produced when it was last fetched (read in the page transaction): every
        request it linked, as ``linked_requests`` keeps it (a row written before links were
        kept: the requests it added, in its ``children``)."""
        keys = sorted({c.key for c in completions if c.not_modified})
        if not keys:
            return {}
        where, param = self._any("key", keys)
        rows = self._lookup(cur, "SELECT key, record_ids, children, links FROM page_validators"
                                 f" WHERE {where}", (param,))
        links = {key: unpack_keys(packed) for key, _, _, packed in rows if packed is not None}
        linked = self._linked_requests(cur, {k for keys in links.values() for k in keys})
        return {key: (json.loads(record_ids),
                      [_child_of(row, key) for row in json.loads(children)] if key not in links
                      else [_linked_of(linked[k], key) for k in links[key] if k in linked])
                for key, record_ids, children, _ in rows}

    def _linked_requests(self, cur: Any, keys: Collection[str]) -> dict[str, Sequence[Any]]:
        """The ``linked_requests`` rows of ``keys`` (those kept), by key, but for those the
        frontier holds already in a state their enqueue would leave as it is (pending or
        leased; done too without a recrawl window): most links of a listing page answered
        304 were enqueued by another page first, and are not read twice."""
        if not keys:
            return {}
        where, param = self._any("l.key", sorted(keys))
        known = "" if self.recrawl_seconds is not None else " OR true"
        return {row[0]: row for row in self._lookup(
            cur, "SELECT l.key, l.fingerprint, l.url, l.priority, l.data, l.filter_fingerprint,"
                 " l.fifo, l.slot FROM linked_requests AS l"
                 f" WHERE {where} AND NOT EXISTS (SELECT 1 FROM requests AS r"
                 f" WHERE r.key = {self.KEY_OF_TEXT.format(c='l.key')}"
                 f" AND (r.state IN ('pending', 'leased'){known}))",
            (param,))}

    def _keep_linked(self, cur: Any, requests: Sequence[NewRequest]) -> None:
        """Keep the requests pages added to the frontier (``requests``: a unit's own, not
        those a ``304`` enqueued again) in ``linked_requests``, as they were added (the
        last one added under a key replaces the one kept), for the ``304`` of any page that
        links them in a later run. Only while conditional requests are on."""
        if not self.claims_load_validators:
            return
        rows = sorted({new.key: _linked_row(new) for new in requests
                       if new.parent_key is not None}.values())
        if rows:
            cur.executemany(self._q(
                "INSERT INTO linked_requests (key, fingerprint, url, priority, data,"
                " filter_fingerprint, fifo, slot) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (key) DO UPDATE SET fingerprint = excluded.fingerprint,"
                " url = excluded.url, priority = excluded.priority, data = excluded.data,"
                " filter_fingerprint = excluded.filter_fingerprint, fifo = excluded.fifo,"
                " slot = excluded.slot WHERE linked_requests.data <> excluded.data"
                " OR linked_requests.priority <> excluded.priority"
                " OR linked_requests.slot <> excluded.slot"), rows)

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
                keep.append(self._validators_row(done, done.validators, requests,
                                                 records, run_id, now))
            else:
                forget.append(done.key)
        revisits = (self._next_revisits(cur, keep, confirmed, changed, run_id)
                    if self.revisit_bounds is not None and (keep or confirmed) else {})
        if keep:
            cur.executemany(self._q(
                "INSERT INTO page_validators (key, etag, last_modified, body_hash, record_ids,"
                " children, run_id, stored_at, body_bytes, links, revisit_seconds, due_at,"
                " outcome) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'fetched')"
                " ON CONFLICT (key) DO UPDATE SET etag = excluded.etag,"
                " last_modified = excluded.last_modified, body_hash = excluded.body_hash,"
                " record_ids = excluded.record_ids, children = excluded.children,"
                " links = excluded.links,"
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
    def _validators_row(done: Completion, validators: PageValidators,
                        requests: Sequence[NewRequest],
                        records: Sequence[tuple[Record, str | None]], run_id: int,
                        now: float) -> tuple[Any, ...]:
        """The ``page_validators`` row of the done page ``done``: its links are every
        request it linked (:attr:`~.base.Completion.links`) and every one it added (its
        children among ``requests``), in the order linked; its ``children`` stay empty
        (the requests are in ``linked_requests``)."""
        key = done.key
        record_ids = list(dict.fromkeys(r.record_id for r, owner in records if owner == key))
        links = list(dict.fromkeys([*done.links, *(new.key for new in requests
                                                   if new.parent_key == key)]))
        return (key, validators.etag, validators.last_modified, validators.body_hash,
                json.dumps(record_ids, separators=(",", ":")), "[]", run_id, now,
                validators.body_bytes, pack_keys(links))

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
