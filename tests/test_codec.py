"""Tagged JSON values and stored requests (``scrapy_idempotent.codec``)."""

from __future__ import annotations

import datetime
import decimal
import functools
import json
import math
import types
from typing import Any

import pytest
import scrapy
from hypothesis import given, settings
from hypothesis import strategies as st
from scrapy.http import JsonRequest
from scrapy.http.request.form import FormRequest  # not scrapy.http: deprecated there in 2.16

from scrapy_idempotent import codec as codec_module
from scrapy_idempotent.codec import EncodeError, RequestCodec, dumps, loads
from scrapy_idempotent.exceptions import UnstorableRequest

UTC = datetime.timezone.utc
IST = datetime.timezone(datetime.timedelta(hours=5, minutes=30))


def assert_same(got: Any, want: Any) -> None:
    """Equal, and of the same types all the way down (``==`` alone says ``(1,) != [1]`` but
    ``{1} == frozenset({1})``, ``1 == 1.0 == True``, ``Decimal('1.0') == Decimal('1')``)."""
    assert type(got) is type(want), (got, want)
    if isinstance(want, dict):
        assert {(type(k), k) for k in got} == {(type(k), k) for k in want}, (got, want)
        for key, value in want.items():
            assert_same(got[key], value)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), (got, want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    elif isinstance(want, (set, frozenset)):
        assert {(type(m), m) for m in got} == {(type(m), m) for m in want}, (got, want)
    elif isinstance(want, decimal.Decimal):
        assert str(got) == str(want)
    elif isinstance(want, float):
        assert got == want and math.copysign(1, got) == math.copysign(1, want), (got, want)
    elif isinstance(want, datetime.datetime):
        assert got == want and got.utcoffset() == want.utcoffset(), (got, want)
    else:
        assert got == want


def roundtrip(value: Any) -> Any:
    text = dumps(value)
    assert isinstance(json.loads(text), (dict, list, str, int, float, bool, type(None)))
    return loads(text)


# -- tagged JSON ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        None, True, False, 0, -7, 2**80, 1.5, -0.0, float("inf"), "", "text", "ünïcødé ✓",
        [], [1, "a", None], {}, {"a": 1, "b": [1, 2]},
        {"outer": {"inner": [{"deep": (1, 2)}]}},
        b"", b"\x00\xff raw", bytearray(b"ba"),
        (), (1, "a", (2.5, None)),
        set(), {1, 2, 3}, {"b", "a"}, frozenset({(1, 2), "x"}),
        datetime.datetime(2024, 5, 1, 12, 30, 15, 123456),
        datetime.datetime(2024, 5, 1, 12, 30, tzinfo=UTC),
        datetime.datetime(2024, 5, 1, 12, 30, tzinfo=IST),
        datetime.date(2024, 2, 29),
        decimal.Decimal("19.90"), decimal.Decimal("-0.000001"), decimal.Decimal("1E+3"),
        {1: "int key", (1, 2): "tuple key", b"k": "bytes key", None: "none key"},
        {"$bytes": "not really bytes", "$": 1, "plain": 2},
        {"$tuple": [1, 2]},
        {datetime.date(2024, 1, 1): decimal.Decimal("1.0")},
        [{"$set": []}, {frozenset({1}): {"$date": "x"}}],
    ],
    # sorted where the repr follows the hash seed (sets): the same ids in every process
    ids=lambda value: (f"{type(value).__name__}({sorted(map(repr, value))})"
                       if isinstance(value, (set, frozenset)) else repr(value)),
)
def test_tagged_json_round_trip(value):
    decoded = roundtrip(value)
    if isinstance(value, bytearray):  # stored as bytes
        assert decoded == bytes(value)
        assert type(decoded) is bytes
    else:
        assert_same(decoded, value)


def test_tagged_json_tags():
    value = {"b": b"\x01", "t": (1,), "s": {2, 1}, "d": datetime.date(2024, 1, 2),
             "n": decimal.Decimal("1.50"), "$k": 1}
    assert json.loads(dumps(value)) == {
        "$dict": [
            ["b", {"$bytes": "AQ=="}],
            ["t", {"$tuple": [1]}],
            ["s", {"$set": [1, 2]}],
            ["d", {"$date": "2024-01-02"}],
            ["n", {"$decimal": "1.50"}],
            ["$k", 1],
        ]
    }


