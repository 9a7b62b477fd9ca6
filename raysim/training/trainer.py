"""Local training of one virtual client at a time on a resident model.

A worker builds one model and one ``LocalTrainer`` and then serves thousands of clients:
per client the flat weights are copied into the existing parameters, a fresh (cheap, ~15 us)
SGD/DPOptimizer pair is built so no optimizer state leaks between clients, and the update
comes back as a new flat CPU tensor. All randomness (batch order, Poisson masks, DP noise)
comes from the caller's ``torch.Generator``, so an update is a function of
(weights, data, cfg, generator state) alone, whichever worker computes it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.optim.sgd import sgd

from raysim.models.params import flat_params, load_flat_, num_params, trainable
from raysim.training.config import (
    EvalResult,
    TrainConfig,
    TrainResult,
    clip_update,
    sampling_plan,
    zero_nonfinite_samples,
)
from raysim.training.losses import (
    REGRESSION_LOSSES,
    TASKS,
    as_tensor,
    batch_loss,
    dataset_loss,
    per_sample_loss,
    targets,
)

if TYPE_CHECKING:
    from raysim.training.per_sample import PerSampleGrads


def float32_kernels() -> None:
    """CUDA computes in float32 as the CPU does. PyTorch lets cuDNN convolutions use TF32 (a
    10-bit mantissa) unless told otherwise; on an H200 that gave the Table-2 CNN's gradient a
    relative error of 3e-2 against float64, where float32 kernels give 5e-7, so a GPU run would
    not be the CPU run within float rounding (docs/speed.md, "On a GPU"). Process-wide: a worker's
    process serves its trainers only."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


