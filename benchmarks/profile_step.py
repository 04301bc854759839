"""Where a training step's time goes at short sequences: one forward + backward through autograd
of fa4gen (the custom op) against the same step's kernel time, with torch.profiler's CPU and CUDA
totals per op. Runs on the GPU machine from a warmed cache:

    python benchmarks/profile_step.py [--head-dim 128] [--causal] [--seqlen 1024] [--batch 16] [--python]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fa4gen  # noqa: E402
from fa4gen.spec import AttentionSpec  # noqa: E402


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--python", action="store_true", help="also cProfile the host's Python per step")
    args = parser.parse_args()
    spec = AttentionSpec(head_dim=args.head_dim, causal=args.causal)
    heads = 2048 // args.head_dim
    attn = fa4gen.compile(spec)
    shape = (args.batch, args.seqlen, heads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step():
        torch.autograd.backward(attn(q, k, v), grad)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    rounds = 50
    start = time.perf_counter()
    for _ in range(rounds):
        step()
    host = (time.perf_counter() - start) / rounds  # host time per step, launches queued
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / rounds
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 10 / 1e3  # ms per step
    summary = f"{spec.summary()} B={args.batch} S={args.seqlen}"
    print(f"{summary}: wall {wall * 1e3:.3f} ms/step, host {host * 1e3:.3f}, GPU kernels {gpu:.3f}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if args.python:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        for _ in range(rounds):
            step()
        profile.disable()
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