def test_datetime_keeps_its_timezone():
    naive = roundtrip(datetime.datetime(2024, 5, 1, 12, 0))
    aware = roundtrip(datetime.datetime(2024, 5, 1, 12, 0, tzinfo=IST))
    assert naive.tzinfo is None
    assert aware.utcoffset() == datetime.timedelta(hours=5, minutes=30)
    assert type(roundtrip(datetime.date(2024, 5, 1))) is datetime.date


def test_decoded_values_are_copies():
    shared = {"rows": [1, 2]}
    decoded = roundtrip({"a": shared, "b": shared})
    assert decoded == {"a": {"rows": [1, 2]}, "b": {"rows": [1, 2]}}
    assert decoded["a"] is not shared
    assert decoded["a"] is not decoded["b"]


def _generator():
    yield 1


def test_encode_error_path_in_dict_and_list():
    with pytest.raises(EncodeError) as caught:
        dumps({"a": [1, _generator()]})
    assert caught.value.path == "['a'][1]"
    assert caught.value.type_name == "generator"
    assert str(caught.value) == "['a'][1]: generator cannot be stored as data"


def test_encode_error_path_of_an_open_file(tmp_path):
    with open(tmp_path / "f.txt", "w") as fh, pytest.raises(EncodeError) as caught:
        dumps([{"b": fh}])
    assert caught.value.path == "[0]['b']"
    assert str(caught.value) == "[0]['b']: TextIOWrapper cannot be stored as data"


def test_encode_error_path_of_an_object_nested_in_dicts():
    with pytest.raises(EncodeError) as caught:
        dumps({"page": {"cursor": object()}})
    assert str(caught.value) == "['page']['cursor']: object cannot be stored as data"


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ((1, object()), "[1]"),
        ({"t": (object(),)}, "['t'][0]"),
        ({object(): 1}, "<key>"),
        ({frozenset(): object()}, "[frozenset()]"),
        ({"s": {1, object()}}, "['s']<member>"),
    ],
)
def test_encode_error_path_in_other_containers(value, path):
    with pytest.raises(EncodeError) as caught:
        dumps(value)
    assert caught.value.path == path


def test_encode_error_at_the_root():
    with pytest.raises(EncodeError) as caught:
        dumps(_generator())
    assert caught.value.path == ""
    assert str(caught.value) == "value: generator cannot be stored as data"


def test_encode_error_is_a_value_error():
    with pytest.raises(ValueError):
        dumps(object())


# -- property: loads(dumps(x)) == x ---------------------------------------------------------

_timezones = st.builds(
    datetime.timezone,
    st.integers(min_value=-23 * 60 - 59, max_value=23 * 60 + 59).map(
        lambda minutes: datetime.timedelta(minutes=minutes)),
)
_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
    | st.binary(max_size=20) | st.decimals(allow_nan=False)
    | st.dates() | st.datetimes() | st.datetimes(timezones=_timezones)
)
_keys_text = st.text(max_size=6) | st.text(max_size=6).map(lambda s: "$" + s) | st.sampled_from(
    ["$bytes", "$tuple", "$set", "$frozenset", "$datetime", "$date", "$decimal", "$dict"])
_hashables = st.recursive(
    _scalars | _keys_text,
    lambda inner: st.lists(inner, max_size=3).map(tuple) | st.frozensets(inner, max_size=3),
    max_leaves=6,
)
_values = st.recursive(
    _scalars | _keys_text,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(_keys_text, inner, max_size=4)
        | st.dictionaries(_hashables, inner, max_size=3)
        | st.sets(_hashables, max_size=4)
        | st.frozensets(_hashables, max_size=4)
    ),
    max_leaves=15,
)


@settings(max_examples=150, deadline=None, database=None)
@given(_values)
def test_round_trip_property(value):
    text = dumps(value)
    decoded = loads(text)
    assert_same(decoded, value)
    assert dumps(decoded) == text  # stable: encoding a decoded value gives the same text


