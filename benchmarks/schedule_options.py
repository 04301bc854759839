"""The schedule-option table of BENCHMARKS.md: each plan option flipped away from the planner's
default, timed with cuDNN beside it, in one process on the GPU.

    python benchmarks/schedule_options.py warm     # any machine: compile every variant
    python benchmarks/schedule_options.py run      # on the GPU
    python benchmarks/schedule_options.py run 1024,2048 default,heavy-first   # some seqlens / rows
    python benchmarks/schedule_options.py ab 4096,16384 default,long   # two rows, A B fa4 B A
    python benchmarks/schedule_options.py ab 4096 default,no-pingpong "window[(]128"  # specs whose summary matches
    python benchmarks/schedule_options.py combine AB.txt BA.txt        # both orders of an ab: B/A
"""

from __future__ import annotations

import math
import re
import sys

import fa4gen
from fa4gen import bench

SEQLENS = (4096, 16384, 1024)


def variants() -> list[tuple[str, fa4gen.AttentionSpec, fa4gen.Plan]]:
    """(label, spec, plan) of every row: the planner's plans and single flips of them (flips the
    kernel cannot run, by config_problem, are left out)."""
    from fa4gen.planner import plan_problem, seqlen_splits
    from fa4gen.planner.candidates import sm90_fits, sm90_refit
    from fa4gen.planner.sm90_tables import NO_PAIR_TAIL, SM90_REGISTER_SPLIT

    out = []

    def add(label: str, spec: fa4gen.AttentionSpec, plan: fa4gen.Plan) -> None:
        if not plan_problem(plan):
            out.append((label, spec, plan))

    dense = [
        fa4gen.AttentionSpec(head_dim=d, head_dim_v=dv, causal=causal)
        for d, dv in ((64, None), (96, None), (128, None), (192, 128), (256, None))
        for causal in (False, True)
    ]
    window = fa4gen.AttentionSpec(head_dim=128, causal=True, window_left=1024)
    alibi = fa4gen.AttentionSpec(head_dim=128, causal=True, score_mod="alibi")  # a score_mod in every loop body
    # GPT-OSS's sliding layers without the sinks: every query tile sees two key tiles
    narrow = fa4gen.AttentionSpec(head_dim=64, qhead_per_kvhead=8, causal=True, window_left=128)
    for spec in (*dense, window, alibi, narrow):
        d = spec.head_dim
        base = fa4gen.plan(spec)
        c = base.config
        add("default", spec, base)
        for split in seqlen_splits(spec):  # the planner's plans for length ranges, and flips of them
            add(split.label, spec, split.plan)
            add(
                f"{split.label}+pingpong-flip",
                spec,
                split.plan.with_config("ping-pong flipped", pingpong=not split.plan.config.pingpong),
            )
            if split.plan.config.q_stages == 2:
                add(f"{split.label}+one-q", spec, split.plan.with_config("one Q buffer", q_stages=1))
        narrower = base.with_config("16 fewer keys per tile", tile_n=c.tile_n - 16)
        if sm90_fits(narrower):  # short causal sequences: less of the diagonal computed and thrown away
            add("tile_n-16", spec, narrower)
        for step in (16, 32):  # giving up Q and O buffers where they no longer fit
            why = f"{step} more keys per tile"
            wider = sm90_refit(base.with_config(why, tile_n=c.tile_n + step), why)
            if sm90_fits(wider):
                add(f"tile_n+{step}", spec, wider)
        if c.q_stages == 2:
            add("one-q", spec, base.with_config("one Q buffer", q_stages=1))
        if c.tile_order == "paired":  # over all heads at once
            add(
                "heavy-first",
                spec,
                base.with_config("causal tiles heaviest first", tile_order="heavy_first", **NO_PAIR_TAIL),
            )
        if c.o_staging != "own":  # smaller key tiles that leave room for O's own buffer: Q is then
            for tile_n in (c.tile_n - 16, c.tile_n - 32):  # freed before the epilogue, not after
                freed = base.with_config(f"{tile_n}-key tiles with O in its own buffer", tile_n=tile_n, o_staging="own")
                if sm90_fits(freed):
                    add(f"n{tile_n}-own-o", spec, freed)
        if d <= 128:
            add("no-pingpong", spec, base.with_config("no ping-pong", pingpong=False))
        else:  # warpgroups that take turns also stagger their tile changes
            add("pingpong", spec, base.with_config("ping-pong", pingpong=True))
        if c.mask_runs:  # one loop over the key tiles, a mask flag per tile (before session 6)
            add("mask-flags", spec, base.with_config("a mask flag per key tile", mask_runs=False))
        if c.num_consumer_warpgroups == 3:  # 2 warpgroups: P back in registers, two Q buffers if they fit
            producer_regs, consumer_regs = SM90_REGISTER_SPLIT[2]
            two = base.with_config(
                "2 consumer warpgroups",
                num_consumer_warpgroups=2,
                producer_regs=producer_regs,
                consumer_regs=consumer_regs,
                p_in_registers=True,
                q_stages=2,
            )
            if not sm90_fits(two):
                two = two.with_config("one Q buffer", q_stages=1)
            add("2wg", spec, two)
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


