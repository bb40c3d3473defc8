"""The ``scrapy idempotent`` commands run in this process, as a user runs them."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any


def idempotent(*args: str) -> tuple[int, str, str]:
    """``scrapy idempotent ARGS`` in this process, through Scrapy's own command line entry
    (``scrapy.cmdline.execute``). Returns (exit code, stdout, stderr)."""
    from scrapy.cmdline import execute

    out, err = io.StringIO(), io.StringIO()
    code: Any = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            execute(["scrapy", "idempotent", *args])
        except SystemExit as exc:
            code = exc.code
    return int(code or 0), out.getvalue(), err.getvalue()


def idempotent_json(*args: str) -> Any:
    """``scrapy idempotent ARGS --json``, its output parsed (exit code 0 or 1)."""
    code, out, err = idempotent(*args, "--json")
    assert code in (0, 1), err
    return json.loads(out)
