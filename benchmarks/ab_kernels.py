"""Kernels of two source trees side by side on the GPU: the same plans built by a baseline commit
and by the working tree, timed on the same inputs in alternating order, outputs compared.

    git worktree add /tmp/base be7e649                                # any machine
    PYTHONPATH=/tmp/base python benchmarks/ab_kernels.py build .devcache/ab-old [REGEX]
    python benchmarks/ab_kernels.py build .devcache/ab-new [REGEX]
    python benchmarks/ab_kernels.py build .devcache/ab-t176 'd128 causal' tile_n=176   # a plan variant
    python benchmarks/ab_kernels.py run .devcache/ab-old .devcache/ab-new [ROUNDS]    # on the GPU
    python benchmarks/ab_kernels.py run .devcache/ab-old current [ROUNDS [REGEX]]   # new: the kernel cache
    python benchmarks/ab_kernels.py both .devcache/ab-a .devcache/ab-b [ROUNDS [REGEX]]  # both orders, combined
    python benchmarks/ab_kernels.py combine A-B.log B-A.log       # the same from two ``run`` logs

``build`` compiles, with whichever fa4gen the interpreter imports, the kernels of some grid cells
(each cell's plan as the planner picks it for its length) and of the variants
(benchmarks/variants.py), plus the dense causal kernel the documents compare with (only
the labels REGEX matches, if given), and copies each entry under DIR by label (DIR/index.json).
With FIELD=VALUE arguments each plan has those config fields (fa4gen.kernels.sm90.config)
changed and is refitted to shared memory as ``fa4gen tune``'s candidates are (Plan.with_config,
planner.candidates.sm90_refit: e.g. tile_n=176 gives up the second Q buffer and stages O over V),
so one tree measures a plan variant against its own plans.
``run`` loads the old side by path (no cache lookup, so the tree on the GPU machine need not
match it) and the new side likewise, or with ``current`` through fa4gen.compile (the working
tree's plans, from FA4GEN_CACHE_DIR); checks that both give the same output, times ROUNDS rounds
of each (order alternating), and prints new/old per label, the geometric mean, and packed
documents against the dense causal kernel per useful FLOP; each grid cell's new kernel is also
checked against the fp32 reference (first batch entry and KV head). ``both`` runs a pair in both
orders (A as old, then B as old) and prints B/A per label from each, their geometric mean (each
order's position bias cancels) and the mean over the labels: the figure an A/B is decided by;
``combine`` prints the same from the logs of two ``run`` calls.
Session 9 (2026-12-01-u-* in benchmarks/results) measured its masking changes this way.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import fa4gen
from fa4gen import bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
import variants as V  # noqa: E402

CELLS = [
    (dict(head_dim=64), (512, 1024, 2048, 4096, 16384)),
    (dict(head_dim=128), (512, 1024, 2048, 4096, 8192, 16384)),
    (dict(head_dim=128, qhead_per_kvhead=4), (1024, 4096)),
    (dict(head_dim=128, qhead_per_kvhead=8), (1024, 2048)),
    (dict(head_dim=192, head_dim_v=128), (512, 1024, 2048, 4096, 16384)),
    (dict(head_dim=256), (512, 1024, 2048, 4096, 8192, 16384)),
    (dict(head_dim=96), (512, 1024, 2048, 4096, 8192, 16384)),
    (dict(head_dim=96, causal=True), (4096, 16384)),
    (dict(head_dim=64, causal=True), (512, 1024, 2048, 4096, 8192, 16384)),
    (dict(head_dim=192, head_dim_v=128, causal=True), (512, 1024, 4096, 16384)),
    (dict(head_dim=256, causal=True), (512, 1024, 2048, 4096, 8192, 16384)),
    (dict(head_dim=128, causal=True, window_left=1024), (4096,)),
    (dict(head_dim=128, causal=True), (512, 1024, 16384)),
    (dict(head_dim=128, return_lse=True), (512, 2048, 16384)),  # a training forward: O and LSE
]
DENSE = "dense causal at the document length"


def _cell_plan(spec: fa4gen.AttentionSpec, seqlen: int) -> fa4gen.Plan:
    from fa4gen.planner import seqlen_splits

    split = next((s for s in seqlen_splits(spec) if s.covers(seqlen)), None)
    return split.plan if split else fa4gen.plan(spec, "sm_90a")


def _dense_spec() -> fa4gen.AttentionSpec:
    return V._spec("packed-documents", mask=None)


def _targets() -> list[tuple[str, fa4gen.AttentionSpec, fa4gen.Plan]]:
    out = []
    for fields, seqlens in CELLS:
        spec = fa4gen.AttentionSpec(**fields)
        out += [(f"{spec.summary()} S={s}", spec, _cell_plan(spec, s)) for s in seqlens]
    out += [(v.name, v.spec, fa4gen.plan(v.spec, "sm_90a")) for v in V.variants()]
    return out + [(DENSE, _dense_spec(), fa4gen.plan(_dense_spec(), "sm_90a"))]


def _changed(plan: fa4gen.Plan, changes: dict) -> fa4gen.Plan:
    """``plan`` with ``changes`` (config fields) applied and refitted to shared memory."""
    if not changes:
        return plan
    from fa4gen.planner import plan_problem
    from fa4gen.planner.candidates import sm90_refit

    unknown = sorted(set(changes) - set(type(plan.config).model_fields))
    if unknown:
        sys.exit(f"not config fields: {', '.join(unknown)}")
    why = ", ".join(f"{field}={value}" for field, value in changes.items())
    changed = sm90_refit(plan.with_config(why, **changes), why)
    problem = plan_problem(changed)
    if problem:
        sys.exit(f"{why}: {problem}")
    return changed


def _field_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def build(directory: Path, pattern: str = "", changes: dict | None = None) -> None:
    index = {}
    for label, spec, plan in _targets():
        if not re.search(pattern, label):
            continue
        plan = _changed(plan, changes or {})
        entry = fa4gen.build(spec, "sm_90a", kernel_plan=plan).entry.path
        target = directory / entry.name
        if not target.exists():
            shutil.copytree(entry, target)
        index[label] = {"entry": entry.name, "spec": spec.model_dump(mode="json")}
        c = getattr(plan, "config", plan)  # (a baseline tree's Plan may hold its fields itself)
        print(
            f"{label:45} {entry.name[:12]} tile {c.tile_m}x{c.tile_n}, {c.kv_stages} K/V stages, "
            f"{c.q_stages} Q, O {c.o_staging}",
            flush=True,
        )
    (directory / "index.json").write_text(json.dumps(index, indent=1))


def _load(directory: Path | None, label: str):
    """The kernel of ``label`` from a ``build`` directory, or (None) the kernel cache's."""
    from fa4gen.runtime import AttentionKernel, load_function

    if directory is None:
        spec, plan = next((spec, plan) for name, spec, plan in _targets() if name == label)
        return fa4gen.compile(spec, kernel_plan=plan)
    item = json.loads((directory / "index.json").read_text())[label]
    path = directory / item["entry"]
    spec = fa4gen.AttentionSpec.model_validate(item["spec"])
    plan = _stored_plan(json.loads((path / "plan.json").read_text()))
    return AttentionKernel(spec=spec, plan=plan, function=load_function(path, "cu13"), key=path.name, path=path)


