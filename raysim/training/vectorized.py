"""Cross-client vectorized local training: a fixed group of clients trained at once.

``LocalTrainer`` runs one client at a time on batches of ~16: small convolutions that leave most
of a core idle. Here G clients' weights are stacked ([G, ...] per parameter) and one
``torch.func.vmap`` over ``functional_call`` runs all of them per step, each on its own batch.

Exactly what ``LocalTrainer`` computes, up to float rounding:

- the same draws: each client's ``torch.Generator`` is replayed in LocalTrainer's order (plain:
  one ``randperm`` per epoch; DP: per step one Poisson mask ``rand(n) < q``, then the noise of
  every parameter, drawn as Opacus' ``_generate_noise`` draws it), so batches, masks and noise
  are bit-identical to the per-client path's;
- DP-SGD as Opacus' ``DPOptimizer`` does it: per-sample gradients (autograd through a ``vmap``
  over per-sample copies of the weights; a group of one by ``layer_grads``' rules), clip
  factor ``min(1, C / (||g_i|| + 1e-6))``, sum, add ``N(0, (zC)^2)``, divide by the expected
  batch size; an empty Poisson batch still takes a noise-only step;
- SGD with momentum / weight decay as ``torch.optim.SGD``, FedProx's ``mu (w - w0)`` added after
  the noise, the client-side update clip.

Clients of one group may differ in data size, Poisson batch size and step count: batches are
padded to the group's largest and masked; a client past its last step is frozen (no update,
no momentum). What cannot be vectorized is refused by :func:`unsupported` and the caller falls
back to ``LocalTrainer`` (see that function for the list).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap

from raysim.training.config import TrainConfig, TrainResult, clip_update, sampling_plan
from raysim.training.layer_grads import LayerGrads, LayerRulesMissed, clip_sum
from raysim.training.layer_grads import unsupported as layer_rules_unsupported
from raysim.training.losses import as_tensor, per_sample_loss, targets

# Per-sample gradients of a group live in memory at once (G x B x dim floats): models above this
# many parameters (ResNet-18: 11M) go through LocalTrainer's chunked Opacus path instead.
MAX_VECTORIZED_PARAMS = 2_000_000


def unsupported(cfgs: Sequence[TrainConfig], dim: int) -> str | None:
    """Why this group cannot be vectorized (None: it can).

    Refused: configs that differ between the clients other than in the DP noise multiplier
    (one step schedule per group); DP-SGD with a logical batch above ``physical_batch_size``
    (the memory bound LocalTrainer honours by accumulating chunks); models with more than
    ``MAX_VECTORIZED_PARAMS`` parameters.
    """
    if not cfgs:
        return "empty group"
    first = replace(cfgs[0], dp_noise_multiplier=None)
    if any(replace(c, dp_noise_multiplier=None) != first for c in cfgs[1:]):
        return "clients of the group have different training configs"
    if any(c.dp != cfgs[0].dp for c in cfgs):
        return "DP and non-DP clients in one group"
    if dim > MAX_VECTORIZED_PARAMS:
        return f"model has {dim} parameters (> {MAX_VECTORIZED_PARAMS})"
    c = cfgs[0]
    if not c.full_batch and c.batch_size > c.physical_batch_size:
        return "batch_size above physical_batch_size (chunked accumulation)"
    return None


@dataclass
class _Client:
    """One client's schedule and running totals inside a group call."""

    n: int
    b: int  # expected batch size (DP denominator)
    q: float
    total_steps: int
    gen: torch.Generator
    noise_gen: torch.Generator | None = None
    orders: list[torch.Tensor] | None = None  # plain SGD: one permutation per epoch
    epoch: int = -1
    loss_total: float = 0.0
    count: int = 0
    loss: float = float("nan")


