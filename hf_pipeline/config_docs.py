"""The configuration reference, the env table and ``--help``'s epilog, made from config.py.

Each fact is defined once in :mod:`hf_pipeline.config` (a field's default, bounds and
meaning in its ``dataclasses.field``; every environment variable in ``ENV_VARS``) and
rendered here. ``docs/configuration.md`` holds the rendered Markdown between markers;
``tests/test_config.py`` fails when the page drifts. Regenerate it with::

    python -m hf_pipeline.config_docs --write-docs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

from hf_pipeline.config import ENV_VARS, Config, EnvVar, field_choices, section_type

__all__ = [
    "DOCS_PAGE",
    "config_reference_markdown",
    "env_help",
    "env_table_markdown",
    "render_docs_page",
    "write_docs",
]

#: The page holding both generated blocks.
DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

_BLOCK = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[a-z ]+) -->\n)(?P<body>.*?)(<!-- END GENERATED -->)",
    re.S,
)


#: A Sphinx cross-reference in a docstring (``:func:`load_config```) becomes code.
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def _cell(text: str) -> str:
    """Text fit for a Markdown table cell (a ``|`` would end the cell)."""
    return text.replace("|", "\\|").replace("\n", " ")


def _type_text(field: dataclasses.Field) -> str:
    """``int``, ``str``, or a closed value set as ``"a" | "b"``."""
    choices = field_choices(field)
    if choices is not None:
        return " | ".join(f"`{json.dumps(v)}`" for v in choices)
    return f"`{field.type if isinstance(field.type, str) else field.type.__name__}`"


def _default_text(value: object) -> str:
    """A default as it is written in YAML."""
    return f"`{json.dumps(value)}`"


def config_reference_markdown() -> str:
    """Every section and field of :class:`~hf_pipeline.config.Config` as Markdown tables:
    type, default, bounds (where declared) and meaning."""
    lines: list[str] = []

    def section(cls: type, dotted: str, title: str) -> None:
        doc = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
        doc = _ROLE.sub(r"`\1`", doc).replace("``", "`")
        lines.extend([f"### {title}", "", doc, ""])
        lines.append("| field | type | default | bounds | meaning |")
        lines.append("|---|---|---|---|---|")
        subsections = []
        for f in dataclasses.fields(cls):
            sub = section_type(f)
            key = f"{dotted}{f.name}"
            if sub is not None:
                subsections.append((sub, key))
                cells = ["section", "", "", f"{f.metadata['help']} (below)"]
            else:
                default = f.default
                bounds = f.metadata.get("bounds")
                cells = [
                    _type_text(f),
                    _default_text(default),
                    bounds.text() if bounds is not None else "",
                    f.metadata["help"],
                ]
            lines.append(f"| `{key}` | " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
        for sub, key in subsections:
            section(sub, f"{key}.", f"`{key}`")

    section(Config, "", "Top level")
    return "\n".join(lines)


def _env_default(var: EnvVar) -> str:
    """What applies while ``var`` is unset: the config file's value of its field, else
    the field's built-in default (read from the field: defined once)."""
    if not var.field:
        return var.default
    section, name = var.field.split(".")
    cls = type(getattr(Config(), section))
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    text = f"the config file's, else `{json.dumps(field.default)}`"
    bounds = field.metadata.get("bounds")
    if bounds is not None and bounds.note.startswith(f" ({field.default}:"):
        text += bounds.note  # what the default means, e.g. " (0: min(8, CPUs))"
    return text


def env_table_markdown() -> str:
    """``ENV_VARS`` as a Markdown table."""
    lines = [
        "| environment variable | config field | meaning | default when unset |",
        "|---|---|---|---|",
    ]
    for var in ENV_VARS:
        names = ", ".join(f"`{n.strip()}`" for n in var.name.split(","))
        field = f"`{var.field}`" if var.field else ""
        cells = [names, field, var.meaning, _env_default(var)]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def env_help() -> str:
    """``ENV_VARS`` as the epilog of the scripts' ``--help`` (plain text)."""
    lines = ["environment (override the config file; --set overrides both):"]
    for var in ENV_VARS:
        what = f"{var.field}: {var.meaning}" if var.field else var.meaning
        if _env_default(var):
            what += f" (unset: {_env_default(var)})"
        what = what.replace("`", "")
        if len(var.name) <= 27:
            lines.append(f"  {var.name:<27} {what}")
        else:  # a group of names: on its own line, the meaning below it
            lines.extend([f"  {var.name}", f"  {'':<27} {what}"])
    return "\n".join(lines) + "\n"


def _blocks() -> dict[str, str]:
    return {
        "config reference": config_reference_markdown(),
        "env table": env_table_markdown(),
    }


def render_docs_page(text: str) -> str:
    """``text`` (the page) with each generated block replaced by what it renders now.

    Raises:
        ValueError: the page lacks a block's markers.
    """
    blocks = _blocks()
    found = {m.group("name") for m in _BLOCK.finditer(text)}
    missing = sorted(set(blocks) - found)
    if missing:
        raise ValueError(
            f"{DOCS_PAGE.name} has no '<!-- BEGIN GENERATED: {missing[0]} -->' ... "
            "'<!-- END GENERATED -->' block"
        )

    def replace(m: re.Match) -> str:
        body = blocks.get(m.group("name"), m.group("body"))
        return f"{m.group(1)}{body.rstrip()}\n{m.group(4)}"

    return _BLOCK.sub(replace, text)


def write_docs(page: Path = DOCS_PAGE) -> bool:
    """Regenerate the blocks of ``page`` in place; True if it changed."""
    old = page.read_text(encoding="utf-8")
    new = render_docs_page(old)
    if new != old:
        page.write_text(new, encoding="utf-8")
    return new != old


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--write-docs", action="store_true", help=f"regenerate docs/{DOCS_PAGE.name}"
    )
    args = parser.parse_args(argv)
    if args.write_docs:
        changed = write_docs()
        print(f"{DOCS_PAGE}: {'regenerated' if changed else 'already current'}")
    else:
        print(config_reference_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
