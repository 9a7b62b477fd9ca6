"""The reference pages of the documentation, generated from the code: every command's options
from its argparse parser, every config key from the pydantic models (type, default, bounds,
description), and the config's JSON Schema for editors.

``python -m raysim.reference`` writes them under docs/reference/; tests/test_docs.py checks that
the committed pages are what the code generates now, so they cannot fall behind it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reference"
WIDTH = "100"  # argparse wraps help to $COLUMNS: fixed, so the page does not depend on a terminal


def _subcommands(parser: argparse.ArgumentParser, prefix: str) -> Iterator[tuple[str, Any]]:
    """(command line, parser) for ``parser`` and each of its subcommands, depth first."""
    yield prefix, parser
    for action in parser._actions:  # argparse keeps its subparsers here (no public accessor)
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, f"{prefix} {name}")


def cli_page() -> str:
    from raysim.cli.main import full_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parts = [
            "# Command line reference\n",
            "Every `raysim` command and its options, as `raysim COMMAND -h` prints them (this "
            "page is generated from the parsers: `python -m raysim.reference`).\n",
        ]
        for line, sub in _subcommands(full_parser(), "raysim"):
            sub.prog = line
            parts.append(f"## `{line}`\n\n```text\n{sub.format_help().rstrip()}\n```\n")
        return "\n".join(parts)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation)
    for noise in ("typing.", "NoneType"):
        text = text.replace(noise, "None" if noise == "NoneType" else "")
    return text


def _bounds(info: FieldInfo) -> str:
    signs = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    found = []
    for meta in info.metadata:
        for attr, sign in signs.items():
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{sign} {value}")
    return ", ".join(found)


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
        return "(a section)" if isinstance(value, BaseModel) else f"`{value!r}`"
    return f"`{json.dumps(info.default)}`" if _jsonable(info.default) else f"`{info.default!r}`"


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except TypeError:
        return False
    return True


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def config_page() -> str:
    from raysim.config import ExperimentConfig

    lines = [
        "# Config reference\n",
        "Every key of an experiment config, by section, with its type, default, bounds and "
        "meaning (generated from `raysim/config.py`: `python -m raysim.reference`). Give "
        "them in a YAML file or as `--set section.key=value`. An algorithm's own keys go under "
        "`algorithm.*` (its module in `algorithms/` lists them); a model's under `model.*`. "
        "Editors that read JSON Schema can check a config against "
        "[config.schema.json](config.schema.json).\n",
    ]
    sections: list[tuple[str, type[BaseModel]]] = [("", ExperimentConfig)]
    top = ExperimentConfig.model_fields
    sections += [
        (name, info.annotation)
        for name, info in top.items()
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
    ]
    for prefix, model in sections:
        title = f"`{prefix}`" if prefix else "Top level"
        lines.append(f"## {title}\n")
        if model.__doc__ and prefix:
            lines.append(_cell(model.__doc__) + "\n")
        lines.append("| key | type | default | bounds | meaning |")
        lines.append("|---|---|---|---|---|")
        for name, info in model.model_fields.items():
            if prefix == "" and name in dict(sections[1:]):
                continue  # a section: its own table
            key = f"{prefix}.{name}" if prefix else name
            row = [f"`{key}`", _cell(_type_name(info.annotation)), _cell(_default(info))]
            row += [_cell(_bounds(info)), _cell(info.description or "")]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def config_schema() -> str:
    from raysim.config import ExperimentConfig

    schema = ExperimentConfig.model_json_schema(mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "raysim experiment config"
    return json.dumps(schema, indent=1, sort_keys=True) + "\n"


PAGES = {"cli.md": cli_page, "config.md": config_page, "config.schema.json": config_schema}


def main() -> int:
    DOCS.mkdir(parents=True, exist_ok=True)
    for name, make in PAGES.items():
        (DOCS / name).write_text(make())
        print(DOCS / name, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
