"""``scrapy idempotent check``: integrity, schema version, the engine's settings (WAL mode),
leases of dead workers, rows in impossible states, orphan files of the local files stores.

Each check is ``ok``, or a state that heals itself (``heals``: the leases of a killed crawl,
or expired ones, which the next crawl takes back; reported, exit code 0), or a problem that
needs a person (exit code 1), so monitoring built on the exit code does not alert after
every kill."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

from ..workers import worker_state
from ._common import WORKER_STATES, all_records, iso, plural, print_report, table

if TYPE_CHECKING:
    import argparse

    from ..store.base import FrontierStore
    from ._common import Opened

DESCRIPTION = ("integrity, schema, WAL, dead workers' leases, impossible rows; exit 1 for a "
               "problem that needs a person")

_ANOMALIES = {
    "unknown_state": "requests in an unknown state",
    "leased_without_owner": "leased requests without a worker or lease time",
    "owner_without_lease": "requests not leased but with a worker or lease time",
    "finished_without_time": "finished requests without a finish time",
    "unfinished_with_time": "pending or leased requests with a finish time",
    "failed_without_kind": "failed requests without an error kind",
    "finished_never_leased": "finished requests never leased",
    "orphan_journal": "journaled responses of requests that are not pending or leased",
    "record_times": "records changed before they were first seen",
}


def run(opened: Opened, opts: argparse.Namespace) -> int:
    store, info = opened.store, opened.info
    checks: list[dict[str, Any]] = []

    def add(name: str, ok: bool, detail: str, *, heals: bool = False) -> None:
        checks.append({"check": name, "ok": ok, "heals": not ok and heals, "detail": detail})

    integrity = store.integrity_check()
    add("integrity", integrity.ok,
        f"{integrity.method}: " + ("; ".join(integrity.problems[:10]) or "ok"))
    add("schema_version", info.current,
        f"schema version {info.version}" + (
            "" if info.current else f", this scrapy_idempotent reads {info.supported}"))
    for setting in store.engine_settings():
        add(setting.name, setting.ok, f"{setting.label} {setting.value}" + (
            "" if setting.ok else f" (expected {setting.expected})"))
    if info.current:
        now = time.time()
        holders = store.lease_holders()
        if not holders:
            add("leases", True, "no leases held")
        for holder in holders:
            state = worker_state(holder.worker)
            leases_s = "s" * (holder.leases != 1)
            if state == "dead":
                add("leases", False,
                    f"{holder.leases} lease{leases_s} held by {holder.worker}, a process of "
                    "this host that no longer exists (the next crawl on this host takes "
                    "them back at once)", heals=True)
            elif holder.leased_until < now:
                add("leases", False,
                    f"{holder.leases} lease{leases_s} of {holder.worker} expired "
                    f"{now - holder.leased_until:.0f} s ago ({WORKER_STATES[state]}; the "
                    "next crawl takes them back)", heals=True)
            else:
                add("leases", True,
                    f"{holder.leases} lease{leases_s} held by {holder.worker} "
                    f"({WORKER_STATES[state]}) until {iso(holder.leased_until)}")
        anomalies = store.anomalies()
        wrong = {name: n for name, n in anomalies.items() if n}
        add("rows", not wrong,
            "; ".join(f"{n} {_ANOMALIES[name]}" for name, n in wrong.items())
            if wrong else "no rows in impossible states")
        for check in _file_checks(store, opened.settings):
            checks.append({**check, "heals": False})
    problems = sum(1 for c in checks if not c["ok"] and not c["heals"])
    healing = sum(1 for c in checks if c["heals"])
    report = {"database": opened.path, "ok": not problems, "problems": problems,
              "heals": healing, "checks": checks}
    lines = [f"Checking {opened.path}"]
    lines += table(["", "check", "detail"],
                   [["ok" if c["ok"] else "heals" if c["heals"] else "PROBLEM", c["check"],
                     c["detail"]] for c in checks], header=False)
    found = f"{plural(problems, 'problem')} found" if problems else "No problem found"
    if healing:
        found += (f"; {healing} state{'s' * (healing != 1)} that "
                  f"heal{'s' * (healing == 1)} by {'itself' if healing == 1 else 'themselves'}"
                  " (the next crawl takes the leases back)")
    lines.append(found)
    print_report(opts, report, lines)
    return 1 if problems else 0


def _file_checks(store: FrontierStore, settings: Any) -> list[dict[str, Any]]:
    """Orphans of the local files stores of ``FILES_STORE`` and ``IMAGES_STORE``: files
    no stored record references (left by a kill, a page that failed for good, an item
    dropped after its files were written, a file URL that changed)."""
    from ..files import orphan_files, referenced_paths

    stores = {settings.get(name) for name in ("FILES_STORE", "IMAGES_STORE")}
    local = sorted(str(s).split("://", 1)[-1] for s in stores
                   if s and ("://" not in str(s) or str(s).startswith("file://")))
    if not local:
        return []
    fields = (settings.get("FILES_RESULT_FIELD") or "files",
              settings.get("IMAGES_RESULT_FIELD") or "images")
    referenced: set[str] = set()
    for record in all_records(store, {}):
        data = json.loads(record.data)
        if isinstance(data, dict):
            referenced |= referenced_paths(data, fields)
    checks = []
    for basedir in local:
        orphans = orphan_files(basedir, referenced) if os.path.isdir(basedir) else []
        shown = ", ".join(orphans[:10]) + (" ..." if len(orphans) > 10 else "")
        checks.append({
            "check": "files", "ok": not orphans,
            "detail": (f"{len(orphans)} file(s) in {basedir} that no stored record "
                       f"references: {shown}") if orphans else
                      f"every file in {basedir} is referenced by a stored record",
            "orphans": orphans})
    return checks
