"""ClientWorker: a long-lived actor that runs many virtual clients per call.

It holds the federated dataset (zero-copy from the object store) and one resident model; per
client it only loads weights in place. One call carries a whole shard of clients, the pattern
measured fastest here (FIELD-NOTES.md: one call per actor with its list of clients).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from raysim.protocol import ClientContext, ClientTask
from raysim.runtime.reuse import Renewable
from raysim.runtime.sealed import opened

if TYPE_CHECKING:  # torch, the models and the trainer load in the actor, not in the driver
    import torch

    from raysim.models import ModelSpec


def pick_device(num_gpus: float) -> torch.device:
    import torch

    # Ray sets CUDA_VISIBLE_DEVICES for GPU actors; a fake (declared) GPU has no CUDA: ask torch.
    if num_gpus > 0 and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


class ClientWorker(Renewable):
    def __init__(
        self,
        algorithm: Any,
        dataset: Any,
        model_spec: ModelSpec,
        seed: int,
        threads: int,
        num_gpus: float,
        vectorize: bool = True,
    ) -> None:
        """``algorithm`` and ``model_spec`` may be sealed (raysim.runtime.sealed)."""
        import torch

        from raysim.models import build_from_spec, init_seed
        from raysim.training import LocalTrainer

        torch.set_num_threads(threads)
        algorithm, model_spec = opened(algorithm), opened(model_spec)
        self.algorithm = algorithm
        if isinstance(dataset, list):  # [ObjectRef]: fetched here, zero-copy
            import ray

            dataset = ray.get(dataset[0])
        self.dataset = dataset  # zero-copy views of the object store
        ds = dataset
        self.device = pick_device(num_gpus)
        # seeded like the run's initial weights; the frozen part is the same in every process
        model = build_from_spec(model_spec, ds.feature_shape, ds.num_classes, init_seed(seed))
        self.trainer = LocalTrainer(model, ds.task, self.device)
        self.trainer.vectorize = vectorize
        self.seed = seed

    def run(
        self, kind: str, round: int, models: np.ndarray, groups: list[list[ClientTask]]
    ) -> list[Any]:
        """Run `kind` ("train" or "evaluate") for each group of tasks; models is the round's
        broadcast. A group goes to the algorithm whole (client_steps: vectorized where it can
        be; client_evaluations: shared forward passes); the groups are fixed by the coordinator,
        so the bits do not depend on how many workers share them."""
        import torch

        broadcast = [torch.from_numpy(np.array(m, copy=True)) for m in models]
        out: list[Any] = []
        for group in groups:
            ctxs = [
                ClientContext(t.client_id, round, self.seed, self.trainer, self.dataset, broadcast)
                for t in group
            ]
            steps = getattr(self.algorithm, "client_steps", None)
            if kind == "train" and steps is not None:
                out.extend(steps(group, ctxs))
                continue
            evaluations = getattr(self.algorithm, "client_evaluations", None)
            if kind == "evaluate" and evaluations is not None:
                out.extend(evaluations(group, ctxs))
                continue
            step = self.algorithm.client_step if kind == "train" else self.algorithm.client_evaluate
            out.extend(step(t, c) for t, c in zip(group, ctxs, strict=True))
        return out

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "device": str(self.device),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "node_id": _node_id(),
        }


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # outside Ray (unit tests)
        return None