# -- RequestCodec ---------------------------------------------------------------------------


class ShopSpider(scrapy.Spider):
    name = "shop"

    def parse(self, response):
        pass

    def parse_product(self, response, **kwargs):
        pass

    def on_error(self, failure):
        pass


class RenamedShopSpider(scrapy.Spider):
    """The same spider after ``parse_product`` was renamed."""

    name = "shop"

    def parse(self, response):
        pass

    def parse_item(self, response, **kwargs):
        pass


class Helper:
    def parse(self, response):
        pass


class TrackedRequest(scrapy.Request):
    pass


TRACKED_PATH = f"{TrackedRequest.__module__}.TrackedRequest"


@pytest.fixture
def spider() -> ShopSpider:
    return ShopSpider()


@pytest.fixture
def codec(spider: ShopSpider) -> RequestCodec:
    return RequestCodec(spider)


def request_roundtrip(codec: RequestCodec, request: scrapy.Request) -> scrapy.Request:
    text = codec.encode(request)
    json.loads(text)  # plain JSON text
    return codec.decode(text)


def assert_bound_to(method: Any, spider: scrapy.Spider, function: Any) -> None:
    assert method.__self__ is spider
    assert method.__func__ is function


def test_get_request_round_trip(codec, spider):
    request = scrapy.Request("https://shop.example/list?page=2", callback=spider.parse)
    decoded = request_roundtrip(codec, request)
    assert type(decoded) is scrapy.Request
    assert decoded.url == "https://shop.example/list?page=2"
    assert decoded.method == "GET"
    assert decoded.body == b""
    assert_bound_to(decoded.callback, spider, ShopSpider.parse)
    assert decoded.errback is None
    assert decoded.priority == 0
    assert decoded.dont_filter is False


def test_request_without_callback_round_trip(codec):
    decoded = request_roundtrip(codec, scrapy.Request("https://shop.example/"))
    assert decoded.callback is None
    assert decoded.errback is None


def test_post_request_with_body_round_trip(codec, spider):
    request = scrapy.Request("https://shop.example/search", method="POST",
                             body=b"q=shoes&raw=\xff\x00", callback=spider.parse)
    decoded = request_roundtrip(codec, request)
    assert decoded.method == "POST"
    assert decoded.body == b"q=shoes&raw=\xff\x00"


def test_form_request_round_trip(codec, spider):
    request = FormRequest("https://shop.example/search", formdata={"q": "shoes", "page": "2"},
                          callback=spider.parse)
    decoded = request_roundtrip(codec, request)
    assert type(decoded) is FormRequest
    assert decoded.method == "POST"
    assert decoded.body == b"q=shoes&page=2"
    assert decoded.headers.getlist("Content-Type") == [b"application/x-www-form-urlencoded"]


def test_json_request_round_trip(codec, spider):
    request = JsonRequest("https://shop.example/api", data={"sku": "A1", "qty": 2},
                          callback=spider.parse)
    decoded = request_roundtrip(codec, request)
    assert type(decoded) is JsonRequest
    assert decoded.method == "POST"
    assert json.loads(decoded.body) == {"sku": "A1", "qty": 2}
    assert decoded.body == request.body
    assert decoded.headers.getlist("Content-Type") == [b"application/json"]


