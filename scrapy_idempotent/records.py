"""Record identity: record types, natural keys, record IDs, content hashes and file names,
all derived from item data.

``record_id = sha256(canonical JSON of [source, record type, natural key values])[:32]``
(128 bits, hex). The source defaults to the spider name; the record type is the item's class
(``module.QualName``) unless ``IDEMPOTENT_RECORD_TYPES`` names it otherwise (so a renamed
class keeps its records), so a product and its offer with one SKU are two records; the
natural key is a field (or fields) configured per item type, or, when none is configured,
the canonical URL of the page the item came from with tracking and session parameters
removed (with the item's type and rank on the page after the page's first such item:
:func:`page_position`), or the item's content for an item of no page. A stored file is named
by its record ID and :func:`url_key`. Nothing here depends on time, or the Python process, so
the same data always gets the same ID.

These rules are scheme :data:`RECORD_ID_SCHEME`. A database records the scheme its records
were identified with (``record_id_scheme`` in its ``meta`` table). Scheme 1 (the first
releases) left the record type out of the record ID; its databases are re-identified by
:mod:`.rekey` (at the next crawl's open, or by ``scrapy idempotent rekey``). A database of a
scheme this release does not know is refused at open, before it stores a record under an ID
the stored ones cannot match.

Each record type's natural key fields (:class:`~.store.base.RecordKey`) are recorded in the
database with its first record; a crawl whose keys differ is refused at open
(:mod:`.rekey`), and, for a type the open could not check, its items are refused one by one
(:class:`~.exceptions.NaturalKeyChanged`), never stored under a second identity.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_plus, urlsplit

from itemadapter import ItemAdapter
from w3lib.url import canonicalize_url

from .codec import EncodeError, canonical_json, encode_value, ordered_json
from .exceptions import MissingNaturalKey, NaturalKeyChanged
from .store.base import Record, RecordKey
from .store.rules import MIGRATED_RECORD_ID_SCHEMES

if TYPE_CHECKING:
    from collections import Counter
    from collections.abc import Iterable

__all__ = [
    "CONTENT_KEY",
    "MIGRATABLE_RECORD_ID_SCHEMES",
    "RECORD_ID_SCHEME",
    "URL_KEY",
    "Record",
    "RecordIdentity",
    "RecordKey",
    "class_name",
    "is_record_id",
    "item_type_name",
    "page_key",
    "page_position",
    "record_id_of",
    "url_key",
]

#: The scheme of the rules here (see the module docstring): changed with any change to how a
#: natural key, a record ID or a content hash is derived from an item.
RECORD_ID_SCHEME = "2"
#: Earlier schemes whose databases are re-identified (:mod:`.rekey`) instead of refused.
MIGRATABLE_RECORD_ID_SCHEMES = MIGRATED_RECORD_ID_SCHEMES
#: The length of a record ID (hex digits of SHA-256).
RECORD_ID_LENGTH = 32

#: Pseudo field name reported when the page URL is the natural key.
URL_KEY = "<page url>"
#: Pseudo field name reported when the item's content is the natural key (no page, no key).
CONTENT_KEY = "<content>"


def item_type_name(item: Any) -> str:
    """``module.QualName`` of the item's class (``dict`` for plain dicts)."""
    return class_name(type(item))


def class_name(cls: type) -> str:
    """``module.QualName`` of an item class (``dict`` for plain dicts)."""
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def page_key(url: str, ignore_params: Iterable[str]) -> str:
    """The canonical form of a page URL used as a natural key.

    :func:`w3lib.url.canonicalize_url` (sorted query, no fragment), then every query argument
    and ``;name=value`` path parameter whose name matches ``ignore_params`` is removed (exact,
    case-insensitive; a trailing ``*`` matches a prefix), so ``?utm_source=x`` or
    ``;jsessionid=...`` variants of a page are one key.
    """
    patterns = [p.lower() for p in ignore_params]

    def ignored(name: str) -> bool:
        name = name.lower()
        return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in patterns)

    url = canonicalize_url(url)
    parts = urlsplit(url)
    if ";" in parts.path:

        def clean(segment: str) -> str:
            head, *params = segment.split(";")
            kept = [p for p in params if not ignored(p.split("=", 1)[0])]
            return ";".join([head, *kept])

        url = parts._replace(path="/".join(clean(s) for s in parts.path.split("/"))).geturl()
    # Filter the canonical query pair by pair (repeated names kept, order kept), matching on
    # the unquoted name: w3lib's url_query_cleaner would also drop repeated arguments.
    parts = urlsplit(url)
    if parts.query:
        pairs = parts.query.split("&")
        kept = [p for p in pairs if not ignored(unquote_plus(p.split("=", 1)[0]))]
        if len(kept) != len(pairs):
            url = parts._replace(query="&".join(kept)).geturl()
    return url


