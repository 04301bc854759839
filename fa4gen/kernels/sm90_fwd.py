"""Hopper (sm_90a) attention forward: warp-specialized TMA producer + wgmma consumer warpgroups.

CTA layout: warpgroup 0 is the producer (one warp issues TMA loads of Q and a ring of K/V
tiles, registers given away with setmaxnreg); warpgroups 1..W are consumers, each owning 64
query rows of the CTA's tile_m: S = Q.K^T (wgmma, both operands in shared memory), score
modifier + mask + online softmax in registers, O += P.V (wgmma, P from registers). K and V have
separate mbarrier pipelines so a K stage is released as soon as S is computed.

Everything tile-shaped is a compile-time constant from the Plan; batch, heads and sequence
lengths are run-time values, so one compiled kernel serves all sizes.
"""

from __future__ import annotations

from typing import Callable, Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from fa4gen.kernels.layout import rows_cols_view, store_as_operand_a
from fa4gen.kernels.masking import KeyTileRange
from fa4gen.kernels.softmax import OnlineSoftmax

WARPGROUP_THREADS = 128
TURN_BARRIER_BASE = 1  # named barriers 1..W order the consumers' MMA issue (0 is __syncthreads)
SMEM_ALIGN = 1024  # 128-byte swizzle atoms repeat every 1 KB


