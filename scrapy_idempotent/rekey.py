"""Re-identifying stored records: the natural keys a crawl may use, and moving records to new
ones.

Every record ID is derived from its record's data (:mod:`.records`), so a change to what
identifies an item (its natural key fields, its record type, the record ID scheme) would
give every stored item a second record. The database records each record type's natural
key with its first record; at open a crawl is refused when its settings key a stored type
otherwise (:func:`check_keys`, one line per type naming the stored key, the new one and the
command that moves the records).

``scrapy idempotent rekey`` and the open of a database of an earlier record ID scheme move
the records (:func:`plan_rekey`, then :func:`apply_rekey`): every record's natural key and ID
are derived again from its stored data under the current settings, in one transaction.
Records that now share an ID are merged: the one observed latest wins (its data, its
version), the earliest ``first_seen`` is kept, the others are deleted and listed. What hangs
off a record ID moves with it: outbox entries name the new ID (their idempotency keys stay:
an entry delivered again must be known to its receiver), and files named by the record ID
in a local files store are linked under the new name before the transaction and the old
names removed after it (the paths to remove are kept in the database until they are: a
kill between leaves them listed for the next rekey or crawl to remove).

A record type keyed by the page URL (no key configured) keeps its natural key; one moved
from a key to the page URL takes the URL of the request that stored it, when the frontier
still has it (records of ``start()`` take their content), ranked on its page in the order
the records were first seen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .exceptions import MissingNaturalKey, StoreError, changed_key_message, describe_key
from .records import (
    MIGRATABLE_RECORD_ID_SCHEMES,
    RECORD_ID_SCHEME,
    RecordIdentity,
    page_key,
    page_position,
    record_id_of,
)
from .store.base import RecordKey, RecordMove, Rekey, StoredIdentity

if TYPE_CHECKING:
    from .store.base import FrontierStore

__all__ = [
    "FileStores",
    "RekeyPlan",
    "apply_rekey",
    "check_keys",
    "finish_cleanup",
    "migratable",
    "plan_rekey",
    "resolve_class",
]

logger = logging.getLogger(__name__)

#: Records read per statement while planning.
READ_BATCH = 5000


@dataclass(frozen=True)
class FileStores:
    """Where files named by record ID are: the base directories of the local files stores
    (``FILES_STORE``, ``IMAGES_STORE`` as paths or ``file://``), whether a remote one is
    configured, and the item fields holding their results (``FILES_RESULT_FIELD``,
    ``IMAGES_RESULT_FIELD``)."""

    local: tuple[str, ...] = ()
    remote: tuple[str, ...] = ()
    fields: tuple[str, ...] = ("files", "images")

    @classmethod
    def from_settings(cls, settings: Any) -> FileStores:
        """The files stores of Scrapy ``settings`` (a settings object or a dict)."""
        local: list[str] = []
        remote: list[str] = []
        for name in ("FILES_STORE", "IMAGES_STORE"):
            uri = settings.get(name)
            if not uri:
                continue
            uri = str(uri)
            scheme = urlsplit(uri).scheme
            if scheme == "file":
                local.append(urlsplit(uri).path)
            elif len(scheme) > 1:  # (a Windows drive letter is no scheme)
                remote.append(uri)
            else:
                local.append(uri)
        fields = tuple(str(settings.get(name) or default) for name, default in (
            ("FILES_RESULT_FIELD", "files"), ("IMAGES_RESULT_FIELD", "images")))
        return cls(local=tuple(dict.fromkeys(local)), remote=tuple(remote), fields=fields)


@dataclass
class RekeyPlan:
    """What re-identifying the records would do (:func:`plan_rekey`)."""

    #: the transaction (None: nothing to change)
    change: Rekey
    #: new record ID -> (the record kept, the records merged into it), of records that now
    #: share an ID
    merges: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    #: (record ID, item type, why) of records that cannot be given a key under the settings
    unkeyable: list[tuple[str, str, str]] = field(default_factory=list)
    #: record type -> (stored key fields or None when none was recorded, new key fields)
    changed_keys: dict[str, tuple[tuple[str, ...] | None, tuple[str, ...]]] = field(
        default_factory=dict)
    #: records whose natural key changes (their ID changes with it)
    rekeyed: int = 0
    #: (old path, new path) of files to link before the transaction
    file_links: list[tuple[str, str]] = field(default_factory=list)
    #: record types whose class does not import (keyed by their names alone)
    missing_classes: list[str] = field(default_factory=list)
    #: records naming files by their record ID in a remote files store (left as they are)
    remote_files: int = 0
    #: the database's record ID scheme is another
    scheme_changed: bool = False
    #: the record keys to record differ from those recorded
    keys_changed: bool = False

    @property
    def records(self) -> int:
        """Records read."""
        return self.change.records

    @property
    def moved(self) -> int:
        """Records given a new ID."""
        return sum(move.new_record_id != move.record_id for move in self.change.moves)

    @property
    def needed(self) -> bool:
        """Whether anything would change."""
        return bool(self.change.moves or self.change.merged or self.scheme_changed
                    or self.keys_changed)


def resolve_class(type_name: str) -> type | None:
    """The item class named ``type_name`` (``module.QualName``; ``dict``), or None when it
    does not import (renamed, removed, or defined in a script)."""
    if type_name == "dict":
        return dict
    module_name, _, qualname = type_name.rpartition(".")
    while module_name:
        try:
            found: Any = importlib.import_module(module_name)
        except Exception:
            module_name, _, head = module_name.rpartition(".")
            qualname = f"{head}.{qualname}"
            continue
        try:
            for part in qualname.split("."):
                found = getattr(found, part)
        except AttributeError:
            return None
        return found if isinstance(found, type) else None
    return None


class _Types:
    """The record type and key fields of each stored item type under the settings."""

    def __init__(self, identity: RecordIdentity) -> None:
        self.identity = identity
        self._known: dict[str, RecordKey] = {}
        self.missing: list[str] = []

    def key(self, item_type: str) -> RecordKey:
        known = self._known.get(item_type)
        if known is None:
            cls = resolve_class(item_type)
            if cls is None:
                self.missing.append(item_type)
                fields = self.identity.fields_of([item_type])
                record_type = self.identity.record_type_of(item_type)
            else:
                fields = self.identity.fields_of(cls.__mro__)
                record_type = self.identity.record_type_of(item_type, cls.__qualname__)
            known = self._known[item_type] = RecordKey(record_type, item_type, fields)
        return known


def check_keys(store: FrontierStore, identity: RecordIdentity) -> list[str]:
    """Why a crawl with ``identity`` would store a second record of items already stored:
    one line per recorded record type whose item type the settings now key by other fields
    or identify as another record type (empty: none). Item types that no longer import are
    compared by their names (``IDEMPOTENT_NATURAL_KEYS`` entries of ``module.Class`` or
    ``Class``)."""
    types = _Types(identity)
    lines = []
    for stored in store.record_keys():
        now = types.key(stored.item_type)
        if now.record_type != stored.record_type:
            lines.append(
                f"the records of {stored.item_type} are identified as record type "
                f"{stored.record_type}, the settings now make it {now.record_type} "
                "(IDEMPOTENT_RECORD_TYPES): run `scrapy idempotent rekey` to move the "
                f"records (or map {stored.item_type} to {stored.record_type} again)")
        elif now.fields != stored.fields:
            lines.append(changed_key_message(stored.record_type, stored.fields, now.fields))
    return lines


def plan_rekey(store: FrontierStore, identity: RecordIdentity, files: FileStores = FileStores(),
               scheme: str = RECORD_ID_SCHEME) -> RekeyPlan:
    """What re-identifying every stored record under ``identity`` would write: read in
    record ID order, nothing written."""
    stored_keys = {key.item_type: key for key in store.record_keys()}
    types = _Types(identity)
    rows: list[tuple[StoredIdentity, RecordKey, list[Any] | None]] = []
    by_page: dict[str, list[int]] = defaultdict(list)
    unkeyable: list[tuple[str, str, str]] = []
    after: str | None = None
    while True:
        batch = store.stored_identities(after, READ_BATCH)
        if not batch:
            break
        after = batch[-1].record_id
        for row in batch:
            key = types.key(row.item_type)
            values = _natural_key(identity, row, key, stored_keys.get(row.item_type))
            row = _slim(row, files)
            if isinstance(values, str):
                if values == "page":  # ranked on its page once every record is read
                    assert row.page_url is not None
                    by_page[page_key(row.page_url, identity.url_ignore_params)].append(
                        len(rows))
                    rows.append((row, key, None))
                else:
                    unkeyable.append((row.record_id, row.item_type, values))
                continue
            rows.append((row, key, values))
    for page, members in by_page.items():
        seen: Counter[str] = Counter()
        for n in sorted(members, key=lambda n: (rows[n][0].seen_seq, rows[n][0].record_id)):
            row, key, _ = rows[n]
            position = page_position(seen, page, row.item_type)
            rows[n] = (row, key, [page] if position is None else [page, *position])
    return _plan(identity, rows, unkeyable, types, stored_keys, files, scheme,
                 record_count=len(rows) + len(unkeyable),
                 scheme_changed=_stored_scheme(store) != scheme)


def _slim(row: StoredIdentity, files: FileStores) -> StoredIdentity:
    """``row`` as the plan keeps it once its natural key is derived: its data only when it
    may name files by the record ID (the rest is most of a record's size: 100,000 records
    of 600 bytes took 235 MB to plan with it)."""
    names_files = bool(files.local or files.remote) and f"/{row.record_id}/" in row.data
    return dataclasses.replace(row, data=row.data if names_files else "", content_hash="",
                               request_key=None, page_url=None)


def _stored_scheme(store: FrontierStore) -> str:
    return store.meta().get("record_id_scheme", RECORD_ID_SCHEME)


def _natural_key(identity: RecordIdentity, row: StoredIdentity, key: RecordKey,
                 stored: RecordKey | None) -> list[Any] | str:
    """The natural key values of ``row`` under ``key``; ``"page"`` when they are its page's
    URL and rank (see :func:`plan_rekey`); else why it has none."""
    data = json.loads(row.data)
    if key.fields:
        try:
            return identity.stored_natural_key(key.fields, data, row.item_type)
        except MissingNaturalKey as exc:
            return str(exc)
    old: list[Any] = json.loads(row.natural_key)
    if (stored.fields == () if stored is not None else _unkeyed_form(old)):
        return old  # keyed by the page URL (or the content) before too: the same key
    if row.request_key is None:  # an item of start(): its content
        hashed, _ = identity.stored_content(data)
        return [identity.stored_content_key(row.item_type, hashed)]
    if row.page_url is None:
        return ("its page URL is no longer known (the frontier does not hold the request "
                "that stored it)")
    return "page"


def _unkeyed_form(values: list[Any]) -> bool:
    """Whether stored natural key ``values`` have the form of a page URL key (with its rank)
    or a content key: a database that recorded no keys (record ID scheme 1)."""
    if not values or not isinstance(values[0], str):
        return False
    first = values[0]
    if first.startswith("content:sha256:"):
        return len(values) == 1
    parts = urlsplit(first)
    return bool(parts.scheme and parts.netloc) and (
        len(values) == 1 or (len(values) == 3 and str(values[2]).startswith("#")))


def _plan(identity: RecordIdentity,
          rows: list[tuple[StoredIdentity, RecordKey, list[Any] | None]],
          unkeyable: list[tuple[str, str, str]], types: _Types,
          stored_keys: dict[str, RecordKey], files: FileStores, scheme: str, *,
          record_count: int, scheme_changed: bool) -> RekeyPlan:
    from .codec import canonical_json

    groups: dict[str, list[tuple[StoredIdentity, str]]] = defaultdict(list)
    keys: dict[str, RecordKey] = {}
    changed: dict[str, tuple[tuple[str, ...] | None, tuple[str, ...]]] = {}
    rekeyed = 0
    for row, key, values in rows:
        assert values is not None
        natural_key = canonical_json(values)
        if natural_key != row.natural_key:
            rekeyed += 1
        groups[record_id_of(identity.source, key.record_type, values)].append(
            (row, natural_key))
        recorded = keys.setdefault(key.record_type, key)
        if recorded.fields != key.fields:
            raise StoreError(
                f"item types {recorded.item_type} and {key.item_type} are both record type "
                f"{key.record_type} (IDEMPOTENT_RECORD_TYPES) but keyed by "
                f"{describe_key(recorded.fields)} and {describe_key(key.fields)}: give them "
                "one natural key, or record types of their own")
        before = stored_keys.get(row.item_type)
        if before is None or before.fields != key.fields or before.record_type != key.record_type:
            changed.setdefault(key.record_type,
                               (None if before is None else before.fields, key.fields))
    moves: list[RecordMove] = []
    merged: list[str] = []
    merges: dict[str, tuple[str, list[str]]] = {}
    outbox: dict[str, str] = {}
    links: list[tuple[str, str]] = []
    cleanup: list[str] = []
    remote: list[str] = []
    for new_id, members in groups.items():
        members.sort(key=lambda m: (m[0].observed_at, m[0].record_id), reverse=True)
        (winner, natural_key), losers = members[0], members[1:]
        if losers:
            merges[new_id] = (winner.record_id, [row.record_id for row, _ in losers])
            merged.extend(row.record_id for row, _ in losers)
        for row, _ in members:
            if row.record_id != new_id:
                outbox[row.record_id] = new_id
        data, content_hash = _moved_files(identity, winner, new_id, files, links, cleanup,
                                          remote)
        for row, _ in losers:
            cleanup.extend(_record_files(row, files))
        first_seen = min(row.first_seen for row, _ in members)
        if (new_id != winner.record_id or natural_key != winner.natural_key
                or data is not None or first_seen < winner.first_seen):
            moves.append(RecordMove(
                record_id=winner.record_id, new_record_id=new_id, natural_key=natural_key,
                data=data, content_hash=content_hash,
                first_seen=first_seen if first_seen < winner.first_seen else None))
    change = Rekey(moves=tuple(moves), merged=tuple(sorted(merged)), outbox=outbox,
                   keys=tuple(sorted(keys.values(), key=lambda k: k.record_type)),
                   scheme=scheme, records=record_count, cleanup=tuple(dict.fromkeys(cleanup)))
    return RekeyPlan(change=change, merges=merges, unkeyable=unkeyable, changed_keys=changed,
                     rekeyed=rekeyed, file_links=links, missing_classes=sorted(types.missing),
                     remote_files=len(remote),
                     scheme_changed=scheme_changed,
                     keys_changed=set(keys.values()) != set(stored_keys.values()))


def _record_files(row: StoredIdentity, files: FileStores) -> list[str]:
    """The local files of stored record ``row`` (absolute paths; thumbnails included)."""
    found: list[str] = []
    data = json.loads(row.data) if row.data else {}  # (none kept: it names no file)
    for base in files.local:
        for name in files.fields:
            for entry in data.get(name) or ():
                path = entry.get("path") if isinstance(entry, dict) else None
                if isinstance(path, str) and f"/{row.record_id}/" in f"/{path}":
                    found.append(os.path.join(base, path))
        thumbs = Path(base, "thumbs")
        if thumbs.is_dir():
            for thumb_dir in thumbs.iterdir():
                folder = thumb_dir / row.record_id
                if folder.is_dir():
                    found.extend(str(p) for p in sorted(folder.iterdir()) if p.is_file())
    return found


def _moved_files(identity: RecordIdentity, row: StoredIdentity, new_id: str, files: FileStores,
                 links: list[tuple[str, str]], cleanup: list[str], remote: list[str]
                 ) -> tuple[str | None, str | None]:
    """The data and content hash of ``row`` with its file paths named by ``new_id`` (None,
    None: it names no file by its record ID, or keeps its ID); the files to link under the
    new names and to remove after are added to ``links`` and ``cleanup``."""
    old_id = row.record_id
    if new_id == old_id or f"/{old_id}/" not in row.data:
        return None, None
    if files.remote:  # the files cannot be moved from here: the record keeps its paths
        remote.append(old_id)
        return None, None
    data = json.loads(row.data)
    changed = False
    mine: list[tuple[str, str]] = []
    for name in files.fields:
        entries = data.get(name)
        if not isinstance(entries, list):
            continue
        for entry in entries:
            path = entry.get("path") if isinstance(entry, dict) else None
            if not isinstance(path, str) or f"/{old_id}/" not in f"/{path}":
                continue
            new_path = f"/{path}".replace(f"/{old_id}/", f"/{new_id}/", 1)[1:]
            entry["path"] = new_path
            changed = True
            for base in files.local:
                mine.append((os.path.join(base, path), os.path.join(base, new_path)))
    if not changed:
        return None, None
    for base in files.local:
        thumbs = Path(base, "thumbs")
        if thumbs.is_dir():
            for thumb_dir in thumbs.iterdir():
                folder = thumb_dir / old_id
                if folder.is_dir():
                    mine.extend((str(p), str(thumb_dir / new_id / p.name))
                                for p in sorted(folder.iterdir()) if p.is_file())
    links.extend(mine)
    cleanup.extend(old for old, _ in mine)
    from .codec import ordered_json

    _, content_hash = identity.stored_content(data)
    return ordered_json(data), content_hash


def apply_rekey(store: FrontierStore, plan: RekeyPlan) -> None:
    """Write ``plan``: the files linked under their new names first, then the one
    transaction, then the old names removed (:func:`finish_cleanup`)."""
    for old, new in plan.file_links:
        if os.path.exists(new) or not os.path.exists(old):
            continue
        os.makedirs(os.path.dirname(new), exist_ok=True)
        try:
            os.link(old, new)
        except OSError:  # another file system, or links not supported: a copy
            import shutil

            shutil.copy2(old, new + ".rekey-partial")
            os.replace(new + ".rekey-partial", new)
    store.rekey(plan.change)
    finish_cleanup(store)


def finish_cleanup(store: FrontierStore) -> int:
    """Remove the files a committed rekey left to remove (:meth:`~.FrontierStore.rekey_cleanup`)
    and their folders once empty; returns how many files were removed."""
    paths = store.rekey_cleanup()
    if not paths:
        return 0
    removed = 0
    folders: set[str] = set()
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed += 1
        folders.add(os.path.dirname(path))
    for folder in sorted(folders, key=len, reverse=True):
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # only when empty
    store.end_rekey_cleanup()
    if removed:
        logger.info("scrapy_idempotent: removed %d files named by record IDs no record has "
                    "any more (re-identified records)", removed)
    return removed


def migratable(scheme: str) -> bool:
    """Whether a database of record ID ``scheme`` is re-identified rather than refused."""
    return scheme in MIGRATABLE_RECORD_ID_SCHEMES


def open_identity(store: FrontierStore, identity: RecordIdentity, files: FileStores,
                  where: str) -> RekeyPlan | None:
    """At a crawl's open, before its session begins: make sure that what the crawl stores
    meets the stored records under the same IDs, and tell ``identity`` the stored keys.

    A database of an earlier record ID scheme is re-identified here when that only renames
    records (no key changed, nothing to merge, no file in a remote store, no crawl of it
    running); returns the plan applied (None: nothing was to do). Raises
    :class:`~.StoreError` (nothing written) when the records need ``scrapy idempotent
    rekey``: the settings key a stored record type otherwise, or identify it as another
    record type. Files a committed rekey left to remove are removed."""
    finish_cleanup(store)
    applied: RekeyPlan | None = None
    scheme = _stored_scheme(store)
    if migratable(scheme):
        running = store.live_workers()
        if running:
            raise StoreError(
                f"{where} holds records of record ID scheme {scheme}, which this release "
                f"re-identifies (scheme {RECORD_ID_SCHEME}: the item type is part of the "
                f"record ID) once no crawl of it runs; {', '.join(running[:3])} still "
                "crawl(s) it: stop every crawl of it (or run `scrapy idempotent rekey` "
                "once they are stopped)")
        plan = plan_rekey(store, identity, files)
        if plan.rekeyed or plan.merges or plan.unkeyable or plan.remote_files:
            raise StoreError(
                f"{where} holds records of record ID scheme {scheme}, and the settings "
                f"give {plan.rekeyed + len(plan.unkeyable)} of them another natural key"
                + (f", {len(plan.merges)} would be merged" if plan.merges else "")
                + (f", {plan.remote_files} name files in a remote files store"
                   if plan.remote_files else "")
                + ": it was left untouched; run `scrapy idempotent rekey --dry-run` to see "
                "what would change, then `scrapy idempotent rekey`")
        apply_rekey(store, plan)
        applied = plan
    else:
        lines = check_keys(store, identity)
        if lines:
            raise StoreError(f"{where}: " + "; ".join(lines))
    identity.expect_keys(store.record_keys())
    return applied
