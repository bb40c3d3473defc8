"""The codec owns its tags: ``plain_value`` turns every tagged form into plain JSON (what the
export command writes), so no other module knows the tags."""

from __future__ import annotations

import datetime
import decimal
import json

from scrapy_idempotent.codec import dumps, plain_value


def test_every_tag_has_a_plain_form() -> None:
    value = {
        "tuple": (1, "a"), "set": {2, 1}, "frozen": frozenset({"x"}), "bytes": b"\x00\xff",
        "when": datetime.datetime(2026, 5, 4, 10, 0, tzinfo=datetime.timezone.utc),
        "day": datetime.date(2026, 5, 4), "price": decimal.Decimal("19.990"),
        "by_int": {1: "one", (2, 3): "pair"}, "$dollar": "kept",
        "nested": [{"deep": (True, None)}],
    }
    assert plain_value(json.loads(dumps(value))) == {
        "tuple": [1, "a"], "set": [1, 2], "frozen": ["x"], "bytes": "AP8=",
        "when": "2026-05-04T10:00:00+00:00", "day": "2026-05-04", "price": "19.990",
        "by_int": {"1": "one", "[2, 3]": "pair"}, "$dollar": "kept",
        "nested": [{"deep": [True, None]}],
    }


def test_leaf_maps_values_and_keys() -> None:
    tagged = json.loads(dumps({"a": [1.5, "x"], "b": (2,)}))
    assert plain_value(tagged, lambda v: v * 2 if isinstance(v, (str, float)) else v) == {
        "aa": [3.0, "xx"], "bb": [2]}
