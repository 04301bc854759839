"""Side-by-side timing of fa4gen kernels and their peers on one GPU, in one process.

Peers (each where it supports the variant): flash-attn-4 (``flash_attn.cute.flash_attn_func``),
PyTorch SDPA with the cuDNN and the flash (FA2) backends, and FlexAttention under
``torch.compile`` with the equivalent score_mod / block mask. Every implementation is timed with
CUDA events (median), on random inputs rotated so they do not sit in L2. TFLOP/s counts useful
FLOPs only (masked-out query/key pairs are not counted). The dense bf16 matmul ceiling is measured
in the same run. Peers are optional imports: fa4gen never depends on them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from fa4gen.spec import AttentionSpec
from fa4gen.testing import attention_flops

TOKENS = 16384  # batch x seqlen of every grid cell
HIDDEN = 2048  # heads x head_dim of every grid cell
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
PEERS = ("fa4", "cudnn", "sdpa_flash", "flex")


@dataclass(frozen=True)
class BenchCase:
    name: str
    spec: AttentionSpec
    batch: int
    seqlen: int
    kv_heads: int

    @property
    def q_heads(self) -> int:
        return self.kv_heads * self.spec.qhead_per_kvhead

    def flops(self) -> float:
        return attention_flops(self.spec, self.batch, self.seqlen, self.seqlen, self.q_heads)


def make_case(spec: AttentionSpec, seqlen: int, name: str = "") -> BenchCase:
    """A cell at TOKENS tokens and HIDDEN model width: B = TOKENS / S, Hq = HIDDEN / d."""
    q_heads = max(1, HIDDEN // spec.head_dim)
    kv_heads = max(1, q_heads // spec.qhead_per_kvhead)
    return BenchCase(name or spec.summary(), spec, max(1, TOKENS // seqlen), seqlen, kv_heads)


def grid(which: str = "full") -> list[BenchCase]:
    """The speed grid. ``full``: every head dim x causal x seqlen (GQA 1), GQA 4/8 at d128, and
    the variants; ``quick``: a few cells per head dim for tuning runs."""
    seqlens = SEQLENS if which == "full" else (1024, 4096, 16384)
    dims = ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))
    cases = []
    for d, dv in dims:
        for causal in (False, True):
            for s in seqlens:
                cases.append(make_case(AttentionSpec(head_dim=d, head_dim_v=dv, causal=causal), s))
    for ratio in (4, 8):
        for causal in (False, True):
            for s in seqlens:
                cases.append(make_case(AttentionSpec(head_dim=128, qhead_per_kvhead=ratio, causal=causal), s))
    variants = [
        AttentionSpec(head_dim=128, softcap=50.0),
        AttentionSpec(head_dim=128, causal=True, window_left=1024),
        AttentionSpec(head_dim=128, causal=True, window_left=4096),
    ]
    for spec in variants:
        for s in (4096, 16384) if which == "full" else (4096,):
            cases.append(make_case(spec, s))
    return cases


def specs_of(cases: Iterable[BenchCase]) -> list[AttentionSpec]:
    seen: dict[str, AttentionSpec] = {}
    for case in cases:
        seen.setdefault(case.spec.canonical_json(), case.spec)
    return list(seen.values())


# ----------------------------------------------------------------------------- timing
def _rotation(bytes_per_set: int) -> int:
    import torch

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return max(1, min(8, math.ceil(3 * l2 / max(bytes_per_set, 1))))


def launch_times_ms(fn: Callable[..., Any], input_sets: list[tuple], iters: int, warmup: int) -> list[float]:
    """Milliseconds of each of ``iters`` launches of ``fn(*inputs)`` (CUDA events), cycling
    through ``input_sets``, after ``warmup`` untimed ones."""
    import torch

    for i in range(warmup):
        fn(*input_sets[i % len(input_sets)])
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        args = input_sets[i % len(input_sets)]
        starts[i].record()
        fn(*args)
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def time_ms(fn: Callable[..., Any], input_sets: list[tuple], iters: int = 30, warmup: int = 5) -> float:
    """Median milliseconds of ``fn(*inputs)``, cycling through ``input_sets``."""
    return statistics.median(launch_times_ms(fn, input_sets, iters, warmup))


def matmul_ceiling_tflops(n: int = 8192) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(torch.matmul, [(a, b)], iters=20)
    return 2 * n**3 / ms / 1e9


def make_inputs(case: BenchCase) -> list[tuple]:
    import torch

    spec = case.spec
    dtype = getattr(torch, spec.dtype)
    per_set = 2 * case.batch * case.seqlen * (case.q_heads * spec.head_dim + case.kv_heads * (spec.head_dim + spec.dv))
    sets = []
    for _ in range(_rotation(per_set)):
        sets.append(
            (
                torch.randn(case.batch, case.seqlen, case.q_heads, spec.head_dim, device="cuda", dtype=dtype),
                torch.randn(case.batch, case.seqlen, case.kv_heads, spec.head_dim, device="cuda", dtype=dtype),
                torch.randn(case.batch, case.seqlen, case.kv_heads, spec.dv, device="cuda", dtype=dtype),
            )
        )
    return sets


# ----------------------------------------------------------------------------- peers
def _fa4(spec: AttentionSpec) -> Callable | None:
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None
    window = (spec.left_bound, None if spec.causal else spec.right_bound)

    def run(q, k, v):
        return flash_attn_func(
            q, k, v, softmax_scale=spec.scale, causal=spec.causal, window_size=window, softcap=spec.softcap or 0.0
        )

    return run


def _sdpa(spec: AttentionSpec, backend_name: str) -> Callable | None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if spec.softcap is not None or spec.left_bound is not None or spec.window_right is not None:
        return None
    backend = getattr(SDPBackend, backend_name)
    gqa = spec.qhead_per_kvhead > 1

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=spec.causal,
                scale=spec.scale,
                enable_gqa=gqa,
            )

    return run


def raise_dynamo_limits() -> None:
    """Every grid cell is a new shape: past dynamo's default of 8 recompiles FlexAttention would
    silently fall back to eager (an order of magnitude slower), so raise the limits."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 1024)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 8192)


