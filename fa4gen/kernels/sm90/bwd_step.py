"""One step of the Hopper backward's consumer warpgroups (a mixin of bwd.HopperAttentionBackward):
a query tile of one query head against the CTA's key tile, every MMA spanning both warpgroups.

1. S^T = K.Q^T and dP^T = V.dO^T (keys on the MMA's M side, so the probabilities are already
   the A operand of dV's product: FA3/FA4's SdP_swapAB); split over the warpgroups by keys, or,
   with dkv_split n (head dims past 128: both warpgroups share 64 keys), by query rows;
2. P^T = exp2(S^T * scale_log2 - LSE_log2) with the mask, dS^T = P^T * (dP^T - dPsum); with a
   soft cap or a score modifier, P^T from the modified score and dS^T times its derivative
   (the modifier's ``score_grad``, derived from its expression by fa4gen.expr_grad); an
   expression mask zeroes both where ``mask_mod`` hides a pair (in partly visible tiles only);
   the rows' LSE and dPsum come from shared memory, loaded with Q and dO;
3. dV += P^T.dO and dK += dS^T.Q, both A operands from registers; with dkv_split n each
   warpgroup's product covers its half of the head-dim columns over every query row, so P^T and
   dS^T come from shared memory, where both warpgroups wrote their rows;
4. dS^T through shared memory (a transposing stmatrix) for dQ = dS.K;
5. dQ staged in fp32 shared memory (``dq_stages`` buffers) and added into the accumulator in
   global memory by one TMA reduce-add per warpgroup's share, which runs on during the next step:
   issued by each warpgroup's first warp, or (``dq_writer``) handed by named barrier to the dQ
   writer warp of the producer warpgroup, which gives the buffer back once read. Deterministic
   (always with the writer, whose waits then stall no MMA), each query tile's share takes the key
   tiles' sums in a fixed order (descending under a right bound, whose higher key tiles reach a
   query tile first and launch first; else ascending: Sm90BwdConfig.dq_descending): a semaphore
   per (query tile, share) counts the tiles added, and a key tile passes its turn once its sum
   has landed. With dq_grouped_turns the turns at a query tile are dealt round-robin over the
   run-time count of dQ groups (the workspaces' extent: backward.dq_groups), each summed into its own partial
   accumulator (a virtual query tile g x m_blocks + m_block) with its own semaphore, so the
   chain of turns is 1/groups as long; the postprocess adds the partials in group order.

With dkv_split t (Sm90BwdConfig.transposed) every product but dQ's puts the keys on the N side,
each warpgroup owning half of them: S = Q.K^T and dP = dO.V^T (query rows on M), P and dS to
shared memory untransposed, dV^T += dO^T.P and dK^T += Q^T.dS (dO and Q the A operands, read
MN-major; P and dS the B operands). The scores' probabilities and gradients: bwd_grads.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from fa4gen.arch import WARP_THREADS, WARPGROUP_THREADS, WGMMA_M
from fa4gen.kernels.common.layout import rows_cols_view, store_as_operand_a


class BwdBarrier(enum.IntEnum):
    """Named barriers of the consumer warpgroups (0 is __syncthreads)."""

    DS_FULL = 1  # both warpgroups have written this step's dS; their dQ staging buffers are free
    DQ_FULL = 2  # both warpgroups' dQ is staged (and their dQ MMAs have read dS)
    # with the dQ writer warp, per staging buffer (id + stage): the consumers hand it a staged dQ,
    # it hands the buffer back once its reduce-adds have read it
    DQ_STAGED = 3
    DQ_EMPTY = 5


@dataclass(frozen=True)
class BwdSmem:
    """The CTA's shared-memory buffers."""

    q: Any  # (tile_m, D, q_stages)
    do: Any  # (tile_m, Dv, q_stages)
    k: Any  # (tile_n, D, 1)
    v: Any  # (tile_n, Dv, 1)
    ds: Any  # (tile_m, tile_n, 1)
    p: Any  # (tile_m, tile_n, 1): P, except with dkv_split m (None)
    dq: Any  # (tile_m, D, dq_stages) fp32
    lse: Any  # (tile_m, q_stages) fp32, log2 units
    dpsum: Any  # (tile_m, q_stages) fp32


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
    tSrK: Any  # S^T: K (A) and Q (B); transposed, S: Q (A) and K (B)
    tSrQ: Any
    tPrV: Any  # dP^T: V (A) and dO (B); transposed, dP: dO (A) and V (B)
    tPrdO: Any
    tVrdO: Any  # dV: dO^T (B); transposed, dV^T: dO^T (A)
    tKrQ: Any  # dK: Q^T (B); transposed, dK^T: Q^T (A)
    tQrdS: Any  # dQ: dS (A) and K^T (B)
    tQrK: Any
    p: Any  # P^T and dS^T (P and dS, transposed) rounded to 16 bits (in registers)
    ds: Any
    p_operand: Any  # dV's and dK's operands: p and ds (dkv_split m, A) or their shared-memory copies (n: A; t: B)
    ds_operand: Any
    ds_copy: Any  # stmatrix of dS^T into sdS (and P^T into sP with dkv_split n): the copy, its
    ds_source: Any  # source views of ds and p, their targets
    ds_target: Any
    p_source: Any
    p_target: Any
    acc_dk: Any
    acc_dv: Any
    coords_s: Any  # (key, query) of each S^T element in the tile; transposed, (query, key) of S's
    thr_dq: Any  # this thread's part of dQ's MMA
    coords_dk: Any  # (key, column) of each dK and dV element in the tile; transposed, (column, key)
    coords_dv: Any
    warpgroup: Any  # this thread's consumer warpgroup (0-based), its index and its warp's in it
    wtidx: Any
    warp: Any


