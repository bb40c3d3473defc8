"""Record identity (``scrapy_idempotent.records``): page keys, natural keys, record IDs, hashes."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import scrapy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scrapy_idempotent.codec import loads
from scrapy_idempotent.config import DEFAULT_URL_IGNORE_PARAMS
from scrapy_idempotent.exceptions import MissingNaturalKey
from scrapy_idempotent.records import (
    CONTENT_KEY,
    RECORD_ID_SCHEME,
    RecordIdentity,
    is_record_id,
    item_type_name,
    page_key,
    page_position,
    url_key,
)

try:
    import attrs
except ImportError:  # pragma: no cover - attrs comes with Twisted, but is optional here
    attrs = None


class ProductItem(scrapy.Item):
    sku = scrapy.Field()
    name = scrapy.Field()
    price = scrapy.Field()
    seen_at = scrapy.Field()
    variant = scrapy.Field()
    record_id = scrapy.Field()


class BookItem(ProductItem):
    isbn = scrapy.Field()


class VariantItem(scrapy.Item):
    color = scrapy.Field()
    stock = scrapy.Field()


@dataclasses.dataclass
class ProductData:
    sku: Any
    name: str = ""


if attrs is not None:

    @attrs.define
    class ProductAttrs:
        sku: Any
        name: str = ""


def identity(natural_keys: dict[str, Any] | None = None, **options: Any) -> RecordIdentity:
    keys = {"*": ("sku",)} if natural_keys is None else natural_keys
    options.setdefault("source", "shop")
    options.setdefault("url_ignore_params", DEFAULT_URL_IGNORE_PARAMS)
    return RecordIdentity(natural_keys=keys, **options)


def expected_id(source: str, key_values: list[str], record_type: str = "dict") -> str:
    """The documented formula: sha256 of the canonical JSON of [source, record type, key
    values], 32 hex."""
    text = json.dumps([source, record_type, key_values], ensure_ascii=False,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def record_id_of(ident: RecordIdentity, item: Any, page_url: str | None = None) -> str:
    return ident.record_id(ident.natural_key(item, page_url), ident.record_key(item).record_type)


# -- page_key -------------------------------------------------------------------------------


def pk(url: str) -> str:
    return page_key(url, DEFAULT_URL_IGNORE_PARAMS)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://shop.example/p/1?utm_source=news&utm_medium=mail&utm_campaign=x&id=7",
         "https://shop.example/p/1?id=7"),
        ("https://shop.example/p/1?gclid=EAIa&id=7", "https://shop.example/p/1?id=7"),
        ("https://shop.example/p/1?id=7&fbclid=IwAR", "https://shop.example/p/1?id=7"),
        ("https://shop.example/p/1;jsessionid=0A1B2C?id=7", "https://shop.example/p/1?id=7"),
        ("https://shop.example/p/1;JSESSIONID=0A1B2C", "https://shop.example/p/1"),
        ("https://shop.example/c;jsessionid=9/p/1", "https://shop.example/c/p/1"),
        ("https://shop.example/p/1?sid=99&id=7", "https://shop.example/p/1?id=7"),
        ("https://shop.example/p/1?PHPSESSID=abc&id=7", "https://shop.example/p/1?id=7"),
        ("https://shop.example/p/1?UTM_Source=x&id=7", "https://shop.example/p/1?id=7"),
        ("https://shop.example/p/1#reviews", "https://shop.example/p/1"),
        ("https://shop.example/p/1?utm_source=x#reviews", "https://shop.example/p/1"),
        ("https://shop.example/list?b=2&a=1", "https://shop.example/list?a=1&b=2"),
        # other parameters are kept: exact names, and prefixes only where the pattern says so
        ("https://shop.example/list?side=left&utm=1&ref_id=5&page=2&sidebar=0",
         "https://shop.example/list?page=2&ref_id=5&side=left&sidebar=0&utm=1"),
        ("https://shop.example/p;v=2", "https://shop.example/p;v=2"),
    ],
)
def test_page_key(url, expected):
    assert pk(url) == expected


def test_page_key_is_query_order_insensitive():
    assert pk("https://shop.example/list?page=2&sort=price&utm_source=x") == pk(
        "https://shop.example/list?utm_source=y&sort=price&page=2")


def test_page_key_without_ignore_params_only_canonicalizes():
    assert page_key("https://shop.example/p?utm_source=x&b=1#f", ()) == (
        "https://shop.example/p?b=1&utm_source=x")


def test_page_key_custom_ignore_params():
    assert page_key("https://shop.example/p?trk=1&trk_id=2&page=3", ["trk"]) == (
        "https://shop.example/p?page=3&trk_id=2")
    assert page_key("https://shop.example/p?trk=1&trk_id=2&page=3", ["trk*"]) == (
        "https://shop.example/p?page=3")


def test_page_key_keeps_repeated_parameters_when_a_tracking_parameter_is_removed():
    # two different pages (a filter on two colours vs one) must not become one key
    plain = pk("https://shop.example/list?color=red&color=blue")
    assert plain == "https://shop.example/list?color=blue&color=red"
    assert pk("https://shop.example/list?color=red&color=blue&utm_source=news") == plain
    assert pk("https://shop.example/list?color=red&utm_source=news") != plain


def test_page_key_removes_tracking_parameters_whose_names_need_quoting():
    assert pk("https://shop.example/p/1?utm_content[0]=banner&id=7") == (
        "https://shop.example/p/1?id=7")


# -- natural keys and record IDs ------------------------------------------------------------


def test_record_id_is_the_documented_hash():
    ident = identity()
    assert ident.natural_key({"sku": "A-1"}, None) == ["A-1"]
    assert ident.record_id(["A-1"], "dict") == expected_id("shop", ["A-1"])
    assert len(ident.record_id(["A-1"], "dict")) == 32


def test_record_id_is_deterministic():
    assert record_id_of(identity(), {"sku": "A-1"}) == record_id_of(identity(), {"sku": "A-1"})


def _item_factories() -> list[Any]:
    factories = [
        pytest.param(lambda sku: {"sku": sku, "name": "Shoe"}, id="dict"),
        pytest.param(lambda sku: ProductItem(sku=sku, name="Shoe"), id="scrapy-item"),
        pytest.param(lambda sku: ProductData(sku=sku, name="Shoe"), id="dataclass"),
    ]
    factories.append(pytest.param(
        (lambda sku: ProductAttrs(sku=sku, name="Shoe")) if attrs is not None else None,
        id="attrs",
        marks=pytest.mark.skipif(attrs is None, reason="attrs is not installed"),
    ))
    return factories


@pytest.mark.parametrize("make_item", _item_factories())
def test_record_id_includes_the_item_type_of_every_item_kind(make_item):
    ident = identity()
    item = make_item("A-1")
    assert ident.natural_key(item, None) == ["A-1"]
    assert record_id_of(ident, item) == expected_id("shop", ["A-1"], item_type_name(item))


def test_two_item_types_with_one_key_value_are_two_records() -> None:
    """A product and its offer keyed by one SKU are two records; a record type named in
    IDEMPOTENT_RECORD_TYPES makes two classes one (a renamed class keeps its records)."""
    ident = identity({"*": ("sku",)})
    product, offer = ProductItem(sku="A-1"), ProductData(sku="A-1")
    assert record_id_of(ident, product) != record_id_of(ident, offer)
    mapped = identity({"*": ("sku",)}, record_types={"ProductData": f"{__name__}.ProductItem"})
    assert record_id_of(mapped, offer) == record_id_of(ident, product)


def test_record_id_is_the_same_in_another_process():
    code = (
        "from scrapy_idempotent.records import RecordIdentity\n"
        "ident = RecordIdentity(source='shop', natural_keys={'*': ('sku', 'region')})\n"
        "print(ident.record_id(ident.natural_key({'sku': 'A-1', 'region': 'eu'}, None),"
        " 'dict'))\n"
    )
    ours = record_id_of(identity({"*": ("sku", "region")}), {"sku": "A-1", "region": "eu"})
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, check=True, timeout=60)
        assert out.stdout.strip() == ours
    assert ours == expected_id("shop", ["A-1", "eu"])


@pytest.mark.parametrize("value", [123, "123", " 123 ", "123\n", "\t123"])
def test_int_and_padded_string_keys_are_equal(value):
    ident = identity()
    assert ident.natural_key({"sku": value}, None) == ["123"]
    assert record_id_of(ident, {"sku": value}) == expected_id("shop", ["123"])


def test_different_sources_give_different_ids():
    item = {"sku": "A-1"}
    ids = {record_id_of(identity(source=source), item) for source in ("shop", "shop-eu", "")}
    assert len(ids) == 3


def test_different_keys_give_different_ids():
    ident = identity()
    assert record_id_of(ident, {"sku": "A-1"}) != record_id_of(ident, {"sku": "A-2"})


def test_key_field_order_matters_for_compound_keys():
    ident = identity({"*": ("sku", "region")})
    assert ident.natural_key({"region": "eu", "sku": "A-1"}, None) == ["A-1", "eu"]


# -- which fields make the key --------------------------------------------------------------


def test_key_fields_by_module_and_class_name():
    ident = identity({f"{__name__}.ProductItem": ("sku",)})
    assert ident.key_fields(ProductItem(sku="A")) == ("sku",)
    assert ident.key_fields({"sku": "A"}) is None


def test_key_fields_by_class_name():
    ident = identity({"ProductData": ("sku", "name")})
    assert ident.key_fields(ProductData(sku="A")) == ("sku", "name")
    assert ident.key_fields(ProductItem(sku="A")) is None


def test_key_fields_by_star_for_any_type():
    ident = identity({"*": ("sku",), "ProductData": ("name",)})
    assert ident.key_fields({"sku": "A"}) == ("sku",)
    assert ident.key_fields(ProductItem(sku="A")) == ("sku",)
    assert ident.key_fields(ProductData(sku="A")) == ("name",)


def test_key_fields_for_dict_items():
    assert identity({"dict": ("sku",)}).key_fields({"sku": "A"}) == ("sku",)


def test_key_fields_via_a_base_class():
    ident = identity({"ProductItem": ("sku",)})
    assert ident.key_fields(BookItem(sku="A", isbn="978")) == ("sku",)


def test_key_fields_of_the_class_itself_win_over_its_base():
    ident = identity({"ProductItem": ("sku",), f"{__name__}.BookItem": ("isbn",)})
    assert ident.key_fields(BookItem(sku="A", isbn="978")) == ("isbn",)
    assert ident.natural_key(BookItem(sku="A", isbn=" 978 "), None) == ["978"]
    assert ident.key_fields(ProductItem(sku="A")) == ("sku",)


def test_key_fields_of_a_base_class_win_over_star():
    ident = identity({"*": ("name",), "ProductItem": ("sku",)})
    assert ident.key_fields(BookItem(sku="A")) == ("sku",)


# -- missing keys ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "item",
    [{"name": "x"}, {"sku": None, "name": "x"}, {"sku": ""}, {"sku": "   "}],
    ids=["missing", "none", "empty", "blank"],
)
def test_missing_key_names_the_item_type_and_the_field(item):
    with pytest.raises(MissingNaturalKey) as caught:
        identity().natural_key(item, "https://shop.example/p/1")
    assert caught.value.item_type == "dict"
    assert caught.value.field == "sku"
    assert str(caught.value) == "dict item has no natural key: field 'sku' is missing or empty"


def test_missing_key_of_a_scrapy_item():
    with pytest.raises(MissingNaturalKey) as caught:
        identity({"ProductItem": ("sku",)}).natural_key(ProductItem(name="x"), None)
    assert str(caught.value) == (
        f"{__name__}.ProductItem item has no natural key: field 'sku' is missing or empty")


def test_missing_second_key_field_is_named():
    with pytest.raises(MissingNaturalKey) as caught:
        identity({"*": ("sku", "region")}).natural_key({"sku": "A", "region": None}, None)
    assert caught.value.field == "region"


@pytest.mark.parametrize("empty", [[], {}, ()], ids=["list", "dict", "tuple"])
def test_empty_container_key_is_missing(empty):
    # every item whose key field holds an empty list would otherwise share one record ID
    with pytest.raises(MissingNaturalKey) as caught:
        identity().natural_key({"sku": empty}, None)
    assert caught.value.field == "sku"


def test_missing_natural_key_is_a_key_error_with_a_readable_message():
    error = MissingNaturalKey("dict", "sku")
    assert isinstance(error, KeyError)
    assert str(error) == "dict item has no natural key: field 'sku' is missing or empty"


# -- the page URL as the key ----------------------------------------------------------------


def test_without_configured_key_the_page_url_is_the_key():
    ident = identity({})
    key = ident.natural_key({"name": "x"}, "https://shop.example/p/1?utm_source=x&id=7#top")
    assert key == ["https://shop.example/p/1?id=7"]
    assert ident.record_id(key, "dict") == expected_id("shop", ["https://shop.example/p/1?id=7"])


def test_page_url_key_same_for_tracking_variants():
    ident = identity({})
    assert record_id_of(ident, {}, "https://shop.example/p?id=1&gclid=z") == record_id_of(
        ident, {}, "https://shop.example/p?id=1")


@pytest.mark.parametrize("url", [None, ""])
def test_item_from_no_page_without_a_configured_key_is_keyed_by_its_content(url):
    ident = identity({}, volatile_fields=["seen_at"])
    key = ident.natural_key({"name": "x", "record_id": "stamped", "seen_at": 1}, url)
    assert len(key) == 1 and key[0].startswith("content:sha256:")
    # the record ID field and volatile fields are not content; the type is
    assert ident.natural_key({"name": "x", "seen_at": 2}, url) == key
    assert ident.natural_key({"name": "y"}, url) != key
    assert ident.natural_key(ProductItem(name="x"), url) != key


def test_item_from_no_page_with_unencodable_content_is_missing_its_key():
    with pytest.raises(MissingNaturalKey) as caught:
        identity({}).natural_key({"name": object()}, None)
    assert caught.value.field == CONTENT_KEY
    assert "no data form" in str(caught.value)


# -- record() -------------------------------------------------------------------------------


def product(**fields: Any) -> ProductItem:
    values = {
        "record_id": "to-be-removed",
        "sku": "A1",
        "name": "Shoe",
        "price": decimal.Decimal("9.90"),
        "seen_at": datetime.datetime(2024, 5, 1, 10, 0),
        "variant": VariantItem(color="red", stock=3),
    }
    values.update(fields)
    return ProductItem(**values)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_record_fields():
    ident = identity(volatile_fields=["seen_at"])
    item = product()
    key = ident.natural_key(item, None)
    record = ident.record(item, ident.record_id(key, ident.record_key(item).record_type), key)
    assert record.record_id == expected_id("shop", ["A1"], f"{__name__}.ProductItem")
    assert record.source == "shop"
    assert record.natural_key == '["A1"]'
    assert record.item_type == f"{__name__}.ProductItem"
    assert record.data == (  # the item's field order (feeds keep it)
        '{"sku":"A1","name":"Shoe","price":{"$decimal":"9.90"},'
        '"seen_at":{"$datetime":"2024-05-01T10:00:00"},"variant":{"color":"red","stock":3}}'
    )
    assert record.content_hash == sha256(
        '{"name":"Shoe","price":{"$decimal":"9.90"},"sku":"A1",'
        '"variant":{"color":"red","stock":3}}'
    )


def test_record_data_decodes_to_the_item_values():
    ident = identity()
    record = ident.record(product(), "id", ["A1"])
    assert loads(record.data) == {
        "name": "Shoe",
        "price": decimal.Decimal("9.90"),
        "seen_at": datetime.datetime(2024, 5, 1, 10, 0),
        "sku": "A1",
        "variant": {"color": "red", "stock": 3},
    }


def test_record_id_field_is_not_in_the_data():
    ident = identity()
    with_id = ident.record(product(record_id="abc"), "id", ["A1"])
    without_id = ident.record({k: v for k, v in dict(product()).items() if k != "record_id"},
                              "id", ["A1"])
    assert "record_id" not in loads(with_id.data)
    assert with_id.data == without_id.data
    assert with_id.content_hash == without_id.content_hash


def test_record_id_field_none_keeps_the_item_unchanged():
    record = identity(record_id_field=None).record({"sku": "A1", "record_id": "x"}, "id", ["A1"])
    assert loads(record.data) == {"sku": "A1", "record_id": "x"}


def test_volatile_fields_do_not_change_the_hash():
    ident = identity(volatile_fields=["seen_at"])
    first = ident.record(product(seen_at=datetime.datetime(2024, 5, 1)), "id", ["A1"])
    later = ident.record(product(seen_at=datetime.datetime(2024, 6, 1)), "id", ["A1"])
    assert first.content_hash == later.content_hash
    assert first.data != later.data
    assert loads(later.data)["seen_at"] == datetime.datetime(2024, 6, 1)


def test_non_volatile_changes_change_the_hash():
    ident = identity(volatile_fields=["seen_at"])
    base = ident.record(product(), "id", ["A1"]).content_hash
    assert ident.record(product(price=decimal.Decimal("9.91")), "id", ["A1"]).content_hash != base
    assert ident.record(product(price=decimal.Decimal("9.9")), "id", ["A1"]).content_hash != base
    assert ident.record(product(variant={"color": "blue", "stock": 3}), "id",
                        ["A1"]).content_hash != base


def test_without_volatile_fields_every_field_is_hashed():
    ident = identity()
    first = ident.record(product(seen_at=datetime.datetime(2024, 5, 1)), "id", ["A1"])
    later = ident.record(product(seen_at=datetime.datetime(2024, 6, 1)), "id", ["A1"])
    assert first.content_hash != later.content_hash


def test_hash_ignores_field_order():
    ident = identity()
    a = ident.record({"sku": "A1", "name": "Shoe"}, "id", ["A1"])
    b = ident.record({"name": "Shoe", "sku": "A1"}, "id", ["A1"])
    assert a.content_hash == b.content_hash
    assert (a.data, b.data) == ('{"sku":"A1","name":"Shoe"}', '{"name":"Shoe","sku":"A1"}')


def test_nested_items_are_stored_as_dicts():
    ident = identity()
    record = ident.record({"sku": "A1", "variants": [VariantItem(color="red"),
                                                     ProductData(sku="B2")]}, "id", ["A1"])
    assert loads(record.data) == {"sku": "A1", "variants": [{"color": "red"},
                                                            {"sku": "B2", "name": ""}]}


def test_item_type_name():
    assert item_type_name({}) == "dict"
    assert item_type_name(ProductItem()) == f"{__name__}.ProductItem"
    assert item_type_name(ProductData(sku=1)) == f"{__name__}.ProductData"


def test_a_boolean_or_list_key_is_not_the_string_that_looks_like_it() -> None:
    """``True`` and ``"true"`` are two keys (and ``[1, "a"]`` and its JSON text), while
    text and number keys keep the record IDs of their scheme (hex values of record ID scheme
    2: the IDs of stored records do not change within a scheme)."""
    identity = RecordIdentity(source="shop", natural_keys={"dict": ("k",)})

    def rid(value: object) -> str:
        return identity.record_id(identity.natural_key({"k": value}, None), "dict")

    assert rid("SKU-1") == "dc880f2feac42cb27207baaaca6560c2"
    assert rid(123) == rid("123") == rid(" 123 ") == "8a1a8539c7012b92bfbf28370c50ac5c"
    assert rid(1.5) == "89dc136b7d1f5ae917e70fe04c86dd50"
    assert rid("true") == "c9cb28073ce15632e046ef658a974c2e"
    assert rid(True) != rid("true")
    assert rid(False) != rid("false")
    assert rid([1, "a"]) != rid('[1,"a"]')
    assert rid({"a": 1}) != rid('{"a":1}')



def test_the_record_id_scheme_pins_every_derivation() -> None:
    """Record IDs, content hashes, content keys, file URL keys and page ranks of scheme 2:
    a change to any of them changes what stored databases hold, so it comes with a new
    RECORD_ID_SCHEME (databases of the old one are then re-identified or refused, never
    silently doubled)."""
    assert RECORD_ID_SCHEME == "2"
    identity = RecordIdentity(source="shop", natural_keys={"dict": ("sku",)})
    item = {"sku": "A1", "name": "x"}
    key = identity.natural_key(item, None)
    record = identity.record(item, identity.record_id(key, "dict"), key)
    assert (record.record_id, record.natural_key) == ("3b61f3fe5cad9b426e0a51d0c399799a",
                                                      '["A1"]')
    assert record.content_hash == (
        "9460bf7a3eeeb2647c4b03035670ac050d2c8ca97f7d05e042f66b0dbf2a92af")
    assert is_record_id(record.record_id) and not is_record_id(record.content_hash)
    unkeyed = RecordIdentity(source="shop", natural_keys={})
    assert unkeyed.natural_key({"name": "x"}, None) == [
        "content:sha256:14264daac3c0b955bbc0123efb69314de3b4c8105cd115b6773378d9135349de"]
    assert url_key("https://shop.example/p?utm_source=a&id=1", ("utm_*",)) == "11ec3d880248d6db"
    seen: Counter[str] = Counter()
    assert [page_position(seen, "k", "dict"), page_position(seen, "k", "dict"),
            page_position(seen, "k", "Other")] == [None, ["dict", "#2"], ["Other", "#1"]]


# -- property: record IDs are stable across processes and item types -------------------------

#: What a natural key field can hold: ints (any size), and text that is not blank (no lone
#: surrogates: those are the subject of their own test above).
_key_values = st.one_of(
    st.integers(),
    st.text(min_size=1, max_size=30).filter(lambda s: s.strip() != ""),
)
_keys = st.tuples(_key_values, _key_values)

#: Computes record IDs in a fresh interpreter (another hash seed) for a JSON list of
#: ``[source, sku, region]``.
RECORD_IDS_ELSEWHERE = r"""
import json, sys
from scrapy_idempotent.records import RecordIdentity
ids = []
for source, sku, region in json.load(sys.stdin):
    ident = RecordIdentity(source=source, natural_keys={"*": ("sku", "region")})
    ids.append(ident.record_id(ident.natural_key({"sku": sku, "region": region}, None),
                               "product"))
