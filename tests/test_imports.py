"""What a process imports: a client worker of a run without DP never loads the accountant, and
the coordinator's round loop loads neither scipy.stats nor scikit-learn until it uses them; and
what imports what: no module imports one that imports it back."""

from __future__ import annotations

import subprocess
import sys

import raysim.privacy


def test_every_public_privacy_name_resolves() -> None:
    for name in raysim.privacy.__all__:
        assert getattr(raysim.privacy, name) is not None, name


def test_worker_imports_leave_out_the_accountant_and_scipy_stats() -> None:
    """What a client worker imports (the algorithms it unpickles, the worker) and the round
    loop load neither dp_accounting nor scipy.stats: ~1 s and ~50 MiB in every process."""
    code = (
        "import sys, algorithms, raysim.runtime.worker, raysim.engine.rounds; "
        "print(sorted(m for m in ('dp_accounting.rdp', 'dp_accounting.pld', 'scipy.stats', "
        "'scipy.signal', 'opacus', 'sklearn') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_training_loads_neither_dynamo_nor_sympy() -> None:
    """A worker's first client (LocalTrainer's plain SGD and evaluation) and first vectorized
    group (plain and DP-SGD) import neither torch._dynamo (which torch.func.grad and building a
    torch.optim optimizer load: ~1.1 s and ~70 MiB per worker) nor sympy (which cross_entropy's
    decomposition under vmap loads)."""
    code = """
import sys, torch
from raysim.models import build_model
from raysim.training import LocalTrainer, TrainConfig
from raysim.training.vectorized import VectorizedTrainer
model = build_model("cnn", (8, 8), 3, seed=0)
w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
vec = VectorizedTrainer(model, "classification")
data = [(torch.randn(12, 64).numpy(), torch.randint(0, 3, (12,)).numpy())] * 2
for dp in (None, 1.0):
    cfg = TrainConfig(lr=0.1, batch_size=4, dp_noise_multiplier=dp, dp_clip=1.0)
    for g in (1, 2):
        gens = [torch.Generator().manual_seed(i) for i in range(g)]
        vec.train_group([w] * g, data[:g], [cfg] * g, gens)
local = LocalTrainer(model, "classification")
cfg = TrainConfig(lr=0.1, batch_size=4, momentum=0.9, weight_decay=1e-3)
local.train(w, *data[0], cfg, torch.Generator().manual_seed(0))
local.evaluate(w, *data[0])
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_ledger_without_charges_never_loads_the_accountant() -> None:
    """Every run keeps a ledger; one that charges nothing (no DP) reports 0 spent without
    loading dp_accounting (~1 s and ~45 MiB in the coordinator)."""
    code = (
        "import sys; from raysim.privacy import PrivacyLedger\n"
        "for acc in ('rdp', 'pld'):\n"
        "    led = PrivacyLedger(delta=1e-3, accountant=acc, budget=2.0, num_clients=4)\n"
        "    led.check_budget(); s = led.summary()\n"
        "    assert s['max_epsilon'] == s['population_epsilon'] == 0.0 == led.epsilon(3), s\n"
        "    led.rows()\n"
        "print(any(m in sys.modules for m in ('dp_accounting.rdp', 'dp_accounting.pld')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_a_client_release_builds_its_event_without_the_accountant() -> None:
    """A DP-SGD client's release (and a private selection) builds its DpEvent without loading
    dp_accounting's package (its PLD code pulls in scipy.signal and scipy.stats: ~1.2 s and
    ~50 MiB in every worker, in round 1). The accountant loaded afterwards reads those events
    as its own: one set of event classes, the same epsilon."""
    code = """
import sys
from raysim import privacy
from raysim.privacy.modes.sample import release_dpsgd
from raysim.training import TrainConfig
cfg = TrainConfig(lr=0.1, batch_size=4, dp_noise_multiplier=1.0, dp_clip=1.0)
rel = release_dpsgd(None, cfg, 40, 10)
sel = privacy.selection_event(0.5, 2)
heavy = ("dp_accounting.rdp", "dp_accounting.pld", "scipy.stats", "scipy.signal")
print(sorted(m for m in heavy if m in sys.modules))
import dp_accounting
from raysim.privacy import Phase, dpsgd_event, epsilon
assert dp_accounting.dp_event is sys.modules["dp_accounting.dp_event"]
fresh = dpsgd_event([Phase(0.1, 10)], 1.0)
assert isinstance(rel.event, dp_accounting.DpEvent) and rel.event == fresh
assert isinstance(sel, dp_accounting.SelfComposedDpEvent)
print(epsilon(rel.event, 1e-5) == epsilon(fresh, 1e-5) > 0, epsilon(sel, 1e-5) > 0)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split("\n")[:2] == ["[]", "True True"], out.stdout + out.stderr


