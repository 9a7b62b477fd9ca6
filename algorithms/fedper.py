"""FedPer (Arivazhagan et al. 2019): a shared body trained federatedly (here with DP-FedAvg's
client-level noise) and a personal head (the model's last layer) that never leaves the client.

The head is the client's persistent state (held by the coordinator between its rounds); the
update a client reports has its head coordinates zeroed, so the DP sum only ever carries the
body and the head costs no privacy. A client that has not trained yet uses the global head.
With ``model.name=linear`` the whole model is the head, so prefer mlp or cnn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from algorithms.base import Environment
from algorithms.fedavg import FedAvg, GlobalState
from raysim.config import ConfigError
from raysim.models import build_from_spec
from raysim.privacy import postprocess
from raysim.protocol import ClientContext, ClientReport, ClientTask, EvalReport, RoundPlan


def head_size(env: Environment) -> int:
    """Parameters of the last layer (the module that holds the model's last parameter), which
    end the flat trainable vector. A frozen last layer (LoRA without its head) has no personal
    head to keep: refused, rather than taking the last adapters for one."""
    model = build_from_spec(env.model_spec(), env.feature_shape, env.num_classes, seed=0)
    named = list(model.named_parameters())
    layer = named[-1][0].rpartition(".")[0]
    head = [p for name, p in named if name.rpartition(".")[0] == layer]
    if not all(p.requires_grad for p in head):
        raise ConfigError(
            f"algorithm.name=fedper: the model's last layer ({layer or 'the model'}) is frozen, "
            "so there is no personal head to keep; train it (vit_lora: model.train_head=true) "
            "or choose another model"
        )
    return sum(p.numel() for p in head)


class FedPer(FedAvg):
    name = "fedper"
    privacy_modes = ("none", "sample", "client")

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
        report.state = (start + getattr(report.update, "value", report.update))[
            -self.head :
        ].clone()
        report.update = postprocess(report.update, self.body_only)  # the head stays on the client
        return report

    def body_only(self, update: torch.Tensor) -> torch.Tensor:
        out = update.clone()
        out[-self.head :] = 0.0
        return out

    def plan_evaluation(
        self, state: GlobalState, clients: Sequence[int] | None = None
    ) -> RoundPlan:
        return RoundPlan([self.task(c) for c in self.evaluated(clients)], [state.model])

    def client_evaluate(self, task: ClientTask, ctx: ClientContext) -> EvalReport:
        weights = self.personal(ctx.models[0], task.state)
        x, y = ctx.test_data()
        res = ctx.trainer.evaluate(weights, x, y)
        acc = float("nan") if res.accuracy is None else res.accuracy
        return EvalReport(task.client_id, res.loss, acc, res.n)
