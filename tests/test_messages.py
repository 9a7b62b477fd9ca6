"""What a newcomer reads: close-match suggestions, pydantic errors in raysim's words, every
command in --help, no "minority" among equal clusters."""

from __future__ import annotations

import pytest
from conftest import small_config

from raysim.cli.main import main, parser


def _sets(**kw):
    return sum((["--set", s] for s in small_config(**kw)), [])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("traning.lr=0.1", "traning: unknown field; did you mean 'training'?"),
        ("runtime.num_worker=2", "did you mean 'num_workers'?"),
        ("data.shift=rotaton", "did you mean 'rotation'?"),
        ("data.dataset=digit", "did you mean 'digits'?"),
        ("algorithm.name=rdpcf", "did you mean 'rdpcfl'?"),
        ("model.name=cn", "did you mean 'cnn'?"),
        ("rounds=abc", "rounds: must be a whole number (got 'abc')"),
        ("privacy.epsilon=-1", "privacy.epsilon: must be > 0"),
    ],
)
def test_mistakes_get_suggestions(override, expected, capsys):
    assert main(["privacy", *_sets(), "--set", override]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert "Traceback" not in err


def test_algorithm_key_typo_is_reworded_without_pydantic_text(capsys):
    args = _sets(**{"algorithm.name": "rdpcfl"}) + ["--set", "algorithm.eps_selct=0.1"]
    assert main(["privacy", *args]) == 2
    err = capsys.readouterr().err
    assert "algorithm.eps_selct: rdpcfl takes no such key; did you mean 'eps_select'?" in err
    assert "http" not in err and "pydantic" not in err.lower() and "type=" not in err
    args = _sets(**{"algorithm.name": "rdpcfl"}) + ["--set", "algorithm.eps_select=-1"]
    assert main(["privacy", *args]) == 2
    err = capsys.readouterr().err
    assert "algorithm.eps_select: must be > 0" in err and "http" not in err


def test_another_algorithms_keys_are_left_out(capsys):
    """The demo carries rdpcfl's eps_select; fedavg runs it without."""
    assert main(["privacy", "--set", "algorithm.name=fedavg"]) == 0
    assert "fedavg does not take algorithm.eps_select: left out" in capsys.readouterr().err


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    text = capsys.readouterr().out
    commands = ["run", "report", "data", "privacy", "compare", "sweep"]
    summary = text.split("\n\n")[1]  # the description line
    assert all(c in summary for c in commands), summary
    assert all(c in text.split("\n\n", 2)[2] for c in commands)


@pytest.mark.parametrize(("sizes", "named"), [("[4, 4]", False), ("[2, 6]", True)])
def test_describe_names_a_minority_only_when_there_is_one(sizes, named, capsys):
    assert main(["data", "describe", *_sets(**{"data.cluster_sizes": sizes})]) == 0
    assert ("minority" in capsys.readouterr().out) == named
