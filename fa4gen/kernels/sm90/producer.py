"""The Hopper forward's producer warp (a mixin of fwd.HopperAttentionForward): per query tile
it loads the first K tile, the tile's Q rows (publishing the tile's position and key-tile bounds
with them: ``publish_tile``), then V and the remaining K/V tiles, highest first, each into the
ring's next stage once both consumer warpgroups have freed it.

Q has one pair of mbarriers per buffer, or with ``q_per_warpgroup`` one per consumer warpgroup's
64 rows (``q_slot``): a warpgroup then starts a tile once its own rows are in, and its next rows
load once it has freed its own.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from fa4gen.arch import WGMMA_M
from fa4gen.kernels.sm90.state import TileInfo


def tma_pipeline(barriers, stages: int, tx_bytes: int, warpgroups: int):
    """A TMA pipeline whose stages ``warpgroups`` consumer warpgroups release (a warp's lane 0 each)."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers,
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * warpgroups),
        tx_count=tx_bytes,
        defer_sync=True,
    )


class Sm90Producer:
    """TMA loads of Q, K and V for the tiles the scheduler gives this CTA (one warp)."""

    @cute.jit
    def publish_tile(self, pipe_q, q_state, sTiles: cute.Tensor, t):
        """Acquire the next Q buffer and hand the consumers this tile's info with it: written to
        the buffer's slot once the consumers have freed it, before the arrive that their Q wait
        acquires. The consumers then start a tile without decoding it or waiting on the global
        loads of its bounds (document key ranges, a ranked order, a block mask's count): the
        producer did that while they were busy with the previous tile."""
        pipe_q.sync_object_empty.wait(q_state.index, q_state.phase)
        # every lane stores the same words, so whichever lane the pipeline elects to arrive has
        # stored them before its arrive (whose release the consumers' wait acquires)
        for i in cutlass.range_constexpr(len(self.tile_fields)):
            sTiles[i, q_state.index] = getattr(t, self.tile_fields[i])
        pipe_q.producer_acquire(q_state, try_acquire_token=True)  # the arrive alone: the buffer is free

    @cute.jit
    def received_tile(self, sTiles: cute.Tensor, index: Int32):
        """The tile info ``publish_tile`` wrote to Q buffer ``index`` (after the wait for that buffer)."""
        fields = {}
        for i in cutlass.range_constexpr(len(self.tile_fields)):
            fields[self.tile_fields[i]] = sTiles[i, index]
        return TileInfo(**fields)

    @cute.jit
    def key_block(self, t, i: Int32, args) -> Int32:
        """The i-th key tile a query tile visits: from the highest down, or the block mask's list."""
        n_block = t.n_max - 1 - i
        if cutlass.const_expr(self.block_sparse):
            n_block = args.block_index[t.mask_b, t.mask_h, t.m_block, i]
        return n_block

    @cute.jit
    def produce(self, tma_q, mQ, tma_k, mK, tma_v, mVt, sQ, sK, sV, sTiles, pipes, sizes):
        """One warp: per tile, the first K tile, then Q (waits for the consumers to free it: K can
        run ahead into the next tile meanwhile), then V and the remaining K/V tiles, highest first.
        Chained tiles with two Q buffers send the next tile's Q one key tile into this one (``q_ahead``)."""
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        items = self.scheduler.items_per_cta(
            sizes.num_m_blocks, sizes.heads_batches, sizes.grid, sizes.pairs, sizes.n_keys
        )
        ahead = Int32(0)  # 1: this item's tile and Q went out with the previous tile's loads
        for item in cutlass.range(items, unroll=1):
            tile, ok, first, end = self.scheduled(item, sizes)
            if ok:
                t = self.tile_info(tile, sizes, first, end)
                kv_state, q_state, ahead = self.produce_tile(
                    tma_q,
                    mQ,
                    tma_k,
                    mK,
                    tma_v,
                    mVt,
                    sQ,
                    sK,
                    sV,
                    sTiles,
                    pipes,
                    sizes,
                    t,
                    kv_state,
                    q_state,
                    ahead,
                    item,
                    items,
                )

    @property
    def q_ahead(self) -> bool:
        """Whether the producer publishes the next tile and loads its Q one key tile into this
        one (chained query tiles with two Q buffers): that buffer (two tiles back) is free once
        this tile's second K/V stage is, so Q is in place a tile early, where after the next
        tile's first K it arrived a stage or two before the chained step needs it, with the held
        P.V (chain.py). Unchained kernels gained nothing from it (decision chain-query-tiles)."""
        return self.chain and self.q_stages >= 2

    @cute.jit
    def load_q(self, tma_q, mQ, sQ, sTiles, pipe_q, q_state, t):
        """Publish tile ``t`` with its Q buffer (``publish_tile``) and load its Q rows into it."""
        one = cute.make_layout(1)
        gQ = cute.local_tile(mQ[None, None, t.head, t.batch], (WGMMA_M, self.dqk), (None, 0))
        tQs, tQg = cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        if cutlass.const_expr(not self.cfg.q_per_warpgroup):
            self.publish_tile(pipe_q, q_state, sTiles, t)
        elif cutlass.const_expr(self.o_over_v):  # warpgroup 0 at most a tile ahead: see o_tile_over_v
            pipe_q.sync_object_empty.wait(self.q_slot(q_state, 1).index, q_state.phase)
        for w in cutlass.range_constexpr(self.num_consumers):
            slot = self.q_slot(q_state, w)
            if cutlass.const_expr(self.cfg.q_per_warpgroup):  # each warpgroup's rows once it freed them
                self.publish_tile(pipe_q, slot, sTiles, t)
            cute.copy(
                tma_q,
                tQg[None, t.m_block * self.num_consumers + w],
                tQs[None, q_state.index * self.num_consumers + w],
                tma_bar_ptr=pipe_q.producer_get_barrier(slot),
            )
        q_state.advance()
        return q_state

    def q_slot(self, q_state, wg):
        """Warpgroup ``wg``'s barriers in the Q buffer ``q_state`` is at: its rows' own pair with
        ``q_per_warpgroup`` (slot buffer * W + wg, in the buffer's phase), else the buffer's."""
        if cutlass.const_expr(not self.cfg.q_per_warpgroup):
            return q_state
        return pipeline.PipelineState(
            self.q_slots, q_state.count, q_state.index * self.num_consumers + wg, q_state.phase
        )

    @cute.jit
    def load_next_q(self, tma_q, mQ, sQ, sTiles, pipe_q, q_state, sizes, item: Int32, items: Int32):
        """``q_ahead``: the next item's tile, where it is one, published with its Q now; returns
        the Q state and whether it went out."""
        ahead = Int32(0)
        if item + 1 < items:
            tile, ok, first, end = self.scheduled(item + 1, sizes)
            if ok:
                q_state = self.load_q(tma_q, mQ, sQ, sTiles, pipe_q, q_state, self.tile_info(tile, sizes, first, end))
                ahead = Int32(1)
        return q_state, ahead

    @cute.jit
    def produce_tile(
        self,
        tma_q,
        mQ,
        tma_k,
        mK,
        tma_v,
        mVt,
        sQ,
        sK,
        sV,
        sTiles,
        pipes,
        sizes,
        t,
        kv_state,
        q_state,
        ahead: Int32,
        item: Int32,
        items: Int32,
    ):
        pipe_q, pipe_k, pipe_v = pipes
        one = cute.make_layout(1)
        kv_head = t.head // self.cfg.qhead_per_kvhead
        gK = cute.local_tile(mK[None, None, kv_head, t.batch], (self.tile_n, self.dqk), (None, 0))
        gVt = cute.local_tile(mVt[None, None, kv_head, t.batch], (self.dv, self.tile_n), (0, None))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gVt, 0, 2))
        if t.n_count > 0:
            pipe_k.producer_acquire(kv_state)
            cute.copy(
                tma_k,
                tKg[None, self.key_block(t, 0, sizes.args)],
                tKs[None, kv_state.index],
                tma_bar_ptr=pipe_k.producer_get_barrier(kv_state),
            )
        if cutlass.const_expr(not self.q_ahead):
            q_state = self.load_q(tma_q, mQ, sQ, sTiles, pipe_q, q_state, t)
        elif ahead == 0:  # (else the previous tile published this one)
            q_state = self.load_q(tma_q, mQ, sQ, sTiles, pipe_q, q_state, t)
        if t.n_count > 0:
            pipe_v.producer_acquire(kv_state)
            cute.copy(
                tma_v,
                tVg[None, self.key_block(t, 0, sizes.args)],
                tVs[None, kv_state.index],
                tma_bar_ptr=pipe_v.producer_get_barrier(kv_state),
            )
            kv_state.advance()
        next_ahead = Int32(0)  # (tiles of at most 2 key tiles leave the next Q to the next tile's loads)
        for i in cutlass.range(t.n_count - 1, unroll=1):
            if cutlass.const_expr(self.q_ahead):
                if i == 1:  # the next tile's Q, once this tile's second K/V stage went out
                    q_state, next_ahead = self.load_next_q(tma_q, mQ, sQ, sTiles, pipe_q, q_state, sizes, item, items)
            n_block = self.key_block(t, i + 1, sizes.args)
            pipe_k.producer_acquire(kv_state)
            cute.copy(
                tma_k, tKg[None, n_block], tKs[None, kv_state.index], tma_bar_ptr=pipe_k.producer_get_barrier(kv_state)
            )
            pipe_v.producer_acquire(kv_state)
            cute.copy(
                tma_v, tVg[None, n_block], tVs[None, kv_state.index], tma_bar_ptr=pipe_v.producer_get_barrier(kv_state)
            )
            kv_state.advance()
        return kv_state, q_state, next_ahead
