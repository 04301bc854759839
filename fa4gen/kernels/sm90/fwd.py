"""Hopper (sm_90a) attention forward: warp-specialized TMA producer + wgmma consumer warpgroups.

CTA layout: warpgroup 0 is the producer (one warp issues TMA loads of Q and a ring of K/V
tiles, registers given away with setmaxnreg); warpgroups 1..W are consumers, each owning 64
query rows of the CTA's tile_m: S = Q.K^T (wgmma, both operands in shared memory), score
modifier + mask + online softmax in registers, O += P.V (wgmma, P from registers); see
mainloop.py. K and V have separate mbarrier pipelines so a K stage is released as soon as S
is computed. O leaves through shared memory (its own buffer, whose store runs on into the next
tile, or over the warpgroup's own Q rows) by TMA store, which clips the ragged edges
(epilogue.py). A persistent launch (one CTA per SM) walks the plan's tile order
(scheduler.py); the producer (producer.py) runs ahead into the next tile while consumers
finish the last, and hands each tile's position and key-tile bounds to the consumers with its Q
buffer (``publish_tile``).

Variants plug in without touching this machinery: the score hook (score_mod) and expression
mask (mask_mod) come from the emitted module; structural masks are per-row key intervals
(masking.py); the variant's run-time values (sinks, prefix lengths, document key ranges, block masks,
aux tensors and scalars) arrive as one tuple, read by name (variant.py).

Everything tile-shaped is a compile-time constant from the Plan; batch, heads and sequence
lengths are run-time values, so one compiled kernel serves all sizes.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from fa4gen.arch import WARPGROUP_THREADS, WGMMA_M
from fa4gen.kernels.common.layout import rows_cols_view
from fa4gen.kernels.common.masking import KeyTileRange
from fa4gen.kernels.common.scheduler import TileScheduler
from fa4gen.kernels.common.softmax import OnlineSoftmax
from fa4gen.kernels.common.variant import VariantArgs
from fa4gen.kernels.sm90.chain import Sm90TileChain
from fa4gen.kernels.sm90.config import Sm90FwdConfig, config_problem, split_partial_words
from fa4gen.kernels.sm90.epilogue import Sm90Epilogue
from fa4gen.kernels.sm90.mainloop import Sm90MainLoop
from fa4gen.kernels.sm90.producer import Sm90Producer, tma_pipeline
from fa4gen.kernels.sm90.split import Sm90SplitTail
from fa4gen.kernels.sm90.state import LaunchSizes, MainLoopState, TileInfo

SMEM_ALIGN = 1024  # 128-byte swizzle atoms repeat every 1 KB
Q_ATOM_COLS = 64  # 16-bit columns of one 128-byte swizzle atom row


class HopperAttentionForward(Sm90Producer, Sm90MainLoop, Sm90TileChain, Sm90SplitTail, Sm90Epilogue):
    """One compiled forward kernel: ``config`` holds its compile-time constants (the planner's
    Sm90FwdConfig); score_mod and mask_mod are the variant's hooks from the emitted module."""

    def __init__(
        self, config: Sm90FwdConfig, score_mod: Optional[Callable] = None, mask_mod: Optional[Callable] = None
    ):
        problem = config_problem(config)
        assert not problem, problem
        assert (mask_mod is not None) == config.expression_mask, "an expression mask comes with its mask_mod"
        self.cfg = config
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self.dqk, self.dv = config.head_dim_padded, config.head_dim_v_padded  # padded extents, as loaded
        self.tile_m, self.tile_n, self.kv_stages = config.tile_m, config.tile_n, config.kv_stages
        self.q_stages = config.q_stages  # Q buffers, each of tile_m rows (one 64-row stage per consumer)
        self.num_consumers = config.num_consumer_warpgroups
        # a full and an empty barrier per warpgroup's 64 Q rows (q_slot), else one pair per buffer
        self.q_slots = config.q_stages * (self.num_consumers if config.q_per_warpgroup else 1)
        # an expression mask comes with a block mask (built on the GPU by fa4gen.blockmask):
        # per query tile, the list of non-empty key tiles and whether each is full
        self.block_sparse = config.expression_mask
        # with 3 warpgroups a warpgroup's rows often see fewer key tiles than the CTA's 192 rows
        # (diagonal, rows past Sq): it passes those by (its per-tile count costs registers that
        # 2-warpgroup kernels at d256 do not have, and there it would rarely skip anything)
        self.skips_masked_tiles = self.num_consumers > 2 and not config.expression_mask
        self.key_tiles = KeyTileRange(
            self.tile_m,
            self.tile_n,
            config.window_left,
            config.window_right,
            config.chunk,
            config.prefix_lm,
            config.document,
            first_keys_masked=config.stale_max,
        )
        # which run-time flags say a key tile crosses a bound (see Sm90MainLoop.needs_mask)
        self.has_left_mask = config.window_left is not None or config.chunk is not None or config.document
        self.has_right_mask = config.window_right is not None or config.prefix_lm or config.document
        # pairs of causal query tiles keep equal work only while a left window cuts no row
        window = config.window_left
        self.scheduler = TileScheduler(
            config.tile_order,
            ranked=config.document,
            pair_limit=None if window is None else window + 1,
            tail_rounds=config.pair_tail_rounds,
            tail_min_tiles=config.pair_tail_min_tiles,
            split_tail=config.split_tail,
            split_min_keys=config.split_tail_min_key_tiles,
        )
        self.softmax = OnlineSoftmax(config.scale_log2, num_rows=2, rescale_threshold=config.rescale_threshold)
        self.threads = WARPGROUP_THREADS * (1 + self.num_consumers)
        # where O is staged (planner: O_STAGING says what each costs)
        self.o_over_q, self.o_over_p = config.o_staging == "over_q", config.o_staging == "over_p"
        self.o_shared, self.o_over_v = config.o_staging == "shared", config.o_staging == "over_v"
        self.chain = config.chain_query_tiles  # a query tile's last P.V with the next one's first Q.K^T

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Sq, Hq, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D)
        mV: cute.Tensor,  # (B, Sk, Hkv, Dv)
        mO: cute.Tensor,  # (B, Sq, Hq, Dv)
        mLSE: Optional[cute.Tensor],  # (B, Hq, Sq) fp32, or None
        mWork: Optional[cute.Tensor],  # split tail: (num_ctas, W, partial words, 128) fp32, or None
        mFlags: Optional[cute.Tensor],  # split tail: (num_ctas, W) int32, zero between launches, or None
        num_ctas: Int32,  # CTAs of a persistent launch (the device's SM count)
        extras: tuple,  # the variant's run-time tensors and scalars, named by extra_names
        stream: cuda.CUstream,
    ):
        dtype = mQ.element_type
        self.dtype = dtype
        sQ_layout, sK_layout, sV_layout, sO_layout, sP_layout = self._smem_layouts(dtype)
        q, k, tmas = self._tma_atoms(mQ, mK, mV, mO, (sQ_layout, sK_layout, sV_layout, sO_layout))
        o_elems, p_elems = self._stage_sizes(dtype, sQ_layout, sK_layout, sV_layout, sO_layout, sP_layout)

        @cute.struct
        class SharedStorage:
            bar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_slots]
            bar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            bar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            tiles: cute.struct.MemRange[Int32, len(self.tile_fields) * self.q_slots]  # see publish_tile
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], SMEM_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sV_layout)], SMEM_ALIGN]
            sO: cute.struct.Align[cute.struct.MemRange[dtype, o_elems], SMEM_ALIGN]
            sP: cute.struct.Align[cute.struct.MemRange[dtype, p_elems], SMEM_ALIGN]

        self.shared_storage = SharedStorage
        # the barriers and tile words sit before the 1 KB-aligned Q buffer, in the planner's
        # SMEM_RESERVE_BYTES: more of them would push every buffer up by 1 KB
        header = 8 * 2 * (self.q_slots + 2 * self.kv_stages) + 4 * len(self.tile_fields) * self.q_slots
        assert header <= SMEM_ALIGN, f"{header} bytes of barriers and tile words do not fit before Q"
        pairs = self.scheduler.pairs_now(k.shape[0])
        grid_x = self.scheduler.work_units(cute.ceil_div(q.shape[0], self.tile_m), q.shape[2] * q.shape[3], pairs)
        grid_x = cutlass.min(grid_x, num_ctas)
        self._check_split_workspace(mWork, mFlags)
        lse = None
        if cutlass.const_expr(mLSE is not None):
            lse = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))  # (Sq, H, B)
        self.kernel(
            *tmas,
            lse,
            mWork,
            mFlags,
            sQ_layout,
            sK_layout,
            sV_layout,
            sO_layout,
            sP_layout,
            extras,
            q if self.cfg.stale_max else None,
            k if self.cfg.stale_max else None,
        ).launch(
            grid=(grid_x, 1, 1),
            block=[self.threads, 1, 1],
            smem=self.shared_storage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    def _tma_atoms(self, mQ, mK, mV, mO, layouts) -> tuple:
        """(q, k, the (atom, tensor) pairs of Q's, K's and V's loads and O's store, flattened):
        q, k and o as (S, D, H, B) views, head dim contiguous; V as the B operand of P.V,
        (Dv, S, H, B) with Dv contiguous (MN-major)."""
        sQ_layout, sK_layout, sV_layout, sO_layout = layouts
        q, k, o = (cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])) for t in (mQ, mK, mO))
        vt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))
        stage = (None, None, 0)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q = cpasync.make_tiled_tma_atom(g2s, q, cute.slice_(sQ_layout, stage), (WGMMA_M, self.dqk))
        tma_k = cpasync.make_tiled_tma_atom(g2s, k, cute.slice_(sK_layout, stage), (self.tile_n, self.dqk))
        tma_v = cpasync.make_tiled_tma_atom(g2s, vt, cute.slice_(sV_layout, stage), (self.dv, self.tile_n))
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        tma_o = cpasync.make_tiled_tma_atom(s2g, o, cute.slice_(sO_layout, stage), (WGMMA_M, self.dv))
        return q, k, (*tma_q, *tma_k, *tma_v, *tma_o)

    def _check_split_workspace(self, mWork, mFlags) -> None:
        """A split tail's workspace has the shape planner.split_workspace_shape gives (traced once)."""
        if self.cfg.split_tail:
            assert mWork is not None and mFlags is not None, "a split tail needs its workspace"
            shape = (mWork.shape[1], mWork.shape[2], mWork.shape[3])
            assert shape == (self.num_consumers, split_partial_words(self.dv), WARPGROUP_THREADS), shape

    def _smem_layouts(self, dtype):
        """(sQ, sK, sV, sO, sP) shared-memory layouts: Q and O one 64-row stage per consumer
        warpgroup, so each touches only its own rows (Q buffer b holds stages b*W .. b*W+W-1);
        K and V one stage per ring slot (V as the B operand of P.V, MN-major); P as the A
        operand of P.V, (64 rows, tile_n keys) per consumer warpgroup."""
        W = self.num_consumers
        sQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (WGMMA_M, self.tile_n, self.dqk), dtype, W * self.q_stages
        )
        sO_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (WGMMA_M, self.tile_n, self.dv), dtype, W)
        sP_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (WGMMA_M, self.dv, self.tile_n), dtype, W)
        sK_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (WGMMA_M, self.tile_n, self.dqk), dtype, self.kv_stages
        )
        sV_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.COL_MAJOR, (WGMMA_M, self.dv, self.tile_n), dtype, self.kv_stages
        )
        return sQ_layout, sK_layout, sV_layout, sO_layout, sP_layout

    def _stage_sizes(self, dtype, sQ_layout, sK_layout, sV_layout, sO_layout, sP_layout) -> tuple[int, int]:
        """Record the stage sizes the kernel's TMA and pointer arithmetic use; return the
        elements of the O staging and P buffers (0 where O is staged elsewhere, P in registers)."""
        stage = (None, None, 0)
        self.q_stage_elems = cute.cosize(cute.slice_(sQ_layout, stage))
        self.p_stage_elems = cute.cosize(cute.slice_(sP_layout, stage))
        self.q_bytes = self.num_consumers * cute.size_in_bytes(dtype, cute.slice_(sQ_layout, stage))
        self.k_bytes = cute.size_in_bytes(dtype, cute.slice_(sK_layout, stage))
        self.v_stage_elems = cute.cosize(cute.slice_(sV_layout, stage))
        self.v_bytes = cute.size_in_bytes(dtype, cute.slice_(sV_layout, stage))
        o_elems = 0 if self.o_over_q or self.o_over_p else cute.cosize(sO_layout)
        if self.o_shared or self.o_over_v:
            o_elems = cute.cosize(cute.slice_(sO_layout, stage))  # one 64-row tile (taken in turn where shared)
        p_elems = 0 if self.cfg.p_in_registers else cute.cosize(sP_layout)
        # over_v: elements from the O buffer back to the V ring and to warpgroup 1's Q rows (the
        # buffers follow one another in SharedStorage, each 1 KB-aligned)
        atom = SMEM_ALIGN * 8 // dtype.width
        q_elems, k_elems, v_elems = (
            cute.round_up(cute.cosize(layout), atom) for layout in (sQ_layout, sK_layout, sV_layout)
        )
        self.o_to_v, self.o_to_q = -v_elems, -(q_elems + k_elems + v_elems) + self.q_stage_elems
        self.smem_atom_elems = atom
        return o_elems, p_elems

    def _make_qk_mma(self, accumulate: Optional[bool] = None) -> cute.TiledMma:
        mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), (WGMMA_M, self.tile_n)
        )
        if accumulate is not None:
            mma.set(warpgroup.Field.ACCUMULATE, accumulate)
        return mma

    def _make_pv_mma(self, accumulate: Optional[bool] = None) -> cute.TiledMma:
        mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            OperandMajorMode.K,
            OperandMajorMode.MN,
            Float32,
            (1, 1, 1),
            (WGMMA_M, self.dv),
            warpgroup.OperandSource.RMEM if self.cfg.p_in_registers else warpgroup.OperandSource.SMEM,
        )
        if accumulate is not None:
            mma.set(warpgroup.Field.ACCUMULATE, accumulate)
        return mma

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_q,
        mQ,
        tma_k,
        mK,
        tma_v,
        mVt,
        tma_o,
        mO,
        mLSE: Optional[cute.Tensor],
        mWork: Optional[cute.Tensor],
        mFlags: Optional[cute.Tensor],
        sQ_layout,
        sK_layout,
        sV_layout,
        sO_layout,
        sP_layout,
        extras: tuple,
        gQ: Optional[cute.Tensor],
        gK: Optional[cute.Tensor],
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        storage = SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sTiles = storage.tiles.get_tensor(cute.make_layout((len(self.tile_fields), self.q_slots)))
        q_users = 1 if self.cfg.q_per_warpgroup else self.num_consumers  # warpgroups per Q slot
        pipes = (
            tma_pipeline(storage.bar_q.data_ptr(), self.q_slots, self.q_bytes * q_users // self.num_consumers, q_users),
            tma_pipeline(storage.bar_k.data_ptr(), self.kv_stages, self.k_bytes, self.num_consumers),
            tma_pipeline(storage.bar_v.data_ptr(), self.kv_stages, self.v_bytes, self.num_consumers),
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        sizes = self.launch_sizes(mQ, mK, gQ, gK, mWork, mFlags, extras)
        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp_idx == 0:
                self.produce(tma_q, mQ, tma_k, mK, tma_v, mVt, sQ, sK, sV, sTiles, pipes, sizes)
        else:
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            wg = warpgroup_idx - 1
            sO, sP = self.warpgroup_buffers(storage, sQ, sO_layout, sP_layout, wg)
            self.consume(sQ, sK, sV, sO, sP, sTiles, pipes, tma_o, mO, mLSE, wg, tidx % WARPGROUP_THREADS, sizes)

    @cute.jit
    def launch_sizes(self, mQ, mK, gQ, gK, mWork, mFlags, extras) -> LaunchSizes:
        """The launch's sizes, the same for every tile (mQ, mK: (S, D, H, B) views)."""
        seqlen_q, seqlen_k, num_heads, num_batches = mQ.shape[0], mK.shape[0], mQ.shape[2], mQ.shape[3]
        num_m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        heads_batches = num_heads * num_batches
        # key tiles per query tile (every tile visits them all where a split tail is allowed);
        # at least 1, so a launch without keys runs whole tiles of one empty key tile
        n_keys = cutlass.max(cute.ceil_div(seqlen_k, self.tile_n), 1)
        grid = cute.arch.grid_dim()[0]
        split_run = None
        if cutlass.const_expr(self.cfg.split_tail):  # this CTA's run of the split tail (scheduled)
            split_run = self.scheduler.split_run(cute.arch.block_idx()[0], num_m_blocks, heads_batches, grid, n_keys)
        return LaunchSizes(
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            num_heads=num_heads,
            num_batches=num_batches,
            num_m_blocks=num_m_blocks,
            heads_batches=heads_batches,
            n_keys=n_keys,
            grid=grid,
            pairs=self.scheduler.pairs_now(seqlen_k),
            args=VariantArgs(self.cfg.extra_names, extras),
            gq=gQ,
            gk=gK,
            split_run=split_run,
            split_work=mWork,
            split_flags=mFlags,
        )

    @cute.jit
    def warpgroup_buffers(self, storage, sQ, sO_layout, sP_layout, wg: Int32):
        """This consumer warpgroup's O staging tile (its own, over its P tile or Q rows, or the
        one all take in turn) and P tile (None when P stays in registers)."""
        sO_stage = cute.slice_(sO_layout, (None, None, 0))
        sP = None
        if cutlass.const_expr(not self.cfg.p_in_registers):
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)[None, None, wg]
        # O's base and the elements between warpgroups' tiles (0: one tile all take in turn)
        if cutlass.const_expr(self.o_over_q):
            base, stride = sQ.iterator, self.q_stage_elems
        elif cutlass.const_expr(self.o_over_p):
            base, stride = storage.sP.data_ptr(), self.p_stage_elems
        else:
            base, stride = storage.sO.data_ptr(), 0 if self.o_shared or self.o_over_v else cute.cosize(sO_stage)
        if cutlass.const_expr(stride > 0):  # whole swizzle atoms: stmatrix keeps its 16-byte alignment
            base = base + cute.assume(wg * stride, divby=SMEM_ALIGN // 2)
        sO = cute.make_tensor(cute.recast_ptr(base, sO_stage.inner, self.dtype), sO_stage.outer)
        return sO, sP

    @cute.jit
    def scheduled(self, item: Int32, sizes):
        """(tile, valid, first, end) of this CTA's item ``item``: the tile id, whether it names
        a tile, and the visited key tiles first .. end-1 it runs (all of them but in a split tail)."""
        cta = cute.arch.block_idx()[0]
        tile = self.scheduler.tile_of(item, cta, sizes.num_m_blocks, sizes.heads_batches, sizes.grid, sizes.pairs)
        ok = self.scheduler.valid(tile, sizes.num_m_blocks, sizes.heads_batches, sizes.grid, sizes.pairs)
        first, end = Int32(0), sizes.n_keys
        if cutlass.const_expr(self.cfg.split_tail):
            tile, ok, first, end = self.scheduler.split_segment(item, sizes.split_run, sizes.n_keys, tile, ok)
        return tile, ok, first, end

    @cute.jit
    def decode(self, tile: Int32, sizes):
        """(m_block, head, batch, rank) of tile ``tile`` (``scheduler.decode`` with this launch's sizes)."""
        ranking = sizes.args.doc_tiles if cutlass.const_expr(self.scheduler.ranked) else None
        return self.scheduler.decode(
            tile, sizes.num_m_blocks, sizes.num_heads, sizes.num_batches, sizes.grid, sizes.pairs, ranking
        )

    @cute.jit
    def tile_info(self, tile: Int32, sizes, first=None, end=None):
        """Tile ``tile`` of the schedule: where it is and which key tiles it visits (the producer
        computes it; the consumers receive it, see ``publish_tile``); a split tail's segment
        visits only the tile's key tiles first .. end-1 (``scheduled``; without a split tail
        they are not used)."""
        ranking = sizes.args.doc_tiles if cutlass.const_expr(self.scheduler.ranked) else None
        m_block, head, batch, rank = self.decode(tile, sizes)
        if cutlass.const_expr(self.scheduler.ranked):
            # the ranking's row also holds the key ranges of the tile's first and last rows: one
            # level of loads, where the rank, then the rows' ranges would be two
            n_min, split_lo, split_hi, n_max = self.key_tiles.bounds_of_rows(
                ranking[rank, 1], ranking[rank, 2], ranking[rank, 3], ranking[rank, 4], sizes.seqlen_k
            )
            # and its document's bounds, for the consumers' row ranges (masking.row_ranges)
            doc_single, doc_shift = ranking[rank, 5], ranking[rank, 6]
            doc_key_start, doc_key_end = ranking[rank, 7], ranking[rank, 8]
        else:
            n_min, split_lo, split_hi, n_max = self.key_tiles.bounds(
                m_block, batch, sizes.seqlen_q, sizes.seqlen_k, sizes.args
            )
        n_count = cutlass.max(n_max - n_min, 0)
        split = Int32(0)
        if cutlass.const_expr(self.cfg.split_tail):
            split = self.split_role(first, end, sizes.n_keys)
            if split != 0:  # a segment of the tile (no mask bounds here: n_min = 0 and n_max = n_keys)
                n_min = n_max - end
                n_max = n_max - first
                n_count = end - first
        extra = {}
        if cutlass.const_expr(self.scheduler.ranked):
            extra = dict(
                doc_single=doc_single, doc_shift=doc_shift, doc_key_start=doc_key_start, doc_key_end=doc_key_end
            )
        if cutlass.const_expr(self.block_sparse):
            # the block mask lists this tile's non-empty key tiles (its tables may be shared
            # across batch entries and heads: a size-1 mode broadcasts)
            mask_b = batch % sizes.args.block_count.shape[0]
            mask_h = head % sizes.args.block_count.shape[1]
            n_count = sizes.args.block_count[mask_b, mask_h, m_block]
            extra = dict(mask_b=mask_b, mask_h=mask_h)
        return TileInfo(
            m_block=m_block,
            head=head,
            batch=batch,
            n_min=n_min,
            split_lo=split_lo,
            split_hi=split_hi,
            n_max=n_max,
            n_count=n_count,
            split=split,
            **extra,
        )

    @property
    def tile_fields(self) -> tuple:
        """The TileInfo fields the producer hands the consumers per tile (``publish_tile``)."""
        fields = ("m_block", "head", "batch", "n_min", "split_lo", "split_hi", "n_max", "n_count")
        if self.cfg.split_tail:
            fields += ("split",)
        if self.block_sparse:
            fields += ("mask_b", "mask_h")
        if self.scheduler.ranked:
            fields += self.document_fields
        return fields

    document_fields = ("doc_single", "doc_shift", "doc_key_start", "doc_key_end")

    @cute.jit
    def make_o_and_p(self, thr_pv):
        """This warpgroup's O accumulator (zero) and, where P stays in registers, P's A-operand
        fragment (None where P goes through shared memory)."""
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((WGMMA_M, self.dv)))
        acc_o.fill(0.0)
        p = None
        if cutlass.const_expr(self.cfg.p_in_registers):
            p = cute.make_rmem_tensor(thr_pv.partition_shape_A((WGMMA_M, self.tile_n)), self.dtype)
        return acc_o, p

    @cute.jit
    def make_loop_state(self, sQ, sK, sV, sP, pipes, wg: Int32, wtidx: Int32, sizes, held=None) -> MainLoopState:
        """Fragments and MMAs of one consumer warpgroup (built inside the tile loop: a Python
        holder cannot be carried by a staged loop, and the partitions cost nothing at run time;
        ``held``: chained query tiles keep O and P across tiles, in tensors made before it)."""
        _, pipe_k, pipe_v = pipes
        qk_mma, pv_mma = self._make_qk_mma(), self._make_pv_mma()
        thr_qk, thr_pv = qk_mma.get_slice(wtidx), pv_mma.get_slice(wtidx)
        row_max, row_sum = self.softmax.make_state()
        if cutlass.const_expr(held is not None):
            acc_o, p = held.acc_o, held.p  # O: zero, or the held tile's until the next tile's first step
        else:
            acc_o, p = self.make_o_and_p(thr_pv)
        p_store = None  # P through smem: (16-bit P in the S layout, stmatrix copy, its smem targets)
        if cutlass.const_expr(not self.cfg.p_in_registers):
            p = thr_pv.make_fragment_A(thr_pv.partition_A(sP))
            stmatrix = cute.make_tiled_copy_C(
                sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32), qk_mma
            )
            thr_store = stmatrix.get_slice(wtidx)
            p_low = cute.make_rmem_tensor(thr_qk.partition_shape_C((WGMMA_M, self.tile_n)), self.dtype)
            p_store = (p_low, stmatrix, thr_store.retile(p_low), thr_store.partition_D(sP))
        # ACCUMULATE is fixed per MMA object, never set inside a loop (that would leak a
        # loop-local value): one object zero-fills S, the other accumulates.
        return MainLoopState(
            qk_first=self._make_qk_mma(False),
            qk_rest=self._make_qk_mma(True),
            pv=self._make_pv_mma(True),
            thr_pv=thr_pv,
            tSrQ=thr_qk.make_fragment_A(thr_qk.partition_A(sQ)),
            tSrK=thr_qk.make_fragment_B(thr_qk.partition_B(sK)),
            tOrV=thr_pv.make_fragment_B(thr_pv.partition_B(sV)),
            coords_s=thr_qk.partition_C(cute.make_identity_tensor((WGMMA_M, self.tile_n))),
            p=p,
            p_store=p_store,
            acc_o=acc_o,
            row_max=row_max,
            row_sum=row_sum,
            pipe_k=pipe_k,
            pipe_v=pipe_v,
            seqlen_q=sizes.seqlen_q,
            seqlen_k=sizes.seqlen_k,
            gq=sizes.gq,
            gk=sizes.gk,
            warpgroup=wg,
            wtidx=wtidx,
            args=sizes.args,
            held=held,
            split_work=sizes.split_work,
            split_flags=sizes.split_flags,
        )

    @cute.jit
    def consume(self, sQ, sK, sV, sO, sP, sTiles, pipes, tma_o, mO, mLSE, wg: Int32, wtidx: Int32, sizes):
        """One consumer warpgroup: every tile of this CTA, main loop then epilogue."""
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        if cutlass.const_expr(self.cfg.pingpong):
            if wg == self.num_consumers - 1:
                self.pass_turn(wg)  # the last warpgroup lets the first one start
        if cutlass.const_expr(self.o_shared):
            if wg == self.num_consumers - 1:  # the first warpgroup stages the first O
                self.pass_o_turn(wg, cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4 == 0)
        held = None  # chained query tiles: O, P and the held tile's state, kept across tiles
        if cutlass.const_expr(self.chain):
            held = self.make_held(self._make_pv_mma().get_slice(wtidx), sO, tma_o, mO, mLSE)
        items = self.scheduler.items_per_cta(
            sizes.num_m_blocks, sizes.heads_batches, sizes.grid, sizes.pairs, sizes.n_keys
        )
        for item in cutlass.range(items, unroll=1):
            _, ok, _, _ = self.scheduled(item, sizes)
            if ok:
                q_state, k_state, v_state = self.consume_tile(
                    sQ,
                    sK,
                    sV,
                    sO,
                    sP,
                    sTiles,
                    pipes,
                    tma_o,
                    mO,
                    mLSE,
                    wg,
                    wtidx,
                    sizes,
                    q_state,
                    k_state,
                    v_state,
                    held,
                )
        if cutlass.const_expr(self.chain):
            if held.pending[0] != 0:  # the CTA's last tile ends alone
                loop = self.make_loop_state(sQ[None, None, wg], sK, sV, sP, pipes, wg, wtidx, sizes, held)
                v_state = self.flush_held(loop, v_state)
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4 == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # the last O store reads shared memory

    @cute.jit
    def consume_tile(
        self,
        sQ,
        sK,
        sV,
        sO,
        sP,
        sTiles,
        pipes,
        tma_o,
        mO,
        mLSE,
        wg: Int32,
        wtidx: Int32,
        sizes,
        q_state,
        k_state,
        v_state,
        held,
    ):
        """One query tile: main loop, then the epilogue (chained: the epilogue of the tile held
        before it runs within its first step, and its own waits for the next tile's)."""
        pipe_q = pipes[0]
        loop = self.make_loop_state(
            self.q_rows(sQ, q_state.index * self.num_consumers + wg), sK, sV, sP, pipes, wg, wtidx, sizes, held
        )
        q_slot = self.q_slot(q_state, wg)
        pipe_q.consumer_wait(q_slot)  # this tile's Q, and its info from the producer
        received = self.received_tile(sTiles, q_slot.index)
        t = dataclasses.replace(received, row_base=received.m_block * self.tile_m + wg * WGMMA_M)
        document = None
        if cutlass.const_expr(self.scheduler.ranked):  # the tile's document bounds (tile_info)
            document = tuple(getattr(t, name) for name in self.document_fields)
        row_start, row_end = self.key_tiles.row_ranges(
            rows_cols_view(loop.coords_s), t.row_base, t.batch, sizes.seqlen_q, sizes.seqlen_k, sizes.args, document
        )
        # (Q is released in the main loop: releases_q_early)
        loop = dataclasses.replace(
            loop, pipe_q=pipe_q, q_state=q_slot, row_start=row_start, row_end=row_end, batch=t.batch, head=t.head
        )
        # the highest key tiles may be masked for every row of this warpgroup (the diagonal of a
        # 192-row tile, rows past Sq): the main loop passes them by without MMAs
        if cutlass.const_expr(self.skips_masked_tiles):
            end = self.key_tiles.rows_tile_end(t.row_base, t.batch, sizes.seqlen_q, sizes.seqlen_k, sizes.args)
            t = dataclasses.replace(t, skip=cutlass.min(cutlass.max(t.n_max - end, 0), t.n_count))
        if cutlass.const_expr(self.chain):
            if t.n_count == 0 and held.pending[0] != 0:  # no first Q.K^T to go with: the held tile ends alone
                v_state = self.flush_held(loop, v_state)
        if t.n_count > 0:
            k_state, v_state = self.mainloop(loop, t, k_state, v_state)
        tile_sO, held = sO, None
        if cutlass.const_expr(self.o_over_v):
            tile_sO, held, v_read_barrier = self.o_tile_over_v(loop, sO, wg, t, q_state, v_state)
            loop = dataclasses.replace(loop, v_read_barrier=v_read_barrier)
        if cutlass.const_expr(self.releases_q_early()):
            if self.sees_no_key_tile(t):  # (else the main loop released Q before its last P.V)
                if cutlass.const_expr(self.o_over_v):
                    if wg == 0:  # (warpgroup 1 stages O over its Q rows: released after the store)
                        pipe_q.consumer_release(q_slot)
                else:
                    pipe_q.consumer_release(q_slot)
        elif cutlass.const_expr(not self.o_over_q):
            pipe_q.consumer_release(q_slot)
        if cutlass.const_expr(self.chain):
            if t.n_count > 0:
                self.hold_tile(loop, t)
            else:
                self.epilogue(loop, sO, tma_o, mO, mLSE, t, wg, sizes.seqlen_q)
        else:
            self.epilogue(loop, tile_sO, tma_o, mO, mLSE, t, wg, sizes.seqlen_q)
        if cutlass.const_expr(self.o_over_q):
            pipe_q.consumer_release(q_slot)
        if cutlass.const_expr(self.o_over_v):
            if wg == 1:
                self.release_o_tile(pipes, q_slot, wg, held)
        q_state.advance()
        return q_state, k_state, v_state

    @cute.jit
    def q_rows(self, sQ, slot: Int32):
        """Q stage ``slot`` (a warpgroup's 64 rows of one Q buffer) as the Q.K^T A operand.

        Where d fits one 128-byte swizzle atom (d <= 64), the view carries the slot's offset as
        whole 1 KB atoms, so ptxas steps the wgmma descriptors through the k-blocks by OR-ing
        their offsets into the low word; a plain slice (unknown alignment) costs a 64-bit add
        with carry per k-block inside the MMA issue. At larger d the k-blocks past the first atom
        still carry (their offset crosses the known alignment), so they keep the plain slice
        (decision mma-issue)."""
        if cutlass.const_expr(self.dqk <= Q_ATOM_COLS):
            offset = cute.assume(slot * self.q_stage_elems, divby=SMEM_ALIGN // 2)
            return cute.make_tensor(sQ.iterator + offset, sQ[None, None, 0].layout)
        return sQ[None, None, slot]

    @cute.jit
    def held_tile_info(self, held, wg: Int32):
        """The position of the tile a chained warpgroup holds (chain.hold_tile)."""
        split = None
        if cutlass.const_expr(self.cfg.split_tail):
            split = held.where[3]
        return TileInfo(
            m_block=held.where[0],
            head=held.where[1],
            batch=held.where[2],
            split=split,
            row_base=held.where[0] * self.tile_m + wg * WGMMA_M,
        )
