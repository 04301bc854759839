"""Time decode (KV-cache) attention of fa4gen against its peers on one GPU, in one process.

    python benchmarks/decode.py warm   [--grid full|quick] [--match G8/]     # any machine: compile the kernels
    python benchmarks/decode.py run    [--grid full|quick] [--match Sq1/,paged] [--part 1/2] [--out rows.json]
    python benchmarks/decode.py report rows.json [rows2.json ...] > table.md
    python benchmarks/decode.py compare base.json new.json [new2.json base2.json]   # an A/B of two trees

Cells: Llama-3-8B-style heads (8 KV heads, 8 x G query heads, d 128, bf16, causal aligned to the
end of the cache) over a KV cache of Sk tokens per batch entry, read through ``seqused_k``: the
contiguous cache (B, Sk, Hkv, d), or pages of 16 or 128 tokens placed by a random permutation
(B, Sk / page) page table; plus chunked prefill (512 query rows). Cells whose K+V pass 24 GB are
skipped (listed at the start of a run). Each implementation is timed with CUDA events in rounds
of rotating order (as ``fa4gen.bench.time_balanced``: 5 rounds of 6 launches), its launches
queued behind a GPU spin so that the events time the kernels, not the host's launch path, on
random inputs rotated so that small caches do not sit in L2; the median of the 30 counts.
TB/s counts K and V read once (B x Sk x Hkv x (d + dv) x 2 bytes), the same for paged cells;
%HBM is that over the device's HBM peak (the H200's 4.8 TB/s, the H100's 3.35: ``hbm_peak``).
Peers, each skipped where not installed or failing: flash-attn-4 (``flash_attn_varlen_func`` with
(B, S, H, D) tensors, ``seqused_k`` and, paged, ``page_table``), SDPA with the cuDNN and the flash
backends (contiguous cells only).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fa4gen  # noqa: E402
from fa4gen import bench  # noqa: E402
from fa4gen.spec import AttentionSpec  # noqa: E402

KV_HEADS = 8
HEAD_DIM = 128
HBM_TBPS = 4.8  # the H200's HBM3e peak
HBM_PEAKS = {"H200": 4.8, "H100": 3.35}  # TB/s by device name (the H100 SXM's HBM3)
MAX_KV_BYTES = 24e9  # K+V past this are skipped: with rotated sets and peers' copies the GPU must hold more
BIG_KV_BYTES = 1e9  # the cells where reading K/V, not launching, should set the time
HBM_GOAL = 0.85
CHUNK_ROWS = 512  # chunked prefill's query rows
LAYOUTS = ("contiguous", "paged16", "paged128")
PEERS = ("fa4", "cudnn", "sdpa_flash")
SPIN_CYCLES_PER_MS = 2_000_000  # torch.cuda._sleep counts SM cycles: the H200 clocks at most 1.98 GHz


@dataclass(frozen=True)
class Cell:
    batch: int
    seqlen_q: int
    seqlen_k: int
    group: int  # query heads per KV head
    layout: str = "contiguous"

    @property
    def kind(self) -> str:
        return "chunked" if self.seqlen_q >= CHUNK_ROWS else "decode"

    @property
    def label(self) -> str:
        """Slash-separated so that --match can pin a number: "B1/" is not "B128/"."""
        return f"{self.kind}/B{self.batch}/Sq{self.seqlen_q}/Sk{self.seqlen_k}/G{self.group}/{self.layout}"

    @property
    def page_size(self) -> int | None:
        return int(self.layout.removeprefix("paged")) if self.layout.startswith("paged") else None

    @property
    def q_heads(self) -> int:
        return KV_HEADS * self.group

    @property
    def kv_bytes(self) -> int:
        """K and V read once, bf16: the same token count for paged caches."""
        return self.batch * self.seqlen_k * KV_HEADS * (HEAD_DIM + HEAD_DIM) * 2

    @property
    def hbm_limit_us(self) -> float:
        return self.kv_bytes / (HBM_TBPS * 1e12) * 1e6

    @property
    def spec(self) -> AttentionSpec:
        return AttentionSpec(head_dim=HEAD_DIM, qhead_per_kvhead=self.group, causal=True)


def grid(which: str) -> list[Cell]:
    """Every cell of the grid, those over the K+V limit too (split_cells sets them aside)."""
    if which == "full":
        cells = [
            Cell(b, sq, sk, g, layout)
            for g in (1, 4, 8)
            for sk in (1024, 4096, 32768, 131072)
            for b in (1, 8, 64, 128)
            for sq in (1, 4, 16)
            for layout in LAYOUTS
        ]
        return cells + [Cell(b, CHUNK_ROWS, sk, 4) for sk in (4096, 32768) for b in (1, 8)]
    cells = [Cell(b, sq, sk, g) for g in (4, 8) for sk in (4096, 32768) for b in (1, 8, 64, 128) for sq in (1, 4)]
    # paged beside a contiguous cell of the same size: batch 1 (split-KV), 8, 64 and 128
    for b, sk, g in ((1, 32768, 4), (8, 32768, 8), (64, 4096, 4), (128, 4096, 8)):
        cells += [Cell(b, 1, sk, g, layout) for layout in LAYOUTS[1:]]
    return cells + [Cell(1, CHUNK_ROWS, sk, 4) for sk in (4096, 32768)]


def split_cells(cells: Iterable[Cell]) -> tuple[list[Cell], list[Cell]]:
    """(cells to run, cells whose K+V exceed MAX_KV_BYTES)."""
    cells = list(cells)
    return [c for c in cells if c.kv_bytes <= MAX_KV_BYTES], [c for c in cells if c.kv_bytes > MAX_KV_BYTES]


def select(cells: list[Cell], match: str = "", part: str = "1/1") -> list[Cell]:
    """Cells whose label contains one of match's comma-separated words (all without; a word of
    parts joined by "+" needs all its parts: "B1/+Sk4096/"), then every k-th from the i-th for part
    "i/k" (a full grid runs past one 10-minute device call)."""
    if match:
        words = [word.split("+") for word in match.split(",")]
        cells = [c for c in cells if any(all(part in c.label for part in word) for word in words)]
    index, parts = (int(x) for x in part.split("/"))
    return cells[index - 1 :: parts]


def specs_of(cells: Iterable[Cell]) -> list[AttentionSpec]:
    seen: dict[int, AttentionSpec] = {}
    for cell in cells:
        seen.setdefault(cell.group, cell.spec)
    return list(seen.values())


# ----------------------------------------------------------------------------- inputs
def pages_per_seq(cell: Cell) -> int:
    return -(-cell.seqlen_k // cell.page_size)


def page_table(batch: int, pages: int, generator=None, device="cpu"):
    """(batch, pages) int32: a random permutation of batch x pages pages, so each sequence's pages
    lie scattered over the pool and no page is shared."""
    import torch

    order = torch.randperm(batch * pages, generator=generator, dtype=torch.int64)
    return order.to(torch.int32).reshape(batch, pages).to(device)


def input_set(cell: Cell, device="cuda", generator=None) -> tuple:
    """(q, k, v, seqused_k, page_table or None), random data (never zeros: a kernel may take
    shortcuts on them); paged K/V are the pool (pages, page, Hkv, d)."""
    import torch

    dtype = torch.bfloat16
    q = torch.randn(cell.batch, cell.seqlen_q, cell.q_heads, HEAD_DIM, device=device, dtype=dtype)
    lens = torch.full((cell.batch,), cell.seqlen_k, dtype=torch.int32, device=device)
    if cell.page_size is None:
        kv_shape = (cell.batch, cell.seqlen_k, KV_HEADS, HEAD_DIM)
        table = None
    else:
        pages = pages_per_seq(cell)
        kv_shape = (cell.batch * pages, cell.page_size, KV_HEADS, HEAD_DIM)
        table = page_table(cell.batch, pages, generator, device)
    k = torch.randn(kv_shape, device=device, dtype=dtype)
    v = torch.randn(kv_shape, device=device, dtype=dtype)
    return q, k, v, lens, table


def make_inputs(cell: Cell) -> list[tuple]:
    """As many sets as keep their total past three L2 sizes (fa4gen.bench's rotation), at most 8."""
    q_bytes = cell.batch * cell.seqlen_q * cell.q_heads * HEAD_DIM * 2
    return [input_set(cell) for _ in range(bench._rotation(cell.kv_bytes + q_bytes))]


def causal_mask(seqlen_q: int, seqlen_k: int, dtype=None, device="cpu"):
    """(1, 1, Sq, Sk) additive mask of causal attention aligned to the end of the keys (query row i
    sees keys up to i + Sk - Sq), built once outside the timed region: SDPA converts a boolean
    mask, and CausalBias materializes one, on every call."""
    import torch

    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device).tril(seqlen_k - seqlen_q)
    mask = torch.zeros(seqlen_q, seqlen_k, dtype=dtype or torch.bfloat16, device=device)
    return mask.masked_fill(~keep, float("-inf"))[None, None]


