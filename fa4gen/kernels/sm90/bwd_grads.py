"""The scores' probabilities and gradients in one step of the Hopper backward (a mixin of
bwd.HopperAttentionBackward, beside bwd_step's MMAs): P = exp2(S * scale_log2 - LSE) under the
mask and dS = P * (dP - dPsum), with a soft cap's or a score modifier's derivative, an expression
mask, and the trainable tensors' shares. The step computes S^T and dP^T (keys on the view's rows)
or, with dkv_split t, S and dP (query rows on the view's rows): the helpers here read the
queries' LSE and dPsum, the mask's bounds and each score's (query row, key) either way.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from fa4gen.arch import WGMMA_M
from fa4gen.kernels.common.layout import rows_cols_view
from fa4gen.kernels.common.masking import column_offsets, visible_columns
from fa4gen.kernels.sm90.bwd_prepost import LOG2_E
from fa4gen.kernels.sm90.bwd_step import BwdFragments, BwdSmem


class Sm90BwdGrads:
    """Needs cfg, tile_m, tile_n, key_queries, score_grad, mask_mod and aux_grad."""

    @cute.jit
    def column_values(self, rows: cute.Tensor, stage: Int32, coords, row_shape):
        """This thread's columns' entries of a staged (tile_m, stages) row table in shared
        memory (LSE, dPsum), in registers shaped like a row of the S^T view."""
        values = cute.make_rmem_tensor(cute.make_layout(row_shape), Float32)
        for c in cutlass.range_constexpr(cute.size(values)):
            values[c] = rows[coords[0, c][1], stage]
        return values

    @cute.jit
    def query_values(self, rows: cute.Tensor, stage: Int32, coords, row_shape):
        """The step's per-query values (LSE, dPsum) this thread reads from a staged row table: its
        columns' (S^T: a row-shaped vector, the same for every view row) or its rows' (S: one per
        view row). ``query_value`` reads them for one view row."""
        if cutlass.const_expr(self.cfg.transposed):
            values = cute.make_rmem_tensor(cute.make_layout(cute.size(coords, mode=[0])), Float32)
            for r in cutlass.range_constexpr(cute.size(values)):
                values[r] = rows[coords[r, 0][0], stage]
        else:
            values = self.column_values(rows, stage, coords, row_shape)
        return values

    def query_value(self, values, r: int):
        """View row ``r``'s per-query values from ``query_values``: a vector (S^T) or a scalar (S)."""
        return values[r] if self.cfg.transposed else values.load()

    @cute.jit
    def visible_of_row(self, coords, r: int, at, sizes, exact: bool = False):
        """Which columns of view row ``r`` the mask lets through, as a vector: S^T's queries of a
        key, or (transposed) S's keys of a query row. S^T not ``exact`` (the score is S^T or its
        soft cap, finite): where only the lowest query of a key is bounded, one compare against
        it, a padded key's moved to Sq; padded query columns then pass, their P^T zero from the
        +inf LSE the preprocess gives them."""
        n_block, _, batch, m_block, _ = at
        seqlen_q, seqlen_k, args = sizes
        if cutlass.const_expr(self.cfg.transposed):
            return self._visible_keys(coords, r, at, sizes)
        offsets = column_offsets(coords, coords[0, None].shape)
        first_col = m_block * self.tile_m + coords[0, 0][1]
        key = n_block * self.tile_n + coords[r, 0][0]
        lo, hi = self.key_queries.key_query_range(key, batch, seqlen_q, seqlen_k, args)
        starts, ends = self.cfg.query_bounds
        if cutlass.const_expr(starts and not ends and not exact):
            lo = cutlass.select_(key < seqlen_k, lo, seqlen_q)
            return offsets >= lo - first_col
        return visible_columns(offsets, first_col, lo, hi, starts)

    @cute.jit
    def _visible_keys(self, coords, r: int, at, sizes):
        """S's view row ``r``: which of its keys the query row sees (none past Sq: a modifier may be
        infinite there, and the clamped row's keys would pass), one compare per key where every
        row's keys start at 0."""
        n_block, _, _, _, _ = at
        offsets = column_offsets(coords, coords[0, None].shape)
        start, end = self._key_range(coords, r, at, sizes)
        return visible_columns(
            offsets, n_block * self.tile_n + coords[0, 0][1], start, end, not self.key_queries.starts_at_zero
        )

    @cute.jit
    def _key_range(self, coords, r: int, at, sizes):
        """[start, end) of the keys S's view row ``r`` sees; empty for a padded query row."""
        _, _, batch, m_block, _ = at
        seqlen_q, seqlen_k, args = sizes
        row = m_block * self.tile_m + coords[r, 0][0]
        start, end = Int32(0), seqlen_k
        if cutlass.const_expr(self.key_queries.structural):
            start, end = self.key_queries.row_range(cutlass.min(row, seqlen_q - 1), batch, seqlen_q, seqlen_k, args)
        return start, cutlass.select_(row < seqlen_q, end, Int32(0))

    @cute.jit
    def plain_grads(self, f: BwdFragments, smem: BwdSmem, state, scores, grads, at, sizes, lse):
        """P = exp2(S * scale_log2 - LSE) while dP finishes, then dS = P (dP - dPsum) (or their
        transposes). The queries' LSE and dPsum are held for the tile up to 64 query rows
        (``lse``: loaded before the step's MMAs were issued, so the loads' latency hides behind
        them, except beside a mask's second bound: None, loaded here), read per row past that
        (held beside 128-row S^T and dP^T they spilled: decision bwd-tiles)."""
        coords = rows_cols_view(f.coords_s)
        row_shape = scores[0, None].shape
        per_row = self.tile_m > WGMMA_M
        if cutlass.const_expr(lse is None and not per_row):
            lse = self.query_values(smem.lse, state.index, coords, row_shape)
        warpgroup.wait_group(1)  # S is done; the exponentials run while dP finishes
        for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
            if cutlass.const_expr(per_row):
                lse = self.column_values(smem.lse, state.index, coords, row_shape)
            visible = self.visible_of_row(coords, r, at, sizes)
            probs = cute.math.exp2(
                scores[r, None].load() * Float32(self.cfg.scale_log2) - self.query_value(lse, r), fastmath=True
            )
            scores[r, None].store(cute.where(visible, probs, Float32(0.0)))
        warpgroup.wait_group(0)
        if cutlass.const_expr(not per_row):
            dpsum = self.query_values(smem.dpsum, state.index, coords, row_shape)
        for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
            if cutlass.const_expr(per_row):
                dpsum = self.column_values(smem.dpsum, state.index, coords, row_shape)
            grads[r, None].store(scores[r, None].load() * (grads[r, None].load() - self.query_value(dpsum, r)))

    @cute.jit
    def capped_grads(self, f: BwdFragments, smem: BwdSmem, state, scores, grads, at, sizes):
        """The forward's score is softcap * tanh(s * scale / softcap): P from it, and dS times
        the derivative 1 - tanh^2 (taken before the mask: masked scores are never used). The
        queries' LSE and dPsum are read per row (held for the whole tile beside tanh's values
        they spilled more: decision bwd-tiles)."""
        coords = rows_cols_view(f.coords_s)
        row_shape = scores[0, None].shape
        warpgroup.wait_group(0)
        softcap = self.cfg.softcap
        for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
            lse = self.query_value(self.query_values(smem.lse, state.index, coords, row_shape), r)
            dpsum = self.query_value(self.query_values(smem.dpsum, state.index, coords, row_shape), r)
            visible = self.visible_of_row(coords, r, at, sizes)
            t = cute.math.tanh(scores[r, None].load() * Float32(self.cfg.softmax_scale / softcap), fastmath=True)
            probs = cute.math.exp2(t * Float32(softcap * LOG2_E) - lse, fastmath=True)
            probs = cute.where(visible, probs, Float32(0.0))
            scores[r, None].store(probs)
            grads[r, None].store(probs * (grads[r, None].load() - dpsum) * (Float32(1.0) - t * t))

    def _pair(self, coords, r: int, c: int, at):
        """(query row, key, the row's index in the step's LSE and dPsum) of view score (r, c)."""
        n_block, _, _, m_block, _ = at
        if self.cfg.transposed:
            local, key = coords[r, 0][0], coords[0, c][1]
        else:
            local, key = coords[0, c][1], coords[r, 0][0]
        return m_block * self.tile_m + local, n_block * self.tile_n + key, local

    @cute.jit
    def _pair_range(self, coords, r: int, at, sizes):
        """The bound of view row ``r`` that ``visible_pair`` tests: the query rows that see its key
        (S^T), or the keys its query row sees (S)."""
        if cutlass.const_expr(self.cfg.transposed):
            bounds = self._key_range(coords, r, at, sizes)
        else:
            n_block, _, batch, _, _ = at
            seqlen_q, seqlen_k, args = sizes
            key = n_block * self.tile_n + coords[r, 0][0]
            bounds = self.key_queries.key_query_range(key, batch, seqlen_q, seqlen_k, args)
        return bounds

    @cute.jit
    def modified_grads(self, f: BwdFragments, smem: BwdSmem, state, scores, grads, at, sizes):
        """A score modifier: per score, its value (P from it) and its derivative with respect to
        the scaled score (dS times it), from the emitted ``score_grad``; the queries' LSE and
        dPsum read from shared memory where used (held in registers beside the modifier's own
        values they spilled). With trainable tensors, each visible score also adds its share of
        their gradient (``add_aux_grads``)."""
        _, head, batch, _, _ = at
        seqlen_q, seqlen_k, args = sizes
        coords = rows_cols_view(f.coords_s)
        warpgroup.wait_group(0)
        uniform = None
        if cutlass.const_expr(self.aux_grad is not None):
            uniform = [Float32(0.0) for shared in self.aux_grad[2] if shared]
        for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
            bounds = None  # (only where each score's visibility counts)
            if cutlass.const_expr(self.aux_grad is not None):
                bounds = self._pair_range(coords, r, at, sizes)
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                row, key, local = self._pair(coords, r, c, at)
                s = scores[r, c]
                value, slope, outer = self.score_grad(s, batch, head, row, key, seqlen_q, seqlen_k, args)
                prob = cute.math.exp2(value * Float32(LOG2_E) - smem.lse[local, state.index], fastmath=True)
                dvalue = prob * (grads[r, c] - smem.dpsum[local, state.index])
                if cutlass.const_expr(self.aux_grad is not None):
                    # (hidden pairs' shares dropped here; their P and dS below, per row)
                    visible = self.visible_pair(row, key, bounds, at, sizes)
                    share = Float32(cutlass.select_(visible, dvalue * outer, Float32(0.0)))
                    uniform = self.add_aux_grads(s, share, (row, key), at, sizes, uniform)
                scores[r, c] = prob
                grads[r, c] = dvalue * slope
            # masked last, as one select per row (no branch per score): whatever the modifier
            # gives outside the mask (it may be infinite on padding) is dropped
            visible = self.visible_of_row(coords, r, at, sizes, exact=True)
            scores[r, None].store(cute.where(visible, scores[r, None].load(), Float32(0.0)))
            grads[r, None].store(cute.where(visible, grads[r, None].load(), Float32(0.0)))
        if cutlass.const_expr(self.aux_grad is not None):
            self.add_uniform_aux_grads(uniform, batch, head, sizes)

    @cute.jit
    def visible_pair(self, row: Int32, key: Int32, bounds, at, sizes):
        """Whether query ``row`` sees ``key`` (``bounds``: [lo, hi) from ``_pair_range``: of the
        rows that see the key, or transposed of the keys the row sees), the expression mask
        applied too."""
        _, head, batch, _, _ = at
        seqlen_q, seqlen_k, args = sizes
        tested = key if self.cfg.transposed else row
        visible = (tested >= bounds[0]) & (tested < bounds[1])
        if cutlass.const_expr(self.mask_mod is not None):
            row, key = cutlass.min(row, seqlen_q - 1), cutlass.min(key, seqlen_k - 1)
            visible = visible & self.mask_mod(batch, head, row, key, seqlen_q, seqlen_k, args)
        return visible

    @cute.jit
    def add_aux_grads(self, s, dvalue, pair, at, sizes, uniform):
        """One score's share of the trainable tensors' gradients: dL/d(modifier) times the
        modifier's derivative with respect to each element it reads. Elements that vary per score
        are added at once (only where the share is non-zero: a hidden pair's indices may lie
        outside the tensor); those the same over the step are summed in ``uniform``."""
        row, key = pair
        _, head, batch, _, _ = at
        seqlen_q, seqlen_k, args = sizes
        derivatives, adders, shared = self.aux_grad
        # (the modifier's own arguments, so its common parts are computed once)
        slopes = derivatives(s, batch, head, row, key, seqlen_q, seqlen_k, args)
        row, key = cutlass.min(row, seqlen_q - 1), cutlass.min(key, seqlen_k - 1)
        sums, i = list(uniform), 0
        for read in cutlass.range_constexpr(len(adders)):
            share = dvalue * slopes[read]
            if cutlass.const_expr(shared[read]):
                sums[i] = sums[i] + share
                i += 1
            else:
                if share != Float32(0.0):
                    adders[read](share, batch, head, row, key, seqlen_q, seqlen_k, args)
        return sums

    @cute.jit
    def add_uniform_aux_grads(self, sums, batch: Int32, head: Int32, sizes):
        """The step's sums of the per-step elements: reduced over the warp, added by its first lane."""
        seqlen_q, seqlen_k, args = sizes
        _, adders, shared = self.aux_grad
        i = 0
        for read in cutlass.range_constexpr(len(adders)):
            if cutlass.const_expr(shared[read]):
                total = sums[i]
                for offset in cutlass.range_constexpr(5):
                    total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << offset)
                if cute.arch.lane_idx() == 0:
                    adders[read](total, batch, head, Int32(0), Int32(0), seqlen_q, seqlen_k, args)
                i += 1

    @cute.jit
    def mask_grads(self, f: BwdFragments, scores, grads, at, sizes):
        """The expression mask: P and dS zero where mask_mod(b, h, q_idx, kv_idx, Sq, Sk, args) is
        False (a select, so whatever the hidden scores gave is dropped). Rows and keys past Sq /
        Sk are evaluated at the last real one (their values are dropped anyway; the mask's aux
        lookups stay in range)."""
        _, head, batch, _, _ = at
        seqlen_q, seqlen_k, args = sizes
        coords = rows_cols_view(f.coords_s)
        for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                row, key, _ = self._pair(coords, r, c, at)
                row, key = cutlass.min(row, seqlen_q - 1), cutlass.min(key, seqlen_k - 1)
                visible = self.mask_mod(batch, head, row, key, seqlen_q, seqlen_k, args)
                scores[r, c] = Float32(cutlass.select_(visible, scores[r, c], Float32(0.0)))
                grads[r, c] = Float32(cutlass.select_(visible, grads[r, c], Float32(0.0)))