class LocalTrainer:
    """One resident model per worker: built once, weights loaded in place per client.

    On CPU, convolutional models train and evaluate in channels-last memory format: oneDNN's
    NHWC convolutions and pooling make a batch-16 step of the Table-2 CNN faster (CHANGELOG.md,
    "Speed: the measurement history"). The Opacus path switches back to PyTorch's default
    format, which its per-sample-gradient hooks assume (with channels-last weights its conv
    per-sample gradients are wrong: tests/test_training.py). The flat weight vectors are in
    logical order either way.
    """

    channels_last = True  # False: always PyTorch's default format (the benchmark's plain loop)

    def __init__(
        self,
        model: nn.Module,
        task: str,
        device: torch.device | str = "cpu",
        grad_sample_mode: str = "hooks",
        regression_loss: str = "mse",
    ):
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
        if regression_loss not in REGRESSION_LOSSES:
            raise ValueError(
                f"regression_loss: unknown {regression_loss!r}; allowed: "
                f"{', '.join(REGRESSION_LOSSES)}"
            )
        if regression_loss != "mse" and task != "regression":
            raise ValueError(f"regression_loss={regression_loss!r} needs a regression task")
        # what training minimises per batch and evaluation reports per client (Eq. 14 for rmse)
        self.regression_loss = regression_loss
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.task = task
        self.grad_sample_mode = grad_sample_mode
        self.params = trainable(self.model)  # kept: loading weights per client walks no tree
        self.dim = num_params(self.params)
        self._psg: PerSampleGrads | None = None  # wrapped lazily, on first DP use
        self._device_gen: torch.Generator | None = None
        self.vectorize = True  # train_many may use training.vectorized (False: Opacus always)
        self._vec = None  # VectorizedTrainer, built on first use
        self._convolutional = self.device.type == "cpu" and any(
            isinstance(m, nn.Conv2d) for m in self.model.modules()
        )
        self._format = torch.contiguous_format

    def _use_format(self, fast: bool) -> None:
        """channels-last (fast) or PyTorch's default format for the resident model's weights."""
        want = (
            torch.channels_last
            if fast and self.channels_last and self._convolutional
            else torch.contiguous_format
        )
        if want is not self._format:
            self.model.to(memory_format=want)  # swaps param.data: the Parameters stay the same
            self._format = want

    # ------------------------------------------------------------------ groups
    def train_many(
        self,
        weights: Sequence[torch.Tensor],
        data: Sequence[tuple[np.ndarray, np.ndarray]],
        cfgs: Sequence[TrainConfig],
        generators: Sequence[torch.Generator],
    ) -> list[TrainResult]:
        """A fixed group of clients (decided by the engine from the cohort, never by the worker
        it lands on, so the bits do not depend on the number of workers).

        Vectorized (``training.vectorized``) where it can be and where it pays: DP-SGD (its
        per-sample gradients, by layer rules or ``vmap``, beat Opacus' hooks on CPU), groups
        of two or more clients, any GPU; plain SGD one client at a time on CPU stays here
        (measured faster: see docs/speed.md). Otherwise one ``train`` per client.
        """
        vectorizable = self.vectorize and self.regression_loss == "mse"  # rmse: not per sample
        if vectorizable and (cfgs and (cfgs[0].dp or len(cfgs) > 1 or self.device.type != "cpu")):
            if self._vec is None:
                from raysim.training.vectorized import VectorizedTrainer

                self._vec = VectorizedTrainer(self.model, self.task, self.device)
            if self._vec.unsupported(cfgs) is None:
                return self._vec.train_group(weights, data, cfgs, generators)
        return [
            self.train(w, x, y, c, g)
            for w, (x, y), c, g in zip(weights, data, cfgs, generators, strict=True)
        ]

    def train_one(
        self,
        weights: torch.Tensor,
        x: np.ndarray,
        y: np.ndarray,
        cfg: TrainConfig,
        generator: torch.Generator,
    ) -> TrainResult:
        """One client as a group of one: the vectorized DP-SGD path where it applies (~1.5-1.6x
        Opacus' per client on CPU), else ``train``; same draws either way."""
        return self.train_many([weights], [(x, y)], [cfg], [generator])[0]

    # ------------------------------------------------------------------ training
    def train(
        self,
        weights: torch.Tensor,
        x: np.ndarray,
        y: np.ndarray,
        cfg: TrainConfig,
        generator: torch.Generator,
        prox_center: torch.Tensor | None = None,
    ) -> TrainResult:
        """Run ``cfg.local_epochs`` of (DP-)SGD from ``weights`` on (x, y); return new - init."""
        xt, yt = self._data(x, y)
        n = xt.shape[0]
        plan = sampling_plan(n, cfg)
        init = weights.detach().reshape(-1).to("cpu", torch.float32)
        self._use_format(not cfg.dp)
        load_flat_(self.params, init)
        center = None
        if cfg.prox_mu > 0:  # FedProx: by default, stay close to the weights received
            ref = init if prox_center is None else prox_center.detach().reshape(-1)
            center = self._views(ref.to(self.device, torch.float32))
        self.model.train()
        if cfg.dp and self.regression_loss != "mse":
            raise ValueError(
                "regression_loss: DP-SGD clips per-sample gradients, and an RMSE over a batch "
                "has none; use mse with DP-SGD"
            )
        run = self._run_dp if cfg.dp else self._run_plain
        steps, loss = run(xt, yt, cfg, plan, generator, center)

        update = flat_params(self.params).sub_(init)
        norm = clip_update(update, cfg.update_clip)
        return TrainResult(update, n, steps, loss, norm)

    def _run_plain(self, xt, yt, cfg, plan, gen, center) -> tuple[int, float]:
        momentum: list[torch.Tensor | None] = [None] * len(self.params)
        for p in self.params:
            p.grad = None
        b, steps, loss = plan.expected_batch_size, 0, float("nan")
        for _ in range(cfg.local_epochs):
            if steps >= plan.total_steps:
                break
            order = None
            if not cfg.full_batch:
                order = self._to_dev(torch.randperm(xt.shape[0], generator=gen, device=gen.device))
            total, count = torch.zeros((), device=self.device), 0
            for s in range(plan.steps_per_epoch):
                if steps >= plan.total_steps:
                    break
                idx = None if order is None else order[s * b : (s + 1) * b]
                size = xt.shape[0] if idx is None else idx.numel()
                if self.regression_loss == "rmse":  # not a sum over samples: one backward
                    chunks = self._chunks(xt, yt, idx, cfg.physical_batch_size)
                    losses = torch.cat(
                        [per_sample_loss(self.task, self.model(xb), yb) for xb, yb in chunks]
                    )
                    step_loss = batch_loss(losses, "rmse")
                    step_loss.backward()
                    total += step_loss.detach() * size  # the size-weighted mean of batch RMSEs
                else:
                    for xb, yb in self._chunks(xt, yt, idx, cfg.physical_batch_size):
                        losses = per_sample_loss(self.task, self.model(xb), yb)
                        (losses.sum() / size).backward()
                        total += losses.detach().sum()
                count += size
                self._add_prox(cfg.prox_mu, center)
                self._sgd_step(momentum, cfg)
                steps += 1
            loss = float(total) / count if count else float("nan")
        return steps, loss

    @torch.no_grad()
    def _sgd_step(self, momentum: list[torch.Tensor | None], cfg: TrainConfig) -> None:
        """One step of PyTorch's SGD (``torch.optim.sgd.sgd``, the function ``SGD.step`` calls,
        with the same arguments: the same bits), then the gradients are cleared. Not the
        ``torch.optim.SGD`` class: building any torch.optim optimizer imports torch._dynamo
        (~1.1 s and ~70 MiB in every worker). ``momentum`` holds the buffers across steps."""
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        bufs = [momentum[i] for i in live]
        sgd(
            [self.params[i] for i in live],
            [self.params[i].grad for i in live],
            bufs,
            weight_decay=cfg.weight_decay,
            momentum=cfg.momentum,
            lr=cfg.lr,
            dampening=0.0,
            nesterov=False,
            maximize=False,
        )
        for i, buf in zip(live, bufs, strict=True):
            momentum[i] = buf
        for p in self.params:
            p.grad = None

    def _run_dp(self, xt, yt, cfg, plan, gen, center) -> tuple[int, float]:
        """DP-SGD: per-sample clip to C, sum, add N(0, (zC)^2), divide by the expected batch
        size (Opacus' DPOptimizer). A logical batch is processed in physical chunks: each chunk
        is clipped and summed into ``summed_grad`` (Opacus' virtual-step accumulation), noise
        is drawn once per logical step, so chunking changes neither the result nor the draws."""
        from opacus.optimizers import DPOptimizer  # ~4 s to import: only where DP-SGD runs

        from raysim.training.per_sample import PerSampleGrads

        if self._psg is None:
            self._psg = PerSampleGrads(self.model, self.task, self.grad_sample_mode)
        psg, n = self._psg, xt.shape[0]
        opt = DPOptimizer(
            torch.optim.SGD(
                self.params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
            ),
            noise_multiplier=cfg.dp_noise_multiplier,
            max_grad_norm=cfg.dp_clip,
            expected_batch_size=plan.expected_batch_size,
            generator=self._noise_generator(gen),
        )
        steps, loss = 0, float("nan")
        psg.enable()
        try:
            for _ in range(cfg.local_epochs):
                if steps >= plan.total_steps:
                    break
                total, count = torch.zeros((), device=self.device), 0
                for _ in range(plan.steps_per_epoch):
                    if steps >= plan.total_steps:
                        break
                    idx = None
                    if not cfg.full_batch:  # Poisson: each sample independently with prob q
                        mask = torch.rand(n, generator=gen, device=gen.device) < plan.q
                        idx = self._to_dev(mask.nonzero().reshape(-1))
                    total += self._dp_step(psg, opt, xt, yt, idx, cfg, center)
                    count += n if idx is None else idx.numel()
                    steps += 1
                loss = float(total) / count if count else float("nan")
        finally:
            psg.disable()
            opt.zero_grad(set_to_none=True)
        return steps, loss

    def _dp_step(self, psg, opt, xt, yt, idx, cfg, center) -> torch.Tensor:
        """One logical DP-SGD step over rows ``idx`` (None: all); returns the loss sum."""
        size = xt.shape[0] if idx is None else idx.numel()
        last = -(-size // cfg.physical_batch_size) - 1
        total = torch.zeros((), device=self.device)
        if size == 0:
            psg.set_empty()  # an empty Poisson batch still takes a noise-only step
        for i, (xb, yb) in enumerate(self._chunks(xt, yt, idx, cfg.physical_batch_size)):
            total += psg(xb, yb).sum()
            zero_nonfinite_samples(self.params)
            if i < last:  # clip this chunk into summed_grad, free its per-sample grads
                opt.clip_and_accumulate()
                for p in self.params:
                    p.grad_sample, p.grad = None, None
        opt.pre_step()  # clip the last chunk, add noise once, divide by the expected batch size
        self._add_prox(cfg.prox_mu, center)
        opt.original_optimizer.step()
        opt.zero_grad(set_to_none=True)
        return total

    # ---------------------------------------------------------------- evaluation
    def eval_rows(self) -> int:
        """Rows per forward pass when nothing is trained (evaluate, evaluate_many, scores): 256 on
        CPU, where the Table-2 CNN's forward pass peaks (~90 GFLOP/s against ~70 at 1,024, whose
        activations spill the 4 MiB L2; and at 1,024 rows its first convolution's 51 MB output is
        above glibc's largest heap threshold, so it is a fresh mmap faulted in page by page at
        every batch: docs/speed.md), 1024 on a GPU."""
        return 256 if self.device.type == "cpu" else 1024

    @torch.no_grad()
    def evaluate(
        self, weights: torch.Tensor, x: np.ndarray, y: np.ndarray, batch_size: int | None = None
    ) -> EvalResult:
        """Mean loss and accuracy (None for regression) of ``weights`` on (x, y)."""
        xt, yt = self._data(x, y)
        load_flat_(self.params, weights)
        rows = batch_size or self.eval_rows()
        loss, correct = self._eval(xt, yt, rows, with_acc=self.task == "classification")
        n = xt.shape[0]
        acc = None if self.task != "classification" else (correct / n if n else float("nan"))
        return EvalResult(loss, acc, n)

    @torch.no_grad()
    def evaluate_many(
        self,
        weights: torch.Tensor,
        data: Sequence[tuple[np.ndarray, np.ndarray]],
        batch_size: int | None = None,
    ) -> list[EvalResult]:
        """``evaluate`` of one model on each (x, y), in shared forward passes: the datasets are
        packed in order into batches of up to ``batch_size`` rows (one larger than that is cut
        in such batches). Thousands of clients with a few test samples each then cost a few
        large batches instead of thousands of small ones (a W client's 10 images took ~2 ms,
        mostly overhead). A row's output depends on the rows beside it by rounding only (~1e-7):
        the caller fixes which datasets go together (the engine's evaluation groups, cut from
        client ids), so the bits do not depend on the workers. Default batch: ``eval_rows``."""
        batch_size = batch_size or self.eval_rows()
        sizes = [len(y) for _, y in data]
        load_flat_(self.params, weights)
        results: list[EvalResult] = []
        start = 0
        while start < len(data):
            stop, rows = start + 1, sizes[start]
            while stop < len(data) and rows + sizes[stop] <= batch_size:
                rows, stop = rows + sizes[stop], stop + 1
            results += self._evaluate_packed(data[start:stop], sizes[start:stop], batch_size)
            start = stop
        return results

    def _evaluate_packed(
        self, data: Sequence[tuple[np.ndarray, np.ndarray]], sizes: list[int], batch_size: int
    ) -> list[EvalResult]:
        xt = torch.cat([as_tensor(x) for x, _ in data]).to(self.device, torch.float32)
        yt = targets(self.task, torch.cat([as_tensor(y) for _, y in data]).to(self.device))
        with_acc = self.task == "classification"
        losses, hits = [], []
        for out, yb in self._outputs(xt, yt, batch_size):
            losses.append(per_sample_loss(self.task, out, yb).double())
            if with_acc:
                hits.append(out.argmax(1) == yb)
        loss = torch.cat(losses).split(sizes) if losses else [torch.zeros(0)] * len(sizes)
        hit = torch.cat(hits).split(sizes) if hits else [None] * len(sizes)
        results = []
        for n, ls, h in zip(sizes, loss, hit, strict=True):
            mean = dataset_loss(float(ls.sum()), n, self.regression_loss)
            acc = None if not with_acc else (int(h.sum()) / n if n else float("nan"))
            results.append(EvalResult(mean, acc, n))
        return results

    @torch.no_grad()
    def scores(
        self,
        weights_list: Sequence[torch.Tensor],
        x: np.ndarray,
        y: np.ndarray,
        loss_clip: float | None = None,
        batch_size: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Mean (per-sample clipped to [0, loss_clip]) loss and accuracy of each model on (x, y):
        what a client scores the cluster models by (no copy of the data). Under ``rmse`` the
        loss is Eq. 14 over (x, y), the root of the mean of the clipped squared errors."""
        xt, yt = self._data(x, y)
        batch_size = batch_size or self.eval_rows()
        losses = np.empty(len(weights_list), dtype=np.float64)
        accs = np.zeros(len(weights_list), dtype=np.float64)
        with_acc = self.task == "classification"
        for k, w in enumerate(weights_list):
            load_flat_(self.params, w)
            losses[k], correct = self._eval(xt, yt, batch_size, with_acc, loss_clip)
            accs[k] = correct / xt.shape[0] if xt.shape[0] else float("nan")
        return losses, accs

    @torch.no_grad()
    def _eval(
        self, xt, yt, batch_size: int, with_acc: bool, loss_clip: float | None = None
    ) -> tuple[float, int]:
        total, correct = torch.zeros((), dtype=torch.float64, device=self.device), 0
        for out, yb in self._outputs(xt, yt, batch_size):
            loss = per_sample_loss(self.task, out, yb)
            if (
                loss_clip is not None
            ):  # bounded whatever the model: a non-finite loss counts as the clip
                loss = loss.nan_to_num(loss_clip, loss_clip, loss_clip).clamp(0, loss_clip)
            total += loss.sum(dtype=torch.float64)
            if with_acc:
                correct += int((out.argmax(1) == yb).sum())
        return dataset_loss(float(total), xt.shape[0], self.regression_loss), correct

    def _outputs(
        self, xt: torch.Tensor, yt: torch.Tensor, batch_size: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The model's outputs in eval mode (no gradients), batch by batch, with the targets."""
        self._use_format(True)
        self.model.eval()
        for xb, yb in self._chunks(xt, yt, None, batch_size):
            yield self.model(xb), yb

    # ------------------------------------------------------------------- helpers
    def _data(self, x, y) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole client dataset as tensors on the device; zero-copy on CPU for float32 x."""
        xt = as_tensor(x).to(self.device, torch.float32)
        yt = targets(self.task, as_tensor(y).to(self.device))
        if xt.shape[0] != yt.shape[0]:
            raise ValueError(f"x has {xt.shape[0]} rows, y has {yt.shape[0]}")
        return xt, yt

    def _chunks(
        self, xt: torch.Tensor, yt: torch.Tensor, idx: torch.Tensor | None, size: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Physical batches: slices (no copy) when ``idx`` is None, else gathered rows."""
        n = xt.shape[0] if idx is None else idx.numel()
        for i in range(0, n, size):
            if idx is None:
                yield xt[i : i + size], yt[i : i + size]
            else:
                j = idx[i : i + size]
                yield xt.index_select(0, j), yt.index_select(0, j)

    def _to_dev(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

    def _views(self, vec: torch.Tensor) -> list[torch.Tensor]:
        if vec.numel() != self.dim:
            raise ValueError(f"prox_center has {vec.numel()} elements, model has {self.dim}")
        out, off = [], 0
        for p in self.params:
            out.append(vec[off : off + p.numel()].view_as(p))
            off += p.numel()
        return out

    def _add_prox(self, mu: float, center: list[torch.Tensor] | None) -> None:
        """Gradient of mu/2 ||w - center||^2, added after DP noise: it touches no data."""
        if center is None:
            return
        with torch.no_grad():
            for p, c in zip(self.params, center, strict=True):
                p.grad.add_(p, alpha=mu).sub_(c, alpha=mu)

    def _noise_generator(self, gen: torch.Generator) -> torch.Generator:
        """Noise must be drawn on the parameters' device. A CPU generator driving a GPU model
        seeds a resident device generator from one draw, so results stay a function of the
        caller's seed (CUDA and CPU bits differ anyway)."""
        if gen.device.type == self.device.type:
            return gen
        if self._device_gen is None:
            self._device_gen = torch.Generator(device=self.device)
        seed = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device))
        return self._device_gen.manual_seed(seed)
