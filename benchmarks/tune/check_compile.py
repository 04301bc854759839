"""On the GPU, after `fa4gen tune` ran for the specs here: does `fa4gen.compile` run the plan the
tuner recorded for this GPU, and is that kernel right?

    python benchmarks/tune/check_compile.py d256-causal d128-causal     # FA4GEN_CACHE_DIR: the tuned cache

Per spec it prints whether the compiled kernel's plan is the recorded one, whether the record is
the planner's default, and the largest error against an fp32 reference on fresh random inputs
(B=2, S=1000, 4 heads: a ragged last query tile; the output poisoned with NaN first). Session 25 ran it
(benchmarks/results/2026-12-02-s25e-tune-check.txt).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import fa4gen
from fa4gen import tuning
from fa4gen.arch import Arch
from fa4gen.cache import KernelCache


def check(name: str) -> str:
    spec = fa4gen.load_spec(Path(__file__).parent / f"{name}.yaml")
    kernel = fa4gen.compile(spec)
    recorded = tuning.tuned_plan(KernelCache(None).root, spec, Arch.SM90A, tuning.current_device_name())
    q, k, v = (torch.randn(2, 1000, 4, spec.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    kernel(q, k, v, out=out)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.float().transpose(1, 2) for x in (q, k, v)), is_causal=spec.causal
    ).transpose(1, 2)
    return (f"{name} compile runs the recorded plan: {kernel.plan == recorded} | recorded = planner default: "
            f"{recorded == fa4gen.plan(spec, 'sm_90a')} | max err vs fp32: {(out.float() - ref).abs().max().item():.1e}")


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(check(name), flush=True)
