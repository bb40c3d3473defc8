#!/usr/bin/env python3
"""The supported-versions matrix: every supported Scrapy minor release x every Python found.

    python3 .ci/matrix.py                        # fast suite + demo, every release x Python
    python3 .ci/matrix.py --scrapy 2.13 2.19 --python 3.11
    python3 .ci/matrix.py --compat               # also Scrapy's own tests with the add-on on
    python3 .ci/matrix.py --slow                 # also the kill-and-resume tests

Each cell gets its own virtual environment under ``.matrix/`` (kept between runs: a second
run only re-checks the installs) with the project installed in editable mode and the newest
patch of that Scrapy minor release. In each cell: the fast suite (``pytest -m "not slow"``),
the demo's idempotent mode (``example_project/demo.py --modes idempotent``, 10 SIGKILLs, its
bar: one correct row per product, at most pages + kills requests), and on request the
compatibility suite (``compat/run.py``, the tests of that Scrapy release's own source
distribution with the add-on forced on) and the slow tests. One more cell checks the release
below the supported range: ``scrapy crawl`` must refuse it with one clear message and a
non-zero exit.

Releases: from the floor in ``setup.cfg`` (``scrapy>=X.Y``) to the newest on the package
index, or ``--scrapy``. Pythons: ``python3.10`` to ``python3.13`` on ``PATH`` or under
``~/.pyenv/versions``, or ``--python``. The table is printed at the end and written to
``.matrix/results.md`` (and ``results.json``); the exit status is 1 when a cell failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".matrix"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
#: pip writes the project's egg-info into the source tree: one install at a time.
_INSTALL_LOCK = threading.Lock()
_PRINT_LOCK = threading.Lock()


@dataclass
class Step:
    """One command of a cell: its verdict and the line that says why."""

    ok: bool | None = None  # None: not run
    summary: str = ""
    seconds: float = 0.0
    log: str = ""


@dataclass
class Cell:
    python: str
    scrapy: str  # the minor release, "2.13"
    installed: str = ""  # the exact versions installed, "Scrapy 2.13.4, Twisted 25.5.0"
    steps: dict[str, Step] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(step.ok is not False for step in self.steps.values())


def say(message: str) -> None:
    with _PRINT_LOCK:
        print(message, flush=True)


def scrapy_floor() -> tuple[int, int]:
    """``(2, 13)`` from ``install_requires`` in setup.cfg (``scrapy>=2.13``)."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requires = config.get("options", "install_requires")
    match = re.search(r"^\s*scrapy\s*>=\s*(\d+)\.(\d+)", requires, re.M | re.I)
    if match is None:
        sys.exit("setup.cfg: no 'scrapy>=X.Y' in install_requires")
    return int(match[1]), int(match[2])


def published_releases(pip_python: str) -> list[str]:
    """Every Scrapy version on the package index (``pip index versions scrapy``)."""
    result = subprocess.run(
        [pip_python, "-m", "pip", "index", "versions", "scrapy"],
        capture_output=True, text=True, check=False)
    match = re.search(r"Available versions: (.*)", result.stdout)
    if result.returncode != 0 or match is None:
        sys.exit("cannot list Scrapy's releases (pip index versions scrapy): "
                 f"{result.stderr.strip() or result.stdout.strip()}; pass --scrapy")
    return [v.strip() for v in match[1].split(",")]


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def newest_patches(versions: list[str]) -> dict[str, str]:
    """``{"2.13": "2.13.4", ...}``: the newest final release of each minor."""
    newest: dict[str, str] = {}
    for version in versions:
        if not re.fullmatch(r"\d+\.\d+(\.\d+)?", version):
            continue  # pre-releases and dev versions are not part of the matrix
        minor = ".".join(version.split(".")[:2])
        if minor not in newest or _key(version) > _key(newest[minor]):
            newest[minor] = version
    return newest


