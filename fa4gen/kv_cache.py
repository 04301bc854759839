"""Launch-time pieces of decode over a KV cache (fa4gen.kernels.sm90.decode), host side: the
checks of cache lengths and page tables (no value of either is read on the host: that would
wait for the GPU; the kernel clamps them), the split count and the tensors a launch passes
beside its inputs (split partials, the splits' counters, stand-ins for what a launch does not
use), kept per device (and stream, where a launch writes them) rather than made per call.
"""

from __future__ import annotations

from typing import Any

from fa4gen.planner import Plan

_SPLIT_COUNTERS: dict = {}  # (device, stream, shape, captured) -> int32 counters


def kept_per_stream(table: dict, shape: tuple, device, make, flags):
    """``table``'s entry for this device, stream and shape (``make()`` on first use), kept: kernels
    on one stream run one after another, and every launch leaves the entry's ``flags(entry)`` at
    zero, so no launch pays for a memset. Launches captured into a CUDA graph get an entry of
    their own, and each captured launch zero-fills its flags within the graph (nothing runs while
    capturing), so every replay starts from zero flags."""
    import torch

    capturing = torch.cuda.is_current_stream_capturing()
    key = (device, torch.cuda.current_stream(device).cuda_stream, shape, capturing)
    if key not in table:
        table[key] = make()
    elif capturing:
        flags(table[key]).zero_()
    return table[key]


def split_counters(shape: tuple, device):
    """The decode splits' int32 counters (one per batch entry, KV head and query tile), which
    every launch leaves at zero (the last split to count in lowers its counter): kept per device,
    stream and shape (``kept_per_stream``)."""
    import torch

    return kept_per_stream(
        _SPLIT_COUNTERS, shape, device, lambda: torch.zeros(shape, dtype=torch.int32, device=device), lambda c: c
    )


_DECODE_CONSTANTS: dict = {}  # (what, device, sizes, capturing) -> a tensor no launch writes


def _kept(key: tuple, make):
    """A tensor made once per key and kept; made apart for launches being captured into a CUDA
    graph (their memory comes from the graph's pool), as ``split_workspace``."""
    import torch

    key = (*key, torch.cuda.is_current_stream_capturing())
    if key not in _DECODE_CONSTANTS:
        _DECODE_CONSTANTS[key] = make()
    return _DECODE_CONSTANTS[key]


def full_cache_lengths(batch: int, seqlen_k: int, device):
    """Cache lengths of a launch without ``seqused_k``: every entry's keys end at the cache's Sk."""
    import torch

    return _kept(
        ("lengths", device, batch, seqlen_k), lambda: torch.full((batch,), seqlen_k, dtype=torch.int32, device=device)
    )


def unused_block_mask(device):
    """Stand-ins for a block mask's (count, index, full), int32, for kernels that never read it."""
    import torch

    shapes = ((1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1))
    return _kept(
        ("block mask", device), lambda: tuple(torch.zeros(s, dtype=torch.int32, device=device) for s in shapes)
    )


def decode_partials(splits: int, out_shape: tuple, device):
    """Split-KV partial outputs (splits, B, Sq, Hq, Dv) and LSE (splits, B, Hq, Sq), fp32, made per
    launch; with one split the kernel never reads them, so a kept stand-in of one element per mode."""
    import torch

    batch, seqlen_q, heads, dv = out_shape
    if splits == 1:
        return _kept(
            ("partials", device, dv),
            lambda: (
                torch.empty((1, 1, 1, 1, dv), dtype=torch.float32, device=device),
                torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device),
            ),
        )
    return (
        torch.empty((splits, batch, seqlen_q, heads, dv), dtype=torch.float32, device=device),
        torch.empty((splits, batch, heads, seqlen_q), dtype=torch.float32, device=device),
    )


