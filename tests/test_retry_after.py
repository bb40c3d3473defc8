"""The one reading of ``Retry-After``, for the download slots' pauses and the outbox."""

from __future__ import annotations

import email.utils

import pytest

from scrapy_idempotent._retry_after import retry_after_seconds


def test_retry_after_in_seconds_or_as_an_http_date() -> None:
    assert retry_after_seconds(b"5") == 5.0
    assert retry_after_seconds(" 120 ") == 120.0
    assert retry_after_seconds("-3") == 0.0
    date = email.utils.formatdate(1_000_030.0, usegmt=True)
    assert retry_after_seconds(date.encode(), now=1_000_000.0) == pytest.approx(30.0)
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert retry_after_seconds(date, now=2_000_000.0) == 0.0  # a date in the past
    assert retry_after_seconds("99999999") == 99999999.0  # each user sets its own bound


@pytest.mark.parametrize("value", [None, b"", "  ", b"soon", "nan", "inf"])
def test_what_is_not_understood_asks_for_nothing(value: bytes | str | None) -> None:
    assert retry_after_seconds(value) is None
