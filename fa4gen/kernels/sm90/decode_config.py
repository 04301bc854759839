"""The Hopper decode kernel's configuration (fa4gen.kernels.sm90.decode) and its one check.

Decode and short queries over a KV cache: a CTA takes one KV head of one batch entry and packs
the query rows of all the head's query heads into its tile (row = query index x group size +
query head in the group), 64 rows per consumer warpgroup, so every K/V tile is read once per
group and tile, not once per query head; the keys of a (batch, KV head) may be split over
several CTAs (split-KV), whose partial outputs the last of them to finish merges by their LSE.
The split count is a run-time argument (the host picks it from the problem size and the SM
count: fa4gen.kernels.sm90.decode_splits), never a recompile. A paged config reads K/V from a
page pool through a page table, whose page size (a multiple of PAGE_BOX) is a run-time value.

Like config.py this module imports no CuTe DSL: the planner, ``fa4gen.build`` and the kernel's
constructor all call ``decode_config_problem``.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from fa4gen.arch import WARPGROUP_THREADS, WGMMA_M, Arch
from fa4gen.kernels.sm90.config import ELEMENT_BYTES, SMEM_RESERVE_BYTES, extent_problem, resource_problem

MAX_SPLITS = 128  # split-KV partials per (batch, KV head, query tile)
PAGE_BOX = 16  # keys per TMA box of a paged cache: the smallest page size (vLLM's default)
PAGED_UNROLLED_PRODUCER_REGS = 32  # an unrolled page walk's addresses spilled at 24


class Sm90DecodeConfig(BaseModel):
    """Compile-time constants of one Hopper decode kernel."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # the variant (from the spec)
    head_dim: int
    head_dim_v: int
    qhead_per_kvhead: int  # query heads packed into a tile's rows
    scale_log2: float
    window_left: int | None
    window_right: int | None
    chunk: int | None
    expression_mask: bool
    sinks: bool
    return_lse: bool
    extra_names: tuple[str, ...]
    # the schedule (from the planner)
    head_dim_padded: int
    head_dim_v_padded: int
    tile_n: int  # keys per step
    kv_stages: int  # depth of the K and V rings
    paged: bool  # K/V from a pool of pages through a page table, PAGE_BOX keys per TMA box
    # paged: a key tile's boxes issued in straight-line code (PAGED_UNROLLED_PRODUCER_REGS or more),
    # else by a loop that walks them one at a time in fewer registers but issues them more slowly
    page_walk_unrolled: bool
    ctas_per_sm: int  # CTAs one SM holds at once (shared memory and registers split between them)
    consumer_warpgroups: int  # 64 packed rows each, sharing every K/V tile the CTA loads
    q_in_registers: bool  # Q.K^T takes Q from registers (read once from global), not shared memory
    rescale_threshold: float  # log2 growth of a row max before O is rescaled (0: every tile)
    producer_regs: int
    consumer_regs: int

    @property
    def tile_m(self) -> int:
        """Packed query rows per CTA (query index x group size + head in the group)."""
        return WGMMA_M * self.consumer_warpgroups


def decode_smem_bytes(c: Sm90DecodeConfig) -> int:
    """Q (the tile's packed rows, unless held in registers) + the K/V ring."""
    q = 0 if c.q_in_registers else c.tile_m * c.head_dim_padded
    kv = c.kv_stages * c.tile_n * (c.head_dim_padded + c.head_dim_v_padded)
    return (q + kv) * ELEMENT_BYTES + SMEM_RESERVE_BYTES


def decode_config_problem(c: Sm90DecodeConfig) -> str:
    """Why the GPU cannot run ``c`` ("" when it can)."""
    extents = extent_problem(c, "tile_n")
    if extents:
        return extents
    if c.tile_n > 256 or c.kv_stages < 2 or c.ctas_per_sm not in (1, 2) or c.consumer_warpgroups not in (1, 2):
        return "tile_n must be at most 256, kv_stages at least 2, ctas_per_sm and consumer_warpgroups 1 or 2"
    if c.paged and (c.tile_n % PAGE_BOX or c.tile_n // PAGE_BOX > 32):
        return f"a paged tile_n must be a multiple of {PAGE_BOX} keys, at most 32 boxes (a lane's page each)"
    if c.page_walk_unrolled and (not c.paged or c.producer_regs < PAGED_UNROLLED_PRODUCER_REGS):
        return f"page_walk_unrolled needs a paged config and at least {PAGED_UNROLLED_PRODUCER_REGS} producer registers"
    warpgroups = c.consumer_warpgroups
    smem, registers = decode_smem_bytes(c), WARPGROUP_THREADS * (c.producer_regs + warpgroups * c.consumer_regs)
    if c.ctas_per_sm > 1:
        caps = Arch.SM90A.caps
        per_cta = caps.smem_bytes_per_sm // c.ctas_per_sm - caps.smem_reserved_per_cta
        pool = caps.registers_per_sm // c.ctas_per_sm
        if smem > per_cta or registers > pool:
            return (
                f"{c.ctas_per_sm} CTAs per SM take at most {per_cta} bytes of shared memory and {pool} registers each"
            )
    return resource_problem(smem, c.producer_regs, c.consumer_regs, warpgroups)


def counter_tiles(seqlen_q: int, qhead_per_kvhead: int) -> int:
    """Split counters per (batch entry, KV head): one per 64 packed rows (a consumer warpgroup's
    rows), whatever the tile holds."""
    return max(math.ceil(seqlen_q * qhead_per_kvhead / WGMMA_M), 1)