print(json.dumps(ids))
"""


class KeyedItem(scrapy.Item):
    sku = scrapy.Field()
    region = scrapy.Field()
    record_id = scrapy.Field()


@dataclasses.dataclass
class KeyedData:
    region: Any
    sku: Any
    extra: str = "ignored by the key"


def test_record_ids_are_the_same_in_another_process_and_for_every_item_type() -> None:
    """Hypothesis draws batches of compound keys (ints of any size, any non-blank text) and
    sources; every item type gives one ID per key in this process; then ONE other process
    (another ``PYTHONHASHSEED``) computes the IDs of everything drawn, and they agree."""
    from scrapy_idempotent.records import RecordIdentity

    kinds: list[Callable[[Any, Any], Any]] = [
        lambda a, b: {"sku": a, "region": b},
        lambda a, b: KeyedItem(sku=a, region=b),
        lambda a, b: KeyedData(sku=a, region=b),
        lambda a, b: {"region": f" {b}\t" if isinstance(b, str) else b, "sku": a,
                      "noise": object()},
    ]
    drawn: list[tuple[str, Any, Any]] = []
    ids: list[str] = []

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(batch=st.lists(_keys, min_size=1, max_size=20),
           source=st.text(min_size=1, max_size=8).filter(lambda s: s.strip() != ""))
    def same_id_for_every_item_type(batch: list[tuple[Any, Any]], source: str) -> None:
        ident = RecordIdentity(source=source, natural_keys={"*": ("sku", "region")},
                               record_types={"dict": "product", "KeyedItem": "product",
                                             "KeyedData": "product"})
        by_key: dict[tuple[str, str], str] = {}
        for a, b in batch:
            found = {ident.record_id(ident.natural_key(make(a, b), None),
                                     ident.record_key(make(a, b)).record_type)
                     for make in kinds}
            assert len(found) == 1, (a, b)
            record_id = found.pop()
            # the same normalised key (1, "1", " 1 ") always has the same ID
            assert by_key.setdefault((str(a).strip(), str(b).strip()), record_id) == record_id
            drawn.append((source, a, b))
            ids.append(record_id)
        assert len(set(by_key.values())) == len(by_key)  # different keys, different IDs

    same_id_for_every_item_type()
    assert len(drawn) >= 60
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", RECORD_IDS_ELSEWHERE], input=json.dumps(drawn),
                         capture_output=True, text=True, env=env, check=True, timeout=60)
    assert json.loads(out.stdout) == ids


class _NestedItem(scrapy.Item):
    a = scrapy.Field()
    b = scrapy.Field()


@dataclasses.dataclass
class _NestedData:
    x: int
    y: list[Any]


def test_a_dict_item_is_stored_as_its_adapter_would_give_it() -> None:
    """A dict item is encoded as it is, without ``ItemAdapter.asdict()``: nested items of
    any type still become their fields, and the record (data and hash) is the same."""
    from itemadapter import ItemAdapter

    from scrapy_idempotent.codec import canonical_json, encode_value, ordered_json

    item = {
        "sku": "1", "nested": _NestedItem(a=1, b=[_NestedData(1, [_NestedItem(a=2)])]),
        "pair": (1, 2), "members": {3}, "by_name": {"k": _NestedData(2, [])},
        "when": datetime.date(2020, 1, 1), "amount": decimal.Decimal("1.5"), "raw": b"x",
        "files": [{"url": "u", "path": "p", "checksum": "c", "status": "downloaded"}],
        "record_id": "left out",
    }
    identity = RecordIdentity(source="s", natural_keys={"dict": ("sku",)})
    record = identity.record(item, "rid", ["1"])
    expected = ItemAdapter(item).asdict()
    del expected["record_id"]
    encoded = encode_value(expected, items=True)
    assert record.data == ordered_json(encoded)
    del encoded["files"][0]["status"]  # (a media pipeline's status is not part of the hash)
    assert record.content_hash == hashlib.sha256(
        canonical_json(encoded).encode("utf-8")).hexdigest()
    assert loads(record.data)["nested"] == {"a": 1, "b": [{"x": 1, "y": [{"a": 2}]}]}


def test_an_item_keyed_otherwise_than_its_stored_record_type_is_refused() -> None:
    """The database recorded ``sku`` for the record type; an item of that type keyed by
    ``sku`` and ``color`` now (a class the crawl's open could not check) raises
    NaturalKeyChanged, a MissingNaturalKey: it is rejected, never stored twice."""
    from scrapy_idempotent.exceptions import MissingNaturalKey, NaturalKeyChanged
    from scrapy_idempotent.store.base import RecordKey

    ident = identity({"dict": ("sku", "color")})
    ident.expect_keys([RecordKey("dict", "dict", ("sku",))])
    with pytest.raises(NaturalKeyChanged) as changed:
        ident.natural_key({"sku": "A", "color": "red"}, None)
    assert isinstance(changed.value, MissingNaturalKey)
    assert str(changed.value) == (
        "the records of dict are keyed by sku, the settings now key it by sku + color: run "
        "`scrapy idempotent rekey` to move the records to the new key (or restore the old key)")
    same = identity({"dict": ("sku",)})
    same.expect_keys([RecordKey("dict", "dict", ("sku",))])
    assert same.natural_key({"sku": "A"}, None) == ["A"]


def test_a_stored_record_type_the_settings_key_otherwise_is_named_at_open(
        tmp_path: Any) -> None:
    """check_keys: one line per stored record type keyed otherwise, or mapped to another
    record type by IDEMPOTENT_RECORD_TYPES; none when the settings agree."""
    from scrapy_idempotent.rekey import check_keys
    from scrapy_idempotent.store import SQLiteStore, UnitOfWork

    store = SQLiteStore(str(tmp_path / "db.sqlite3"))
    store.open(fingerprinter="x", record_id_scheme="2")
    store.begin_session("w1", "auto")
    stored = identity({"dict": ("sku",)})
    product = ProductItem(sku="P")
    records = []
    for item in ({"sku": "A"}, product):
        key = stored.natural_key(item, None)
        records.append((stored.record(item, record_id_of(stored, item), key), None))
    store.commit(UnitOfWork(records=records), "w1")
    assert check_keys(store, stored) == []
    assert check_keys(store, identity({"dict": ("sku", "color")})) == [
        "the records of dict are keyed by sku, the settings now key it by sku + color: run "
        "`scrapy idempotent rekey` to move the records to the new key (or restore the old key)"]
    renamed = identity(record_types={"ProductItem": "product"})
    [line] = check_keys(store, renamed)
    assert line.startswith(f"the records of {__name__}.ProductItem are identified as record "
                           f"type {__name__}.ProductItem, the settings now make it product")
    store.close()