# ----------------------------------------------------------------------------- implementations
# each is fn(q, k, v, seqused_k, page_table) -> (B, Sq, Hq, dv), so outputs compare directly
def fa4gen_function(kernel) -> Callable:
    def run(q, k, v, lens, table):
        if table is None:
            return kernel(q, k, v, seqused_k=lens)
        return kernel(q, k, v, seqused_k=lens, page_table=table)

    return run


def fa4_function(cell: Cell) -> Callable | None:
    """flash-attn-4's batched varlen call (4.0.0b36: flash_attn_varlen_func takes (B, S, H, D)
    tensors with seqused_k, and page_table with a (pages, page, Hkv, d) pool). num_splits stays
    at its default 1: split KV asserts on SM90 ("SplitKV not supported on SM 9.0"), so 0 (its
    heuristic) would fail wherever that picks more than one; pack_gqa stays its default (on for
    G > 1). Without the varlen function: flash_attn_func, contiguous cells only."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        if cell.page_size is not None:
            return None
        case = bench.BenchCase(cell.label, cell.spec, cell.batch, cell.seqlen_k, KV_HEADS)
        plain = bench.peer_function("fa4", case)
        return None if plain is None else lambda q, k, v, lens, table: _output(plain(q, k, v))

    def run(q, k, v, lens, table):
        return _output(flash_attn_varlen_func(q, k, v, seqused_k=lens, page_table=table, causal=True))

    return run


def _output(result):
    return result[0] if isinstance(result, tuple) else result


def _sdpa_call(cell: Cell, backend_name: str) -> Callable:
    """SDPA on (B, H, S, D) views under one backend, causal aligned to the end of the keys: no
    mask for one query row (it sees every key), else torch's lower-right CausalBias for the flash
    backend (its fast path) and a prebuilt additive mask for the others."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    mask = None
    if cell.seqlen_q > 1:
        mask = causal_mask(cell.seqlen_q, cell.seqlen_k, device="cuda")
        if backend_name == "FLASH_ATTENTION":
            try:
                from torch.nn.attention.bias import causal_lower_right

                mask = causal_lower_right(cell.seqlen_q, cell.seqlen_k)
            except ImportError:
                pass

    def call(q, k, v, gqa: bool):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=mask,
                scale=cell.spec.scale,
                enable_gqa=gqa,
            )
        return out.transpose(1, 2)

    return call