def find_python(version: str) -> str | None:
    """An interpreter of ``version`` ("3.12") that runs: on PATH, else the newest under
    pyenv (a pyenv shim on PATH fails for a version that is not selected)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which(f"python{version}")] + [
        str(p) for p in sorted(root.glob(f"{version}.*/bin/python{version}"),
                               key=lambda p: _key(p.parts[-3]), reverse=True)]
    for found in candidates:
        if found and subprocess.run([found, "-c", "pass"], capture_output=True,
                                    check=False).returncode == 0:
            return found
    return None


def run(command: list[str], log: Path, timeout: float, cwd: Path = ROOT,
        env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``command``, its output appended to ``log``; (exit status, output)."""
    start = time.monotonic()
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True,
                                timeout=timeout, stdin=subprocess.DEVNULL, env=env)
        code, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        err = exc.stderr or ""
        output = (out.decode() if isinstance(out, bytes) else out) + \
            (err.decode() if isinstance(err, bytes) else err) + f"\nTIMEOUT after {timeout} s\n"
        code = 124
    with log.open("a") as f:
        f.write(f"$ {' '.join(command)}  ({time.monotonic() - start:.0f} s, exit {code})\n")
        f.write(output)
        f.write("\n")
    return code, output


def pytest_summary(output: str) -> str:
    """The closing line of a pytest run ("380 passed, 1 failed in 61.2s")."""
    lines = [line.strip("= ") for line in output.splitlines()
             if re.search(r"\d+ (passed|failed|error)", line) and " in " in line]
    return lines[-1] if lines else (output.strip().splitlines() or ["no output"])[-1][:200]


