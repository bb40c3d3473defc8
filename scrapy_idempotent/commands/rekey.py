"""``scrapy idempotent rekey``: give every stored record the record ID the crawl's current
settings derive from its data (a natural key changed, an item class renamed, a database of
an earlier record ID scheme), merging records that now share an ID, in one transaction."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import rekey
from ..exceptions import describe_key
from ..records import RecordIdentity
from ._common import plural, print_report

if TYPE_CHECKING:
    import argparse

    from ._common import Opened

DESCRIPTION = ("re-derive every record's ID from its stored data under the current natural "
               "keys (after changing IDEMPOTENT_NATURAL_KEYS or renaming an item class), "
               "merging records that now share an ID; --dry-run shows what would change")

#: Merged records listed one by one at most (all with --json).
LISTED = 20


def run(opened: Opened, opts: argparse.Namespace) -> int:
    """Plan under the project's settings; with ``--dry-run`` print the plan, else apply it
    (refused while a crawl of the database runs, or when some record has no key under the
    new settings: nothing is written then). Exit code 0 when done (or nothing to do), 1
    when refused."""
    store, path = opened.store, opened.path
    removed = rekey.finish_cleanup(store) if not opts.dry_run else 0
    identity = RecordIdentity.from_config(opened.config)
    # the source the crawl stored its records under (with --db, the settings cannot know it)
    identity.source = store.meta().get("source") or identity.source
    plan = rekey.plan_rekey(store, identity, rekey.FileStores.from_settings(opened.settings))
    report = _report(path, plan, dry_run=bool(opts.dry_run))
    lines = _lines(path, plan, dry_run=bool(opts.dry_run))
    refusal = _refusal(plan, keep_file_paths=bool(opts.keep_file_paths))
    if refusal is None and not opts.dry_run and plan.needed:
        running = store.live_workers()
        if running:
            refusal = (f"{path} is in use by the crawl of {', '.join(running[:3])}: stop "
                       "every crawl of it before re-identifying its records")
        else:
            rekey.apply_rekey(store, plan)
    if refusal is not None:
        report["refused"] = refusal
        lines.append(f"Refused, nothing was changed: {refusal}")
    elif removed:
        lines.append(f"Removed {plural(removed, 'file', 'files')} a rekey cut short left")
    print_report(opts, report, lines)
    return 1 if refusal is not None else 0


def _refusal(plan: rekey.RekeyPlan, *, keep_file_paths: bool) -> str | None:
    changed_types = {key.item_type for key in plan.change.keys
                     if key.record_type in plan.changed_keys}
    unresolved = [name for name in plan.missing_classes if name in changed_types]
    if unresolved:
        return (f"the item class {unresolved[0]} does not import here, and its records would "
                "get another key: run the command in the project's directory with the "
                "spider's name (its key may come from a base class the settings name)")
    if plan.unkeyable:
        record_id, item_type, why = plan.unkeyable[0]
        return (f"{plural(len(plan.unkeyable), 'record has', 'records have')} no natural key "
                f"under the settings (record {record_id}, {item_type}: {why}); fix "
                "IDEMPOTENT_NATURAL_KEYS, or delete those records")
    if plan.remote_files and not keep_file_paths:
        return (f"{plural(plan.remote_files, 'record names', 'records name')} files by its "
                "record ID in a remote files store, which rekey cannot rename: pass "
                "--keep-file-paths to keep their paths (the next crawl downloads those files "
                "again under the new names and counts the records as updated)")
    return None


def _report(path: str, plan: rekey.RekeyPlan, *, dry_run: bool) -> dict[str, object]:
    return {
        "database": path, "dry_run": dry_run, "records": plan.records,
        "moved": plan.moved, "rekeyed": plan.rekeyed,
        "merged": [{"record_id": new_id, "kept": kept, "merged": merged}
                   for new_id, (kept, merged) in sorted(plan.merges.items())],
        "keys": {key.record_type: {"item_type": key.item_type, "fields": list(key.fields)}
                 for key in plan.change.keys},
        "changed_keys": {record_type: {"stored": None if old is None else list(old),
                                       "new": list(new)}
                         for record_type, (old, new) in sorted(plan.changed_keys.items())},
        "unkeyable": [{"record_id": r, "item_type": t, "reason": why}
                      for r, t, why in plan.unkeyable],
        "files": len(plan.file_links), "missing_classes": plan.missing_classes,
    }


def _lines(path: str, plan: rekey.RekeyPlan, *, dry_run: bool) -> list[str]:
    if not plan.needed:
        return [f"{path}: every one of {plural(plan.records, 'record', 'records')} has the "
                "record ID the settings give it: nothing to do"]
    verb = "would be" if dry_run else "were"
    lines = [f"{path}: {plural(plan.records, 'record', 'records')} read; {plan.moved} {verb} "
             f"given a new record ID ({plan.rekeyed} of them a new natural key), "
             f"{sum(len(m) for _, m in plan.merges.values())} {verb} merged into others, "
             f"{plural(len(plan.file_links), 'file', 'files')} {verb} renamed"]
    for record_type, (old, new) in sorted(plan.changed_keys.items()):
        lines.append(f"  {record_type}: keyed by "
                     f"{'(not recorded)' if old is None else describe_key(old)} -> "
                     f"{describe_key(new)}")
    for n, (new_id, (kept, merged)) in enumerate(sorted(plan.merges.items())):
        if n == LISTED:
            lines.append(f"  ... {len(plan.merges) - LISTED} more merges (--json lists all)")
            break
        lines.append(f"  {new_id}: kept {kept} (observed latest), merged {', '.join(merged)}")
    for type_name in plan.missing_classes:
        lines.append(f"  {type_name} does not import: keyed by its name in the settings")
    return lines