def sdpa_function(cell: Cell, backend_name: str, input_sets: list[tuple]) -> Callable | None:
    """SDPA with GQA through enable_gqa, tried once on the first set; where the backend refuses
    it, K/V expanded to every query head beforehand (outside the timed region), while the copies
    fit under MAX_KV_BYTES. None for paged cells: SDPA has no paged cache."""
    if cell.page_size is not None:
        return None
    call = _sdpa_call(cell, backend_name)
    gqa = cell.group > 1
    q, k, v, _, _ = input_sets[0]
    try:
        call(q, k, v, gqa)
        return lambda q, k, v, lens, table: call(q, k, v, gqa)
    except RuntimeError as exc:
        if not gqa:
            raise
        refused = exc
    if cell.kv_bytes * cell.group * len(input_sets) > MAX_KV_BYTES:
        raise RuntimeError(f"enable_gqa refused ({refused}) and expanded K/V pass {MAX_KV_BYTES / 1e9:.0f} GB")
    expanded = {
        id(k): (k.repeat_interleave(cell.group, 2), v.repeat_interleave(cell.group, 2)) for _, k, v, _, _ in input_sets
    }
    return lambda q, k, v, lens, table: call(q, *expanded[id(k)], False)


def implementations(cell: Cell, kernel, input_sets: list[tuple]) -> tuple[dict[str, Callable], dict[str, str]]:
    """(name -> function, name -> why it does not run) for fa4gen and each peer."""
    makers = {
        "fa4": lambda: fa4_function(cell),
        "cudnn": lambda: sdpa_function(cell, "CUDNN_ATTENTION", input_sets),
        "sdpa_flash": lambda: sdpa_function(cell, "FLASH_ATTENTION", input_sets),
    }
    functions, missing = {"fa4gen": fa4gen_function(kernel)}, {}
    for name, make in makers.items():
        try:
            function = make()
        except Exception as exc:  # a peer that refuses the cell is reported, not fatal
            missing[name] = error_text(exc)
            continue
        if function is None:
            missing[name] = "paged cache unsupported" if cell.page_size else "not installed"
        else:
            functions[name] = function
    return functions, missing


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:160]}"


