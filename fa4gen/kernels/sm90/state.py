"""Typed state of the Hopper forward kernel, each record created whole and never assigned to.

Values are traced CuTe DSL values (Int32, tensors, pipelines) or None where the plan has no use
for them; a record that needs another value is copied with ``dataclasses.replace``. Nothing here
may be carried by a staged loop: records are made and read inside one iteration, or before the
loops begin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LaunchSizes:
    """The launch's run-time sizes and tensors, the same for every tile of a CTA."""

    seqlen_q: Any
    seqlen_k: Any
    num_heads: Any
    num_batches: Any
    num_m_blocks: Any  # query tiles per (head, batch)
    heads_batches: Any
    n_keys: Any  # key tiles per query tile, at least 1 (a launch without keys runs one empty key tile)
    grid: Any  # CTAs of the launch
    pairs: Any  # whether this launch runs causal pairs (a Python bool, or a run-time flag)
    args: Any  # the variant's run-time values (fa4gen.kernels.common.variant)
    gq: Any = None  # stale max: Q and K in global memory, (S, D, H, B), for recomputed scores
    gk: Any = None
    split_run: Any = None  # split tail: this CTA's run (scheduler.split_run)
    split_work: Any = None  # split tail: the partials' workspace and flags
    split_flags: Any = None


@dataclass(frozen=True)
class TileInfo:
    """One query tile: where it is and which key tiles it visits (the producer's tile_info, handed
    to the consumers through shared memory: publish_tile), and the consumer warpgroup's own rows."""

    m_block: Any
    head: Any
    batch: Any
    n_min: Any = None  # key tiles n_min .. n_max-1 are visited, n_count of them
    split_lo: Any = None  # tiles below split_lo cross a row's start, from split_hi a row's end
    split_hi: Any = None
    n_max: Any = None
    n_count: Any = None
    split: Any = None  # split tail: the tile's role (0: whole)
    mask_b: Any = None  # block mask: the tables' batch and head (a size-1 mode broadcasts)
    mask_h: Any = None
    doc_single: Any = None  # documents: the tile's document bounds (masking.row_ranges)
    doc_shift: Any = None
    doc_key_start: Any = None
    doc_key_end: Any = None
    row_base: Any = None  # consumer: the warpgroup's first query row
    skip: Any = None  # consumer: leading key tiles masked for every row of the warpgroup


@dataclass(frozen=True)
class MainLoopState:
    """One consumer warpgroup's fragments, MMAs and pipelines for one query tile (made inside the
    tile loop: the partitions cost nothing at run time)."""

    qk_first: Any  # Q.K^T zero-filling S; qk_rest accumulates
    qk_rest: Any
    pv: Any
    thr_pv: Any
    tSrQ: Any
    tSrK: Any
    tOrV: Any
    coords_s: Any  # (row, column) of each S element in the tile
    p: Any  # P's A operand (registers or shared memory)
    p_store: Any  # P through shared memory: (16-bit P, stmatrix copy, source, target)
    acc_o: Any
    row_max: Any
    row_sum: Any
    pipe_k: Any
    pipe_v: Any
    seqlen_q: Any
    seqlen_k: Any
    gq: Any
    gk: Any
    warpgroup: Any
    wtidx: Any
    args: Any
    held: Any  # chained query tiles: the HeldTile
    split_work: Any
    split_flags: Any
    pipe_q: Any = None  # this tile's Q (released in the main loop: releases_q_early)
    q_state: Any = None
    row_start: Any = None  # each row's first and last visible key (masking.row_ranges)
    row_end: Any = None
    batch: Any = None
    head: Any = None
    v_read_barrier: Any = None  # O over V: the barrier warpgroup 1 waits at before staging O


@dataclass(frozen=True)
class HeldTile:
    """The registers a chained warpgroup keeps from one query tile into the next: O and P (for the
    whole kernel), the held tile's row statistics and position, and whether a tile is held
    (``pending``); plus where its epilogue writes. Its tensors change in place; the record never."""

    acc_o: Any
    p: Any
    row_max: Any
    row_sum: Any
    where: Any  # m_block, head, batch (and with a split tail the tile's role)
    pending: Any
    sO: Any
    tma_o: Any
    mO: Any
    mLSE: Any