class VectorizedTrainer:
    """One resident model per worker (as LocalTrainer); trains groups of clients with vmap."""

    def __init__(
        self,
        model: nn.Module,
        task: str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        # float64 is for numerical checks across devices: a max-pool's gradient jumps where
        # float32 rounding decides a near-tie, so two devices' float32 results can part in a
        # client beyond rounding (scripts/gpu_check_vectorized.py); in float64 they do not.
        self.device, self.dtype = torch.device(device), dtype
        self.model = model.to(self.device, dtype)
        self.task = task
        self.names = [k for k, p in self.model.named_parameters() if p.requires_grad]
        self.shapes = [p.shape for _, p in self.model.named_parameters() if p.requires_grad]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.dim = sum(self.sizes)
        model = self.model

        def client_loss(params, xb, yb, w):
            """Weighted loss sum of one client's (padded) batch; w is 0 on padding rows."""
            losses = per_sample_loss(task, functional_call(model, params, (xb,)), yb)
            return (losses * w).sum(), losses.detach()

        def sample_loss(params, xi, yi):
            out = functional_call(model, params, (xi.unsqueeze(0),))
            loss = per_sample_loss(task, out, yi.unsqueeze(0)).sum()
            return loss, loss.detach()

        # Gradients come from autograd on the summed losses of independent copies of the weights
        # (one per client, or one per sample for DP), not from torch.func.grad: its first call
        # imports torch._dynamo (~1.1 s and ~70 MiB in every worker). Each copy's gradient is its
        # own loss's gradient. Plain SGD gets vmap(grad)'s very bits; per-sample gradients agree
        # to float rounding (1e-7) and took 63 ms against 75 for a group of 8 x 16 (one thread).
        self._client_losses = vmap(client_loss)  # weights [G, ...]
        self._sample_losses = vmap(vmap(sample_loss))  # weights [G, B, ...]
        self._sample_losses_one = vmap(sample_loss)  # weights [B, ...]
        # A group of one (every DP-SGD client on CPU) takes the layer rules where they apply:
        # an ordinary batched forward pass, channels-last on CPU (~1.6x faster per step).
        self._layer_grads = (
            LayerGrads(model, task, self.names, channels_last=self.device.type == "cpu")
            if layer_rules_unsupported(model, self.names) is None
            else None
        )

    def unsupported(self, cfgs: Sequence[TrainConfig]) -> str | None:
        return unsupported(cfgs, self.dim)

    # --------------------------------------------------------------------------------- API
    def train_group(
        self,
        weights: Sequence[torch.Tensor],
        data: Sequence[tuple[np.ndarray, np.ndarray]],
        cfgs: Sequence[TrainConfig],
        generators: Sequence[torch.Generator],
    ) -> list[TrainResult]:
        """Train G clients from their flat ``weights`` on their own ``(x, y)``; one TrainResult
        per client, as ``LocalTrainer.train`` would return it (FedProx centre: the start)."""
        g = len(weights)
        if not (len(data) == len(cfgs) == len(generators) == g):
            raise ValueError("weights, data, cfgs and generators must have one entry per client")
        reason = self.unsupported(cfgs)
        if reason is not None:
            raise ValueError(f"group cannot be vectorized: {reason}")
        cfg = cfgs[0]
        if g == 1 and cfg.dp:
            return [self._train_one_dp(weights[0], data[0], cfg, generators[0])]
        init = torch.stack([w.detach().reshape(-1).to("cpu", self.dtype) for w in weights])
        if init.shape[1] != self.dim:
            raise ValueError(f"weights have {init.shape[1]} elements, model has {self.dim}")
        xs, ys, ns = self._pad(data)
        clients = [self._client(int(n), cfg, gen) for n, gen in zip(ns, generators, strict=True)]
        params = self._unflatten(init.to(self.device))
        center = {k: v.clone() for k, v in params.items()} if cfg.prox_mu > 0 else None
        momentum: dict[str, torch.Tensor] | None = None
        steps = max((c.total_steps for c in clients), default=0)
        losses: list[tuple[torch.Tensor, list[tuple[int, int, int]]]] = []
        for t in range(steps):
            active = [t < c.total_steps for c in clients]
            if cfg.dp:
                grads, step_losses = self._dp_grads(params, xs, ys, clients, cfgs, cfg, t, active)
            else:
                grads, step_losses = self._plain_grads(params, xs, ys, clients, cfg, t, active)
            losses.append(step_losses)
            momentum = self._sgd_step(params, grads, center, cfg, active, momentum)
        self._settle_losses(clients, losses)
        new = self._flatten(params).to("cpu", self.dtype)
        out = []
        for i, c in enumerate(clients):
            update = new[i] - init[i]
            norm = clip_update(update, cfg.update_clip)
            out.append(TrainResult(update, c.n, c.total_steps, c.loss, norm))
        return out

    # ------------------------------------------------------------------------- schedules
    def _client(self, n: int, cfg: TrainConfig, gen: torch.Generator) -> _Client:
        plan = sampling_plan(n, cfg)
        c = _Client(n, plan.expected_batch_size, plan.q, plan.total_steps, gen)
        if cfg.dp:
            c.noise_gen = self._noise_generator(gen)
        elif not cfg.full_batch:
            # LocalTrainer draws one permutation at the start of each epoch that runs a step and
            # nothing else from this generator: drawing them all now gives the same bits.
            epochs = -(-plan.total_steps // plan.steps_per_epoch) if plan.total_steps else 0
            c.orders = [torch.randperm(n, generator=gen, device=gen.device) for _ in range(epochs)]
        return c

    def _noise_generator(self, gen: torch.Generator) -> torch.Generator:
        """As LocalTrainer._noise_generator: noise is drawn on the parameters' device."""
        if gen.device.type == self.device.type:
            return gen
        seed = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device))
        return torch.Generator(device=self.device).manual_seed(seed)

    @staticmethod
    def _settle_losses(
        clients: list[_Client], steps: list[tuple[torch.Tensor, list[tuple[int, int, int]]]]
    ) -> None:
        """Each client's mean per-sample loss over the last epoch it ran (LocalTrainer's
        train_loss), from every step's per-client loss sums read back once: reading them each
        step would make a GPU wait for every step before the next is queued."""
        if not steps:
            return
        sums = torch.stack([s for s, _ in steps]).tolist()
        for row, (_, entries) in zip(sums, steps, strict=True):
            for i, epoch, count in entries:
                c = clients[i]
                if epoch != c.epoch:
                    c.epoch, c.loss_total, c.count = epoch, 0.0, 0
                c.loss_total += row[i]
                c.count += count
        for c in clients:
            c.loss = c.loss_total / c.count if c.count else float("nan")

    # ----------------------------------------------------------------------------- steps
    def _grads(self, losses_fn, params, *batch):
        """Gradient of each independent copy in ``params`` (leading dims: its copies) of its own
        loss, and the unweighted per-sample losses."""
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        with torch.enable_grad():
            total, losses = losses_fn(leaves, *batch)
            grads = torch.autograd.grad(
                total.sum(), [leaves[k] for k in self.names], allow_unused=True
            )
        out = {
            k: torch.zeros_like(leaves[k]) if g is None else g
            for k, g in zip(self.names, grads, strict=True)
        }
        return out, losses

    def _per_sample_grads(self, params, xb, yb):
        """Per-sample gradients [G, B, ...] of a group: every sample gets its own (expanded)
        weights under vmap."""
        b = xb.shape[1]
        expanded = {
            k: v.unsqueeze(1).expand(v.shape[0], b, *v.shape[1:]) for k, v in params.items()
        }
        return self._grads(self._sample_losses, expanded, xb, yb)

    def _plain_grads(self, params, xs, ys, clients, cfg, t, active):
        rows, sizes = [], []
        for c, on in zip(clients, active, strict=True):
            if not on:
                rows.append(torch.zeros(0, dtype=torch.long))
            elif cfg.full_batch:
                rows.append(torch.arange(c.n))
            else:
                spe = -(-c.n // c.b)
                epoch, s = divmod(t, spe)
                rows.append(c.orders[epoch][s * c.b : (s + 1) * c.b].cpu())
            sizes.append(rows[-1].numel())
        idx, mask = self._index(rows)
        w = mask / torch.tensor([max(s, 1) for s in sizes], dtype=self.dtype)[:, None]
        xb, yb = self._gather(xs, ys, idx)
        grads, losses = self._grads(self._client_losses, params, xb, yb, self._put(w))
        sums = (losses * self._put(mask)).sum(1)
        return grads, (sums, self._loss_entries(clients, cfg, t, active, sizes))

    @staticmethod
    def _loss_entries(clients, cfg, t, active, sizes) -> list[tuple[int, int, int]]:
        """(client, epoch, samples) of this step's active clients, for _settle_losses."""
        out = []
        for i, c in enumerate(clients):
            if active[i]:
                spe = 1 if cfg.full_batch else -(-c.n // c.b)
                out.append((i, t // spe, sizes[i]))
        return out

    def _dp_grads(self, params, xs, ys, clients, cfgs, cfg, t, active):
        rows = []
        for c, on in zip(clients, active, strict=True):
            if not on:
                rows.append(torch.zeros(0, dtype=torch.long))
            elif cfg.full_batch:
                rows.append(torch.arange(c.n))
            else:  # Poisson: each sample independently with prob q (LocalTrainer's draw)
                m = torch.rand(c.n, generator=c.gen, device=c.gen.device) < c.q
                rows.append(m.nonzero().reshape(-1).cpu())
        idx, mask = self._index(rows)
        xb, yb = self._gather(xs, ys, idx)
        if idx.shape[1] > 0:
            per_sample, losses = self._per_sample_grads(params, xb, yb)
        else:  # every batch empty: noise-only steps
            g = len(clients)
            per_sample = {k: v.new_zeros((g, 0, *v.shape[1:])) for k, v in params.items()}
            losses = torch.zeros(len(clients), 0, device=self.device)
        mask = self._put(mask)
        flat = [per_sample[k].flatten(2) for k in self.names]
        norms = torch.stack([f.norm(2, dim=-1) for f in flat], dim=-1).norm(2, dim=-1)  # [G, B]
        finite = torch.isfinite(norms)
        if not bool(finite.all()):  # as training.config.zero_nonfinite_samples: counted as zero
            norms = torch.where(finite, norms, 0)
            for k in self.names:
                keep = finite.view(*finite.shape, *[1] * (per_sample[k].dim() - 2))
                per_sample[k] = torch.where(keep, per_sample[k], 0)
        clip = self._put(torch.tensor([c.dp_clip for c in cfgs], dtype=self.dtype))
        factor = (clip[:, None] / (norms + 1e-6)).clamp(max=1.0) * mask
        sums = (losses * mask).sum(1)
        grads = {}
        for k in self.names:
            grads[k] = torch.einsum("gi,gi...->g...", factor, per_sample[k])
        # Opacus per client: each parameter's noise from the client's generator, in parameter
        # order (none at std 0), added to the clipped sum, divided by the expected batch size.
        # The same draws and float operations, one addition and one division per parameter for
        # the whole group (a GPU launches a kernel per operation). Rows of inactive clients
        # are left to _sgd_step, which does not move them.
        stds = [ci.dp_noise_multiplier * ci.dp_clip for ci in cfgs]
        noisy = [i for i in range(len(clients)) if active[i] and stds[i] != 0]
        divisors = {clients[i].b for i in range(len(clients)) if active[i]}
        for k, shape in zip(self.names, self.shapes, strict=True):
            if noisy:
                # contiguous, whatever the strides of grads[k]: a strided row would be filled
                # in another order than Opacus' fresh tensor
                noise = grads[k].new_zeros(grads[k].shape)
                for i in noisy:
                    torch.normal(0.0, stds[i], shape, generator=clients[i].noise_gen, out=noise[i])
                grads[k] += noise
            if len(divisors) == 1:  # one python divisor, as Opacus divides (CUDA: by 1/b)
                grads[k] /= next(iter(divisors))
            else:
                for i in range(len(clients)):
                    if active[i]:
                        grads[k][i] /= clients[i].b
        sizes = [r.numel() for r in rows]
        return grads, (sums, self._loss_entries(clients, cfg, t, active, sizes))

    def _train_one_dp(
        self,
        weights: torch.Tensor,
        data: tuple[np.ndarray, np.ndarray],
        cfg: TrainConfig,
        gen: torch.Generator,
    ) -> TrainResult:
        """One DP-SGD client (every DP-SGD client on CPU, where groups are of one): the group
        path's draws and arithmetic, without a group's padding, masks and per-client loops.
        The weights, the step's gradient and its noise are flat vectors whose parameters are
        views; the clipped sum comes from the layer rules where the model allows
        (``LayerGrads.clipped_sum``), else from per-sample gradients under ``vmap``. Each step:
        Poisson rows ``rand(n) < q``, the clipped sum, Opacus' noise drawn parameter by
        parameter into the flat vector, the division by the expected batch size, and SGD."""
        (xt,), (yt,), (n,) = self._pad([data])
        xt, yt = xt[:n], yt[:n]
        c = self._client(n, cfg, gen)
        init = weights.detach().reshape(-1).to("cpu", self.dtype)
        if init.numel() != self.dim:
            raise ValueError(f"weights have {init.numel()} elements, model has {self.dim}")
        w = init.to(self.device, copy=True)
        views = self._views(w)
        std = cfg.dp_noise_multiplier * cfg.dp_clip
        noise = torch.empty_like(w) if std != 0 else None
        noise_views = self._views(noise) if noise is not None else {}
        center = w.clone() if cfg.prox_mu > 0 else None
        momentum: torch.Tensor | None = None
        spe = 1 if cfg.full_batch else -(-n // c.b)
        loss_sums: list[torch.Tensor] = []  # per step, read back once (as _settle_losses)
        sizes: list[int] = []
        for _ in range(c.total_steps):
            if cfg.full_batch:
                xb, yb = xt, yt
            else:  # Poisson: each sample independently with prob q (LocalTrainer's draw)
                rows = (torch.rand(n, generator=gen, device=gen.device) < c.q).nonzero()
                rows = self._put(rows.reshape(-1))
                xb, yb = xt.index_select(0, rows), yt.index_select(0, rows)
            sizes.append(xb.shape[0])
            if xb.shape[0] > 0:
                sums, losses = self._clipped_sum(views, xb, yb, cfg.dp_clip)
                grad = torch.cat([sums[k].reshape(-1) for k in self.names])
                loss_sums.append(losses.sum())
            else:  # an empty Poisson batch: a noise-only step
                grad = torch.zeros_like(w)
                loss_sums.append(torch.zeros((), device=self.device, dtype=self.dtype))
            if noise is not None:  # Opacus' draws: parameter by parameter, in order
                for k, shape in zip(self.names, self.shapes, strict=True):
                    torch.normal(0.0, std, shape, generator=c.noise_gen, out=noise_views[k])
                grad += noise
            grad /= c.b
            with torch.no_grad():  # torch.optim.SGD's arithmetic, as _sgd_step's
                d = grad
                if center is not None:  # FedProx gradient, after the noise: it touches no data
                    d = d + cfg.prox_mu * (w - center)
                if cfg.weight_decay != 0:
                    d = d + cfg.weight_decay * w
                if cfg.momentum != 0:
                    momentum = d if momentum is None else cfg.momentum * momentum + d
                    d = momentum
                w.sub_(cfg.lr * d)
        c.loss = self._last_epoch_loss(loss_sums, sizes, spe)
        update = w.to("cpu", self.dtype) - init
        norm = clip_update(update, cfg.update_clip)
        return TrainResult(update, n, c.total_steps, c.loss, norm)

    @staticmethod
    def _last_epoch_loss(loss_sums: list[torch.Tensor], sizes: list[int], spe: int) -> float:
        """The mean per-sample loss over the last epoch run, from per-step loss sums."""
        if not loss_sums:
            return float("nan")
        last = (len(loss_sums) - 1) // spe
        total, count = 0.0, 0
        for t, (s, size) in enumerate(zip(torch.stack(loss_sums).tolist(), sizes, strict=True)):
            if t // spe == last:
                total += s
                count += size
        return total / count if count else float("nan")

    def _clipped_sum(self, views, xb, yb, clip: float):
        """One client's clipped per-sample gradient sum (unbatched) and per-sample losses:
        by the layer rules where the model allows, else by vmap."""
        if self._layer_grads is not None:
            try:
                return self._layer_grads.clipped_sum(views, xb, yb, clip)
            except LayerRulesMissed:
                self._layer_grads = None  # this model hides a parameter from the rules
        b = xb.shape[0]
        expanded = {k: v.expand(b, *v.shape) for k, v in views.items()}
        per_sample, losses = self._grads(self._sample_losses_one, expanded, xb, yb)
        return clip_sum(per_sample, self.names, clip), losses

    def _sgd_step(self, params, grads, center, cfg, active, momentum):
        """torch.optim.SGD (dampening 0, no Nesterov) on the active clients only."""
        on = self._put(torch.tensor(active))
        with torch.no_grad():
            if momentum is None and cfg.momentum != 0:
                momentum = {}
            for k in self.names:
                p, d = params[k], grads[k]
                view = (-1,) + (1,) * (p.dim() - 1)
                if center is not None:  # FedProx gradient, after the noise: it touches no data
                    d = d + cfg.prox_mu * (p - center[k])
                if cfg.weight_decay != 0:
                    d = d + cfg.weight_decay * p
                if cfg.momentum != 0:
                    buf = momentum.get(k)
                    if buf is None:  # torch's first step: buf = d (only where a step is taken)
                        buf = torch.where(on.view(view), d, torch.zeros_like(d))
                        started = on.clone()
                    else:
                        started = momentum[k + ".started"]
                        new = torch.where(started.view(view), cfg.momentum * buf + d, d)
                        buf = torch.where(on.view(view), new, buf)
                        started = started | on
                    momentum[k], momentum[k + ".started"] = buf, started
                    d = buf
                params[k] = torch.where(on.view(view), p - cfg.lr * d, p)
        return momentum

    # --------------------------------------------------------------------------- helpers
    def _pad(self, data):
        """All clients' rows in one [G, n_max, ...] tensor (one copy per group call)."""
        xs_list, ys_list, ns = [], [], []
        for x, y in data:
            xt = as_tensor(x).to(self.dtype)
            yt = targets(self.task, as_tensor(y))
            if xt.shape[0] != yt.shape[0]:
                raise ValueError(f"x has {xt.shape[0]} rows, y has {yt.shape[0]}")
            if xt.shape[0] < 1:
                raise ValueError("a client needs at least one sample")
            xs_list.append(xt)
            ys_list.append(yt)
            ns.append(xt.shape[0])
        nmax = max(ns)
        xs = xs_list[0].new_zeros((len(ns), nmax, *xs_list[0].shape[1:]))
        ys = ys_list[0].new_zeros((len(ns), nmax, *ys_list[0].shape[1:]))
        for i, (xt, yt) in enumerate(zip(xs_list, ys_list, strict=True)):
            xs[i, : xt.shape[0]] = xt
            ys[i, : yt.shape[0]] = yt
        return xs.to(self.device), ys.to(self.device), ns

    @staticmethod
    def _index(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pad each client's row indices to the group's largest batch (row 0, masked out)."""
        bmax = max(r.numel() for r in rows)
        idx = torch.zeros(len(rows), bmax, dtype=torch.long)
        mask = torch.zeros(len(rows), bmax, dtype=torch.float32)
        for i, r in enumerate(rows):
            idx[i, : r.numel()] = r
            mask[i, : r.numel()] = 1.0
        return idx, mask

    def _put(self, t: torch.Tensor) -> torch.Tensor:
        """A step's small host tensor (indices, masks) on the device. On CUDA from pinned memory
        and asynchronous: a blocking copy makes the host wait for every kernel queued so far,
        so the next step could not be queued while this one runs."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _gather(self, xs, ys, idx):
        idx = self._put(idx)
        ar = torch.arange(idx.shape[0], device=self.device)[:, None]
        return xs[ar, idx], ys[ar, idx]

    def _unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, off = {}, 0
        for k, shape, size in zip(self.names, self.shapes, self.sizes, strict=True):
            out[k] = flat[:, off : off + size].reshape(flat.shape[0], *shape).clone()
            off += size
        return out

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter as a view of one client's flat vector."""
        out, off = {}, 0
        for k, shape, size in zip(self.names, self.shapes, self.sizes, strict=True):
            out[k] = flat[off : off + size].view(shape)
            off += size
        return out

    def _flatten(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([params[k].reshape(params[k].shape[0], -1) for k in self.names], dim=1)