def _stored_plan(data: dict) -> fa4gen.Plan:
    """A build's plan.json as today's Plan, unvalidated: a baseline's may predate or outlive
    config fields, or (before Sm90FwdConfig) hold them in the plan itself; the runtime reads only
    the tile sizes and the split tail's from it."""
    from fa4gen.kernels.sm90.config import Sm90FwdConfig

    fields = data.get("config", data)
    config = Sm90FwdConfig.model_construct(**{k: v for k, v in fields.items() if k in Sm90FwdConfig.model_fields})
    return fa4gen.Plan.model_construct(
        arch=data.get("arch", "sm_90a"), kernel=data.get("kernel", ""), config=config, reasons=data.get("reasons", {})
    )


def _workload(label: str, spec: fa4gen.AttentionSpec):
    """(input sets, run-time arguments, useful FLOPs) of a label: a grid cell or a variant."""
    variant = next((v for v in V.variants() if v.name == label), None)
    if variant is None:
        seqlen = V.DOC_LEN if label == DENSE else int(label.rsplit("S=", 1)[1])
        case = bench.make_case(spec, seqlen)
        return bench.make_inputs(case), {}, case.flops()
    q_heads = max(1, bench.HIDDEN // spec.head_dim)
    inputs = V.make_inputs(variant, max(1, q_heads // spec.qhead_per_kvhead), q_heads)
    args = variant.make_args(inputs)
    packed, total = spec.is_varlen, variant.batch * variant.seqlen
    flops = V.attention_flops(
        spec,
        1 if packed else variant.batch,
        total if packed else variant.seqlen,
        total if packed else variant.seqlen,
        q_heads,
        args,
    )
    return inputs, args, flops


def _rounds(functions: dict, workloads: dict, rounds: int) -> dict[str, list[float]]:
    """TFLOP/s per round of each function, the order reversed every other round."""
    times = {name: [] for name in functions}
    for turn in range(rounds):
        for name in list(functions)[:: 1 if turn % 2 == 0 else -1]:
            inputs, args, flops = workloads[name]
            fn = functions[name]
            times[name].append(
                flops / bench.time_ms(lambda q, k, v, fn=fn, args=args: fn(q, k, v, **args), inputs) / 1e9
            )
    return times


def _outputs(result) -> tuple:
    """(O, LSE) of a kernel's result: LSE is None unless the spec returns it."""
    return result if isinstance(result, tuple) else (result, None)


def _check(label: str, kernel, q, k, v) -> None:
    """The new side's output on the first batch entry and KV head (its query heads) against the
    fp32 reference, within the tests' bound (2x PyTorch's own bf16 error); raises where it misses."""
    from fa4gen.testing import assert_close_to_reference

    heads = kernel.spec.qhead_per_kvhead
    q1, k1, v1 = q[:1, :, :heads].contiguous(), k[:1, :, :1].contiguous(), v[:1, :, :1].contiguous()
    out, lse = _outputs(kernel(q1, k1, v1))
    report = assert_close_to_reference(kernel.spec, q1, k1, v1, out, lse)
    print(f"{label:45} new vs fp32 reference: error {report['out_err']:.1e} (bound {report['out_bound']:.1e})")


def run(old_dir: Path, new_dir: Path | None, rounds: int, pattern: str = "") -> dict[str, float]:
    """Time each label's old and new kernel (see the module docstring); returns label -> new/old."""
    labels = [name for name in json.loads((old_dir / "index.json").read_text()) if re.search(pattern, name)]
    gains, documents = {}, None
    for label in labels:
        old, new = _load(old_dir, label), _load(new_dir, label)
        workload = _workload(label, new.spec)
        inputs, args, _ = workload
        q, k, v = inputs[0]
        outs = [_outputs(kernel(q, k, v, **args))[0].float() for kernel in (old, new)]
        differ = (outs[0] - outs[1]).abs().max().item()
        if not args:  # grid cells: the new kernel against the fp32 reference, on the first KV head
            _check(label, new, q, k, v)
        t = _rounds({"old": old, "new": new}, {"old": workload, "new": workload}, rounds)
        gain = sum(t["new"]) / sum(t["old"])
        gains[label] = gain
        print(
            f"{label:45} old {sum(t['old']) / rounds:6.1f} new {sum(t['new']) / rounds:6.1f} new/old {gain:.3f} "
            f"max|new-old| {differ:.1e}",
            flush=True,
        )
        if new.spec.is_varlen:
            documents = (label, new, workload)
    print(f"geometric mean new/old over {len(gains)}: {math.exp(sum(map(math.log, gains.values())) / len(gains)):.3f}")
    new_labels = [t[0] for t in _targets()] if new_dir is None else json.loads((new_dir / "index.json").read_text())
    if documents and DENSE in new_labels:
        label, kernel, workload = documents
        dense = _load(new_dir, DENSE)
        t = _rounds(
            {"documents": kernel, "dense": dense},
            {"documents": workload, "dense": _workload(DENSE, dense.spec)},
            rounds,
        )
        print(
            f"new documents {sum(t['documents']) / rounds:.1f} against dense causal {sum(t['dense']) / rounds:.1f} "
            f"TFLOP/s: {sum(t['documents']) / sum(t['dense']):.3f} per useful FLOP",
            flush=True,
        )
    return gains


_RESULT = re.compile(r"^(?P<label>.+?)\s+old\s+(?P<old>[\d.]+) new\s+(?P<new>[\d.]+) new/old ")


def _results(path: Path) -> dict[str, float]:
    """label -> new/old TFLOP/s of a ``run`` log."""
    found = {}
    for line in path.read_text().splitlines():
        match = _RESULT.match(line)
        if match:
            found[match["label"].strip()] = float(match["new"]) / float(match["old"])
    return found


def combine(forward: Path, backward: Path) -> None:
    """Two ``run`` logs of the same pair, A->B and B->A, combined (``print_combined``)."""
    print_combined(_results(forward), _results(backward))


def both(a_dir: Path, b_dir: Path, rounds: int, pattern: str = "") -> None:
    """A pair in both orders on the GPU, then combined (``print_combined``)."""
    first = run(a_dir, b_dir, rounds, pattern)
    print_combined(first, run(b_dir, a_dir, rounds, pattern))


def print_combined(first: dict[str, float], second: dict[str, float]) -> None:
    """B/A per label from the A->B pass (``first``) and the B->A pass (``second``, A/B), their
    geometric mean (each order's position bias cancels), then the mean over the labels."""
    logs = []
    for label, ratio in first.items():
        if label in second:
            both = math.sqrt(ratio / second[label])
            logs.append(math.log(both))
            print(f"{label:45} {ratio:.3f} {1 / second[label]:.3f} -> {both:.3f}")
    if logs:
        print(f"geometric mean B/A over {len(logs)}, both orders: {math.exp(sum(logs) / len(logs)):.4f}")


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "build":
        directory = Path(argv[1])
        directory.mkdir(parents=True, exist_ok=True)
        changes = dict(arg.split("=", 1) for arg in argv[3:])
        build(directory, argv[2] if len(argv) > 2 else "", {k: _field_value(v) for k, v in changes.items()})
    elif len(argv) >= 3 and argv[0] == "run":
        run(
            Path(argv[1]),
            None if argv[2] == "current" else Path(argv[2]),
            int(argv[3]) if len(argv) > 3 else 8,
            argv[4] if len(argv) > 4 else "",
        )
    elif len(argv) >= 3 and argv[0] == "both":
        both(Path(argv[1]), Path(argv[2]), int(argv[3]) if len(argv) > 3 else 8, argv[4] if len(argv) > 4 else "")
    elif len(argv) == 3 and argv[0] == "combine":
        combine(Path(argv[1]), Path(argv[2]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
