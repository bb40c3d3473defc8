"""A real scrapyd for the tests: started on 127.0.0.1 on a free port, with its own
configuration file and temporary directories (``max_proc = 1``), from a working directory
without a ``scrapy.cfg`` (like a real deployment); ``example_project`` built into an egg with
setuptools as ``scrapyd-deploy`` does; a small client of its JSON API; the stats of a job's
log."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

EXAMPLE_PROJECT = Path(__file__).resolve().parents[2] / "example_project"
PROJECT = "shop"
SPIDER = "shop"

SCRAPYD_START_TIMEOUT = 30.0
JOB_START_TIMEOUT = 30.0
JOB_TIMEOUT = 60.0
HTTP_TIMEOUT = 10.0


# --- waiting -------------------------------------------------------------------------------


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- the egg -------------------------------------------------------------------------------

SETUP_PY = """\
from setuptools import find_packages, setup

setup(
    name="shop",
    version="1.0",
    packages=find_packages(),
    entry_points={"scrapy": ["settings = shop.settings"]},
)
"""


def build_egg(workdir: Path) -> Path:
    """Build ``example_project`` into an egg, as ``scrapyd-deploy`` does: a ``setup.py`` with
    the ``scrapy.settings`` entry point, ``setup.py bdist_egg``; in a copy of the project."""
    source = workdir / "project"
    shutil.copytree(
        EXAMPLE_PROJECT, source,
        ignore=shutil.ignore_patterns(".scrapy", "__pycache__", "*.sqlite3*", "*.egg-info",
                                      "build", "dist"),
    )
    (source / "setup.py").write_text(SETUP_PY)
    out = workdir / "egg"
    result = subprocess.run(
        [sys.executable, "setup.py", "-q", "bdist_egg", "--dist-dir", str(out)],
        cwd=source, capture_output=True, text=True, timeout=120, check=False,
    )
    eggs = sorted(out.glob("*.egg")) if out.is_dir() else []
    if result.returncode != 0 or len(eggs) != 1:
        pytest.fail(f"building the egg failed ({result.returncode}):\n{result.stdout}\n"
                    f"{result.stderr}")
    return eggs[0]


# --- scrapyd -------------------------------------------------------------------------------


def multipart(fields: Mapping[str, str], files: Mapping[str, tuple[str, bytes]]
              ) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts: list[bytes] = []
    for name, value in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
                     f"{value}\r\n".encode())
    for name, (filename, content) in files.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
                     f'filename="{filename}"\r\nContent-Type: application/octet-stream\r\n\r\n'
                     .encode() + content + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


class Scrapyd:
    """A scrapyd process of this test and a small client of its JSON API."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.logs_dir = root / "logs"
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._output: Any = None
        self.pids: set[int] = set()  # job processes seen, to kill leftovers at teardown

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle --

    def write_config(self) -> None:
        (self.root / "scrapyd.conf").write_text(
            "[scrapyd]\n"
            "bind_address = 127.0.0.1\n"
            f"http_port = {self.port}\n"
            f"eggs_dir = {self.root / 'eggs'}\n"
            f"logs_dir = {self.logs_dir}\n"
            "items_dir =\n"
            f"dbs_dir = {self.root / 'dbs'}\n"
            "jobs_to_keep = 20\n"
            "max_proc = 1\n"
            "poll_interval = 0.1\n"
        )

    def start(self) -> None:
        """Start scrapyd on a free port (a few tries: the port is free when picked, not
        necessarily when scrapyd binds it) and wait until it answers."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SCRAPY_", "SCRAPYD_"))}
        # No ~/.scrapyd.conf or ~/.scrapy.cfg of the machine running the tests.
        env["HOME"] = str(self.root)
        for attempt in range(3):
            self.port = free_port()
            self.write_config()
            self._output = open(self.root / f"scrapyd-{attempt}.out", "wb")  # noqa: SIM115
            # Its own session: scrapyd's job processes join its process group, so the
            # teardown can end all of them with one signal to the group.
            self.process = subprocess.Popen(
                [sys.executable, "-m", "scrapyd"], cwd=self.root, env=env,
                stdout=self._output, stderr=subprocess.STDOUT, start_new_session=True,
            )
            deadline = time.monotonic() + SCRAPYD_START_TIMEOUT
            while time.monotonic() < deadline and self.process.poll() is None:
                try:
                    if self.get("daemonstatus.json")["status"] == "ok":
                        return
                except OSError:
                    pass
                time.sleep(0.1)
            self.stop()
        output = (self.root / "scrapyd-2.out").read_text(errors="replace")
        pytest.fail(f"scrapyd did not start:\n{output}")

    def stop(self) -> None:
        """Kill every job process still running, then scrapyd and its process group."""
        if self.process is not None:
            try:
                running = self.get("listjobs.json")["running"]
            except (OSError, ValueError, KeyError, AssertionError):
                running = []
            self.pids.update(job["pid"] for job in running if job.get("pid"))
        for pid in self.pids:
            if is_job_process(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
            self.process = None
        if self._output is not None:
            self._output.close()
            self._output = None

    # -- API --

    def _call(self, request: urllib.request.Request) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:
                payload: dict[str, Any] = json.load(response)
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            exc.close()
            raise AssertionError(f"scrapyd answered {exc.code}: {body}") from None
        assert payload.get("status") == "ok", payload
        return payload

    def get(self, endpoint: str, **params: str) -> dict[str, Any]:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        return self._call(urllib.request.Request(f"{self.url}/{endpoint}{query}"))

    def post(self, endpoint: str, fields: list[tuple[str, str]]) -> dict[str, Any]:
        data = urllib.parse.urlencode(fields).encode()
        return self._call(urllib.request.Request(f"{self.url}/{endpoint}", data=data))

    def add_version(self, egg: Path, version: str = "1") -> dict[str, Any]:
        body, content_type = multipart({"project": PROJECT, "version": version},
                                       {"egg": (egg.name, egg.read_bytes())})
        request = urllib.request.Request(f"{self.url}/addversion.json", data=body,
                                         headers={"Content-Type": content_type})
        return self._call(request)

    def schedule(self, settings: Mapping[str, Any], **spider_args: str) -> str:
        fields = [("project", PROJECT), ("spider", SPIDER)]
        fields += [("setting", f"{name}={value}") for name, value in settings.items()]
        fields += list(spider_args.items())
        return str(self.post("schedule.json", fields)["jobid"])

    def cancel(self, job: str, signal_name: str | None = None) -> str | None:
        fields = [("project", PROJECT), ("job", job)]
        if signal_name is not None:
            fields.append(("signal", signal_name))
        prevstate: str | None = self.post("cancel.json", fields)["prevstate"]
        return prevstate

    def state(self, job: str) -> str | None:
        """``pending``, ``running`` or ``finished`` (from ``listjobs.json``); None if unknown."""
        jobs = self.get("listjobs.json", project=PROJECT)
        for state in ("finished", "running", "pending"):
            if any(entry["id"] == job for entry in jobs[state]):
                return state
        return None

    def running_pid(self, job: str) -> int | None:
        for entry in self.get("listjobs.json", project=PROJECT)["running"]:
            if entry["id"] == job and entry.get("pid"):
                self.pids.add(entry["pid"])
                return int(entry["pid"])
        return None

    def wait_running(self, job: str) -> int:
        def started() -> int | None:
            if self.state(job) == "finished":
                pytest.fail(f"job {job} ended before it was seen running:\n{self.log(job)}")
            return self.running_pid(job)

        return int(wait_until(started, JOB_START_TIMEOUT, f"job {job} to start"))

    def wait_finished(self, job: str, timeout: float = JOB_TIMEOUT) -> None:
        wait_until(lambda: self.state(job) == "finished", timeout, f"job {job} to finish")

    def clear_jobs(self) -> None:
        """Drop pending jobs, SIGKILL running ones, and wait until none runs."""
        jobs = self.get("listjobs.json", project=PROJECT)
        for entry in jobs["pending"]:
            self.cancel(entry["id"])
        for entry in jobs["running"]:
            if entry.get("pid") and is_job_process(entry["pid"]):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(entry["pid"], signal.SIGKILL)
        wait_until(lambda: not self.get("listjobs.json", project=PROJECT)["running"],
                   JOB_TIMEOUT, "the jobs of the test to end")

    def launcher_lines(self, job: str) -> str:
        """What scrapyd logged about ``job``: its process started, and how it ended."""
        if self._output is None:
            return "(scrapyd is not running)"
        self._output.flush()
        lines = Path(self._output.name).read_text(errors="replace").splitlines()
        return "\n".join(line for line in lines if job in line)

    def log(self, job: str) -> str:
        path = self.logs_dir / PROJECT / SPIDER / f"{job}.log"
        return path.read_text(errors="replace") if path.is_file() else f"(no log at {path})"


def is_job_process(pid: int) -> bool:
    """True if ``pid`` is still a scrapyd job process (not a pid reused by something else)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: trust the pid, it came from scrapyd a moment ago
        return True
    return b"scrapyd.runner" in cmdline


# --- reading results -----------------------------------------------------------------------


def stat(log: str, name: str) -> Any:
    """A value of the stats dump at the end of a Scrapy log (None when absent)."""
    match = re.search(rf"'{re.escape(name)}': ([^,\n]+)", log)
    return None if match is None else ast.literal_eval(match.group(1))
