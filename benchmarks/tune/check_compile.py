"""On the GPU, after `fa4gen tune` ran for the specs here: does `fa4gen.compile` run the plan the
tuner recorded for this GPU, and is that kernel right?

    python benchmarks/tune/check_compile.py d256-causal d128-causal     # FA4GEN_CACHE_DIR: the tuned cache

Per spec it prints whether the compiled kernel's plan is the recorded one and whether the record
is the planner's default, and checks the output against the fp32 reference on fresh random
inputs of the tuner's shapes (``bench.make_case``/``make_inputs`` at S=1000: a ragged last query
tile), the output poisoned with NaN first (``fa4gen.testing.assert_close_to_reference``: raises
past 2x PyTorch's own error in the spec's dtype). Specs with run-time values (sinks, ALiBi
slopes, documents, ...) are refused before any launch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import fa4gen
from fa4gen import bench, testing, tuning
from fa4gen.arch import Arch
from fa4gen.cache import KernelCache

SEQLEN = 1000  # not a multiple of any tile: a ragged last query tile


def check(name: str) -> str:
    spec = fa4gen.load_spec(Path(__file__).parent / f"{name}.yaml")
    kernel = fa4gen.compile(spec)
    recorded = tuning.tuned_plan(KernelCache(None).root, spec, Arch.SM90A, tuning.current_device_name())
    case = bench.make_case(spec, SEQLEN)  # the tuner's shape family: 16k tokens, model width 2048
    q, k, v = bench.make_inputs(case)[0]
    out = torch.full((*q.shape[:3], spec.dv), float("nan"), device=q.device, dtype=q.dtype)
    kernel(q, k, v, out=out)
    report = testing.assert_close_to_reference(spec, q, k, v, out)
    return (
        f"{name}: compile runs the recorded plan: {kernel.plan == recorded} | recorded = planner default: "
        f"{recorded == fa4gen.plan(spec, 'sm_90a')} | error against fp32 {report['out_err']:.1e} "
        f"(bound {report['out_bound']:.1e})"
    )


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(check(name), flush=True)
