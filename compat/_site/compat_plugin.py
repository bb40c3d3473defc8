"""pytest plugin of a compatibility run (``-p compat_plugin``): marks allow-listed tests,
then prints the counts that prove the add-on was on.

Settings come from the environment (``compat/run.py`` sets them):
``SCRAPY_IDEMPOTENT_COMPAT_EVENTS`` (the events directory, see ``idempotent_forced``),
``SCRAPY_IDEMPOTENT_COMPAT_FORCE`` (``1``: add-on forced on) and
``SCRAPY_IDEMPOTENT_COMPAT_ALLOWLIST`` (the allow-list file; only used when forced).

An allow-listed test still runs, as a non-strict xfail: its failure is expected and counted
as allow-listed; if it passes, the summary names it as a stale entry. A run fails (exit
status 1 even when pytest passed) when the add-on was forced on but no crawler was built, no
IdempotentScheduler opened, or a spider opened with another scheduler.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from idempotent_forced import EVENTS_ENV, FORCE_ENV, POSTGRESQL_ENV

ALLOWLIST_ENV = "SCRAPY_IDEMPOTENT_COMPAT_ALLOWLIST"
#: the file in the events directory naming the tests that failed, not allow-listed (one node
#: id a line), for ``compat/run.py`` to run again without the add-on
FAILED_FILE = "FAILED_TESTS"
IDEMPOTENT_SCHEDULER = "scrapy_idempotent.scheduler.IdempotentScheduler"


STORES = ("sqlite", "postgresql")


def current_store() -> str:
    return "postgresql" if os.environ.get(POSTGRESQL_ENV) else "sqlite"


def read_allowlist(path: str | None, store: str) -> dict[str, str]:
    """``{entry: reason}`` from lines ``[<store>:] <node id or prefix>  # <reason>``; an
    entry matches the node id itself, its parametrisations (``entry[...]``) and, for a
    class, its tests; one with a store (``postgresql: tests/...``) only on that store."""
    entries: dict[str, str] = {}
    if not path:
        return entries
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        entry, _, reason = line.partition(" #")
        entry, reason = entry.strip(), reason.strip()
        if not reason:
            raise pytest.UsageError(f"{path}: allow-list entry without a reason: {line!r}")
        only, colon, rest = entry.partition(": ")
        if colon:
            if only not in STORES:
                raise pytest.UsageError(f"{path}: unknown store {only!r} in {line!r}")
            if only != store:
                continue
            entry = rest.strip()
        entries[entry] = reason
    return entries


def allowlisted(nodeid: str, entries: dict[str, str]) -> str | None:
    for entry in entries:
        if nodeid == entry or nodeid.startswith((entry + "[", entry + "::")):
            return entry
    return None


class CompatReport:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.forced = os.environ.get(FORCE_ENV) == "1"
        self.allowlist = (read_allowlist(os.environ.get(ALLOWLIST_ENV), current_store())
                          if self.forced else {})
        self.outcomes: Counter[str] = Counter()
        self.failed: list[str] = []
        self.allowlisted_failed: list[str] = []
        self.allowlisted_passed: list[str] = []
        self.matched: set[str] = set()
        self.collected_files: set[str] = set()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            self.collected_files.add(item.nodeid.split("::", 1)[0])
            entry = allowlisted(item.nodeid, self.allowlist)
            if entry is not None:
                self.matched.add(entry)
                item.add_marker(pytest.mark.xfail(
                    reason=f"allow-listed: {self.allowlist[entry]}", strict=False))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.collected_files.add(report.nodeid.split("::", 1)[0])  # xdist: not collected here
        # one outcome per test: a failing setup or teardown counts as a failure
        if report.when == "call" or (report.when == "setup" and not report.passed) or (
                report.when == "teardown" and report.failed):
            if report.when == "teardown" and report.nodeid in self.failed:
                return
            entry = allowlisted(report.nodeid, self.allowlist)
            if entry is not None:
                self.matched.add(entry)
            if hasattr(report, "wasxfail") and entry is not None:
                if report.skipped:
                    self.outcomes["allow-listed"] += 1
                    self.allowlisted_failed.append(report.nodeid)
                else:
                    self.outcomes["passed"] += 1
                    self.allowlisted_passed.append(report.nodeid)
            elif report.failed:
                self.outcomes["failed"] += 1
                self.failed.append(report.nodeid)
            elif report.skipped:
                self.outcomes["xfailed" if hasattr(report, "wasxfail") else "skipped"] += 1
            else:
                self.outcomes["passed"] += 1

    def events(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for path in sorted(Path(os.environ[EVENTS_ENV]).glob("events-*.jsonl")):
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    found.append(json.loads(line))
        return found

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if hasattr(self.config, "workerinput"):
            return  # an xdist worker: the controller reports
        write = terminalreporter.write_line
        events = self.events()
        kinds = Counter(e["event"] for e in events)
        development = [e for e in events if e["event"] == "opened"
                       and e.get("development_command")]
        opened = [e for e in events if e["event"] == "opened"
                  and not e.get("development_command")]
        other = sorted({(e["test"], e["scheduler"]) for e in opened
                        if e["scheduler"] != IDEMPOTENT_SCHEDULER})
        by_idempotent = sum(1 for e in opened if e["scheduler"] == IDEMPOTENT_SCHEDULER)
        by_other = len(opened) - by_idempotent
        forced = sum(1 for e in events if e["event"] == "crawler" and e["forced"])
        processes = len({e["pid"] for e in events})
        tests_with_crawler = len({e["test"] for e in events if e["event"] == "crawler"})
        run = sum(n for k, n in self.outcomes.items() if k != "skipped")

        terminalreporter.section("scrapy_idempotent compatibility")
        import scrapy

        write(f"Scrapy {scrapy.__version__} from {os.path.dirname(scrapy.__file__)}; "
              f"add-on {'FORCED ON for every crawler' if self.forced else 'off (plain Scrapy)'}"
              f"; each crawler's frontier on {current_store()}")
        write(f"tests run {run}: passed {self.outcomes['passed']}, failed "
              f"{self.outcomes['failed']}, allow-listed {self.outcomes['allow-listed']}, "
              f"xfailed upstream {self.outcomes['xfailed']}; skipped {self.outcomes['skipped']}")
        write(f"crawlers built {kinds['crawler']} (add-on forced on {forced}) in "
              f"{tests_with_crawler} tests and {processes} processes; spiders opened "
              f"{len(opened)}: with IdempotentScheduler {by_idempotent}, with another "
              f"scheduler {by_other}; IdempotentScheduler.open calls "
              f"{kinds['idempotent_open']}; spiders opened by development commands "
              f"(scrapy fetch, shell...: add-on off by design) {len(development)}")
        for nodeid in self.allowlisted_failed:
            entry = allowlisted(nodeid, self.allowlist)
            write(f"allow-listed {nodeid}: {self.allowlist[entry] if entry else ''}")
        for nodeid in self.failed:
            write(f"FAILED (not allow-listed) {nodeid}")
        Path(os.environ[EVENTS_ENV], FAILED_FILE).write_text(
            "".join(f"{nodeid}\n" for nodeid in self.failed), encoding="utf-8")
        for nodeid in self.allowlisted_passed:
            write(f"ALLOW-LISTED BUT PASSED (stale entry?) {nodeid}")
        for entry in sorted(set(self.allowlist) - self.matched):
            if entry.split("::", 1)[0] not in self.collected_files:
                continue  # its module was not selected
            write(f"allow-list entry matched no test of this run: {entry}")
        if self.forced:
            for test, scheduler in other:
                write(f"PROOF: spider opened with {scheduler} in {test}")
            if not kinds["crawler"] or not kinds["idempotent_open"] or other:
                write("PROOF FAILED: the add-on was not on for every crawl")
                Path(os.environ[EVENTS_ENV], "PROOF_FAILED").touch()


#: Scrapy's suite makes warnings errors, as ours does; as in ours (pyproject.toml), a
#: deprecation raised where Scrapy and its libraries call each other is not one. Named by
#: its message too: ``pytest.warns`` raises again the warnings it did not expect without
#: their module. w3lib 2.6 deprecated parameters Scrapy passes when it infers a response's
#: encoding, which the add-on's response journal reads (``Response.to_dict()``).
LIBRARIES_OWN_DEPRECATIONS = (
    r"ignore::DeprecationWarning:(scrapy|twisted|w3lib|parsel|itemadapter)\.",
    "ignore:The default_encoding and auto_detect_fun parameters of"
    " w3lib.encoding.html_to_unicode:DeprecationWarning",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in LIBRARIES_OWN_DEPRECATIONS:
        config.addinivalue_line("filterwarnings", line)
    config.pluginmanager.register(CompatReport(config), "scrapy_idempotent_compat_report")
