"""The schedule-option table of BENCHMARKS.md: each plan option flipped away from the planner's
default, timed with cuDNN beside it, in one process on the GPU.

    python benchmarks/schedule_options.py warm     # any machine: compile every variant
    python benchmarks/schedule_options.py run      # on the GPU
    python benchmarks/schedule_options.py run 1024,2048 default,heavy-first   # some seqlens / rows
"""

from __future__ import annotations

import sys

import fa4gen
from fa4gen import bench
from fa4gen.arch import Arch

SEQLENS = (4096, 16384, 1024)


def variants() -> list[tuple[str, fa4gen.AttentionSpec, fa4gen.Plan]]:
    out = []
    from fa4gen.planner import sm90_fits, sm90_refit, sm90_variant

    for d, dv in ((64, None), (96, None), (128, None), (192, 128), (256, None)):
        for causal in (False, True):
            spec = fa4gen.AttentionSpec(head_dim=d, head_dim_v=dv, causal=causal)
            base = fa4gen.plan(spec)
            out.append(("default", spec, base))
            out.append(("one-shot", spec, base.model_copy(update={"persistent": False})))
            for step in (16, 32):  # giving up Q and O buffers where they no longer fit
                wider = sm90_refit(sm90_variant(base, f"{step} more keys per tile", tile_n=base.tile_n + step),
                                   f"{step} more keys per tile")
                if sm90_fits(wider):
                    out.append((f"tile_n+{step}", spec, wider))
            if base.q_stages == 2:
                out.append(("one-q", spec, base.model_copy(update={"q_stages": 1})))
            if base.tile_order == "paired":
                heavy = base.model_copy(update={"tile_order": "heavy_first"})
                out.append(("heavy-first", spec, heavy))  # over all heads at once
                groups = heavy.model_copy(update={"l2_group_bytes": Arch.SM90A.caps.l2_bytes})
                out.append(("heavy-groups", spec, groups))  # heads in L2-sized groups
                out.append(("groups-one-shot", spec, groups.model_copy(update={"persistent": False})))
            if not causal:  # the CTAs of a head read different K/V tiles at a time
                out.append(("rotated", spec, base.model_copy(update={"rotate_key_tiles": True})))
            if d <= 128:
                out.append(("no-pingpong", spec, base.model_copy(update={"pingpong": False})))
            out.append(("serial", spec, base.model_copy(update={"pingpong": False, "intra_warpgroup_overlap": False})))
            if base.num_consumer_warpgroups == 3:  # 2 warpgroups: P back in registers, two Q buffers if they fit
                two = sm90_variant(base, "2 consumer warpgroups", tile_m=128, num_consumer_warpgroups=2,
                                    producer_regs=24, consumer_regs=240, p_in_registers=True, q_stages=2)
                if not sm90_fits(two):
                    two = sm90_variant(two, "one Q buffer", q_stages=1)
                out.append(("2wg", spec, two))
    return out


def main(command: str, seqlens: tuple[int, ...] = SEQLENS, labels: tuple[str, ...] = ()) -> None:
    if command == "warm":
        for label, spec, plan in variants():
            if labels and label not in labels:
                continue
            result = fa4gen.build(spec, "sm_90a", kernel_plan=plan)
            print(f"{label:12} {spec.summary():24} {'compiled' if result.built_now else 'cached'}", flush=True)
        return
    print("matmul ceiling", round(bench.matmul_ceiling_tflops()), flush=True)
    for seqlen in seqlens:
        for label, spec, plan in variants():
            if labels and label not in labels:
                continue
            case = bench.make_case(spec, seqlen)
            impls = {"fa4gen": fa4gen.compile(spec, kernel_plan=plan)}
            if label == "default":
                impls["cudnn"] = bench.peer_function("cudnn", case)
            print(f"{label:12} {bench.format_row(bench.bench_case(case, impls), list(impls))}", flush=True)


if __name__ == "__main__":
    argv = sys.argv[1:] + [""] * 3
    main(argv[0] or "run", tuple(int(s) for s in argv[1].split(",")) if argv[1] else SEQLENS,
         tuple(argv[2].split(",")) if argv[2] else ())
