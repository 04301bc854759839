"""Hopper (sm_90a) attention backward: dQ, dK, dV from Q, K, V, O, dO and the forward's LSE.

Three launches on one stream (``__call__``): the preprocess (bwd_prepost: dPsum = rowsum(dO * O),
the LSE in log2 units, dQ's fp32 accumulator zeroed), the main kernel below, and the
postprocess (dQ scaled and rounded).

Main kernel: one CTA per (key tile, KV head, batch). Warpgroup 0 is the producer (one warp: TMA
loads of K and V once, then per step a query tile's Q and dO, with their rows' LSE and dPsum,
into a ring of ``q_stages``); warpgroups 1..2 are consumers, each owning its part of the tile's
dK and dV (64 keys each of a 128-key tile up to d128; past it, half the head-dim columns of a
64-key tile, or computed transposed 48 keys each of a 96-key tile: Sm90BwdConfig.dkv_split),
which stay in registers over every step: the KV head's
query heads (so GQA needs no reduction across CTAs: dK and dV are written once,
deterministically) times the query tiles that see the key tile (from the mask's structure, a
table of packed documents' query rows, or an expression mask's backward block mask). A step
(bwd_step.py) runs S^T and dP^T, the probabilities and dS^T, dV += P^T.dO and dK += dS^T.Q from
registers, dQ = dS.K through shared memory, and hands dQ to a TMA reduce-add into the fp32
accumulator in global memory (the only cross-CTA sum) that runs on during the next step: issued
by a consumer warp, or with ``dq_writer`` by warp 1 of warpgroup 0, the dQ writer; a
deterministic backward's writer adds each query tile's dQ in a fixed key-tile order (bwd_step.py).

Everything tile-shaped is a compile-time constant of Sm90BwdConfig; batch, heads and sequence
lengths are run-time values.
"""

from __future__ import annotations

from typing import Callable, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from fa4gen.arch import WARPGROUP_THREADS, WGMMA_M
from fa4gen.kernels.common.masking import KeyTileRange
from fa4gen.kernels.common.variant import VariantArgs
from fa4gen.kernels.sm90.bwd_config import KeyTileOrder, Sm90BwdConfig, bwd_config_problem
from fa4gen.kernels.sm90.bwd_grads import Sm90BwdGrads
from fa4gen.kernels.sm90.bwd_prepost import Sm90BwdPrePost
from fa4gen.kernels.sm90.bwd_step import BwdSmem, Sm90BwdStep
from fa4gen.kernels.sm90.producer import tma_pipeline

SMEM_ALIGN = 1024
PREPOST_THREADS = WARPGROUP_THREADS
ROW_ALIGN = 128  # TMA destinations of the LSE and dPsum rows


