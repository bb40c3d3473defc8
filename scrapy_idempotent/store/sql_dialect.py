"""What every part of :class:`~.sql.SqlStore` stands on: :class:`SqlDialect` declares the
store's attributes, the connections and the dialect a backend gives (see the module docstring
of :mod:`.sql`), and the few statements that differ between backends. The parts of the SQL
store (the commit and claim path, the known-request memory, the crawl-wide slots, runs and
samples, the operator queries) are written over it."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from typing import Any

from .base import CommitResult, NewRequest
from .packing import pack, unpack
from .rules import QUEUE_ORDER, request_data, stored_request_data

__all__ = ["RECORD_STATE", "Answer", "SqlDialect"]

#: The rows of a statement sent, read when called (see :meth:`SqlStore._send`).
Answer = Callable[[], list[Any]]


#: The columns of a stored record that decide its next write: its ID and :class:`StoredState`.
RECORD_STATE = "record_id, content_hash, seen_run_id, observed_at, version"
_LAST_RUN = "SELECT run_id, finished_at FROM runs ORDER BY run_id DESC LIMIT 1"
_PENDING_AGAIN = "UPDATE requests SET state = 'pending', worker = NULL, leased_until = NULL"


class SqlDialect(ABC):
    """The connections and the dialect of one SQL backend, and the store's attributes the
    statements read (a base of every part of ``SqlStore``)."""

    lease_seconds: float
    max_attempts: int
    recrawl_seconds: float | None
    run_id: int | None
    clock: Callable[[], float]
    #: the worker of this store's session (None before it begins)
    _worker: str | None = None

    #: appended to a ``SELECT`` whose rows the transaction then changes (``FOR UPDATE``)
    LOCK_ROWS = ""
    #: appended to a claim's ``SELECT``: rows other claims hold are skipped
    SKIP_LOCKED = ""
    #: appended to the claim's ``SELECT`` of the slots that may send: slots other claims
    #: hold are skipped (their limits are being spent)
    SKIP_LOCKED_SLOTS = ""
    #: appended to ``ORDER BY`` a text key, so that keyset paging follows byte order
    TEXT_ORDER = ""
    #: the condition "leased by the worker ``?``", for statements on a list of keys: the
    #: key's index finds their rows (``+worker``: SQLite's planner would otherwise take the
    #: index of the worker's leases and read every row the worker holds, page after page)
    LEASED_BY = "state = 'leased' AND +worker = ?"
    #: the claim's ``ORDER BY``: :data:`.rules.QUEUE_ORDER` as the backend's pending indexes
    #: hold it
    PENDING_ORDER = QUEUE_ORDER
    #: the column a statement finds a request row by, through its index: SQLite's ``id``
    #: (the rowid); PostgreSQL's primary key, ``key`` (its ``id`` has no index of its own)
    REQUEST_ROW = "id"
    #: the condition "the request row ``{r}`` (an alias and a dot, or nothing) is of the
    #: download slot ``{slot}``" (an expression, or ``?``: :meth:`_slot_params`), as the
    #: slot's pending index finds the slot's requests: by the slot itself
    OF_SLOT = "{r}slot = {slot}"
    #: the number of pending requests of the slot of the ``slots`` row ``s``, beside the
    #: join :attr:`SLOT_PENDING_JOIN` appends to ``FROM slots s`` (operator reads): each
    #: slot's counted in the slot's pending index
    SLOT_PENDING = ("(SELECT count(*) FROM requests r WHERE r.slot = s.slot"
                    " AND r.state = 'pending')")
    SLOT_PENDING_JOIN = ""
    #: when the slot of the ``slots`` row ``s`` may send (the later of its next send time and
    #: its pause), as the index of the slots with pending requests (``slots_pending``) holds it
    SLOT_READY_AT = "max(s.next_send_at, s.paused_until)"
    #: the ``LIMIT`` parameter meaning no limit
    NO_LIMIT: Any = -1
    #: a request row keeps its URL once: in its ``url`` column, its ``data`` stored without
    #: it (:func:`.rules.stored_request_data`, read back by :meth:`_request_data`)
    URL_ONCE = False
    #: where a request row's packed request (:func:`.packing.pack`) is stored: None, in its
    #: ``data`` column itself (SQLite: a BLOB in the text column); else the name of a
    #: ``bytea`` column beside it, ``data`` then ``''`` (PostgreSQL)
    PACKED_COLUMN: str | None = None
    #: a request row's stored request as one value, ``{r}`` the row's alias and a dot:
    #: text, or bytes (packed, or UTF-8 text: see :meth:`_request_data`)
    DATA_READ = "{r}data"
    #: the assignments of a request row's stored request (the values: :meth:`_stored_data`)
    DATA_SET = "data = ?"
    #: the SQL type of the ``requests`` table's ``key``, ``parent_key`` and ``fingerprint``
    #: columns: text (SQLite), or ``bytea`` (PostgreSQL: the hex digits' bytes, half the
    #: size). Python holds a key as lowercase hex text everywhere; the values of those
    #: columns go through :meth:`_key` (parameters) and :meth:`_key_read` (rows read).
    KEY_TYPE = "text"
    #: a request key column ``{c}`` (``key``, ``r.parent_key``, ...) read as lowercase hex
    #: text, for statements that compare it with another table's text key or return it
    #: where :meth:`_key_read` is not applied
    KEY_TEXT = "{c}"
    #: a text key expression ``{c}`` (another table's key, or a parameter) as the requests
    #: table's key columns hold it: for comparisons and joins with them (PostgreSQL: its
    #: bytes, so that the requests' index serves the comparison)
    KEY_OF_TEXT = "{c}"

    # -- the dialect and the connections (each backend's own) -----------------------------

    def _of_slot(self, r: str = "", slot: str = "?") -> str:
        """:attr:`OF_SLOT` for the row ``r`` and the slot ``slot``."""
        return self.OF_SLOT.format(r=r, slot=slot)

    def _slot_params(self, slot: str) -> tuple[str, ...]:
        """The parameters of :meth:`_of_slot` ``(slot="?")`` for the slot ``slot``."""
        return (slot,) * self.OF_SLOT.count("{slot}")

    def _stored_data(self, data: str, url: str | None) -> tuple[Any, ...]:
        """A request's JSON text ``data`` as its row beside ``url`` stores it (None: a row
        whose URL is not known here, stored unpacked): the values of :attr:`DATA_SET`'s
        columns. Packed (:func:`.packing.pack`) where that is smaller. Anything but text goes
        as given: the database's to refuse, inside the transaction."""
        if not isinstance(data, str):
            return (data, None) if self.PACKED_COLUMN else (data,)
        text = stored_request_data(data, url) if self.URL_ONCE else data
        packed = None if url is None else pack(text, url)
        if self.PACKED_COLUMN:
            return ("", packed) if packed is not None else (text, None)
        return (text if packed is None else packed,)

    def _request_data(self, stored: str | bytes, url: str, row: str = "") -> str:
        """The JSON text of a request whose row (key ``row``, for errors) holds ``stored``
        (:attr:`DATA_READ`) and ``url``. Raises :class:`.packing.PackedRequestError` for a
        packed request that cannot be read back."""
        if not isinstance(stored, str):
            raw = bytes(stored)  # (a driver may give a memoryview)
            # a packed request's format byte is below a space; else UTF-8 text
            stored = unpack(raw, url, row) if raw[:1] < b" " else raw.decode()
        return request_data(stored, url) if self.URL_ONCE else stored

    def _key(self, key: str | None) -> Any:
        """A request key (or fingerprint, or parent key) as a parameter compared with, or
        written to, a key column of ``requests`` (:attr:`KEY_TYPE`); None stays None."""
        return key

    def _keys(self, keys: Collection[str | None]) -> list[Any]:
        """:meth:`_key` of each of ``keys``, in order."""
        return [self._key(key) for key in keys]

    def _key_read(self, value: Any) -> Any:
        """A value read from a key column of ``requests``, as Python holds keys (lowercase
        hex text); None stays None."""
        return value

    def _any_key(self, column: str, keys: Collection[str]) -> tuple[str, Any]:
        """:meth:`_any` for a key column of ``requests`` and the keys ``keys``."""
        return self._any(column, self._keys(keys), sql_type=self.KEY_TYPE)

    @abstractmethod
    def _write(self, doing: str = "writing") -> contextlib.AbstractContextManager[Any]:
        """The one write-transaction primitive: a cursor inside one transaction, committed
        at the end of the block, rolled back on any exception (all or nothing)."""

    @abstractmethod
    def _select(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        """Every row of one statement (written with ``?`` placeholders), outside any
        transaction: the operator queries' reads."""

    def _crawl_select(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        """:meth:`_select` for the reads a crawl makes beside its writer thread."""
        return self._select(sql, params)

    def _q(self, sql: str) -> str:
        """``sql`` (written with ``?`` placeholders) in the driver's placeholder style."""
        return sql

    @abstractmethod
    def _any(self, column: str, values: Collection[Any], *,
             sql_type: str = "text") -> tuple[str, Any]:
        """A condition that ``column`` is one of ``values`` (of ``sql_type``), with its one
        parameter: however many values, one placeholder."""

    def _send(self, cur: Any, sql: str, params: Sequence[Any] = ()) -> Answer:
        """Send one statement of the transaction of ``cur``; its rows are read when the
        returned function is called (at once, unless the backend pipelines)."""
        rows = cur.execute(self._q(sql), params).fetchall()
        return lambda: rows

    def _lookup(self, cur: Any, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        """Every row of one statement of the transaction of ``cur`` that looks rows up by a
        list of keys in a table that grows from empty, planned at each call where the
        backend caches plans (a plan made while the table was empty would scan it)."""
        return list(cur.execute(self._q(sql), params).fetchall())

    def _notify(self, cur: Any, *, force: bool = False) -> None:  # noqa: B027
        """Tell idle workers that requests became claimable (when the transaction commits);
        nothing by default (workers poll)."""

    @abstractmethod
    def _claim_rows(self, cur: Any, worker: str, count: int, until: float) -> list[Any]:
        """Lease the head of the pending index (:data:`.rules.QUEUE_ORDER`) to ``worker``
        until ``until``; the rows taken, :data:`.rules.CLAIMED_COLUMNS` (any order)."""

    @abstractmethod
    def _send_insert(self, cur: Any, new: list[NewRequest], now: float,
                     run_id: int) -> Callable[[], int]:
        """Insert ``new`` requests (their ids, the claim order, in the order given); a key
        another worker inserted meanwhile is not inserted. Returns the number inserted,
        when called."""

    @abstractmethod
    def _read_records(self, cur: Any, run_id: int, count: int, record_ids: list[str]
                      ) -> tuple[float | None, list[int], list[Any]]:
        """Before ``count`` records are written by ``run_id``: the latest ``last_changed``
        of any record (None: none), ``count`` increasing numbers of first sight in the run
        (the feeds' order), one per record in item order, and the stored rows of
        ``record_ids`` (sorted), locked: :data:`RECORD_STATE` columns."""

    def _lock_records(self, cur: Any, record_ids: list[str]) -> list[Any]:
        """The stored rows of ``record_ids`` (sorted), locked in that order where rows are
        locked: record ID and :class:`.rules.StoredState`."""
        where, param = self._any("record_id", record_ids)
        return self._lookup(cur, f"SELECT {RECORD_STATE} FROM records WHERE {where}"
                                 f" ORDER BY record_id{self.LOCK_ROWS}", (param,))

    @abstractmethod
    def _join_run(self, cur: Any, worker: str, run_id: int, now: float) -> None:
        """In the transaction of ``cur``: end ``worker``'s session and start one of its own
        in run ``run_id`` (newer than its own); :attr:`run_id` and the other attributes of
        :attr:`_SESSION_STATE` say so from now on."""

    @abstractmethod
    def _count(self, cur: Any, result: CommitResult, run_id: int, leased: int,
               number: int) -> None:
        """Add this transaction's work to the run's counters (same transaction): ``leased``
        the leases it took less those it gave back; ``number`` is the page commit's (see
        the PostgreSQL store)."""

    @abstractmethod
    def _add_to_counter(self, cur: Any, column: str, count: int) -> None:
        """Add ``count`` to this worker's share of the run counter ``column`` (the run's row
        on SQLite, the session's on PostgreSQL), in the transaction of ``cur``: the leases
        taken back from expired or dead workers (``leases_reclaimed``), the claims given
        back unstarted (``leased``, negative)."""

    def _observation_offset(self) -> float:
        """Seconds added to a worker's observation time to put it on the store's clock."""
        return 0.0

    def _set_meta(self, cur: Any, key: str, value: str) -> None:
        cur.execute(self._q("INSERT INTO meta (key, value) VALUES (?, ?)"
                            " ON CONFLICT (key) DO UPDATE SET value = excluded.value"),
                    (key, value))
