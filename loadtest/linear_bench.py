"""A decode step's projections: our AMX kernel (``cpu_kernels.AmxLinear``) against oneDNN's
prepacked linear (``cpu_kernels.Linear``), on the built-in model's shapes.

    python -m tandem.loadtest.linear_bench [--tokens 1 8 32 128 512] [--rounds 5] [--two-threads]

Each round runs the 120 projections of a SmolLM2-135M forward pass (30 layers of q/k/v, o,
gate/up and down: 212 MB of bfloat16 weights, one distinct weight per layer, so they stream
from memory as in the engine) once through each implementation, alternating; the medians, the
weight-read rate they imply and their ratio are printed as a Markdown table. One torch thread,
as a worker runs. Needs a CPU with AMX (the kernel's reason is printed otherwise). The gate/up
projection runs as the model runs it: plain for oneDNN, with SwiGLU in the pass for ours (its
activation follows oneDNN's projection, fused, so both rows do the same work).
``--two-threads`` adds our kernel split with its helper thread (``kernel_threads`` 2) to each
round, and its speed-up over one thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable

import torch

from tandem.services.engine import cpu_kernels
from tandem.services.engine.cpu_kernels import AmxLinear, Linear

LAYERS = 30
HIDDEN, INTERMEDIATE, QKV = 576, 1536, 960  # SmolLM2-135M


def step(projections: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]],
         inputs: dict[int, torch.Tensor]) -> float:
    started = time.perf_counter()
    for projection, width in projections:
        projection(inputs[width])
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.loadtest.linear_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 512])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--two-threads", action="store_true",
                        help="also time our kernel with its helper thread")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    reason = cpu_kernels.unavailable_reason()
    kernels = None if reason else cpu_kernels.load()
    if kernels is None or not kernels.amx:
        print(f"no AMX kernel here: {reason or 'this CPU (or Linux) has no AMX'}")
        return 1
    gen = torch.Generator().manual_seed(0)
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN),
              (HIDDEN, INTERMEDIATE)]
    ours: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]] = []
    onednn: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]] = []
    helped: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]] = []
    silu = kernels.silu_mul
    for _ in range(LAYERS):
        for out_features, in_features in shapes:
            weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
            swiglu = out_features == 2 * INTERMEDIATE
            ours.append((AmxLinear.of(kernels, weight, swiglu=swiglu), in_features))
            helped.append((dataclasses.replace(ours[-1][0], threads=2), in_features))
            packed = Linear.of(weight, pack=True)
            onednn.append((packed if not swiglu else
                           (lambda x, p=packed: silu(p(x))), in_features))
    megabytes = sum(o * i * 2 for o, i in shapes) * LAYERS / 1e6
    print(f"{len(ours)} projections, {megabytes:.0f} MB of weights, one thread, medians of "
          f"{args.rounds}\n")
    extra = " ours, 2 threads ms (GB/s) | 1 / 2 threads |" if args.two_threads else ""
    print(f"| tokens | ours ms (GB/s) | oneDNN ms (GB/s) | oneDNN / ours |{extra}")
    print("|---|---|---|---|" + ("---|---|" if args.two_threads else ""))
    for tokens in args.tokens:
        inputs = {w: torch.randn(tokens, w, generator=gen).bfloat16()
                  for w in (HIDDEN, INTERMEDIATE)}
        times: dict[str, list[float]] = {"ours": [], "onednn": [], "helped": []}
        for _ in range(args.rounds):
            times["ours"].append(step(ours, inputs))
            times["onednn"].append(step(onednn, inputs))
            if args.two_threads:
                times["helped"].append(step(helped, inputs))
        a, b = (statistics.median(times[k]) * 1e3 for k in ("ours", "onednn"))
        row = (f"| {tokens} | {a:.1f} ({megabytes / a:.1f}) | {b:.1f} ({megabytes / b:.1f}) | "
               f"{b / a:.2f}x |")
        if args.two_threads:
            c = statistics.median(times["helped"]) * 1e3
            row += f" {c:.1f} ({megabytes / c:.1f}) | {a / c:.2f}x |"
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
