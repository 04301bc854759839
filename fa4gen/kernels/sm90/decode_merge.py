"""The decode kernel's split merge (fa4gen.kernels.sm90.decode): the last split of a 64-row query
tile to finish merges every split's partial O by their LSE.

O = sum_s exp(lse_s - lse) O_s with lse = log(sum_s exp(lse_s) + exp(sink)). The merge is on the
launch's critical path (every other CTA is done by then), and its cost is load latency, so it is
laid out for many independent loads in flight rather than few instructions. A tile of at most
FEW_ROWS rows (decode at small G) merges a row per warp, the lanes holding the splits' LSEs
(max and sum by butterfly) and each split's weight shuffled from its lane. More rows:
1. one thread per row reads the row's split LSEs in one pass (online max and sum, the loads
   unrolled) and leaves the row's max and 1 / sum in shared memory, writing the merged LSE;
2. each warp then takes up to 8 rows at once (``rows_per_warp``), lanes over the columns, and for each split
   loads every row's LSE and O columns before it adds any of them: a split costs about one load
   latency, not two dependent loads per row.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa4gen.arch import WARPGROUP_THREADS, WGMMA_M
from fa4gen.kernels.common.softmax import LN2
from fa4gen.kernels.sm90.decode_config import MAX_SPLITS

COMBINE_WARPS = WARPGROUP_THREADS // 32
MERGE_ACCUMULATORS = 32  # per lane: rows a warp merges at once x (Dv / 32) (64 spilled at d256)
FEW_ROWS = 2 * COMBINE_WARPS  # up to here a row per warp, its splits over the lanes (fewer round trips)
SPLITS_PER_LANE = MAX_SPLITS // 32


class DecodeSplitMerge:
    """Mixed into HopperAttentionDecode: needs ``cfg``, ``group``, ``dv`` and ``sync``."""

    @property
    def rows_per_warp(self) -> int:
        """Rows a warp merges at once: 8, fewer where Dv's columns would take more registers."""
        return max(1, min(8, MERGE_ACCUMULATORS // -(-self.dv // 32)))

    @cute.jit
    def combine_tile(self, parts: tuple, outs: tuple, where: tuple, num_splits: Int32, sStats, wtidx, wg, args):
        """Merge the partials of 64-row query tile ``m_block`` (``parts``: (O partials, LSE
        partials); ``outs``: (O, LSE or None); ``where``: (m_block, kv_head, batch, seqlen_q);
        ``sStats``: (64, 2, warpgroups) fp32 shared memory for each row's max and 1 / sum)."""
        mOPart, mLSEPart = parts
        m_block, kv_head, batch, seqlen_q = where
        rows = seqlen_q * self.group
        first = m_block * WGMMA_M
        tile_rows = cutlass.min(rows - first, WGMMA_M)
        if tile_rows <= FEW_ROWS:
            for r in cutlass.range(wtidx // 32, tile_rows, COMBINE_WARPS, unroll=1):
                self.merge_row_over_lanes(parts, outs, first + r, kv_head, batch, wtidx % 32, num_splits, args)
        else:
            if wtidx < tile_rows:  # (tile_rows <= 64: the first two warps)
                self.row_stats(mLSEPart, outs[1], first + wtidx, kv_head, batch, num_splits, sStats, wtidx, wg, args)
            self.sync(wg, async_reads=False)
            per_pass = COMBINE_WARPS * self.rows_per_warp
            for p in cutlass.range_constexpr(WGMMA_M // per_pass):
                if p * per_pass < tile_rows:  # (a pass past the tile's rows has nothing to merge)
                    self.merge_rows(parts, outs[0], where, p, num_splits, sStats, wtidx, wg)

    @cute.jit
    def merge_row_over_lanes(self, parts: tuple, outs: tuple, packed: Int32, kv_head, batch, lane, num_splits, args):
        """One row, one warp: lane l loads the LSEs of splits l, l + 32, ... at once (their max
        and sum by butterfly), and sums columns l, l + 32, ... of O over the splits, each
        split's weight shuffled from its lane."""
        mOPart, mLSEPart = parts
        mO, mLSE = outs
        log2e = Float32(1.0 / LN2)
        weights = cute.make_rmem_tensor(cute.make_layout(SPLITS_PER_LANE), Float32)
        top = -Float32.inf
        for j in cutlass.range_constexpr(SPLITS_PER_LANE):
            weights[j] = -Float32.inf
            if lane + 32 * j < num_splits:
                weights[j] = mLSEPart[packed, kv_head, batch, lane + 32 * j] * log2e
            top = cute.arch.fmax(top, weights[j])
        for offset in cutlass.range_constexpr(5):
            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=1 << offset))
        sink = Float32(0.0)
        if cutlass.const_expr(self.cfg.sinks):
            sink = Float32(args.sinks[kv_head * self.group + packed % self.group]) * log2e
            top = cute.arch.fmax(top, sink)
        if top == -Float32.inf:
            top = Float32(0.0)
        total = Float32(0.0)
        for j in cutlass.range_constexpr(SPLITS_PER_LANE):
            weights[j] = cute.math.exp2(weights[j] - top, fastmath=True)  # 0 past the splits
            total = total + weights[j]
        for offset in cutlass.range_constexpr(5):
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << offset)
        if cutlass.const_expr(self.cfg.sinks):
            total = total + cute.math.exp2(sink - top, fastmath=True)
        columns = cute.ceil_div(self.dv, 32)
        acc = cute.make_rmem_tensor(cute.make_layout(columns), Float32)
        acc.fill(0.0)
        last_col = self.cfg.head_dim_v - 1
        for j in cutlass.range_constexpr(SPLITS_PER_LANE):
            for s in cutlass.range(32 * j, cutlass.min(32 * j + 32, num_splits), unroll=4):
                weight = cute.arch.shuffle_sync(weights[j], s - 32 * j)
                for c in cutlass.range_constexpr(columns):
                    acc[c] = acc[c] + weight * mOPart[packed, cutlass.min(lane + 32 * c, last_col), kv_head, batch, s]
        inv = Float32(0.0)
        lse = -Float32.inf
        if total > Float32(0.0):
            inv = cute.arch.rcp_approx(total)
            lse = (top + cute.math.log2(total, fastmath=True)) * Float32(LN2)
        for c in cutlass.range_constexpr(columns):
            if lane + 32 * c < self.cfg.head_dim_v:
                mO[packed, lane + 32 * c, kv_head, batch] = (acc[c] * inv).to(mO.element_type)
        if cutlass.const_expr(mLSE is not None):
            if lane == 0:
                mLSE[packed, kv_head, batch] = lse

    @cute.jit
    def row_stats(self, mLSEPart, mLSE, packed: Int32, kv_head, batch, num_splits, sStats, r, wg, args):
        """Row ``packed``'s max (log2 units, 0 where every split is empty and no sink) and 1 / sum
        of exp2 over its splits and its sink into sStats[r, :, wg]; its merged LSE into mLSE."""
        log2e = Float32(1.0 / LN2)
        top, total = -Float32.inf, Float32(0.0)
        for s in cutlass.range(num_splits, unroll=4):
            value = mLSEPart[packed, kv_head, batch, s] * log2e
            grown = cute.arch.fmax(top, value)
            safe = grown
            if grown == -Float32.inf:
                safe = Float32(0.0)
            total = total * cute.math.exp2(top - safe, fastmath=True) + cute.math.exp2(value - safe, fastmath=True)
            top = grown
        if cutlass.const_expr(self.cfg.sinks):
            sink = Float32(args.sinks[kv_head * self.group + packed % self.group]) * log2e
            grown = cute.arch.fmax(top, sink)
            total = total * cute.math.exp2(top - grown, fastmath=True) + cute.math.exp2(sink - grown, fastmath=True)
            top = grown
        if top == -Float32.inf:
            top = Float32(0.0)
        inv = Float32(0.0)
        lse = -Float32.inf
        if total > Float32(0.0):
            inv = cute.arch.rcp_approx(total)
            lse = (top + cute.math.log2(total, fastmath=True)) * Float32(LN2)
        sStats[r, 0, wg] = top
        sStats[r, 1, wg] = inv
        if cutlass.const_expr(mLSE is not None):
            mLSE[packed, kv_head, batch] = lse

    @cute.jit
    def merge_rows(self, parts: tuple, mO, where: tuple, p: int, num_splits: Int32, sStats, wtidx, wg):
        """Pass ``p``: this warp's rows_per_warp rows (warp + COMBINE_WARPS x (p x rows_per_warp + i)), lane l taking
        columns l, l + 32, ... Rows past Sq x G read the last row (in bounds) with weight 0 and
        are not written; so are columns past Dv."""
        mOPart, mLSEPart = parts
        m_block, kv_head, batch, seqlen_q = where
        log2e = Float32(1.0 / LN2)
        lane, rows = wtidx % 32, seqlen_q * self.group
        columns = cute.ceil_div(self.dv, 32)
        acc = cute.make_rmem_tensor(cute.make_layout((self.rows_per_warp, columns)), Float32)
        acc.fill(0.0)
        packed = cute.make_rmem_tensor(cute.make_layout(self.rows_per_warp), Int32)
        tops = cute.make_rmem_tensor(cute.make_layout(self.rows_per_warp), Float32)
        invs = cute.make_rmem_tensor(cute.make_layout(self.rows_per_warp), Float32)
        for i in cutlass.range_constexpr(self.rows_per_warp):
            r = wtidx // 32 + COMBINE_WARPS * (p * self.rows_per_warp + i)
            packed[i] = cutlass.min(m_block * WGMMA_M + r, rows - 1)
            tops[i], invs[i] = sStats[r, 0, wg], sStats[r, 1, wg]
            if m_block * WGMMA_M + r >= rows:
                invs[i] = Float32(0.0)
        last_col = self.cfg.head_dim_v - 1
        for s in cutlass.range(num_splits, unroll=2):
            for i in cutlass.range_constexpr(self.rows_per_warp):
                lse = mLSEPart[packed[i], kv_head, batch, s] * log2e
                weight = cute.math.exp2(lse - tops[i], fastmath=True) * invs[i]
                for c in cutlass.range_constexpr(columns):
                    col = cutlass.min(lane + 32 * c, last_col)
                    acc[i, c] = acc[i, c] + weight * mOPart[packed[i], col, kv_head, batch, s]
        for i in cutlass.range_constexpr(self.rows_per_warp):
            if m_block * WGMMA_M + wtidx // 32 + COMBINE_WARPS * (p * self.rows_per_warp + i) < rows:
                for c in cutlass.range_constexpr(columns):
                    if lane + 32 * c < self.cfg.head_dim_v:
                        mO[packed[i], lane + 32 * c, kv_head, batch] = acc[i, c].to(mO.element_type)
