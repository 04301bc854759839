"""Which (query tile, head, batch) a CTA works on, for one-shot and persistent launches.

Tiles are numbered 0..num_tiles-1 and handed out in rounds of ``grid`` tiles; in round r, CTA b
takes tile r*grid + b on even rounds and r*grid + grid-1-b on odd ones (a snake). A launch with
one CTA per tile is the special case of a single round. The numbering decides the order:
- ``heavy_first`` (causal / windowed masks, where work per query tile differs): the query tile
  index is the slowest digit, counted from the end of the sequence, so the longest tiles start
  first. Work then falls linearly with the tile number, and the snake pairs a heavy tile with a
  light one for every CTA: a static schedule with balanced totals, no atomics.
- otherwise the query tile is the fastest digit: CTAs running together share one head's K/V in L2.
Packed documents break "higher query tile = more work" (work restarts at every document), so
there the caller passes the query tiles ranked by their work (``order``: most first) and the
slowest digit indexes that ranking.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


class TileScheduler:
    def __init__(self, heavy_first: bool, ranked: bool = False):
        self.heavy_first = heavy_first
        self.ranked = ranked  # heavy_first through a run-time ranking of the query tiles

    @cute.jit
    def tile_of(self, round_: Int32, cta: Int32, grid: Int32) -> Int32:
        """The tile CTA ``cta`` works on in round ``round_`` (may be >= num_tiles in the last)."""
        offset = cta
        if round_ % 2 == 1:
            offset = grid - 1 - cta
        return round_ * grid + offset

    @cute.jit
    def decode(self, tile: Int32, num_m_blocks: Int32, num_heads: Int32, num_batches: Int32, order=None):
        """tile index -> (m_block, head, batch)."""
        m_block = Int32(0)
        head_batch = Int32(0)
        if cutlass.const_expr(self.heavy_first):
            heads_batches = num_heads * num_batches
            m_block = num_m_blocks - 1 - tile // heads_batches
            if cutlass.const_expr(self.ranked):
                m_block = order[tile // heads_batches]
            head_batch = tile % heads_batches
        else:
            m_block = tile % num_m_blocks
            head_batch = tile // num_m_blocks
        return m_block, head_batch % num_heads, head_batch // num_heads
