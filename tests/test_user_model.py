"""A model of the user's own, named ``module:Builder`` (raysim.models.spec), as algorithms are."""

from __future__ import annotations

import json
import textwrap

import pyarrow.parquet as pq
import pytest

from raysim.cli.main import main
from raysim.config import DEMO_CONFIG

USER_MODELS = textwrap.dedent(
    """
    from torch import nn


    class TinyNet(nn.Module):
        def __init__(self, input_shape, num_classes, width: int = 8):
            super().__init__()
            c = input_shape[0]
            self.body = nn.Sequential(
                nn.Conv2d(c, width, 3, padding=1), nn.GroupNorm(2, width), nn.ReLU(),
                nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * width, num_classes),
            )

        def forward(self, x):
            return self.body(x)


    def batchnorm_net(input_shape, num_classes):
        layers = [nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8), nn.Linear(8, num_classes)]
        return nn.Sequential(*layers)


    def wrong_signature(shape, classes):
        return nn.Linear(64, classes)


    def not_a_module(input_shape, num_classes):
        return "a model"
    """
)

SETS = {
    "rounds": 2,
    "data.dataset": "digits",
    "data.num_clients": 6,
    "data.cluster_sizes": "[3,3]",
    "privacy.mode": "sample",
    "privacy.delta": 1e-3,
    "training.batch_size": 16,
    "runtime.progress": "false",
}


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    (tmp_path / "usermodels.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _compare(out, **sets: object) -> list[str]:
    argv = [
        "compare",
        str(DEMO_CONFIG),
        "--algorithms",
        "fedavg",
        "--seeds",
        "0",
        "--inline",
        "--out",
        str(out),
    ]
    return argv + sum((["--set", f"{k}={v}"] for k, v in {**SETS, **sets}.items()), [])


def _metrics(out) -> object:
    return pq.read_table(next(out.glob("*/seed0/metrics.parquet"))).to_pandas()


def test_an_imported_builder_runs_as_the_registered_one(user_models):
    """`raysim.models:CNN` is the builder registered as `cnn`: the same run, to the bit."""
    runs = {}
    for name in ("cnn", "raysim.models:CNN"):
        out = user_models / name.replace(":", "_")
        assert main(_compare(out, **{"model.name": name})) == 0
        runs[name] = _metrics(out)
    cols = ["round", "accuracy", "loss", "epsilon"]
    assert runs["cnn"][cols].equals(runs["raysim.models:CNN"][cols])


def test_a_users_model_takes_its_own_keys_and_trains_under_dp_sgd(user_models):
    out = user_models / "tiny"
    assert main(_compare(out, **{"model.name": "usermodels:TinyNet", "model.width": 4})) == 0
    summary = json.loads(next(out.glob("*/seed0/summary.json")).read_text())
    assert summary["rounds"] == 2 and 0 < summary["epsilon"] <= 8 + 1e-9
    assert "name: usermodels:TinyNet" in next(out.glob("*/seed0/config.yaml")).read_text()
    assert "width: 4" in next(out.glob("*/seed0/config.yaml")).read_text()


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("usermodels:Missing", "model.name: cannot import 'usermodels:Missing'"),
        ("no_such_module:Net", "model.name: cannot import 'no_such_module:Net'"),
        ("usermodels:wrong_signature", "(input_shape, num_classes, **its own keyword"),
        ("usermodels:not_a_module", "built a str, not a torch.nn.Module"),
        ("usermodels:batchnorm_net", "has BatchNorm1d 2: its running statistics"),
    ],
)
def test_a_model_that_cannot_serve_stops_the_run_before_it_starts(
    user_models, model, message, capsys
):
    out = user_models / "out"
    sets = sum((["--set", f"{k}={v}"] for k, v in {**SETS, "model.name": model}.items()), [])
    assert main(["run", "--out", str(out), *sets]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists()


def test_a_key_the_users_builder_does_not_take_is_named(user_models, capsys):
    sets = ["--set", "model.name=usermodels:TinyNet", "--set", "model.depth=3"]
    assert main(["privacy", *sets]) == 2
    assert "model.depth: unknown key for model 'usermodels:TinyNet'" in capsys.readouterr().err
