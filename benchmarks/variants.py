"""Attention variants on a GPU: fa4gen against FlexAttention and flash-attn-4, one process.

    python benchmarks/variants.py warm                      # any machine: compile fa4gen's kernels
    python benchmarks/variants.py run [--out rows.json]     # on the GPU (peers where installed)
    python benchmarks/variants.py report rows.json          # markdown table

Shapes follow the anchors file: 16k tokens (B x S), d128 with 16 query heads (d64 with 32),
causal where the variant is. Each variant runs FlexAttention with the same score_mod /
mask_mod (block mask built once, outside the timing) and flash-attn-4 where its API covers the
variant (windows, learnable sinks, varlen documents). TFLOP/s counts visible pairs only.
Packed documents are also compared per useful FLOP with the dense causal kernel at the
documents' length.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import fa4gen
from fa4gen import bench
from fa4gen.planner import candidates
from fa4gen.testing import attention_flops
from fa4gen.variants import standard_alibi_slopes

SPECS = Path(__file__).resolve().parent.parent / "specs"
SEQLEN = 4096
BATCH = 4
DOC_LEN = 1024


@dataclass
class Variant:
    name: str
    spec: fa4gen.AttentionSpec
    batch: int = BATCH
    seqlen: int = SEQLEN
    flex: bool = True
    fa4: bool = False
    make_args: Callable[[Any], dict] = field(default=lambda inputs: {})
    kernel_plan: fa4gen.Plan | None = None  # a tuning candidate instead of the planner's plan


def _spec(name: str, **update) -> fa4gen.AttentionSpec:
    spec = fa4gen.load_spec(SPECS / f"{name}.yaml")
    return fa4gen.AttentionSpec.model_validate({**spec.model_dump(), **update})  # validated, unlike model_copy


def variants() -> list[Variant]:
    import torch

    def heads(spec):
        return max(1, bench.HIDDEN // spec.head_dim)

    def documents(_):
        starts = torch.arange(0, BATCH * SEQLEN + 1, DOC_LEN, dtype=torch.int32, device="cuda")
        return {"cu_seqlens_q": starts, "cu_seqlens_k": starts}

    t5 = _spec("t5-relative-bias")
    oss = _spec("gpt-oss-sinks")
    expr = _spec("expression-score")
    return [
        Variant("alibi causal", _spec("alibi-mpt")),
        Variant(
            "T5 relative bias (d64)",
            t5,
            make_args=lambda _: {"rel_bias": torch.randn(heads(t5), 2 * t5.score_mod.max_distance + 1, device="cuda")},
        ),
        Variant(
            "expression score_mod + softcap",
            expr,
            make_args=lambda _: {
                "aux": {"temperature": torch.rand(heads(expr), device="cuda") + 0.5, "strength": 0.25}
            },
        ),
        Variant(
            "chunked 1024 gqa8",  # (the cell measured since it was added; Llama 4 itself is GQA 5)
            _spec("llama4-chunked", mask={"kind": "chunked", "size": 1024}, qhead_per_kvhead=8),
        ),
        Variant(
            "prefix-LM",
            _spec("prefix-lm", return_lse=False),
            make_args=lambda _: {
                "prefix_lengths": torch.randint(512, 2048, (BATCH,), dtype=torch.int32, device="cuda")
            },
        ),
        Variant(
            f"documents {BATCH * SEQLEN // DOC_LEN}x{DOC_LEN} causal gqa4",
            _spec("packed-documents"),
            batch=1,
            seqlen=BATCH * SEQLEN,
            fa4=True,
            make_args=documents,
        ),
        Variant(
            "sinks + window 128 gqa8 (d64)",
            oss,
            flex=False,
            fa4=True,
            make_args=lambda _: {"sinks": torch.randn(heads(oss), device="cuda")},
        ),
        Variant(
            "StreamingLLM expression mask",
            _spec("streaming-llm"),
            make_args=lambda _: {"aux": {"sink_tokens": 4, "window": 1024}},
        ),
        Variant("causal window 1024", fa4gen.AttentionSpec(head_dim=128, causal=True, window_left=1024), fa4=True),
        Variant("window 4096 + softcap 50 (Gemma 2, d256)", _spec("gemma2-local"), fa4=True),
    ]


# ----------------------------------------------------------------------------- implementations
def _packed(variant: Variant) -> bool:
    return variant.spec.is_varlen


def make_inputs(variant: Variant, kv_heads: int, q_heads: int) -> list[tuple]:
    import torch

    spec, dtype = variant.spec, getattr(torch, variant.spec.dtype)
    lead = (variant.batch * variant.seqlen,) if _packed(variant) else (variant.batch, variant.seqlen)
    sets = []
    for _ in range(3):
        sets.append(
            (
                torch.randn(*lead, q_heads, spec.head_dim, device="cuda", dtype=dtype),
                torch.randn(*lead, kv_heads, spec.head_dim, device="cuda", dtype=dtype),
                torch.randn(*lead, kv_heads, spec.dv, device="cuda", dtype=dtype),
            )
        )
    return sets


def _flex_mods(spec: fa4gen.AttentionSpec, args: dict, q_heads: int):
    """The variant as FlexAttention's score_mod and mask_mod (Python closures over tensors)."""
    import torch

    aux = args.get("aux", {})
    score_mod = None
    mod = spec.score_mod
    if mod is not None and mod.kind == "alibi":
        slopes = torch.tensor(standard_alibi_slopes(q_heads), device="cuda")
        score_mod = lambda s, b, h, q, k: s - slopes[h] * (q - k).abs()  # noqa: E731
    elif mod is not None and mod.kind == "relative_bias":
        table, d = args["rel_bias"], mod.max_distance
        score_mod = lambda s, b, h, q, k: s + table[h, (k - q).clamp(-d, d) + d]  # noqa: E731
    elif mod is not None:  # the expression-score spec, written by hand
        temp, strength, cap = aux["temperature"], aux["strength"], spec.softcap

        def score_mod(s, b, h, q, k):
            return cap * torch.tanh((s * temp[h] - strength * torch.log(1.0 + (q - k).abs().float())) / cap)

    elif spec.softcap is not None:
        cap = spec.softcap
        score_mod = lambda s, b, h, q, k: cap * torch.tanh(s / cap)  # noqa: E731

    def mask_mod(b, h, q, k):
        keep = bench.window_keep(spec, q, k)
        if spec.mask_kind == "chunked":
            keep = keep & (q // spec.mask.size == k // spec.mask.size)
        if spec.mask_kind == "prefix_lm":
            keep = (k <= q) | (k < args["prefix_lengths"][b])
        if spec.mask_kind == "document":
            doc = args["doc_ids"]
            keep = keep & (doc[q] == doc[k])
        if spec.mask_kind == "expression":
            keep = keep & ((k < aux["sink_tokens"]) | (q - k < aux["window"]))
        return keep

    return score_mod, mask_mod


def flex_function(variant: Variant, args: dict, q_heads: int) -> Callable:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    bench.raise_dynamo_limits()
    spec = variant.spec
    if spec.is_varlen:
        cu = args["cu_seqlens_q"].long()
        args = {**args, "doc_ids": torch.searchsorted(cu, torch.arange(int(cu[-1]), device="cuda"), right=True) - 1}
    score_mod, mask_mod = _flex_mods(spec, args, q_heads)
    batch = variant.batch if spec.mask_kind == "prefix_lm" else None
    block_mask = create_block_mask(
        mask_mod,
        batch,
        None,
        variant.seqlen * (variant.batch if _packed(variant) else 1),
        variant.seqlen * (variant.batch if _packed(variant) else 1),
        device="cuda",
    )
    compiled = torch.compile(flex_attention, dynamic=False)
    gqa = spec.qhead_per_kvhead > 1

    def run(q, k, v):
        if q.dim() == 3:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        return compiled(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            score_mod=score_mod,
            block_mask=block_mask,
            scale=spec.scale,
            enable_gqa=gqa,
        )

    return run


def fa4_function(variant: Variant, args: dict) -> Callable | None:
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        return None
    spec = variant.spec
    window = (spec.left_bound, None if spec.causal else spec.right_bound)
    common = dict(softmax_scale=spec.scale, causal=spec.causal, softcap=spec.softcap or 0.0)
    if spec.is_varlen:
        cu = args["cu_seqlens_q"]
        return lambda q, k, v: flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=DOC_LEN, max_seqlen_k=DOC_LEN, **common
        )
    sink = args.get("sinks")
    return lambda q, k, v: flash_attn_func(q, k, v, window_size=window, learnable_sink=sink, **common)