def ab(seqlens: tuple[int, ...], label_a: str, label_b: str, only: str = "") -> None:
    """Every spec with both rows (whose summary matches the regular expression ``only``): A, B,
    flash-attn-4, B, A timed on the same inputs in one bench_case, so linear drift of the shared
    GPU favours neither; prints B's mean over A's."""
    print("matmul ceiling", round(bench.matmul_ceiling_tflops()), flush=True)
    plans: dict[str, dict[str, fa4gen.Plan]] = {}
    specs = {}
    for label, spec, plan in variants():
        plans.setdefault(spec.summary(), {})[label] = plan
        specs[spec.summary()] = spec
    for seqlen in seqlens:
        for name, by_label in plans.items():
            if label_a not in by_label or label_b not in by_label or not re.search(only, name):
                continue
            case = bench.make_case(specs[name], seqlen)
            a, b = (fa4gen.compile(specs[name], kernel_plan=by_label[label]) for label in (label_a, label_b))
            impls = {
                label_a: a,
                label_b: b,
                "fa4": bench.peer_function("fa4", case),
                f"{label_b}'": b,
                f"{label_a}'": a,
            }
            row = bench.bench_case(case, impls)
            gain = (row[label_b] + row[f"{label_b}'"]) / (row[label_a] + row[f"{label_a}'"])
            q, k, v = bench.make_inputs(case)[0]  # both plans compute the same attention
            differ = (a(q, k, v).float() - b(q, k, v).float()).abs().max().item()
            print(
                f"{bench.format_row(row, list(impls))}  {label_b}/{label_a}={gain:.3f} max|A-B|={differ:.1e}",
                flush=True,
            )


RATIO = re.compile(r"^(?P<spec>\S.*?)\s+S=(?P<seqlen>\d+)\s.*\s(?P<b>[\w+-]+)/(?P<a>[\w+-]+)=(?P<ratio>[\d.]+)")


def combine(first: str, second: str) -> None:
    """Two ab outputs with the labels in both orders: per cell, B over A as the geometric mean of
    the first file's ratio and the inverted second's (the position effect cancels), then overall."""
    cells: dict[tuple[str, str], list[float]] = {}
    names = None
    for path, invert in ((first, False), (second, True)):
        for line in open(path):
            m = RATIO.match(line)
            if m:
                ratio = float(m["ratio"])
                names = names or (m["b"], m["a"])
                cells.setdefault((m["spec"].strip(), m["seqlen"]), []).append(1 / ratio if invert else ratio)
    both = {cell: math.sqrt(r[0] * r[1]) for cell, r in cells.items() if len(r) == 2}
    for (spec, seqlen), ratio in both.items():
        print(f"{spec:36} S={seqlen:>6}  {names[0]}/{names[1]}={ratio:.3f}")
    if both:
        mean = math.exp(sum(map(math.log, both.values())) / len(both))
        print(
            f"geometric mean over {len(both)} cells: {mean:.3f} (min {min(both.values()):.3f}, "
            f"max {max(both.values()):.3f})"
        )


if __name__ == "__main__":
    argv = sys.argv[1:] + [""] * 3
    if argv[0] == "combine":  # schedule_options.py combine AB.txt BA.txt
        combine(argv[1], argv[2])
    elif argv[0] == "ab":  # schedule_options.py ab SEQLENS LABEL_A,LABEL_B [SPEC_SUBSTRING]
        ab(tuple(int(s) for s in argv[1].split(",")), *argv[2].split(","), argv[3])
    else:
        main(
            argv[0] or "run",
            tuple(int(s) for s in argv[1].split(",")) if argv[1] else SEQLENS,
            tuple(argv[2].split(",")) if argv[2] else (),
        )
