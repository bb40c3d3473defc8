"""Kill demo: SIGKILL a crawl again and again, let it finish, and count what was stored.

Run from anywhere::

    python example_project/demo.py                   # both modes, 10 kills each
    python example_project/demo.py --modes naive --kills 5 --seed 1

One local test shop (:mod:`shop.site`) runs in this process for the whole demo. For each mode,
in a fresh temporary directory, ``scrapy crawl shop`` runs in a subprocess and is killed with
SIGKILL a random moment (``--kill-min`` .. ``--kill-max`` seconds, drawn from ``--seed``,
default 11) after the shop has seen its first request, and not before the crawl has made
``--kill-min-requests`` requests (20): on a loaded machine a crawl can be so slow to start
that a kill 0.2 s in would stop it before anything was at stake (JOBDIR has written nothing
yet and simply starts over). This is repeated ``--kills`` times, then the crawl runs once
more to completion.

Modes:

* ``naive``: Scrapy's default in-memory scheduler and :class:`shop.pipelines.NaiveInsertPipeline`
  (one INSERT per item), i.e. the project without the ``scrapy_idempotent`` add-on.
* ``jobdir``: Scrapy's own persistence (``JOBDIR``: disk queues and a seen-set) and
  :class:`shop.pipelines.UpsertBySkuPipeline` (one row per SKU), the usual hand-made fix.
* ``idempotent``: the project's own settings (the ``scrapy_idempotent`` add-on) with its database
  in the temporary directory.

If a run finishes on its own before its kill moment, or is killed while shutting down after its
crawl finished (its log has ``Closing spider (finished)``), the crawl is complete: the run is
recorded, the kill phase ends there and no further run is started (another ``scrapy crawl`` would
be a new crawl, not a resumption). Only real SIGKILLs are counted as kills.

The idempotent mode is checked against the bar: exactly one correct row per product and at most
``pages + kills x concurrency`` HTTP requests (525 + kills with the default shop and the default
``--concurrency 1``: a kill can only repeat what was on the wire, and the response journal keeps
what had already arrived). The exit code is 1 when it
fails the bar, 2 when the demo itself could not run.

POSIX only (SIGKILL). The procedure is importable (:func:`run_mode`, :func:`check_bar`) so a
test can reuse it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

EXAMPLE_DIR = Path(__file__).resolve().parent
REPO_DIR = EXAMPLE_DIR.parent
if str(EXAMPLE_DIR) not in sys.path:
    sys.path.insert(0, str(EXAMPLE_DIR))

from shop.site import ShopSite  # noqa: E402 (needs EXAMPLE_DIR on sys.path)

MODES = ("naive", "jobdir", "idempotent")
MODE_LABELS = {
    "naive": "naive (default scheduler)",
    "jobdir": "JOBDIR + upsert by SKU",
    "idempotent": "scrapy_idempotent",
}
CORRECT_DEFINITION = (
    "correct = SKUs with a stored row whose sku, name and price equal the shop's, each SKU "
    "counted once (duplicate rows beyond the first are not correct rows)"
)
START_TIMEOUT = 60.0
_CLOSED_RE = re.compile(r"Spider closed \(([^)]*)\)")
# Logged by the engine when it starts closing the spider, before the scheduler's close().
_CLOSING_RE = re.compile(r"Closing spider \(([^)]*)\)")


class DemoError(RuntimeError):
    """The demo could not run a crawl or read its results (not a verdict on the scraper)."""


# --- running crawls ------------------------------------------------------------------------


def crawl_command(mode: str, site_url: str, workdir: Path, concurrency: int = 1) -> list[str]:
    """The ``scrapy crawl shop`` command line of ``mode``; run it with ``cwd=EXAMPLE_DIR``.

    ``concurrency`` sets ``CONCURRENT_REQUESTS`` (and per domain): what one kill can repeat.
    """
    command = [
        sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"url={site_url}",
        "-s", f"CONCURRENT_REQUESTS={concurrency}",
        "-s", f"CONCURRENT_REQUESTS_PER_DOMAIN={concurrency}",
    ]
    if mode == "idempotent":
        return [*command, "-s", f"IDEMPOTENT_DATABASE={workdir / 'idempotent.sqlite3'}"]
    if mode == "naive":
        return [
            *command,
            "-s",
            "ADDONS={}",
            "-s",
            'ITEM_PIPELINES={"shop.pipelines.NaiveInsertPipeline": 300}',
            "-s",
            f"NAIVE_DATABASE={workdir / 'naive.sqlite3'}",
        ]
    if mode == "jobdir":
        return [
            *command,
            "-s",
            "ADDONS={}",
            "-s",
            'ITEM_PIPELINES={"shop.pipelines.UpsertBySkuPipeline": 300}',
            "-s",
            f"NAIVE_DATABASE={workdir / 'jobdir.sqlite3'}",
            "-s",
            f"JOBDIR={workdir / 'job'}",
        ]
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")


def crawl_environment() -> dict[str, str]:
    """The environment of the crawl subprocesses.

    If ``scrapy_idempotent`` is not installed but its source sits next to ``example_project/``
    (a checkout of the repository), the checkout is put on ``PYTHONPATH``.
    """
    env = dict(os.environ)
    if (
        importlib.util.find_spec("scrapy_idempotent") is None
        and (REPO_DIR / "scrapy_idempotent" / "__init__.py").is_file()
    ):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_DIR), env.get("PYTHONPATH")]))
    return env


def _log_reason(log_path: Path, pattern: re.Pattern[str] = _CLOSED_RE) -> str | None:
    """The reason of the last ``Spider closed (...)`` line (or ``pattern``) of a crawl log."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    reasons = pattern.findall(text)
    return reasons[-1] if reasons else None