class Sm90BwdStep:
    """Needs cfg, dtype, dqk, dv, tile_m, tile_n, num_consumers, dq_stages, key_queries,
    mask_mod, score_grad, _dq_box(), query_tile() and dq_turn()."""

    def _mma(self, a_major, b_major, atoms, tiler, accumulate: bool, a_registers: bool = False) -> cute.TiledMma:
        source = warpgroup.OperandSource.RMEM if a_registers else warpgroup.OperandSource.SMEM
        mma = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, a_major, b_major, Float32, atoms, tiler, source)
        mma.set(warpgroup.Field.ACCUMULATE, accumulate)
        return mma

    @cute.jit
    def fragments(self, smem: BwdSmem, ctidx: Int32) -> BwdFragments:
        """The MMAs over both consumer warpgroups (``ctidx``: 0..255) and this thread's parts."""
        K, MN = OperandMajorMode.K, OperandMajorMode.MN
        W = self.num_consumers
        split, sdp_tiler, a_major, dv_tiler, dk_tiler = self._dkv_tiling()
        transposed = self.cfg.transposed
        sdp_first = self._mma(K, K, split, sdp_tiler, False)
        thr_sdp = sdp_first.get_slice(ctidx)
        # (t: dV^T's and dK^T's A operands are dO^T and Q^T, B the shared P and dS; else A is P^T
        # and dS^T, from registers with dkv_split m)
        b_major = MN
        dkv = self._mma(a_major, b_major, split, dv_tiler, True, a_registers=self.cfg.dkv_split == "m")
        dk = self._mma(a_major, b_major, split, dk_tiler, True, a_registers=self.cfg.dkv_split == "m")
        thr_dv, thr_dk = dkv.get_slice(ctidx), dk.get_slice(ctidx)
        if cutlass.const_expr(self.cfg.dq_split == "m"):
            dq_atoms, dq_tiler = (W, 1, 1), (WGMMA_M, self.dqk)
        else:
            dq_atoms, dq_tiler = (1, W, 1), (WGMMA_M, self.dqk // W)
        dq_first = self._mma(K, MN, dq_atoms, dq_tiler, False)
        thr_dq = dq_first.get_slice(ctidx)
        # transposed views of the same buffers (a K-major atom read transposed is an MN-major one)
        sQt, sdOt, sKt, sdSt = (
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0, 2]))
            for t in (smem.q, smem.do, smem.k, smem.ds)
        )
        # S's and dP's operands: (A, B) = (K, Q) and (V, dO) for S^T, (Q, K) and (dO, V) for S
        s_ops, dp_ops = ((smem.q, smem.k), (smem.do, smem.v)) if transposed else ((smem.k, smem.q), (smem.v, smem.do))
        # dS (and P) into shared memory: S's accumulators as they are, S^T's transposed
        store_major = LayoutEnum.ROW_MAJOR if transposed else LayoutEnum.COL_MAJOR
        ds_copy = cute.make_tiled_copy_C(sm90_utils.get_smem_store_op(store_major, self.dtype, Float32), sdp_first)
        thr_copy = ds_copy.get_slice(ctidx)
        s_shape = thr_sdp.partition_shape_C(self._s_tile())
        p, ds, p_operand, ds_operand, p_source, p_target = self._probability_operands(
            smem, (thr_dv, thr_dk, thr_copy), s_shape, sdSt
        )
        ds_smem = smem.ds if transposed else sdSt
        dk_tile, dv_tile = self._dkv_tiles()
        acc_dk = thr_dk.make_fragment_C(thr_dk.partition_shape_C(dk_tile))
        acc_dv = thr_dv.make_fragment_C(thr_dv.partition_shape_C(dv_tile))
        acc_dk.fill(0.0)
        acc_dv.fill(0.0)
        # dV's and dK's operands from Q and dO: B (dO^T, Q^T) or, transposed, A (dO^T, Q^T read MN-major)
        if cutlass.const_expr(transposed):
            tVrdO = thr_dv.make_fragment_A(thr_dv.partition_A(sdOt))
            tKrQ = thr_dk.make_fragment_A(thr_dk.partition_A(sQt))
        else:
            tVrdO = thr_dv.make_fragment_B(thr_dv.partition_B(sdOt))
            tKrQ = thr_dk.make_fragment_B(thr_dk.partition_B(sQt))
        return BwdFragments(
            sdp_first=sdp_first,
            sdp_rest=self._mma(K, K, split, sdp_tiler, True),
            dkv=dkv,
            dk=dk,
            dq_first=dq_first,
            dq_rest=self._mma(K, MN, dq_atoms, dq_tiler, True),
            tSrK=thr_sdp.make_fragment_A(thr_sdp.partition_A(s_ops[0])),
            tSrQ=thr_sdp.make_fragment_B(thr_sdp.partition_B(s_ops[1])),
            tPrV=thr_sdp.make_fragment_A(thr_sdp.partition_A(dp_ops[0])),
            tPrdO=thr_sdp.make_fragment_B(thr_sdp.partition_B(dp_ops[1])),
            tVrdO=tVrdO,
            tKrQ=tKrQ,
            tQrdS=thr_dq.make_fragment_A(thr_dq.partition_A(smem.ds)),
            tQrK=thr_dq.make_fragment_B(thr_dq.partition_B(sKt)),
            p=p,
            ds=ds,
            p_operand=p_operand,
            ds_operand=ds_operand,
            ds_copy=ds_copy,
            ds_source=thr_copy.retile(cute.make_tensor(ds.iterator, cute.make_layout(s_shape))),
            ds_target=thr_copy.partition_D(ds_smem[None, None, 0]),
            p_source=p_source,
            p_target=p_target,
            acc_dk=acc_dk,
            acc_dv=acc_dv,
            coords_s=thr_sdp.partition_C(cute.make_identity_tensor(self._s_tile())),
            thr_dq=thr_dq,
            coords_dk=thr_dk.partition_C(cute.make_identity_tensor(dk_tile)),
            coords_dv=thr_dv.partition_C(cute.make_identity_tensor(dv_tile)),
            warpgroup=cute.arch.make_warp_uniform(ctidx // WARPGROUP_THREADS),
            wtidx=ctidx % WARPGROUP_THREADS,
            warp=cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4,
        )

    def _s_tile(self) -> tuple[int, int]:
        """The score tile as the step computes it: (query rows, keys) for S, (keys, query rows) for S^T."""
        return (self.tile_m, self.tile_n) if self.cfg.transposed else (self.tile_n, self.tile_m)

    def _dkv_tiles(self) -> tuple:
        """dK's and dV's accumulator tiles: (keys, columns), or (columns, keys) transposed."""
        if self.cfg.transposed:
            return (self.dqk, self.tile_n), (self.dv, self.tile_n)
        return (self.tile_n, self.dqk), (self.tile_n, self.dv)

    def _dkv_tiling(self) -> tuple:
        """(warpgroup layout, S^T's (or S's) tiler, dV's and dK's A major mode, dV's tiler, dK's tiler)."""
        K, MN = OperandMajorMode.K, OperandMajorMode.MN
        W = self.num_consumers
        if self.cfg.dkv_split == "t":
            # the warpgroups split the keys on every MMA's N side: S and dP (query rows on M),
            # dV^T and dK^T (head-dim columns on M, A = dO^T and Q^T read MN-major)
            keys = self.cfg.keys_per_warpgroup
            return (1, W, 1), (WGMMA_M, keys), MN, (WGMMA_M, keys), (WGMMA_M, keys)
        if self.cfg.dkv_split == "n":
            # the 64 keys shared: S^T split by query rows, dK and dV by head-dim columns, their
            # A operands (P^T, dS^T) read transposed from shared memory
            return (1, W, 1), (WGMMA_M, self.tile_m // W), MN, (WGMMA_M, self.dv // W), (WGMMA_M, self.dqk // W)
        # the key rows split over the warpgroups
        return (W, 1, 1), (WGMMA_M, self.tile_m), K, (WGMMA_M, self.dv), (WGMMA_M, self.dqk)

    def _probability_operands(self, smem: BwdSmem, parts, s_shape, sdSt):
        """P^T and dS^T (P and dS, transposed) rounded to 16 bits (registers) and dV's and dK's
        operands from them: the same registers (dkv_split m, A), or their shared-memory copies,
        with the stmatrix source and target of P's (n: A read transposed; t: B; dS's source and
        target are made by the caller for dQ either way)."""
        thr_dv, thr_dk, thr_copy = parts
        p_source, p_target = None, None
        if self.cfg.dkv_split == "m":
            p = cute.make_rmem_tensor(thr_dv.partition_shape_A((self.tile_n, self.tile_m)), self.dtype)
            ds = cute.make_rmem_tensor(thr_dk.partition_shape_A((self.tile_n, self.tile_m)), self.dtype)
            p_operand, ds_operand = p, ds
        else:
            p = cute.make_rmem_tensor(s_shape, self.dtype)
            ds = cute.make_rmem_tensor(s_shape, self.dtype)
            sPt = cute.make_tensor(smem.p.iterator, cute.select(smem.p.layout, mode=[1, 0, 2]))
            if cutlass.const_expr(self.cfg.transposed):  # B = P^T, dS^T: (keys, query rows), MN-major
                p_operand = thr_dv.make_fragment_B(thr_dv.partition_B(sPt))
                ds_operand = thr_dk.make_fragment_B(thr_dk.partition_B(sdSt))
                p_target = thr_copy.partition_D(smem.p[None, None, 0])
            else:
                p_operand = thr_dv.make_fragment_A(thr_dv.partition_A(sPt))
                ds_operand = thr_dk.make_fragment_A(thr_dk.partition_A(sdSt))
                p_target = thr_copy.partition_D(sPt[None, None, 0])
            p_source = thr_copy.retile(p)
        return p, ds, p_operand, ds_operand, p_source, p_target

    @cute.jit
    def scores_and_grads(self, f: BwdFragments, smem: BwdSmem, pipe_q, pipe_do, state, at, sizes):
        """S^T and dP^T (S and dP, transposed) of one step, then the probabilities and dS into
        ``f.p`` / ``f.ds`` (and dS into sdS); ``at``: (key tile, query head, batch, query tile,
        whether the expression mask hides some pair of the tile)."""
        acc_s = cute.make_rmem_tensor(f.coords_s.shape, Float32)
        acc_dp = cute.make_rmem_tensor(f.coords_s.shape, Float32)
        pipe_q.consumer_wait(state)
        lse = None
        # (not beside a mask's second bound: with chunks it spilled, decision bwd-step-trim)
        plain = self.score_grad is None and self.cfg.softcap is None and not self.cfg.query_bounds[1]
        if cutlass.const_expr(plain and self.tile_m <= WGMMA_M):
            lse = self.query_values(
                smem.lse, state.index, rows_cols_view(f.coords_s), rows_cols_view(acc_s)[0, None].shape
            )
        # Q and dO are S's and dP's A operands when transposed, else their B
        a_stage, b_stage = (state.index, 0) if self.cfg.transposed else (0, state.index)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(f.tSrK, mode=[2])):
            mma = f.sdp_first if kb == 0 else f.sdp_rest
            cute.gemm(mma, acc_s, f.tSrK[None, None, kb, a_stage], f.tSrQ[None, None, kb, b_stage], acc_s)
        warpgroup.commit_group()
        pipe_do.consumer_wait(state)
        for kb in cutlass.range_constexpr(cute.size(f.tPrV, mode=[2])):
            mma = f.sdp_first if kb == 0 else f.sdp_rest
            cute.gemm(mma, acc_dp, f.tPrV[None, None, kb, a_stage], f.tPrdO[None, None, kb, b_stage], acc_dp)
        warpgroup.commit_group()
        scores, grads = rows_cols_view(acc_s), rows_cols_view(acc_dp)
        if cutlass.const_expr(self.score_grad is not None):
            self.modified_grads(f, smem, state, scores, grads, at, sizes)
        elif cutlass.const_expr(self.cfg.softcap is not None):
            self.capped_grads(f, smem, state, scores, grads, at, sizes)
        else:
            self.plain_grads(f, smem, state, scores, grads, at, sizes, lse)
        if cutlass.const_expr(self.mask_mod is not None):
            if at[4]:  # (tiles whose every pair is visible skip it: the block mask's full flag)
                self.mask_grads(f, scores, grads, at, sizes)
        store_as_operand_a(acc_s, f.p, pinned=False)
        store_as_operand_a(acc_dp, f.ds, pinned=False)
        # dS to shared memory for dQ (and for dK, with P for dV, unless dkv_split m): every MMA
        # of the step before that read them was done before its DQ_FULL barrier (stage_dq)
        cute.copy(f.ds_copy, f.ds_source, f.ds_target)
        if cutlass.const_expr(self.cfg.dkv_split != "m"):
            cute.copy(f.ds_copy, f.p_source, f.p_target)
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def products(self, f: BwdFragments, pipe_do, state):
        """dV += P^T.dO, then dQ = dS.K once every dS row is in (returned, done), then dK +=
        dS^T.Q, left running (the caller stages dQ meanwhile, then waits: ``dk_done``); frees dO."""
        warpgroup.fence()
        self._dv_product(f, state)
        # every dS row is in, and (for stage_dq) every warpgroup's dQ staging buffer is free
        cute.arch.barrier(barrier_id=int(BwdBarrier.DS_FULL), number_of_threads=self.num_consumers * WARPGROUP_THREADS)
        acc_dq = self._dq_product(f)
        self._dk_product(f, state)
        warpgroup.wait_group(1)  # dV and dQ are done; dK runs on
        pipe_do.consumer_release(state)
        return acc_dq

    @cute.jit
    def products_by_columns(self, f: BwdFragments, pipe_q, pipe_do, state):
        """dkv_split n (and t): once both warpgroups' P and dS are in, dK += dS^T.Q first (Q's
        stage is freed as it ends, so the next Q loads during dV and dQ: one stage at d256), then
        dV += P^T.dO (frees dO), then dQ = dS.K (returned, done). Every reader of sP and sdS is
        done before stage_dq's barrier, after which the other warpgroup may write them again."""
        self._dq_buffer_read(f)
        cute.arch.barrier(barrier_id=int(BwdBarrier.DS_FULL), number_of_threads=self.num_consumers * WARPGROUP_THREADS)
        warpgroup.fence()
        self._dk_product(f, state)
        self._dv_product(f, state)
        acc_dq = self._dq_product(f)
        warpgroup.wait_group(2)
        pipe_q.consumer_release(state)
        warpgroup.wait_group(1)
        pipe_do.consumer_release(state)
        warpgroup.wait_group(0)
        return acc_dq

    @cute.jit
    def _dq_buffer_read(self, f: BwdFragments):
        """dkv_split n, the issuing warp: the reduce-add that last read the staging buffer this
        step's dQ goes to (dq_stages steps back) has read it. Waited here, half a step after it
        was issued, not right after issuing (with one buffer, a stall of the warpgroup's next
        MMAs); the DS_FULL barrier after it tells the other warps. (dkv_split m waits in
        stage_dq; with the dQ writer warp, stage_dq takes the buffer back from it.)"""
        if cutlass.const_expr(not self.cfg.dq_writer):
            if f.warp == 0:
                cute.arch.cp_async_bulk_wait_group(self.dq_stages - 1, read=True)

    @cute.jit
    def _dq_product(self, f: BwdFragments):
        acc_dq = cute.make_rmem_tensor(f.thr_dq.partition_shape_C((self.tile_m, self.dqk)), Float32)
        for kb in cutlass.range_constexpr(cute.size(f.tQrdS, mode=[2])):
            mma = f.dq_first if kb == 0 else f.dq_rest
            cute.gemm(mma, acc_dq, f.tQrdS[None, None, kb, 0], f.tQrK[None, None, kb, 0], acc_dq)
        warpgroup.commit_group()
        return acc_dq

    def _dk_product(self, f: BwdFragments, state):
        """dK += dS^T.Q, or transposed dK^T += Q^T.dS."""
        self._key_product(f.dk, f.acc_dk, f.tKrQ, f.ds_operand, state)

    def _dv_product(self, f: BwdFragments, state):
        """dV += P^T.dO, or transposed dV^T += dO^T.P."""
        self._key_product(f.dkv, f.acc_dv, f.tVrdO, f.p_operand, state)

    @cute.jit
    def _key_product(self, mma, acc, staged, probs, state):
        """``acc`` += ``probs``^T . ``staged`` (a step's Q or dO, from its stage), or transposed
        ``staged``^T . ``probs`` (the staged operand is then A, read MN-major); one commit group."""
        for kb in cutlass.range_constexpr(cute.size(staged, mode=[2])):
            rows = staged[None, None, kb, state.index]
            if cutlass.const_expr(self.cfg.transposed):
                cute.gemm(mma, acc, rows, probs[None, None, kb, 0], acc)
            else:
                cute.gemm(mma, acc, self._a_block(probs, kb), rows, acc)
        warpgroup.commit_group()

    def _a_block(self, operand, kb: int):
        """K-block ``kb`` of dV's or dK's A operand from P^T / dS^T (a shared-memory one has a stage mode)."""
        return operand[None, None, kb, 0] if self.cfg.dkv_split == "n" else operand[None, None, kb]

    @cute.jit
    def dk_done(self, pipe_q, state):
        """Wait for the step's dK product, the last reader of its Q stage, and free the stage."""
        warpgroup.wait_group(0)
        pipe_q.consumer_release(state)

    @cute.jit
    def stage_dq(self, f: BwdFragments, smem: BwdSmem, acc_dq, tma_dq, at, stage: Int32):
        """This warpgroup's dQ into staging buffer ``stage`` and on into the accumulator in global
        memory: with the dQ writer warp (dq_writer), handed to it by named barrier, the buffer
        first taken back from it (its last reduce-add has read it); else by TMA reduce-add from
        the warpgroup's issuing warp, left running during the next step (the buffer free since
        ``products``)."""
        if cutlass.const_expr(self.cfg.dq_writer):
            cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_EMPTY) + stage, number_of_threads=self._dq_handoff_threads())
        staged = f.thr_dq.partition_C(smem.dq[None, None, stage])
        if cutlass.const_expr(self.cfg.dq_writer):
            # (element by element: beside the buffer's barrier, 64-bit stores spilled at d256)
            for i in cutlass.range_constexpr(cute.size(acc_dq)):
                staged[i] = acc_dq[i]
        else:
            cute.autovec_copy(acc_dq, staged)  # (64-bit stores where the swizzle keeps pairs together)
        cute.arch.fence_proxy("async.shared", space="cta")
        # both warpgroups: this step's dQ is staged, and their dQ MMAs have read dS (products
        # waited for them), so the next step may write it
        cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_FULL), number_of_threads=self.num_consumers * WARPGROUP_THREADS)
        if cutlass.const_expr(self.cfg.dq_writer):
            cute.arch.barrier_arrive(
                barrier_id=int(BwdBarrier.DQ_STAGED) + stage, number_of_threads=self._dq_handoff_threads()
            )
        elif f.warp == 0:
            # (a warp-uniform branch: a thread-dependent one around the TMA serialized every
            # wgmma of the kernel)
            self._reduce_add_dq(tma_dq, smem, stage, at, f.warpgroup)
            cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.cfg.dkv_split == "m"):
                # (waited here with dK's MMA in flight: a wait in products, between dV's MMA and
                # the barrier, made ptxas serialize wgmmas and spill)
                cute.arch.cp_async_bulk_wait_group(self.dq_stages - 1, read=True)

    def _dq_handoff_threads(self) -> int:
        """Threads of the named barriers between the consumers and the dQ writer warp."""
        return self.num_consumers * WARPGROUP_THREADS + WARP_THREADS

    @cute.jit
    def _reduce_add_dq(self, tma_dq, smem: BwdSmem, stage: Int32, at, share):
        """Issue the TMA reduce-add of consumer warpgroup ``share``'s part of staging buffer
        ``stage`` into query tile ``at`` = (head, batch, query tile) of the accumulator."""
        head, batch, m_block = at
        atom, mdq = tma_dq
        box = self._dq_box()
        by_rows = self.cfg.dq_split == "m"
        mine = (share, 0) if cutlass.const_expr(by_rows) else (0, share)
        source = cute.local_tile(smem.dq[None, None, stage], box, mine)
        tiles = cute.local_tile(mdq[None, None, head, batch], box, (None, None))
        tDs, tDg = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(source, 0, 2), cute.group_modes(tiles, 0, 2)
        )
        row_tile = m_block * (self.tile_m // WGMMA_M) + (share if cutlass.const_expr(by_rows) else 0)
        cute.copy(atom, tDs, tDg[None, row_tile, mine[1]])

    @cute.jit
    def dq_stores_done(self, f: BwdFragments):
        """Every reduce-add a consumer warp issued has read its staging buffer (shared memory ends
        with the CTA; the dQ writer warp waits for its own)."""
        if cutlass.const_expr(not self.cfg.dq_writer):
            if f.warp == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def write_dq(self, smem: BwdSmem, tma_dq, semaphores, where, sizes):
        """The dQ writer warp (dq_writer): each step's staged dQ, both warpgroups' shares, added into
        the accumulator by TMA reduce-add. Deterministic, in the key tile's turn at its query tile
        (computed while the consumers work), passed on once the sums have landed; each staging
        buffer goes back to the consumers once read (landed, deterministic)."""
        _, _, batch, _, count, first_head, heads = where
        steps = heads * count
        threads = self._dq_handoff_threads()
        for stage in cutlass.range_constexpr(self.dq_stages):  # every buffer starts free
            if stage < steps:
                cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_EMPTY) + stage, number_of_threads=threads)
        for step in cutlass.range(steps, unroll=1):
            stage = step % self.dq_stages
            at = (first_head + step // count, batch, self.query_tile(where, step % count, sizes[2]))
            turn = Int32(0)
            if cutlass.const_expr(self.cfg.dq_grouped_turns):
                # the turn's group (round-robin) sums into its own partial: the tile's virtual
                # query tile, whose semaphore counts that group's turns (the counts worked out
                # per step: held over the loop they spilled the writer's 24 registers)
                m_blocks = cute.ceil_div(sizes[0], self.tile_m)
                groups = semaphores.shape[2] // m_blocks  # the host's dq_groups
                order = self.dq_turn(where, step % count, at[2], sizes)
                turn = order // groups
                at = (at[0], at[1], at[2] + order % groups * m_blocks)
            elif cutlass.const_expr(self.cfg.deterministic):
                turn = self.dq_turn(where, step % count, at[2], sizes)
            cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_STAGED) + stage, number_of_threads=threads)
            # (a loop, not unrolled: both shares' TMA addresses at once spilled the 24-register warp)
            for share in cutlass.range(self.num_consumers, unroll=1):
                if cutlass.const_expr(self.cfg.deterministic):
                    self._await_dq_turn(semaphores, at, share, turn)
                self._reduce_add_dq(tma_dq, smem, stage, at, share)
            cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.cfg.deterministic):
                self._pass_dq_turn(semaphores, at)
            else:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            if step + self.dq_stages < steps:
                cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_EMPTY) + stage, number_of_threads=threads)

    @cute.jit
    def _await_dq_turn(self, semaphores, at, share: Int32, turn: Int32):
        """Spin until ``turn`` key tiles have added warpgroup ``share``'s part of this (virtual)
        query tile's dQ, then order this warp's reduce-add after theirs."""
        head, batch, m_block = at
        flag = semaphores.iterator + cute.crd2idx((batch, head, m_block, share), semaphores.layout)
        seen = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
        while seen != turn:
            seen = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
        cute.arch.fence_proxy("async.global")

    @cute.jit
    def _pass_dq_turn(self, semaphores, at):
        """Once this warp's reduce-adds have landed in global memory (not just read their
        buffer), count this key tile's turn at query tile ``at`` as taken, for every share."""
        head, batch, m_block = at
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_proxy("async.global")
        if cute.arch.lane_idx() == 0:
            for share in cutlass.range_constexpr(self.num_consumers):
                flag = semaphores.iterator + cute.crd2idx((batch, head, m_block, share), semaphores.layout)
                cute.arch.red(flag, Int32(1), op="add", dtype="s32", sem="release", scope="gpu")

    @cute.jit
    def store_dk_dv(self, f: BwdFragments, outputs, head_splits: Int32, at, seqlen_k: Int32):
        """dK (times softmax_scale) and dV of this thread's keys below Sk: rounded into the outputs,
        or with the KV head's query heads split over CTAs, added into the fp32 sums (the runtime
        rounds them; two partials added into zeros give the same sum in either order)."""
        mdK, mdV, mdKaccum, mdVaccum = outputs
        n_block, kv_head, batch = at
        where = (n_block * self.tile_n, kv_head, batch, seqlen_k)
        if head_splits == 1:
            self._store_rows(f.acc_dk, f.coords_dk, mdK, where, self.cfg.head_dim, self.cfg.softmax_scale)
            self._store_rows(f.acc_dv, f.coords_dv, mdV, where, self.cfg.head_dim_v, 1.0)
        else:
            self._add_rows(f.acc_dk, f.coords_dk, mdKaccum, where, self.cfg.softmax_scale)
            self._add_rows(f.acc_dv, f.coords_dv, mdVaccum, where, 1.0)

    def _key_col(self, coords, i: int):
        """(key, column) of accumulator element ``i`` of dK or dV (transposed: stored as (column, key))."""
        first, second = coords[i]
        return (second, first) if self.cfg.transposed else (first, second)

    @cute.jit
    def _store_rows(self, acc, coords, out, where, width: int, scale: float):
        first_key, kv_head, batch, seqlen_k = where
        for i in cutlass.range_constexpr(cute.size(acc)):
            key, col = self._key_col(coords, i)
            value = acc[i] if cutlass.const_expr(scale == 1.0) else acc[i] * Float32(scale)
            if first_key + key < seqlen_k:
                if col < width:  # (the padded head dim's columns are not stored)
                    out[batch, first_key + key, kv_head, col] = value.to(out.element_type)

    @cute.jit
    def _add_rows(self, acc, coords, sums, where, scale: float):
        """``acc`` (times ``scale``) added into the fp32 sums, whole padded key tiles (no bounds)."""
        first_key, kv_head, batch, _ = where
        for i in cutlass.range_constexpr(cute.size(acc)):
            key, col = self._key_col(coords, i)
            value = acc[i] if cutlass.const_expr(scale == 1.0) else acc[i] * Float32(scale)
            target = sums.iterator + cute.crd2idx((batch, first_key + key, kv_head, col), sums.layout)
            cute.arch.red(target, value, op="add", dtype="f32", sem="relaxed", scope="gpu")
