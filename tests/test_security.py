"""No code from the database: nothing in the package can unpickle or eval, a stored request
or response naming code is refused as data, SQL in URLs, meta, items and the source is stored
as data, and the package logs no credentials. Real crawls against a local site."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import scrapy
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import (
    PagesSpider,
    all_messages,
    crawl_settings,
    frontier_counts,
    package_messages,
    pages,
    run_crawl,
)
from helpers.stored import change_stored, frontier_entries, reading, stored_key, stored_records
from scrapy_idempotent.codec import loads

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "scrapy_idempotent"
EXAMPLE_PROJECT = ROOT / "example_project"




KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"dict": "sku"}}


def test_no_module_of_the_package_can_unpickle() -> None:
    """Reading the database must never execute code: no pickle, marshal, shelve (or their
    look-alikes), no eval/exec, anywhere in the package."""
    import ast

    banned_modules = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill",
                      "cloudpickle", "jsonpickle", "copyreg"}
    banned_calls = {"eval", "exec", "__import__"}
    found: list[str] = []
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) >= 10
    for module in modules:
        tree = ast.parse(module.read_text(), filename=str(module))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in banned_calls):
                found.append(f"{module.name}:{node.lineno}: {node.func.id}()")
            for name in names:
                if name.split(".")[0] in banned_modules:
                    found.append(f"{module.name}:{getattr(node, 'lineno', 0)}: import {name}")
    assert found == []
    for module in modules:  # nor through importlib with a literal name
        text = module.read_text()
        assert not re.search(r"""import_module\(\s*["'](pickle|marshal|shelve)""", text)


def _stored_request(database: str, url: str, **changes: Any) -> dict[str, Any]:
    """The data of a real stored request (the first crawl's ``/page/1``), re-aimed at ``url``
    and changed by ``changes``."""
    [data] = [e.data for e in frontier_entries(database) if e.url.endswith("/page/1")]
    value = json.loads(data)
    value["url"] = url
    value.update(changes)
    return value


def _insert_pending(database: str, key: str, url: str, data: dict[str, Any],
                    attempts: int = 0) -> None:
    """A pending request of the last run written into the database as it is (tampered)."""
    change_stored(
        database,
        "INSERT INTO requests (key, fingerprint, url, priority, state, data, attempts,"
        " enqueued_at, run_id) VALUES (?, ?, ?, 0, 'pending', ?, ?, 0,"
        " (SELECT max(run_id) FROM runs))",
        (stored_key(database, key), stored_key(database, hashlib.sha1(key.encode()).hexdigest()),
         url, json.dumps(data), attempts))


STORED_CODE = {
    "class-os-system": {"_class": "os.system"},
    "class-popen": {"_class": "subprocess.Popen"},
    "class-marker": {"_class": "never_imported.EvilRequest"},
    "callback-init": {"callback": "__init__"},
    "callback-class": {"callback": "__class__"},
    "callback-crawler-engine": {"callback": "crawler.engine"},
    "callback-globals": {"callback": "parse.__globals__"},
    "callback-module-function": {"callback": "never_imported.touch"},
    "errback-engine-close": {"errback": "crawler.engine.close_spider"},
    "errback-dunder": {"errback": "__reduce_ex__"},
}

#: Callable attributes every spider has that are Scrapy's API, not callbacks: a stored request
#: naming one is data from the database choosing which spider code to run.
STORED_FRAMEWORK_METHODS = {
    "callback-from-crawler": {"callback": "from_crawler"},
    "callback-set-crawler": {"callback": "_set_crawler"},
    "callback-close": {"callback": "close"},
    "callback-update-settings": {"callback": "update_settings"},
    "errback-start": {"errback": "start"},
}


async def _crawl_with_stored_rows(site: LocalSite, database: str, rows: dict[str, Any],
                                  caplog: Any) -> tuple[Any, dict[str, list[Any]]]:
    settings = crawl_settings(database, **KEYS)
    site.add("/good", "<html>good</html>")
    first = await run_crawl(PagesSpider, settings, url=site.url, paths=pages(site, 1),
                            make_output=lambda r: [{"sku": r.url}])
    assert first.stats.get_value("finish_reason") == "finished"
    for name, changes in rows.items():
        path = f"/stored/{name}"
        site.add(path, "<html>should never be fetched</html>")
        _insert_pending(database, name, site.url + path,
                        _stored_request(database, site.url + path, **changes))
    _insert_pending(database, "good", site.url + "/good", _stored_request(database,
                                                                           site.url + "/good"))
    site.reset_counts()
    sys.modules.pop("never_imported", None)
    crawler = await run_crawl(PagesSpider, {**settings, "IDEMPOTENT_RUN_MODE": "resume"},
                              url=site.url, paths=[], make_output=lambda r: [{"sku": r.url}])
    # what the first crawl committed is still there, and the good row added its record
    assert {"/good", "/page/1"} <= {urlsplit(loads(r.data)["sku"]).path
                                    for r in stored_records(database)}
    outcome = {e.key: [e.state, e.error_kind, e.error_message]
               for e in frontier_entries(database)}
    return crawler, outcome


@deferred_f_from_coro_f
async def test_stored_request_naming_code_is_failed_as_unloadable_and_nothing_runs(
    site: LocalSite, crawl_database: str, caplog: Any
) -> None:
    crawler, outcome = await _crawl_with_stored_rows(site, crawl_database, STORED_CODE, caplog)
    assert "never_imported" not in sys.modules  # nothing was imported
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert outcome["good"][0] == "done"  # the crawl went on
    assert site.hits("/good") == 1
    assert [path for path in site.counts_by_path() if path.startswith("/stored/")] == []
    for name, changes in STORED_CODE.items():
        state, kind, message = outcome[name]
        assert (state, kind) == ("failed", "unloadable"), (name, outcome[name])
        (value,) = changes.values()
        assert value in message, (name, message)
    assert crawler.stats.get_value("idempotent/requests/unloadable") == len(STORED_CODE)
    logged = package_messages(caplog, logging.ERROR)
    for name in STORED_CODE:
        assert any(f"cannot load stored request {name}" in m for m in logged), name


@deferred_f_from_coro_f
async def test_stored_request_naming_a_spider_framework_method_is_unloadable(
    site: LocalSite, crawl_database: str, caplog: Any
) -> None:
    """``from_crawler``, ``_set_crawler``, ``close``, ``update_settings``, ``start`` are
    callable attributes of every spider, and no spider method encoded by the package could
    have stored them as a callback: loading must refuse them instead of calling them with a
    response."""
    crawler, outcome = await _crawl_with_stored_rows(site, crawl_database,
                                                     STORED_FRAMEWORK_METHODS, caplog)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert outcome["good"][0] == "done"
    spider_errors = [m for m in all_messages(caplog, logging.ERROR) if "Spider error" in m]
    wrong = {name: outcome[name] for name in STORED_FRAMEWORK_METHODS
             if tuple(outcome[name][:2]) != ("failed", "unloadable")}
    assert wrong == {}, (wrong, spider_errors)
    assert [path for path in site.counts_by_path() if path.startswith("/stored/")] == []


@deferred_f_from_coro_f
async def test_journaled_response_naming_another_class_is_not_loaded(
    site: LocalSite, crawl_database: str, caplog: Any
) -> None:
    """A response journaled for a pending request (a replay after a kill) whose ``_class``
    names code outside Scrapy's response classes: not imported; the page is downloaded."""
    settings = crawl_settings(crawl_database, **KEYS)
    first = await run_crawl(PagesSpider, settings, url=site.url, paths=pages(site, 1),
                            make_output=lambda r: [{"sku": r.url}])
    assert first.stats.get_value("finish_reason") == "finished"
    site.add("/replayed", "<html>the real page</html>")
    url = site.url + "/replayed"
    _insert_pending(crawl_database, "replayed", url, _stored_request(crawl_database, url),
                    attempts=1)
    change_stored(crawl_database,
                  "INSERT INTO responses (key, data, body, stored_at) VALUES (?, ?, ?, 0)",
                  ("replayed", json.dumps({"_class": "never_imported.EvilResponse",
                                           "url": url, "status": 200, "headers": {},
                                           "flags": []}), b"<html>forged</html>"))
    sys.modules.pop("never_imported", None)
    seen: list[str] = []

    def output(response: Any) -> Any:
        seen.append(response.text)
        return []

    crawler = await run_crawl(PagesSpider, {**settings, "IDEMPOTENT_RUN_MODE": "resume"},
                              url=site.url, paths=[], make_output=output)
    assert "never_imported" not in sys.modules
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert seen == ["<html>the real page</html>"]
    assert site.hits("/replayed") == 1
    assert any("journaled response" in m and "not allowed" in m
               for m in package_messages(caplog, logging.WARNING))


SQL_INJECTION = "'; DROP TABLE records; --"
SQL_INJECTION_2 = "\"); DELETE FROM requests WHERE (\"1\"=\"1"


@deferred_f_from_coro_f
async def test_sql_injection_in_urls_meta_items_and_source_is_stored_as_data(
    site: LocalSite, crawl_database: str
) -> None:
    from urllib.parse import quote

    target = f"/q/{quote(SQL_INJECTION, safe='')}?x={quote(SQL_INJECTION_2, safe='')}"
    site.add(target, "<html>injected target</html>")

    class InjectionSpider(PagesSpider):
        def parse(self, response: Any, **cb_kwargs: Any) -> Any:
            if response.url.endswith("/page/1"):
                yield scrapy.Request(self.base_url + target, callback=self.parse,
                                     meta={"note": SQL_INJECTION, SQL_INJECTION_2: [1]},
                                     cb_kwargs={"why": SQL_INJECTION})
            yield {"sku": f"{SQL_INJECTION} {response.url}", "name": SQL_INJECTION_2,
                   SQL_INJECTION: SQL_INJECTION_2}

    settings = crawl_settings(crawl_database, IDEMPOTENT_SOURCE=SQL_INJECTION_2, **KEYS)
    crawler = await run_crawl(InjectionSpider, settings, url=site.url, paths=pages(site, 1))
    assert crawler.stats.get_value("finish_reason") == "finished"
    with reading(crawl_database) as store:  # every table is still there: each one is read
        assert store.meta() and store.runs()
        assert store.count_rejects() == 0
    assert frontier_counts(crawl_database) == {"done": 2}
    stored_rows = stored_records(crawl_database)
    records = [loads(r.data) for r in stored_rows]
    assert len(records) == 2
    assert all(r["name"] == SQL_INJECTION_2 and r[SQL_INJECTION] == SQL_INJECTION_2
               for r in records)
    assert {r.source for r in stored_rows} == {SQL_INJECTION_2}
    [data] = [e.data for e in frontier_entries(crawl_database) if "/q/" in e.url]
    stored = loads(data)
    assert stored["meta"]["note"] == SQL_INJECTION
    assert stored["meta"][SQL_INJECTION_2] == [1]
    assert stored["cb_kwargs"] == {"why": SQL_INJECTION}
    assert site.hits(target) == 1


@deferred_f_from_coro_f
async def test_no_credentials_in_the_package_logs(
    site: LocalSite, crawl_database: str, tmp_path: Path, caplog: Any
) -> None:
    """Credentials in a URL, an Authorization header and a proxy URL, on a request that
    cannot be stored (something else in it; fetched from memory) and on one whose download
    fails: the package's own log lines never show them."""
    caplog.set_level(logging.DEBUG, logger="scrapy_idempotent")
    host = site.url.split("://", 1)[1]
    handle = (tmp_path / "f.txt").open("w")
    secrets = ["pw-secret-url", "tok-secret-header", "pw-secret-proxy"]

    def with_credentials(path: str, **meta: Any) -> scrapy.Request:
        return scrapy.Request(
            f"http://alice:pw-secret-url@{host}{path}",
            headers={"Authorization": "Bearer tok-secret-header"},
            meta={"proxy": "http://bob:pw-secret-proxy@127.0.0.1:1", **meta},
            dont_filter=True)

    class CredentialsSpider(PagesSpider):
        def parse(self, response: Any) -> Any:
            yield with_credentials("/refused", handle=handle)  # unstorable: an open file
            yield with_credentials("/failing")  # the proxy port refuses connections
            yield {"sku": "CRED-1"}

    try:
        crawler = await run_crawl(CredentialsSpider, crawl_settings(crawl_database, **KEYS),
                                  url=site.url, paths=pages(site, 1))
    finally:
        handle.close()
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/requests/unstorable"] == 1
    # the download through the proxy failed; the page whose unstorable child (fetched from
    # memory through the same proxy) failed is failed too
    assert stats["idempotent/requests/failed"] == 2
    logged = package_messages(caplog, tracebacks=True)
    assert any("/refused" in m and "meta['handle']" in m for m in logged), logged
    leaks = [m for m in logged if "secret" in m or "alice:" in m or "bob:" in m
             or any(secret in m for secret in secrets)]
    assert leaks == []
    # the stored frontier keeps what the request needs (a 0600 file), the failure says why
    kinds = sorted(e.error_kind or "" for e in frontier_entries(crawl_database)
                   if e.state == "failed")
    assert kinds[0].startswith("download_error/")
    assert kinds[1].startswith("unstorable_child/download_error/")