def test_request_attributes_round_trip(codec, spider):
    when = datetime.datetime(2024, 5, 1, 9, 0, tzinfo=UTC)
    cb_kwargs = {
        "when": when,
        "day": datetime.date(2024, 5, 1),
        "price": decimal.Decimal("19.90"),
        "raw": b"\x00\xff",
        "tags": {"new", "sale"},
        "pair": ("A1", 2),
        "rows": [{"n": 1}, {"n": 2}],
    }
    meta = {"page": 3, "seen": ["a", "b"], "depth": 1, "ts": when}
    request = scrapy.Request(
        "https://shop.example/p/1",
        callback=spider.parse_product,
        errback=spider.on_error,
        headers={"X-Token": "abc", "Accept-Language": ["en", "fr"]},
        cookies={"session": "s1"},
        meta=meta,
        cb_kwargs=cb_kwargs,
        priority=7,
        dont_filter=True,
        flags=["seed"],
    )
    decoded = request_roundtrip(codec, request)
    assert_bound_to(decoded.callback, spider, ShopSpider.parse_product)
    assert_bound_to(decoded.errback, spider, ShopSpider.on_error)
    assert decoded.headers.getlist("X-Token") == [b"abc"]
    assert decoded.headers.getlist("Accept-Language") == [b"en", b"fr"]
    assert dict(decoded.headers) == dict(request.headers)
    assert decoded.cookies == {"session": "s1"}
    assert_same(decoded.meta, meta)
    assert_same(decoded.cb_kwargs, cb_kwargs)
    assert decoded.priority == 7
    assert decoded.dont_filter is True
    assert decoded.flags == ["seed"]


def test_cb_kwargs_come_back_as_equal_copies(codec, spider):
    rows = [{"n": 1}]
    cb_kwargs = {"rows": rows, "same": rows, "price": decimal.Decimal("1.10")}
    request = scrapy.Request("https://shop.example/", callback=spider.parse_product,
                             cb_kwargs=cb_kwargs)
    decoded = request_roundtrip(codec, request)
    assert decoded.cb_kwargs == cb_kwargs
    assert decoded.cb_kwargs is not cb_kwargs
    assert decoded.cb_kwargs["rows"] is not rows
    assert decoded.cb_kwargs["rows"][0] is not rows[0]
    # value semantics: objects shared between values are no longer shared
    assert decoded.cb_kwargs["same"] is not decoded.cb_kwargs["rows"]


def test_decoding_twice_gives_independent_requests(codec, spider):
    text = codec.encode(scrapy.Request("https://shop.example/", callback=spider.parse_product,
                                       cb_kwargs={"rows": [1]}))
    first, second = codec.decode(text), codec.decode(text)
    first.cb_kwargs["rows"].append(2)
    assert second.cb_kwargs == {"rows": [1]}


# -- refused at encode ----------------------------------------------------------------------


def refused(codec: RequestCodec, request: scrapy.Request) -> UnstorableRequest:
    with pytest.raises(UnstorableRequest) as caught:
        codec.encode(request)
    assert caught.value.request == repr(request)
    assert str(caught.value).startswith(f"cannot store {request!r}: {caught.value.path}: ")
    return caught.value


def test_lambda_callback_is_refused(codec):
    error = refused(codec, scrapy.Request("https://shop.example/p/1", callback=lambda r: None))
    assert error.path == "callback"
    assert "is not a method of the spider" in error.reason
    assert "cb_kwargs" in error.reason  # the message suggests the fix


def test_partial_callback_is_refused(codec, spider):
    callback = functools.partial(spider.parse_product, sku="A1")
    error = refused(codec, scrapy.Request("https://shop.example/p/1", callback=callback))
    assert error.path == "callback"
    assert "is not a method of the spider" in error.reason


@pytest.mark.parametrize("owner", [Helper(), ShopSpider()], ids=["helper", "other-spider"])
def test_method_of_another_object_is_refused(codec, owner):
    error = refused(codec, scrapy.Request("https://shop.example/", callback=owner.parse))
    assert error.path == "callback"


def test_function_bound_to_the_spider_at_runtime_is_refused(codec, spider):
    # a fresh spider after a restart would not have it
    spider.parse_later = types.MethodType(lambda self, response: None, spider)
    request = scrapy.Request("https://shop.example/", callback=spider.parse_later)
    assert refused(codec, request).path == "callback"


def test_plain_function_callback_is_refused(codec):
    def parse(response):
        pass

    assert refused(codec, scrapy.Request("https://shop.example/", callback=parse)).path == (
        "callback")


def test_lambda_errback_is_refused(codec, spider):
    request = scrapy.Request("https://shop.example/", callback=spider.parse,
                             errback=lambda f: None)
    assert refused(codec, request).path == "errback"


