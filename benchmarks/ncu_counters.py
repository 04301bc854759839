"""Hardware counters of one grid cell's kernels (Nsight Compute), fa4gen beside its peers, on the
GPU machine (its ncu reads the counters; give it ``--clock-control none`` to leave the clocks be):

    python benchmarks/ncu_counters.py --head-dim 96 --seqlen 8192 [--causal] [--dv 128] \
        [--impls fa4gen,fa4] [--out-dir DIR] [--backward]

runs ``ncu`` on itself once per implementation: the child makes the cell's inputs (as the grid
does), launches the implementation a few times to warm up, then once between
``cudaProfilerStart`` and ``cudaProfilerStop``, so ncu sees exactly that launch (kernel replay
restores memory between its passes). It prints the sections that place time without clock
reads (speed of light, issue slots and warp stalls, the instruction mix, stall sampling), and
with ``--out-dir`` also writes there each kernel's SASS with the stall samples of every
instruction (``IMPL-dD-S.csv``, ncu's source page), for ``sass_stalls.py`` to compare. With
``--backward`` the profiled launch is the backward's main kernel (fa4gen's on a saved out and LSE,
a peer's under autograd of a kept forward graph), the other kernels of the range filtered out.
Kernels come from FA4GEN_CACHE_DIR, as everywhere on that machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

import fa4gen
from fa4gen import bench

SECTIONS = (
    "SpeedOfLight",
    "ComputeWorkloadAnalysis",
    "MemoryWorkloadAnalysis",
    "SchedulerStats",
    "WarpStateStats",
    "InstructionStats",
    "LaunchStats",
    "Occupancy",
    "SourceCounters",
)
WARMUP = 3
# the backward's main kernel, not its pre- and postprocess: fa4gen's and flash-attn-4's Hopper one
BACKWARD_KERNELS = "regex:kernel_cutlass_kernel_.*(HopperAttentionBackward|FlashAttentionBackwardSm90)"


def _case(args) -> bench.BenchCase:
    spec = fa4gen.AttentionSpec(
        head_dim=args.head_dim, head_dim_v=args.dv or args.head_dim, causal=args.causal, qhead_per_kvhead=args.gqa
    )
    return bench.make_case(spec, args.seqlen)


def _function(impl: str, case: bench.BenchCase):
    if impl == "fa4gen":
        return fa4gen.compile(case.spec)
    fn = bench.peer_function(impl, case)
    if fn is None:
        raise SystemExit(f"{impl} does not run {case.name}")
    return fn


def _backward_function(impl: str, case: bench.BenchCase, inputs):
    """A callable that runs ``impl``'s backward alone on ``inputs`` (their forward run once here)."""
    import torch

    q, k, v = (t.requires_grad_() for t in inputs)
    dout = torch.randn(*q.shape[:-1], case.spec.dv, device=q.device, dtype=q.dtype)
    if impl == "fa4gen":
        from fa4gen.api import training_spec

        with torch.no_grad():
            out, lse = fa4gen.compile(training_spec(case.spec))(q, k, v)
        backward = fa4gen.compile_backward(case.spec)
        return lambda *_: backward(q, k, v, out, dout, lse)
    out = _function(impl, case)(q, k, v)
    out = out[0] if isinstance(out, tuple) else out
    return lambda *_: torch.autograd.backward(out, dout, retain_graph=True)


def child(args) -> None:
    """The profiled process: warm up one implementation, then one launch inside the range."""
    import torch

    case = _case(args)
    inputs = bench.make_inputs(case)[0]
    fn = _backward_function(args.child, case, inputs) if args.backward else _function(args.child, case)
    for _ in range(WARMUP):
        fn(*inputs)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn(*inputs)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _ncu() -> str:
    found = shutil.which("ncu")
    if found:
        return found
    for root in ("/usr/local/cuda/bin", "/opt/nvidia/nsight-compute"):
        for folder, _, files in os.walk(root):
            if "ncu" in files:
                return os.path.join(folder, "ncu")
    raise SystemExit("ncu (Nsight Compute) is not on this machine")


def _cell_arguments(args) -> list[str]:
    cell = [
        "--head-dim",
        str(args.head_dim),
        "--dv",
        str(args.dv),
        "--seqlen",
        str(args.seqlen),
        "--gqa",
        str(args.gqa),
    ]
    return cell + (["--causal"] if args.causal else []) + (["--backward"] if args.backward else [])


def parent(args) -> None:
    ncu = _ncu()
    for impl in args.impls.split(","):
        print(f"===== {impl}: {_case(args).name} S={args.seqlen}", flush=True)
        report = os.path.join(
            args.out_dir or "/tmp",
            f"{impl}-d{args.head_dim}{'c' if args.causal else ''}-{args.seqlen}{'-bwd' if args.backward else ''}",
        )
        command = [ncu, "--profile-from-start", "off", "--clock-control", "none", "-f", "-o", report]
        if args.backward:
            command += ["--kernel-name", BACKWARD_KERNELS]
        for section in SECTIONS:
            command += ["--section", section]
        command += [sys.executable, __file__, *_cell_arguments(args), "--child", impl]
        subprocess.run(command, check=False, stdout=subprocess.DEVNULL)
        subprocess.run([ncu, "-i", report + ".ncu-rep", "--print-details", "all"], check=False)
        if args.out_dir:
            with open(report + ".csv", "w") as sass:
                subprocess.run(
                    [ncu, "-i", report + ".ncu-rep", "--page", "source", "--print-source", "sass", "--csv"],
                    check=False,
                    stdout=sass,
                )
            os.remove(report + ".ncu-rep")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, required=True)
    parser.add_argument("--dv", type=int, default=0, help="head_dim_v (default: head_dim)")
    parser.add_argument("--seqlen", type=int, required=True)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--gqa", type=int, default=1, help="query heads per KV head")
    parser.add_argument("--impls", default="fa4gen,fa4", help="fa4gen and peers: " + ",".join(bench.PEERS))
    parser.add_argument("--out-dir", default="", help="write each kernel's SASS with its stall samples here")
    parser.add_argument("--backward", action="store_true", help="profile the backward's main kernel")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main(sys.argv[1:])
