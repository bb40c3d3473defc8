"""Worker identity and liveness (``scrapy_idempotent.workers``): one id format, one parser,
and a worker of this host declared dead only when its process is gone, with real processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from scrapy_idempotent import workers
from scrapy_idempotent.workers import WorkerId, new_worker_id, worker_is_dead, worker_state


def test_a_new_id_parses_back_to_this_process() -> None:
    worker = new_worker_id()
    parsed = WorkerId.parse(worker)
    assert parsed is not None
    assert (parsed.host, parsed.pid) == (socket.gethostname(), os.getpid())
    assert str(parsed) == worker
    assert new_worker_id() != worker  # one per scheduler, even in one process


@pytest.mark.parametrize("text", ["", "host", "host:12", "host:pid:1", "host:-1:5"])
def test_texts_that_are_not_worker_ids(text: str) -> None:
    assert WorkerId.parse(text) is None
    assert worker_state(text) == "unknown"
    assert not worker_is_dead(text)


def test_an_id_without_nonce_written_by_an_older_release() -> None:
    assert WorkerId.parse("h:12:345") == WorkerId("h", 12, "345")
    assert str(WorkerId("h", 12, "345")) == "h:12:345"


def test_a_worker_of_another_host_is_never_dead_here() -> None:
    other = "not-" + socket.gethostname() + ":1:1:abcd"
    assert worker_state(other) == "other host"
    assert not worker_is_dead(other)


def test_a_worker_of_this_process_lives_while_declared() -> None:
    worker = new_worker_id()
    assert worker_state(worker) == "dead"  # no scheduler of that id is open
    workers.declare_live(worker)
    try:
        assert worker_state(worker) == "alive"
    finally:
        workers.forget_live(worker)
    assert worker_is_dead(worker)


def test_a_worker_whose_process_exited_is_dead() -> None:
    code = "from scrapy_idempotent.workers import new_worker_id; print(new_worker_id())"
    worker = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                            text=True).stdout.strip()
    assert worker_state(worker) == "dead"