def window_keep(spec: AttentionSpec, q_idx, kv_idx):
    """The causal / window bounds as a FlexAttention mask_mod body (Sq == Sk in every cell)."""
    keep = q_idx >= 0
    if spec.right_bound is not None:
        keep = keep & (kv_idx <= q_idx + spec.right_bound)
    if spec.left_bound is not None:
        keep = keep & (kv_idx >= q_idx - spec.left_bound)
    return keep


def _flex(spec: AttentionSpec, case: BenchCase) -> Callable | None:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    raise_dynamo_limits()

    def mask_mod(b, h, q_idx, kv_idx):
        return window_keep(spec, q_idx, kv_idx)

    block_mask = None
    if spec.has_mask:
        block_mask = create_block_mask(mask_mod, None, None, case.seqlen, case.seqlen, device="cuda")
    score_mod = None
    if spec.softcap is not None:
        cap = spec.softcap

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

    compiled = torch.compile(flex_attention, dynamic=False)
    gqa = spec.qhead_per_kvhead > 1

    def run(q, k, v):
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


def peer_function(peer: str, case: BenchCase) -> Callable | None:
    if peer == "fa4":
        return _fa4(case.spec)
    if peer == "cudnn":
        return _sdpa(case.spec, "CUDNN_ATTENTION")
    if peer == "sdpa_flash":
        return _sdpa(case.spec, "FLASH_ATTENTION")
    if peer == "flex":
        return _flex(case.spec, case)
    raise ValueError(f"unknown peer {peer!r}: known are {', '.join(PEERS)}")


# ----------------------------------------------------------------------------- runs
BALANCED_ROUNDS = 5  # rounds of time_balanced: each implementation takes each place in the order once (up to 5)
BALANCED_ITERS = 6  # timed launches per implementation and round (after one warm-up launch)


def rotations(names: list[str], rounds: int) -> list[list[str]]:
    """The order of each round: round r starts at the r-th name, so over len(names) rounds every
    name runs once in every place (first after another cell, right after each other one)."""
    return [names[r % len(names) :] + names[: r % len(names)] for r in range(rounds)] if names else []


