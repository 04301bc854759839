"""The Hopper backward's two small launches around its main kernel (a mixin of
bwd.HopperAttentionBackward), one CTA of 128 threads per (query tile, head, batch):

- preprocess: per query row, dPsum = rowsum(dO * O) - dLSE in fp32 and the LSE in log2 units (+inf for
  rows past Sq and rows that saw no key, so every probability the main kernel recomputes there
  is 0), and the tile's rows of dQ's fp32 accumulator zeroed (deterministic: its semaphores too);
- postprocess: dQ = softmax_scale * accumulator, rounded to the input type.

The workspaces have ceil(Sq / tile_m) * tile_m rows, so the main kernel reads and adds whole
tiles without bounds checks. With dq_grouped_turns the accumulator and semaphores hold one
partial per dQ group (bwd_step.py), query tile m of group g at virtual tile g x m_blocks + m: both
launches walk the groups (the semaphores' extent over m_blocks), the postprocess adding the
partials in group order, so the sum's order is fixed too.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa4gen.arch import WARPGROUP_THREADS

LOG2_E = math.log2(math.e)
WARP = 32


class Sm90BwdPrePost:
    """Needs tile_m, dqk (padded head dim), cfg (Sm90BwdConfig)."""

    @cute.kernel
    def preprocess(self, mO, mdO, mLSE, mdLSE, mdPsum, mLSElog2, mdQaccum, mdQorder):
        """mO, mdO: (B, Sq, H, Dv); mLSE, mdLSE (the LSE's gradient): (B, H, Sq); mdPsum,
        mLSElog2: (B, H, Sq_pad); mdQaccum: (B, H, groups x Sq_pad, D_pad); mdQorder: (B, H, groups x m_blocks, W)
        dQ's semaphores, zeroed when deterministic."""
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        lane, warp = tidx % WARP, tidx // WARP
        seqlen_q = mO.shape[1]
        dv = self.cfg.head_dim_v
        rows_per_warp = self.tile_m // (WARPGROUP_THREADS // WARP)
        for r in cutlass.range_constexpr(rows_per_warp):
            row = m_block * self.tile_m + warp * rows_per_warp + r
            total = Float32(0.0)
            if row < seqlen_q:
                for c in cutlass.range_constexpr((dv + WARP - 1) // WARP):
                    col = lane + c * WARP
                    if cutlass.const_expr((c + 1) * WARP <= dv):
                        total += Float32(mO[batch, row, head, col]) * Float32(mdO[batch, row, head, col])
                    elif col < dv:
                        total += Float32(mO[batch, row, head, col]) * Float32(mdO[batch, row, head, col])
            total = cute.arch.warp_reduction_sum(total, threads_in_group=WARP)
            if lane == 0:
                lse = Float32.inf
                if row < seqlen_q:
                    lse = mLSE[batch, head, row]
                    # an LSE used downstream adds dLSE * P to dS: dS = P * (dP - (dPsum - dLSE))
                    total -= mdLSE[batch, head, row]
                # a row that saw no key has LSE -inf: +inf makes its probabilities 0, not NaN
                lse_log2 = Float32.inf if lse == -Float32.inf else lse * Float32(LOG2_E)
                mdPsum[batch, head, row] = total
                mLSElog2[batch, head, row] = lse_log2
        if cutlass.const_expr(self.cfg.dq_grouped_turns):
            m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
            for group in cutlass.range(mdQorder.shape[2] // m_blocks, unroll=1):  # dQ's partials
                tile = group * m_blocks + m_block
                self._zero_dq_tile(mdQaccum, (batch, head, tile), tidx)
                if tidx < self.cfg.num_consumer_warpgroups:
                    mdQorder[batch, head, tile, tidx] = Int32(0)
        else:
            self._zero_dq_tile(mdQaccum, (batch, head, m_block), tidx)
            if cutlass.const_expr(self.cfg.deterministic):
                if tidx < self.cfg.num_consumer_warpgroups:
                    mdQorder[batch, head, m_block, tidx] = Int32(0)

    @cute.jit
    def _zero_dq_tile(self, mdQaccum, at, tidx):
        batch, head, tile = at
        for i in cutlass.range_constexpr(self.tile_m * self.dqk // WARPGROUP_THREADS):
            flat = tidx + i * WARPGROUP_THREADS
            mdQaccum[batch, head, tile * self.tile_m + flat // self.dqk, flat % self.dqk] = Float32(0.0)

    @cute.kernel
    def postprocess(self, mdQaccum, mdQ):
        """mdQ (B, Sq, H, D) = softmax_scale * mdQaccum (B, H, groups x Sq_pad, D_pad), its
        groups' partials added in group order (one group without dq_grouped_turns), rounded."""
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen_q, d = mdQ.shape[1], self.cfg.head_dim
        scale = Float32(self.cfg.softmax_scale)
        if cutlass.const_expr(self.cfg.dq_grouped_turns):
            rows = cute.ceil_div(seqlen_q, self.tile_m) * self.tile_m  # a group's
            groups = mdQaccum.shape[2] // rows
        for i in cutlass.range_constexpr(self.tile_m * self.dqk // WARPGROUP_THREADS):
            flat = tidx + i * WARPGROUP_THREADS
            row, col = m_block * self.tile_m + flat // self.dqk, flat % self.dqk
            if row < seqlen_q:
                total = mdQaccum[batch, head, row, col]
                if cutlass.const_expr(self.cfg.dq_grouped_turns):
                    for group in cutlass.range(1, groups, unroll=1):
                        total += mdQaccum[batch, head, group * rows + row, col]
                if cutlass.const_expr(self.dqk == d):
                    mdQ[batch, row, head, col] = (total * scale).to(mdQ.element_type)
                elif col < d:
                    mdQ[batch, row, head, col] = (total * scale).to(mdQ.element_type)
