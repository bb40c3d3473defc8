"""The sample outputs in the docs are real: the steps the docs describe are run here (a crawl
of the example shop whose products 3, 7 and 42 answer 503, ``failed``, ``retry``, a second crawl
that fetches only those three, ``status``, ``export``, ``check``; a spider that blanks every
tenth SKU for ``rejects`` and ``retry --rejects``) and each command's output is compared with
its sample, ``docs/samples/<name>.txt``, times, paths and the port aside.

``IDEMPOTENT_UPDATE_SAMPLES=1`` writes the samples from this run instead (paths and port shown
as in the docs: ``/tmp/shop/...``, port 8000)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import scrapy
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, run_crawl
from helpers.commands import idempotent
from helpers.shop_spiders import NATURAL_KEYS, PartlyBrokenSpider
from shop.spiders.shop import ShopSpider

SAMPLES = Path(__file__).resolve().parent.parent / "docs" / "samples"
UPDATE = os.environ.get("IDEMPOTENT_UPDATE_SAMPLES") == "1"
#: How the docs show the crawl's database and the shop (the samples are of a SQLite crawl's
#: output, so the tests that write them crawl on SQLite).
SHOWN_DB = "/tmp/shop/.scrapy/idempotent/shop.sqlite3"
SHOWN_SITE = "http://127.0.0.1:8000"
WORKER = re.compile(r"\S+:\d+:\d+:[0-9a-f]+:[0-9a-f]+")
TIME = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(\.\d+)?Z?")


def shown(text: str, db: Path, site: LocalSite) -> str:
    """``text`` with this run's database path and site address as the docs show them."""
    return text.replace(str(db), SHOWN_DB).replace(site.url, SHOWN_SITE)


def comparable(text: str) -> list[str]:
    """The lines, with times as ``<time>`` and runs of spaces as one (column widths follow
    the lengths of paths and times), sorted: rows that finished within one second may be
    listed in either order."""
    return sorted(re.sub(r"\s+", " ", TIME.sub("<time>", line)).strip()
                  for line in text.strip("\n").splitlines())


def check_sample(name: str, command: str, output: str, *, loose: bool = False) -> None:
    """``output`` of ``command`` (as the docs show it: ``$ scrapy idempotent ...``) is the
    sample ``name``, or becomes it with IDEMPOTENT_UPDATE_SAMPLES=1; ``loose``: numbers and
    worker ids aside too."""
    sample = SAMPLES / f"{name}.txt"
    text = f"$ {command}\n{output.rstrip()}\n"
    if UPDATE:
        sample.write_text(text, encoding="utf-8")
        return
    assert sample.is_file(), f"no sample {sample}: run with IDEMPOTENT_UPDATE_SAMPLES=1"
    expected = sample.read_text(encoding="utf-8")
    if loose:
        text, expected = (re.sub(r"\d+", "<n>", WORKER.sub("<worker>", t))
                          for t in (text, expected))
    assert comparable(text) == comparable(expected), (
        f"docs/samples/{name}.txt no longer matches the output; if the change is right, run "
        "this test with IDEMPOTENT_UPDATE_SAMPLES=1 and review the diff")


def test_every_sample_is_shown_and_checked() -> None:
    """Each sample file is included by a page, and this module checks each."""
    pages = "".join(p.read_text(encoding="utf-8") for p in SAMPLES.parent.glob("*.rst"))
    source = Path(__file__).read_text(encoding="utf-8")
    for sample in sorted(SAMPLES.glob("*.txt")):
        assert f"literalinclude:: samples/{sample.name}" in pages, f"{sample.name} not shown"
        assert f'check_sample("{sample.stem}"' in source, f"{sample.name} not checked"


