"""The local test site itself (``local_site.LocalSite``), through real HTTP requests: what the
other tests rely on when they count requests, hold answers or read the shop."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest
from local_site import LocalSite, Received

from crawling import wait_for


def fetch(url: str, data: bytes | None = None, method: str | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, dict(answer.headers.items()), answer.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, dict(error.headers.items()), error.read()


def test_the_shop_pages_and_what_a_crawl_should_store(shop: LocalSite) -> None:
    status, _, listing = fetch(f"{shop.url}/list/25")
    assert status == 200
    assert listing.count(b'class="product"') == 20
    assert b'class="listing next"' not in listing  # the last listing page
    expected = shop.expected_products()
    assert len(expected) == shop.product_count == 500 and shop.page_count == 525
    status, _, page = fetch(f"{shop.url}/product/SKU-00042")
    assert status == 200 and expected["SKU-00042"]["price"].encode() in page
    shop.set_price_version(1)
    _, _, repriced = fetch(f"{shop.url}/product/SKU-00042")
    assert shop.expected_products()["SKU-00042"]["price"].encode() in repriced
    assert expected["SKU-00042"]["price"] != shop.expected_products()["SKU-00042"]["price"]
    shop.set_products_failing([42])
    assert fetch(f"{shop.url}/product/SKU-00042")[0] == 503
    shop.set_catalogue(listing_pages=26, products_per_page=20)
    assert fetch(f"{shop.url}/product/SKU-00520")[0] == 200
    assert fetch(f"{shop.url}/product/SKU-00521")[0] == 404
    assert shop.hits("/product/SKU-00042") == 3 and shop.request_count == 6


def test_counters_by_path_query_and_method(site: LocalSite) -> None:
    fetch(f"{site.url}/ok/a?x=1")
    fetch(f"{site.url}/ok/a?x=2", data=b"form=1")
    fetch(f"{site.url}/__stats__")  # control pages are not counted
    assert (site.hits("/ok/a"), site.hits("/ok/a?x=1"), site.hits("/ok/a", "POST")) == (2, 1, 1)
    assert site.counts_by_path() == {"/ok/a": 2}
    assert [path for path, _ in site.arrivals()] == ["/ok/a", "/ok/a"]
    stats = json.loads(fetch(f"{site.url}/__stats__")[2])
    assert stats["by_full_path"] == {"/ok/a?x=1": 1, "/ok/a?x=2": 1}
    site.reset_counts()
    assert site.request_count == 0 and site.headers_seen == []


@pytest.mark.parametrize("keep_alive", [True, False])
def test_connection_per_request_or_keep_alive(keep_alive: bool) -> None:
    with LocalSite(keep_alive=keep_alive) as local:
        status, headers, _ = fetch(f"{local.url}/ok/a")
        assert status == 200
        assert (headers.get("Connection") == "close") is not keep_alive
        assert local.errors == []


def test_a_held_route_is_answered_once_released(site: LocalSite) -> None:
    site.add("/slow", "slow page", held=True)
    answers: list[int] = []
    thread = threading.Thread(target=lambda: answers.append(fetch(f"{site.url}/slow")[0]))
    thread.start()
    wait_for(lambda: site.in_flight == 1, 30, "the request to arrive")
    assert answers == [] and thread.is_alive()  # arrived, held
    site.release()
    thread.join(30)
    assert answers == [200]
    # the server counts the request out after its last byte is written, which the client
    # may read first
    wait_for(lambda: site.in_flight == 0, 30, "the request counted out")


def test_routes_added_by_a_test_and_a_responder(site: LocalSite) -> None:
    site.add("/page", "<html>page</html>", status=410, headers={"X-Test": "yes"})
    status, headers, body = fetch(f"{site.url}/page?any=query")
    assert (status, headers["X-Test"], body) == (410, "yes", b"<html>page</html>")
    received: list[Received] = []

    def hook(request: Received) -> tuple[int, dict[str, str], str]:
        received.append(request)
        return (200, {"Retry-After": "1"}, '{"ok": true}') if len(received) > 1 else (
            503, {}, "{}")

    site.add_responder("/hook", hook)
    post: dict[str, Any] = {"data": b'{"id": 7}', "headers": {"Idempotency-Key": "k1"}}
    assert fetch(f"{site.url}/hook", **post)[0] == 503
    status, headers, body = fetch(f"{site.url}/hook", **post)
    assert (status, headers["Retry-After"], headers["Content-Type"]) == (
        200, "1", "application/json")
    assert [(r.method, r.json(), r.headers["Idempotency-Key"]) for r in received] == [
        ("POST", {"id": 7}, "k1")] * 2
    assert fetch(f"{site.url}/nothing/here")[0] == 404


def test_sites_on_host_names_of_their_own_record_in_flight_and_intervals() -> None:
    """Each site binds its own loopback address (its own host name for Scrapy's download
    slots) and records the most requests in flight at once and the gaps between starts."""
    with LocalSite(host="127.0.0.2") as slow, LocalSite(host="127.0.0.3") as quick:
        assert slow.url.startswith("http://127.0.0.2:")
        slow.add("/held", "held", held=True)
        threads = [threading.Thread(target=fetch, args=(f"{slow.url}/held",))
                   for _ in range(3)]
        for thread in threads:
            thread.start()
        wait_for(lambda: slow.in_flight == 3, 30, "three requests held")
        slow.release()
        for thread in threads:
            thread.join()
        # the server counts an answer as done after its last byte is written, so a client can
        # have read it a moment before: wait for the count, do not read it at once
        wait_for(lambda: slow.in_flight == 0, 30, "the three answers counted")
        assert slow.most_in_flight == 3
        assert len(slow.intervals()) == 2 and all(gap >= 0 for gap in slow.intervals())
        fetch(f"{quick.url}/ok/a")
        wait_for(lambda: quick.in_flight == 0, 30, "the first answer counted")
        fetch(f"{quick.url}/ok/b")
        assert quick.most_in_flight == 1 and quick.request_count == 2
        (gap,) = quick.intervals()
        assert gap > 0
        slow.reset_counts()
        assert slow.most_in_flight == 0 and slow.intervals() == []
