"""The consumer warpgroup's main loop on Hopper: S = Q.K^T, softmax, O += P.V over key tiles.

The schedule is FA3's intra-warpgroup overlap: S(n) = Q.K^T and O += P(n+1).V(n+1) are issued
together, and the softmax of S(n) runs while the tensor cores finish P.V (ptxas moves the P.V
wait above part of the softmax; with ping-pong the other warpgroups' MMAs fill that wait).
With ping-pong the consumer warpgroups take turns issuing their MMAs (named barriers), so one
warpgroup's softmax fills the time another's MMAs hold the tensor cores.

With a stale max (``stale_max``), key tiles without mask code skip the tile's row max: their scores
are exponentiated against the rows' running max and the row sums say whether the max must move
(softmax.stale_exponentials and settle; recompute_scores where the exponentials overflowed).

Key tiles run from the highest down (or in a block mask's list order): the first tile always runs the mask
(it may hold the diagonal or the ragged end of Sk). After it, with mask runs, the tiles crossing
the right bound, the interior and the tiles crossing the left bound (masking.py) are three loops
traced with and without the mask code; otherwise a run-time flag per tile says whether it crosses
a bound or, with a block mask, is partial. Either way interior
and full tiles skip the mask code. Where rows can start past key 0 (left windows, chunks,
documents), the mask compares the rows' starts only in key tiles below split_lo (masking.py): the
left run, and the first tile when it lies there, which is traced in both forms and chosen per
query tile (decision mask-compare); without mask runs every masked tile compares the starts, in one
form. The highest tiles of a query
tile can be masked for every row of one warpgroup (the diagonal of a 192-row tile, rows past
Sq): that warpgroup passes them by without MMAs, releasing their stages and its turns.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from fa4gen.arch import WARPGROUP_THREADS
from fa4gen.kernels.common.layout import convert_p, rows_cols_view, store_as_operand_a
from fa4gen.kernels.sm90.config import NamedBarrier
from fa4gen.kernels.sm90.wgmma import issue_k_blocks


class Sm90MainLoop:
    """Mixin for the Hopper forward kernel: needs tile_n, kv_stages, num_consumers,
    pingpong, mask_runs, interior_first_tile, p_in_registers, chain,
    skips_masked_tiles, has_left_mask, has_right_mask, block_sparse, score_mod,
    mask_mod, key_tiles, softmax, o_shared, o_over_v, key_block() and await_o_store()."""

    @cute.jit
    def mainloop(self, loop, tile, k_state, v_state):
        """All key tiles of one query tile (``tile.n_count`` of them, in key_block order), of
        which the first ``tile.skip`` may be masked for all of this warpgroup's rows (only with
        3 warpgroups, where a 192-row tile's diagonal makes that common); returns the advanced K
        and V pipeline states."""
        if cutlass.const_expr(self.skips_masked_tiles):
            for _ in cutlass.range(tile.skip, unroll=1):
                k_state, v_state = self.skip_tile(loop, k_state, v_state)
            if self.sees_no_key_tile(tile):
                # nothing visible: the turn of the last P.V that never comes still passes
                self.wait_turn(loop.warpgroup)
                self.pass_turn(loop.warpgroup)
            else:
                k_state, v_state = self.visible_tiles(loop, tile, tile.skip, k_state, v_state)
        else:
            k_state, v_state = self.visible_tiles(loop, tile, 0, k_state, v_state)
        return k_state, v_state

    def releases_q_early(self) -> bool:
        """Whether a warpgroup releases its Q rows before a query tile's last P.V (so the next
        tile's Q loads during it and the epilogue): where Q has one buffer and O is not staged
        over it, and each tile ends with its own P.V (unchained)."""
        return self.q_stages == 1 and not self.o_over_q and not self.chain

    def sees_no_key_tile(self, tile):
        """Whether ``visible_tiles`` does not run for this warpgroup's rows of ``tile``: the tile
        has no key tile, or (skipping masked tiles) every one is masked for these rows."""
        return tile.skip >= tile.n_count if self.skips_masked_tiles else tile.n_count <= 0

    @cute.jit
    def visible_tiles(self, loop, tile, start, k_state, v_state):
        """Visited key tiles start .. n_count-1 (start: 0, or the warpgroup's skipped count)."""
        first = self.key_block(tile, start, loop.args)
        if cutlass.const_expr(self.chain):
            # the previous query tile's last P.V, held back, goes with this tile's first Q.K^T
            if loop.held.pending[0] != 0:
                k_state, v_state = self.first_tile_of(loop, tile, first, k_state, v_state, True)
            else:
                k_state, v_state = self.first_tile_of(loop, tile, first, k_state, v_state, False)
        else:
            k_state, v_state = self.first_tile_of(loop, tile, first, k_state, v_state, False)
        if cutlass.const_expr(self.cfg.mask_runs):
            # key tiles go from the highest down: those crossing the right bound, the interior,
            # those crossing the left bound; each run is its own loop, traced with or without
            # the mask code, so no key tile branches on a flag
            right_end, left_start = self.mask_run_bounds(tile, start)
            # (the tiles crossing the right bound lie at or past every row's start: masking.py)
            if cutlass.const_expr(self.has_right_mask):
                k_state, v_state = self.key_tile_run(
                    loop, tile, start + 1, right_end, k_state, v_state, True, check_start=False
                )
            k_state, v_state = self.key_tile_run(loop, tile, right_end, left_start, k_state, v_state, False)
            if cutlass.const_expr(self.has_left_mask):
                k_state, v_state = self.key_tile_run(
                    loop, tile, left_start, tile.n_count, k_state, v_state, True, check_start=True
                )
        else:
            # one loop body: where rows can start past key 0 every masked tile compares starts
            # too (a no-op above split_lo), rather than tracing the mask in both forms
            k_state, v_state = self.key_tile_run(
                loop, tile, start + 1, tile.n_count, k_state, v_state, None, check_start=True
            )
        if cutlass.const_expr(not self.chain):
            if cutlass.const_expr(self.releases_q_early()):
                loop.pipe_q.consumer_release(loop.q_state)  # the last Q.K^T is done
            v_state = self.pv_product(loop, v_state)
        # (chained: the last P.V waits for the next query tile's first Q.K^T, or the flush)
        return k_state, v_state

    @cute.jit
    def first_tile_of(self, loop, tile, first: Int32, k_state, v_state, chained: bool):
        """The first key tile in the form its bounds need, each form traced apart (no branch
        inside); ``chained``: issued with the held query tile's last P.V (chain.py)."""
        if cutlass.const_expr(self.key_tiles.starts_at_zero):
            k_state, v_state = self.first_past_starts(loop, tile, first, k_state, v_state, chained)
        elif cutlass.const_expr(not self.cfg.mask_runs):  # one form, as the loop (visible_tiles)
            k_state, v_state = self.first_tile_as(loop, tile, first, k_state, v_state, True, True, chained)
        elif first < tile.split_lo:
            k_state, v_state = self.first_tile_as(loop, tile, first, k_state, v_state, True, True, chained)
        else:
            k_state, v_state = self.first_past_starts(loop, tile, first, k_state, v_state, chained)
        return k_state, v_state

    @cute.jit
    def first_past_starts(self, loop, tile, n_block: Int32, k_state, v_state, chained: bool):
        """The first key tile where it lies at or past every row's start: masked by the rows'
        ends, or not at all where it lies below split_hi (an interior tile)."""
        if cutlass.const_expr(self.cfg.interior_first_tile):
            if n_block < tile.split_hi:
                k_state, v_state = self.first_tile_as(loop, tile, n_block, k_state, v_state, False, False, chained)
            else:
                k_state, v_state = self.first_tile_as(loop, tile, n_block, k_state, v_state, True, False, chained)
        else:
            k_state, v_state = self.first_tile_as(loop, tile, n_block, k_state, v_state, True, False, chained)
        return k_state, v_state

    @cute.jit
    def first_tile_as(
        self, loop, tile, n_block: Int32, k_state, v_state, masked: bool, check_start: bool, chained: bool
    ):
        """A query tile's first key tile, ``masked`` or not (``check_start``: whether the mask
        compares the rows' starts, see masking.bounds_of_rows)."""
        if cutlass.const_expr(chained):
            k_state, v_state = self.chained_first_tile(loop, tile, n_block, k_state, v_state, masked, check_start)
        else:
            k_state = self.first_tile(loop, tile, n_block, k_state, masked, check_start)
        return k_state, v_state

    @cute.jit
    def mask_run_bounds(self, tile, start: Int32):
        """(right_end, left_start) of the mask runs: visited tiles start+1 .. right_end-1 cross
        the right bound, left_start .. n_count-1 the left bound, those between are interior
        (key tile n_max-1-i is the i-th visited, and the bounds split_lo <= split_hi order them)."""
        right_end = cutlass.max(cutlass.min(tile.n_max - tile.split_hi, tile.n_count), start + 1)
        left_start = cutlass.max(cutlass.min(tile.n_max - tile.split_lo, tile.n_count), right_end)
        return right_end, left_start

    @cute.jit
    def key_tile_run(self, loop, tile, begin: Int32, end: Int32, k_state, v_state, masked, check_start=None):
        """Visited key tiles begin .. end-1 after the first; ``masked``: True or False for the whole
        run, or None for a run-time flag per tile (see needs_mask); ``check_start``: whether the
        mask compares the rows' starts, for the whole run, or None: per tile (scores_to_probs)."""
        for i in cutlass.range(begin, end, unroll=1):
            n_block = self.key_block(tile, i, loop.args)
            flag = masked
            if cutlass.const_expr(masked is None):
                flag = self.needs_mask(loop, tile, i, n_block)
            k_state, v_state = self.overlapped_tile(loop, tile, n_block, k_state, v_state, flag, check_start)
        return k_state, v_state

    @cute.jit
    def skip_tile(self, loop, k_state, v_state):
        """A key tile masked for every row of this warpgroup: its K and V stages are waited for
        (never released before the producer filled them) and released untouched; with ping-pong
        the warpgroup still takes and passes the turn its MMAs would have taken, so the turn
        ring stays in step."""
        loop.pipe_k.consumer_wait(k_state)
        loop.pipe_v.consumer_wait(v_state)
        self.wait_turn(loop.warpgroup)
        self.pass_turn(loop.warpgroup)
        loop.pipe_k.consumer_release(k_state)
        loop.pipe_v.consumer_release(v_state)
        k_state.advance()
        v_state.advance()
        return k_state, v_state

    @cute.jit
    def needs_mask(self, loop, tile, i: Int32, n_block: Int32):
        """Whether the i-th visited key tile ``n_block`` (not the first, which is always masked)
        needs mask code: a run-time flag, so masked and interior tiles share one traced loop
        body and only boundary tiles execute it. With a block mask, its 'full' flag decides; with
        structural bounds, whether the tile crosses one; otherwise it is the constant False (the
        only ragged tile, the last one of Sk, is the first tile)."""
        masked = False
        if cutlass.const_expr(self.block_sparse):
            masked = loop.args.block_full[tile.mask_b, tile.mask_h, tile.m_block, i] == 0
        elif cutlass.const_expr(self.has_right_mask and self.has_left_mask):
            masked = n_block >= tile.split_hi or n_block < tile.split_lo
        elif cutlass.const_expr(self.has_right_mask):
            masked = n_block >= tile.split_hi
        elif cutlass.const_expr(self.has_left_mask):
            masked = n_block < tile.split_lo
        return masked

    # ------------------------------------------------------------------ ping-pong turns
    @cute.jit
    def wait_turn(self, wg: Int32):
        """Block until the previous warpgroup has issued its MMAs."""
        if cutlass.const_expr(self.cfg.pingpong):
            cute.arch.barrier(barrier_id=NamedBarrier.TURN + wg, number_of_threads=2 * WARPGROUP_THREADS)

    @cute.jit
    def pass_turn(self, wg: Int32):
        """Let the next warpgroup issue its MMAs (ours are queued)."""
        if cutlass.const_expr(self.cfg.pingpong):
            following = (wg + 1) % self.num_consumers
            cute.arch.barrier_arrive(barrier_id=NamedBarrier.TURN + following, number_of_threads=2 * WARPGROUP_THREADS)

    # ------------------------------------------------------------------ MMAs
    @cute.jit
    def issue_qk(self, loop, acc_s: cute.Tensor, stage: Int32):
        issue_k_blocks(loop.qk_first, loop.qk_rest, acc_s, loop.tSrQ, loop.tSrK, stage)

    @cute.jit
    def issue_pv(self, loop, stage: Int32):
        issue_k_blocks(loop.pv, loop.pv, loop.acc_o, loop.p, loop.tOrV, stage)

    @cute.jit
    def scores_to_probs(self, loop, tile, acc_s: cute.Tensor, n_block: Int32, masked, check_start=None):
        """Score modifier, mask (``masked``: a Python bool or a run-time flag; ``check_start``:
        whether it compares the rows' starts, None: where the tile lies below split_lo),
        online-softmax update; returns the per-row O correction."""
        scores = rows_cols_view(acc_s)
        coords = rows_cols_view(loop.coords_s)
        col_base = n_block * self.tile_n
        if cutlass.const_expr(self.score_mod is not None):
            self.modify_scores(loop, tile, scores, coords, col_base)
        below_start = check_start
        if cutlass.const_expr(check_start is None):
            below_start = n_block < tile.split_lo
        if masked:
            self.key_tiles.apply(scores, coords, loop.row_start, loop.row_end, col_base, below_start)
            if cutlass.const_expr(self.mask_mod is not None):
                self.mask_scores(loop, tile, scores, coords, col_base)
        return self.softmax.update(scores, loop.row_max, loop.row_sum)

    @cute.jit
    def stale_probs(self, loop, tile, acc_s: cute.Tensor, n_block: Int32, sums: cute.Tensor):
        """A key tile without mask code, against the rows' running max (``stale_max``): score
        modifier, exponentials and each thread's share of the row sums; softmax.settle finishes."""
        scores = rows_cols_view(acc_s)
        if cutlass.const_expr(self.score_mod is not None):
            self.modify_scores(loop, tile, scores, rows_cols_view(loop.coords_s), n_block * self.tile_n)
        self.softmax.stale_exponentials(scores, loop.row_max, sums)

    @cute.jit
    def recompute_scores(self, loop, tile, scores, n_block: Int32):
        """The modified scores of key tile ``n_block`` again, from Q and K in global memory, one
        product per thread and score: only where a stale max fell behind the tile's by 2^120 or
        more (exponentials overflowed) or a row had seen no key before this tile (softmax.settle).
        Rows past Sq score 0, as the zero-filled Q rows of the wgmma give."""
        coords = rows_cols_view(loop.coords_s)
        col_base = n_block * self.tile_n
        kv_head = loop.head // self.cfg.qhead_per_kvhead
        # one key at a time, its dot products over d in a loop: a few addresses live, where all
        # the keys' at once spilled the 112 registers of 4-warpgroup kernels
        for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
            key = cutlass.min(col_base + coords[0, c][1], loop.seqlen_k - 1)
            for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
                scores[r, c] = Float32(0.0)
            for d in cutlass.range(self.cfg.head_dim, unroll=1):
                k_value = loop.gk[key, d, kv_head, loop.batch].to(Float32)
                for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
                    row = tile.row_base + coords[r, 0][0]
                    q_value = loop.gq[cutlass.min(row, loop.seqlen_q - 1), d, loop.head, loop.batch].to(Float32)
                    q_value = Float32(cutlass.select_(row < loop.seqlen_q, q_value, Float32(0.0)))
                    scores[r, c] = scores[r, c] + q_value * k_value
        if cutlass.const_expr(self.score_mod is not None):
            self.modify_scores(loop, tile, scores, coords, col_base)

    @cute.jit
    def modify_scores(self, loop, tile, scores, coords, col_base: Int32):
        """score_mod(q.k, b, h, q_idx, kv_idx, Sq, Sk, args) per score: indices it does not use
        cost nothing (dead code)."""
        for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
            row = tile.row_base + coords[r, 0][0]
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                scores[r, c] = self.score_mod(
                    scores[r, c],
                    loop.batch,
                    loop.head,
                    row,
                    col_base + coords[0, c][1],
                    loop.seqlen_q,
                    loop.seqlen_k,
                    loop.args,
                )

    @cute.jit
    def mask_scores(self, loop, tile, scores, coords, col_base: Int32):
        """The expression mask: -inf where mask_mod(b, h, q_idx, kv_idx, Sq, Sk, args) is False."""
        for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
            row = tile.row_base + coords[r, 0][0]
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                visible = self.mask_mod(
                    loop.batch, loop.head, row, col_base + coords[0, c][1], loop.seqlen_q, loop.seqlen_k, loop.args
                )
                scores[r, c] = Float32(cutlass.select_(visible, scores[r, c], -Float32.inf))

    @cute.jit
    def store_p(self, loop, acc_s: cute.Tensor):
        """The probabilities become the A operand of the next P.V: rounded in registers, or
        written to this warpgroup's P tile in shared memory (the P.V that read the previous P
        has completed: every caller waited for it) and made visible to the tensor cores.

        Each warp then waits only for itself: warp w holds S rows 16w..16w+15 (the wgmma
        accumulator layout), stmatrix writes exactly those rows of P, and in the P.V wgmma warp
        w's 16 rows of O read only those rows of the A operand, so a warpgroup barrier orders
        nothing the MMA needs (decision p-warp-sync; FlashAttention-3 and flash-attn-4 sync one
        warp here too).

        Where O's rescale is skipped below a threshold (a branch), the overlapped tile calls
        this right after the P.V wait, before the branches of the V release and of the O
        rescale, with conversions LLVM cannot sink below them (layout.pack_pair_pinned): they
        stay in the exponentials' basic block, where ptxas interleaves the F2FP with the MUFU
        ex2 instead of running them after the last one (decision pinned-p-conversions). Where O is
        rescaled every tile (no branch)
        the conversions are plain and follow the V release (see pins_p_conversions)."""
        pinned = self.pins_p_conversions()
        if cutlass.const_expr(self.cfg.p_in_registers):
            store_as_operand_a(acc_s, loop.p, pinned)
        else:
            p_low, stmatrix, source, target = loop.p_store
            convert_p(acc_s, p_low, pinned)
            cute.copy(stmatrix, source, target)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_warp()

    def pins_p_conversions(self) -> bool:
        """Whether P's conversions are pinned above the branches (store_p): with a rescale
        threshold. Without one there is no rescale branch to keep them above, and plain
        conversions after the V release measured faster (decision pinned-p-conversions). With a
        stale max (stale_probs) they are stored right after the P.V wait, before the row-sum check,
        and again where it moves a row's reference."""
        return self.softmax.rescale_threshold > 0.0

    # ------------------------------------------------------------------ one key tile
    @cute.jit
    def first_tile(self, loop, tile, n_block: Int32, k_state, masked: bool, check_start: bool):
        """A query tile's first key tile: S and P; its P.V goes with the next tile's Q.K^T."""
        acc_s = cute.make_rmem_tensor(loop.coords_s.shape, Float32)
        loop.pipe_k.consumer_wait(k_state)
        self.wait_turn(loop.warpgroup)
        warpgroup.fence()
        self.issue_qk(loop, acc_s, k_state.index)
        self.pass_turn(loop.warpgroup)
        self.await_o_store(loop.warpgroup)  # O staged over P: the last store has read P's tile
        warpgroup.wait_group(0)
        loop.pipe_k.consumer_release(k_state)
        self.scores_to_probs(loop, tile, acc_s, n_block, masked, check_start)  # O is still zero: no correction
        self.store_p(loop, acc_s)
        k_state.advance()
        return k_state

    @cute.jit
    def overlapped_tile(self, loop, tile, n_block: Int32, k_state, v_state, masked, check_start=None):
        """Issue S(n) = Q.K^T and O += P(n+1).V(n+1) together; the softmax of S(n) runs while
        the tensor cores finish P.V; then O is corrected and S(n) becomes the next P."""
        acc_s = cute.make_rmem_tensor(loop.coords_s.shape, Float32)
        self.issue_qk_with_pv(loop, acc_s, k_state, v_state)
        loop.pipe_k.consumer_release(k_state)
        stale = self.cfg.stale_max and masked is False  # (a key tile without mask code)
        if cutlass.const_expr(stale):
            sums = cute.make_rmem_tensor(cute.make_layout(self.softmax.num_rows), Float32)
            self.stale_probs(loop, tile, acc_s, n_block, sums)
        else:
            correction = self.scores_to_probs(loop, tile, acc_s, n_block, masked, check_start)
        warpgroup.wait_group(0)
        if cutlass.const_expr(self.pins_p_conversions()):
            self.store_p(loop, acc_s)  # before the branches of the release and the rescale
        if cutlass.const_expr(stale):
            correction = cute.make_rmem_tensor(cute.make_layout(self.softmax.num_rows), Float32)
            self.softmax.settle(
                rows_cols_view(acc_s),
                loop.row_max,
                loop.row_sum,
                sums,
                correction,
                recompute=lambda scores: self.recompute_scores(loop, tile, scores, n_block),
                restore=lambda: self.store_p(loop, acc_s),
            )
        loop.pipe_v.consumer_release(v_state)
        if cutlass.const_expr(not self.pins_p_conversions()):
            self.store_p(loop, acc_s)  # plain conversions: no rescale branch to sink below
        self.softmax.rescale(rows_cols_view(loop.acc_o), correction)
        k_state.advance()
        v_state.advance()
        return k_state, v_state

    @cute.jit
    def issue_qk_with_pv(self, loop, acc_s: cute.Tensor, k_state, v_state):
        """S = Q.K^T into ``acc_s`` and O += P.V (the P in registers or smem now) in one turn,
        once their K and V stages are loaded; returns when S is done (P.V may still run)."""
        loop.pipe_k.consumer_wait(k_state)
        loop.pipe_v.consumer_wait(v_state)
        self.wait_turn(loop.warpgroup)
        warpgroup.fence()
        self.issue_qk(loop, acc_s, k_state.index)
        self.issue_pv(loop, v_state.index)
        self.pass_turn(loop.warpgroup)
        warpgroup.wait_group(1)

    @cute.jit
    def pv_product(self, loop, v_state):
        """A query tile's last P.V (the one no Q.K^T is issued with)."""
        loop.pipe_v.consumer_wait(v_state)
        self.wait_turn(loop.warpgroup)
        warpgroup.fence()
        self.issue_pv(loop, v_state.index)
        self.pass_turn(loop.warpgroup)
        warpgroup.wait_group(0)
        if cutlass.const_expr(self.o_over_v):
            pipe_v = loop.pipe_v
            if loop.warpgroup == 0:  # (warpgroup 1 stages O over this V stage: release_o_tile frees it)
                pipe_v.consumer_release(v_state)
        else:
            loop.pipe_v.consumer_release(v_state)
        v_state.advance()
        return v_state
