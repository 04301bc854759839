"""Compile every kernel the GPU tests need into a cache directory (runs without a GPU).

python tests/warm_gpu_cache.py .devcache/kernels
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_cases import (
    example_specs,
    gpu_specs,
    keyless_cases,
    pair_tail_specs,
    plan_option_cases,  # noqa: E402
    split_tail_cases,
    variant_specs,
)

import fa4gen  # noqa: E402


def main(cache_dir: str) -> None:
    tails = {f"pair-tail/{name}": spec for name, (spec, _) in pair_tail_specs().items()}
    for name, spec in {**gpu_specs(), **variant_specs(), **example_specs(), **tails}.items():
        started = time.perf_counter()
        result = fa4gen.build(spec, "sm_90a", cache_dir=cache_dir)
        state = "compiled" if result.any_built_now else "cached"
        print(f"{name:28} {state:8} {time.perf_counter() - started:6.2f} s  {result.key[:12]}", flush=True)
    planned = {
        **plan_option_cases(),
        **{f"keyless/{name}": case for name, case in keyless_cases().items()},
        **{f"split-tail/{name}": case for name, case in split_tail_cases().items()},
    }
    for name, (spec, plan) in planned.items():
        started = time.perf_counter()
        result = fa4gen.build(spec, "sm_90a", cache_dir=cache_dir, kernel_plan=plan)
        state = "compiled" if result.any_built_now else "cached"
        print(f"{name:28} {state:8} {time.perf_counter() - started:6.2f} s  {result.key[:12]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".devcache/kernels")
