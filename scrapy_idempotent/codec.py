"""Values and requests as JSON text: the only form in which anything enters the database.

Tagged JSON keeps what plain JSON would lose, so a stored value comes back equal to what was
given (value semantics: a stored object comes back as a copy, never the same object):

=================  =======================================
Python value       stored as
=================  =======================================
``None``, bool,    itself
int, float, str
list               list
dict (str keys)    object (keys starting with ``$`` escaped)
other dict         ``{"$dict": [[key, value], ...]}``
bytes              ``{"$bytes": "<base64>"}``
tuple              ``{"$tuple": [...]}``
set, frozenset     ``{"$set": [...]}`` / ``{"$frozenset": [...]}`` (sorted)
datetime.datetime  ``{"$datetime": "<ISO 8601>"}`` (timezone kept)
datetime.date      ``{"$date": "YYYY-MM-DD"}``
decimal.Decimal    ``{"$decimal": "<str>"}``
an item            ``{"$item": [module, class, {field: value}]}``
=================  =======================================

An item is an object of a class :mod:`itemadapter` knows (``scrapy.Item``, a dataclass, an
attrs class, a pydantic model) defined at the top level of a module (or nested in such a
class): its class and its fields' values are stored, and it comes back as an equal object of
that class, built from its fields (:func:`_build_item`). The class is looked up among the
modules already imported, never imported because the database names it; a class whose
objects cannot be built from their fields (one of its own ``__init__``), found on the first
object of that class, is refused as any other value is. With ``items=True`` (records) an
item is stored as the dict of its fields instead.

Anything else (generators, open files, sockets, arbitrary objects) is refused with the path of
the value, e.g. ``meta['page'].cursor``. Nothing is ever pickled: reading the database must
not execute code (Scrapy's disk queues pickle).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import decimal
import inspect
import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

from itemadapter import ItemAdapter
from scrapy import Request, Spider
from scrapy.utils.misc import load_object
from scrapy.utils.request import request_from_dict
from scrapy.utils.url import strip_url

from .exceptions import UnstorableRequest

__all__ = [
    "BUILTIN_REQUEST_CLASSES",
    "EncodeError",
    "RequestCodec",
    "canonical_json",
    "decode_value",
    "describe",
    "dumps",
    "encode_value",
    "loads",
    "ordered_json",
]

#: Names of scrapy.Spider's own methods and attributes: never callbacks, whatever a stored
#: request says (``parse`` and its dispatcher ``_parse`` are allowed).
_FRAMEWORK_NAMES: frozenset[str] = frozenset(
    name for klass in Spider.__mro__ for name in vars(klass)) - {"parse", "_parse"}

#: Request classes that may be stored without configuration (``_class`` of ``to_dict``).
BUILTIN_REQUEST_CLASSES: frozenset[str] = frozenset(
    {
        "scrapy.http.request.Request",
        "scrapy.http.request.form.FormRequest",
        "scrapy.http.request.json_request.JsonRequest",
        "scrapy.http.request.rpc.XmlRpcRequest",
    }
)


class EncodeError(ValueError):
    """A value has no tagged-JSON form. ``path`` locates it from the root (``['a'][0]``)."""

    def __init__(self, path: str, value: object) -> None:
        self.path = path
        self.type_name = type(value).__qualname__
        super().__init__(f"{path or 'value'}: {self.type_name} cannot be stored as data")


def _json_items(value: dict[Any, Any], path: str, items: bool) -> Any:
    if all(isinstance(k, str) and not k.startswith("$") for k in value):
        return {k: _encode(v, f"{path}[{k!r}]", items) for k, v in value.items()}
    return {
        "$dict": [
            [_encode(k, f"{path}<key>", items), _encode(v, f"{path}[{k!r}]", items)]
            for k, v in value.items()
        ]
    }


class _NeedsSlowPath(Exception):
    """The fast encoder met a value it does not handle itself."""


#: the types :func:`_encode_fast` passes on as they are
_SCALARS = frozenset({str, int, bool, float, type(None)})


def _encode_fast(value: Any) -> Any:
    # The common shapes of request and item data, exact built-in types only, without the
    # path strings that only an error message needs (the hot path: every enqueue, every item).
    # A scalar member is taken as it is without a call (most members are scalars).
    cls = type(value)
    if cls in _SCALARS:
        return value
    if cls is dict:
        for key in value:
            if type(key) is not str or key[:1] == "$":
                return {"$dict": [[_encode_fast(k), _encode_fast(v)] for k, v in value.items()]}
        return {k: v if type(v) in _SCALARS else _encode_fast(v) for k, v in value.items()}
    if cls is list:
        return [v if type(v) in _SCALARS else _encode_fast(v) for v in value]
    if cls is bytes:
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if cls is tuple:
        return {"$tuple": [_encode_fast(v) for v in value]}
    raise _NeedsSlowPath


def encode_value(value: Any, path: str = "", *, items: bool = False) -> Any:
    """Return the tagged-JSON form of ``value`` (plain dicts, lists and scalars).

    With ``items=True`` nested items of any type :mod:`itemadapter` supports are stored as
    dicts of their fields. Raises :class:`EncodeError` naming the first value that has no form.
    """
    try:
        return _encode_fast(value)
    except _NeedsSlowPath:
        return _encode(value, path, items)


def _encode(value: Any, path: str, items: bool) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, dict):
        return _json_items(value, path, items)
    if isinstance(value, list):
        return [_encode(v, f"{path}[{i}]", items) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, f"{path}[{i}]", items) for i, v in enumerate(value)]}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, (set, frozenset)):
        tag = "$set" if isinstance(value, set) else "$frozenset"
        members = [_encode(v, f"{path}<member>", items) for v in value]
        return {tag: sorted(members, key=canonical_json)}
    if isinstance(value, datetime.datetime):
        return {"$datetime": value.isoformat()}
    if isinstance(value, datetime.date):
        return {"$date": value.isoformat()}
    if isinstance(value, decimal.Decimal):
        return {"$decimal": str(value)}
    if ItemAdapter.is_item(value):
        if items:
            return _json_items(ItemAdapter(value).asdict(), path, items)
        return _tagged_item(value, path)
    raise EncodeError(path, value)


#: item class -> None when its objects are built again from their fields, else why not
#: (found on the first object of that class stored)
_ITEM_CLASSES: dict[type, str | None] = {}


def _tagged_item(value: Any, path: str) -> Any:
    """``{"$item": [module, qualname, fields]}`` of an item (see the module docstring)."""
    cls = type(value)
    if _item_class(cls.__module__, cls.__qualname__) is not cls:
        raise EncodeError(path, value)  # defined in a function, or not where it says
    fields = _json_items(dict(ItemAdapter(value).items()), path, False)
    if cls not in _ITEM_CLASSES:
        try:
            _build_item(cls, decode_value(fields))
        except Exception as exc:
            _ITEM_CLASSES[cls] = f"{type(exc).__name__}: {exc}"
        else:
            _ITEM_CLASSES[cls] = None
    if _ITEM_CLASSES[cls] is not None:
        raise EncodeError(path, value)
    return {"$item": [cls.__module__, cls.__qualname__, fields]}


def _item_class(module_name: str, qualname: str) -> Any:
    """The class ``qualname`` of the module ``module_name`` if that module is imported, else
    None (nothing is imported: the names come from the database)."""
    found: Any = sys.modules.get(module_name)
    for name in qualname.split("."):
        if found is None or name == "<locals>":
            return None
        found = getattr(found, name, None)
    return found if isinstance(found, type) else None


def _build_item(cls: type, fields: dict[str, Any]) -> Any:
    """An object of the item class ``cls`` with ``fields``: its constructor given the fields
    it takes (a dataclass's or attrs class's fields with ``init=False`` set afterwards, an
    attrs field ``_x`` given as ``x``)."""
    later: dict[str, Any] = {}
    if dataclasses.is_dataclass(cls):
        init = {f.name for f in dataclasses.fields(cls) if f.init}
        later = {k: v for k, v in fields.items() if k not in init}
        kwargs = {k: v for k, v in fields.items() if k in init}
    elif hasattr(cls, "__attrs_attrs__"):
        kwargs = {}
        for attribute in cls.__attrs_attrs__:
            if attribute.name not in fields:
                continue
            if attribute.init:
                alias = getattr(attribute, "alias", None) or attribute.name.lstrip("_")
                kwargs[alias] = fields[attribute.name]
            else:
                later[attribute.name] = fields[attribute.name]
    else:
        kwargs = fields
    item = cls(**kwargs)
    for name, value in later.items():
        object.__setattr__(item, name, value)
    return item


def _decode_item(value: list[Any]) -> Any:
    module_name, qualname, fields = value
    cls = _item_class(module_name, qualname)
    if cls is None or not ItemAdapter.is_item_class(cls):
        raise ValueError(f"stored item class {module_name}.{qualname} is not an item class "
                         "of the modules loaded (was it renamed or removed?)")
    return _build_item(cls, decode_value(fields))


_DECODERS: dict[str, Callable[[Any], Any]] = {
    "$bytes": lambda v: base64.b64decode(v),
    "$tuple": lambda v: tuple(decode_value(x) for x in v),
    "$set": lambda v: {decode_value(x) for x in v},
    "$frozenset": lambda v: frozenset(decode_value(x) for x in v),
    "$datetime": datetime.datetime.fromisoformat,
    "$date": datetime.date.fromisoformat,
    "$decimal": decimal.Decimal,
    "$dict": lambda v: {decode_value(k): decode_value(x) for k, x in v},
    "$item": _decode_item,
}


def decode_value(value: Any) -> Any:
    """Inverse of :func:`encode_value`."""
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            (key, inner), = value.items()
            decoder = _DECODERS.get(key)
            if decoder is not None:
                return decoder(inner)
        return {k: decode_value(v) for k, v in value.items()}
    return value


#: Tags whose plain JSON form is a list of their elements, and tags whose plain form is
#: their text (base64 of bytes, ISO 8601 of dates and times, a Decimal's digits).
_PLAIN_LISTS = frozenset({"$tuple", "$set", "$frozenset"})
_PLAIN_TEXT = frozenset({"$bytes", "$datetime", "$date", "$decimal"})


def plain_value(value: Any, leaf: Callable[[Any], Any] = lambda v: v) -> Any:
    """Tagged JSON (as stored) to plain JSON values, for exports: a tuple, set or frozenset
    becomes a list, bytes their base64 text, a datetime, date or Decimal its text, a dict
    whose keys are not all text an object keyed by each key's JSON text. ``leaf`` maps every
    other value and every key of an object (the exporter's rules for text and numbers)."""
    if isinstance(value, list):
        return [plain_value(v, leaf) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            ((tag, inner),) = value.items()
            if tag in _PLAIN_LISTS:
                return [plain_value(v, leaf) for v in inner]
            if tag in _PLAIN_TEXT:
                return leaf(inner)
            if tag == "$item":
                return plain_value(inner[2], leaf)
            if tag == "$dict":
                return {k if isinstance(k := plain_value(key, leaf), str)
                        else json.dumps(k, sort_keys=True): plain_value(v, leaf)
                        for key, v in inner}
        return {leaf(k): plain_value(v, leaf) for k, v in value.items()}
    return leaf(value)


#: ``json.dumps(..., ensure_ascii=False, separators=(",", ":"))`` with and without sorted
#: keys, made once (``json.dumps`` makes an encoder for each call given options)
_ENCODERS = {sort_keys: json.JSONEncoder(ensure_ascii=False, separators=(",", ":"),
                                         sort_keys=sort_keys) for sort_keys in (False, True)}


def _text(encoded: Any, *, sort_keys: bool) -> str:
    text = _ENCODERS[sort_keys].encode(encoded)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (say, from a JSON API): escape, keep it
        text = json.dumps(encoded, sort_keys=sort_keys, ensure_ascii=True,
                          separators=(",", ":"))
    return text


def dumps(value: Any, *, items: bool = False) -> str:
    """Tagged JSON text of ``value``, always valid UTF-8 (a lone surrogate is kept as a JSON
    escape). Raises :class:`EncodeError`."""
    return _text(encode_value(value, items=items), sort_keys=False)


def loads(text: str) -> Any:
    """Inverse of :func:`dumps`."""
    return decode_value(json.loads(text))


def ordered_json(encoded: Any) -> str:
    """Text of an already encoded value with its keys in their order (an item's fields as
    the item has them). Always valid UTF-8, like :func:`dumps`."""
    return _text(encoded, sort_keys=False)


def canonical_json(encoded: Any) -> str:
    """Deterministic text of an already encoded value (sorted keys): input of content hashes.
    Always valid UTF-8, like :func:`dumps`."""
    return _text(encoded, sort_keys=True)


class RequestCodec:
    """Turns requests into JSON text and back, for one spider.

    Built on :meth:`scrapy.Request.to_dict` (its dict, the callback names taken from the checked
    methods) and :func:`scrapy.utils.request.request_from_dict`.
    Stored callbacks and errbacks are method *names* of the spider; on loading they must name
    a callable attribute of the spider that is not a dunder (no attribute chains, no imports);
    the request class must be allow-listed (the built-in request classes plus
    ``IDEMPOTENT_REQUEST_CLASSES``). ``request_from_dict`` alone would import any ``_class``.
    """

    def __init__(self, spider: Spider, extra_classes: Iterable[str] = ()) -> None:
        self.spider = spider
        self.allowed_classes = BUILTIN_REQUEST_CLASSES | frozenset(extra_classes)

    def encode(self, request: Request) -> str:
        """JSON text of ``request``.

        Raises :class:`~.UnstorableRequest` naming the request and the offending value: a
        callback or errback that is not a method of the spider (lambda, partial, function,
        method of another object), a request class outside the allow-list, or a value in
        ``meta``, ``cb_kwargs``, cookies or headers with no tagged-JSON form.
        """
        for attr in ("callback", "errback"):
            func = getattr(request, attr)
            if func is not None and not _is_spider_method(self.spider, func):
                raise UnstorableRequest(
                    describe(request), attr,
                    f"{func!r} is not a method of the spider; use a spider method and pass "
                    "data through cb_kwargs",
                )
        try:
            data = _request_dict(request, self.spider)
        except ValueError as exc:  # callback not found on the spider
            raise UnstorableRequest(describe(request), "callback", str(exc)) from None
        cls_path = data.get("_class")
        if cls_path is not None and cls_path not in self.allowed_classes:
            raise UnstorableRequest(
                describe(request), "_class",
                f"request class {cls_path} is not allowed; add it to IDEMPOTENT_REQUEST_CLASSES",
            )
        try:
            return dumps(_compact(data))
        except EncodeError as exc:
            raise UnstorableRequest(describe(request), _pretty_path(exc.path),
                                    f"{exc.type_name} cannot be stored as data") from None

    def decode(self, text: str) -> Request:
        """The request stored as ``text``. Raises ``ValueError`` with a clear reason when the
        stored class is not allowed or a callback/errback no longer exists on the spider."""
        data = loads(text)
        cls_path = data.get("_class")
        if cls_path is not None and cls_path not in self.allowed_classes:
            raise ValueError(f"stored request class {cls_path!r} is not allowed")
        for attr in ("callback", "errback"):
            name = data.get(attr)
            if name is None:
                continue
            if not isinstance(name, str) or not name.isidentifier() or name.startswith("__"):
                raise ValueError(f"stored {attr} {name!r} is not a spider method name")
            if name in _FRAMEWORK_NAMES:
                raise ValueError(f"stored {attr} {name!r} is a method of scrapy.Spider itself, "
                                 "not a callback")
            if not inspect.ismethod(getattr(self.spider, name, None)):
                raise ValueError(
                    f"stored {attr} {name!r} is not a method of spider {self.spider.name!r} "
                    "(was it renamed or removed?)"
                )
        if cls_path is not None:
            load_object(cls_path)  # only allow-listed paths reach this point
        return request_from_dict(data, spider=self.spider)


_REQUEST_TO_DICT = Request.to_dict


def _request_dict(request: Request, spider: Spider) -> dict[str, Any]:
    """``request.to_dict(spider=spider)`` for a request whose callback and errback are known
    to be methods of ``spider`` under their own names (:func:`_is_spider_method`): the same
    dict, without ``to_dict``'s search of the spider's members for each (``inspect.getmembers``
    on every request stored). A request class with a ``to_dict`` of its own keeps it."""
    if type(request).to_dict is not _REQUEST_TO_DICT:
        return request.to_dict(spider=spider)
    data: dict[str, Any] = {
        "url": request.url,
        "callback": None if request.callback is None else request.callback.__name__,
        "errback": None if request.errback is None else request.errback.__name__,
        "headers": dict(request.headers),
    }
    for attr in request.attributes:
        data.setdefault(attr, getattr(request, attr))
    if type(request) is not Request:
        data["_class"] = f"{type(request).__module__}.{type(request).__name__}"
    return data


#: What a plain ``scrapy.Request`` built without the argument holds, per attribute of
#: ``to_dict``: a stored request leaves these out (``request_from_dict`` passes only the keys
#: it finds, so the constructor's defaults come back). A third to half of a plain link's
#: stored text were these defaults.
_REQUEST_DEFAULTS: dict[str, Any] = {
    "errback": None, "body": b"", "cookies": {}, "meta": {}, "encoding": "utf-8",
    "flags": [], "cb_kwargs": {}, "dont_filter": False, "method": "GET", "priority": 0,
    "headers": {}}


def _compact(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a request's ``to_dict``) in the form stored: for a plain ``scrapy.Request``
    (no ``_class``: a subclass may have other defaults) without the attributes equal to the
    constructor's defaults; headers whose names and values are all ASCII as text (the
    ``Headers`` of the request built from them encodes them back to the same bytes) instead
    of base64-tagged bytes. Decoding needs nothing of its own: older, full forms decode as
    before."""
    headers = data.get("headers")
    if headers:  # (not all ASCII bytes: tagged bytes, as given)
        with contextlib.suppress(AttributeError, TypeError, UnicodeDecodeError):
            data["headers"] = {name.decode("ascii"): [value.decode("ascii")
                                                      for value in values]
                               for name, values in headers.items()}
    if "_class" in data:
        return data
    return {key: value for key, value in data.items()
            if key not in _REQUEST_DEFAULTS or not _is_default(value, _REQUEST_DEFAULTS[key])}


def _is_default(value: Any, default: Any) -> bool:
    # the type too: 0 == False == 0.0, and b"" == "" is False but {} == {} whatever the kind
    return type(value) is type(default) and value == default


def describe(request: Request) -> str:
    """``<METHOD url>`` for messages, without user:password in the URL (logs are often
    shared; the stored request keeps its credentials, in a file readable by its owner only)."""
    return f"<{request.method} {strip_url(request.url, strip_credentials=True)}>"


def _is_spider_method(spider: Spider, func: Any) -> bool:
    name = getattr(func, "__name__", None)
    return (
        getattr(func, "__self__", None) is spider
        and isinstance(name, str)
        and not name.startswith("__")
        and name not in _FRAMEWORK_NAMES
        and getattr(type(spider), name, None) is getattr(func, "__func__", None)
    )


def _pretty_path(path: str) -> str:
    """``['meta']['page']`` -> ``meta['page']`` for messages."""
    if path.startswith("['") and "']" in path:
        head, _, rest = path[2:].partition("']")
        return head + rest
    return path or "value"
