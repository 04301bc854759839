"""Hopper (sm_90a) decode: short queries over a KV cache, a group's query heads packed into one tile.

A CTA takes one (query tile, key split, KV head, batch entry). Its rows are packed query rows of
the KV head's group: packed row r is query index r // G of query head kv_head * G + r % G
(G = qhead_per_kvhead), so the G query heads share every K/V tile the CTA loads, where one CTA
per query head would read the group's K/V G times. Warpgroup 0's first warp loads K and V by TMA
into a ring; each consumer warpgroup (one, or two where the planner gives the tile 128 rows: a
long group's rows then share each K/V tile too) owns 64 rows and loads their Q itself (the
addresses follow the packing, not one TMA box), then per key tile: S = Q.K^T (wgmma), score
modifier, mask, online softmax, O += P.V with P from registers. Q.K^T takes Q from registers up
to d128 (``q_in_registers``), so a step reads only K and V from shared memory, whose bandwidth
bounds a long group's steps and chunked prefill. S(n) = Q.K^T is issued with O += P(n-1).V(n-1),
in the forward's order; ptxas places the P.V wait above the row max, so within a warpgroup the
softmax still follows the P.V (decision decode-q-registers).

Each batch entry's keys end at its own cache length (``seqused_k``, at most the cache's Sk):
masks and score modifiers see that length as Sk, and query row i sits at key position
i + length - Sq. The visible key tiles of a query tile are split evenly over ``num_splits`` CTAs
(a run-time value, fa4gen.kernels.sm90.decode_splits). With one split the CTA
writes O and the LSE; with more, each writes its normalised partial O (fp32) and LSE and counts
itself into its query tile's counter, and the last of them to count in merges the tile's
partials by their LSE, adding the sink there, and lowers the counter again for the next launch
(``arrives_last``, ``combine_tile``): no second launch, and no CTA waits for another.

A paged kernel (config.paged) reads K and V from a pool of pages (pages, page size, Hkv, D)
through a page table (B, max pages): each key tile arrives as boxes of PAGE_BOX keys, each box
from its own page (a page size a multiple of PAGE_BOX never splits a box), one TMA copy per box
into its rows of the stage; the producer warp's lanes read the next tile's table entries while
the current tile's boxes issue, and clamp every entry into the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

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
from fa4gen.kernels.common.layout import rows_cols_view, store_as_operand_a
from fa4gen.kernels.common.masking import KeyTileRange
from fa4gen.kernels.common.softmax import OnlineSoftmax
from fa4gen.kernels.common.variant import VariantArgs
from fa4gen.kernels.sm90.config import NamedBarrier
from fa4gen.kernels.sm90.decode_config import PAGE_BOX, Sm90DecodeConfig, decode_config_problem
from fa4gen.kernels.sm90.decode_merge import DecodeSplitMerge
from fa4gen.kernels.sm90.producer import tma_pipeline
from fa4gen.kernels.sm90.wgmma import issue_k_blocks

SMEM_ALIGN = 1024
VECTOR = 8  # 16-bit elements per 16 bytes (Q loads, V clears)


def pack_query_heads(t: cute.Tensor, group: int, seq: int, head: int, order: tuple) -> cute.Tensor:
    """``t`` with its query-sequence mode ``seq`` and query-head mode ``head`` packed into one
    leading mode (G, S): packed row g + G * s of KV head h is query s of query head h * G + g.
    The other modes follow in ``order`` (original mode numbers), ``head`` standing for the KV
    heads: (B, S, Hq, D) with seq 1, head 2 and order (3, 2, 0) is ((G, S), D, Hkv, B)."""
    shape, stride = t.layout.shape, t.layout.stride
    kv = {head: (shape[head] // group, stride[head] * group)}
    rest = [kv.get(m, (shape[m], stride[m])) for m in order]
    layout = cute.make_layout(
        ((group, shape[seq]), *(size for size, _ in rest)),
        stride=((stride[head], stride[seq]), *(step for _, step in rest)),
    )
    return cute.make_tensor(t.iterator, layout)


@dataclass(frozen=True)
class DecodeStep:
    """A consumer warpgroup's MMAs and fragments for its key tiles (made once, before the loop)."""

    qk_mma: Any  # S = Q.K^T, its first K block (accumulate off) and the rest
    qk_acc: Any
    thr_qk: Any  # this thread's slice of qk_mma
    s_shape: tuple  # (rows, keys) of S
    pv_mma: Any  # O += P.V, P from registers
    tSrQ: Any
    tSrK: Any
    tOrV: Any
    p: Any  # the previous key tile's P, the A operand of the P.V in flight
    acc_o: Any
    coords: Any  # (row, column) of each S element of this thread
    wtidx: Any
    wg: Any

    def fresh_scores(self):
        """An fp32 S fragment for the next key tile."""
        return self.thr_qk.make_fragment_C(self.thr_qk.partition_shape_C(self.s_shape))


