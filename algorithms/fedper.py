"""FedPer (Arivazhagan et al. 2019): a shared body trained federatedly (here with DP-FedAvg's
client-level noise) and a personal head (the model's last layer) that never leaves the client.

The head is the client's persistent state (held by the coordinator between its rounds); the
update a client reports has its head coordinates zeroed, so the DP sum only ever carries the
body and the head costs no privacy. A client that has not trained yet uses the global head.
With ``model.name=linear`` the whole model is the head, so prefer mlp or cnn.
"""

from __future__ import annotations

import torch

from algorithms.base import Environment
from algorithms.clustered import _SHAPES
from algorithms.fedavg import FedAvg, GlobalState
from raysim.models import build_model, model_kwargs
from raysim.protocol import ClientContext, ClientReport, ClientTask, EvalReport, RoundPlan


def head_size(env: Environment) -> int:
    """Parameters of the last layer (weight and bias: the last two in flattening order)."""
    cfg = env.cfg
    if cfg.data.dataset == "synthetic_linear":
        shape, classes = (cfg.data.dim,), 0
    else:
        shape, classes = _SHAPES[cfg.data.dataset]
    kwargs = model_kwargs(cfg.model)
    params = list(build_model(cfg.model.name, shape, classes, seed=0, **kwargs).parameters())
    return sum(p.numel() for p in params[-2:])


class FedPer(FedAvg):
    name = "fedper"

    def __init__(self, env: Environment) -> None:
        super().__init__(env)
        self.head = head_size(env)

    def personal(self, model: torch.Tensor, head: torch.Tensor | None) -> torch.Tensor:
        if head is None:
            return model
        return torch.cat([model[: -self.head], head])

    def client_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport:
        start = self.personal(ctx.models[0], task.state)
        report = self.train_client(task, ctx, start)
        new_head = (start + report.update)[-self.head :].clone()
        report.update = report.update.clone()
        report.update[-self.head :] = 0.0  # the head stays on the client
        report.state = new_head
        return report

    def plan_evaluation(self, state: GlobalState) -> RoundPlan:
        return RoundPlan([self.task(c) for c in range(self.env.num_clients)], [state.model])

    def client_evaluate(self, task: ClientTask, ctx: ClientContext) -> EvalReport:
        weights = self.personal(ctx.models[0], task.state)
        x, y = ctx.test_data()
        res = ctx.trainer.evaluate(weights, x, y)
        acc = float("nan") if res.accuracy is None else res.accuracy
        return EvalReport(task.client_id, res.loss, acc, res.n, 0)