def url_key(url: str, ignore_params: Iterable[str]) -> str:
    """16 hex digits naming ``url`` without its ignored query parameters and fragment (the
    SHA-1 of :func:`page_key`): a stored file's name beside its record ID."""
    return hashlib.sha1(page_key(url, ignore_params).encode()).hexdigest()[:16]


def page_position(seen: Counter[str], key: str, type_name: str) -> list[str] | None:
    """What tells an item keyed by its page URL ``key`` apart from the page's other such
    items, counted in ``seen`` (one counter per page, updated here): None for the page's
    first such item (its key is the page URL alone), else its type and its rank among such
    items of its type on the page (``#1`` for the first), appended to its natural key."""
    first = not seen
    seen[f"{key}|{type_name}"] += 1
    if first:
        return None
    return [type_name, f"#{seen[f'{key}|{type_name}']}"]


def is_record_id(value: object) -> bool:
    """Whether ``value`` has the form of a record ID (a stamped one read back from an item)."""
    return isinstance(value, str) and len(value) == RECORD_ID_LENGTH


class RecordIdentity:
    """Computes record IDs and content hashes for one crawl.

    ``natural_keys`` maps an item class (``module.Class``, ``Class`` or ``*``) to the field
    names of its natural key; classes without an entry use the page URL (see :func:`page_key`).
    ``record_types`` maps an item class (``module.Class`` or ``Class``, that class only) to
    the record type its records are identified by (default: its ``module.QualName``).
    ``stored_keys`` (record type -> natural key fields, as the database recorded them, see
    :meth:`expect_keys`): an item whose type is keyed otherwise is refused.
    """

    def __init__(
        self,
        *,
        source: str,
        natural_keys: dict[str, tuple[str, ...]],
        url_ignore_params: Iterable[str] = (),
        record_id_field: str | None = "record_id",
        volatile_fields: Iterable[str] = (),
        record_types: dict[str, str] | None = None,
    ) -> None:
        self.source = source
        self.natural_keys = dict(natural_keys)
        self.url_ignore_params = tuple(url_ignore_params)
        self.record_id_field = record_id_field
        self.volatile_fields = frozenset(volatile_fields)
        self.record_types = dict(record_types or {})
        self.stored_keys: dict[str, tuple[str, ...]] = {}
        self._keys_by_type: dict[type, RecordKey | NaturalKeyChanged] = {}

    @classmethod
    def from_config(cls, config: Any) -> RecordIdentity:
        """The record identity of a crawl's :class:`~.config.IdempotentConfig`."""
        return cls(source=config.source, natural_keys=config.natural_keys,
                   url_ignore_params=config.url_ignore_params,
                   record_id_field=config.record_id_field,
                   volatile_fields=config.volatile_fields, record_types=config.record_types)

    def expect_keys(self, stored: Iterable[RecordKey]) -> None:
        """The natural keys the database recorded per record type: an item whose record type
        is among them and whose key fields differ is refused from now on."""
        self.stored_keys = {key.record_type: key.fields for key in stored}
        self._keys_by_type.clear()

    def key_fields(self, item: Any) -> tuple[str, ...] | None:
        """The natural key fields configured for the item's type, or None for the page URL.
        Raises :class:`~.NaturalKeyChanged` when its record type was stored under others."""
        fields = self.record_key(item).fields
        return fields or None

    def record_key(self, item: Any) -> RecordKey:
        """The record type, item type and natural key fields of ``item`` (empty fields: the
        page URL or the content). Raises :class:`~.NaturalKeyChanged` when the database
        recorded other fields for its record type."""
        cls = type(item)
        try:
            known = self._keys_by_type[cls]
        except KeyError:
            known = self._keys_by_type[cls] = self._key_of_class(cls)
        if isinstance(known, NaturalKeyChanged):
            raise known
        return known

    def _key_of_class(self, cls: type) -> RecordKey | NaturalKeyChanged:
        type_name = class_name(cls)
        key = RecordKey(record_type=self.record_type_of(type_name, cls.__qualname__),
                        item_type=type_name, fields=self.fields_of(cls.__mro__))
        stored = self.stored_keys.get(key.record_type)
        if stored is not None and stored != key.fields:
            return NaturalKeyChanged(key.record_type, stored, key.fields)
        return key

    def record_type_of(self, type_name: str, qualname: str | None = None) -> str:
        """The record type of the item class named ``type_name`` (``module.QualName``):
        ``IDEMPOTENT_RECORD_TYPES``' entry for that name or its ``qualname``, else the name."""
        if qualname is None:
            qualname = type_name.rsplit(".", 1)[-1]
        found = self.record_types.get(type_name)
        if found is None:
            found = self.record_types.get(qualname)
        return found if found is not None else type_name

    def fields_of(self, classes: Iterable[type] | Iterable[str]) -> tuple[str, ...]:
        """The natural key fields configured for the first of ``classes`` (a class's
        ``__mro__``, or the ``module.QualName`` of a class that cannot be imported) that
        has an entry, else the ``*`` entry; empty: none (the page URL or the content)."""
        for klass in classes:
            if isinstance(klass, str):
                names = (klass, klass.rsplit(".", 1)[-1])
            else:
                names = (f"{klass.__module__}.{klass.__qualname__}", klass.__qualname__)
            for name in names:
                if name in self.natural_keys:
                    return self.natural_keys[name]
        return self.natural_keys.get("*", ())

    def natural_key(self, item: Any, page_url: str | None) -> list[Any]:
        """The normalised natural key values of ``item``: a text or number as a string with
        surrounding whitespace removed (so ``123``, ``"123"`` and ``" 123 "`` are one key);
        any other value (a boolean, a list, a dict, bytes, a date) as its tagged JSON value,
        not as text, so it never equals a string: ``True`` and ``"true"``, ``[1]`` and
        ``"[1]"`` are different keys. (Record IDs of text and number keys are what they
        always were; those of other keys changed once, when this rule came.)

        Without a configured key: the page URL (see :func:`page_key`), or for an item that
        came from no page (from ``Spider.start()``) its content: ``content:sha256:<hex>`` of
        its type and data without the record ID field and the volatile fields, so the same
        item yielded again is the same record.

        Raises :class:`~.MissingNaturalKey` naming the item type and the field when a key
        field is missing, None or empty, or has no data form.
        """
        fields = self.key_fields(item)
        if fields is None:
            if not page_url:
                return [self._content_key(item)]
            return [page_key(page_url, self.url_ignore_params)]
        adapter = ItemAdapter(item)
        values = []
        for field in fields:
            value = adapter.get(field)
            if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                text = str(value).strip()
                if not text:
                    raise MissingNaturalKey(item_type_name(item), field)
                values.append(text)
                continue
            if value is None or (isinstance(value, (list, tuple, dict, set, frozenset))
                                 and not value):
                raise MissingNaturalKey(item_type_name(item), field)
            try:
                values.append(encode_value(value, items=True))
            except EncodeError as exc:
                raise MissingNaturalKey(item_type_name(item), field,
                                        f"{exc.type_name} has no data form") from None
        return values

    def _content_key(self, item: Any) -> str:
        try:
            _, hashed = self._encode(item)
        except EncodeError as exc:
            raise MissingNaturalKey(item_type_name(item), CONTENT_KEY,
                                    f"{exc.type_name} has no data form") from None
        text = canonical_json([item_type_name(item), hashed])
        return f"content:sha256:{hashlib.sha256(text.encode('utf-8')).hexdigest()}"

    def _encode(self, item: Any) -> tuple[Any, Any]:
        """The item's data as tagged JSON values (record ID field removed), and the part of
        it that is hashed (volatile fields removed). Raises :class:`~.codec.EncodeError`."""
        # A dict item as it is (its nested items, if any, become dicts in encode_value, as
        # asdict() would make them): asdict() of a small dict took half a record's time.
        data = dict(item) if type(item) is dict else ItemAdapter(item).asdict()
        if self.record_id_field is not None:
            data.pop(self.record_id_field, None)
        encoded = encode_value(data, items=True)
        without_status = _without_media_status(data)
        hashed = encoded if without_status is None else encode_value(without_status, items=True)
        if self.volatile_fields and isinstance(hashed, dict):
            hashed = {k: v for k, v in hashed.items() if k not in self.volatile_fields}
        return encoded, hashed

    def record_id(self, key_values: list[Any], record_type: str) -> str:
        """128-bit hex record ID of a natural key of ``record_type`` within this source."""
        return record_id_of(self.source, record_type, key_values)

    def record(self, item: Any, record_id: str, key_values: list[Any]) -> Record:
        """The stored form of ``item``. Raises :class:`~.codec.EncodeError` for a field
        value that has no tagged-JSON form."""
        encoded, hashed = self._encode(item)
        key = self.record_key(item)
        return Record(
            record_id=record_id,
            source=self.source,
            natural_key=canonical_json(key_values),
            item_type=key.item_type,
            data=ordered_json(encoded),  # the item's field order; the hash is canonical
            content_hash=hashlib.sha256(canonical_json(hashed).encode("utf-8")).hexdigest(),
            key=key,
        )

    # -- from stored data (re-identifying stored records: :mod:`.rekey`) ---------------------

    def stored_natural_key(self, fields: tuple[str, ...], data: dict[str, Any],
                           item_type: str) -> list[Any]:
        """The natural key values of a stored record's ``data`` (its tagged JSON fields) for
        key ``fields``, normalised as :meth:`natural_key` normalises an item's. Raises
        :class:`~.MissingNaturalKey` naming the type and field when one is missing or empty."""
        values: list[Any] = []
        for field in fields:
            value = data.get(field)
            if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                text = str(value).strip()
                if not text:
                    raise MissingNaturalKey(item_type, field)
                values.append(text)
            elif value is None or (isinstance(value, (list, dict)) and not value):
                raise MissingNaturalKey(item_type, field)
            else:
                values.append(value)  # already in its tagged JSON form
        return values

    def stored_content(self, data: dict[str, Any]) -> tuple[str, str]:
        """The content key and the content hash of a stored record's ``data`` (tagged JSON
        fields, record ID field removed), as :meth:`natural_key` and :meth:`record` give
        them for the item."""
        without_status = _without_media_status(data)
        hashed: Any = data if without_status is None else without_status
        if self.volatile_fields:
            hashed = {k: v for k, v in hashed.items() if k not in self.volatile_fields}
        return hashed, hashlib.sha256(canonical_json(hashed).encode("utf-8")).hexdigest()

    def stored_content_key(self, item_type: str, hashed: Any) -> str:
        """``content:sha256:...`` of a stored record of an item of no page (see
        :meth:`natural_key`), from the hashed part of its data (:meth:`stored_content`)."""
        text = canonical_json([item_type, hashed])
        return f"content:sha256:{hashlib.sha256(text.encode('utf-8')).hexdigest()}"


