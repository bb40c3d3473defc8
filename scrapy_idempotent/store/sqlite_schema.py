"""The SQLite store's schema: its tables, versioned and migrated forward (one transaction
per step), the tables each version has, and the ``application_id`` that marks a file as the
package's."""

from __future__ import annotations

__all__ = ["APPLICATION_ID", "SCHEMA_VERSION"]

SCHEMA_VERSION = 21

#: Schema migrations: ``_MIGRATIONS[n]`` brings version n to n + 1, one transaction each.
#: The failed and the redirected requests, each in an index of its own (few rows): with the
#: pending and leased indexes they count the frontier exactly without reading its rows
#: (:meth:`~.sql.SqlStore.counts`: done is the rest), and ``failed`` lists its requests
#: without a scan of the table.
_COUNTED_STATES = [
    "CREATE INDEX IF NOT EXISTS requests_failed ON requests (error_kind)"
    " WHERE state = 'failed'",
    "CREATE INDEX IF NOT EXISTS requests_redirected ON requests (id)"
    " WHERE state = 'redirected'",
]

#: Conditional requests: every request a kept page linked, not only those it added. The
#: requests pages added to the frontier, once each, kept from run to run (fingerprint NULL:
#: the key); per page kept, the keys of every request it linked, packed in one value
#: (``sql_pages.pack_keys``). The requests of the rows written before are copied from their
#: ``children`` (those rows are read from there until they are written again).
_LINKED_REQUESTS = [
    """CREATE TABLE linked_requests (
        key TEXT PRIMARY KEY,
        fingerprint TEXT,
        url TEXT NOT NULL,
        priority INTEGER NOT NULL,
        data TEXT NOT NULL,
        filter_fingerprint INTEGER NOT NULL,
        fifo INTEGER NOT NULL,
        slot TEXT NOT NULL
    ) WITHOUT ROWID""",
    """ALTER TABLE page_validators ADD COLUMN links BLOB""",
    """INSERT INTO linked_requests (key, fingerprint, url, priority, data,
        filter_fingerprint, fifo, slot)
       SELECT json_extract(c.value, '$[0]'),
              nullif(json_extract(c.value, '$[1]'), json_extract(c.value, '$[0]')),
              json_extract(c.value, '$[2]'), json_extract(c.value, '$[3]'),
              json_extract(c.value, '$[4]'), json_extract(c.value, '$[6]'),
              json_extract(c.value, '$[7]'), json_extract(c.value, '$[8]')
       FROM page_validators AS p, json_each(p.children) AS c WHERE true
       ON CONFLICT (key) DO NOTHING""",
]

#: A site's places spread over the workers that want them: per slot, the last worker whose
#: claim found the slot full while it held less than its share, and when (the store's
#: clock). While that is recent, a claim by another worker takes no more than its share.
_SLOT_WANTED = [
    """ALTER TABLE slots ADD COLUMN wanted_by TEXT""",
    """ALTER TABLE slots ADD COLUMN wanted_at REAL NOT NULL DEFAULT 0""",
]

#: Claims by slot read only the slots with pending requests, through an index, in the claim's
#: order: per slot a flag of pending requests (``has_pending``), set by triggers on every
#: transition of a request into 'pending' (a new request, or any update to 'pending': a
#: lease taken back or released, a continuation, a request due again, ``retry``, a
#: quarantined request put back; none can be missed) and cleared by the claim that reads a
#: flagged slot and finds none (:meth:`~.sql_politeness.SqlPoliteness._claim_by_slot`); the
#: flagged slots indexed by when they may send (the later of their next send time and their
#: pause). A trigger writes the slot's row only when its flag changes (an UPDATE finding the
#: slot flagged writes nothing). One transaction writes at a time: a claim's clearing never
#: races a commit adding a request. Existing slots: flagged by one probe each of the slot's
#: pending index.
_SLOT_PENDING = [
    """ALTER TABLE slots ADD COLUMN has_pending INTEGER NOT NULL DEFAULT 0""",
    """UPDATE slots SET has_pending = 1 WHERE EXISTS (SELECT 1 FROM requests r
       WHERE r.slot = slots.slot AND r.state = 'pending')""",
    """CREATE INDEX slots_pending ON slots (max(next_send_at, paused_until), slot)
       WHERE has_pending""",
    """CREATE TRIGGER requests_pending_added AFTER INSERT ON requests
       WHEN NEW.state = 'pending'
       BEGIN UPDATE slots SET has_pending = 1 WHERE slot = NEW.slot AND NOT has_pending; END""",
    """CREATE TRIGGER requests_pending_again AFTER UPDATE OF state, slot ON requests
       WHEN NEW.state = 'pending' AND (OLD.state <> 'pending' OR OLD.slot <> NEW.slot)
       BEGIN UPDATE slots SET has_pending = 1 WHERE slot = NEW.slot AND NOT has_pending; END""",
]

