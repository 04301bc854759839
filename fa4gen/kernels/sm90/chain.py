"""Chained query tiles on Hopper: a query tile's last P.V is issued with the next tile's first Q.K^T.

Without the chain every query tile a consumer warpgroup runs starts and ends with an MMA it
waits for alone: the first Q.K^T (nothing to compute until S arrives) and the last P.V (nothing
left to compute while it runs), then the epilogue. With the chain (the plan's
``chain_query_tiles``) the warpgroup holds the last P.V back: O, P and the row statistics of
the finished tile stay in registers ("held"), and the next tile's first step issues its Q.K^T
and the held P.V together, runs the new tile's first softmax while the tensor cores do both,
then writes the held tile's O (the epilogue) and zeroes O for the new tile. The CTA's last
tile, and a held tile followed by one with no key tile to visit, end alone (``flush_held``).

The held tile's position and row statistics are copied into registers when it ends
(``hold_tile``): its Q buffer and tile info are released to the producer as before, so the
producer loads the next tiles meanwhile. Every warpgroup of the CTA runs the same tiles, so
each takes the same turns: one per chained step where the unchained kernel takes two (the last
P.V and the next first Q.K^T), and the turn ring stays in step.

With two Q buffers the producer sends the next tile's Q one key tile into this one
(``HopperAttentionForward.q_ahead``): the chained step issues the held P.V with the new tile's
first Q.K^T, so a Q that arrives late stalls both.

The chain needs O's staging buffer to be free of Q and P (the next tile's Q and first P are
written before the held O is staged) and every warpgroup to visit every key tile (no skipped
tiles, whose turns differ per warpgroup): the planner applies it only there.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from fa4gen.kernels.sm90.state import HeldTile


class Sm90TileChain:
    """Mixin for the Hopper forward kernel: needs make_o_and_p(), epilogue(), held_tile_info(),
    pv_product(), issue_qk_with_pv(), scores_to_probs(), store_p(), softmax and split_tail."""

    @cute.jit
    def make_held(self, thr_pv, sO, tma_o, mO, mLSE):
        """O (zero) and P for every tile of this warpgroup, and room for a held tile's state."""
        acc_o, p = self.make_o_and_p(thr_pv)
        row_max, row_sum = self.softmax.make_state()
        # m_block, head, batch (and with a split tail the tile's role, see split.py)
        where = cute.make_rmem_tensor(cute.make_layout(4 if self.cfg.split_tail else 3), Int32)
        pending = cute.make_rmem_tensor(cute.make_layout(1), Int32)
        pending[0] = Int32(0)
        return HeldTile(
            acc_o=acc_o,
            p=p,
            row_max=row_max,
            row_sum=row_sum,
            where=where,
            pending=pending,
            sO=sO,
            tma_o=tma_o,
            mO=mO,
            mLSE=mLSE,
        )

    @cute.jit
    def hold_tile(self, loop, tile):
        """The query tile's main loop is done but for its last P.V: keep its row statistics and
        position for the epilogue that the next tile's first step (or the flush) runs."""
        held = loop.held
        for r in cutlass.range_constexpr(cute.size(held.row_max)):
            held.row_max[r] = loop.row_max[r]
            held.row_sum[r] = loop.row_sum[r]
        held.where[0] = tile.m_block
        held.where[1] = tile.head
        held.where[2] = tile.batch
        if cutlass.const_expr(self.cfg.split_tail):
            held.where[3] = tile.split
        held.pending[0] = Int32(1)

    @cute.jit
    def finish_held(self, loop):
        """The held tile's epilogue (its last P.V has completed), then O is zero for the next tile."""
        held = loop.held
        ended = dataclasses.replace(loop, row_max=held.row_max, row_sum=held.row_sum)
        tile = self.held_tile_info(held, loop.warpgroup)
        self.epilogue(ended, held.sO, held.tma_o, held.mO, held.mLSE, tile, loop.warpgroup, loop.seqlen_q)
        loop.acc_o.fill(0.0)
        held.pending[0] = Int32(0)

    @cute.jit
    def flush_held(self, loop, v_state):
        """The held tile ends alone: its last P.V, then its epilogue."""
        v_state = self.pv_product(loop, v_state)
        self.finish_held(loop)
        return v_state

    @cute.jit
    def chained_first_tile(self, loop, tile, n_block: Int32, k_state, v_state, masked: bool, check_start: bool):
        """This query tile's first Q.K^T and the held tile's last P.V, issued together; the first
        softmax runs while the tensor cores do both, then P becomes the next A operand and the
        held tile's O is written out."""
        acc_s = cute.make_rmem_tensor(loop.coords_s.shape, Float32)
        self.issue_qk_with_pv(loop, acc_s, k_state, v_state)  # the held P as the A operand
        loop.pipe_k.consumer_release(k_state)
        # the new tile's O starts at zero: the correction is not needed
        self.scores_to_probs(loop, tile, acc_s, n_block, masked, check_start)
        warpgroup.wait_group(0)
        loop.pipe_v.consumer_release(v_state)
        self.store_p(loop, acc_s)  # the held P.V has read P
        self.finish_held(loop)
        k_state.advance()
        v_state.advance()
        return k_state, v_state
