"""The docs' own Sphinx extension: the ``setting`` cross-reference type (targets and
cross-reference roles, as in Scrapy's docs), and the ``idempotent-settings`` directive, which
renders the settings reference from
``scrapy_idempotent.default_settings.SETTING_DEFINITIONS``: a setting is documented exactly
when it is defined.

:func:`settings_reference` is plain Python (no Sphinx), so the tests check what it renders.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Any

from scrapy_idempotent.default_settings import SETTING_DEFINITIONS, SETTING_SECTIONS, Setting

if TYPE_CHECKING:
    from docutils.nodes import Node
    from sphinx.application import Sphinx

#: Underline characters: sections of the reference, then one setting.
SECTION_RULE, SETTING_RULE = "=", "-"


def _default(setting: Setting) -> str:
    return setting.default_text or f"``{setting.default!r}``"


def setting_rst(setting: Setting) -> list[str]:
    """One setting as reStructuredText: its target, heading, example, type, default, text."""
    return [
        f".. setting:: {setting.name}",
        "",
        setting.name,
        SETTING_RULE * len(setting.name),
        "",
        f"Example: ``{setting.name} = {setting.example}``",
        "",
        f"Type: {setting.type}. Default: {_default(setting)}."
        + (f" Allowed: {setting.allowed}." if setting.allowed else ""),
        "",
        *textwrap.dedent(setting.doc).strip("\n").splitlines(),
        "",
    ]


def settings_reference(heading_rule: str = SECTION_RULE) -> list[str]:
    """Every defined setting, grouped by :data:`SETTING_SECTIONS` in their order, as
    reStructuredText lines. A setting of an unknown section raises ``ValueError``."""
    unknown = {s.name: s.section for s in SETTING_DEFINITIONS}.items()
    bad = {name: section for name, section in unknown if section not in SETTING_SECTIONS}
    if bad:
        raise ValueError(f"settings of unknown sections (see SETTING_SECTIONS): {bad}")
    lines: list[str] = []
    for section in SETTING_SECTIONS:
        members = [s for s in SETTING_DEFINITIONS if s.section == section]
        if not members:
            continue
        lines += [section, heading_rule * len(section), ""]
        for setting in members:
            lines += setting_rst(setting)
    return lines


def setup(app: Sphinx) -> dict[str, Any]:
    from docutils.statemachine import StringList
    from sphinx.util.docutils import SphinxDirective
    from sphinx.util.nodes import nested_parse_with_titles

    class SettingsDirective(SphinxDirective):
        """``.. idempotent-settings::``: the generated settings reference."""

        has_content = False

        def run(self) -> list[Node]:
            from docutils import nodes

            source = "scrapy_idempotent.config.SETTING_DEFINITIONS"
            content = StringList(settings_reference(), source=source)
            container = nodes.section()
            container.document = self.state.document
            nested_parse_with_titles(self.state, content, container)
            self.env.note_dependency("../scrapy_idempotent/config.py")
            return list(container.children)

    app.add_crossref_type("setting", "setting", indextemplate="pair: %s; setting")
    app.add_directive("idempotent-settings", SettingsDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