_MIGRATIONS: list[list[str]] = [
    [
        """CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)""",
        # A run is one pass over the site; its counters are cumulative over every session
        # (process) that worked on it, updated in the same transactions as the work.
        """CREATE TABLE runs (
            run_id INTEGER PRIMARY KEY,
            started_at REAL NOT NULL,
            finished_at REAL,
            reason TEXT,
            leased INTEGER NOT NULL DEFAULT 0,
            done INTEGER NOT NULL DEFAULT 0,
            failed INTEGER NOT NULL DEFAULT 0,
            redirected INTEGER NOT NULL DEFAULT 0,
            records_inserted INTEGER NOT NULL DEFAULT 0,
            records_updated INTEGER NOT NULL DEFAULT 0,
            records_unchanged INTEGER NOT NULL DEFAULT 0
        )""",
        """CREATE TABLE sessions (
            session_id INTEGER PRIMARY KEY,
            run_id INTEGER NOT NULL,
            worker TEXT NOT NULL,
            started_at REAL NOT NULL,
            ended_at REAL,
            reason TEXT
        )""",
        """CREATE TABLE requests (
            id INTEGER PRIMARY KEY,
            key TEXT NOT NULL UNIQUE,
            fingerprint TEXT NOT NULL,
            url TEXT NOT NULL,
            priority INTEGER NOT NULL,
            is_start INTEGER NOT NULL DEFAULT 0,
            state TEXT NOT NULL,
            data TEXT NOT NULL,
            parent_key TEXT,
            worker TEXT,
            leased_until REAL,
            attempts INTEGER NOT NULL DEFAULT 0,
            unfinished INTEGER NOT NULL DEFAULT 0,
            enqueued_at REAL NOT NULL,
            finished_at REAL,
            error_kind TEXT,
            error_message TEXT,
            run_id INTEGER NOT NULL
        )""",
        # Leasing reads the head of this index: O(log n) whatever the frontier size.
        """CREATE INDEX requests_pending ON requests (priority DESC, is_start, id DESC)
           WHERE state = 'pending'""",
        """CREATE INDEX requests_leased ON requests (worker, leased_until)
           WHERE state = 'leased'""",
        # An ordinary request's key is its fingerprint (the unique key index finds it); only
        # the others (dont_filter requests) need a fingerprint index.
        """CREATE INDEX requests_fingerprint ON requests (fingerprint)
           WHERE key != fingerprint""",
        """CREATE TABLE records (
            record_id TEXT PRIMARY KEY,
            source TEXT NOT NULL,
            natural_key TEXT NOT NULL,
            item_type TEXT NOT NULL,
            data TEXT NOT NULL,
            content_hash TEXT NOT NULL,
            first_seen REAL NOT NULL,
            last_changed REAL NOT NULL,
            first_run_id INTEGER NOT NULL,
            changed_run_id INTEGER NOT NULL,
            request_key TEXT
        ) WITHOUT ROWID""",
        """CREATE INDEX records_last_changed ON records (last_changed)""",
        # Responses received for leased requests and not yet completed (the response journal).
        """CREATE TABLE responses (
            key TEXT PRIMARY KEY,
            data TEXT NOT NULL,
            body BLOB NOT NULL,
            stored_at REAL NOT NULL
        )""",
        """CREATE TABLE rejects (
            id INTEGER PRIMARY KEY,
            item_type TEXT NOT NULL,
            reason TEXT NOT NULL,
            data TEXT NOT NULL,
            request_key TEXT,
            created_at REAL NOT NULL,
            run_id INTEGER NOT NULL
        )""",
    ],
    [
        # The run that last stored or saw a record, and when it first did in that run: a
        # run's feeds hold the records of that run. Set in the page transaction; an unchanged
        # record costs one write the first time a run sees it, none after.
        """ALTER TABLE records ADD COLUMN seen_run_id INTEGER NOT NULL DEFAULT 0""",
        """ALTER TABLE records ADD COLUMN seen_at REAL""",
        """UPDATE records SET seen_run_id = changed_run_id, seen_at = last_changed""",
        # Attempts answered from the response journal (not downloads).
        """ALTER TABLE requests ADD COLUMN replays INTEGER NOT NULL DEFAULT 0""",
        """ALTER TABLE rejects ADD COLUMN page_url TEXT""",
        """ALTER TABLE rejects ADD COLUMN retried_at REAL""",
        # Size an appended feed had before a run first wrote to it.
        """CREATE TABLE feeds (
            run_id INTEGER NOT NULL,
            uri TEXT NOT NULL,
            base_size INTEGER NOT NULL,
            PRIMARY KEY (run_id, uri)
        )""",
    ],
    [
        # Scrapy's queue order: a request is taken first-in-first-out (start requests by
        # default) or last-in-first-out (other requests by default) within its priority and
        # queue; the pending index follows that order (rules.QUEUE_ORDER).
        """ALTER TABLE requests ADD COLUMN fifo INTEGER NOT NULL DEFAULT 0""",
        """DROP INDEX requests_pending""",
        """CREATE INDEX requests_pending ON requests
           (priority DESC, is_start, (CASE WHEN fifo THEN id ELSE -id END))
           WHERE state = 'pending'""",
    ],
    [
        # The order in which a run first stored or saw its records (its feeds' order): a
        # counter per run, taken in the page transaction.
        """ALTER TABLE records ADD COLUMN seen_seq INTEGER NOT NULL DEFAULT 0""",
        """ALTER TABLE runs ADD COLUMN seen_seq INTEGER NOT NULL DEFAULT 0""",
    ],
    [
        # A run's records in its feeds' order, read page by page (no read transaction held
        # while the feed exporter writes).
        """CREATE INDEX records_seen ON records (seen_run_id, seen_seq, seen_at, record_id)""",
    ],
    [
        # The outbox: one entry per record change and delivery target, written in the page
        # transaction that stored the change (only while targets are configured).
        """CREATE TABLE outbox (
            id INTEGER PRIMARY KEY,
            target TEXT NOT NULL,
            idempotency_key TEXT NOT NULL,
            kind TEXT NOT NULL,
            record_id TEXT NOT NULL,
            content_hash TEXT NOT NULL,
            item_type TEXT NOT NULL,
            source TEXT NOT NULL,
            natural_key TEXT NOT NULL,
            data TEXT,
            run_id INTEGER NOT NULL,
            created_at REAL NOT NULL,
            state TEXT NOT NULL DEFAULT 'pending',
            attempts INTEGER NOT NULL DEFAULT 0,
            due_at REAL NOT NULL,
            settled_at REAL,
            detail TEXT
        )""",
        """CREATE INDEX outbox_due ON outbox (target, due_at, id) WHERE state = 'pending'""",
    ],
    [
        # When the stored data was observed (its response received): a record is never
        # replaced by data observed before it. Existing rows: their latest commit (a change
        # or a run's first sight), the latest time known to have held their data.
        """ALTER TABLE records ADD COLUMN observed_at REAL NOT NULL DEFAULT 0""",
        """UPDATE records SET observed_at = max(last_changed, coalesce(seen_at, 0))""",
        # The record's change counter (1 when inserted, +1 per stored change), part of the
        # outbox key: every change has its own key, a change back to earlier content too.
        """ALTER TABLE records ADD COLUMN version INTEGER NOT NULL DEFAULT 1""",
    ],
    [
        # Run counters for monitoring, in the transactions that do the work: records refused
        # as stale, leases taken back from expired or dead workers, completions refused
        # because their lease was lost.
        """ALTER TABLE runs ADD COLUMN records_stale INTEGER NOT NULL DEFAULT 0""",
        """ALTER TABLE runs ADD COLUMN leases_reclaimed INTEGER NOT NULL DEFAULT 0""",
        """ALTER TABLE runs ADD COLUMN leases_lost INTEGER NOT NULL DEFAULT 0""",
        # The run's progress over time: its counters as they were, one row per slot of
        # IDEMPOTENT_SAMPLE_SECONDS, written by the first worker to reach the slot.
        """CREATE TABLE samples (
            run_id INTEGER NOT NULL,
            slot INTEGER NOT NULL,
            at REAL NOT NULL,
            leased INTEGER NOT NULL,
            done INTEGER NOT NULL,
            failed INTEGER NOT NULL,
            redirected INTEGER NOT NULL,
            records_inserted INTEGER NOT NULL,
            records_updated INTEGER NOT NULL,
            records_unchanged INTEGER NOT NULL,
            records_stale INTEGER NOT NULL,
            leases_reclaimed INTEGER NOT NULL,
            leases_lost INTEGER NOT NULL,
            in_flight INTEGER NOT NULL,
            PRIMARY KEY (run_id, slot)
        )""",
    ],
    [
        # Streamed feeds: per run and feed (key "stream " + the feed's URI template), how far
        # the file is durably written (FeedMark) and the worker writing it until when.
        """ALTER TABLE feeds ADD COLUMN seq INTEGER NOT NULL DEFAULT 0""",
        """ALTER TABLE feeds ADD COLUMN byte_offset INTEGER NOT NULL DEFAULT 0""",
        """ALTER TABLE feeds ADD COLUMN batch_id INTEGER NOT NULL DEFAULT 1""",
        """ALTER TABLE feeds ADD COLUMN items INTEGER NOT NULL DEFAULT 0""",
        """ALTER TABLE feeds ADD COLUMN first_seq INTEGER NOT NULL DEFAULT 0""",
        """ALTER TABLE feeds ADD COLUMN total INTEGER NOT NULL DEFAULT 0""",
        """ALTER TABLE feeds ADD COLUMN writer TEXT""",
        """ALTER TABLE feeds ADD COLUMN writer_until REAL""",
    ],
    [
        # Politeness for the whole crawl: each request's download slot (Scrapy's slot key),
        # and per slot its limits, when it may be sent to next and the pause a site asked
        # for. A claim reads the slots that may send, then the head of each one's pending
        # requests (requests_slot_pending, in rules.QUEUE_ORDER) and counts its leases
        # (requests_slot_leased). Rows of earlier versions are in slot '' (no limits).
        """ALTER TABLE requests ADD COLUMN slot TEXT NOT NULL DEFAULT ''""",
        """CREATE INDEX requests_slot_pending ON requests
           (slot, priority DESC, is_start, (CASE WHEN fifo THEN id ELSE -id END))
           WHERE state = 'pending'""",
        """CREATE INDEX requests_slot_leased ON requests (slot) WHERE state = 'leased'""",
        """CREATE TABLE slots (
            slot TEXT PRIMARY KEY,
            concurrency INTEGER NOT NULL,
            delay REAL NOT NULL DEFAULT 0,
            crawl_delay REAL NOT NULL DEFAULT 0,
            next_send_at REAL NOT NULL DEFAULT 0,
            paused_until REAL NOT NULL DEFAULT 0,
            backoffs INTEGER NOT NULL DEFAULT 0
        ) WITHOUT ROWID""",
        """INSERT INTO slots (slot, concurrency) VALUES ('', 1000000)""",
    ],
    [
        # Record identity: per record type (the name in its record IDs), the natural key
        # fields its records were stored under (JSON list; [] for the page URL or the
        # content), written with its first record; a crawl keyed otherwise is refused.
        """CREATE TABLE record_keys (
            record_type TEXT PRIMARY KEY,
            item_type TEXT NOT NULL,
            fields TEXT NOT NULL,
            recorded_at REAL NOT NULL
        ) WITHOUT ROWID""",
    ],
    [
        # robots.txt of the crawl: per site (host[:port], as Scrapy keys its parsers) the
        # answer to /robots.txt (its final URL, status and body) and when it was fetched, on
        # the store's clock; every worker and every resume reads it instead of fetching.
        """CREATE TABLE robots (
            netloc TEXT PRIMARY KEY,
            url TEXT NOT NULL,
            status INTEGER NOT NULL,
            body BLOB NOT NULL,
            fetched_at REAL NOT NULL
        ) WITHOUT ROWID""",
    ],
    [
        # Responses received from the network per request (retries included; not answers
        # of the response journal or of Scrapy's HTTP cache), written with the transaction
        # after they arrive. Before, downloads were estimated as leases minus replays.
        """ALTER TABLE requests ADD COLUMN downloads INTEGER NOT NULL DEFAULT 0""",
        """UPDATE requests SET downloads = max(attempts - replays, 0)""",
    ],
    [
        # Conditional requests: per request done with validators (ETag, Last-Modified) what
        # its page answered with and produced (its records' IDs and the requests it added,
        # JSON lists), kept from run to run; a 304 answer is completed from it.
        """CREATE TABLE page_validators (
            key TEXT PRIMARY KEY,
            etag TEXT,
            last_modified TEXT,
            body_hash TEXT NOT NULL,
            record_ids TEXT NOT NULL,
            children TEXT NOT NULL,
            run_id INTEGER NOT NULL,
            stored_at REAL NOT NULL
        ) WITHOUT ROWID""",
    ],
    [
        # Adaptive revisits: per page kept, the size of its body when last downloaded in
        # full, its revisit interval and when it is due (NULL: every run), and how the run
        # of run_id last reached it ('fetched', 'not_modified', 'not_due').
        """ALTER TABLE page_validators ADD COLUMN body_bytes INTEGER NOT NULL DEFAULT 0""",
        """ALTER TABLE page_validators ADD COLUMN revisit_seconds REAL""",
        """ALTER TABLE page_validators ADD COLUMN due_at REAL""",
        """ALTER TABLE page_validators ADD COLUMN outcome TEXT NOT NULL DEFAULT 'fetched'""",
    ],
    _COUNTED_STATES,
    _LINKED_REQUESTS,
    _SLOT_WANTED,
    _SLOT_PENDING,
    # A request row's encoded request packed (packing.pack: raw deflate with a preset
    # dictionary of the codec's fixed fragments and the row's URL), stored as a BLOB in its
    # `data` column (a TEXT column keeps a BLOB as given) where that is smaller than the
    # text. Nothing to change in the file: the version says that its rows may hold such
    # BLOBs, which a release before reads as no request (it refuses this version instead).
    # The rows written before keep their text and are read as they are.
    [],
    [
        # The run's latest observation time (of the records seen in it), kept by the page
        # commits in the run's row: a session resuming the run reads it instead of every
        # record the run saw (seconds at millions). NULL for the runs before: their records
        # are read once, when a session resumes one.
        "ALTER TABLE runs ADD COLUMN observed_at REAL",
    ],
]
assert len(_MIGRATIONS) == SCHEMA_VERSION

