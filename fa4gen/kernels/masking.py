"""Structural masks: which key tiles a query tile needs, which of them need mask code.

Positions are aligned bottom-right: query row i sits at key position i + (Sk - Sq). A row sees
keys in [i + off - left, i + off + right] (a bound of None is unbounded) and below Sk.

For one query tile the key tiles split in three runs, visited from the highest key tile down
(the diagonal first, so the running max is found early):
  [split_hi, n_max)   boundary tiles on the right bound / ragged Sk: masked
  [split_lo, split_hi) interior tiles: no mask code at all
  [n_min, split_lo)   boundary tiles on the left bound: masked
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32


class KeyTileRange:
    """Compile-time mask bounds; run-time sizes come in as arguments."""

    def __init__(self, tile_m: int, tile_n: int, left: Optional[int], right: Optional[int]):
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.left = left
        self.right = right

    @cute.jit
    def bounds(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """(n_min, split_lo, split_hi, n_max) for query tile ``m_block``; n_max <= n_min: no keys."""
        tile_m, tile_n = self.tile_m, self.tile_n
        offset = seqlen_k - seqlen_q
        first_row = m_block * tile_m
        last_row = cutlass.min(first_row + tile_m, seqlen_q) - 1
        n_max = cute.ceil_div(seqlen_k, tile_n)
        # tiles wholly below Sk and wholly left of the right bound for every row of the tile
        split_hi = seqlen_k // tile_n
        if cutlass.const_expr(self.right is not None):
            visible_end = cutlass.max(last_row + offset + self.right + 1, 0)
            n_max = cutlass.min(n_max, cute.ceil_div(visible_end, tile_n))
            full_end = cutlass.max(first_row + offset + self.right + 1, 0)
            split_hi = cutlass.min(split_hi, full_end // tile_n)
        n_min = Int32(0)
        split_lo = Int32(0)
        if cutlass.const_expr(self.left is not None):
            n_min = cutlass.max(first_row + offset - self.left, 0) // tile_n
            split_lo = cute.ceil_div(cutlass.max(last_row + offset - self.left, 0), tile_n)
        split_hi = cutlass.max(cutlass.min(split_hi, n_max), n_min)
        split_lo = cutlass.min(cutlass.max(split_lo, n_min), split_hi)
        return n_min, split_lo, split_hi, n_max

    @cute.jit
    def apply(
        self,
        scores_mn: cute.Tensor,
        coords_mn: cute.Tensor,
        row_base: Int32,
        col_base: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
    ):
        """Set scores outside the visible key range of their row to -inf (in place)."""
        offset = seqlen_k - seqlen_q
        for r in cutlass.range_constexpr(cute.size(scores_mn, mode=[0])):
            row = row_base + coords_mn[r, 0][0]
            col_end = seqlen_k
            if cutlass.const_expr(self.right is not None):
                col_end = cutlass.min(col_end, row + offset + self.right + 1)
            col_start = Int32(0)
            if cutlass.const_expr(self.left is not None):
                col_start = row + offset - self.left
            for c in cutlass.range_constexpr(cute.size(scores_mn, mode=[1])):
                col = col_base + coords_mn[0, c][1]
                # a select, not a branch: one instruction per score and no control flow to trace
                visible = (col < col_end) & (col >= col_start)
                scores_mn[r, c] = cutlass.Float32(
                    cutlass.select_(visible, scores_mn[r, c], -cutlass.Float32.inf)
                )
