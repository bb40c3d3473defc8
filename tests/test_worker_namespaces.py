"""Workers in other PID namespaces (containers sharing a host name: ``--uts=host``, one
``hostname:`` for several replicas): never declared dead from here, whatever their pid looks
like in this namespace; a gone worker of this namespace is, at once. Real processes in real
PID namespaces (``unshare --pid --fork``, which needs root or CAP_SYS_ADMIN)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from local_site import LocalSite

from crawling import EXAMPLE_PROJECT, close_reason, wait_for
from helpers.stored import leases_by_worker, stored_products
from scrapy_idempotent.workers import (
    WorkerId,
    pid_namespace,
    worker_is_dead,
    worker_state,
)
from shop.site import product_html, product_sku

#: A process that prints its worker id and lives until its stdin is closed.
PRINT_ID_AND_WAIT = ("import sys; from scrapy_idempotent.workers import new_worker_id; "
                     "print(new_worker_id(), flush=True); sys.stdin.read()")


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                            "true"], capture_output=True, check=False)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _unshare_works(),
    reason="needs Linux and `unshare --pid --fork --mount-proc` (util-linux; root or "
           "CAP_SYS_ADMIN)")


def in_new_pid_namespace(*command: str, mount_proc: bool = True,
                         **popen: object) -> subprocess.Popen[str]:
    """``command`` as pid 1 of a new PID namespace (with a /proc of its own unless
    ``mount_proc`` is False); killing the returned process kills the namespace."""
    options = ["--mount-proc"] if mount_proc else []
    return subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", *options,
                             *command], text=True, **popen)  # type: ignore[call-overload]


def test_a_live_worker_in_another_pid_namespace_is_not_dead_nor_once_gone() -> None:
    with in_new_pid_namespace(sys.executable, "-c", PRINT_ID_AND_WAIT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) as other:
        assert other.stdout is not None and other.stdin is not None
        worker = other.stdout.readline().strip()
        parsed = WorkerId.parse(worker)
        assert parsed is not None
        # the same host name, pid 1 (in its namespace; here pid 1 is init, another process)
        assert (parsed.host, parsed.pid) == (socket.gethostname(), 1)
        assert parsed.namespace != pid_namespace()
        assert worker_state(worker) == "other namespace"
        assert not worker_is_dead(worker)
        other.stdin.close()
    assert other.returncode == 0
    # gone now, but nothing here can tell: its leases end by expiry
    assert worker_state(worker) == "other namespace"
    assert not worker_is_dead(worker)
    # a worker of this namespace whose process exited is dead
    exited = subprocess.run([sys.executable, "-c", PRINT_ID_AND_WAIT], input="",
                            capture_output=True, text=True, check=True).stdout.strip()
    assert worker_state(exited) == "dead"


def test_ids_of_older_releases_parse_and_are_never_declared_dead() -> None:
    host = socket.gethostname()
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                            capture_output=True, text=True, check=True).stdout.strip()
    for old in (f"{host}:{exited}:1", f"{host}:{exited}:1:0a0b0c0d"):
        parsed = WorkerId.parse(old)
        assert parsed is not None and parsed.namespace == ""
        assert str(parsed) == old
        assert worker_state(old) == "other namespace"  # which namespace is not known
        assert not worker_is_dead(old)


def test_in_a_namespace_without_its_own_proc_pids_are_looked_up_in_the_namespace() -> None:
    """``unshare --pid`` without ``--mount-proc`` (a container given the host's /proc): the
    pids in /proc are of another namespace; liveness is asked of the kernel instead."""
    code = (
        "import json, subprocess, sys\n"
        "from scrapy_idempotent.workers import new_worker_id, worker_state\n"
        f"child = {PRINT_ID_AND_WAIT!r}\n"
        "live = subprocess.Popen([sys.executable, '-c', child], stdin=subprocess.PIPE,\n"
        "                        stdout=subprocess.PIPE, text=True)\n"
        "live_id = live.stdout.readline().strip()\n"
        "dead_id = subprocess.run([sys.executable, '-c', child], input='', text=True,\n"
        "                         capture_output=True, check=True).stdout.strip()\n"
        "print(json.dumps([worker_state(live_id), worker_state(dead_id),\n"
        "                  worker_state(new_worker_id())]))\n"
        "live.stdin.close(); live.wait()\n"
    )
    other = in_new_pid_namespace(sys.executable, "-c", code, mount_proc=False,
                                 stdout=subprocess.PIPE)
    out, _ = other.communicate(timeout=120)
    assert other.returncode == 0
    assert json.loads(out) == ["alive", "dead", "dead"]


# -- crawls -------------------------------------------------------------------------------------

PRODUCTS = 10


def held_shop() -> LocalSite:
    """One listing page of 10 products, each product page held until the site is released."""
    site = LocalSite(listing_pages=1, products_per_page=PRODUCTS)
    for n in range(1, PRODUCTS + 1):
        site.add(f"/product/{product_sku(n)}", product_html(n, 0), held=True)
    return site


def shop_command(site: LocalSite, db: str, log: Path, *settings: str) -> list[str]:
    command = [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"url={site.url}",
               "-s", f"IDEMPOTENT_DATABASE={db}", "-s", f"LOG_FILE={log}"]
    for setting in settings:
        command += ["-s", setting]
    return command


def crawl(command: list[str], *, other_namespace: bool = False) -> subprocess.Popen[str]:
    if other_namespace:
        return in_new_pid_namespace(*command, cwd=EXAMPLE_PROJECT, stdin=subprocess.DEVNULL)
    return subprocess.Popen(command, cwd=EXAMPLE_PROJECT, stdin=subprocess.DEVNULL, text=True)


def all_products_leased_and_held(db: str, site: LocalSite) -> bool:
    return (list(leases_by_worker(db).values()) == [PRODUCTS]
            and site.in_flight == PRODUCTS)


def reclaimed_at_open(log: Path) -> int:
    """The leases of dead workers the crawl of ``log`` took back when it opened."""
    match = re.search(r"\((\d+) reclaimed from dead workers\)", log.read_text())
    assert match, log.read_text()
    return int(match.group(1))


def wait_for_open(log: Path, process: subprocess.Popen[str]) -> None:
    wait_for(lambda: (log.exists() and "reclaimed from dead workers" in log.read_text())
             or process.poll() is not None, 120, "the crawl to open", log)


@pytest.mark.slow
def test_a_crawl_does_not_take_the_leases_of_a_live_crawl_in_another_pid_namespace(
        tmp_path: Path, crawl_database: str) -> None:
    db = crawl_database
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    with held_shop() as site:
        a = crawl(shop_command(site, db, log_a), other_namespace=True)
        b = None
        try:
            # every product page is in flight in the other namespace's crawl, held
            wait_for(lambda: all_products_leased_and_held(db, site) or a.poll() is not None,
                     120, "the products leased and in flight", log_a)
            [(worker_a, leased)] = leases_by_worker(db).items()
            assert leased == PRODUCTS
            assert WorkerId.parse(worker_a).pid == 1  # type: ignore[union-attr]
            b = crawl(shop_command(site, db, log_b))
            wait_for_open(log_b, b)
            assert reclaimed_at_open(log_b) == 0
            status = subprocess.run(
                [sys.executable, "-m", "scrapy", "idempotent", "status", "--db", db,
                 "--json"], capture_output=True, text=True, check=True, timeout=120)
            [lease] = json.loads(status.stdout)["leases"]
            assert (lease["worker"], lease["worker_state"]) == (worker_a, "other namespace")
            # b waits for a's leases (checking for dead workers meanwhile) until a is done
            assert leases_by_worker(db) == {worker_a: PRODUCTS}
            site.release()
            assert a.wait(timeout=300) == 0
            assert b.wait(timeout=300) == 0
        finally:
            for process in (a, b):
                if process is not None and process.poll() is None:
                    process.kill()
                    process.wait()
        by_path = site.counts_by_path()
    assert (close_reason(log_a), close_reason(log_b)) == ("finished", "finished")
    assert "leases of dead workers" not in log_b.read_text()
    assert "leases_lost" not in log_a.read_text()
    assert len(stored_products(db)) == PRODUCTS
    # each product fetched once: by the crawl that leased it, not again by the other
    assert {path: count for path, count in by_path.items() if "/product/" in path} == {
        f"/product/{product_sku(n)}": 1 for n in range(1, PRODUCTS + 1)}


@pytest.mark.slow
def test_leases_of_a_killed_crawl_come_back_at_once_in_its_namespace_by_expiry_elsewhere(
        tmp_path: Path, crawl_database: str, second_crawl_database: str) -> None:
    def killed_with_leases(db: str, name: str, other_namespace: bool, *settings: str) -> str:
        """A crawl killed while holding the leases of every product; its worker."""
        log = tmp_path / f"{name}.log"
        with held_shop() as site:
            process = crawl(shop_command(site, db, log, *settings),
                            other_namespace=other_namespace)
            try:
                wait_for(lambda: all_products_leased_and_held(db, site)
                         or process.poll() is not None, 120,
                         "the products leased and in flight", log)
            finally:
                process.send_signal(signal.SIGKILL)
                process.wait()
        [(worker, leased)] = leases_by_worker(db).items()
        assert leased == PRODUCTS
        return worker

    def resume(db: str, name: str) -> Path:
        log = tmp_path / f"{name}.log"
        with LocalSite(listing_pages=1, products_per_page=PRODUCTS) as site:
            process = crawl(shop_command(site, db, log))
            assert process.wait(timeout=300) == 0
        assert close_reason(log) == "finished"
        return log

    # killed in this namespace, leases of 600 s: taken back as the next crawl opens
    here = crawl_database
    killed_with_leases(here, "here", False, "IDEMPOTENT_LEASE_SECONDS=600")
    assert reclaimed_at_open(resume(here, "after_here")) == PRODUCTS
    assert leases_by_worker(here) == {}
    assert len(stored_products(here)) == PRODUCTS

    # killed in another namespace: nothing here can tell it is gone; its leases (of 2 s)
    # come back when they expire, and the next crawl finishes with them
    elsewhere = second_crawl_database
    worker = killed_with_leases(elsewhere, "elsewhere", True, "IDEMPOTENT_LEASE_SECONDS=2")
    assert worker_state(worker) == "other namespace"
    assert reclaimed_at_open(resume(elsewhere, "after_elsewhere")) == 0
    assert leases_by_worker(elsewhere) == {}
    assert len(stored_products(elsewhere)) == PRODUCTS