#: ``PRAGMA application_id`` of the package's databases ("SIDP"): a file with another one is
#: not ours, whatever its tables.
APPLICATION_ID = 0x53494450
#: The tables of each schema version: a file with any other table is not ours.
_TABLES_1 = frozenset({"meta", "runs", "sessions", "requests", "records", "responses",
                       "rejects"})
_TABLES: dict[int, frozenset[str]] = {1: _TABLES_1, 2: _TABLES_1 | {"feeds"},
                                      3: _TABLES_1 | {"feeds"}, 4: _TABLES_1 | {"feeds"},
                                      5: _TABLES_1 | {"feeds"},
                                      6: _TABLES_1 | {"feeds", "outbox"},
                                      7: _TABLES_1 | {"feeds", "outbox"},
                                      8: _TABLES_1 | {"feeds", "outbox", "samples"},
                                      9: _TABLES_1 | {"feeds", "outbox", "samples"},
                                      10: _TABLES_1 | {"feeds", "outbox", "samples", "slots"},
                                      11: _TABLES_1 | {"feeds", "outbox", "samples", "slots",
                                                       "record_keys"},
                                      12: _TABLES_1 | {"feeds", "outbox", "samples", "slots",
                                                       "record_keys", "robots"}}
_TABLES[13] = _TABLES[12]
_TABLES[14] = _TABLES[13] | {"page_validators"}
_TABLES[15] = _TABLES[14]
_TABLES[16] = _TABLES[15]
_TABLES[17] = _TABLES[16] | {"linked_requests"}
_TABLES[18] = _TABLES[17]
_TABLES[19] = _TABLES[18]
_TABLES[20] = _TABLES[19]
_TABLES[21] = _TABLES[20]
assert set(_TABLES) == set(range(1, SCHEMA_VERSION + 1))
#: Schema versions written before the application id was (files of those have none).
_BEFORE_APPLICATION_ID = frozenset({1, 2, 3})