def time_balanced(
    functions: dict[str, Callable[..., Any]],
    input_sets: list[tuple],
    rounds: int = BALANCED_ROUNDS,
    iters: int = BALANCED_ITERS,
) -> dict[str, float | Exception]:
    """Median milliseconds of each function over ``rounds`` rounds whose order rotates: on this
    shared, power-capped GPU whatever runs first after a pause, or after a lighter kernel, runs
    at a higher clock, so a fixed order favours the first. A function that raises gets its
    exception instead of a time and leaves the later rounds."""
    samples: dict[str, list[float] | Exception] = {name: [] for name in functions}
    for order in rotations(list(functions), rounds):
        for name in order:
            if isinstance(samples[name], Exception):
                continue
            try:  # one warm-up launch per round: first calls compile, allocate, tune
                samples[name].extend(launch_times_ms(functions[name], input_sets, iters, warmup=1))
            except Exception as exc:  # a peer that cannot run is reported, not fatal
                samples[name] = exc
    return {name: got if isinstance(got, Exception) else statistics.median(got) for name, got in samples.items()}


def bench_case(case: BenchCase, implementations: dict[str, Callable | None]) -> dict[str, Any]:
    """TFLOP/s of each implementation on one cell (None where unsupported or failing), timed in
    rounds of rotating order (time_balanced) on the same inputs."""
    inputs = make_inputs(case)
    flops = case.flops()
    row: dict[str, Any] = {"case": case.name, "seqlen": case.seqlen, "batch": case.batch, "q_heads": case.q_heads}
    return add_tflops(row, implementations, inputs, flops)


def add_tflops(
    row: dict[str, Any], implementations: dict[str, Callable | None], inputs: list[tuple], flops: float
) -> dict[str, Any]:
    """``row`` with each implementation's TFLOP/s on ``inputs`` (time_balanced; None where it is
    unsupported or fails, the failure under row["errors"])."""
    timed = time_balanced({label: fn for label, fn in implementations.items() if fn is not None}, inputs)
    for label in implementations:
        got = timed.get(label)
        row[label] = None if got is None or isinstance(got, Exception) else flops / got / 1e9
        if isinstance(got, Exception):
            row.setdefault("errors", {})[label] = f"{type(got).__name__}: {str(got)[:160]}"
    return row


def run_grid(
    cases: list[BenchCase],
    kernels: dict[str, Callable],
    peers: Iterable[str] = PEERS,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """``kernels`` maps a spec's canonical JSON to fa4gen's callable for it."""
    rows = []
    for case in cases:
        impls: dict[str, Callable | None] = {"fa4gen": kernels[case.spec.canonical_json()]}
        for peer in peers:
            try:
                impls[peer] = peer_function(peer, case)
            except Exception as exc:
                impls[peer] = None
                log(f"{peer} unavailable for {case.name}: {type(exc).__name__}: {exc}")
        row = bench_case(case, impls)
        rows.append(row)
        log(format_row(row, list(impls)))
    return rows


def best_peer(row: dict[str, Any], peers: Iterable[str]) -> tuple[str | None, float | None]:
    found = [(row[p], p) for p in peers if row.get(p)]
    if not found:
        return None, None
    value, name = max(found)
    return name, value


def format_row(row: dict[str, Any], labels: list[str]) -> str:
    cells = " ".join(f"{label}={row[label]:.0f}" if row.get(label) else f"{label}=-" for label in labels)
    return f"{row['case']:40} S={row['seqlen']:<6} {cells}"


def markdown_table(rows: list[dict[str, Any]], peers: Iterable[str] = PEERS) -> str:
    peers = list(peers)
    head = ["case", "S", "B", "fa4gen", *peers, "best peer", "ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        name, value = best_peer(row, peers)
        ratio = f"{row['fa4gen'] / value:.2f}x" if value and row.get("fa4gen") else "-"
        values = [f"{row[p]:.0f}" if row.get(p) else "-" for p in ["fa4gen", *peers]]
        lines.append(
            "| " + " | ".join([row["case"], str(row["seqlen"]), str(row["batch"]), *values, name or "-", ratio]) + " |"
        )
    return "\n".join(lines)


def ratio_summary(rows: list[dict[str, Any]], peers: Iterable[str] = PEERS) -> dict[str, dict[str, float]]:
    """min and geometric mean of fa4gen / peer over the cells each peer ran."""
    summary = {}
    for peer in peers:
        ratios = [row["fa4gen"] / row[peer] for row in rows if row.get(peer) and row.get("fa4gen")]
        if ratios:
            geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
            summary[peer] = {"cells": len(ratios), "min": min(ratios), "geomean": geo}
    return summary