def test_generator_in_cb_kwargs_is_refused_naming_the_key(codec, spider):
    request = scrapy.Request("https://shop.example/", callback=spider.parse_product,
                             cb_kwargs={"sku": "A1", "rows": _generator()})
    error = refused(codec, request)
    assert error.path == "cb_kwargs['rows']"
    assert error.reason == "generator cannot be stored as data"


def test_nested_value_in_meta_is_refused_with_its_path(codec, spider):
    request = scrapy.Request("https://shop.example/", callback=spider.parse,
                             meta={"page": {"cursor": object()}})
    assert refused(codec, request).path == "meta['page']['cursor']"


def test_open_file_in_meta_is_refused(codec, spider, tmp_path):
    with open(tmp_path / "out.csv", "w") as fh:
        request = scrapy.Request("https://shop.example/", callback=spider.parse,
                                 meta={"fh": fh})
        error = refused(codec, request)
    assert error.path == "meta['fh']"
    assert error.reason == "TextIOWrapper cannot be stored as data"


def test_request_subclass_not_allow_listed_is_refused(codec, spider):
    error = refused(codec, TrackedRequest("https://shop.example/", callback=spider.parse))
    assert error.path == "_class"
    assert TRACKED_PATH in error.reason
    assert "IDEMPOTENT_REQUEST_CLASSES" in error.reason


def test_request_subclass_allowed_by_extra_classes(spider):
    codec = RequestCodec(spider, extra_classes=[TRACKED_PATH])
    decoded = request_roundtrip(
        codec, TrackedRequest("https://shop.example/", callback=spider.parse, priority=2))
    assert type(decoded) is TrackedRequest
    assert decoded.priority == 2
    assert_bound_to(decoded.callback, spider, ShopSpider.parse)


class InheritingSpider(ShopSpider):
    name = "inheriting"


class DictRequest(scrapy.Request):
    """A request class with a ``to_dict`` of its own."""

    def to_dict(self, *, spider=None):
        data = super().to_dict(spider=spider)
        data["meta"] = {**data["meta"], "own_to_dict": True}
        return data


DICT_REQUEST_PATH = f"{DictRequest.__module__}.DictRequest"


@pytest.mark.parametrize("make", [
    lambda s: scrapy.Request("https://shop.example/"),
    lambda s: scrapy.Request("https://shop.example/p", callback=s.parse_product,
                             errback=s.on_error, meta={"a": 1}, cb_kwargs={"b": 2},
                             headers={"X": ["1", "2"]}, cookies={"c": "d"}, priority=3,
                             dont_filter=True, flags=["f"]),
    lambda s: FormRequest("https://shop.example/s", formdata={"q": "x"}, callback=s.parse),
    lambda s: JsonRequest("https://shop.example/api", data={"k": 1}, errback=s.on_error),
    lambda s: TrackedRequest("https://shop.example/", callback=s.parse),
], ids=["bare", "everything", "form", "json", "subclass"])
@pytest.mark.parametrize("spider_cls", [ShopSpider, InheritingSpider])
def test_stored_dict_is_scrapys_to_dict(make, spider_cls):
    # the codec names the (checked) callbacks itself instead of searching the spider's
    # members for every request: what it stores is still what Request.to_dict gives (less
    # the defaults of a plain Request, headers of ASCII as text), and it decodes to a
    # request whose to_dict is Scrapy's
    spider = spider_cls()
    request = make(spider)
    codec = RequestCodec(spider, extra_classes=[TRACKED_PATH])
    full = request.to_dict(spider=spider)
    stored = json.loads(codec.encode(request))
    assert stored == json.loads(dumps(codec_module._compact(dict(full))))
    assert codec.decode(codec.encode(request)).to_dict(spider=spider) == full
    assert codec.decode(dumps(full)).to_dict(spider=spider) == full  # the full form too