def _start_crawl(
    command: Sequence[str], log_path: Path, env: Mapping[str, str]
) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            command,
            cwd=EXAMPLE_DIR,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _wait_for_first_request(
    process: subprocess.Popen[bytes], site: ShopSite, baseline: int, log_path: Path
) -> None:
    """Block until the shop has served a request beyond ``baseline``."""
    deadline = time.monotonic() + START_TIMEOUT
    while site.request_count <= baseline:
        if process.poll() is not None:
            raise DemoError(
                f"the crawl exited with code {process.returncode} before its first request; "
                f"log: {log_path}"
            )
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise DemoError(
                f"the crawl made no request within {START_TIMEOUT:.0f} s; log: {log_path}"
            )
        time.sleep(0.002)


def run_mode(
    mode: str,
    site: ShopSite,
    kills: int,
    rng: random.Random,
    workdir: Path,
    *,
    kill_min: float = 0.2,
    kill_max: float = 1.0,
    timeout: float = 300.0,
    progress: bool = True,
    concurrency: int = 1,
    kill_min_requests: int = 0,
) -> dict[str, Any]:
    """Run the kill procedure of ``mode`` against ``site`` and measure the result.

    Resets the site's counters, runs up to ``kills`` crawls that are SIGKILLed ``kill_min`` ..
    ``kill_max`` seconds (drawn from ``rng``) after their first request (and not before the shop
    has answered ``kill_min_requests`` requests of that crawl), then one crawl to
    completion (at most ``timeout`` seconds). Logs and databases go to ``workdir``.

    Returns a JSON-ready dict: ``mode``, ``label``, ``kills`` (SIGKILLs of unfinished crawls),
    ``runs`` (one dict per crawl), ``completed_during_kills``, ``finish_reason``, ``rows``,
    ``distinct``, ``correct``, ``products``, ``pages``, ``requests``, ``repeated_paths`` (paths
    fetched more than once), ``wall_seconds``, ``workdir``.

    Raises:
        DemoError: a crawl failed to start, crashed, timed out or left no readable store.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if not 0 <= kill_min <= kill_max:
        raise ValueError(f"need 0 <= kill_min <= kill_max, got {kill_min} and {kill_max}")
    workdir.mkdir(parents=True, exist_ok=True)
    command = crawl_command(mode, site.url, workdir, concurrency)
    env = crawl_environment()
    runs: list[dict[str, Any]] = []
    real_kills = 0
    completed = False

    def note(text: str) -> None:
        if progress:
            print(f"[{mode}] {text}", file=sys.stderr, flush=True)

    site.reset_counts()
    began = time.monotonic()
    for attempt in range(1, kills + 1):
        kill_after = rng.uniform(kill_min, kill_max)
        log_path = workdir / f"{mode}-run{attempt:02d}.log"
        baseline = site.request_count
        process = _start_crawl(command, log_path, env)
        try:
            _wait_for_first_request(process, site, baseline, log_path)
            try:
                process.wait(timeout=kill_after)
            except subprocess.TimeoutExpired:
                while (site.request_count - baseline < kill_min_requests
                       and process.poll() is None):
                    time.sleep(0.002)
                process.kill()  # SIGKILL on POSIX
                process.wait()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        run: dict[str, Any] = {
            "run": attempt,
            "kill_after": round(kill_after, 3),
            "returncode": process.returncode,
            "requests_so_far": site.request_count,
            "log": str(log_path),
        }
        if process.returncode == -signal.SIGKILL:
            runs.append(run)
            # Killed while shutting down after the crawl finished: the crawl is complete (not
            # counted as a kill), and another `scrapy crawl` would be a new crawl, not a
            # resumption.
            if _log_reason(log_path, _CLOSING_RE) == "finished":
                run["outcome"] = "killed while closing"
                completed = True
                note(
                    f"run {attempt}: killed {kill_after:.2f} s after its first request, but "
                    "only while closing a finished crawl (not counted); no more runs"
                )
                break
            real_kills += 1
            run["outcome"] = "killed"
            note(
                f"run {attempt}: killed {kill_after:.2f} s after its first request "
                f"({run['requests_so_far']} requests so far)"
            )
            continue
        run["finish_reason"] = _log_reason(log_path)
        run["outcome"] = "finished" if process.returncode == 0 else "failed"
        runs.append(run)
        if process.returncode != 0:
            raise DemoError(
                f"run {attempt} exited with code {process.returncode}; log: {log_path}"
            )
        completed = True
        note(
            f"run {attempt}: finished on its own before its kill moment "
            f"({run['finish_reason']}); the crawl is complete, no more runs"
        )
        break

    if not completed:
        attempt = len(runs) + 1
        log_path = workdir / f"{mode}-run{attempt:02d}-final.log"
        process = _start_crawl(command, log_path, env)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise DemoError(
                f"the final run did not finish within {timeout:.0f} s; log: {log_path}"
            ) from None
        run = {
            "run": attempt,
            "outcome": "finished",
            "returncode": process.returncode,
            "finish_reason": _log_reason(log_path),
            "requests_so_far": site.request_count,
            "log": str(log_path),
        }
        runs.append(run)
        if process.returncode != 0:
            raise DemoError(
                f"the final run exited with code {process.returncode}; log: {log_path}"
            )
        note(f"final run: {run['finish_reason']} ({run['requests_so_far']} requests in all)")
    wall = time.monotonic() - began
    requests = site.request_count

    rows = read_rows(mode, workdir)
    expected = site.expected_products()
    return {
        "mode": mode,
        "label": MODE_LABELS[mode],
        "kills": real_kills,
        "runs": runs,
        "completed_during_kills": completed,
        "finish_reason": runs[-1].get("finish_reason"),
        **score(rows, expected),
        "products": len(expected),
        "pages": site.page_count,
        "requests": requests,
        "repeated_paths": _top_repeats(site.counts_by_path()),
        "concurrency": concurrency,
        "wall_seconds": round(wall, 2),
        "workdir": str(workdir),
    }


def _top_repeats(counts: Mapping[str, int], limit: int = 10) -> dict[str, int]:
    """The paths fetched more than once, most repeated first (at most ``limit``)."""
    repeated = Counter({path: n for path, n in counts.items() if n > 1})
    return dict(repeated.most_common(limit))


# --- measuring -----------------------------------------------------------------------------


def read_rows(mode: str, workdir: Path) -> list[tuple[Any, Any, Any]]:
    """Every stored row of ``mode`` as ``(sku, name, price)``.

    naive and jobdir: the ``products`` table of ``<mode>.sqlite3``; idempotent: the JSON
    ``data`` column of
    the ``records`` table of ``idempotent.sqlite3``.
    """
    database = workdir / f"{mode}.sqlite3"
    if not database.is_file():
        raise DemoError(f"the crawl left no database at {database}")
    try:
        connection = sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise DemoError(f"cannot open {database}: {exc}") from exc
    try:
        if mode in ("naive", "jobdir"):
            return connection.execute("SELECT sku, name, price FROM products").fetchall()
        rows = []
        for (data,) in connection.execute("SELECT data FROM records"):
            record = json.loads(data)
            rows.append((record.get("sku"), record.get("name"), record.get("price")))
        return rows
    except (sqlite3.Error, ValueError, AttributeError) as exc:
        raise DemoError(f"cannot read the stored rows of {database}: {exc}") from exc
    finally:
        connection.close()


def score(
    rows: Iterable[tuple[Any, Any, Any]], expected: Mapping[str, Mapping[str, str]]
) -> dict[str, int]:
    """Count ``rows``, distinct SKUs and correct SKUs (see :data:`CORRECT_DEFINITION`)."""
    rows = list(rows)
    correct_skus = {
        sku
        for sku, name, price in rows
        if isinstance(sku, str)
        and sku in expected
        and (name, price) == (expected[sku]["name"], expected[sku]["price"])
    }
    return {
        "rows": len(rows),
        "distinct": len({sku for sku, _, _ in rows}),
        "correct": len(correct_skus),
    }


def check_bar(result: Mapping[str, Any]) -> list[str]:
    """Why ``result`` misses the bar (empty when it passes).

    The bar: exactly one row per product, all of them correct, and at most
    ``pages + kills x concurrency`` HTTP requests: a kill may repeat only the requests that were
    on the wire (with the default concurrency of 1: ``pages + kills``).
    """
    products, kills = result["products"], result["kills"]
    allowed = result["pages"] + kills * result.get("concurrency", 1)
    failures = []
    if result["rows"] != products:
        failures.append(f"{result['rows']} rows stored, expected exactly {products}")
    if result["correct"] != products:
        failures.append(f"{result['correct']} correct rows, expected {products}")
    if result["requests"] > allowed:
        failures.append(
            f"{result['requests']} requests, allowed {allowed} ({result['pages']} pages + "
            f"{kills} kills x {result.get('concurrency', 1)} in flight)"
        )
    return failures


# --- reporting -----------------------------------------------------------------------------


def format_table(results: Sequence[Mapping[str, Any]]) -> str:
    """The results as a fixed-width table."""
    lines = [
        f"{'scraper':<28} {'kills':>5} {'rows':>6} {'distinct':>9} {'correct':>8} "
        f"{'requests':>9} {'wall s':>7}"
    ]
    for r in results:
        lines.append(
            f"{r['label']:<28} {r['kills']:>5} {r['rows']:>6} {r['distinct']:>9} "
            f"{r['correct']:>8} {r['requests']:>9} {r['wall_seconds']:>7.1f}"
        )
    return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="demo.py",
        description="SIGKILL the shop crawl repeatedly, let it finish, and count what it stored.",
    )
    parser.add_argument("--kills", type=int, default=10, help="kills per mode (10)")
    parser.add_argument("--seed", type=int, default=11,
                        help="seed of the kill moments (11; -1: a random seed)")
    parser.add_argument(
        "--modes",
        default="naive,jobdir,idempotent",
        help="comma-separated modes to run, from: naive, jobdir, idempotent (all)",
    )
    parser.add_argument(
        "--kill-min", type=float, default=0.2, help="earliest kill, s after first request (0.2)"
    )
    parser.add_argument(
        "--kill-max", type=float, default=1.0, help="latest kill, s after first request (1.0)"
    )
    parser.add_argument(
        "--kill-min-requests", type=int, default=20,
        help="no kill before the crawl has made this many requests (20)",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="time limit of the final run, s (300)"
    )
    parser.add_argument("--listing-pages", type=int, default=25, help="shop listing pages (25)")
    parser.add_argument(
        "--products-per-page", type=int, default=20, help="products per listing page (20)"
    )
    parser.add_argument(
        "--delay", type=float, default=0.01,
        help="seconds the shop waits before each answer (0.01)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=1,
        help="CONCURRENT_REQUESTS of the crawls: the most a kill can repeat (1)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary directories")
    parser.add_argument("--json", action="store_true", help="print one JSON object, no table")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"--modes takes a comma-separated subset of {', '.join(MODES)}")
    if args.kills < 0:
        parser.error("--kills must be >= 0")
    if not 0 <= args.kill_min <= args.kill_max:
        parser.error("need 0 <= --kill-min <= --kill-max")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit code (0 pass or no verdict, 1 fail, 2 error)."""
    args = _parse_args(argv)
    seed = args.seed if args.seed >= 0 else random.SystemRandom().randrange(2**31)
    site = ShopSite(
        listing_pages=args.listing_pages,
        products_per_page=args.products_per_page,
        delay=args.delay,
    )
    results: list[dict[str, Any]] = []
    workdirs: list[Path] = []
    error: str | None = None
    print(
        f"shop: {site.page_count} pages, {site.product_count} products; seed {seed}; "
        f"{args.kills} kills per mode, {args.kill_min}-{args.kill_max} s after the first request "
        f"and after at least {args.kill_min_requests} requests; "
        f"CONCURRENT_REQUESTS={args.concurrency}, shop delay {args.delay} s",
        file=sys.stderr,
        flush=True,
    )
    with site:
        for mode in args.modes:
            workdir = Path(tempfile.mkdtemp(prefix=f"shop-demo-{mode}-"))
            workdirs.append(workdir)
            try:
                results.append(
                    run_mode(
                        mode,
                        site,
                        args.kills,
                        random.Random(seed),  # the same kill moments for every mode
                        workdir,
                        kill_min=args.kill_min,
                        kill_max=args.kill_max,
                        timeout=args.timeout,
                        concurrency=args.concurrency,
                        kill_min_requests=args.kill_min_requests,
                    )
                )
            except DemoError as exc:
                error = f"{mode}: {exc}"
                break

    verdict: dict[str, Any] | None = None
    idempotent = next((r for r in results if r["mode"] == "idempotent"), None)
    if idempotent is not None:
        failures = check_bar(idempotent)
        verdict = {
            "pass": not failures,
            "failures": failures,
            "allowed_requests": idempotent["pages"]
            + idempotent["kills"] * args.concurrency,
        }
    keep = args.keep or error is not None or (verdict is not None and not verdict["pass"])

    if args.json:
        payload = {
            "seed": seed,
            "kills": args.kills,
            "kill_window": [args.kill_min, args.kill_max],
            "kill_min_requests": args.kill_min_requests,
            "site": {
                "listing_pages": args.listing_pages,
                "products_per_page": args.products_per_page,
                "pages": site.page_count,
                "products": site.product_count,
                "delay": args.delay,
            },
            "correct_definition": CORRECT_DEFINITION,
            "results": results,
            "verdict": verdict,
            "error": error,
            "workdirs": [str(w) for w in workdirs] if keep else [],
        }
        print(json.dumps(payload, indent=2))
    else:
        if results:
            print(format_table(results))
            print(f"bar: {site.product_count} correct rows, requests <= {site.page_count} + "
                  f"kills x {args.concurrency} (CONCURRENT_REQUESTS)")
            print(CORRECT_DEFINITION)
        for r in results:
            if r["completed_during_kills"]:
                print(
                    f"note: {r['label']}: run {r['runs'][-1]['run']} ended on its own "
                    f"({r['runs'][-1].get('finish_reason') or r['runs'][-1]['outcome']}) after "
                    f"{r['kills']} kill(s), with {r['correct']} of {r['products']} products "
                    "stored; no further run was started"
                )
        if verdict is not None and idempotent is not None:
            if verdict["pass"]:
                print(
                    f"PASS: scrapy_idempotent stored {idempotent['correct']} correct rows with "
                    f"{idempotent['requests']} requests (allowed {verdict['allowed_requests']})"
                )
            else:
                print("FAIL: scrapy_idempotent missed the bar: " + "; ".join(verdict["failures"]))
        if error is not None:
            print(f"ERROR: {error}")
        if keep:
            print("logs and databases kept in: " + ", ".join(str(w) for w in workdirs))

    if not keep:
        for workdir in workdirs:
            shutil.rmtree(workdir, ignore_errors=True)
    if error is not None:
        return 2
    return 1 if verdict is not None and not verdict["pass"] else 0


if __name__ == "__main__":
    sys.exit(main())
