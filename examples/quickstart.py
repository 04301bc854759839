"""fa4gen quickstart: a GQA causal attention kernel from a spec, checked against PyTorch.

    python examples/quickstart.py            # on a GPU machine: compile (or load), run, check
    python examples/quickstart.py --cpu      # anywhere: cross-compile for sm_90a into the cache

The first run compiles (a few seconds); every later process loads the cached kernel.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import fa4gen
from fa4gen.testing import assert_close_to_reference

SPEC_FILE = Path(__file__).resolve().parent.parent / "specs" / "llama3-8b.yaml"


def cross_compile() -> None:
    spec = fa4gen.load_spec(SPEC_FILE)
    print(fa4gen.plan(spec, "sm_90a").describe())
    started = time.perf_counter()
    result = fa4gen.build(spec, "sm_90a")
    state = "compiled" if result.built_now else "cache hit"
    print(f"{state} in {time.perf_counter() - started:.2f} s -> {result.entry.path}")


def run_on_gpu() -> None:
    spec = fa4gen.AttentionSpec(head_dim=128, qhead_per_kvhead=4, causal=True, dtype="bfloat16")
    started = time.perf_counter()
    attn = fa4gen.compile(spec)  # plans, emits, compiles (or loads from cache)
    loaded = time.perf_counter()
    q = torch.randn(2, 1024, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    o = attn(q, k, v)
    torch.cuda.synchronize()
    first_call = time.perf_counter()
    report = assert_close_to_reference(spec, q, k, v, o)
    print(f"{attn}: get kernel {1e3 * (loaded - started):.1f} ms, first call {1e3 * (first_call - loaded):.1f} ms")
    print(f"max error {report['out_err']:.2e} (bound {report['out_bound']:.2e})")

    with_lse = fa4gen.compile(spec.model_copy(update={"return_lse": True}))
    o, lse = with_lse(q, k, v)
    assert_close_to_reference(spec, q, k, v, o, lse)
    print(f"o {tuple(o.shape)} {o.dtype}, lse {tuple(lse.shape)} {lse.dtype}: ok")

    # decode over a paged KV cache: the same keys in 16-token pages, scattered over a pool in
    # random order, each batch entry at its own length (the decode kernel's paged build)
    pages = k.shape[1] // 16
    table = torch.randperm(2 * pages, device="cuda").view(2, pages)
    pool_k, pool_v = (torch.empty(2 * pages, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pool_k[table.flatten()] = k.reshape(2 * pages, 16, 8, 128)
    pool_v[table.flatten()] = v.reshape(2 * pages, 16, 8, 128)
    cache = {"seqused_k": torch.tensor([700, 1024], dtype=torch.int32, device="cuda"), "page_table": table.int()}
    o = attn(q[:, :1], pool_k, pool_v, **cache)
    report = assert_close_to_reference(spec, q[:, :1], pool_k, pool_v, o, args=cache)
    print(f"paged decode {tuple(o.shape)}: max error {report['out_err']:.2e} (bound {report['out_bound']:.2e})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="cross-compile only (no GPU needed)")
    args = parser.parse_args()
    if args.cpu or not torch.cuda.is_available():
        cross_compile()
    else:
        run_on_gpu()