def check_cache_lengths(seqused_k: Any, batch: int, device) -> None:
    """``seqused_k``: int32 (B,) on the inputs' device, contiguous. Its values are not read here
    (that would wait for the GPU): the kernel clamps each to [0, the cache's Sk]."""
    import torch

    if not isinstance(seqused_k, torch.Tensor):
        raise ValueError(f"seqused_k must be a torch.Tensor, got {type(seqused_k).__name__}")
    if seqused_k.dtype != torch.int32 or tuple(seqused_k.shape) != (batch,):
        raise ValueError(f"seqused_k must be int32 of shape ({batch},), got {seqused_k.dtype} {tuple(seqused_k.shape)}")
    if seqused_k.device != device:
        raise ValueError(f"seqused_k is on {seqused_k.device}, the inputs are on {device}")
    if batch > 1 and seqused_k.stride(0) != 1:
        raise ValueError("seqused_k must be contiguous")


def check_page_table(page_table: Any, q, k, v) -> None:
    """A paged launch: k and v one pool of (pages, page size, Hkv, D) with a page size that is a
    multiple of PAGE_BOX, and ``page_table`` int32 (B, max pages) on their device, rows
    contiguous. Its entries are not read here (that would wait for the GPU): the kernel clamps
    each into the pool."""
    import torch

    from fa4gen.kernels.sm90.decode_config import PAGE_BOX

    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must be one page pool (pages, page size): got k {k.shape[:2]} and v {v.shape[:2]}")
    if k.shape[0] < 1 or k.shape[1] < PAGE_BOX or k.shape[1] % PAGE_BOX:
        raise ValueError(
            f"k and v must be a page pool of at least one page of a multiple of {PAGE_BOX} tokens "
            f"(pages, page size, heads, head_dim), got shape {tuple(k.shape)}"
        )
    if not isinstance(page_table, torch.Tensor):
        raise ValueError(f"page_table must be a torch.Tensor, got {type(page_table).__name__}")
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] != q.shape[0]:
        raise ValueError(
            f"page_table must be int32 of shape ({q.shape[0]}, max_pages), got {page_table.dtype} "
            f"{tuple(page_table.shape)}"
        )
    if page_table.shape[1] < 1:
        raise ValueError("page_table has no columns: each batch entry needs at least one page slot")
    if page_table.device != q.device:
        raise ValueError(f"page_table is on {page_table.device}, the inputs are on {q.device}")
    if not page_table.is_contiguous():
        raise ValueError("page_table must be contiguous (call .contiguous() first)")


def cache_capacity(k, page_table) -> int:
    """Keys a batch entry's cache holds: Sk, or over a page pool its table's pages x the page size."""
    return k.shape[1] * (1 if page_table is None else page_table.shape[1])


def decode_arguments(plan: Plan, q, k, seqused_k, page_table, slots: int) -> tuple:
    """What a decode launch passes beside its inputs: (o_part, lse_part, seqused_k, counters,
    splits), the split count from the sizes and ``slots`` (the runtime passes the SM count: one
    CTA per SM measured faster than one per CTA slot, decision decode-kernel), the cache lengths
    every entry's capacity where none are given (Sk, or a paged entry's pages x page size)."""
    from fa4gen.kernels.sm90.decode_config import counter_tiles
    from fa4gen.kernels.sm90.decode_splits import decode_splits

    c = plan.config
    batch, seqlen_q, heads_q = q.shape[:3]
    capacity = cache_capacity(k, page_table)
    if seqused_k is None:
        seqused_k = full_cache_lengths(batch, capacity, q.device)
    splits = decode_splits(
        batch, k.shape[2], seqlen_q, capacity, c.qhead_per_kvhead, c.tile_m, c.tile_n, slots, c.paged
    )
    o_part, lse_part = decode_partials(splits, (batch, seqlen_q, heads_q, c.head_dim_v), q.device)
    tiles = counter_tiles(seqlen_q, c.qhead_per_kvhead)
    counters = split_counters((batch, k.shape[2], tiles) if splits > 1 else (1, 1, 1), q.device)
    return o_part, lse_part, seqused_k, counters, splits