# ----------------------------------------------------------------------------- runs
def warm(_args) -> None:
    for spec in variants_for_warm():
        result = fa4gen.build(spec, "sm_90a")
        print(f"{spec.summary():40} {'compiled' if result.any_built_now else 'cached'}", flush=True)
    result = fa4gen.build(_spec("packed-documents"), "sm_90a", kernel_plan=document_order_candidate())
    print(f"{'packed documents, ranked pairs':40} {'compiled' if result.built_now else 'cached'}", flush=True)


def variants_for_warm() -> list[fa4gen.AttentionSpec]:
    """Specs only (no GPU needed to list them); the dense causal comparison kernel too."""
    specs = [
        _spec("alibi-mpt"),
        _spec("t5-relative-bias"),
        _spec("expression-score"),
        _spec("llama4-chunked", mask={"kind": "chunked", "size": 1024}, qhead_per_kvhead=8),
        _spec("prefix-lm", return_lse=False),
        _spec("packed-documents"),
        _spec("gpt-oss-sinks"),
        _spec("streaming-llm"),
        fa4gen.AttentionSpec(head_dim=128, causal=True, window_left=1024),
        _spec("gemma2-local"),
        fa4gen.AttentionSpec(head_dim=128, qhead_per_kvhead=4, causal=True),
    ]
    return specs


