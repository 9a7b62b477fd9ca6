"""How close to the matmul peak can a W round get? One batch-16 training step of the Table-2 CNN,
alone on one core (channels-last, as the engine runs it), against that core's matmul peak; and
the share of the step's time spent in the convolution kernels, which hold 99% of its counted
FLOPs. A round can at best reach the step's fraction: it also loads each client's data and
weights, updates them and runs the server step.

    python benchmarks/step_ceiling.py [--reps 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from engine_vs_loop import peak_gflops  # beside this script: the benchmark's own peak
from torch.nn import functional as F
from torch.profiler import profile
from torch.utils.flop_counter import FlopCounterMode

from raysim.models import build_model

CONV_OPS = ("aten::mkldnn_convolution", "aten::convolution_backward")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    one, two = peak_gflops(1), peak_gflops(2)
    torch.set_num_threads(1)
    model = build_model("cnn", (1, 28, 28), 10).to(memory_format=torch.channels_last)
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    for _ in range(30):
        step()
    best = float("inf")
    for _ in range(args.reps):
        t = time.perf_counter()
        for _ in range(200):
            step()
        best = min(best, (time.perf_counter() - t) / 200)
    with profile() as prof:
        for _ in range(100):
            step()
    events = prof.key_averages()
    conv = sum(e.self_cpu_time_total for e in events if e.key in CONV_OPS)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"matmul peak: 1 thread {one:.0f} GFLOP/s, 2 threads {two:.0f} ({two / one:.2f}x)")
    print(
        f"batch-16 step, 1 thread: {best * 1e3:.2f} ms, {flops / best / 1e9:.0f} GFLOP/s, "
        f"{100 * flops / best / 1e9 / one:.0f}% of one thread's peak"
    )
    print(f"convolution kernels: {100 * conv / total:.0f}% of the step's time (profiled)")


if __name__ == "__main__":
    main()