@deferred_f_from_coro_f
async def test_the_command_samples(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    db = tmp_path / "shop.sqlite3"
    # one request at a time (one order of the rows), Scrapy's retries on (the 503s)
    settings = crawl_settings(db, **NATURAL_KEYS, CONCURRENT_REQUESTS=1, RETRY_ENABLED=True)
    site = LocalSite(products_failing={3, 7, 42}).start()
    request.addfinalizer(site.stop)
    await run_crawl(ShopSpider, settings, url=site.url)

    def run(*args: str) -> str:
        code, out, err = idempotent(*args, "--db", str(db))
        assert code in (0, 1), err
        return shown(out, db, site)

    check_sample("failed", "scrapy idempotent failed shop", run("failed"))
    check_sample("retry", "scrapy idempotent retry shop", run("retry"))
    site.set_products_failing(())
    await run_crawl(ShopSpider, settings, url=site.url)
    check_sample("status", "scrapy idempotent status shop", run("status"))
    csv_path = tmp_path / "products.csv"
    exported = run("export", "-o", str(csv_path)).replace(str(csv_path), "products.csv")
    head = "".join(csv_path.read_text(encoding="utf-8").splitlines(keepends=True)[:3])
    check_sample("export", "scrapy idempotent export shop -o products.csv",
                 f"{exported}$ head -3 products.csv\n{shown(head, db, site)}")
    check_sample("check", "scrapy idempotent check shop", run("check"))


@pytest.mark.skipif(
    scrapy.version_info < (2, 19),
    reason="the sample is of Scrapy 2.19's crawl order; older releases hand the products out "
           "in another order, so other pages are the latest rejected")
@deferred_f_from_coro_f
async def test_the_rejects_samples(tmp_path: Path) -> None:
    db = tmp_path / "shop.sqlite3"
    settings = crawl_settings(db, **NATURAL_KEYS, CONCURRENT_REQUESTS=1)  # one order
    with LocalSite() as site:
        PartlyBrokenSpider.broken = True
        try:
            await run_crawl(PartlyBrokenSpider, settings, url=site.url)
        finally:
            PartlyBrokenSpider.broken = False

        def run(*args: str) -> str:
            code, out, err = idempotent(*args, "--db", str(db))
            assert code == 0, err
            return shown(out, db, site)

        check_sample("rejects", "scrapy idempotent rejects shop --limit 2",
                     run("rejects", "--limit", "2"))
        check_sample("retry-rejects", "scrapy idempotent retry shop --rejects",
                     run("retry", "--rejects"))


#: A log line in a page's literal block: ``[logger] LEVEL: message`` or ``LEVEL: message``.
LOG_LINE = re.compile(
    r"^\s+(?:\S+ \S+ )?(?:\[[\w.]+\] )?(DEBUG|INFO|WARNING|ERROR|CRITICAL): (.*)$")
LEVELS = {"debug", "info", "warning", "error", "critical", "exception"}


def log_formats() -> list[re.Pattern[str]]:
    """The message formats of the package's logger calls, as patterns (a ``%d`` stands for
    any text, a ``%s`` for any text or none)."""
    import ast

    patterns = []
    for path in sorted((SAMPLES.parent.parent / "scrapy_idempotent").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEVELS and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                fields = re.split(r"(%[-#0 +]*\d*(?:\.\d+)?[sdrfgi])", node.args[0].value)
                patterns.append(re.compile("".join(
                    re.escape(part) if n % 2 == 0 else ".*" if part == "%s" else ".+"
                    for n, part in enumerate(fields)), re.DOTALL))
    return patterns


def logged_samples() -> dict[str, str]:
    """Every log message shown in a literal block of the docs (a message wrapped over several
    lines joined again), with where."""
    found: dict[str, str] = {}
    for page in sorted(SAMPLES.parent.glob("*.rst")):
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            match = LOG_LINE.match(line)
            if not match:
                continue
            message = match.group(2)
            for more in lines[number + 1:]:
                if not more.strip() or LOG_LINE.match(more) or not more.startswith("   "):
                    break
                message += " " + more.strip()
            found[message] = f"docs/{page.name}:{number + 1}"
    return found


def test_the_logged_samples_are_messages_the_package_logs() -> None:
    samples = logged_samples()
    assert any(m.startswith("Frontier: ") for m in samples)  # the progress line is seen
    formats = log_formats()
    unknown = {where: message for message, where in samples.items()
               if not any(f.fullmatch(message) for f in formats)}
    assert not unknown, f"log lines in the docs that the package does not log: {unknown}"


def test_the_config_error_sample() -> None:
    """The CRITICAL line of a bad setting, as docs/troubleshooting.rst shows it."""
    from scrapy.settings import Settings

    from scrapy_idempotent import ConfigError, config

    with pytest.raises(ConfigError) as error:
        config._boolean(Settings({"IDEMPOTENT_RESPONSE_JOURNAL": "yes"}),
                        "IDEMPOTENT_RESPONSE_JOURNAL")
    line = f"CRITICAL: scrapy_idempotent: {error.value}; the crawl was not started"
    page = (SAMPLES.parent / "troubleshooting.rst").read_text(encoding="utf-8")
    assert f"   {line}\n" in page


@pytest.mark.slow
def test_the_check_sample_after_a_kill(tmp_path: Path) -> None:
    """``check`` after a SIGKILL: the dead crawl's leases heal by themselves (their count and
    the worker id vary from run to run)."""
    import signal
    import time

    from crawling import start_shop_crawl

    db = tmp_path / "shop.sqlite3"
    with LocalSite(delay=0.02) as site:
        crawl = start_shop_crawl(site.url, db, tmp_path / "crawl.log")
        deadline = time.monotonic() + 60
        while site.request_count < 40 and time.monotonic() < deadline:
            time.sleep(0.01)  # the kill's moment, not a synchronisation: any moment will do
        os.kill(crawl.pid, signal.SIGKILL)
        crawl.wait()
        code, out, err = idempotent("check", "--db", str(db))
        assert code == 0, err
        check_sample("check-killed", "scrapy idempotent check shop; echo $?",
                     f"{shown(out, db, site)}{code}", loose=True)
