"""Time the backward (and forward + backward) of fa4gen against its peers on one GPU, in one process.

    python benchmarks/backward.py warm [--grid full|quick]            # any machine: compile the kernels
    python benchmarks/backward.py run  [--grid full|quick] [--out rows.json]   # on the GPU

Cells follow the forward grid's rule (fa4gen.bench: B x S = 16k tokens, Hq x d = 2048). Peers:
flash-attn-4 (``flash_attn.cute.flash_attn_func`` under autograd), SDPA with the cuDNN and the
flash backends; each is skipped where it is not installed or does not run the cell. The
backward is timed alone (fa4gen: the backward kernel on saved out and LSE; peers: autograd's
backward of a recorded forward, graph kept) and with the forward. TFLOP/s counts 2.5x the
forward's useful FLOPs for the backward (its five matrix products against the forward's two)
and 3.5x for forward + backward.
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
    for spec in (
        AttentionSpec(head_dim=128, causal=True, softcap=30.0),
        AttentionSpec(head_dim=128, causal=True, window_left=1024),
    ):
        cases.append(bench.make_case(spec, 4096))
    return cases


def warm(args) -> None:
    for spec in bench.specs_of(grid(args.grid)):
        fa4gen.build(spec, "sm_90a")  # (fa4gen.compile(spec) looks it up before autograd runs the LSE one)
        forward, backward = build_training(spec)
        print(f"{spec.summary():36} {'compiled' if backward.built_now else 'cached'}", flush=True)


def _peers(spec: AttentionSpec):
    """name -> (q, k, v) -> out under autograd, for the peers that run ``spec``."""
    import torch
    import torch.nn.functional as F

    peers = {}
    try:
        from flash_attn.cute import flash_attn_func

        window = (spec.left_bound, spec.right_bound) if spec.left_bound is not None else (None, None)

        def fa4(q, k, v):
            result = flash_attn_func(q, k, v, causal=spec.causal, softcap=spec.softcap or 0.0, window_size=window)
            return result[0] if isinstance(result, tuple) else result

        peers["fa4"] = fa4
    except ImportError:
        pass
    if spec.softcap is None and spec.left_bound is None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(backend):
            def run(q, k, v):
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(
                        q.transpose(1, 2),
                        k.transpose(1, 2),
                        v.transpose(1, 2),
                        is_causal=spec.causal,
                        enable_gqa=spec.qhead_per_kvhead > 1,
                    )
                return out.transpose(1, 2)

            return run

        peers["cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
        peers["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    del torch
    return peers


def _time_autograd(forward, inputs_sets, dout):
    """(backward ms, forward + backward ms) of ``forward`` under autograd."""
    import torch

    def step(q, k, v):
        out = forward(q, k, v)
        out.backward(dout)

    recorded = []
    for q, k, v in inputs_sets:
        out = forward(q, k, v)
        recorded.append((out,))

    def backward_only(out):
        torch.autograd.backward(out, dout, retain_graph=True)

    both = bench.time_ms(step, inputs_sets, iters=10, warmup=2)
    alone = bench.time_ms(backward_only, recorded, iters=10, warmup=2)
    return alone, both


def run_case(case: bench.BenchCase) -> dict:
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
    kernel = fa4gen.compile(spec)
    _, both = _time_autograd(lambda q, k, v: kernel(q, k, v), sets, dout)
    row["fa4gen"] = {"bwd_ms": ms, "bwd_tflops": BACKWARD_FLOPS * flops / ms / 1e9, "fwdbwd_ms": both}
    for name, peer in _peers(spec).items():
        try:
            alone, both = _time_autograd(peer, sets, dout)
        except Exception as exc:  # a peer that does not run the cell
            row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
            continue
        row[name] = {"bwd_ms": alone, "bwd_tflops": BACKWARD_FLOPS * flops / alone / 1e9, "fwdbwd_ms": both}
    return row


def run(args) -> None:
    rows = []
    for case in grid(args.grid):
        row = run_case(case)
        rows.append(row)
        cells = "  ".join(
            f"{name} {row[name]['bwd_tflops']:.0f}" if "bwd_tflops" in row[name] else f"{name} -"
            for name in ("fa4gen", "fa4", "cudnn", "sdpa_flash")
            if name in row
        )
        print(f"{case.name:34} S={case.seqlen:5} B={case.batch:2}  bwd TFLOP/s: {cells}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"env": _environment(), "rows": rows}, indent=1))


def _environment() -> dict:
    import torch

    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("warm", "run"))
    parser.add_argument("--grid", choices=("full", "quick"), default="quick")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    {"warm": warm, "run": run}[args.mode](args)


if __name__ == "__main__":
    main()