def measure(variant: Variant) -> dict[str, Any]:
    spec = variant.spec
    q_heads = max(1, bench.HIDDEN // spec.head_dim)
    kv_heads = max(1, q_heads // spec.qhead_per_kvhead)
    inputs = make_inputs(variant, kv_heads, q_heads)
    args = variant.make_args(inputs)
    total = variant.batch * variant.seqlen
    flops = attention_flops(
        spec,
        1 if _packed(variant) else variant.batch,
        total if _packed(variant) else variant.seqlen,
        total if _packed(variant) else variant.seqlen,
        q_heads,
        args,
    )
    kernel = fa4gen.compile(spec, kernel_plan=variant.kernel_plan)
    impls: dict[str, Callable | None] = {"fa4gen": lambda q, k, v: kernel(q, k, v, **args)}
    row: dict[str, Any] = {"case": variant.name, "seqlen": variant.seqlen, "batch": variant.batch, "q_heads": q_heads}
    for label, make in (
        ("fa4", lambda: fa4_function(variant, args) if variant.fa4 else None),
        ("flex", lambda: flex_function(variant, args, q_heads) if variant.flex else None),
    ):
        try:
            impls[label] = make()
        except Exception as exc:
            impls[label] = None
            row.setdefault("errors", {})[label] = f"{type(exc).__name__}: {str(exc)[:160]}"
    # rounds of rotating order, as the grid: a fixed order favours the first (bench.time_balanced)
    return bench.add_tflops(row, impls, inputs, flops)


def document_order_candidate() -> fa4gen.Plan:
    """The packed-documents plan with its query tiles in ranked pairs (a `fa4gen tune`
    candidate; tune's dense inputs cannot time a varlen spec, so it is timed here)."""
    spec = _spec("packed-documents")
    return next(p for p in candidates(spec, "sm_90a") if p.config.tile_order == "paired")


def dense_causal_at_document_length() -> dict[str, Any]:
    """The dense causal kernel at the documents' length (same heads, same token count)."""
    spec = _spec("packed-documents", mask=None)
    q_heads = bench.HIDDEN // spec.head_dim
    case = bench.BenchCase(
        "dense causal gqa4 at the document length",
        spec,
        BATCH * SEQLEN // DOC_LEN,
        DOC_LEN,
        q_heads // spec.qhead_per_kvhead,
    )
    return bench.bench_case(case, {"fa4gen": fa4gen.compile(spec)})


def run(args) -> None:
    rows = []
    for variant in variants():
        row = measure(variant)
        rows.append(row)
        print(bench.format_row(row, ["fa4gen", "fa4", "flex"]), row.get("errors", ""), flush=True)
    dense = dense_causal_at_document_length()
    print(bench.format_row(dense, ["fa4gen"]), flush=True)
    documents = next(v for v in variants() if v.spec.is_varlen)
    paired = measure(
        replace(
            documents,
            name=f"{documents.name} [ranked pairs]",
            fa4=False,
            flex=False,
            kernel_plan=document_order_candidate(),
        )
    )
    print(bench.format_row(paired, ["fa4gen"]), paired.get("errors", ""), flush=True)
    result = {
        "environment": _environment(),
        "rows": rows,
        "dense_causal_at_document_length": dense,
        "document_order_candidate": paired,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(bench.markdown_table(rows, ["fa4", "flex"]))


def report(args) -> None:
    """Markdown: TFLOP/s, fa4gen's ratio to each peer, and documents against dense causal."""
    result = json.loads(Path(args.file).read_text())
    env = result["environment"]
    print(
        f"Measured {env['date']} on {env['device']}: torch {env['torch']}, flash-attn-4 {env['flash-attn-4']}, "
        f"fa4gen {env['fa4gen']}.\n"
    )
    print("| variant | S | B | fa4gen | flash-attn-4 | FlexAttention | vs flash-attn-4 | vs FlexAttention |")
    print("|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        cells = [f"{row[p]:.0f}" if row.get(p) else "-" for p in ("fa4gen", "fa4", "flex")]
        ratios = [
            f"{row['fa4gen'] / row[p]:.2f}x" if row.get(p) and row.get("fa4gen") else "-" for p in ("fa4", "flex")
        ]
        print(f"| {row['case']} | {row['seqlen']} | {row['batch']} | " + " | ".join(cells + ratios) + " |")
    dense = result["dense_causal_at_document_length"]
    docs = next(r for r in result["rows"] if r["case"].startswith("documents"))
    print(
        f"\nPacked documents {docs['fa4gen']:.0f} TFLOP/s against the dense causal kernel at the document "
        f"length ({dense['seqlen']} tokens, batch {dense['batch']}): {dense['fa4gen']:.0f} TFLOP/s "
        f"({docs['fa4gen'] / dense['fa4gen']:.2f}x per useful FLOP)."
    )
    paired = result.get("document_order_candidate")
    if paired and paired.get("fa4gen"):
        print(
            f"Same documents with the query tiles in ranked pairs (tune candidate): {paired['fa4gen']:.0f} TFLOP/s "
            f"({paired['fa4gen'] / dense['fa4gen']:.2f}x per useful FLOP)."
        )


def _environment() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run import environment

    return environment()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("warm").set_defaults(func=warm)
    run_parser = sub.add_parser("run")
    run_parser.add_argument("--out", default="")
    run_parser.set_defaults(func=run)
    report_parser = sub.add_parser("report")
    report_parser.add_argument("file")
    report_parser.set_defaults(func=report)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