class HopperAttentionBackward(Sm90BwdPrePost, Sm90BwdStep, Sm90BwdGrads):
    """One compiled backward; ``config`` is the planner's Sm90BwdConfig."""

    def __init__(
        self,
        config: Sm90BwdConfig,
        score_grad: Optional[Callable] = None,
        mask_mod: Optional[Callable] = None,
        aux_grad: Optional[tuple] = None,
    ):
        problem = bwd_config_problem(config)
        assert not problem, problem
        assert (score_grad is not None) == config.score_mod, "a score modifier comes with its score_grad"
        assert (mask_mod is not None) == config.expression_mask, "an expression mask comes with its mask_mod"
        assert (aux_grad is not None) == bool(config.aux_grads), "trainable tensors come with their aux_grad"
        self.cfg = config
        # (value, d value / d scaled score) of the variant's score modifier, and the expression
        # mask (b, h, q_idx, kv_idx, Sq, Sk, args) -> visible, from the emitted module
        self.score_grad, self.mask_mod = score_grad, mask_mod
        # trainable tensors: (derivatives per read, an adder per read, whether a read's element
        # is the same over a step), from the emitted module
        self.aux_grad = aux_grad
        self.dqk, self.dv = config.head_dim_padded, config.head_dim_v_padded
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.num_consumers = config.num_consumer_warpgroups
        self.q_stages, self.dq_stages = config.q_stages, config.dq_stages
        # the mask read per key: the query rows that see it (masking.key_query_range)
        self.key_queries = KeyTileRange(
            self.tile_m,
            self.tile_n,
            config.window_left,
            config.window_right,
            config.chunk,
            config.prefix_lm,
            document=config.document,
        )
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
        mdQaccum: cute.Tensor,  # (B, Hq, dQ groups x Sq_pad, D_pad) fp32 workspace
        mdPsum: cute.Tensor,  # (B, Hq, Sq_pad) fp32 workspace
        mLSElog2: cute.Tensor,  # (B, Hq, Sq_pad) fp32 workspace
        mdQorder: cute.Tensor,  # (B, Hq, dQ groups x m_blocks, W) int32: dQ's turns, deterministic
        mdKaccum: cute.Tensor,  # (B, Sk_pad, Hkv, D_pad) fp32, zeroed: dK's partial sums when split
        mdVaccum: cute.Tensor,  # (B, Sk_pad, Hkv, Dv_pad) fp32, zeroed: dV's
        head_splits: Int32,  # CTAs per KV head and key tile, each with its share of the query heads
        key_tile_order: Int32,  # the launch order of key tiles (KeyTileOrder; backward.key_tile_order)
        extras: tuple,
        stream: cuda.CUstream,
    ):
        self.dtype = mQ.element_type
        layouts = self._smem_layouts(self.dtype)
        tmas = self._tma_atoms(mQ, mK, mV, mdO, mdQaccum, mdPsum, mLSElog2, layouts)
        sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout = layouts
        rows = self.tile_m * self.q_stages
        # P beside dS, except with dkv_split m (no bytes then: P^T stays in registers)
        p_elems = cute.cosize(sdS_layout) if self.cfg.dkv_split != "m" else 0

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
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], SMEM_ALIGN]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], SMEM_ALIGN]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, rows], ROW_ALIGN]
            sdPsum: cute.struct.Align[cute.struct.MemRange[Float32, rows], ROW_ALIGN]

        self.shared_storage = SharedStorage
        batches, seqlen_q, heads_q = mQ.shape[0], mQ.shape[1], mQ.shape[2]
        m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        self.preprocess(mO, mdO, mLSE, mdLSE, mdPsum, mLSElog2, mdQaccum, mdQorder).launch(
            grid=(m_blocks, heads_q, batches), block=[PREPOST_THREADS, 1, 1], stream=stream
        )
        grid_order = (head_splits, key_tile_order)
        key_tiles, groups = cute.ceil_div(mK.shape[1], self.tile_n), mK.shape[2] * head_splits
        outer = key_tile_order == int(KeyTileOrder.OUTERMOST)
        self.kernel(*tmas, mdQorder, (mdK, mdV, mdKaccum, mdVaccum), grid_order, extras, *layouts).launch(
            grid=(
                Int32(cutlass.select_(outer, groups * batches, key_tiles)),
                Int32(cutlass.select_(outer, key_tiles, groups)),
                Int32(cutlass.select_(outer, 1, batches)),
            ),
            block=[self.threads, 1, 1],
            smem=self.shared_storage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )
        self.postprocess(mdQaccum, mdQ).launch(
            grid=(m_blocks, heads_q, batches), block=[PREPOST_THREADS, 1, 1], stream=stream
        )

    def _tma_atoms(self, mQ, mK, mV, mdO, mdQaccum, mdPsum, mLSElog2, layouts) -> tuple:
        """(atom, its tensor) of every TMA: loads of Q, dO, K, V (as (S, D, H, B) views) and of the
        rows' LSE and dPsum ((Sq_pad, H, B)), and dQ's reduce-add, one box per warpgroup
        ((Sq_pad, D_pad, H, B)); records the bytes each load pipeline's stage receives."""
        sQ_layout, sdO_layout, sK_layout, sV_layout, _, _ = layouts
        q, k, v, do = (
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])) for t in (mQ, mK, mV, mdO)
        )
        lse, dpsum = (cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0])) for t in (mLSElog2, mdPsum))
        dq = cute.make_tensor(mdQaccum.iterator, cute.select(mdQaccum.layout, mode=[2, 3, 1, 0]))
        g2s, stage = cpasync.CopyBulkTensorTileG2SOp(), (None, None, 0)
        rows = cute.make_layout(self.tile_m)
        tmas = (
            cpasync.make_tiled_tma_atom(g2s, q, cute.slice_(sQ_layout, stage), (self.tile_m, self.dqk)),
            cpasync.make_tiled_tma_atom(g2s, do, cute.slice_(sdO_layout, stage), (self.tile_m, self.dv)),
            cpasync.make_tiled_tma_atom(g2s, k, cute.slice_(sK_layout, stage), (self.tile_n, self.dqk)),
            cpasync.make_tiled_tma_atom(g2s, v, cute.slice_(sV_layout, stage), (self.tile_n, self.dv)),
            cpasync.make_tiled_tma_atom(g2s, lse, rows, (self.tile_m,)),
            cpasync.make_tiled_tma_atom(g2s, dpsum, rows, (self.tile_m,)),
            cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), dq, self._dq_layout(self._dq_box()), self._dq_box()
            ),
        )
        row_bytes = self.tile_m * Float32.width // 8
        self.q_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sQ_layout, stage)) + row_bytes
        self.do_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sdO_layout, stage)) + row_bytes
        self.kv_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, stage)) + cute.size_in_bytes(
            self.dtype, cute.slice_(sV_layout, stage)
        )
        return tmas

    def _smem_layout(self, dtype, rows: int, cols: int, stages: int, major: int):
        """(rows, cols, stages), cols contiguous, in swizzle atoms ``major`` columns wide or
        narrower: the widest that the narrowest slice any MMA takes of the columns allows (an
        MMA reading the buffer transposed, or a warpgroup's share of it, starts on an atom)."""
        kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, major)
        atom = warpgroup.make_smem_layout_atom(kind, dtype)
        return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))

    def _smem_layouts(self, dtype):
        """Q and dO: read as S^T / dP^T's B operand and, transposed, dK / dV's (split over the
        warpgroups by head dim with dkv_split n); K: S^T's A operand and, transposed, dQ's B
        (split by head dim with dq_split n); V: dP^T's A; dS (and P with dkv_split n): dQ's A,
        written transposed, and transposed dK's (dV's) A with dkv_split n; dQ's fp32 staging
        (``_dq_layout``)."""
        k_major = self.dqk // self.num_consumers if self.cfg.dq_split == "n" else self.dqk
        ways, t = self.cfg.dkv_ways, self.cfg.transposed
        return (
            self._smem_layout(dtype, self.tile_m, self.dqk, self.q_stages, self.dqk // ways),
            self._smem_layout(dtype, self.tile_m, self.dv, self.q_stages, self.dv // ways),
            self._smem_layout(dtype, self.tile_n, self.dqk, 1, k_major),
            self._smem_layout(dtype, self.tile_n, self.dv, 1, self.dv),
            # (t: dK^T's and dV^T's B operands, each warpgroup's keys read MN-major from their first)
            self._smem_layout(dtype, self.tile_m, self.tile_n, 1, self.cfg.keys_per_warpgroup if t else self.tile_n),
            self._dq_layout((self.tile_m, self.dqk, self.dq_stages)),
        )

    def _dq_box(self) -> tuple[int, int]:
        """One warpgroup's share of dQ: 64 rows x its columns (dq_split n) or all (m)."""
        return (WGMMA_M, self.dqk // self.num_consumers if self.cfg.dq_split == "n" else self.dqk)

    def _dq_layout(self, shape: tuple):
        """fp32 dQ staging of ``shape`` in swizzle atoms as wide as a warpgroup's box allows,
        ordered so each warpgroup's box is one compact run of atoms (what its TMA reads)."""
        kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, Float32, self._dq_box()[1])
        atom = warpgroup.make_smem_layout_atom(kind, Float32)
        order = (0, 1, 2) if self.cfg.dq_split == "n" else (1, 0, 2)
        return cute.tile_to_shape(atom, shape, order=order[: len(shape)])

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_q,
        tma_do,
        tma_k,
        tma_v,
        tma_lse,
        tma_dpsum,
        tma_dq,
        dq_order: cute.Tensor,
        outputs: tuple,
        grid_order: tuple,
        extras: tuple,
        sQ_layout,
        sdO_layout,
        sK_layout,
        sV_layout,
        sdS_layout,
        sdQ_layout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        head_splits, key_tile_order = grid_order
        n_block, split_head, batch = self._grid_coords(key_tile_order, head_splits, tma_k[1].shape)
        # a KV head's query heads may be shared out over head_splits CTAs (the runtime's choice,
        # where one CTA per KV head leaves SMs idle); their dK and dV partials are then summed
        kv_head, split = split_head // head_splits, split_head % head_splits
        heads = self.cfg.qhead_per_kvhead // head_splits
        storage = SmemAllocator().allocate(self.shared_storage)
        rows = cute.make_layout((self.tile_m, self.q_stages))
        smem = BwdSmem(
            q=storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            do=storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner),
            k=storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
            v=storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner),
            ds=storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner),
            p=storage.sP.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner) if self.cfg.dkv_split != "m" else None,
            dq=storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner),
            lse=storage.sLSE.get_tensor(rows),
            dpsum=storage.sdPsum.get_tensor(rows),
        )
        W = self.num_consumers
        pipes = (
            tma_pipeline(storage.bar_kv.data_ptr(), 1, self.kv_bytes, W),
            tma_pipeline(storage.bar_q.data_ptr(), self.q_stages, self.q_bytes, W),
            tma_pipeline(storage.bar_do.data_ptr(), self.q_stages, self.do_bytes, W),
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        seqlen_q, seqlen_k = tma_q[1].shape[0], tma_k[1].shape[0]
        args = VariantArgs(self.cfg.extra_names, extras)
        m_min, m_max = Int32(0), cute.ceil_div(seqlen_q, self.tile_m)
        if cutlass.const_expr(self.cfg.expression_mask):  # the block mask lists the query tiles
            m_max = args.bwd_block_count[self._mask_coords(n_block, kv_head, batch, args)]
        elif cutlass.const_expr(self.key_queries.structural):
            m_min, m_max = self.key_queries.query_tiles_of_keys(n_block, batch, seqlen_q, seqlen_k, args)
        first_head = kv_head * self.cfg.qhead_per_kvhead + split * heads
        where = (n_block, kv_head, batch, m_min, cutlass.max(m_max - m_min, 0), first_head, heads)
        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp_idx == 0:
                self.produce((tma_q, tma_do, tma_k, tma_v, tma_lse, tma_dpsum), smem, pipes, where, args)
            if cutlass.const_expr(self.cfg.dq_writer):
                if warp_idx == 1:
                    self.write_dq(smem, tma_dq, dq_order, where, (seqlen_q, seqlen_k, args))
        else:
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            f = self.fragments(smem, tidx - WARPGROUP_THREADS)
            self.consume(f, smem, pipes, where, tma_dq, (seqlen_q, seqlen_k, args))
            self.store_dk_dv(f, outputs, head_splits, (n_block, kv_head, batch), seqlen_k)

    @cute.jit
    def _grid_coords(self, key_tile_order: Int32, head_splits: Int32, k_shape):
        """(key tile, KV head x head split, batch) of this CTA under the launch order of key tiles
        (``k_shape``: the keys' (Sk, D, Hkv, B))."""
        x, y, z = cute.arch.block_idx()
        n_block, split_head, batch = x, y, z
        if key_tile_order == int(KeyTileOrder.OUTERMOST):
            groups = k_shape[2] * head_splits
            n_block, split_head, batch = y, x % groups, x // groups
        if cutlass.const_expr(self.cfg.deterministic and self.cfg.dq_descending):
            if key_tile_order == int(KeyTileOrder.REVERSED):
                n_block = cute.ceil_div(k_shape[0], self.tile_n) - 1 - n_block
        return n_block, split_head, batch

    @cute.jit
    def _mask_coords(self, n_block: Int32, kv_head: Int32, batch: Int32, args):
        """(batch, head, key tile) of this CTA in the backward block mask, whose batch and head
        extents are 1 where the mask does not read b or h."""
        sizes = args.bwd_block_count.shape
        return cutlass.min(batch, sizes[0] - 1), cutlass.min(kv_head, sizes[1] - 1), n_block

    @cute.jit
    def query_tile(self, where, j: Int32, args) -> Int32:
        """The query tile of this CTA's j-th step of a query head."""
        n_block, kv_head, batch, m_min, _, _, _ = where
        m_block = m_min + j
        if cutlass.const_expr(self.cfg.expression_mask):
            b, h, n = self._mask_coords(n_block, kv_head, batch, args)
            m_block = args.bwd_block_index[b, h, n, j]
        return m_block

    @cute.jit
    def _exact(self, where, j: Int32, args):
        """Whether the j-th step's tile needs the expression mask evaluated per score (some pair
        of it hidden); False without an expression mask."""
        exact = False
        if cutlass.const_expr(self.cfg.expression_mask):
            n_block, kv_head, batch, _, _, _, _ = where
            b, h, n = self._mask_coords(n_block, kv_head, batch, args)
            exact = args.bwd_block_full[b, h, n, j] == 0
        return exact

    @cute.jit
    def dq_turn(self, where, j: Int32, m_block: Int32, sizes) -> Int32:
        """How many key tiles add into query tile ``m_block``'s dQ before this CTA's (deterministic)."""
        n_block, kv_head, batch, _, _, _, _ = where
        seqlen_q, seqlen_k, args = sizes
        if cutlass.const_expr(self.cfg.expression_mask):
            b, h, n = self._mask_coords(n_block, kv_head, batch, args)
            turn = args.bwd_block_turn[b, h, n, j]
        elif cutlass.const_expr(self.cfg.dq_descending):
            turn = self.key_queries.key_tiles_after(n_block, m_block, batch, seqlen_q, seqlen_k, args)
        else:
            turn = self.key_queries.key_tiles_before(n_block, m_block, batch, seqlen_q, seqlen_k, args)
        return turn

    @cute.jit
    def produce(self, tmas, smem: BwdSmem, pipes, where, args):
        """One warp: K and V once, then each step's Q with its rows' LSE and dO with their dPsum."""
        (tma_q, mQ), (tma_do, mdO), (tma_k, mK), (tma_v, mV), (tma_lse, mLSE), (tma_dpsum, mdPsum) = tmas
        pipe_kv, pipe_q, pipe_do = pipes
        n_block, kv_head, batch, m_min, count, first_head, heads = where
        tKs, tKg = self._tma_parts(tma_k, mK[None, None, kv_head, batch], smem.k, (self.tile_n, self.dqk))
        tVs, tVg = self._tma_parts(tma_v, mV[None, None, kv_head, batch], smem.v, (self.tile_n, self.dv))
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_kv.producer_acquire(kv_state)
        cute.copy(tma_k, tKg[None, n_block, 0], tKs[None, 0], tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        cute.copy(tma_v, tVg[None, n_block, 0], tVs[None, 0], tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        for step in cutlass.range(heads * count, unroll=1):
            head = first_head + step // count
            m_block = self.query_tile(where, step % count, args)
            tQs, tQg = self._tma_parts(tma_q, mQ[None, None, head, batch], smem.q, (self.tile_m, self.dqk))
            tdOs, tdOg = self._tma_parts(tma_do, mdO[None, None, head, batch], smem.do, (self.tile_m, self.dv))
            tLs, tLg = self._tma_parts(tma_lse, mLSE[None, head, batch], smem.lse, (self.tile_m,))
            tPs, tPg = self._tma_parts(tma_dpsum, mdPsum[None, head, batch], smem.dpsum, (self.tile_m,))
            pipe_q.producer_acquire(state)
            q_bar = pipe_q.producer_get_barrier(state)
            cute.copy(tma_q, tQg[None, m_block, 0], tQs[None, state.index], tma_bar_ptr=q_bar)
            cute.copy(tma_lse, tLg[None, m_block], tLs[None, state.index], tma_bar_ptr=q_bar)
            pipe_do.producer_acquire(state)
            do_bar = pipe_do.producer_get_barrier(state)
            cute.copy(tma_do, tdOg[None, m_block, 0], tdOs[None, state.index], tma_bar_ptr=do_bar)
            cute.copy(tma_dpsum, tPg[None, m_block], tPs[None, state.index], tma_bar_ptr=do_bar)
            state.advance()

    def _tma_parts(self, atom, tensor, buffer, tile: tuple):
        """(smem, gmem) TMA partitions of ``tensor``'s tiles of shape ``tile`` into ``buffer``'s
        stages (the gmem side indexed by tile coordinates)."""
        modes = len(tile)
        tiles = cute.local_tile(tensor, tile, (None,) * modes)
        return cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(buffer, 0, modes), cute.group_modes(tiles, 0, modes)
        )

    @cute.jit
    def consume(self, f, smem: BwdSmem, pipes, where, tma_dq, sizes):
        """Both consumer warpgroups: every step of this CTA (dK and dV accumulate in ``f``);
        ``tma_dq``: dQ's reduce-add TMA; ``sizes``: (Sq, Sk, the variant's run-time values)."""
        pipe_kv, pipe_q, pipe_do = pipes
        n_block, kv_head, batch, m_min, count, first_head, heads = where
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        steps = heads * count
        args = sizes[2]
        for step in cutlass.range(steps, unroll=1):
            head = first_head + step // count
            m_block = self.query_tile(where, step % count, args)
            at = (n_block, head, batch, m_block, self._exact(where, step % count, args))
            self.scores_and_grads(f, smem, pipe_q, pipe_do, state, at, sizes)
            if cutlass.const_expr(self.cfg.dkv_split != "m"):
                acc_dq = self.products_by_columns(f, pipe_q, pipe_do, state)
            else:
                acc_dq = self.products(f, pipe_do, state)
            self.stage_dq(f, smem, acc_dq, tma_dq, (head, batch, m_block), step % self.dq_stages)
            if cutlass.const_expr(self.cfg.dkv_split == "m"):
                self.dk_done(pipe_q, state)
            state.advance()
        self.dq_stores_done(f)
