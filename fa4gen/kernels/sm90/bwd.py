"""Hopper (sm_90a) attention backward: dQ, dK, dV from Q, K, V, O, dO and the forward's LSE.

Three launches on one stream (``__call__``): the preprocess (bwd_prepost: dPsum = rowsum(dO * O),
the LSE in log2 units, dQ's fp32 accumulator zeroed), the main kernel below, and the
postprocess (dQ scaled and rounded).

Main kernel: one CTA per (key tile of 64 keys per consumer warpgroup, KV head, batch). Warpgroup
0 is the producer (one warp: TMA loads of K and V once, then per step a query tile's Q and dO
into a ring of ``q_stages``); warpgroups 1..2 are consumers, each owning 64 keys of the tile and
their dK and dV accumulators, which stay in registers over every step: the KV head's query heads
(so GQA needs no reduction across CTAs: dK and dV are written once, deterministically) times the
query tiles that see the key tile. One step (``step``), with every MMA spanning both warpgroups:

1. S^T = K.Q^T and dP^T = V.dO^T (keys on the MMA's M side, so the probabilities are already
   the A operand of dV's product: FA3/FA4's SdP_swapAB);
2. P^T = exp2(S^T * scale_log2 - LSE_log2) with the mask, dS^T = P^T * (dP^T - dPsum) (with a
   soft cap, times its tanh's derivative);
3. dV += P^T.dO and dK += dS^T.Q, both A operands from registers;
4. dS^T through shared memory (transposing stmatrix) for dQ = dS.K, whose fp32 result is added
   into the accumulator in global memory (``red.add``: the only cross-CTA reduction).

Everything tile-shaped is a compile-time constant of Sm90BwdConfig; batch, heads and sequence
lengths are run-time values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

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
from fa4gen.kernels.common.masking import KeyTileRange, column_offsets, visible_columns
from fa4gen.kernels.sm90.bwd_config import Sm90BwdConfig, bwd_config_problem
from fa4gen.kernels.sm90.bwd_prepost import LOG2_E, Sm90BwdPrePost
from fa4gen.kernels.sm90.producer import tma_pipeline

SMEM_ALIGN = 1024
PREPOST_THREADS = WARPGROUP_THREADS


class BwdBarrier(enum.IntEnum):
    """Named barriers of the consumer warpgroups (0 is __syncthreads)."""

    DS_FREE = 1  # both warpgroups' dQ MMAs have read the last dS
    DS_FULL = 2  # both warpgroups have written this step's dS


@dataclass(frozen=True)
class BwdFragments:
    """One consumer thread's MMAs, operand fragments and accumulators (made once per CTA; the
    accumulators change in place, the record never)."""

    sdp_first: Any  # S^T and dP^T: the first k-block zero-fills
    sdp_rest: Any
    dkv: Any  # dV += P^T.dO and dK += dS^T.Q (A from registers)
    dk: Any
    dq_first: Any  # dQ = dS.K
    dq_rest: Any
    tSrK: Any  # S^T: K (A) and Q (B)
    tSrQ: Any
    tPrV: Any  # dP^T: V (A) and dO (B)
    tPrdO: Any
    tVrdO: Any  # dV: dO^T (B)
    tKrQ: Any  # dK: Q^T (B)
    tQrdS: Any  # dQ: dS (A) and K^T (B)
    tQrK: Any
    p: Any  # P^T and dS^T as 16-bit A operands
    ds: Any
    ds_copy: Any  # stmatrix of dS^T into sdS: (copy, its source view of ds, its targets)
    ds_source: Any
    ds_target: Any
    acc_dk: Any
    acc_dv: Any
    coords_s: Any  # (key, query) of each S^T element in the tile
    thr_dq: Any  # this thread's part of dQ's MMA
    coords_dk: Any  # (key, column) of each dK and dV element in the tile
    coords_dv: Any


class HopperAttentionBackward(Sm90BwdPrePost):
    """One compiled backward; ``config`` is the planner's Sm90BwdConfig."""

    def __init__(self, config: Sm90BwdConfig):
        problem = bwd_config_problem(config)
        assert not problem, problem
        self.cfg = config
        self.dqk, self.dv = config.head_dim_padded, config.head_dim_v_padded
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.num_consumers = config.num_consumer_warpgroups
        self.q_stages = config.q_stages
        # the mask read per key: the query rows that see it (masking.key_query_range)
        self.key_queries = KeyTileRange(self.tile_m, self.tile_n, config.window_left, config.window_right)
        self.threads = WARPGROUP_THREADS * (1 + self.num_consumers)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Sq, Hq, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D)
        mV: cute.Tensor,  # (B, Sk, Hkv, Dv)
        mO: cute.Tensor,  # (B, Sq, Hq, Dv)
        mdO: cute.Tensor,  # (B, Sq, Hq, Dv)
        mLSE: cute.Tensor,  # (B, Hq, Sq) fp32, natural log
        mdLSE: cute.Tensor,  # (B, Hq, Sq) fp32: the LSE's gradient (zeros where it has none)
        mdQ: cute.Tensor,  # (B, Sq, Hq, D), written
        mdK: cute.Tensor,  # (B, Sk, Hkv, D), written
        mdV: cute.Tensor,  # (B, Sk, Hkv, Dv), written
        mdQaccum: cute.Tensor,  # (B, Hq, Sq_pad, D_pad) fp32 workspace
        mdPsum: cute.Tensor,  # (B, Hq, Sq_pad) fp32 workspace
        mLSElog2: cute.Tensor,  # (B, Hq, Sq_pad) fp32 workspace
        extras: tuple,
        stream: cuda.CUstream,
    ):
        self.dtype = mQ.element_type
        # (S, D, H, B): sequence-major views, head dim contiguous
        q, k, v, do = (
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])) for t in (mQ, mK, mV, mdO)
        )
        layouts = self._smem_layouts(self.dtype)
        sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout = layouts
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        stage = (None, None, 0)
        tma_q, tma_q_t = cpasync.make_tiled_tma_atom(g2s, q, cute.slice_(sQ_layout, stage), (self.tile_m, self.dqk))
        tma_do, tma_do_t = cpasync.make_tiled_tma_atom(g2s, do, cute.slice_(sdO_layout, stage), (self.tile_m, self.dv))
        tma_k, tma_k_t = cpasync.make_tiled_tma_atom(g2s, k, cute.slice_(sK_layout, stage), (self.tile_n, self.dqk))
        tma_v, tma_v_t = cpasync.make_tiled_tma_atom(g2s, v, cute.slice_(sV_layout, stage), (self.tile_n, self.dv))
        self.q_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sQ_layout, stage))
        self.do_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sdO_layout, stage))
        self.kv_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, stage)) + cute.size_in_bytes(
            self.dtype, cute.slice_(sV_layout, stage)
        )

        @cute.struct
        class SharedStorage:
            bar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            bar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            bar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], SMEM_ALIGN]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], SMEM_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], SMEM_ALIGN]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], SMEM_ALIGN]

        self.shared_storage = SharedStorage
        batches, seqlen_q, heads_q = mQ.shape[0], mQ.shape[1], mQ.shape[2]
        m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        self.preprocess(mO, mdO, mLSE, mdLSE, mdPsum, mLSElog2, mdQaccum).launch(
            grid=(m_blocks, heads_q, batches), block=[PREPOST_THREADS, 1, 1], stream=stream
        )
        self.kernel(
            tma_q,
            tma_q_t,
            tma_do,
            tma_do_t,
            tma_k,
            tma_k_t,
            tma_v,
            tma_v_t,
            mdK,
            mdV,
            mdQaccum,
            mdPsum,
            mLSElog2,
            *layouts,
        ).launch(  # fmt: skip
            grid=(cute.ceil_div(mK.shape[1], self.tile_n), mK.shape[2], batches),
            block=[self.threads, 1, 1],
            smem=self.shared_storage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )
        self.postprocess(mdQaccum, mdQ).launch(
            grid=(m_blocks, heads_q, batches), block=[PREPOST_THREADS, 1, 1], stream=stream
        )

    def _smem_layout(self, dtype, rows: int, cols: int, stages: int, major: int):
        """(rows, cols, stages), cols contiguous, in swizzle atoms ``major`` columns wide or
        narrower: the widest that the narrowest slice any MMA takes of the columns allows (an
        MMA reading the buffer transposed, or a warpgroup's share of it, starts on an atom)."""
        kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, major)
        atom = warpgroup.make_smem_layout_atom(kind, dtype)
        return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))

    def _smem_layouts(self, dtype):
        """Q and dO: read as S^T / dP^T's B operand and, transposed, dK / dV's; K: S^T's A
        operand and, transposed, dQ's B (split over the warpgroups by head dim with dq_split n);
        V: dP^T's A; dS: dQ's A, written transposed."""
        k_major = self.dqk // self.num_consumers if self.cfg.dq_split == "n" else self.dqk
        return (
            self._smem_layout(dtype, self.tile_m, self.dqk, self.q_stages, self.dqk),
            self._smem_layout(dtype, self.tile_m, self.dv, self.q_stages, self.dv),
            self._smem_layout(dtype, self.tile_n, self.dqk, 1, k_major),
            self._smem_layout(dtype, self.tile_n, self.dv, 1, self.dv),
            self._smem_layout(dtype, self.tile_m, self.tile_n, 1, self.tile_n),
        )

    # ------------------------------------------------------------------ MMAs and fragments
    def _mma(self, a_major, b_major, atoms, tiler, accumulate: bool, a_registers: bool = False) -> cute.TiledMma:
        source = warpgroup.OperandSource.RMEM if a_registers else warpgroup.OperandSource.SMEM
        mma = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, a_major, b_major, Float32, atoms, tiler, source)
        mma.set(warpgroup.Field.ACCUMULATE, accumulate)
        return mma

    @cute.jit
    def fragments(self, sQ, sdO, sK, sV, sdS, ctidx: Int32) -> BwdFragments:
        """The MMAs over both consumer warpgroups (``ctidx``: 0..255) and this thread's parts."""
        K, MN = OperandMajorMode.K, OperandMajorMode.MN
        W = self.num_consumers
        keys = (W, 1, 1)  # the key rows split over the warpgroups
        sdp_first = self._mma(K, K, keys, (WGMMA_M, self.tile_m), False)
        thr_sdp = sdp_first.get_slice(ctidx)
        dkv = self._mma(K, MN, keys, (WGMMA_M, self.dv), True, a_registers=True)
        dk = self._mma(K, MN, keys, (WGMMA_M, self.dqk), True, a_registers=True)
        thr_dv, thr_dk = dkv.get_slice(ctidx), dk.get_slice(ctidx)
        if cutlass.const_expr(self.cfg.dq_split == "m"):
            dq_atoms, dq_tiler = (W, 1, 1), (WGMMA_M, self.dqk)
        else:
            dq_atoms, dq_tiler = (1, W, 1), (WGMMA_M, self.dqk // W)
        dq_first = self._mma(K, MN, dq_atoms, dq_tiler, False)
        thr_dq = dq_first.get_slice(ctidx)
        # transposed views of the same buffers (a K-major atom read transposed is an MN-major one)
        sQt = cute.make_tensor(sQ.iterator, cute.select(sQ.layout, mode=[1, 0, 2]))
        sdOt = cute.make_tensor(sdO.iterator, cute.select(sdO.layout, mode=[1, 0, 2]))
        sKt = cute.make_tensor(sK.iterator, cute.select(sK.layout, mode=[1, 0, 2]))
        sdSt = cute.make_tensor(sdS.iterator, cute.select(sdS.layout, mode=[1, 0, 2]))
        ds_copy = cute.make_tiled_copy_C(
            sm90_utils.get_smem_store_op(LayoutEnum.COL_MAJOR, self.dtype, Float32), sdp_first
        )
        thr_copy = ds_copy.get_slice(ctidx)
        s_shape = thr_sdp.partition_shape_C((self.tile_n, self.tile_m))
        ds = cute.make_rmem_tensor(thr_dk.partition_shape_A((self.tile_n, self.tile_m)), self.dtype)
        acc_dk = thr_dk.make_fragment_C(thr_dk.partition_shape_C((self.tile_n, self.dqk)))
        acc_dv = thr_dv.make_fragment_C(thr_dv.partition_shape_C((self.tile_n, self.dv)))
        acc_dk.fill(0.0)
        acc_dv.fill(0.0)
        return BwdFragments(
            sdp_first=sdp_first,
            sdp_rest=self._mma(K, K, keys, (WGMMA_M, self.tile_m), True),
            dkv=dkv,
            dk=dk,
            dq_first=dq_first,
            dq_rest=self._mma(K, MN, dq_atoms, dq_tiler, True),
            tSrK=thr_sdp.make_fragment_A(thr_sdp.partition_A(sK)),
            tSrQ=thr_sdp.make_fragment_B(thr_sdp.partition_B(sQ)),
            tPrV=thr_sdp.make_fragment_A(thr_sdp.partition_A(sV)),
            tPrdO=thr_sdp.make_fragment_B(thr_sdp.partition_B(sdO)),
            tVrdO=thr_dv.make_fragment_B(thr_dv.partition_B(sdOt)),
            tKrQ=thr_dk.make_fragment_B(thr_dk.partition_B(sQt)),
            tQrdS=thr_dq.make_fragment_A(thr_dq.partition_A(sdS)),
            tQrK=thr_dq.make_fragment_B(thr_dq.partition_B(sKt)),
            p=cute.make_rmem_tensor(thr_dv.partition_shape_A((self.tile_n, self.tile_m)), self.dtype),
            ds=ds,
            ds_copy=ds_copy,
            ds_source=thr_copy.retile(cute.make_tensor(ds.iterator, cute.make_layout(s_shape))),
            ds_target=thr_copy.partition_D(sdSt[None, None, 0]),
            acc_dk=acc_dk,
            acc_dv=acc_dv,
            coords_s=thr_sdp.partition_C(cute.make_identity_tensor((self.tile_n, self.tile_m))),
            thr_dq=thr_dq,
            coords_dk=thr_dk.partition_C(cute.make_identity_tensor((self.tile_n, self.dqk))),
            coords_dv=thr_dv.partition_C(cute.make_identity_tensor((self.tile_n, self.dv))),
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_q,
        mQ,
        tma_do,
        mdO,
        tma_k,
        mK,
        tma_v,
        mV,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdPsum: cute.Tensor,
        mLSElog2: cute.Tensor,
        sQ_layout,
        sdO_layout,
        sK_layout,
        sV_layout,
        sdS_layout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        n_block, kv_head, batch = cute.arch.block_idx()
        storage = SmemAllocator().allocate(self.shared_storage)
        smem = (
            storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner),
            storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
            storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner),
            storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner),
        )
        W = self.num_consumers
        pipes = (
            tma_pipeline(storage.bar_kv.data_ptr(), 1, self.kv_bytes, W),
            tma_pipeline(storage.bar_q.data_ptr(), self.q_stages, self.q_bytes, W),
            tma_pipeline(storage.bar_do.data_ptr(), self.q_stages, self.do_bytes, W),
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        m_min, m_max = Int32(0), cute.ceil_div(seqlen_q, self.tile_m)
        if cutlass.const_expr(self.key_queries.structural):
            m_min, m_max = self.key_queries.query_tiles_of_keys(n_block, seqlen_q, seqlen_k)
        where = (n_block, kv_head, batch, m_min, cutlass.max(m_max - m_min, 0))
        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp_idx == 0:
                self.produce(tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, smem, pipes, where)
        else:
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            ctidx = tidx - WARPGROUP_THREADS
            f = self.fragments(*smem, ctidx)
            self.consume(f, pipes, where, seqlen_q, seqlen_k, mdQaccum, mdPsum, mLSElog2)
            self.store_dk_dv(f, mdK, mdV, n_block, kv_head, batch, seqlen_k)

    @cute.jit
    def produce(self, tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, smem, pipes, where):
        """One warp: K and V once, then Q and dO of every step into the ring."""
        sQ, sdO, sK, sV, _ = smem
        pipe_kv, pipe_q, pipe_do = pipes
        n_block, kv_head, batch, m_min, count = where
        one = cute.make_layout(1)
        gK = cute.local_tile(mK[None, None, kv_head, batch], (self.tile_n, self.dqk), (None, 0))
        gV = cute.local_tile(mV[None, None, kv_head, batch], (self.tile_n, self.dv), (None, 0))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_kv.producer_acquire(kv_state)
        cute.copy(tma_k, tKg[None, n_block], tKs[None, 0], tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        cute.copy(tma_v, tVg[None, n_block], tVs[None, 0], tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        for step in cutlass.range(self.cfg.qhead_per_kvhead * count, unroll=1):
            head = kv_head * self.cfg.qhead_per_kvhead + step // count
            m_block = m_min + step % count
            gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.dqk), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head, batch], (self.tile_m, self.dv), (None, 0))
            tQs, tQg = cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
            tdOs, tdOg = cpasync.tma_partition(tma_do, 0, one, cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2))
            pipe_q.producer_acquire(state)
            cute.copy(tma_q, tQg[None, m_block], tQs[None, state.index], tma_bar_ptr=pipe_q.producer_get_barrier(state))
            pipe_do.producer_acquire(state)
            cute.copy(
                tma_do, tdOg[None, m_block], tdOs[None, state.index], tma_bar_ptr=pipe_do.producer_get_barrier(state)
            )
            state.advance()

    @cute.jit
    def consume(self, f: BwdFragments, pipes, where, seqlen_q, seqlen_k, mdQaccum, mdPsum, mLSElog2):
        """Both consumer warpgroups: every step of this CTA (dK and dV accumulate in ``f``)."""
        pipe_kv, pipe_q, pipe_do = pipes
        n_block, kv_head, batch, m_min, count = where
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        for step in cutlass.range(self.cfg.qhead_per_kvhead * count, unroll=1):
            head = kv_head * self.cfg.qhead_per_kvhead + step // count
            m_block = m_min + step % count
            self.scores_and_grads(
                f, pipe_q, pipe_do, state, (n_block, head, batch, m_block), seqlen_q, seqlen_k, mdPsum, mLSElog2
            )
            acc_dq = self.products(f, pipe_q, pipe_do, state)
            self.add_dq(f, acc_dq, mdQaccum, head, batch, m_block)
            state.advance()

    @cute.jit
    def column_values(self, table: cute.Tensor, batch: Int32, head: Int32, m_block: Int32, coords, row_shape):
        """This thread's columns' entries of a (B, H, Sq_pad) row table (LSE, dPsum), as one
        vector shaped like a row of the S^T view."""
        values = cute.make_rmem_tensor(cute.make_layout(row_shape), Float32)
        base = m_block * self.tile_m
        for c in cutlass.range_constexpr(cute.size(values)):
            values[c] = table[batch, head, base + coords[0, c][1]]
        return values.load()

    @cute.jit
    def scores_and_grads(self, f: BwdFragments, pipe_q, pipe_do, state, at, seqlen_q, seqlen_k, mdPsum, mLSElog2):
        """S^T and dP^T of one step, then P^T and dS^T into ``f.p`` / ``f.ds`` (and dS^T into sdS)."""
        n_block, head, batch, m_block = at
        acc_s = cute.make_rmem_tensor(f.coords_s.shape, Float32)
        acc_dp = cute.make_rmem_tensor(f.coords_s.shape, Float32)
        pipe_q.consumer_wait(state)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(f.tSrK, mode=[2])):
            mma = f.sdp_first if kb == 0 else f.sdp_rest
            cute.gemm(mma, acc_s, f.tSrK[None, None, kb, 0], f.tSrQ[None, None, kb, state.index], acc_s)
        warpgroup.commit_group()
        pipe_do.consumer_wait(state)
        for kb in cutlass.range_constexpr(cute.size(f.tPrV, mode=[2])):
            mma = f.sdp_first if kb == 0 else f.sdp_rest
            cute.gemm(mma, acc_dp, f.tPrV[None, None, kb, 0], f.tPrdO[None, None, kb, state.index], acc_dp)
        warpgroup.commit_group()
        scores, grads, coords = rows_cols_view(acc_s), rows_cols_view(acc_dp), rows_cols_view(f.coords_s)
        row_shape = scores[0, None].shape
        lse = self.column_values(mLSElog2, batch, head, m_block, coords, row_shape)
        offsets = column_offsets(coords, row_shape)
        first_col = m_block * self.tile_m + coords[0, 0][1]
        check_start = self.cfg.window_right is not None  # (the lowest query seeing a key is 0 otherwise)
        if cutlass.const_expr(self.cfg.softcap is None):
            warpgroup.wait_group(1)  # S^T is done; the exponentials run while dP^T finishes
            for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
                lo, hi = self.key_queries.key_query_range(n_block * self.tile_n + coords[r, 0][0], seqlen_q, seqlen_k)
                visible = visible_columns(offsets, first_col, lo, hi, check_start)
                probs = cute.math.exp2(scores[r, None].load() * Float32(self.cfg.scale_log2) - lse, fastmath=True)
                scores[r, None].store(cute.where(visible, probs, Float32(0.0)))
            warpgroup.wait_group(0)
            dpsum = self.column_values(mdPsum, batch, head, m_block, coords, row_shape)
            for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
                grads[r, None].store(scores[r, None].load() * (grads[r, None].load() - dpsum))
        else:
            warpgroup.wait_group(0)
            dpsum = self.column_values(mdPsum, batch, head, m_block, coords, row_shape)
            softcap = self.cfg.softcap
            for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
                lo, hi = self.key_queries.key_query_range(n_block * self.tile_n + coords[r, 0][0], seqlen_q, seqlen_k)
                visible = visible_columns(offsets, first_col, lo, hi, check_start)
                # the forward's score is softcap * tanh(s * scale / softcap); its derivative 1 - tanh^2
                t = cute.math.tanh(scores[r, None].load() * Float32(self.cfg.softmax_scale / softcap), fastmath=True)
                probs = cute.math.exp2(t * Float32(softcap * LOG2_E) - lse, fastmath=True)
                probs = cute.where(visible, probs, Float32(0.0))
                scores[r, None].store(probs)
                grads[r, None].store(probs * (grads[r, None].load() - dpsum) * (Float32(1.0) - t * t))
        store_as_operand_a(acc_s, f.p, pinned=False)
        store_as_operand_a(acc_dp, f.ds, pinned=False)
        # dS^T to shared memory for dQ, once both warpgroups' last dQ MMAs have read it
        cute.arch.barrier(barrier_id=int(BwdBarrier.DS_FREE), number_of_threads=self.num_consumers * WARPGROUP_THREADS)
        cute.copy(f.ds_copy, f.ds_source, f.ds_target)
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def products(self, f: BwdFragments, pipe_q, pipe_do, state):
        """dV += P^T.dO, dK += dS^T.Q, then dQ = dS.K once every dS row is in (returned); frees
        Q and dO."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(f.p, mode=[2])):
            cute.gemm(f.dkv, f.acc_dv, f.p[None, None, kb], f.tVrdO[None, None, kb, state.index], f.acc_dv)
        for kb in cutlass.range_constexpr(cute.size(f.ds, mode=[2])):
            cute.gemm(f.dk, f.acc_dk, f.ds[None, None, kb], f.tKrQ[None, None, kb, state.index], f.acc_dk)
        warpgroup.commit_group()
        cute.arch.barrier(barrier_id=int(BwdBarrier.DS_FULL), number_of_threads=self.num_consumers * WARPGROUP_THREADS)
        acc_dq = cute.make_rmem_tensor(f.thr_dq.partition_shape_C((self.tile_m, self.dqk)), Float32)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(f.tQrdS, mode=[2])):
            mma = f.dq_first if kb == 0 else f.dq_rest
            cute.gemm(mma, acc_dq, f.tQrdS[None, None, kb, 0], f.tQrK[None, None, kb, 0], acc_dq)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        pipe_q.consumer_release(state)
        pipe_do.consumer_release(state)
        return acc_dq

    @cute.jit
    def add_dq(self, f: BwdFragments, acc_dq, mdQaccum: cute.Tensor, head: Int32, batch: Int32, m_block: Int32):
        """This thread's dQ partials into the fp32 accumulator (whole padded tiles: no bounds)."""
        gdq = cute.local_tile(mdQaccum[batch, head, None, None], (self.tile_m, self.dqk), (m_block, 0))
        # the tile partitioned like the accumulator: one base address, a constant offset per element
        # (per-element coordinates would be hoisted out of the loop as 32 more live registers)
        targets = f.thr_dq.partition_C(gdq)
        for i in cutlass.range_constexpr(cute.size(acc_dq)):
            address = targets.iterator + cute.crd2idx(i, targets.layout)
            cute.arch.red(address, acc_dq[i], op="add", dtype="f32", sem="relaxed", scope="gpu")

    @cute.jit
    def store_dk_dv(self, f: BwdFragments, mdK, mdV, n_block: Int32, kv_head: Int32, batch: Int32, seqlen_k: Int32):
        """dK (times softmax_scale) and dV of this thread's keys, rounded, below Sk."""
        where = (n_block * self.tile_n, kv_head, batch, seqlen_k)
        self._store_rows(f.acc_dk, f.coords_dk, mdK, where, self.cfg.head_dim, self.cfg.softmax_scale)
        self._store_rows(f.acc_dv, f.coords_dv, mdV, where, self.cfg.head_dim_v, 1.0)

    @cute.jit
    def _store_rows(self, acc, coords, out, where, width: int, scale: float):
        first_key, kv_head, batch, seqlen_k = where
        for i in cutlass.range_constexpr(cute.size(acc)):
            key, col = coords[i]
            value = acc[i] if cutlass.const_expr(scale == 1.0) else acc[i] * Float32(scale)
            if first_key + key < seqlen_k:
                if col < width:  # (the padded head dim's columns are not stored)
                    out[batch, first_key + key, kv_head, col] = value.to(out.element_type)
