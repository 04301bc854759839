"""Time the backward (and forward + backward) of fa4gen against its peers on one GPU, in one process.

    python benchmarks/backward.py warm [--grid full|quick]            # any machine: compile the kernels
    python benchmarks/backward.py run  [--grid full|quick] [--match gqa8,d64] [--out rows.json]   # on the GPU
    python benchmarks/backward.py report rows.json > table.md
    python benchmarks/backward.py {warm,run} --deterministic [--match d128]   # deterministic mode's cost
    python benchmarks/backward.py {warm,run} --plan tile_m=128,dq_split=m [--match d64]   # a plan A/B
    python benchmarks/backward.py run --deterministic --plan dq_grouped_turns=true --dq-groups 1,2,4,8

Cells follow the forward grid's rule (fa4gen.bench: B x S = 16k tokens, Hq x d = 2048). Peers:
flash-attn-4 (``flash_attn.cute.flash_attn_func`` under autograd), SDPA with the cuDNN and the
flash backends, and FlexAttention on the variant cells; each is skipped where it is not
installed or does not run the cell. The backward is timed alone (fa4gen: the backward kernel on
saved out and LSE; peers: autograd's backward of a recorded forward, graph kept) and with the
forward (all through autograd). TFLOP/s counts 2.5x the forward's useful FLOPs for the backward
(its five matrix products against the forward's two). With --deterministic a run times the
backward kernel alone twice per cell, without and with ``spec.deterministic`` (no peers), and
the report gives its cost. With --plan FIELD=VALUE,... likewise against the backward plan with
those config fields changed (an A/B of one plan option, checked as ``fa4gen.build`` checks plans);
both together change the deterministic plan. --dq-groups times that kernel again with each dQ
group count forced (a run-time choice, fa4gen.backward.dq_groups: nothing recompiles).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fa4gen  # noqa: E402
from fa4gen import bench  # noqa: E402
from fa4gen.api import build_training, training_spec  # noqa: E402
from fa4gen.planner import Plan, backward_plan  # noqa: E402
from fa4gen.spec import AttentionSpec  # noqa: E402

BACKWARD_FLOPS = 2.5
SEQLENS_FULL = (512, 1024, 2048, 4096, 8192, 16384)


def grid(which: str) -> list[bench.BenchCase]:
    seqlens = SEQLENS_FULL if which == "full" else (1024, 4096, 16384)
    cases = []
    for d in (64, 96, 128):
        for causal in (False, True):
            for s in seqlens:
                cases.append(bench.make_case(AttentionSpec(head_dim=d, causal=causal), s))
    for ratio in (4, 8):
        for causal in (False, True):
            for s in seqlens if which == "full" else (4096,):
                cases.append(bench.make_case(AttentionSpec(head_dim=128, qhead_per_kvhead=ratio, causal=causal), s))
    for causal in (False, True):  # past d128: dK and dV split by head-dim columns
        for spec in (
            AttentionSpec(head_dim=192, head_dim_v=128, causal=causal),
            AttentionSpec(head_dim=256, causal=causal),
        ):
            for s in seqlens if which == "full" else (4096,):
                cases.append(bench.make_case(spec, s))
    for spec in (
        AttentionSpec(head_dim=128, causal=True, softcap=30.0),
        AttentionSpec(head_dim=128, causal=True, window_left=1024),
    ):
        cases.append(bench.make_case(spec, 4096))
    return cases


def _cells(args) -> list[bench.BenchCase]:
    """The grid's cells, those whose name contains one of --match's comma-separated words if given."""
    cases = grid(args.grid)
    if args.match:
        cases = [case for case in cases if any(word in case.name for word in args.match.split(","))]
    return cases


def _deterministic(spec: AttentionSpec) -> AttentionSpec:
    return spec.model_copy(update={"deterministic": True})


def _changed_plan(spec: AttentionSpec, changes: str) -> Plan:
    """The backward plan of ``spec`` (with its LSE) with config fields set from "field=value,..."."""
    plan = backward_plan(training_spec(spec))
    fields = type(plan.config).model_fields
    update = {}
    for item in changes.split(","):
        name, _, text = item.partition("=")
        if name not in fields:
            raise SystemExit(f"--plan: {name!r} is not a backward config field ({', '.join(fields)})")
        update[name] = json.loads(text) if text[:1].isdigit() or text in ("true", "false") else text
    return plan.model_copy(update={"config": plan.config.model_copy(update=update)})


def _alternative(spec: AttentionSpec, args, build: bool = False):
    """The backward timed against the default one: deterministic, the changed plan, or both (the
    deterministic spec's plan changed), built into the cache with ``build``, else loaded from it."""
    target = _deterministic(spec) if args.deterministic else spec
    plan = _changed_plan(target, args.plan) if args.plan else backward_plan(training_spec(target))
    if build:
        return fa4gen.build(training_spec(target), "sm_90a", kernel_plan=plan)
    return fa4gen.compile_backward(target, kernel_plan=plan)


def warm(args) -> None:
    for spec in bench.specs_of(_cells(args)):
        if args.deterministic or args.plan:  # the backward alone, both ways, on the forward of the first
            forward, backward = build_training(spec)
            _alternative(spec, args, build=True)
        else:
            fa4gen.build(spec, "sm_90a")  # (fa4gen.compile(spec) looks it up before autograd runs the LSE one)
            forward, backward = build_training(spec)
        print(f"{spec.summary():36} {'compiled' if backward.built_now else 'cached'}", flush=True)


PEERS = ("fa4", "cudnn", "sdpa_flash", "flex")


def _peers(case: bench.BenchCase) -> dict:
    """name -> (q, k, v) -> output under autograd, for the peers installed that run the cell
    (the forward grid's peer functions: fa4gen.bench)."""
    import torch._functorch.config

    # the backward is timed on a kept graph (retain_graph): FlexAttention's compiled backward
    # refuses that while it donates buffers
    torch._functorch.config.donated_buffer = False
    found = {}
    variant = case.spec.softcap is not None or case.spec.left_bound is not None
    for name in PEERS if variant else PEERS[:-1]:  # (FlexAttention's compiles: on the variant cells)
        try:
            function = bench.peer_function(name, case)
        except Exception:  # not installed, or the variant is not supported
            function = None
        if function is not None:
            found[name] = function
    return found


def _output(result):
    return result[0] if isinstance(result, tuple) else result


def _time_autograd(forward, input_sets):
    """(backward ms, forward + backward ms) of ``forward`` under autograd, with a random gradient
    of its output's shape."""
    import torch

    grad = torch.randn_like(_output(forward(*input_sets[0])))

    def step(q, k, v):
        torch.autograd.backward(_output(forward(q, k, v)), grad)

    recorded = [(_output(forward(q, k, v)),) for q, k, v in input_sets]

    def backward_only(out):
        torch.autograd.backward(out, grad, retain_graph=True)

    both = bench.time_ms(step, input_sets, iters=10, warmup=2)
    alone = bench.time_ms(backward_only, recorded, iters=10, warmup=2)
    return alone, both


def _time_dq_groups(kernel, saved, counts: str, flops: float) -> dict:
    """The deterministic backward with each of these dQ group counts forced (fa4gen.backward's
    run-time choice: nothing recompiles), timed on the same saved tensors."""
    import fa4gen.backward as backward_module

    rule, found = backward_module.dq_groups, {}
    for count in (int(c) for c in counts.split(",")):
        backward_module.dq_groups = lambda plan, seqlen_k, count=count: count
        try:
            ms = bench.time_ms(lambda *a: kernel(*a), saved, iters=10, warmup=2)
        finally:
            backward_module.dq_groups = rule
        found[str(count)] = {"bwd_ms": ms, "bwd_tflops": BACKWARD_FLOPS * flops / ms / 1e9}
    return found


def run_case(case: bench.BenchCase, args) -> dict:
    import torch

    spec = case.spec
    sets = [tuple(t.requires_grad_() for t in s) for s in bench.make_inputs(case)]
    dout = torch.randn(case.batch, case.seqlen, case.q_heads, spec.dv, device="cuda", dtype=sets[0][0].dtype)
    flops = case.flops()
    row = {"name": case.name, "batch": case.batch, "seqlen": case.seqlen, "kv_heads": case.kv_heads}
    forward = fa4gen.compile(training_spec(spec))
    backward = fa4gen.compile_backward(spec)
    saved = []
    with torch.no_grad():
        for q, k, v in sets:
            out, lse = forward(q, k, v)
            saved.append((q, k, v, out, dout, lse))
    ms = bench.time_ms(lambda *a: backward(*a), saved, iters=10, warmup=2)
    if args.deterministic or args.plan:  # the same saved tensors, then each way again (order-balanced)
        other = _alternative(spec, args)
        ms_other = bench.time_ms(lambda *a: other(*a), saved, iters=10, warmup=2)
        ms_other = (ms_other + bench.time_ms(lambda *a: other(*a), saved, iters=10, warmup=2)) / 2
        ms = (ms + bench.time_ms(lambda *a: backward(*a), saved, iters=10, warmup=2)) / 2
        row["fa4gen"] = {"bwd_ms": ms, "bwd_tflops": BACKWARD_FLOPS * flops / ms / 1e9}
        row["alternative"] = {"bwd_ms": ms_other, "bwd_tflops": BACKWARD_FLOPS * flops / ms_other / 1e9}
        row["label"] = " ".join(filter(None, ("deterministic" if args.deterministic else "", args.plan)))
        if args.deterministic and args.dq_groups:
            row["groups"] = _time_dq_groups(other, saved, args.dq_groups, flops)
        return row
    kernel = fa4gen.compile(spec)
    _, both = _time_autograd(lambda q, k, v: kernel(q, k, v), sets)
    row["fa4gen"] = {"bwd_ms": ms, "bwd_tflops": BACKWARD_FLOPS * flops / ms / 1e9, "fwdbwd_ms": both}
    for name, peer in _peers(case).items():
        try:
            alone, both = _time_autograd(peer, sets)
        except Exception as exc:  # a peer that does not run the cell
            row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
            continue
        row[name] = {"bwd_ms": alone, "bwd_tflops": BACKWARD_FLOPS * flops / alone / 1e9, "fwdbwd_ms": both}
    return row


def run(args) -> None:
    rows = []
    for case in _cells(args):
        try:
            row = run_case(case, args)
        except fa4gen.CacheMiss as exc:  # (FA4GEN_NO_COMPILE=1 with a cache holding only some cells)
            print(f"{case.name:34} S={case.seqlen:5} skipped: {exc}", flush=True)
            continue
        rows.append(row)
        if "alternative" in row:
            mine, other = row["fa4gen"]["bwd_tflops"], row["alternative"]["bwd_tflops"]
            head = f"{case.name:34} S={case.seqlen:5} B={case.batch:2}"
            groups = "".join(f", {g} groups {v['bwd_tflops']:.0f}" for g, v in row.get("groups", {}).items())
            print(f"{head}  bwd TFLOP/s {mine:.0f}, {row['label']} {other:.0f}{groups}", flush=True)
            continue
        cells = "  ".join(
            f"{name} {row[name]['bwd_tflops']:.0f}/{row[name]['fwdbwd_ms']:.2f}ms"
            if "bwd_tflops" in row[name]
            else f"{name} -"
            for name in ("fa4gen", *PEERS)
            if name in row
        )
        print(f"{case.name:34} S={case.seqlen:5} B={case.batch:2}  bwd TFLOP/s / fwd+bwd: {cells}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"env": _environment(), "rows": rows}, indent=1))


def report(args) -> None:
    """A markdown table of a run's backward TFLOP/s, with fa4gen / peer per cell and a summary."""
    import math

    rows = json.loads(Path(args.rows).read_text())["rows"]
    if any("alternative" in row for row in rows):
        return _report_alternative(rows)
    peers = [p for p in PEERS if any("bwd_tflops" in r.get(p, {}) for r in rows)]
    print(
        "| case | S | B | fa4gen | " + " | ".join(peers) + " | vs flash-attn-4 | vs cuDNN | fwd+bwd vs flash-attn-4 |"
    )
    print("|" + "---|" * (len(peers) + 7))
    ratios: dict[str, list[float]] = {p: [] for p in peers}

    def ratio(row, peer, key="bwd_tflops"):
        mine, theirs = row["fa4gen"].get(key), row.get(peer, {}).get(key)
        if not mine or not theirs:
            return None
        return mine / theirs if key == "bwd_tflops" else theirs / mine

    for row in rows:
        values = [f"{row[p]['bwd_tflops']:.0f}" if "bwd_tflops" in row.get(p, {}) else "-" for p in peers]
        for peer in peers:
            if (r := ratio(row, peer)) is not None:
                ratios[peer].append(r)
        shown = [ratio(row, "fa4"), ratio(row, "cudnn"), ratio(row, "fa4", "fwdbwd_ms")]
        cells = [f"{r:.2f}x" if r is not None else "-" for r in shown]
        print(
            f"| {row['name']} | {row['seqlen']} | {row['batch']} | {row['fa4gen']['bwd_tflops']:.0f} | "
            + " | ".join(values + cells)
            + " |"
        )
    print()
    for peer, found in ratios.items():
        if found:
            mean = math.exp(sum(math.log(r) for r in found) / len(found))
            print(f"- fa4gen / {peer}: min {min(found):.2f}x, geometric mean {mean:.2f}x over {len(found)} cells")


def _report_alternative(rows: list[dict]) -> None:
    """Deterministic mode's cost, or a changed plan's worth, per cell: the backward kernel's
    TFLOP/s by default and the other way."""
    import math

    label = rows[0]["label"]
    groups = list(rows[0].get("groups", {}))  # (--dq-groups: each count / default)
    extra = "".join(f" {g} groups / default |" for g in groups)
    print(f"| case | S | B | backward TFLOP/s | {label} | {label} / default |{extra}")
    print("|---|---|---|---|---|---|" + "---|" * len(groups))
    kept, by_count = [], {g: [] for g in groups}
    for row in rows:
        mine, other = row["fa4gen"]["bwd_tflops"], row["alternative"]["bwd_tflops"]
        kept.append(other / mine)
        cells = f"{mine:.0f} | {other:.0f} | {other / mine:.2f}x"
        for g in groups:
            by_count[g].append(row["groups"][g]["bwd_tflops"] / mine)
            cells += f" | {by_count[g][-1]:.2f}x"
        print(f"| {row['name']} | {row['seqlen']} | {row['batch']} | {cells} |")

    def summary(name: str, found: list[float]) -> str:
        mean = math.exp(sum(map(math.log, found)) / len(found))
        return f"- {name} / default: min {min(found):.2f}x, geometric mean {mean:.2f}x over {len(found)} cells"

    print("\n" + summary(label, kept))
    for g, found in by_count.items():
        print(summary(f"{label}, {g} dQ groups", found))


def _environment() -> dict:
    import torch

    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("warm", "run", "report"))
    parser.add_argument("rows", nargs="?", default="", help="report: the rows a run wrote (--out)")
    parser.add_argument("--grid", choices=("full", "quick"), default="quick")
    parser.add_argument("--out", default="")
    parser.add_argument("--match", default="", help="only cells whose name contains one of these words (a,b)")
    parser.add_argument("--deterministic", action="store_true", help="time deterministic mode's cost (no peers)")
    parser.add_argument("--plan", default="", help="time the backward plan with these config fields changed (f=v,...)")
    parser.add_argument(
        "--dq-groups",
        default="",
        help="with --deterministic --plan dq_grouped_turns=true: also time these dQ group counts (1,2,4)",
    )
    args = parser.parse_args()
    {"warm": warm, "run": run, "report": report}[args.mode](args)


if __name__ == "__main__":
    main()
