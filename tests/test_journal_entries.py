"""A journaled response comes back as it was received: its headers byte for byte (kept as
latin-1 text), its class, status and URL; entries written in the earlier form (headers in
tagged JSON) are still read."""

from __future__ import annotations

import json

import pytest
from scrapy.http import HtmlResponse, Response, TextResponse

from scrapy_idempotent.codec import dumps
from scrapy_idempotent.journal import decode_response, encode_response, received_at_of

EVERY_BYTE = bytes(range(256))


@pytest.mark.parametrize("cls", [Response, TextResponse, HtmlResponse])
def test_headers_come_back_byte_for_byte(cls: type[Response]) -> None:
    headers = {
        # (a plain Response is stored without its class: the type is guessed from this)
        "Content-Type": "application/octet-stream",
        "Set-Cookie": [b"a=1; Path=/", b"b=\xe9t\xe9"],  # two values, one not ASCII
        "X-Every-Byte": EVERY_BYTE.replace(b"\r", b"").replace(b"\n", b""),
    }
    response = cls("https://example.com/p?q=1", status=203, headers=headers,
                   body=b"\x00\x01 raw \xff", flags=["cached"])
    data, body = encode_response(response, received_at=1234.5)
    json.loads(data)  # valid JSON
    data.encode("utf-8")  # valid UTF-8 text (stored in a text column)
    back = decode_response(data, body)
    assert type(back) is cls
    assert (back.url, back.status, back.body, back.flags) == (
        response.url, 203, response.body, ["cached"])
    assert list(back.headers.items()) == list(response.headers.items())
    assert back.headers.getlist("Set-Cookie") == [b"a=1; Path=/", b"b=\xe9t\xe9"]
    assert received_at_of(data) == 1234.5


def test_an_entry_of_the_earlier_form_is_read() -> None:
    # headers in tagged JSON: {"$dict": [[{"$bytes": ...}, [{"$bytes": ...}]]]}
    earlier = dumps({
        "url": "https://example.com/a", "status": 200, "flags": [], "protocol": None,
        "_class": "scrapy.http.response.html.HtmlResponse",
        "headers": {b"Content-Type": [b"text/html"], b"X-Raw": [b"\xe9"]},
    })
    assert "$bytes" in earlier
    back = decode_response(earlier, b"<html></html>")
    assert type(back) is HtmlResponse
    assert back.headers.getlist("X-Raw") == [b"\xe9"]
    assert back.headers.get("Content-Type") == b"text/html"
    assert received_at_of(earlier) is None
