"""Block masks for expression masks: which key tiles each query tile needs, built on the GPU.

An expression mask (``mask: {kind: expression, expr: ...}``) has no structure the kernel can
reason about, so, as FlexAttention's ``create_block_mask`` does, fa4gen evaluates the expression
(with PyTorch, through the expression language's renderer) over every (query, key) pair once,
in chunks of query tiles, and reduces it per (query tile, key tile) of the kernel's plan:

- ``count`` (Bm, Hm, M): how many key tiles query tile m visits;
- ``index`` (Bm, Hm, M, N): those key tiles, highest first (the kernel's order), zero-padded;
- ``full`` (Bm, Hm, M, N): 1 where every pair of the tile is visible, so no mask code runs.

Bm is the batch size when the expression reads ``b`` (else 1: one table serves the whole batch),
Hm likewise for ``h``. Empty tiles are never loaded. The result depends on the shape, the
scalars and the aux tensors the expression reads, and is reused across calls and layers:
``AttentionKernel`` caches it per (shape, scalar values, aux tensor identity and version), and
``AttentionKernel.block_mask(...)`` builds one explicitly to share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fa4gen.expr import evaluate_torch
from fa4gen.planner import Plan
from fa4gen.spec import AttentionSpec
from fa4gen.variants import lower

MAX_CHUNK_ELEMENTS = 1 << 26  # mask entries evaluated at once (64 M booleans)


@dataclass(frozen=True)
class BlockMask:
    count: Any  # int32 (Bm, Hm, M)
    index: Any  # int32 (Bm, Hm, M, N)
    full: Any  # int32 (Bm, Hm, M, N)
    tile_m: int
    tile_n: int
    seqlen_q: int
    seqlen_k: int

    def sparsity(self) -> float:
        """Share of (query tile, key tile) pairs that are skipped."""
        m, n = self.index.shape[-2], self.index.shape[-1]
        return 1.0 - self.count.float().mean().item() / max(n, 1) if m else 0.0


def _structural(spec: AttentionSpec, q_idx, kv_idx, seqlen_q: int, seqlen_k: int):
    """The causal / window bounds (bottom-right aligned) and the Sk edge, for the given indices."""
    position = q_idx + (seqlen_k - seqlen_q)
    keep = kv_idx < seqlen_k
    if spec.right_bound is not None:
        keep = keep & (kv_idx <= position + spec.right_bound)
    if spec.left_bound is not None:
        keep = keep & (kv_idx >= position - spec.left_bound)
    return keep


def tile_visibility(
    spec: AttentionSpec,
    tile_m: int,
    tile_n: int,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    args: dict | None = None,
    device: Any = "cuda",
):
    """(some, every), bool (Bm, Hm, M, N): whether some / every (query, key) pair of query tile m
    and key tile n is visible (expression mask and causal / window bounds; rows past Sq never
    count, keys past Sk are never visible). ``heads``: query heads."""
    import torch

    lowered = lower(spec)
    if lowered.mask is None:
        raise ValueError(f"spec ({spec.summary()}) has no expression mask: its kernel needs no block mask")
    m_blocks, n_blocks = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    mask_b = batch if "b" in lowered.mask.uses else 1
    mask_h = heads if "h" in lowered.mask.uses else 1
    if m_blocks == 0 or n_blocks == 0:
        empty = torch.zeros(mask_b, mask_h, m_blocks, n_blocks, dtype=torch.bool, device=device)
        return empty, empty.clone()
    args = args or {}
    env: dict[str, Any] = {"seqlen_q": seqlen_q, "seqlen_k": seqlen_k, **args.get("aux", {})}
    env["b"] = torch.arange(mask_b, device=device).view(-1, 1, 1, 1)
    env["h"] = torch.arange(mask_h, device=device).view(1, -1, 1, 1)
    kv_idx = torch.arange(n_blocks * tile_n, device=device).view(1, 1, 1, -1)
    # padded positions are evaluated at the last real index (aux lookups stay in range) and
    # then dropped by the structural mask / the real-row mask
    env["kv_idx"] = kv_idx.clamp(max=seqlen_k - 1)
    tiles_per_chunk = max(1, MAX_CHUNK_ELEMENTS // max(1, mask_b * mask_h * tile_m * n_blocks * tile_n))
    any_parts, all_parts = [], []
    for first in range(0, m_blocks, tiles_per_chunk):
        rows = min(tiles_per_chunk, m_blocks - first) * tile_m
        q_idx = torch.arange(first * tile_m, first * tile_m + rows, device=device).view(1, 1, -1, 1)
        env["q_idx"] = q_idx.clamp(max=seqlen_q - 1)
        visible = evaluate_torch(lowered.mask, env).bool() & _structural(spec, q_idx, kv_idx, seqlen_q, seqlen_k)
        visible = visible.expand(mask_b, mask_h, rows, n_blocks * tile_n)
        tiles = visible.reshape(mask_b, mask_h, rows // tile_m, tile_m, n_blocks, tile_n)
        real_rows = (q_idx < seqlen_q).reshape(1, 1, rows // tile_m, tile_m, 1, 1)
        any_parts.append((tiles & real_rows).any(dim=5).any(dim=3))
        all_parts.append((tiles | ~real_rows).all(dim=5).all(dim=3))  # rows past Sq do not count
    some = torch.cat(any_parts, dim=2)
    return some, torch.cat(all_parts, dim=2) & some


def _ranked(some, every, descending: bool):
    """(count, index, full, order) over the last dim: how many tiles some pair of is visible,
    those tiles' indices first (highest first, or lowest first), zero-padded, whether every pair
    of each is visible, and the permutation that ranks them."""
    import torch

    n = torch.arange(some.shape[-1], device=some.device)
    rank = torch.where(some, n + 1, 0) if descending else torch.where(some, some.shape[-1] - n, 0)
    order = torch.argsort(rank, dim=-1, descending=True, stable=True)
    listed = torch.gather(some, -1, order)
    count = some.sum(dim=-1, dtype=torch.int32)
    index = torch.where(listed, order, 0).to(torch.int32)
    full = torch.gather(every, -1, order).to(torch.int32)
    return count.contiguous(), index.contiguous(), full.contiguous(), order


def build_block_mask(
    spec: AttentionSpec,
    plan: Plan,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    args: dict | None = None,
    device: Any = "cuda",
) -> BlockMask:
    """Evaluate the spec's expression mask on ``device`` and reduce it to the plan's tiles."""
    tile_m, tile_n = plan.config.tile_m, plan.config.tile_n
    some, every = tile_visibility(spec, tile_m, tile_n, batch, heads, seqlen_q, seqlen_k, args, device)
    if some.shape[-1] == 0:  # (no key tile: one zero column keeps the index tensor non-empty)
        some = every = some.new_zeros((*some.shape[:-1], 1))
    count, index, full, _ = _ranked(some, every, descending=True)  # the forward walks key tiles down
    return BlockMask(count, index, full, tile_m, tile_n, seqlen_q, seqlen_k)


@dataclass(frozen=True)
class BackwardBlockMask:
    """The backward's view of an expression mask: per (Bm, Hm, key tile n) the query tiles some
    pair of is visible, lowest first (Hm: KV heads where the mask reads h, each the union of its
    query heads: one CTA walks them all). ``count`` (Bm, Hm, N); ``index``, ``full`` (every pair
    visible, for every query head of the group: no mask code) and ``turn`` (how many key tiles
    before n walk that query tile: the deterministic backward's turn at its dQ, key tiles
    ordered as Sm90BwdConfig.dq_descending says), (Bm, Hm, N, M)."""

    count: Any
    index: Any
    full: Any
    turn: Any


def build_backward_block_mask(
    spec: AttentionSpec,
    tile_m: int,
    tile_n: int,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    args: dict | None = None,
    device: Any = "cuda",
    descending: bool = False,
) -> BackwardBlockMask:
    """Evaluate the spec's expression mask on ``device`` and reduce it to the backward's tiles
    (``heads``: query heads; ``descending``: the order of the key tiles' turns)."""
    import torch

    some, every = tile_visibility(spec, tile_m, tile_n, batch, heads, seqlen_q, seqlen_k, args, device)
    group = spec.qhead_per_kvhead
    if some.shape[1] > 1 and group > 1:  # a KV head's CTAs walk the union of its query heads
        b, h, m, n = some.shape
        some = some.view(b, h // group, group, m, n).any(dim=2)
        every = every.view(b, h // group, group, m, n).all(dim=2) & some
    some, every = some.transpose(2, 3), every.transpose(2, 3)  # (Bm, Hm, N, M)
    if some.shape[-1] == 0:
        some = every = some.new_zeros((*some.shape[:-1], 1))
    count, index, full, order = _ranked(some, every, descending=False)
    walks = some.int()
    if descending:  # key tiles above n walking query tile m
        before = torch.flip(torch.cumsum(torch.flip(walks, dims=[2]), dim=2), dims=[2]) - walks
    else:  # below n
        before = torch.cumsum(walks, dim=2) - walks
    turn = torch.where(torch.gather(some, -1, order), torch.gather(before, -1, order), 0).to(torch.int32)
    return BackwardBlockMask(count, index, full, turn.contiguous())


def check_block_mask(bm: Any, plan: Plan, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device: Any) -> None:
    """Raise ValueError if ``bm`` was not built for this kernel's tiles and this call's shape."""
    import torch

    if not isinstance(bm, BlockMask):
        raise ValueError(f"block_mask must come from AttentionKernel.block_mask(...), got {type(bm).__name__}")
    if (bm.tile_m, bm.tile_n) != (plan.config.tile_m, plan.config.tile_n):
        raise ValueError(
            f"block_mask was built for {bm.tile_m}x{bm.tile_n} tiles; this kernel uses "
            f"{plan.config.tile_m}x{plan.config.tile_n}"
        )
    if (bm.seqlen_q, bm.seqlen_k) != (seqlen_q, seqlen_k):
        raise ValueError(
            f"block_mask was built for Sq={bm.seqlen_q}, Sk={bm.seqlen_k}; the call has Sq={seqlen_q}, Sk={seqlen_k}"
        )
    mask_b, mask_h = bm.count.shape[:2]
    if mask_b not in (1, batch) or mask_h not in (1, heads):
        raise ValueError(
            f"block_mask covers {mask_b} batch entries and {mask_h} heads; the call has {batch} and {heads}"
        )
    for name in ("count", "index", "full"):
        t = getattr(bm, name)
        if t.dtype != torch.int32 or t.device != device or not t.is_contiguous():
            raise ValueError(f"block_mask.{name} must be a contiguous int32 tensor on {device}")
