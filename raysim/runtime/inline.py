"""The engine's round loop in this process, without Ray: the clients on one ``ClientWorker``
here (or on the clients' side in a child process), the same calls with the same seeded
generators as on Ray, so the same numbers on the same device. `raysim compare --inline`, the
audits and tests run it; ``drive`` (raysim.engine.driver) is the loop around it, as on Ray."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from raysim.config import dump_config


def inline_loop(
    prep: Any,
    device: str | None = None,
    apart: bool = False,
    make_worker: Callable[..., Any] | None = None,
) -> Any:
    """The engine's round loop (``raysim.engine.rounds.RoundLoop``) for this process, without Ray:
    the clients run on one ``ClientWorker``, as they would on a worker actor: here, or with
    ``apart`` in a child process with the clients' side (``runtime.client_side.ClientsProcess``:
    the clients' states and secure inputs never in this process, the server's; its
    ``loop.clients`` is to be closed). ``make_worker``: builds the worker from ClientWorker's
    arguments, to run the clients here (the black-box audit's canary clients,
    ``raysim.audit.clients``)."""
    import torch

    from raysim.engine.rounds import RoundLoop, group_size, task_groups
    from raysim.metrics.evaluation import Judge
    from raysim.models import model_spec
    from raysim.runtime.client_side import ClientsProcess
    from raysim.runtime.worker import ClientWorker

    cfg = prep.cfg
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpus = 1.0 if dev.startswith("cuda") else 0.0
    rt = cfg.runtime
    # a copy of the algorithm, as a worker actor holds
    args = (copy.deepcopy(prep.algorithm), prep.dataset, model_spec(cfg), cfg.seed)
    args += (rt.threads_per_worker, gpus, rt.vectorize, prep.client_seed, copy.deepcopy(prep.mode))
    clients = None
    if apart and make_worker is not None:
        raise ValueError("make_worker runs the clients in this process: not with apart")
    if apart:
        secure = prep.privacy_summary.get("secure_spec")
        judge = Judge.of_run(prep.truth, cfg)
        clients = ClientsProcess(args, rt.checkpoint_every > 0, prep.client_seed, secure, judge)
    worker = clients or (make_worker or ClientWorker)(*args)
    size = group_size(rt.client_group_size, gpus)  # the same groups as on Ray

    def execute(kind: str, round: int, models: list[Any], tasks: list[Any]) -> list[Any]:
        stacked = np.stack([m.detach().to("cpu", torch.float32).numpy() for m in models])
        return worker.run(kind, round, stacked, task_groups(kind, tasks, size, rt.eval_group_size))

    seed = None if apart else prep.client_seed
    loop = RoundLoop(cfg, prep.algorithm, prep.mode, prep.truth, execute, seed)
    loop.device = str(worker.device)
    loop.clients = clients
    if clients is not None:  # the secure sums and the evaluations' metrics from their side
        loop.secure_sums, loop.judge = clients.secure_sums, None
    return loop


def run_inline(
    prep: Any,
    on_round: Callable[[dict], None] | None = None,
    device: str | None = None,
    out_dir: Path | None = None,
    resume: bytes | None = None,
    apart: bool | None = None,
) -> dict[str, Any]:
    """The remaining rounds of ``inline_loop``: the result dict of ``runtime.session.run_session``,
    whose files it writes too: with ``out_dir``, metrics.parquet and a checkpoint (every
    ``runtime.checkpoint_every`` rounds) as rounds finish, so a paper-scale run that stops loses
    at most those rounds; ``resume`` is a checkpoint to continue from (the same format as a Ray
    run's, so either can continue the other). ``apart`` (default: where the server is
    untrusted) keeps the clients in a child process, as a Ray run keeps them on actors."""
    import torch
    from threadpoolctl import threadpool_limits

    from raysim.engine.driver import Progress, StatesHere, drive
    from raysim.state.checkpoint import clients_seed_of, kept_apart

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    blas = threadpool_limits(limits=None, user_api="blas")  # the user's, restored after
    cfg = prep.cfg
    if apart is None:
        apart = not prep.mode.trusted_server
    loop = None
    if resume is not None and apart:  # the clients continue with their states
        resume = kept_apart(resume, cfg.seed)
    if resume is not None and prep.client_seed is not None:  # and with their seed
        prep.client_seed = clients_seed_of(resume, cfg.seed)
    try:
        loop = inline_loop(prep, device, apart)
        clients = loop.clients if loop.clients is not None else StatesHere(loop)
        config = dump_config(prep.recorded_config())
        drive(
            loop,
            clients,
            cfg,
            Progress(resume),
            config,
            prep.client_seed,
            out_dir,
            on_round,
            checkpoints=out_dir is not None,  # nothing to keep one for: none is taken
        )
        evaluations = loop.clients.evaluations() if loop.clients is not None else None
    finally:
        torch.set_num_threads(threads)
        blas.restore_original_limits()
        if loop is not None and loop.clients is not None:
            loop.clients.close()
    on_gpu = loop.device.startswith("cuda")
    results = loop.results()
    if evaluations is not None:
        results["eval"] = evaluations
    return {
        **results,
        "workers_replaced": 0,
        "workers": [{"inline": True, "device": loop.device, "clients_apart": apart}],
        "gpus_per_worker": 1.0 if on_gpu else 0.0,
        "wall_seconds": time.perf_counter() - t0,
    }