class Matrix:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        WORK.mkdir(exist_ok=True)

    def venv(self, python: str, interpreter: str, scrapy: str, log: Path) -> Path | None:
        """The cell's environment with the project and Scrapy ``scrapy`` (exact) in it."""
        env_dir = WORK / f"py{python}-scrapy{'.'.join(scrapy.split('.')[:2])}"
        if not (env_dir / "bin" / "python").exists() or self.args.fresh:
            shutil.rmtree(env_dir, ignore_errors=True)
            code, _ = run([interpreter, "-m", "venv", str(env_dir)], log, 300)
            if code != 0:
                return None
        pip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        with _INSTALL_LOCK:
            code, _ = run([*pip, "--upgrade", "pip"], log, 600)
            extras = ".[test,compat]" if self.args.compat else ".[test]"
            code, _ = run([*pip, "-e", extras, f"scrapy=={scrapy}"], log, 1200)
        return env_dir if code == 0 else None

    def installed(self, env_dir: Path) -> str:
        code, output = run([str(env_dir / "bin" / "python"), "-c",
                            "import scrapy, twisted; print(scrapy.__version__, "
                            "twisted.__version__)"], Path(os.devnull), 60)
        scrapy, _, twisted = output.strip().partition(" ")
        return f"Scrapy {scrapy}, Twisted {twisted}" if code == 0 else "?"

    def cell(self, python: str, interpreter: str, minor: str, release: str) -> Cell:
        cell = Cell(python=python, scrapy=minor)
        log = WORK / f"py{python}-scrapy{minor}.log"
        log.write_text("")
        started = time.monotonic()
        env_dir = self.venv(python, interpreter, release, log)
        if env_dir is None:
            cell.steps["install"] = Step(False, "install failed", log=str(log))
            return cell
        cell.installed = self.installed(env_dir)
        py = str(env_dir / "bin" / "python")
        self.step(cell, "fast", [py, "-m", "pytest", "-m", "not slow", "-q"], log, 3600,
                  pytest_summary)
        if not self.args.no_demo:
            self.step(cell, "demo", [py, "example_project/demo.py", "--modes", "idempotent",
                                     "--seed", str(self.args.seed), "--json"], log, 1200,
                      demo_summary)
        if self.args.slow:
            self.step(cell, "slow", [py, "-m", "pytest", "-m", "slow", "-q"], log, 3600,
                      pytest_summary)
        if self.args.compat:
            if (ROOT / "compat" / "run.py").exists():
                self.step(cell, "compat", [py, "compat/run.py"], log, 3600, pytest_summary)
            else:
                cell.steps["compat"] = Step(None, "no compat/run.py in this checkout")
        say(f"[{time.monotonic() - started:5.0f} s] Python {python} x Scrapy {minor} "
            f"({cell.installed}): " + "; ".join(
                f"{name} {'ok' if s.ok else 'FAILED' if s.ok is False else '-'}: {s.summary}"
                for name, s in cell.steps.items()))
        return cell

    def step(self, cell: Cell, name: str, command: list[str], log: Path, timeout: float,
             summarize: object) -> None:
        start = time.monotonic()
        code, output = run(command, log, timeout)
        summary = summarize(output)  # type: ignore[operator]
        cell.steps[name] = Step(code == 0, summary, time.monotonic() - start, str(log))

    def below_range(self, python: str, interpreter: str, release: str) -> Cell:
        """The release below the floor, installed without the package's own requirement:
        ``scrapy crawl`` must stop at once with one message and a non-zero exit."""
        minor = ".".join(release.split(".")[:2])
        cell = Cell(python=python, scrapy=minor)
        log = WORK / f"py{python}-scrapy{minor}.log"
        log.write_text("")
        env_dir = WORK / f"py{python}-scrapy{minor}"
        if not (env_dir / "bin" / "python").exists() or self.args.fresh:
            shutil.rmtree(env_dir, ignore_errors=True)
            run([interpreter, "-m", "venv", str(env_dir)], log, 300)
        pip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        with _INSTALL_LOCK:
            # Scrapy 2.12 imports a private name that w3lib 2.3 removed
            code, _ = run([*pip, f"scrapy=={release}", "itemadapter", "w3lib<2.3"], log, 1200)
            if code == 0:
                code, _ = run([*pip, "--no-deps", "-e", "."], log, 600)
        if code != 0:
            cell.steps["refused"] = Step(False, "install failed", log=str(log))
            return cell
        cell.installed = self.installed(env_dir)
        start = time.monotonic()
        code, output = run([str(env_dir / "bin" / "scrapy"), "crawl", "shop", "-a",
                            "url=http://127.0.0.1:9/", "-s", "LOG_LEVEL=INFO"],
                           log, 300, cwd=ROOT / "example_project")
        refusals = [line for line in output.splitlines()
                    if "scrapy_idempotent" in line and "supports Scrapy" in line]
        # the refusal is logged once as CRITICAL (Twisted then logs the failed crawl's
        # traceback, which ends with the same message)
        critical = [line for line in refusals if "CRITICAL" in line]
        ok = code != 0 and "Crawled" not in output and "ImportError" not in output \
            and len(critical) == 1
        summary = (f"exit {code}: {critical[0].strip()[:160]}" if critical
                   else f"exit {code}, no refusal message")
        cell.steps["refused"] = Step(ok, summary, time.monotonic() - start, str(log))
        say(f"Python {python} x Scrapy {minor} ({cell.installed}): refused "
            f"{'ok' if ok else 'FAILED'}: {summary}")
        return cell


def demo_summary(output: str) -> str:
    start = output.find("{")
    try:
        data = json.loads(output[start:output.rfind("}") + 1])
    except ValueError:
        return (output.strip().splitlines() or ["no output"])[-1][:200]
    if data.get("error"):
        return f"error: {data['error']}"[:200]
    result = next(r for r in data["results"] if r["mode"] == "idempotent")
    verdict = data["verdict"] or {}
    return (f"{'PASS' if verdict.get('pass') else 'FAIL'}: {result['kills']} kills, "
            f"{result['correct']}/{result['products']} correct, {result['rows']} rows, "
            f"{result['requests']} requests (allowed {verdict.get('allowed_requests')})")


