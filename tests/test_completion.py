"""`raysim completion bash`: the script, sourced in a real bash, completes commands, every
command's options (compare's own included), choices and paths."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from raysim.cli.main import main

ROOT = Path(__file__).resolve().parents[1]

DRIVER = """
source "$1"
try() {
  COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]}-1)); COMP_LINE="${COMP_WORDS[*]}"
  COMP_POINT=${#COMP_LINE}; COMPREPLY=(); _shtab_raysim; echo "${COMPREPLY[*]}"
}
try raysim ""
try raysim compare --se
try raysim report runs --format ""
try raysim list ""
try raysim run configs/rdpcfl_qu
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash here")
def test_bash_completion_offers_commands_options_choices_and_files(tmp_path, capsys):
    assert main(["completion", "bash"]) == 0
    script = tmp_path / "raysim.bash"
    script.write_text(capsys.readouterr().out)
    done = subprocess.run(
        ["bash", "-c", DRIVER, "driver", str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert set(lines[0].split()) >= {"run", "report", "compare", "sweep", "audit", "list"}
    assert lines[1].split() == ["--seeds", "--set"]
    assert lines[2].split() == ["html", "json", "csv", "markdown"]
    assert lines[3].split() == ["algorithms", "modes", "datasets", "configs", "sweeps"]
    assert lines[4] == "configs/rdpcfl_quick.yaml"


@pytest.mark.parametrize("shell", ["zsh", "tcsh"])
def test_other_shells_get_a_script_naming_every_command(shell, capsys):
    assert main(["completion", shell]) == 0
    script = capsys.readouterr().out
    for command in ("run", "report", "compare", "sweep", "audit", "algorithms"):
        assert command in script


def test_an_unknown_shell_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["completion", "fish"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