def record_id_of(source: str, record_type: str, key_values: list[Any]) -> str:
    """The record ID of scheme :data:`RECORD_ID_SCHEME`: 32 hex digits of the SHA-256 of
    ``[source, record_type, key_values]`` as canonical JSON."""
    digest = hashlib.sha256(canonical_json([source, record_type, key_values]).encode("utf-8"))
    return digest.hexdigest()[:RECORD_ID_LENGTH]


#: the keys of one entry of the result field of Scrapy's FilesPipeline / ImagesPipeline
_MEDIA_RESULT_KEYS = frozenset({"url", "path", "checksum", "status"})


def _without_media_status(data: dict[str, Any]) -> dict[str, Any] | None:
    """``data`` without the ``status`` of the media pipelines' results (``downloaded``,
    ``uptodate``, ``cached``: how this process got the file, not what the file is), or None
    when it has none. The status stays in the stored item; it is left out of the content
    hash, so a later run finding the file already there is not a change of the record."""
    changed: dict[str, Any] | None = None
    for name, value in data.items():
        if (isinstance(value, list) and value
                and all(isinstance(v, dict) and v.keys() == _MEDIA_RESULT_KEYS for v in value)):
            changed = dict(data) if changed is None else changed
            changed[name] = [{k: v for k, v in entry.items() if k != "status"}
                             for entry in value]
    return changed