class HopperAttentionDecode(DecodeSplitMerge):
    """One compiled decode kernel (and its split combine): ``config`` is the planner's
    Sm90DecodeConfig; score_mod and mask_mod the variant's hooks from the emitted module."""

    def __init__(
        self, config: Sm90DecodeConfig, score_mod: Optional[Callable] = None, mask_mod: Optional[Callable] = None
    ):
        problem = decode_config_problem(config)
        assert not problem, problem
        assert (mask_mod is not None) == config.expression_mask, "an expression mask comes with its mask_mod"
        self.cfg = config
        self.warpgroups, self.tile_m = config.consumer_warpgroups, config.tile_m
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self.dqk, self.dv = config.head_dim_padded, config.head_dim_v_padded
        self.tile_n, self.kv_stages = config.tile_n, config.kv_stages
        self.group = config.qhead_per_kvhead
        # row ranges by query index (not packed row): the tile height only matters to bounds()
        self.key_tiles = KeyTileRange(WGMMA_M, self.tile_n, config.window_left, config.window_right, config.chunk)
        self.has_left_mask = config.window_left is not None or config.chunk is not None
        self.softmax = OnlineSoftmax(config.scale_log2, num_rows=2, rescale_threshold=config.rescale_threshold)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Sq, Hq, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D): the cache, Sk its capacity
        mV: cute.Tensor,  # (B, Sk, Hkv, Dv)
        mO: cute.Tensor,  # (B, Sq, Hq, Dv)
        mLSE: Optional[cute.Tensor],  # (B, Hq, Sq) fp32, or None
        mOPart: cute.Tensor,  # (splits, B, Sq, Hq, Dv) fp32: the partial outputs (read with 2+ splits)
        mLSEPart: cute.Tensor,  # (splits, B, Hq, Sq) fp32: their LSE
        mSeqUsedK: cute.Tensor,  # (B,) int32: each batch entry's cache length
        mPageTable: Optional[cute.Tensor],  # (B, max pages) int32 with a paged config, else None
        mCounters: cute.Tensor,  # (B, Hkv, query tiles) int32, zero: splits counted in (read with 2+ splits)
        num_splits: Int32,
        extras: tuple,
        stream: cuda.CUstream,
    ):
        self.dtype = mQ.element_type
        G = self.group
        sQ_layout, sK_layout, sV_layout = self._smem_layouts()
        q_elems = VECTOR if self.cfg.q_in_registers else cute.cosize(sQ_layout)  # (a placeholder in registers)
        (tma_k, tma_k_t), (tma_v, tma_v_t) = self._tma_atoms(mK, mV, sK_layout, sV_layout)
        self.k_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0)))
        self.v_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sV_layout, (None, None, 0)))

        @cute.struct
        class SharedStorage:
            bar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            bar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            last: cute.struct.MemRange[Int32, self.warpgroups]  # per consumer: whether it counted in last
            stats: cute.struct.MemRange[Float32, 2 * WGMMA_M * self.warpgroups]  # the merge's row max, 1 / sum
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], SMEM_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], SMEM_ALIGN]

        self.shared_storage = SharedStorage
        # ((G, S), D, Hkv, B) rows; the partials with their split mode last
        q, o = pack_query_heads(mQ, G, 1, 2, (3, 2, 0)), pack_query_heads(mO, G, 1, 2, (3, 2, 0))
        o_part = pack_query_heads(mOPart, G, 2, 3, (4, 3, 1, 0))  # ((G, Sq), Dv, Hkv, B, splits)
        lse_part = pack_query_heads(mLSEPart, G, 3, 2, (2, 1, 0))  # ((G, Sq), Hkv, B, splits)
        lse = None
        if cutlass.const_expr(mLSE is not None):
            lse = pack_query_heads(mLSE, G, 2, 1, (1, 0))  # ((G, Sq), Hkv, B)
        rows = mQ.shape[1] * G
        m_blocks = cute.ceil_div(rows, self.tile_m)
        kv_heads, batch = mK.shape[2], mQ.shape[0]
        self.kernel(
            tma_k,
            tma_k_t,
            tma_v,
            tma_v_t,
            q,
            o,
            lse,
            o_part,
            lse_part,
            mSeqUsedK,
            mPageTable,
            mCounters,
            num_splits,
            mQ.shape[1],
            sQ_layout,
            sK_layout,
            sV_layout,
            extras,
        ).launch(
            grid=(m_blocks * num_splits, kv_heads, batch),
            block=[(1 + self.warpgroups) * WARPGROUP_THREADS, 1, 1],
            smem=self.shared_storage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=self.cfg.ctas_per_sm,
            # all of the SM's memory as shared memory, given here: else the DSL asks the device
            # for it while tracing (artifacts depend on no device)
            preferred_smem_carveout=100,
        )

    def _smem_layouts(self):
        """Q: 64 packed rows per consumer warpgroup (its Q.K^T A operand); K and V one stage per
        ring slot (V as the P.V B operand, MN-major)."""
        q_tile = (WGMMA_M, self.tile_n, self.dqk)
        sQ = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, q_tile, self.dtype, self.warpgroups)
        sK = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (WGMMA_M, self.tile_n, self.dqk), self.dtype, self.kv_stages
        )
        sV = sm90_utils.make_smem_layout_b(
            LayoutEnum.COL_MAJOR, (WGMMA_M, self.dv, self.tile_n), self.dtype, self.kv_stages
        )
        return sQ, sK, sV

    def _tma_atoms(self, mK: cute.Tensor, mV: cute.Tensor, sK_layout, sV_layout):
        """The K and V loads, each (atom, its view of the cache): a stage's tile_n keys per copy
        over (S, D, H, B) and (Dv, S, H, B); paged, PAGE_BOX rows of a stage per copy over (page
        size, D, H, pages) and (Dv, page size, H, pages)."""
        k = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
        vt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))
        k_box, v_box = cute.slice_(sK_layout, (None, None, 0)), cute.slice_(sV_layout, (None, None, 0))
        keys = self.tile_n
        if cutlass.const_expr(self.cfg.paged):
            keys = PAGE_BOX
            k_box = cute.slice_(cute.flat_divide(k_box, (keys, self.dqk)), (None, None, 0, 0))
            v_box = cute.slice_(cute.flat_divide(v_box, (self.dv, keys)), (None, None, 0, 0))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        return (
            cpasync.make_tiled_tma_atom(g2s, k, k_box, (keys, self.dqk)),
            cpasync.make_tiled_tma_atom(g2s, vt, v_box, (self.dv, keys)),
        )

    def _mma(self, n: int, b_major, a_source, accumulate: bool) -> cute.TiledMma:
        mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, b_major, Float32, (1, 1, 1), (WGMMA_M, n), a_source
        )
        mma.set(warpgroup.Field.ACCUMULATE, accumulate)
        return mma

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_k,
        mK,
        tma_v,
        mVt,
        mQ,
        mO,
        mLSE: Optional[cute.Tensor],
        mOPart,
        mLSEPart,
        mSeqUsedK,
        mPageTable: Optional[cute.Tensor],
        mCounters,
        num_splits: Int32,
        seqlen_q: Int32,
        sQ_layout,
        sK_layout,
        sV_layout,
        extras: tuple,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = SmemAllocator().allocate(self.shared_storage)
        sQ = None
        if cutlass.const_expr(not self.cfg.q_in_registers):
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        pipe_k = tma_pipeline(storage.bar_k.data_ptr(), self.kv_stages, self.k_bytes, self.warpgroups)
        pipe_v = tma_pipeline(storage.bar_v.data_ptr(), self.kv_stages, self.v_bytes, self.warpgroups)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        args = VariantArgs(self.cfg.extra_names, extras)
        capacity = mK.shape[0]  # the cache's Sk, or a paged entry's pages x page size
        if cutlass.const_expr(self.cfg.paged):
            capacity = mK.shape[0] * mPageTable.shape[1]
        work = self.work_of(mSeqUsedK, capacity, num_splits, seqlen_q, args)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp_idx == 0:
                if cutlass.const_expr(self.cfg.paged):
                    self.produce_paged(tma_k, mK, tma_v, mVt, sK, sV, pipe_k, pipe_v, mPageTable, work)
                else:
                    self.produce(tma_k, mK, tma_v, mVt, sK, sV, pipe_k, pipe_v, work)
        else:
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            wg = 0
            if cutlass.const_expr(self.warpgroups > 1):
                wg = warp_idx // 4 - 1
            last = storage.last.get_tensor(cute.make_layout(self.warpgroups))
            stats = storage.stats.get_tensor(cute.make_layout((WGMMA_M, 2, self.warpgroups)))
            splits = (mOPart, mLSEPart, mCounters, last, stats, num_splits)
            # from here on the warpgroup's 64 rows are its query tile: m_block counts 64-row tiles
            rows = (work[0] * self.warpgroups + wg, *work[1:])
            sQ_wg = None if cutlass.const_expr(self.cfg.q_in_registers) else sQ[None, None, wg]
            self.consume(mQ, mO, mLSE, sQ_wg, sK, sV, pipe_k, pipe_v, rows, splits, wg, args)

    @cute.jit
    def work_of(self, mSeqUsedK, capacity: Int32, num_splits: Int32, seqlen_q: Int32, args):
        """This CTA's (m_block, split, kv_head, batch, Sq, cache length, first key tile, key
        tiles, split_lo, split_hi) (``key_run``)."""
        bx, kv_head, batch = cute.arch.block_idx()
        m_block, split = bx // num_splits, bx % num_splits
        # a length past the cache's capacity (or below 0) is clamped: no load leaves the cache
        length = cutlass.min(cutlass.max(mSeqUsedK[batch], 0), capacity)
        lo, count, split_lo, split_hi = self.key_run(m_block, split, num_splits, batch, seqlen_q, length, args)
        return (m_block, split, kv_head, batch, seqlen_q, length, lo, count, split_lo, split_hi)

    @cute.jit
    def key_run(
        self, m_block: Int32, split: Int32, num_splits: Int32, batch: Int32, seqlen_q: Int32, length: Int32, args
    ):
        """(first key tile, key tiles, split_lo, split_hi) of split ``split`` of packed query tile
        ``m_block``: the tiles holding a key one of its rows sees (from its first and last rows'
        query indices: masking.bounds_of_rows), cut into num_splits even runs (the last ones
        may be short or empty)."""
        first_row = m_block * self.tile_m
        last_row = cutlass.min(first_row + self.tile_m, seqlen_q * self.group) - 1
        first_start, first_end = self.key_tiles.row_range(first_row // self.group, batch, seqlen_q, length, args)
        last_start, last_end = self.key_tiles.row_range(last_row // self.group, batch, seqlen_q, length, args)
        n_min, split_lo, split_hi, n_max = self.key_tiles.bounds_of_rows(
            first_start, first_end, last_start, last_end, length
        )
        per_split = cute.ceil_div(cutlass.max(n_max - n_min, 0), num_splits)
        lo = n_min + split * per_split
        count = cutlass.max(cutlass.min(lo + per_split, n_max) - lo, 0)
        return lo, count, split_lo, split_hi

    @cute.jit
    def produce(self, tma_k, mK, tma_v, mVt, sK, sV, pipe_k, pipe_v, work):
        """One warp: the CTA's key tiles lo .. lo+count-1, K then V, each into the ring's next stage."""
        _, _, kv_head, batch, _, _, lo, count, _, _ = work
        one = cute.make_layout(1)
        gK = cute.local_tile(mK[None, None, kv_head, batch], (self.tile_n, self.dqk), (None, 0))
        gVt = cute.local_tile(mVt[None, None, kv_head, batch], (self.dv, self.tile_n), (0, None))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gVt, 0, 2))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        for i in cutlass.range(count, unroll=1):
            pipe_k.producer_acquire(state)
            cute.copy(tma_k, tKg[None, lo + i], tKs[None, state.index], tma_bar_ptr=pipe_k.producer_get_barrier(state))
            pipe_v.producer_acquire(state)
            cute.copy(tma_v, tVg[None, lo + i], tVs[None, state.index], tma_bar_ptr=pipe_v.producer_get_barrier(state))
            state.advance()

    @cute.jit
    def produce_paged(self, tma_k, mK, tma_v, mVt, sK, sV, pipe_k, pipe_v, mPageTable, work):
        """``produce`` over a paged cache: key tile n's box c (keys n * tile_n + c * PAGE_BOX on)
        comes from row box (key % page size) / PAGE_BOX of the page the table gives for
        key / page size. Lane c holds box c's page, read one tile ahead."""
        _, _, kv_head, batch, _, _, lo, count, _, _ = work
        one = cute.make_layout(1)
        page_size, num_pages, max_pages = mK.shape[0], mK.shape[3], mPageTable.shape[1]
        # ((box), (row box, 1, page)) and ((box), (1, row box, page)) in global memory; the stages'
        # boxes (box, c, 1, stage) and (box, 1, c, stage)
        gK = cute.zipped_divide(mK[None, None, kv_head, None], (PAGE_BOX, self.dqk))
        gVt = cute.zipped_divide(mVt[None, None, kv_head, None], (self.dv, PAGE_BOX))
        sKb = cute.group_modes(cute.flat_divide(sK, (PAGE_BOX, self.dqk)), 0, 2)
        sVb = cute.group_modes(cute.flat_divide(sV, (self.dv, PAGE_BOX)), 0, 2)
        tKs, tKg = cpasync.tma_partition(tma_k, 0, one, sKb, gK)
        tVs, tVg = cpasync.tma_partition(tma_v, 0, one, sVb, gVt)
        table, lane = mPageTable[batch, None], cute.arch.lane_idx()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        pages = self.page_of(table, lo, lane, page_size, max_pages, num_pages)
        for i in cutlass.range(count, unroll=1):
            current = pages
            # (the next tile's entries: their latency overlaps this tile's waits and copies)
            pages = self.page_of(table, lo + i + 1, lane, page_size, max_pages, num_pages)
            n_block, at = lo + i, state.index
            pipe_k.producer_acquire(state)
            self.copy_boxes(tma_k, tKg, tKs, False, current, n_block, page_size, pipe_k.producer_get_barrier(state), at)
            pipe_v.producer_acquire(state)
            self.copy_boxes(tma_v, tVg, tVs, True, current, n_block, page_size, pipe_v.producer_get_barrier(state), at)
            state.advance()

    @cute.jit
    def copy_boxes(
        self, tma, boxes, stage_boxes, transposed: bool, current, n_block: Int32, page_size: Int32, barrier, stage
    ):
        """Every box of key tile ``n_block`` from its page (lane c of ``current`` holds box c's) into
        its rows of ``stage`` (``transposed``: V's boxes, keys along the second mode): unrolled with
        every box's addresses live at once, or (page_walk_unrolled false) a loop in 24 registers."""
        if cutlass.const_expr(self.cfg.page_walk_unrolled):
            for c in cutlass.range_constexpr(self.tile_n // PAGE_BOX):
                self.copy_box(tma, boxes, stage_boxes, c, transposed, current, n_block, page_size, barrier, stage)
        else:
            for c in cutlass.range(self.tile_n // PAGE_BOX, unroll=1):
                self.copy_box(tma, boxes, stage_boxes, c, transposed, current, n_block, page_size, barrier, stage)

    @cute.jit
    def copy_box(
        self, tma, boxes, stage_boxes, c, transposed: bool, current, n_block: Int32, page_size: Int32, barrier, stage
    ):
        """Box ``c`` of key tile ``n_block`` from its page into its rows of ``stage``."""
        page, row = cute.arch.shuffle_sync(current, c), self.row_box_of(n_block, c, page_size)
        if cutlass.const_expr(transposed):
            cute.copy(tma, boxes[None, (0, row, page)], stage_boxes[None, 0, c, stage], tma_bar_ptr=barrier)
        else:
            cute.copy(tma, boxes[None, (row, 0, page)], stage_boxes[None, c, 0, stage], tma_bar_ptr=barrier)

    @cute.jit
    def page_of(self, table, n_block: Int32, box: Int32, page_size: Int32, max_pages: Int32, num_pages: Int32):
        """The page of box ``box`` of key tile ``n_block`` (``table``: the entry's row of the page
        table), slot and entry clamped: a tile past an entry's pages, or an entry out of range,
        reads a page of the pool."""
        slot = (n_block * self.tile_n + box * PAGE_BOX) // page_size
        page = table[cutlass.min(slot, max_pages - 1)]
        return cutlass.min(cutlass.max(page, 0), num_pages - 1)

    @cute.jit
    def row_box_of(self, n_block: Int32, box: Int32, page_size: Int32):
        """Which PAGE_BOX rows of its page box ``box`` of key tile ``n_block`` reads."""
        return (n_block * self.tile_n + box * PAGE_BOX) % page_size // PAGE_BOX

    @cute.jit
    def load_q(self, mQ, sQ, m_block: Int32, kv_head: Int32, batch: Int32, seqlen_q: Int32, wtidx: Int32, wg):
        """The warpgroup's 64 packed Q rows into shared memory, 16 bytes per load; rows past the
        group's Sq x G and columns past the head dim are zero. Ordered before the warpgroup's
        MMAs read them (generic-proxy stores, async-proxy reads)."""
        gQ = mQ[None, None, kv_head, batch]  # ((G, Sq), D)
        rows = seqlen_q * self.group
        vectors = self.dqk // VECTOR
        chunk = cute.make_rmem_tensor(cute.make_layout(VECTOR), self.dtype)
        for i in cutlass.range_constexpr(WGMMA_M * vectors // WARPGROUP_THREADS):
            v = wtidx + i * WARPGROUP_THREADS
            row, col = v // vectors, v % vectors * VECTOR
            packed = m_block * WGMMA_M + row
            chunk.fill(0.0)
            if packed < rows and col < self.cfg.head_dim:
                for j in cutlass.range_constexpr(VECTOR):
                    chunk[j] = gQ[packed, col + j]
            for j in cutlass.range_constexpr(VECTOR):
                sQ[row, col + j] = chunk[j]
        self.sync(wg, async_reads=True)

    @cute.jit
    def q_fragment(self, mQ, thr_qk, m_block: Int32, kv_head: Int32, batch: Int32, seqlen_q: Int32):
        """The warpgroup's 64 packed Q rows as Q.K^T's A operand in registers, loaded from global
        memory once (each element where the MMA wants it): Q.K^T then reads only K from shared
        memory, whose bandwidth the 64-key steps of long groups and chunked prefill ran into.
        Rows past the group's Sq x G and columns past the head dim are zero."""
        gQ = mQ[None, None, kv_head, batch]  # ((G, Sq), D)
        rows = seqlen_q * self.group
        q = cute.make_rmem_tensor(thr_qk.partition_shape_A((WGMMA_M, self.dqk)), self.dtype)
        where = thr_qk.partition_A(cute.make_identity_tensor((WGMMA_M, self.dqk)))
        # every load unconditional at a clamped address, then zeroed: straight-line code shares
        # the row's index arithmetic (a branch per element repeated it: ~25 instructions a load)
        for i in cutlass.range_constexpr(cute.size(q)):
            row, col = where[i]
            packed = m_block * WGMMA_M + row
            value = gQ[cutlass.min(packed, rows - 1), cutlass.min(col, self.cfg.head_dim - 1)]
            q[i] = cutlass.select_(packed < rows and col < self.cfg.head_dim, value, self.dtype(0.0))
        return q

    @cute.jit
    def sync(self, wg, async_reads: bool):
        """Barrier of consumer warpgroup ``wg`` (its own id: two consumers never mix), ordering its
        shared-memory stores before the MMAs that read them where ``async_reads``."""
        if cutlass.const_expr(async_reads):
            cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=NamedBarrier.EPILOGUE + wg, number_of_threads=WARPGROUP_THREADS)

    @cute.jit
    def consume(self, mQ, mO, mLSE, sQ, sK, sV, pipe_k, pipe_v, work, splits: tuple, wg, args):
        """Consumer warpgroup ``wg``: its Q rows (work's m_block counts 64-row tiles), then every
        key tile of the CTA's run, then its output (``splits``: the partials, their counters, the
        ``last`` word in shared memory and the split count)."""
        m_block, split, kv_head, batch, seqlen_q, length, lo, count, split_lo, split_hi = work
        wtidx = cute.arch.thread_idx()[0] % WARPGROUP_THREADS
        q_source = warpgroup.OperandSource.RMEM if self.cfg.q_in_registers else warpgroup.OperandSource.SMEM
        qk_mma = self._mma(self.tile_n, OperandMajorMode.K, q_source, False)
        qk_acc = self._mma(self.tile_n, OperandMajorMode.K, q_source, True)
        pv_mma = self._mma(self.dv, OperandMajorMode.MN, warpgroup.OperandSource.RMEM, True)
        thr_qk, thr_pv = qk_mma.get_slice(wtidx), pv_mma.get_slice(wtidx)
        if cutlass.const_expr(self.cfg.q_in_registers):
            tSrQ = self.q_fragment(mQ, thr_qk, m_block, kv_head, batch, seqlen_q)
        else:
            self.load_q(mQ, sQ, m_block, kv_head, batch, seqlen_q, wtidx, wg)
            tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
        coords = rows_cols_view(thr_qk.partition_C(cute.make_identity_tensor((WGMMA_M, self.tile_n))))
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((WGMMA_M, self.dv)))
        acc_o.fill(0.0)
        p = cute.make_rmem_tensor(thr_pv.partition_shape_A((WGMMA_M, self.tile_n)), self.dtype)
        row_max, row_sum = self.softmax.make_state()
        # each of the thread's rows: its query index and head, and its visible keys
        queries, heads, starts, ends = self.row_positions(coords, m_block, kv_head, batch, seqlen_q, length, args)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        step = DecodeStep(
            qk_mma, qk_acc, thr_qk, (WGMMA_M, self.tile_n), pv_mma, tSrQ, tSrK, tOrV, p, acc_o, coords, wtidx, wg
        )
        rows = (queries, heads, starts, ends, batch, seqlen_q, length, split_lo, split_hi)
        if count > 0:
            k_state = self.first_scores(step, pipe_k, k_state, lo, rows, row_max, row_sum, args)
        for i in cutlass.range(1, count, unroll=1):
            k_state, v_state = self.overlapped_step(
                step, pipe_k, pipe_v, k_state, v_state, lo + i, rows, row_max, row_sum, args
            )
        if count > 0:
            self.last_product(step, sV, pipe_v, v_state, lo + count - 1, length)
        o_coords = rows_cols_view(thr_pv.partition_C(cute.make_identity_tensor((WGMMA_M, self.dv))))
        if cutlass.const_expr(self.warpgroups == 1):
            self.store(acc_o, o_coords, row_max, row_sum, heads, mO, mLSE, work, splits, wtidx, wg, args)
        elif m_block * WGMMA_M < seqlen_q * self.group:  # a 128-row tile's second half may hold no row
            self.store(acc_o, o_coords, row_max, row_sum, heads, mO, mLSE, work, splits, wtidx, wg, args)

    @cute.jit
    def first_scores(self, step, pipe_k, k_state, n_block: Int32, rows: tuple, row_max, row_sum, args):
        """The run's first key tile up to its P (O is still zero: nothing to rescale)."""
        acc_s = step.fresh_scores()
        pipe_k.consumer_wait(k_state)
        warpgroup.fence()
        self.issue_qk(step, acc_s, k_state.index)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(k_state)
        self.probabilities(step, acc_s, n_block, rows, row_max, row_sum, args)
        store_as_operand_a(acc_s, step.p, self.softmax.rescale_threshold > 0.0)
        k_state.advance()
        return k_state

    @cute.jit
    def overlapped_step(
        self, step, pipe_k, pipe_v, k_state, v_state, n_block: Int32, rows: tuple, row_max, row_sum, args
    ):
        """S(n) = Q.K^T issued with O += P(n-1).V(n-1), the softmax of S(n) after both (ptxas
        hoists the P.V wait above it); then O is corrected and S(n) becomes the next P."""
        acc_s = step.fresh_scores()
        pipe_k.consumer_wait(k_state)
        pipe_v.consumer_wait(v_state)
        warpgroup.fence()
        self.issue_qk(step, acc_s, k_state.index)
        self.issue_pv(step, v_state.index)
        warpgroup.wait_group(1)
        pipe_k.consumer_release(k_state)
        correction = self.probabilities(step, acc_s, n_block, rows, row_max, row_sum, args)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)
        # (with a rescale threshold the conversions stay above the rescale's branch: mainloop.store_p)
        store_as_operand_a(acc_s, step.p, self.softmax.rescale_threshold > 0.0)
        self.softmax.rescale(rows_cols_view(step.acc_o), correction)
        k_state.advance()
        v_state.advance()
        return k_state, v_state

    @cute.jit
    def last_product(self, step, sV, pipe_v, v_state, n_block: Int32, length: Int32):
        """The run's last P.V, after clearing the V rows past the cache length where its tile
        holds the cache's last key."""
        pipe_v.consumer_wait(v_state)
        if (n_block + 1) * self.tile_n > length:
            self.clear_keys_from(sV[None, None, v_state.index], length - n_block * self.tile_n, step.wtidx, step.wg)
        warpgroup.fence()
        self.issue_pv(step, v_state.index)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)

    @cute.jit
    def issue_qk(self, step, acc_s, stage: Int32):
        issue_k_blocks(step.qk_mma, step.qk_acc, acc_s, step.tSrQ, step.tSrK, stage)

    @cute.jit
    def issue_pv(self, step, stage: Int32):
        issue_k_blocks(step.pv_mma, step.pv_mma, step.acc_o, step.p, step.tOrV, stage)

    @cute.jit
    def probabilities(self, step, acc_s, n_block: Int32, rows: tuple, row_max, row_sum, args):
        """Key tile ``n_block``'s scores modified, masked and exponentiated in place; returns O's
        row corrections."""
        scores = rows_cols_view(acc_s)
        self.scores_of_tile(scores, step.coords, n_block, rows, args)
        return self.softmax.update(scores, row_max, row_sum)

    @cute.jit
    def clear_keys_from(self, sVt, first: Int32, wtidx: Int32, wg):
        """Zero the V rows of keys ``first`` .. tile_n - 1 of a stage (``sVt``: (Dv, keys)). Their
        P is 0, but 0 x NaN is NaN, and a cache's slots past an entry's length (or a clamped
        page's) may hold anything. Ordered before the warpgroup's MMA reads them; a second
        consumer clears the same rows to the same zeros, so neither waits for the other."""
        vectors = self.dv // VECTOR
        for v in cutlass.range(wtidx, (self.tile_n - first) * vectors, WARPGROUP_THREADS, unroll=1):
            key, col = first + v // vectors, v % vectors * VECTOR
            for j in cutlass.range_constexpr(VECTOR):
                sVt[col + j, key] = self.dtype(0.0)
        self.sync(wg, async_reads=True)

    @cute.jit
    def row_positions(self, coords, m_block: Int32, kv_head: Int32, batch: Int32, seqlen_q: Int32, length: Int32, args):
        """Per row of this thread: query index, query head, and [start, end) of its keys."""
        rows = cute.size(coords, mode=[0])
        queries = cute.make_rmem_tensor(cute.make_layout(rows), Int32)
        heads = cute.make_rmem_tensor(cute.make_layout(rows), Int32)
        starts = cute.make_rmem_tensor(cute.make_layout(rows), Int32)
        ends = cute.make_rmem_tensor(cute.make_layout(rows), Int32)
        for r in cutlass.range_constexpr(rows):
            packed = m_block * WGMMA_M + coords[r, 0][0]
            query = cutlass.min(packed // self.group, seqlen_q - 1)  # rows past Sq x G are discarded
            queries[r] = query
            heads[r] = kv_head * self.group + packed % self.group
            starts[r], ends[r] = self.key_tiles.row_range(query, batch, seqlen_q, length, args)
        return queries, heads, starts, ends

    @cute.jit
    def scores_of_tile(self, scores, coords, n_block: Int32, rows: tuple, args):
        """Score modifier and masks of key tile ``n_block`` (the ragged end of the cache length
        and any bound crossing the tile; an expression mask on every tile). ``rows``: the thread's
        rows' query indices, heads and key ranges, then batch, Sq, the cache length, split_lo and
        split_hi."""
        queries, heads, starts, ends, batch, seqlen_q, length, split_lo, split_hi = rows
        col_base = n_block * self.tile_n
        if cutlass.const_expr(self.score_mod is not None):
            for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                    scores[r, c] = self.score_mod(
                        scores[r, c], batch, heads[r], queries[r], col_base + coords[0, c][1], seqlen_q, length, args
                    )
        if n_block >= split_hi or n_block < split_lo:
            self.key_tiles.apply(scores, coords, starts, ends, col_base, n_block < split_lo)
        if cutlass.const_expr(self.mask_mod is not None):
            for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                    visible = self.mask_mod(
                        batch, heads[r], queries[r], col_base + coords[0, c][1], seqlen_q, length, args
                    )
                    scores[r, c] = Float32(cutlass.select_(visible, scores[r, c], -Float32.inf))

    @cute.jit
    def store(self, acc_o, o_coords, row_max, row_sum, heads, mO, mLSE, work, splits: tuple, wtidx: Int32, wg, args):
        """With one split: O normalised (the sink in its denominator) and the LSE. With more:
        this split's O normalised by its own sum, fp32, and its LSE; the last split to finish
        then merges them all (``combine_tile``)."""
        m_block, split, kv_head, batch, seqlen_q, _, _, _, _, _ = work
        mOPart, mLSEPart, mCounters, sLast, sStats, num_splits = splits
        out = rows_cols_view(acc_o)
        lse = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        rows = seqlen_q * self.group
        if num_splits == 1:
            sinks = None
            if cutlass.const_expr(self.cfg.sinks):
                sinks = cute.make_rmem_tensor(cute.make_layout(2), Float32)
                for r in cutlass.range_constexpr(2):
                    sinks[r] = Float32(args.sinks[heads[r]])
            self.softmax.finalize(out, row_max, row_sum, lse, row_sinks=sinks)
            self.write_rows(out, o_coords, lse, m_block, rows, mO[None, None, kv_head, batch], mLSE, kv_head, batch)
        else:
            self.softmax.finalize(out, row_max, row_sum, lse)
            self.write_rows(
                out,
                o_coords,
                lse,
                m_block,
                rows,
                mOPart[None, None, kv_head, batch, split],
                mLSEPart[None, kv_head, batch, split],
                None,
                None,
            )
            counter = mCounters.iterator + cute.crd2idx((batch, kv_head, m_block), mCounters.layout)
            if self.arrives_last(counter, num_splits, sLast, wtidx, wg):
                where = (m_block, kv_head, batch, seqlen_q)
                self.combine_tile((mOPart, mLSEPart), (mO, mLSE), where, num_splits, sStats, wtidx, wg, args)

    @cute.jit
    def arrives_last(self, counter, num_splits: Int32, sLast, wtidx: Int32, wg):
        """Count this CTA into its query tile's ``counter`` once the warpgroup's partial stores
        are visible GPU-wide; True in the CTA that counts in last (it lowers the counter again
        for the next launch: every split has counted in by then), whose threads then see every
        split's partial."""
        cute.arch.fence_acq_rel_gpu()
        self.sync(wg, async_reads=False)
        if wtidx == 0:
            before = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
            sLast[wg] = Int32(0)
            if before == num_splits - 1:
                sLast[wg] = Int32(1)
                cute.arch.store(counter, Int32(0), sem="relaxed", scope="gpu")
        self.sync(wg, async_reads=False)
        last = sLast[wg] == Int32(1)
        if last:
            cute.arch.fence_acq_rel_gpu()
        return last

    @cute.jit
    def write_rows(self, out, o_coords, lse, m_block: Int32, rows: Int32, gO, gLSE, kv_head, batch):
        """This thread's O elements of rows below ``rows`` (in gO's type) and, from the thread
        holding a row's first column, its LSE (``gLSE``: packed rows, or None; indexed with
        kv_head and batch where they are given)."""
        for r in cutlass.range_constexpr(cute.size(out, mode=[0])):
            packed = m_block * WGMMA_M + o_coords[r, 0][0]
            if packed < rows:
                for c in cutlass.range_constexpr(cute.size(out, mode=[1])):
                    col = o_coords[0, c][1]
                    if col < self.cfg.head_dim_v:
                        gO[packed, col] = out[r, c].to(gO.element_type)
                if cutlass.const_expr(gLSE is not None):
                    if o_coords[0, 0][1] == 0:
                        if cutlass.const_expr(kv_head is None):
                            gLSE[packed] = lse[r]
                        else:
                            gLSE[packed, kv_head, batch] = lse[r]
