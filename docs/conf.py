"""Sphinx configuration of the scrapy_idempotent docs (``sphinx-build -W docs docs/_build``)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))

from scrapy_idempotent import __version__  # noqa: E402

project = "scrapy_idempotent"
author = "the scrapy_idempotent authors"
copyright = "the scrapy_idempotent authors"
version = release = __version__

extensions = ["idempotent_docs"]
exclude_patterns = ["_build"]
# every cross-reference must resolve (a :setting: of a setting that does not exist warns, and
# the CI build turns warnings into errors)
nitpicky = True
default_role = "literal"
# a bare :: literal block is shown as written (commands, log lines); code-block names its language
highlight_language = "none"

html_theme = "furo"
html_title = f"scrapy_idempotent {release}"
