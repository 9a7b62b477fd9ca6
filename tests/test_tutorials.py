"""docs/tutorials/*.md run as written: each page's Python blocks, in order, in one namespace, in a
scratch directory (a user's working directory). A tutorial that no longer runs fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TUTORIALS = Path(__file__).resolve().parents[1] / "docs" / "tutorials"


def blocks(page: Path) -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))


def test_every_tutorial_is_in_the_site_navigation():
    nav = (TUTORIALS.parents[1] / "mkdocs.yml").read_text()
    assert {p.name for p in TUTORIALS.glob("*.md")} == set(
        re.findall(r"tutorials/([\w-]+\.md)", nav)
    )


@pytest.mark.parametrize(
    "page", [p for p in sorted(TUTORIALS.glob("*.md")) if blocks(p)], ids=lambda p: p.stem
)
def test_tutorial_runs_as_written(page, ray_session, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks(page), str(page), "exec"), {"__name__": "tutorial"})
    out = capsys.readouterr().out
    assert out.strip(), "a tutorial shows its results"
    assert "Traceback" not in out
