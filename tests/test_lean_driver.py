"""`raysim run` prepares its experiment in a forked child and hands the algorithm to the actors
sealed (raysim.engine.experiment.prepare_apart, raysim.engine.sealed): its driver never imports
torch. Checked in fresh processes, since this one has torch loaded (where prepare_apart runs
in-process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from conftest import small_config


def _run(script: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_prepare_apart_returns_sealed_and_raises_what_the_child_raised() -> None:
    out = _run(
        """
        import sys
        from raysim.config import ConfigError
        from raysim.engine.experiment import prepare_apart
        from raysim.engine.sealed import Sealed

        def fails(exc):
            def build():
                raise exc
            return build

        for exc in (ConfigError("model.name: expected one of cnn, mlp"), ValueError("boom")):
            try:
                prepare_apart(fails(exc))
            except type(exc) as got:
                print(type(got).__name__, got)

        def build():
            from algorithms import Environment, get_algorithm
            from raysim.config import load_config
            from raysim.engine.experiment import prepare
            cfg = load_config(None, ["data.dataset=digits", "data.num_clients=4",
                                     "data.cluster_sizes=null", "model.name=mlp"])
            return [prepare(cfg, get_algorithm("fedavg"), Environment)]

        import gc, os

        def shared_files():
            count = 0
            for fd in os.listdir("/proc/self/fd"):
                try:  # the listing's own descriptor is gone by now
                    count += "raysim-prepared" in os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    pass
            return count

        (prep,) = prepare_apart(build)
        print(type(prep.algorithm).__name__, type(prep.spec).__name__, prep.env)
        print(prep.dataset.num_clients, prep.cfg.model.name, "torch" in sys.modules)
        print(type(prep.algorithm.open()).__name__, "torch" in sys.modules)
        # the data came back through a shared file (its buffers out of band): the same bytes as
        # built here; the file lives as long as the data mapped from it
        mapped = shared_files()
        (here,) = build()
        import numpy as np
        same = all(
            np.array_equal(a, b)
            for c in range(4)
            for a, b in zip(prep.dataset.client_train(c) + prep.dataset.client_test(c),
                            here.dataset.client_train(c) + here.dataset.client_test(c))
        )
        del prep
        gc.collect()
        print("same data", same, mapped, shared_files())
        """
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "ConfigError model.name: expected one of cnn, mlp",
        "ValueError boom",
        "Sealed Sealed None",
        "4 mlp False",
        "FedAvg True",
        "same data True 1 0",
    ], out.stdout


def test_the_driver_of_raysim_run_never_imports_torch(tmp_path) -> None:
    sets = [s for item in small_config(rounds=2) for s in ("--set", item)]
    argv = ["run", "--out", str(tmp_path / "run"), *sets]
    out = _run(
        f"""
        import os, sys
        os.environ["RAY_AUTH_MODE"] = "disabled"
        from raysim.cli.main import main
        code = main({argv!r})
        print(code, "torch" in sys.modules)
        """,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "0 False", out.stdout + out.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").is_file()


def test_prepared_buffers_travel_through_a_shared_file_or_the_pipe() -> None:
    """_pickle_shared / _unpickle_shared: numpy and pyarrow buffers out of band in a memfd, or
    everything in band where there is no shared file; the same values either way."""
    import numpy as np
    import pyarrow as pa

    from raysim.engine.experiment import _pickle_shared, _shared_file, _unpickle_shared

    obj = {
        "pixels": np.arange(3 * 1000 * 7, dtype=np.uint8).reshape(3000, 7),
        "sizes": np.array([5, 0, 9], dtype=np.int64),
        "labels": pa.array(np.arange(100, dtype=np.int32)),
        "empty": np.zeros(0),
    }
    shared = _shared_file()
    assert shared is not None  # Linux: memfd_create
    try:
        body, spans = _pickle_shared(obj, shared)
        assert len(spans) >= 3 and len(body) < 2000  # the buffers are in the file, not the pickle
        assert all(offset % 64 == 0 for offset, _ in spans)
        back = _unpickle_shared((body, spans), shared)
    finally:
        os.close(shared)
    inline = _unpickle_shared(_pickle_shared(obj, None), None)
    for got in (back, inline):
        assert np.array_equal(got["pixels"], obj["pixels"])
        assert np.array_equal(got["sizes"], obj["sizes"])
        assert got["labels"].equals(obj["labels"])
        assert got["empty"].shape == (0,)