class _MainLoop:
    """Per-thread state of one query tile's main loop (fragments, pipelines, sizes).

    A plain holder filled once before the loops; nothing assigns to it inside them."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


class HopperAttentionForward:
    """One compiled forward kernel. Constructor arguments are all compile-time constants."""

    def __init__(
        self,
        *,
        head_dim: int,
        head_dim_v: int,
        head_dim_padded: int,
        head_dim_v_padded: int,
        qhead_per_kvhead: int,
        tile_m: int,
        tile_n: int,
        kv_stages: int,
        num_consumer_warpgroups: int,
        producer_regs: int,
        consumer_regs: int,
        scale_log2: float,
        window_left: Optional[int],
        window_right: Optional[int],
        score_mod: Optional[Callable] = None,
        return_lse: bool = False,
        intra_warpgroup_overlap: bool = True,
        pingpong: bool = False,
    ):
        assert tile_m == 64 * num_consumer_warpgroups
        assert not pingpong or intra_warpgroup_overlap, "ping-pong needs the overlapped schedule"
        self.head_dim, self.head_dim_v = head_dim, head_dim_v
        self.dqk, self.dv = head_dim_padded, head_dim_v_padded
        self.qhead_per_kvhead = qhead_per_kvhead
        self.tile_m, self.tile_n, self.kv_stages = tile_m, tile_n, kv_stages
        self.num_consumers = num_consumer_warpgroups
        self.producer_regs, self.consumer_regs = producer_regs, consumer_regs
        self.score_mod = score_mod
        self.return_lse = return_lse
        self.overlap = intra_warpgroup_overlap
        self.pingpong = pingpong and num_consumer_warpgroups > 1
        self.key_tiles = KeyTileRange(tile_m, tile_n, window_left, window_right)
        self.has_mask = window_left is not None or window_right is not None
        self.softmax = OnlineSoftmax(scale_log2, num_rows=2)
        self.threads = WARPGROUP_THREADS * (1 + num_consumer_warpgroups)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Sq, Hq, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D)
        mV: cute.Tensor,  # (B, Sk, Hkv, Dv)
        mO: cute.Tensor,  # (B, Sq, Hq, Dv)
        mLSE: Optional[cute.Tensor],  # (B, Hq, Sq) fp32, or None
        stream: cuda.CUstream,
    ):
        dtype = mQ.element_type
        self.dtype = dtype
        # (S, D, H, B): sequence-major views, head dim contiguous
        q = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
        k = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
        o = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0]))
        # V as the B operand of P.V: (Dv, S, H, B), Dv contiguous (MN-major)
        vt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))

        qk_mma, pv_mma = self._make_qk_mma(), self._make_pv_mma()
        sQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, self.dqk), dtype, 1
        )
        sK_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, self.dqk), dtype, self.kv_stages
        )
        sV_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.COL_MAJOR, (self.tile_m, self.dv, self.tile_n), dtype, self.kv_stages
        )
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_q_t = cpasync.make_tiled_tma_atom(
            g2s, q, cute.slice_(sQ_layout, (None, None, 0)), (self.tile_m, self.dqk)
        )
        tma_k, tma_k_t = cpasync.make_tiled_tma_atom(
            g2s, k, cute.slice_(sK_layout, (None, None, 0)), (self.tile_n, self.dqk)
        )
        tma_v, tma_v_t = cpasync.make_tiled_tma_atom(
            g2s, vt, cute.slice_(sV_layout, (None, None, 0)), (self.dv, self.tile_n)
        )
        self.q_bytes = cute.size_in_bytes(dtype, cute.slice_(sQ_layout, (None, None, 0)))
        self.k_bytes = cute.size_in_bytes(dtype, cute.slice_(sK_layout, (None, None, 0)))
        self.v_bytes = cute.size_in_bytes(dtype, cute.slice_(sV_layout, (None, None, 0)))

        @cute.struct
        class SharedStorage:
            bar_q: cute.struct.MemRange[cutlass.Int64, 2]
            bar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            bar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], SMEM_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sV_layout)], SMEM_ALIGN]

        self.shared_storage = SharedStorage
        seqlen_q = q.shape[0]
        num_m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        grid = (num_m_blocks, q.shape[2], q.shape[3])
        lse = None
        if cutlass.const_expr(mLSE is not None):
            lse = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))  # (Sq, H, B)
        self.kernel(
            qk_mma, pv_mma, tma_q, tma_q_t, tma_k, tma_k_t, tma_v, tma_v_t, o, lse,
            sQ_layout, sK_layout, sV_layout,
        ).launch(
            grid=grid,
            block=[self.threads, 1, 1],
            smem=self.shared_storage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mVt: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        bidx, head, batch = cute.arch.block_idx()
        num_m_blocks = cute.arch.grid_dim()[0]
        m_block = num_m_blocks - 1 - bidx  # longest (causal) tiles first

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        pipe_q = self._make_pipeline(storage.bar_q.data_ptr(), 1, self.q_bytes)
        pipe_k = self._make_pipeline(storage.bar_k.data_ptr(), self.kv_stages, self.k_bytes)
        pipe_v = self._make_pipeline(storage.bar_v.data_ptr(), self.kv_stages, self.v_bytes)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        n_min, split_lo, split_hi, n_max = self.key_tiles.bounds(m_block, seqlen_q, seqlen_k)
        kv_head = head // self.qhead_per_kvhead

        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce(
                    tma_q, mQ, tma_k, mK, tma_v, mVt, sQ, sK, sV, pipe_q, pipe_k, pipe_v,
                    m_block, head, kv_head, batch, n_min, n_max,
                )
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(
                qk_mma, pv_mma, sQ, sK, sV, pipe_q, pipe_k, pipe_v, mO, mLSE,
                tidx - WARPGROUP_THREADS, m_block, head, batch,
                seqlen_q, seqlen_k, n_min, split_lo, split_hi, n_max,
            )

    def _make_qk_mma(self, accumulate: Optional[bool] = None) -> cute.TiledMma:
        mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            (self.num_consumers, 1, 1), (64, self.tile_n),
        )
        if accumulate is not None:
            mma.set(warpgroup.Field.ACCUMULATE, accumulate)
        return mma

    def _make_pv_mma(self, accumulate: Optional[bool] = None) -> cute.TiledMma:
        mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
            (self.num_consumers, 1, 1), (64, self.dv), warpgroup.OperandSource.RMEM,
        )
        if accumulate is not None:
            mma.set(warpgroup.Field.ACCUMULATE, accumulate)
        return mma

    def _make_pipeline(self, barriers, stages: int, tx_bytes: int):
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers,
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.num_consumers),
            tx_count=tx_bytes,
            defer_sync=True,
        )

    @cute.jit
    def produce(
        self, tma_q, mQ, tma_k, mK, tma_v, mVt, sQ, sK, sV, pipe_q, pipe_k, pipe_v,
        m_block: Int32, head: Int32, kv_head: Int32, batch: Int32, n_min: Int32, n_max: Int32,
    ):
        """One warp: Q once, then K and V tiles from the highest key tile down."""
        gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.dqk), (m_block, 0))
        gK = cute.local_tile(mK[None, None, kv_head, batch], (self.tile_n, self.dqk), (None, 0))
        gVt = cute.local_tile(mVt[None, None, kv_head, batch], (self.dv, self.tile_n), (0, None))
        one = cute.make_layout(1)
        tQs, tQg = cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gVt, 0, 2))
        if n_max > n_min:
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_q, tQg, tQs[None, 0], tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
            for i in cutlass.range(n_max - n_min, unroll=1):
                n_block = n_max - 1 - i
                pipe_k.producer_acquire(kv_state)
                cute.copy(tma_k, tKg[None, n_block], tKs[None, kv_state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                pipe_v.producer_acquire(kv_state)
                cute.copy(tma_v, tVg[None, n_block], tVs[None, kv_state.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                kv_state.advance()

    @cute.jit
    def consume(
        self, qk_mma, pv_mma, sQ, sK, sV, pipe_q, pipe_k, pipe_v, mO, mLSE,
        ctidx: Int32, m_block: Int32, head: Int32, batch: Int32,
        seqlen_q: Int32, seqlen_k: Int32, n_min: Int32, split_lo: Int32, split_hi: Int32, n_max: Int32,
    ):
        thr_qk = qk_mma.get_slice(ctidx)
        thr_pv = pv_mma.get_slice(ctidx)
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.tile_m, self.dv)))
        acc_o.fill(0.0)
        row_max, row_sum = self.softmax.make_state()
        row_base = m_block * self.tile_m
        if n_max > n_min:
            # ACCUMULATE is fixed per MMA object outside the loops (setting it inside a loop
            # would leak a loop-local value): one object zero-fills S, the other accumulates.
            loop = _MainLoop(
                qk_first=self._make_qk_mma(False),
                qk_rest=self._make_qk_mma(True),
                pv=self._make_pv_mma(True),
                tSrQ=thr_qk.make_fragment_A(thr_qk.partition_A(sQ)),
                tSrK=thr_qk.make_fragment_B(thr_qk.partition_B(sK)),
                tOrV=thr_pv.make_fragment_B(thr_pv.partition_B(sV)),
                coords_s=thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))),
                p=cute.make_rmem_tensor(thr_pv.partition_shape_A((self.tile_m, self.tile_n)), self.dtype),
                acc_o=acc_o, row_max=row_max, row_sum=row_sum, pipe_k=pipe_k, pipe_v=pipe_v,
                row_base=row_base, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                warpgroup=ctidx // WARPGROUP_THREADS,
            )
            pipe_q.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
            self.mainloop(loop, n_min, split_lo, split_hi, n_max)
        self.epilogue(thr_pv, acc_o, row_max, row_sum, mO, mLSE, row_base, head, batch, seqlen_q)

    @cute.jit
    def mainloop(self, loop, n_min: Int32, split_lo: Int32, split_hi: Int32, n_max: Int32):
        """Key tiles from n_max-1 down to n_min. The first tile always runs the mask (it may hold
        the diagonal or the ragged end of Sk); then masked / interior / masked runs."""
        top = n_max - 1
        count_hi = cutlass.max(top - split_hi, 0)
        start_mid = cutlass.min(split_hi, top)
        count_mid = cutlass.max(start_mid - split_lo, 0)
        start_lo = cutlass.min(split_lo, top)
        count_lo = cutlass.max(start_lo - n_min, 0)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        if cutlass.const_expr(self.overlap):
            if cutlass.const_expr(self.pingpong):
                if loop.warpgroup == self.num_consumers - 1:
                    self.pass_turn(loop)  # the last warpgroup lets the first one start
            k_state = self.first_tile(loop, top, k_state)
            for i in cutlass.range(count_hi, unroll=1):
                k_state, v_state = self.overlapped_tile(loop, top - 1 - i, k_state, v_state, True)
            for i in cutlass.range(count_mid, unroll=1):
                k_state, v_state = self.overlapped_tile(loop, start_mid - 1 - i, k_state, v_state, False)
            if cutlass.const_expr(self.has_mask):
                for i in cutlass.range(count_lo, unroll=1):
                    k_state, v_state = self.overlapped_tile(loop, start_lo - 1 - i, k_state, v_state, True)
            self.pv_product(loop, v_state)
        else:
            k_state = self.serial_tile(loop, top, k_state, True)
            for i in cutlass.range(count_hi, unroll=1):
                k_state = self.serial_tile(loop, top - 1 - i, k_state, True)
            for i in cutlass.range(count_mid, unroll=1):
                k_state = self.serial_tile(loop, start_mid - 1 - i, k_state, False)
            if cutlass.const_expr(self.has_mask):
                for i in cutlass.range(count_lo, unroll=1):
                    k_state = self.serial_tile(loop, start_lo - 1 - i, k_state, True)

    @cute.jit
    def wait_turn(self, loop):
        """Ping-pong: block until the previous warpgroup has issued its MMAs."""
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=TURN_BARRIER_BASE + loop.warpgroup, number_of_threads=2 * WARPGROUP_THREADS)

    @cute.jit
    def pass_turn(self, loop):
        """Ping-pong: let the next warpgroup issue (our MMAs are queued; our softmax runs
        while its MMAs occupy the tensor cores)."""
        if cutlass.const_expr(self.pingpong):
            following = (loop.warpgroup + 1) % self.num_consumers
            cute.arch.barrier_arrive(barrier_id=TURN_BARRIER_BASE + following, number_of_threads=2 * WARPGROUP_THREADS)

    @cute.jit
    def issue_qk(self, loop, acc_s: cute.Tensor, stage: Int32):
        for kb in cutlass.range_constexpr(cute.size(loop.tSrQ, mode=[2])):
            mma = loop.qk_first if kb == 0 else loop.qk_rest
            cute.gemm(mma, acc_s, loop.tSrQ[None, None, kb, 0], loop.tSrK[None, None, kb, stage], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def issue_pv(self, loop, stage: Int32):
        for kb in cutlass.range_constexpr(cute.size(loop.p, mode=[2])):
            cute.gemm(loop.pv, loop.acc_o, loop.p[None, None, kb], loop.tOrV[None, None, kb, stage], loop.acc_o)
        warpgroup.commit_group()

    @cute.jit
    def scores_to_probs(self, loop, acc_s: cute.Tensor, n_block: Int32, masked: cutlass.Constexpr) -> cute.Tensor:
        """Score modifier, mask, online-softmax update; returns the per-row O correction."""
        if cutlass.const_expr(self.score_mod is not None):
            for j in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[j] = self.score_mod(acc_s[j])
        scores = rows_cols_view(acc_s)
        if cutlass.const_expr(masked):
            self.key_tiles.apply(scores, rows_cols_view(loop.coords_s), loop.row_base, n_block * self.tile_n,
                                 loop.seqlen_q, loop.seqlen_k)
        return self.softmax.update(scores, loop.row_max, loop.row_sum)

    @cute.jit
    def serial_tile(self, loop, n_block: Int32, k_state, masked: cutlass.Constexpr):
        """S = Q.K^T; softmax; O += P.V, each waited for before the next."""
        acc_s = cute.make_rmem_tensor(loop.coords_s.shape, Float32)
        loop.pipe_k.consumer_wait(k_state)
        warpgroup.fence()
        self.issue_qk(loop, acc_s, k_state.index)
        warpgroup.wait_group(0)
        loop.pipe_k.consumer_release(k_state)
        correction = self.scores_to_probs(loop, acc_s, n_block, masked)
        self.softmax.rescale(rows_cols_view(loop.acc_o), correction)
        store_as_operand_a(acc_s, loop.p)
        self.pv_product(loop, k_state)
        k_state.advance()
        return k_state

    @cute.jit
    def first_tile(self, loop, n_block: Int32, k_state):
        """Overlapped schedule, prologue: S and P of the first tile; its P.V waits for the next."""
        acc_s = cute.make_rmem_tensor(loop.coords_s.shape, Float32)
        loop.pipe_k.consumer_wait(k_state)
        self.wait_turn(loop)
        warpgroup.fence()
        self.issue_qk(loop, acc_s, k_state.index)
        self.pass_turn(loop)
        warpgroup.wait_group(0)
        loop.pipe_k.consumer_release(k_state)
        self.scores_to_probs(loop, acc_s, n_block, True)  # O is still zero: no correction
        store_as_operand_a(acc_s, loop.p)
        k_state.advance()
        return k_state

    @cute.jit
    def overlapped_tile(self, loop, n_block: Int32, k_state, v_state, masked: cutlass.Constexpr):
        """Issue S(n) = Q.K^T and O += P(n+1).V(n+1) together; the softmax of S(n) runs while
        the tensor cores finish P.V; then O is corrected and S(n) becomes the next P."""
        acc_s = cute.make_rmem_tensor(loop.coords_s.shape, Float32)
        loop.pipe_k.consumer_wait(k_state)
        loop.pipe_v.consumer_wait(v_state)
        self.wait_turn(loop)
        warpgroup.fence()
        self.issue_qk(loop, acc_s, k_state.index)
        self.issue_pv(loop, v_state.index)
        self.pass_turn(loop)
        warpgroup.wait_group(1)
        loop.pipe_k.consumer_release(k_state)
        correction = self.scores_to_probs(loop, acc_s, n_block, masked)
        warpgroup.wait_group(0)
        loop.pipe_v.consumer_release(v_state)
        self.softmax.rescale(rows_cols_view(loop.acc_o), correction)
        store_as_operand_a(acc_s, loop.p)
        k_state.advance()
        v_state.advance()
        return k_state, v_state

    @cute.jit
    def pv_product(self, loop, v_state):
        loop.pipe_v.consumer_wait(v_state)
        self.wait_turn(loop)
        warpgroup.fence()
        self.issue_pv(loop, v_state.index)
        self.pass_turn(loop)
        warpgroup.wait_group(0)
        loop.pipe_v.consumer_release(v_state)

    @cute.jit
    def epilogue(self, thr_pv, acc_o, row_max, row_sum, mO, mLSE, row_base, head, batch, seqlen_q):
        """Normalise O, store it (rows < Sq, columns < Dv) in the input dtype, and the LSE."""
        out = rows_cols_view(acc_o)
        lse = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        self.softmax.finalize(out, row_max, row_sum, lse)
        gO = cute.local_tile(mO[None, None, head, batch], (self.tile_m, self.dv), (row_base // self.tile_m, 0))
        tOgO = rows_cols_view(thr_pv.partition_C(gO))
        coords = rows_cols_view(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.dv))))
        o_cast = cute.make_rmem_tensor_like(acc_o, mO.element_type)
        o_cast.store(acc_o.load().to(mO.element_type))
        o_mn = rows_cols_view(o_cast)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            if row_base + coords[r, 0][0] < seqlen_q:
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                    if cutlass.const_expr(self.dv == self.head_dim_v):
                        tOgO[r, c] = o_mn[r, c]
                    else:
                        if coords[0, c][1] < self.head_dim_v:
                            tOgO[r, c] = o_mn[r, c]
        if cutlass.const_expr(self.return_lse):
            if coords[0, 0][1] == 0:
                for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
                    row = row_base + coords[r, 0][0]
                    if row < seqlen_q:
                        mLSE[row, head, batch] = lse[r]