def test_building_and_opening_a_population_does_not_import_pandas_or_arrow_compute() -> None:
    """pyarrow's ``pa.array``, ``pa.table`` and ``Array.to_numpy`` import pandas (~0.4 CPU-s)
    to ask whether their argument is a pandas object, and ``FixedSizeListArray.from_arrays``
    and ``.flatten()`` import pyarrow.compute (~0.1 s): the prepare step and every process that
    opens the population (the coordinator and the workers) used to pay them at start-up."""
    code = """
import pickle, sys
from raysim.config import DataConfig
from raysim.data.federated import build_federated_dataset
ds = build_federated_dataset(DataConfig(dataset="synthetic_linear", num_clients=4), seed=0)
ds = pickle.loads(pickle.dumps(ds))
x, y = ds.client_train(1)
print(x.shape, "pandas" in sys.modules, "pyarrow.compute" in sys.modules)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().endswith(" False False"), out.stdout + out.stderr


def test_calibration_runs_without_dp_accountings_package_init() -> None:
    """Calibrating a schedule (before Ray starts) loads the RDP accountant but not
    dp_accounting's package __init__, whose PLD and calibration code load scipy.signal, .stats
    and .optimize (~1.2 CPU-s). Code that then uses the package as usual finds it whole, with
    the same classes, and the PLD accountant answers."""
    code = """
import sys
from raysim import privacy
phases = [privacy.Phase(0.05, 40)] * 10
z = privacy.calibrate_dpsgd(phases, 4.0, 1e-5)
heavy = ("dp_accounting.pld", "dp_accounting.mechanism_calibration", "scipy.stats",
         "scipy.signal", "scipy.optimize")
print(sorted(m for m in heavy if m in sys.modules), "dp_accounting.rdp" in sys.modules)
import dp_accounting
assert hasattr(dp_accounting.rdp, "RdpAccountant")  # a subpackage asked for, not imported
assert "dp_accounting.pld" not in sys.modules
assert hasattr(dp_accounting.pld, "PLDAccountant")
from dp_accounting import pld
from dp_accounting.dp_event import GaussianDpEvent
from raysim.privacy.events import gaussian
assert dp_accounting.GaussianDpEvent is GaussianDpEvent is type(gaussian(1.0))
assert dp_accounting.pld is pld and hasattr(pld, "PLDAccountant")
event = privacy.dpsgd_event(phases, z)
rdp, pld_eps = privacy.epsilon(event, 1e-5), privacy.epsilon(event, 1e-5, "pld")
print(rdp <= 4.0, 0 < pld_eps <= rdp)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split("\n")[:2] == ["[] True", "True True"], out.stdout + out.stderr


def test_no_module_imports_one_that_imports_it_back() -> None:
    """The layers hold at module level too: no import cycle among raysim's, the algorithms' and
    the sweeps' modules (grimp's graph, as import-linter reads it, annotations left out; the
    strongly connected components by scipy). A cycle names its modules."""
    import grimp
    import numpy as np
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import connected_components

    graph = grimp.build_graph("raysim", "algorithms", "tune", exclude_type_checking_imports=True)
    modules = sorted(graph.modules)
    index = {m: i for i, m in enumerate(modules)}
    edges = [
        (index[m], index[i])
        for m in modules
        for i in graph.find_modules_directly_imported_by(m)
        if i in index
    ]
    rows, cols = zip(*edges, strict=True)
    adjacency = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(modules),) * 2)
    _, labels = connected_components(adjacency, directed=True, connection="strong")
    sizes = np.bincount(labels)
    cycles = [
        sorted(m for m, lab in zip(modules, labels, strict=True) if lab == c)
        for c in np.flatnonzero(sizes > 1)
    ]
    assert not cycles, cycles
