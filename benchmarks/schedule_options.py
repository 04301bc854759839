"""The schedule-option table of BENCHMARKS.md: each plan option flipped away from the planner's
default, timed with cuDNN beside it, in one process on the GPU.

    python benchmarks/schedule_options.py warm     # any machine: compile every variant
    python benchmarks/schedule_options.py run      # on the GPU
"""

from __future__ import annotations

import sys

import fa4gen
from fa4gen import bench

SEQLENS = (4096, 16384, 1024)


def variants() -> list[tuple[str, fa4gen.AttentionSpec, fa4gen.Plan]]:
    out = []
    for d in (64, 128, 256):
        for causal in (False, True):
            spec = fa4gen.AttentionSpec(head_dim=d, causal=causal)
            base = fa4gen.plan(spec)
            out.append(("default", spec, base))
            out.append(("one-shot", spec, base.model_copy(update={"persistent": False})))
            if d <= 128:
                out.append(("no-pingpong", spec, base.model_copy(update={"pingpong": False})))
            out.append(("serial", spec, base.model_copy(update={"pingpong": False, "intra_warpgroup_overlap": False})))
            if d == 64:
                out.append(("2wg", spec, base.model_copy(update={
                    "tile_m": 128, "num_consumer_warpgroups": 2, "producer_regs": 24, "consumer_regs": 240})))
    return out


def main(command: str) -> None:
    if command == "warm":
        for label, spec, plan in variants():
            result = fa4gen.build(spec, "sm_90a", kernel_plan=plan)
            print(f"{label:12} {spec.summary():24} {'compiled' if result.built_now else 'cached'}", flush=True)
        return
    print("matmul ceiling", round(bench.matmul_ceiling_tflops()), flush=True)
    for seqlen in SEQLENS:
        for label, spec, plan in variants():
            case = bench.make_case(spec, seqlen)
            impls = {"fa4gen": fa4gen.compile(spec, kernel_plan=plan)}
            if label == "default":
                impls["cudnn"] = bench.peer_function("cudnn", case)
            print(f"{label:12} {bench.format_row(bench.bench_case(case, impls), list(impls))}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