# ----------------------------------------------------------------------------- runs
def cell_row(cell: Cell) -> dict[str, Any]:
    return {
        "label": cell.label,
        "kind": cell.kind,
        "batch": cell.batch,
        "seqlen_q": cell.seqlen_q,
        "seqlen_k": cell.seqlen_k,
        "group": cell.group,
        "layout": cell.layout,
        "kv_bytes": cell.kv_bytes,
        "hbm_limit_us": cell.hbm_limit_us,
    }


def timing(cell: Cell, ms: float) -> dict[str, float]:
    """A median time's entry: microseconds, TB/s of K/V read once, and that over HBM's peak."""
    us = ms * 1e3
    tbps = cell.kv_bytes / us / 1e6
    return {"us": us, "tbps": tbps, "hbm_fraction": tbps / HBM_TBPS}


def agreement(functions: dict[str, Callable], timed: dict, inputs: tuple) -> dict[str, float]:
    """max |fa4gen - peer| on the first set, for each peer that ran: a fast wrong kernel shows."""
    if not isinstance(timed.get("fa4gen"), float):
        return {}
    mine = functions["fa4gen"](*inputs).float()
    return {
        name: float((functions[name](*inputs).float() - mine).abs().max())
        for name in functions
        if name != "fa4gen" and isinstance(timed.get(name), float)
    }


