"""Run the speed grid on a GPU: fa4gen against its peers in one process, one table.

    python benchmarks/run.py warm [--grid full|quick]          # any machine: compile the grid's kernels
    python benchmarks/run.py run  [--grid full|quick] [--part 1/3] [--match causal] [--out rows.json]   # on the GPU
    python benchmarks/run.py report rows1.json rows2.json ... > table.md

fa4gen's kernels come from the cache (FA4GEN_CACHE_DIR); peers are imported if installed
(flash-attn-4, cuDNN and flash through SDPA, FlexAttention) and skipped otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import fa4gen
from fa4gen import bench


def _cases(args) -> list[bench.BenchCase]:
    cases = bench.grid(args.grid)
    if getattr(args, "match", ""):
        words = args.match.split(",")
        cases = [case for case in cases if any(word in case.name for word in words)]
    index, parts = (int(x) for x in args.part.split("/"))
    return cases[index - 1 :: parts]


def warm(args) -> None:
    for spec in bench.specs_of(bench.grid(args.grid)):
        started = time.perf_counter()
        result = fa4gen.build(spec, "sm_90a")
        print(
            f"{spec.summary():32} {'compiled' if result.any_built_now else 'cached':8} "
            f"{time.perf_counter() - started:5.1f} s",
            flush=True,
        )


def environment() -> dict:
    import torch

    env = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "fa4gen": fa4gen.__version__,
    }
    try:
        import importlib.metadata as md

        env["flash-attn-4"] = md.version("flash-attn-4")
    except Exception:
        env["flash-attn-4"] = "not installed"
    return env


def run(args) -> None:
    cases = _cases(args)
    kernels = {spec.canonical_json(): fa4gen.compile(spec) for spec in bench.specs_of(cases)}
    peers = [p for p in args.peers.split(",") if p]
    result = {"environment": environment(), "ceiling_tflops": bench.matmul_ceiling_tflops(), "rows": []}
    print(json.dumps(result["environment"]), f"matmul ceiling {result['ceiling_tflops']:.0f}", flush=True)
    result["rows"] = bench.run_grid(cases, kernels, peers)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def report(args) -> None:
    runs = [json.loads(Path(p).read_text()) for p in args.files]
    order = {(case.name, case.seqlen): i for i, case in enumerate(bench.grid("full"))}
    rows = sorted(
        (row for r in runs for row in r["rows"]), key=lambda row: order.get((row["case"], row["seqlen"]), len(order))
    )
    env = runs[0]["environment"]
    print(
        f"Measured {env['date']} on {env['device']}: torch {env['torch']} (CUDA {env['cuda']}, cuDNN "
        f"{env['cudnn']}), flash-attn-4 {env['flash-attn-4']}, fa4gen {env['fa4gen']}. Dense bf16 "
        f"matmul ceiling in the same run: {runs[0]['ceiling_tflops']:.0f} TFLOP/s.\n"
    )
    print(bench.markdown_table(rows))
    print("\n| peer | cells | min ratio | geomean ratio |\n|---|---|---|---|")
    for peer, stats in bench.ratio_summary(rows).items():
        print(f"| {peer} | {stats['cells']} | {stats['min']:.2f}x | {stats['geomean']:.2f}x |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("warm", "run"):
        p = sub.add_parser(name)
        p.add_argument("--grid", choices=("full", "quick"), default="full")
        p.add_argument("--part", default="1/1", help="run every k-th case: i/k")
    sub.choices["run"].add_argument("--out", default="")
    sub.choices["run"].add_argument(
        "--match", default="", help="only cases whose name contains one of these comma-separated words"
    )
    sub.choices["run"].add_argument("--peers", default=",".join(bench.PEERS))
    p = sub.add_parser("report")
    p.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    {"warm": warm, "run": run, "report": report}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
