"""Which (query tile, head, batch) a CTA works on, for one-shot and persistent launches.

A CTA walks items k = 0, 1, ... of its own list (``items_per_cta``); ``tile_of`` maps an item to a
tile id and ``decode`` a tile id to (m_block, head, batch); ids that name no tile (the ragged last
round) are skipped by ``valid``. A launch with one CTA per tile is the special case of one item.
Three orders (the plan's ``tile_order``):
- ``head_major`` (uniform work per query tile): the query tile is the fastest digit, in rounds of
  ``grid`` tiles, so the CTAs running together share one head's K/V in L2.
- ``heavy_first`` (windows, chunks, prefix-LM, documents: work per query tile differs): the query
  tile is the slowest digit, counted from the end of the sequence, so the longest tiles start
  first; rounds alternate direction (a snake), pairing a heavy tile with a light one per CTA.
  Packed documents break "higher query tile = more work" (work restarts at every
  document): the caller passes the query tiles ranked by their work (``order``: most first) and
  the slowest digit indexes that ranking (``paired`` pairs the j-th heaviest with the j-th
  lightest of that ranking): ``order[rank, 0]`` is the query tile of rank ``rank``, and the
  caller may keep more per rank in the other columns (``decode`` returns the rank).
- ``paired`` (causal, where query tile m sees m + 1 key tiles): one CTA runs query tile M-1-j and
  then j of the same head, a pair whose work is the same for every j. Pairs are handed out in
  rounds with the pair fastest, then the head: every CTA does equal work per round (a static
  schedule that balances without atomics) and the CTAs of a round share few heads, so each K/V
  tile comes from HBM about once. With an odd tile count the middle tiles (half a pair's work)
  go last, one per CTA, where they shorten the final round. With a left window (``pair_limit``
  = window + 1) pairs keep equal work only while the window cuts no row (Sk <= pair_limit, which
  the kernel checks at run time); longer sequences fall back to ``heavy_first``.
  Pairs come in whole rounds, so the last round is ragged: with P pairs on G CTAs the launch
  takes ceil(P / G) pair-times where P / G would do (0.95 at d64 causal S=16384: 10.4 rounds
  in 11). With ``tail_rounds`` t > 0 only the first floor(P / G) - t rounds hand out pairs; the
  remaining pairs and the middle tiles of an odd count go as single tiles, heaviest first, in a
  snake over the CTAs: the tail's heads are the last few, so its K/V stays in L2, and its tiles
  get lighter as it goes, so the CTAs finish within a few key tiles of each other (the longest
  processing time rule; simulated on the grid's causal cells: 0.99 of the ideal, 0.93-0.98
  with whole rounds of pairs). Only launches with at least ``tail_min_tiles`` query tiles
  per head take the tail (``tail_now``).

A split tail (``split_tail``, head_major only: every query tile visits the same n key tiles)
evens out the ragged last round of a persistent launch. With T tiles on G CTAs and T % G = r > 0,
G x floor(T / G) would leave the last round with r busy CTAs and G - r idle ones; instead the
last full round and the ragged one (G + r tiles, (G + r) x n key tiles) are cut into G equal runs
of consecutive key tiles, one per CTA, after its floor(T / G) - 1 whole tiles (``split_segment``),
in launches whose query tiles visit at least ``split_min_keys`` key tiles (shorter runs pay
more for their extra prologues and epilogues than the ragged round costs).
A run is at least n key tiles long, so a tile is cut at most once, between CTAs c and c + 1: CTA
c + 1 runs the tile's last key tiles first of its run and leaves its partial O and row statistics
to CTA c (the writer), which runs the first key tiles last of its run, merges them and writes the
output (the finisher). Each CTA is the writer of at most one tile, so the partials have one slot
per CTA (the writer's index), and the writer's partial is ready long before its finisher needs it.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32

TILE_ORDERS = ("head_major", "heavy_first", "paired")
SPLIT_SEGMENTS = 3  # a CTA's run of the split tail touches at most 3 tiles (its run is < 2 tiles long)


class TileScheduler:
    def __init__(
        self,
        order: str,
        ranked: bool = False,
        pair_limit: Optional[int] = None,
        tail_rounds: int = 0,
        tail_min_tiles: int = 0,
        split_tail: bool = False,
        split_min_keys: int = 0,
    ):
        assert order in TILE_ORDERS, order
        assert tail_rounds >= 0
        assert not split_tail or order == "head_major", "a split tail needs the head-major order (equal tiles)"
        self.order = order
        self.split_tail = split_tail
        self.split_min_keys = split_min_keys  # key tiles per query tile from which a launch splits
        # paired: rounds of pairs handed out as single tiles, heaviest first, at the end
        self.tail_rounds = tail_rounds if order == "paired" else 0
        self.tail_min_tiles = tail_min_tiles  # query tiles per head from which a launch takes the tail
        # heavy_first / paired through a run-time ranking of the query tiles (head_major ignores it)
        self.ranked = ranked and order in ("heavy_first", "paired")
        self.pair_limit = pair_limit if order == "paired" else None

    def pairs_now(self, seqlen_k: Int32):
        """Whether this launch runs pairs: a Python bool, or a run-time flag with a pair limit."""
        if self.order != "paired":
            return False
        if self.pair_limit is None:
            return True
        return seqlen_k <= self.pair_limit

    # ------------------------------------------------------------------ either order, picked
    @cute.jit
    def work_units(self, num_m_blocks: Int32, heads_batches: Int32, pairs) -> Int32:
        """What a round hands one CTA each of: tiles, or pairs of every head followed by the odd
        middle tiles. A one-shot launch has this many CTAs."""
        units = num_m_blocks * heads_batches
        if pairs:
            units = (num_m_blocks // 2 + num_m_blocks % 2) * heads_batches
        return units

    def tail_now(self, num_m_blocks: Int32):
        """Whether this launch's pairs end in a tail: only with many query tiles per head. With
        few, each round's single tiles come from many heads where pairs came from few, and
        the short tiles pay for their own prologue and epilogue (decision pair-tail)."""
        return num_m_blocks >= self.tail_min_tiles

    @cute.jit
    def front_rounds(self, num_m_blocks: Int32, heads_batches: Int32, grid: Int32) -> Int32:
        """With a tail: the rounds of pairs before it (every CTA runs one pair per round)."""
        return cutlass.max((num_m_blocks // 2) * heads_batches // grid - self.tail_rounds, 0)

    @cute.jit
    def tail_tiles(self, num_m_blocks: Int32, heads_batches: Int32, grid: Int32) -> Int32:
        """With a tail: its single tiles (both tiles of each pair past the front, and the middle
        tiles of an odd count)."""
        front = self.front_rounds(num_m_blocks, heads_batches, grid) * grid
        return 2 * ((num_m_blocks // 2) * heads_batches - front) + (num_m_blocks % 2) * heads_batches

    @cute.jit
    def items_per_cta(self, num_m_blocks: Int32, heads_batches: Int32, grid: Int32, pairs, n_keys=None) -> Int32:
        """Items of each CTA (``n_keys``: key tiles per query tile, with a split tail)."""
        items = cute.ceil_div(self.work_units(num_m_blocks, heads_batches, pairs), grid)
        if cutlass.const_expr(self.split_tail):
            start = self.split_start(num_m_blocks, heads_batches, grid, n_keys)
            if start < num_m_blocks * heads_batches:
                items = start // grid + SPLIT_SEGMENTS
        if pairs:
            items = 2 * items
            if cutlass.const_expr(self.tail_rounds > 0):
                if self.tail_now(num_m_blocks):
                    items = 2 * self.front_rounds(num_m_blocks, heads_batches, grid) + cute.ceil_div(
                        self.tail_tiles(num_m_blocks, heads_batches, grid), grid
                    )
        return items

    @cute.jit
    def tile_of(self, item: Int32, cta: Int32, num_m_blocks: Int32, heads_batches: Int32, grid: Int32, pairs) -> Int32:
        """The tile id of item ``item`` of CTA ``cta`` (may name no tile: see ``valid``); with a
        tail, ids past the front's pairs count the tail's tiles, heaviest first."""
        offset = cta
        if item % 2 == 1:
            offset = grid - 1 - cta
        tile = item * grid + offset  # rounds of grid tiles, alternating direction
        if pairs:
            tile = ((item // 2) * grid + cta) * 2 + item % 2  # slot * 2 + (0: first, 1: second)
            if cutlass.const_expr(self.tail_rounds > 0):
                front = self.front_rounds(num_m_blocks, heads_batches, grid)
                if self.tail_now(num_m_blocks) & (item >= 2 * front):
                    tail_item = item - 2 * front
                    offset = cta
                    if tail_item % 2 == 1:
                        offset = grid - 1 - cta
                    tile = 2 * front * grid + tail_item * grid + offset  # a snake, as heavy_first
        return tile

    @cute.jit
    def valid(self, tile: Int32, num_m_blocks: Int32, heads_batches: Int32, grid: Int32, pairs):
        ok = tile < num_m_blocks * heads_batches
        if pairs:
            slot = tile // 2
            single = slot >= (num_m_blocks // 2) * heads_batches
            ok = (slot < self.work_units(num_m_blocks, heads_batches, pairs)) & ((tile % 2 == 0) | ~single)
            if cutlass.const_expr(self.tail_rounds > 0):
                front = self.front_rounds(num_m_blocks, heads_batches, grid) * grid
                if self.tail_now(num_m_blocks):
                    ok = tile - 2 * front < self.tail_tiles(num_m_blocks, heads_batches, grid)
        return ok

    @cute.jit
    def decode(
        self, tile: Int32, num_m_blocks: Int32, num_heads: Int32, num_batches: Int32, grid: Int32, pairs, order=None
    ):
        """tile id -> (m_block, head, batch, rank); ``rank``: the tile's row of ``order`` in a
        ranked order (else the same as m_block)."""
        heads_batches = num_heads * num_batches
        m_block, head_batch = self._decode_rounds(tile, num_m_blocks, heads_batches)
        if pairs:
            m_block, head_batch = self._decode_pairs(tile, num_m_blocks, heads_batches)
            if cutlass.const_expr(self.tail_rounds > 0):
                front = self.front_rounds(num_m_blocks, heads_batches, grid) * grid
                if self.tail_now(num_m_blocks) & (tile >= 2 * front):
                    m_block, head_batch = self._decode_tail(tile - 2 * front, front, num_m_blocks, heads_batches)
        rank = m_block
        if cutlass.const_expr(self.ranked):
            m_block = order[rank, 0]
        return m_block, head_batch % num_heads, head_batch // num_heads, rank

    # ------------------------------------------------------------------ the orders
    @cute.jit
    def _decode_rounds(self, tile: Int32, num_m_blocks: Int32, heads_batches: Int32):
        """(m_block, or with a ranked order the rank, heaviest 0; head * batch)."""
        m_block = tile % num_m_blocks
        head_batch = tile // num_m_blocks
        if cutlass.const_expr(self.order != "head_major"):  # heavy_first, or paired falling back
            rank = tile // heads_batches  # query tiles from the heaviest, heads fastest
            head_batch = tile % heads_batches
            m_block = num_m_blocks - 1 - rank
            if cutlass.const_expr(self.ranked):
                m_block = rank
        return m_block, head_batch

    @cute.jit
    def _decode_pairs(self, tile: Int32, num_m_blocks: Int32, heads_batches: Int32):
        """As ``_decode_rounds``, for pairs."""
        pairs = num_m_blocks // 2
        slot = tile // 2
        head_batch = slot - pairs * heads_batches
        m_block = pairs  # the middle tile of an odd count
        rank = pairs  # ranked: positions in the ranking, heaviest 0
        if slot < pairs * heads_batches:
            head_batch = slot // pairs
            j = slot % pairs
            m_block = j  # second: the j-th lightest
            rank = num_m_blocks - 1 - j
            if tile % 2 == 0:
                m_block = num_m_blocks - 1 - j  # first: the j-th heaviest
                rank = j
        if cutlass.const_expr(self.ranked):
            m_block = rank
        return m_block, head_batch

    @cute.jit
    def _decode_tail(self, k: Int32, front: Int32, num_m_blocks: Int32, heads_batches: Int32):
        """(m_block, or ranked the rank, heaviest 0; head * batch) of the tail's k-th tile, heaviest
        first: the first tiles of the pairs past the front (query tile M-1-j, by j rising, heads
        fastest), the middle tiles, then the second tiles (query tile j, by j falling)."""
        per_head = num_m_blocks // 2
        pairs_left = per_head * heads_batches - front
        middles = (num_m_blocks % 2) * heads_batches
        # the pairs past the front: head h0 from pair j0 on, then every pair of the later heads
        h0 = front // cutlass.max(per_head, 1)
        j0 = front - h0 * per_head
        later = heads_batches - h0 - 1
        index = k  # in the ascending-j order of those pairs
        if k >= pairs_left + middles:
            index = pairs_left - 1 - (k - pairs_left - middles)
        j = j0 + (index - j0 * later) // (later + 1)
        head_batch = h0 + (index - j0 * later) % (later + 1)
        if index < j0 * later:  # pairs below j0: only the later heads have them
            j = index // cutlass.max(later, 1)
            head_batch = h0 + 1 + index % cutlass.max(later, 1)
        m_block = num_m_blocks - 1 - j  # a pair's first tile
        rank = j
        if k >= pairs_left + middles:
            m_block = j  # its second tile
            rank = num_m_blocks - 1 - j
        if k >= pairs_left and k < pairs_left + middles:
            m_block = per_head
            rank = per_head
            head_batch = k - pairs_left
        if cutlass.const_expr(self.ranked):
            m_block = rank
        return m_block, head_batch

    # ------------------------------------------------------------------ the split tail
    @cute.jit
    def split_start(self, num_m_blocks: Int32, heads_batches: Int32, grid: Int32, n_keys: Int32) -> Int32:
        """The first tile of the split tail (the last full round), or the tile count where the
        launch splits nothing (whole rounds only, fewer tiles than CTAs, or query tiles of fewer
        than ``split_min_keys`` key tiles)."""
        units = num_m_blocks * heads_batches
        start = units
        if cutlass.const_expr(self.split_tail):
            rounds = units // grid
            if (units - rounds * grid > 0) & (rounds > 0) & (n_keys >= self.split_min_keys):
                start = (rounds - 1) * grid
        return start

    @cute.jit
    def split_run(self, cta: Int32, num_m_blocks: Int32, heads_batches: Int32, grid: Int32, n_keys: Int32):
        """CTA ``cta``'s part of the split tail, fixed for the whole launch (computed once per CTA,
        before its item loop): (splits, start, whole_items, first_rel, run_lo, run_hi). ``splits``:
        the launch has a split tail, from tile ``start``; the CTA's first whole_items items are
        whole tiles; its run covers the tail's key-tile units run_lo .. run_hi-1 (unit u = key tile
        u % n_keys of tile start + u // n_keys), beginning in tile start + first_rel."""
        units = num_m_blocks * heads_batches
        start = self.split_start(num_m_blocks, heads_batches, grid, n_keys)
        total = cutlass.Int64(units - start) * cutlass.Int64(n_keys)  # 0 where nothing splits
        run_lo = Int32(cutlass.Int64(cta) * total // cutlass.Int64(grid))
        run_hi = Int32(cutlass.Int64(cta + 1) * total // cutlass.Int64(grid))
        return start < units, start, start // grid, run_lo // n_keys, run_lo, run_hi

    @cute.jit
    def split_segment(self, item: Int32, run, n_keys: Int32, tile: Int32, ok):
        """(tile, valid, first, end) of item ``item`` of the CTA whose ``split_run`` is ``run``:
        visited key tiles first .. end-1 of the tile (0 .. n_keys: the whole tile, as every item
        before the split tail); ``tile`` and ``ok`` are the item's tile and validity before the
        split (tile_of, valid); ``n_keys`` >= 1 (a launch without keys runs whole tiles of one
        empty key tile)."""
        splits, start, whole_items, first_rel, run_lo, run_hi = run
        first = Int32(0)
        end = n_keys
        if splits & (item >= whole_items):
            rel = first_rel + (item - whole_items)  # the item's tile, counted from the tail's first
            base = rel * n_keys
            seg_lo = cutlass.max(run_lo, base)
            seg_hi = cutlass.min(run_hi, base + n_keys)
            tile = start + rel
            ok = seg_lo < seg_hi
            first = seg_lo - base
            end = seg_hi - base
        return tile, ok, first, end