def table(cells: list[Cell], pythons: list[str], minors: list[str]) -> str:
    """Markdown: one row per Scrapy release, one column per Python."""
    by = {(c.scrapy, c.python): c for c in cells}
    lines = ["| Scrapy | " + " | ".join(f"Python {p}" for p in pythons) + " |",
             "|---|" + "---|" * len(pythons)]
    for minor in minors:
        row = []
        for python in pythons:
            cell = by.get((minor, python))
            if cell is None:
                row.append("not run")
                continue
            parts = []
            for name, step in cell.steps.items():
                mark = "pass" if step.ok else "FAIL" if step.ok is False else "-"
                detail = ", ".join(re.findall(r"\d+ (?:passed|failed|errors?|xfailed)",
                                              step.summary)) if name != "demo" else ""
                if name == "demo":
                    m = re.search(r"(\d+)/(\d+) correct.*?(\d+) requests \(allowed (\d+)\)",
                                  step.summary)
                    detail = f"{m[1]} correct, {m[3]}/{m[4]} requests" if m else ""
                parts.append(f"{name} {mark}" + (f" ({detail})" if detail else ""))
            row.append("; ".join(parts))
        lines.append(f"| {minor} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scrapy", nargs="+", metavar="X.Y",
                        help="minor releases (default: setup.cfg's floor to the newest)")
    parser.add_argument("--python", nargs="+", metavar="3.N",
                        help=f"Python versions (default: those of {', '.join(PYTHONS)} found)")
    parser.add_argument("--jobs", type=int, default=2, help="cells run at once (2)")
    parser.add_argument("--no-demo", action="store_true", help="skip the demo")
    parser.add_argument("--slow", action="store_true", help="also the slow (kill) tests")
    parser.add_argument("--compat", action="store_true",
                        help="also Scrapy's own test suite with the add-on (compat/run.py)")
    parser.add_argument("--no-below", action="store_true",
                        help="skip the check that the release below the range is refused")
    parser.add_argument("--seed", type=int, default=11, help="demo kill seed (11)")
    parser.add_argument("--fresh", action="store_true", help="recreate the environments")
    args = parser.parse_args(argv)

    floor = scrapy_floor()
    releases = newest_patches(published_releases(sys.executable))
    supported = sorted((m for m in releases if _key(m) >= floor), key=_key)
    minors = args.scrapy or supported
    unknown = [m for m in minors if m not in releases]
    if unknown:
        sys.exit(f"no such Scrapy release: {', '.join(unknown)}")
    pythons = []
    interpreters = {}
    for version in args.python or PYTHONS:
        found = find_python(version)
        if found is None:
            say(f"Python {version}: not found, skipped")
            continue
        pythons.append(version)
        interpreters[version] = found
    if not pythons:
        sys.exit("no Python interpreter found")
    say(f"Scrapy {', '.join(f'{m} ({releases[m]})' for m in minors)} x Python "
        f"{', '.join(pythons)}; logs in {WORK}")

    matrix = Matrix(args)
    started = time.monotonic()
    cells: list[Cell] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(matrix.cell, python, interpreters[python], minor,
                               releases[minor])
                   for minor in minors for python in pythons]
        below = [m for m in releases if _key(m) < floor]
        if not args.no_below and below and not args.scrapy:
            newest_below = max(below, key=_key)
            python = "3.11" if "3.11" in pythons else pythons[0]
            futures.append(pool.submit(matrix.below_range, python, interpreters[python],
                                       releases[newest_below]))
        cells = [f.result() for f in futures]
    minutes = (time.monotonic() - started) / 60
    shown = [m for m in sorted({c.scrapy for c in cells}, key=_key)]
    text = table(cells, pythons, shown)
    say(f"\n{text}\n\n{sum(c.ok for c in cells)} of {len(cells)} cells passed in "
        f"{minutes:.0f} min")
    (WORK / "results.md").write_text(text + "\n")
    (WORK / "results.json").write_text(json.dumps(
        [{**asdict(c), "ok": c.ok} for c in cells], indent=2) + "\n")
    return 0 if all(c.ok for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
