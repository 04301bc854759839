"""fa4gen variants: packed documents (the varlen API) and an expression mask with run-time scalars.

    python examples/variants.py            # on a GPU machine: compile (or load), run, check
    python examples/variants.py --cpu      # anywhere: cross-compile both specs for sm_90a

Both specs are YAML files in specs/: `packed-documents.yaml` (causal within each document, GQA 4)
and `streaming-llm.yaml` (first `sink_tokens` keys plus a window of `window` recent keys).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import fa4gen
from fa4gen.testing import assert_close_to_reference

SPECS = Path(__file__).resolve().parent.parent / "specs"


def cross_compile() -> None:
    for name in ("packed-documents", "streaming-llm"):
        spec = fa4gen.load_spec(SPECS / f"{name}.yaml")
        result = fa4gen.build(spec, "sm_90a")
        print(f"{spec.summary():40} {'compiled' if result.built_now else 'cache hit'} -> {result.entry.path}")


def packed_documents() -> None:
    spec = fa4gen.load_spec(SPECS / "packed-documents.yaml")
    attn = fa4gen.compile(spec)
    lengths = torch.tensor([700, 1500, 33, 1024])  # documents of any length, packed back to back
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).cuda()
    total = int(lengths.sum())
    q = torch.randn(total, 32, 128, device="cuda", dtype=torch.bfloat16)  # (total, Hq, D)
    k = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16)  # (total, Hkv, D)
    v = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16)
    args = {"cu_seqlens_q": cu_seqlens, "cu_seqlens_k": cu_seqlens}
    o = attn(q, k, v, max_seqlen_q=1500, max_seqlen_k=1500, **args)
    torch.cuda.synchronize()
    report = assert_close_to_reference(spec, q, k, v, o, args=args)
    print(f"{spec.summary()}: o {tuple(o.shape)}, max error {report['out_err']:.2e} (bound {report['out_bound']:.2e})")


def streaming_llm() -> None:
    spec = fa4gen.load_spec(SPECS / "streaming-llm.yaml")
    attn = fa4gen.compile(spec)
    q, k, v = (torch.randn(2, 4096, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    aux = {"sink_tokens": 4, "window": 1024}  # run-time scalars: new values never recompile
    mask = attn.block_mask(2, 16, 4096, 4096, aux=aux)  # built once on the GPU, shared by layers
    print(f"{spec.summary()}: block mask skips {100 * mask.sparsity():.0f}% of the key tiles")
    for _layer in range(3):
        o = attn(q, k, v, aux=aux, block_mask=mask)
    torch.cuda.synchronize()
    report = assert_close_to_reference(spec, q, k, v, o, args={"aux": aux})
    print(f"max error {report['out_err']:.2e} (bound {report['out_bound']:.2e})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="cross-compile only (no GPU needed)")
    if parser.parse_args().cpu or not torch.cuda.is_available():
        cross_compile()
    else:
        packed_documents()
        streaming_llm()
