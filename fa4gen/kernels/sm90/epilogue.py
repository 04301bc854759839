"""The end of a query tile on Hopper: O normalised, rounded, staged in shared memory and
TMA-stored, and the LSE written.

O's staging tile is one of five (the plan's ``o_staging``, chosen in ``HopperAttentionForward``):
its own buffer, whose store runs on into the next tile and is waited for only before the buffer
is written again; the warpgroup's P tile; the warpgroup's own Q rows (the next Q waits for the
store to read them); one buffer for all warpgroups, taken in warpgroup order; or, with two
warpgroups, that buffer for the first and the last key tile's V stage for the second (held
until its store has read it: ``o_tile_over_v``). In a split tail
(split.py) the epilogue also leaves or merges a partial.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from fa4gen.arch import WARPGROUP_THREADS, WGMMA_M
from fa4gen.kernels.common.layout import convert_into, rows_cols_view
from fa4gen.kernels.sm90.config import NamedBarrier
from fa4gen.kernels.sm90.state import TileInfo


class Sm90Epilogue:
    """Mixin for the Hopper forward kernel: needs dtype, dv, tile_m, num_consumers, o_shared,
    o_over_q, o_over_p, o_over_v (with kv_stages, v_stage_elems, o_to_v, o_to_q, smem_atom_elems and
    sees_no_key_tile()), sinks, return_lse, softmax, split_tail and _make_pv_mma() (and, with a
    split tail, Sm90SplitTail's write_partial, merge_stats and add_partial)."""

    @cute.jit
    def stage_o(self, loop, sO: cute.Tensor, wg: Int32, merge=None):
        """Round O to the output type and write it to its staging tile with stmatrix (8x8 16-bit
        matrices, a quarter of the shared-memory stores of element pairs); a split tail's
        finisher rounds it with the writer's partial added (``add_partial``)."""
        pv_mma = self._make_pv_mma()
        stmatrix = cute.make_tiled_copy_C(
            sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32), pv_mma
        )
        thr_store = stmatrix.get_slice(loop.wtidx)
        o_low = cute.make_rmem_tensor(pv_mma.get_slice(loop.wtidx).partition_shape_C((WGMMA_M, self.dv)), self.dtype)
        convert_into(loop.acc_o, o_low)
        if cutlass.const_expr(merge is not None):
            self.add_partial(loop, o_low, merge[0], merge[1], wg)
        cute.copy(stmatrix, thr_store.retile(o_low), thr_store.partition_D(sO))

    @cute.jit
    def tma_store_o(self, loop, sO, tma_o, mO, t, wg: Int32, merge=None):
        """Stage the normalised O in shared memory (its own buffer, over this warpgroup's P tile
        or Q rows, or the shared one in its turn; stmatrix) and TMA-store it, clipped to Sq rows
        and Dv columns."""
        barrier = NamedBarrier.EPILOGUE + wg
        storing = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4 == 0  # the warp that issues the store
        if cutlass.const_expr(self.o_shared):
            self.wait_o_turn(wg)  # the previous warpgroup's store has read the buffer
        elif cutlass.const_expr(self.o_over_v):
            if wg == 0:  # its own buffer (warpgroup 1's tile is held for it: o_tile_over_v)
                self.o_store_has_read(wg)
            else:  # warpgroup 0's last P.V has read the V stage too (it arrives after its main loop)
                cute.arch.barrier(barrier_id=loop.v_read_barrier, number_of_threads=2 * WARPGROUP_THREADS)
        elif cutlass.const_expr(not self.o_over_q):
            # O has its own buffer (or P's, which every warp's last P.V has read once all pass
            # the barrier): the previous tile's store was left running; it must have read the
            # buffer before this tile overwrites it (long done by now, as a rule)
            self.o_store_has_read(wg)
        self.stage_o(loop, sO, wg, merge)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=barrier, number_of_threads=WARPGROUP_THREADS)
        gO = cute.local_tile(mO[None, None, t.head, t.batch], (WGMMA_M, self.dv), (None, 0))
        tOs, tOg = cpasync.tma_partition(
            tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
        )
        if storing:
            cute.copy(tma_o, tOs, tOg[None, t.m_block * self.num_consumers + wg])
            cute.arch.cp_async_bulk_commit_group()
        if cutlass.const_expr(self.o_over_q):
            # O sits over Q's rows: the next tile's Q may load only once the store has read them
            self.o_store_has_read(wg)
        if cutlass.const_expr(self.o_shared):
            self.pass_o_turn(wg, storing)

    @cute.jit
    def o_tile_over_v(self, loop, sO, wg: Int32, t, q_state, v_state):
        """``over_v``: this warpgroup's O staging tile for tile ``t``, the V stage it holds (-1:
        none) and the barrier warpgroup 1 waits at before staging (per tile parity). Warpgroup 0
        stages in its own buffer (``sO``); warpgroup 1 over the V stage of its last key tile, which
        the main loop left unreleased (``pv_product``), or, where it saw no key tile, over its own
        Q rows (still unreleased); ``release_o_tile`` frees either once the store has read it. No
        warpgroup waits for another's store.

        Warpgroup 0 arrives here once its last P.V has read that V stage, and warpgroup 1 waits
        for it before writing (``tma_store_o``): a barrier per tile parity (one Q buffer: the Q
        phase), so warpgroup 0 can be a tile ahead, never two (that tile's K/V would need the
        stage warpgroup 1 still holds; tiles without keys need none, so with Q barriers per
        warpgroup the producer loads warpgroup 0's Q rows once warpgroup 1 has freed its rows
        of the previous tile, which it does past this tile's barrier: ``load_q``)."""
        last = (v_state.index + self.kv_stages - 1) % self.kv_stages  # (pv_product advanced the state)
        held = Int32(cutlass.select_(self.sees_no_key_tile(t), Int32(-1), last))
        # (warpgroup 1: 0/1 times the offsets; no select, whose result would lose their alignment)
        has_v = Int32(held >= 0)
        delta = wg * (has_v * (self.o_to_v + held * self.v_stage_elems) + (1 - has_v) * self.o_to_q)
        tile = cute.make_tensor(sO.iterator + cute.assume(delta, divby=self.smem_atom_elems), sO.layout)
        v_read_barrier = NamedBarrier.O_TURN + q_state.phase
        if wg == 0:
            cute.arch.barrier_arrive(barrier_id=v_read_barrier, number_of_threads=2 * WARPGROUP_THREADS)
        return tile, held, v_read_barrier

    @cute.jit
    def release_o_tile(self, pipes, q_state, wg: Int32, held: Int32):
        """``over_v``, warpgroup 1: once its O store has read the staging tile, free the V stage
        it sat over (``held``), or its Q rows where it held no V stage."""
        self.o_store_has_read(wg)
        pipe_q, _, pipe_v = pipes
        if held >= 0:
            if pipe_v.is_signaling_thread:
                pipe_v.sync_object_empty.arrive(held, pipe_v.consumer_mask)
        else:
            pipe_q.consumer_release(q_state)

    @cute.jit
    def wait_o_turn(self, wg: Int32):
        """O in one buffer for all warpgroups (taken in warpgroup order, tile by tile): wait
        until the previous warpgroup's store has read it (the warpgroup and the previous one's
        storing warp meet at this warpgroup's barrier)."""
        cute.arch.barrier(barrier_id=NamedBarrier.O_TURN + wg, number_of_threads=WARPGROUP_THREADS + 32)

    @cute.jit
    def pass_o_turn(self, wg: Int32, storing):
        """Hand the shared O buffer to the next warpgroup once this one's store has read it (only
        the storing warp waits for that)."""
        if storing:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            following = (wg + 1) % self.num_consumers
            cute.arch.barrier_arrive(
                barrier_id=NamedBarrier.O_TURN + following, number_of_threads=WARPGROUP_THREADS + 32
            )

    @cute.jit
    def await_o_store(self, wg: Int32):
        """O staged over P: the previous tile's O store must have read this warpgroup's P tile
        before the first P of the next tile overwrites it (the main loop calls this once per
        query tile, while its first Q.K^T runs; the store is long done as a rule)."""
        if cutlass.const_expr(self.o_over_p):
            self.o_store_has_read(wg)

    @cute.jit
    def o_store_has_read(self, wg: Int32):
        """Wait until this warpgroup's last O store has read its staging tile: the warp that
        issued it waits for the bulk copies' reads, the warpgroup's barrier passes it on."""
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4 == 0:  # the warp that issues the store
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=NamedBarrier.EPILOGUE + wg, number_of_threads=WARPGROUP_THREADS)

    @cute.jit
    def epilogue(self, loop, sO, tma_o, mO, mLSE, t, wg: Int32, seqlen_q: Int32):
        """The end of a query tile: its output (``store_output``). In a split tail every tile runs
        the same steps, each empty where its role does not take it (split.py): merge a
        partial (a finisher), leave one (a writer), write the output (a writer's goes past the
        last row, where the TMA store clips it away and no LSE row is written)."""
        merge = None
        if cutlass.const_expr(self.cfg.split_tail):
            self.write_partial(loop, t.split, wg)
            merge = (t.split, self.merge_stats(loop, t.split, wg))
            past = cute.ceil_div(seqlen_q, self.tile_m)  # a query tile wholly past Sq
            m_block = Int32(cutlass.select_(t.split < 0, past, t.m_block))
            t = TileInfo(m_block=m_block, head=t.head, batch=t.batch, row_base=m_block * self.tile_m + wg * WGMMA_M)
        self.store_output(loop, sO, tma_o, mO, mLSE, t, wg, seqlen_q, merge)

    @cute.jit
    def store_output(self, loop, sO, tma_o, mO, mLSE, t, wg: Int32, seqlen_q: Int32, merge=None):
        """Normalise O, store it (``tma_store_o``) and write the LSE. ``merge``: a split tail's
        (split word, weights of the own and the writer's O) from ``merge_stats``."""
        lse = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        sink = None
        if cutlass.const_expr(self.cfg.sinks):
            sink = Float32(loop.args.sinks[t.head])
        self.softmax.finalize(
            rows_cols_view(loop.acc_o), loop.row_max, loop.row_sum, lse, sink, None if merge is None else merge[1]
        )
        self.tma_store_o(loop, sO, tma_o, mO, t, wg, merge)
        if cutlass.const_expr(self.cfg.return_lse):
            coords = rows_cols_view(loop.coords_s)
            if coords[0, 0][1] == 0:
                for r in cutlass.range_constexpr(2):
                    row = t.row_base + coords[r, 0][0]
                    if row < seqlen_q:
                        mLSE[row, t.head, t.batch] = lse[r]