@pytest.mark.parametrize("make, stored", [
    (lambda s: scrapy.Request("https://shop.example/"),
     {"url": "https://shop.example/", "callback": None}),
    (lambda s: scrapy.Request("https://shop.example/p", callback=s.parse, meta={"depth": 2},
                              headers={"Referer": "https://shop.example/"}),
     {"url": "https://shop.example/p", "callback": "parse", "meta": {"depth": 2},
      "headers": {"Referer": ["https://shop.example/"]}}),
    # bytes that are not ASCII stay tagged bytes; a value that is not the default stays
    (lambda s: scrapy.Request("https://shop.example/", headers={"X": b"\xe9"}, priority=0,
                              method="POST", body=b"a", encoding="latin-1"),
     {"url": "https://shop.example/", "callback": None, "method": "POST",
      "headers": {"$dict": [[{"$bytes": "WA=="}, [{"$bytes": "6Q=="}]]]},
      "body": {"$bytes": "YQ=="}, "encoding": "latin-1"}),
], ids=["bare", "link", "not-default"])
def test_plain_request_is_stored_without_its_defaults(spider, make, stored):
    codec = RequestCodec(spider)
    request = make(spider)
    assert json.loads(codec.encode(request)) == stored
    assert codec.decode(codec.encode(request)).to_dict(spider=spider) == \
        request.to_dict(spider=spider)


def test_request_class_with_its_own_to_dict_keeps_it(spider):
    codec = RequestCodec(spider, extra_classes=[DICT_REQUEST_PATH])
    decoded = request_roundtrip(codec, DictRequest("https://shop.example/", callback=spider.parse))
    assert type(decoded) is DictRequest
    assert decoded.meta == {"own_to_dict": True}


# -- refused at decode ----------------------------------------------------------------------


def test_decode_of_a_callback_that_no_longer_exists(spider):
    text = RequestCodec(spider).encode(
        scrapy.Request("https://shop.example/", callback=spider.parse_product))
    renamed = RequestCodec(RenamedShopSpider())
    with pytest.raises(ValueError) as caught:
        renamed.decode(text)
    assert str(caught.value) == (
        "stored callback 'parse_product' is not a method of spider 'shop' "
        "(was it renamed or removed?)"
    )


def test_decode_of_an_errback_that_no_longer_exists(spider):
    text = RequestCodec(spider).encode(
        scrapy.Request("https://shop.example/", callback=spider.parse, errback=spider.on_error))
    with pytest.raises(ValueError, match="stored errback 'on_error' is not a method of spider"):
        RequestCodec(RenamedShopSpider()).decode(text)


@pytest.mark.parametrize("name", ["__init__", "__class__", "__reduce_ex__"])
@pytest.mark.parametrize("attr", ["callback", "errback"])
def test_decode_refuses_dunder_names(codec, attr, name):
    text = json.dumps({"url": "https://shop.example/", attr: name})
    with pytest.raises(ValueError) as caught:
        codec.decode(text)
    assert str(caught.value) == f"stored {attr} {name!r} is not a spider method name"


@pytest.mark.parametrize("name", ["parse.__func__", "crawler.engine", "os.system", 3])
def test_decode_refuses_names_that_are_not_identifiers(codec, name):
    text = json.dumps({"url": "https://shop.example/", "callback": name})
    with pytest.raises(ValueError) as caught:
        codec.decode(text)
    assert str(caught.value) == f"stored callback {name!r} is not a spider method name"


def test_decode_refuses_a_non_callable_attribute(codec):
    text = json.dumps({"url": "https://shop.example/", "callback": "name"})
    with pytest.raises(ValueError, match="stored callback 'name' is not a method of spider"):
        codec.decode(text)


@pytest.mark.parametrize(
    "cls_path",
    ["scrapy_idempotent_no_such_module.Request", "scrapy.Spider", TRACKED_PATH],
)
def test_decode_refuses_a_class_not_allow_listed(codec, cls_path):
    text = json.dumps({"url": "https://shop.example/", "_class": cls_path})
    with pytest.raises(ValueError) as caught:
        codec.decode(text)
    assert str(caught.value) == f"stored request class {cls_path!r} is not allowed"


def test_decode_of_hand_written_builtin_class(codec, spider):
    text = json.dumps({"url": "https://shop.example/", "callback": "parse",
                       "_class": "scrapy.http.request.form.FormRequest"})
    decoded = codec.decode(text)
    assert type(decoded) is FormRequest
    assert_bound_to(decoded.callback, spider, ShopSpider.parse)