def queued_times_ms(fn: Callable, input_sets: list[tuple], iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` launches (CUDA events), enqueued while the GPU spins
    (torch.cuda._sleep) for longer than the host takes to enqueue them all: a small decode
    kernel runs in less time than a Python call's launch path (tens of us, more for SDPA under
    sdpa_kernel), and events on an idle stream would time that path. One untimed call first
    (compile, allocate, tune), and one to measure the host's time per call."""
    import torch

    fn(*input_sets[0])
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn(*input_sets[1 % len(input_sets)])
    host_ms = (time.perf_counter() - started) * 1e3
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda._sleep(int(min(100.0, 1.0 + 4 * iters * host_ms) * SPIN_CYCLES_PER_MS))
    for i in range(iters):
        starts[i].record()
        fn(*input_sets[i % len(input_sets)])
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def time_queued(functions: dict[str, Callable], input_sets: list[tuple]) -> dict[str, float | Exception]:
    """fa4gen.bench.time_balanced's rounds of rotating order (a fixed order favours whatever runs
    first after a pause on this power-capped GPU), each round's launches timed queued: the median
    per function, or the exception that stopped it."""
    samples: dict[str, list[float] | Exception] = {name: [] for name in functions}
    for order in bench.rotations(list(functions), bench.BALANCED_ROUNDS):
        for name in order:
            if isinstance(samples[name], Exception):
                continue
            try:
                samples[name].extend(queued_times_ms(functions[name], input_sets, bench.BALANCED_ITERS))
            except Exception as exc:  # a peer that cannot run is reported, not fatal
                samples[name] = exc
    return {name: got if isinstance(got, Exception) else statistics.median(got) for name, got in samples.items()}


def run_cell(cell: Cell, kernel) -> dict[str, Any]:
    sets = make_inputs(cell)
    functions, missing = implementations(cell, kernel, sets)
    timed = time_queued(functions, sets)
    row = cell_row(cell)
    for name in ("fa4gen", *PEERS):
        got = timed.get(name)
        if isinstance(got, float):
            row[name] = timing(cell, got)
        else:
            row[name] = {"error": missing.get(name) or error_text(got)}
    row["max_diff"] = agreement(functions, timed, sets[0])
    return row


def line(row: dict[str, Any]) -> str:
    mine = row["fa4gen"]
    head = f"{row['label']:42}"
    if "us" not in mine:
        return f"{head} fa4gen failed: {mine['error']}"
    peers = "  ".join(f"{p} {row[p]['us']:.1f}" if "us" in row[p] else f"{p} -" for p in PEERS)
    mine_text = f"fa4gen {mine['us']:.1f} us {mine['tbps']:.2f} TB/s ({100 * mine['hbm_fraction']:.0f}% HBM)"
    diffs = " ".join(f"{p} {d:.1e}" for p, d in row.get("max_diff", {}).items())
    return f"{head} {mine_text}  {peers}  max|diff| {diffs or '-'}"


def run(args) -> None:
    import torch
    from run import environment

    cells, skipped = split_cells(select(grid(args.grid), args.match, args.part))
    print(f"{len(cells)} cells:", *(f"  {c.label}" for c in cells), sep="\n")
    for c in skipped:
        print(f"  {c.label} skipped: K+V {c.kv_bytes / 1e9:.1f} GB > {MAX_KV_BYTES / 1e9:.0f} GB")
    result = {"environment": environment(), "rows": []}
    print(json.dumps(result["environment"]), flush=True)
    kernels: dict[int, Any] = {}
    for cell in cells:
        try:
            if cell.group not in kernels:
                kernels[cell.group] = fa4gen.compile(cell.spec)
            row = run_cell(cell, kernels[cell.group])
        except fa4gen.CacheMiss as exc:  # (FA4GEN_NO_COMPILE=1 with a cache holding only some kernels)
            print(f"{cell.label:42} skipped: {exc}", flush=True)
            continue
        result["rows"].append(row)
        print(line(row), flush=True)
        torch.cuda.empty_cache()  # the next cell's cache may be another size: give the blocks back
        if args.out:  # after every cell: a run cut off at the device's time limit keeps what it timed
            Path(args.out).write_text(json.dumps(result, indent=1))


def warm(args) -> None:
    """fa4gen.compile for sm_90a, then prepare(): every kernel of each spec (the decode path's
    and each query-length range's) built into the cache, on any machine."""
    cells, _ = split_cells(select(grid(args.grid), args.match))
    for spec in specs_of(cells):
        started = time.perf_counter()
        fa4gen.compile(spec, arch="sm_90a").prepare()
        print(f"{spec.summary():36} ready in {time.perf_counter() - started:6.1f} s", flush=True)


# ----------------------------------------------------------------------------- report
def us_of(row: dict[str, Any], name: str) -> float | None:
    return row.get(name, {}).get("us")


def speed_ratio(row: dict[str, Any], peer: str) -> float | None:
    """peer time / fa4gen time: above 1, fa4gen is faster."""
    mine, theirs = us_of(row, "fa4gen"), us_of(row, peer)
    return theirs / mine if mine and theirs else None


def best_peer(row: dict[str, Any]) -> tuple[str | None, float | None]:
    """The fastest peer that ran the cell, and its time."""
    found = [(us, p) for p in PEERS if (us := us_of(row, p))]
    if not found:
        return None, None
    us, name = min(found)
    return name, us


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def hbm_peak(device: str) -> float:
    """The HBM peak (TB/s) of the device a run names (the H200's where it names neither)."""
    return next((peak for name, peak in HBM_PEAKS.items() if name in device), HBM_TBPS)


def table_lines(rows: list[dict[str, Any]], peak: float = HBM_TBPS) -> list[str]:
    head = ["case", "B", "Sq", "Sk", "G", "layout", "HBM limit us", "fa4gen us", "fa4gen TB/s", "%HBM"]
    head += [f"{p} us" for p in PEERS] + ["best peer", "fa4gen / best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        mine = row["fa4gen"]
        name, best = best_peer(row)
        ratio = best / mine["us"] if best and "us" in mine else None
        values = [row["kind"], row["batch"], row["seqlen_q"], row["seqlen_k"], row["group"], row["layout"]]
        limit = row["kv_bytes"] / (peak * 1e12) * 1e6
        values += [f"{limit:.1f}", _cell(mine.get("us"), ".1f"), _cell(mine.get("tbps"), ".2f")]
        values += [_cell(100 * mine["tbps"] / peak if "us" in mine else None, ".0f")]
        values += [_cell(us_of(row, p), ".1f") for p in PEERS] + [name or "-", f"{ratio:.2f}x" if ratio else "-"]
        lines.append("| " + " | ".join(map(str, values)) + " |")
    return lines


def paged_ratios(rows: list[dict[str, Any]], name: str = "fa4gen") -> dict[str, list[float]]:
    """layout -> contiguous time / paged time of ``name`` over the cells timed both ways (1.0: paging costs nothing)."""
    contiguous = {_shape(r): us_of(r, name) for r in rows if r["layout"] == "contiguous" and us_of(r, name)}
    found: dict[str, list[float]] = {}
    for row in rows:
        paged, flat = us_of(row, name), contiguous.get(_shape(row))
        if row["layout"] != "contiguous" and paged and flat:
            found.setdefault(row["layout"], []).append(flat / paged)
    return found


def _shape(row: dict[str, Any]) -> tuple:
    return row["batch"], row["seqlen_q"], row["seqlen_k"], row["group"]


def hbm_count(rows: list[dict[str, Any]], peak: float = HBM_TBPS) -> tuple[int, int]:
    """(cells reaching HBM_GOAL of ``peak``, cells) over fa4gen's timed decode cells of >= 1 GB K/V."""
    big = [r for r in rows if r["kind"] == "decode" and r["kv_bytes"] >= BIG_KV_BYTES and us_of(r, "fa4gen")]
    return sum(r["fa4gen"]["tbps"] >= HBM_GOAL * peak for r in big), len(big)


def summary_lines(rows: list[dict[str, Any]], peak: float = HBM_TBPS) -> list[str]:
    lines = []
    for peer in (*PEERS, "best peer"):
        if peer == "best peer":
            found = [us / r["fa4gen"]["us"] for r in rows if (us := best_peer(r)[1]) and us_of(r, "fa4gen")]
        else:
            found = [x for r in rows if (x := speed_ratio(r, peer)) is not None]
        if found:
            stats = f"min {min(found):.2f}x, geometric mean {geomean(found):.2f}x over {len(found)} cells"
            lines.append(f"- fa4gen vs {peer} (its time / fa4gen's): {stats}")
    reached, total = hbm_count(rows, peak)
    goal = f"{100 * HBM_GOAL:.0f}% of HBM ({peak} TB/s)"
    lines.append(f"- decode cells with >= {BIG_KV_BYTES / 1e9:.0f} GB of K/V reaching >= {goal}: {reached} of {total}")
    for name in ("fa4gen", "fa4"):
        for layout, found in paged_ratios(rows, name).items():
            stats = f"min {min(found):.2f}x, geometric mean {geomean(found):.2f}x over {len(found)} cells"
            lines.append(f"- {name} {layout} vs contiguous (contiguous time / paged time): {stats}")
    failed = [r["label"] for r in rows if not us_of(r, "fa4gen")]
    if failed:
        lines.append(f"- fa4gen failed on {len(failed)} cells: {', '.join(failed[:8])}{' ...' * (len(failed) > 8)}")
    return lines


def report(args) -> None:
    runs = [json.loads(Path(p).read_text()) for p in args.rows]
    rows = [row for r in runs for row in r["rows"]]
    env = runs[0]["environment"]
    print(
        f"Measured {env['date']} on {env['device']}: torch {env['torch']} (CUDA {env['cuda']}, cuDNN "
        f"{env['cudnn']}), flash-attn-4 {env['flash-attn-4']}, fa4gen {env['fa4gen']}.\n"
    )
    peak = hbm_peak(env["device"])
    print("\n".join(table_lines(rows, peak)))
    print()
    print("\n".join(summary_lines(rows, peak)))


def compare_lines(base_runs: list[dict], new_runs: list[dict]) -> list[str]:
    """fa4gen's time in the base runs over its time in the new runs, per cell (the geometric mean
    over the runs: an A/B run in both orders cancels the position bias) and over the cells, with
    flash-attn-4's ratio between the same runs beside it (how far the machine moved meanwhile)."""

    def times(runs: list[dict], name: str) -> dict[str, list[float]]:
        found: dict[str, list[float]] = {}
        for run in runs:
            for row in run["rows"]:
                if us := us_of(row, name):
                    found.setdefault(row["label"], []).append(us)
        return found

    lines, ours, theirs = (
        ["| cell | base us | new us | base / new | fa4 (base runs / new runs) |", "|---|---|---|---|---|"],
        [],
        [],
    )
    base, new = times(base_runs, "fa4gen"), times(new_runs, "fa4gen")
    base_fa4, new_fa4 = times(base_runs, "fa4"), times(new_runs, "fa4")
    for label in [label for label in base if label in new]:
        ratio = geomean(base[label]) / geomean(new[label])
        peer = geomean(base_fa4[label]) / geomean(new_fa4[label]) if label in base_fa4 and label in new_fa4 else None
        ours.append(ratio)
        theirs += [peer] if peer else []
        us = f"{geomean(base[label]):.1f} | {geomean(new[label]):.1f}"
        lines.append(f"| {label} | {us} | {ratio:.3f}x | {_cell(peer, '.3f')} |")
    if ours:
        spread = f"min {min(ours):.3f}x, max {max(ours):.3f}x"
        lines.append(f"\n- new vs base: {spread}, geometric mean {geomean(ours):.3f}x over {len(ours)} cells")
    if theirs:
        lines.append(f"- flash-attn-4 between the same runs: geometric mean {geomean(theirs):.3f}x")
    return lines


def compare(args) -> None:
    """base.json new.json [new2.json base2.json]: the runs alternate base, new, new, base."""
    runs = [json.loads(Path(p).read_text()) for p in args.rows]
    base, new = [runs[0], *runs[3:]], runs[1:3]
    print("\n".join(compare_lines(base, new)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("warm", "run", "report", "compare"))
    parser.add_argument("rows", nargs="*", help="report, compare: the rows files runs wrote (--out)")
    parser.add_argument("--grid", choices=("full", "quick"), default="quick")
    parser.add_argument("--match", default="", help="only cells whose label holds one of these words (a,b; a+b: both)")
    parser.add_argument("--part", default="1/1", help="run: every k-th cell from the i-th (i/k)")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.mode == "report" and not args.rows:
        parser.error("report needs the rows file(s) a run wrote")
    if args.mode == "compare" and len(args.rows) not in (2, 4):
        parser.error("compare needs base.json new.json, or base, new, new, base")
    {"warm": warm, "run": run, "report": report, "compare": compare}[args.mode](args)


if __name__ == "__main__":
    main()
