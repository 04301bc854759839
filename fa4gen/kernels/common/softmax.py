"""Online softmax over key tiles, in fp32 with exp2, for one thread's rows.

Scores arrive as a (rows, columns) register view. Four consecutive lanes share each row (the
wgmma C layout), so row maxima are reduced across the quad; row sums stay per-thread until the
end, when one quad reduction finishes them. Exponentials use base 2 with the softmax scale folded
into one FMA: p = exp2(s * scale_log2 - max * scale_log2).

FlashAttention-4's rescale threshold relieves the FMA pipe, a compile-time choice of the plan:
with ``rescale_threshold`` t > 0 (log2 units) a row keeps its stale running max until a tile's max
exceeds it by more than t, so probabilities may reach 2^t (harmless in fp32 sums and in bf16/fp16
P) and the O rescale is skipped by every warp whose rows all kept their max. (Its other idea,
part of the exponentials as a polynomial on the FMA units, measured slower on the H200 at every
share: docs/decisions.md#exp2-poly-period.)
With a threshold, key tiles without mask code can skip the tile's max altogether
(``stale_exponentials`` and ``settle``): exponentiated against the running max, a row whose sum
stays within 2^t kept its max by the threshold's own rule, and only a warp where some sum passed
it looks for the tile's max.

Row sums stay FADDs here: summing P on the tensor cores instead (P times a tile of ones beside
each P.V) measured slower (decision softmax-reductions).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

QUAD = 4  # lanes that share one row of a wgmma accumulator
LN2 = math.log(2.0)
# settle: a largest probability past this (2^120) is treated as overflowed, so the new
# reference's factor 2^-log2(p) stays a normal float
REGROW_LIMIT = 2.0**120


class OnlineSoftmax:
    def __init__(self, scale_log2: float, num_rows: int, rescale_threshold: float = 0.0):
        assert rescale_threshold >= 0.0
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.rescale_threshold = rescale_threshold

    @cute.jit
    def make_state(self):
        row_max = cute.make_rmem_tensor(cute.make_layout(self.num_rows), Float32)
        row_sum = cute.make_rmem_tensor(cute.make_layout(self.num_rows), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return row_max, row_sum

    @cute.jit
    def update(
        self, scores_mn: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, correction=None
    ) -> cute.Tensor:
        """Turn scores into unnormalised probabilities in place; return each row's correction,
        the factor the output accumulated so far must be multiplied by (see ``rescale``; written
        into ``correction`` where given)."""
        scale = Float32(self.scale_log2)
        if cutlass.const_expr(correction is None):
            correction = cute.make_rmem_tensor(cute.make_layout(self.num_rows), Float32)
        for r in cutlass.range_constexpr(cute.size(scores_mn, mode=[0])):
            tile_max = self._row_max(scores_mn, r)
            prev_max = row_max[r]
            new_max = cute.arch.fmax(prev_max, tile_max)
            if cutlass.const_expr(self.rescale_threshold > 0.0):
                # keep the stale max unless the row grew past the threshold (always from -inf)
                grown = (new_max - prev_max) * scale > Float32(self.rescale_threshold)
                new_max = Float32(cutlass.select_(grown, new_max, prev_max))
            # a row with no visible key so far keeps max -inf: use 0 so exp2 gives 0, never NaN
            safe_max = new_max
            if new_max == -Float32.inf:
                safe_max = Float32(0.0)
            max_scaled = safe_max * scale
            # exactly 1 when the max stayed: the threshold's skipped rescale tests for it
            correction[r] = Float32(
                cutlass.select_(
                    new_max == prev_max, Float32(1.0), cute.math.exp2(prev_max * scale - max_scaled, fastmath=True)
                )
            )
            row_max[r] = new_max
            tile_sum = self._exponentiate_row(scores_mn, r, max_scaled)
            row_sum[r] = row_sum[r] * correction[r] + tile_sum
        return correction

    @cute.jit
    def _row_max(self, scores_mn: cute.Tensor, r: int) -> Float32:
        """Row ``r``'s largest value, over the quad that shares the row: a running max, one
        dependent FMNMX per score (a balanced tree measured no faster: decision softmax-reductions)."""
        largest = scores_mn[r, 0]
        for c in cutlass.range_constexpr(1, cute.size(scores_mn, mode=[1])):
            largest = cute.arch.fmax(largest, scores_mn[r, c])
        return cute.arch.warp_reduction_max(largest, threads_in_group=QUAD)

    @cute.jit
    def _exponentiate_row(self, scores_mn: cute.Tensor, r: int, reference: Float32) -> Float32:
        """Row ``r``'s scores become 2^(s * scale - reference) in place; returns this thread's
        share of their sum."""
        row = scores_mn[r, None]  # one vector operation per step (see masking.column_offsets)
        probs = cute.math.exp2(row.load() * Float32(self.scale_log2) - reference, fastmath=True)
        row.store(probs)
        return probs.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)

    @cute.jit
    def stale_exponentials(self, scores_mn: cute.Tensor, row_max: cute.Tensor, tile_sum: cute.Tensor):
        """``update``'s exponentials without the tile's row max (``settle`` finishes the update).

        The scores are exponentiated against each row's running max as it stands, and each
        thread's share of the row sums goes into ``tile_sum``; a share bounds each of its terms, so
        ``settle`` can tell whether some probability passed 2^threshold. Where none did, that is
        exactly the threshold's outcome (the max is kept, the correction is 1), without the
        FMNMX, the quad shuffles and the correction's exponential (68 + 4 + 2 instructions per
        thread and 128-key tile). A row that has seen no key yet is exponentiated against 0 (no
        NaN) and always settled the slow way."""
        scale = Float32(self.scale_log2)
        for r in cutlass.range_constexpr(cute.size(scores_mn, mode=[0])):
            reference = row_max[r] * scale
            if row_max[r] == -Float32.inf:
                reference = Float32(0.0)
            tile_sum[r] = self._exponentiate_row(scores_mn, r, reference)

    @cute.jit
    def settle(
        self,
        scores_mn: cute.Tensor,
        row_max: cute.Tensor,
        row_sum: cute.Tensor,
        tile_sum: cute.Tensor,
        correction: cute.Tensor,
        recompute,
        restore,
    ):
        """After ``stale_exponentials``: the correction per row, into ``correction``.

        Where some row of the warp passed 2^threshold, the tile's largest probability is the new
        reference: the row's max grows by its log2, its probabilities, sum and O scale by its
        inverse, and ``restore()`` takes the scaled probabilities again (the caller stored P
        already). A probability past REGROW_LIMIT (fp32 overflows at 2^128) or a row without a
        key so far has lost what the max needs: ``recompute(scores_mn)`` puts the modified scores
        back and the plain ``update`` runs on them, then ``restore()``."""
        bound = Float32(2.0**self.rescale_threshold)
        over = False
        for r in cutlass.range_constexpr(cute.size(scores_mn, mode=[0])):
            correction[r] = Float32(1.0)
            # (NaN compares false and propagates, as in update)
            over = over | (tile_sum[r] > bound) | (row_max[r] == -Float32.inf)
        if cute.arch.vote_any_sync(over):
            top = cute.make_rmem_tensor(cute.make_layout(self.num_rows), Float32)
            lost = False
            for r in cutlass.range_constexpr(cute.size(scores_mn, mode=[0])):
                top[r] = self._row_max(scores_mn, r)
                lost = lost | (top[r] >= Float32(REGROW_LIMIT)) | (top[r] != top[r]) | (row_max[r] == -Float32.inf)
            if cute.arch.vote_any_sync(lost):
                recompute(scores_mn)
                self.update(scores_mn, row_max, row_sum, correction)
            else:
                self._regrow(scores_mn, row_max, row_sum, tile_sum, top, correction)
            restore()
        else:
            for r in cutlass.range_constexpr(cute.size(scores_mn, mode=[0])):
                row_sum[r] = row_sum[r] + tile_sum[r]

    @cute.jit
    def _regrow(
        self,
        scores_mn: cute.Tensor,
        row_max: cute.Tensor,
        row_sum: cute.Tensor,
        tile_sum: cute.Tensor,
        top: cute.Tensor,
        correction: cute.Tensor,
    ):
        """``settle`` where every row has a finite reference: rows whose largest probability
        ``top`` passed 2^threshold move their reference up to it."""
        bound = Float32(2.0**self.rescale_threshold)
        for r in cutlass.range_constexpr(cute.size(scores_mn, mode=[0])):
            grows = top[r] > bound
            growth = cute.math.log2(top[r], fastmath=True)
            factor = Float32(cutlass.select_(grows, cute.math.exp2(-growth, fastmath=True), Float32(1.0)))
            correction[r] = factor
            row_max[r] = Float32(
                cutlass.select_(grows, row_max[r] + growth * Float32(1.0 / self.scale_log2), row_max[r])
            )
            for c in cutlass.range_constexpr(cute.size(scores_mn, mode=[1])):
                scores_mn[r, c] = scores_mn[r, c] * factor
            row_sum[r] = (row_sum[r] + tile_sum[r]) * factor

    @cute.jit
    def rescale(self, out_mn: cute.Tensor, correction: cute.Tensor):
        """O *= correction per row; with a threshold, only in warps where some row moved its max.

        The skip is a branch, and no code after it is scheduled above it: the main loop converts
        P to 16 bits before calling this, in conversions LLVM cannot sink below the branch
        (layout.pack_pair_pinned), so they run between the exponentials."""
        if cutlass.const_expr(self.rescale_threshold > 0.0):
            moved = correction[0] != Float32(1.0)
            for r in cutlass.range_constexpr(1, cute.size(out_mn, mode=[0])):
                moved = moved | (correction[r] != Float32(1.0))
            if cute.arch.vote_any_sync(moved):
                self._multiply_rows(out_mn, correction)
        else:
            self._multiply_rows(out_mn, correction)

    @cute.jit
    def _multiply_rows(self, out_mn: cute.Tensor, correction: cute.Tensor):
        for r in cutlass.range_constexpr(cute.size(out_mn, mode=[0])):
            row = out_mn[r, None]
            row.store(row.load() * correction[r])

    @cute.jit
    def finalize(
        self,
        out_mn: cute.Tensor,
        row_max: cute.Tensor,
        row_sum: cute.Tensor,
        lse: cute.Tensor,
        sink=None,
        weights=None,
        row_sinks=None,
    ):
        """Normalise the output rows; write each row's natural-log LSE (-inf for empty rows).

        ``sink`` (a natural-log logit, or None): one more term exp(sink) in every row's
        denominator that carries no value (attention sinks); a row that sees no key then gets
        O = 0 and LSE = sink. ``weights`` (2 x rows, or None): a split tile's weight of the own
        O per row (applied here) and of another partial O (row_sum already counts both; the
        normalisation is folded into it in place, for the caller to add that O with).
        ``row_sinks`` (a tensor, one logit per row): a sink per row, where rows belong to
        different heads (decode's packed query heads)."""
        scale = Float32(self.scale_log2)
        for r in cutlass.range_constexpr(cute.size(out_mn, mode=[0])):
            total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=QUAD)
            top = row_max[r] * scale  # log2 units; -inf for a row without keys
            weight = Float32(1.0)  # what the accumulated O and total are worth at the final max
            if cutlass.const_expr(sink is not None or row_sinks is not None):
                sink_log2 = (sink if cutlass.const_expr(row_sinks is None) else row_sinks[r]) * Float32(1.0 / LN2)
                final = cute.arch.fmax(top, sink_log2)
                weight = cute.math.exp2(top - final, fastmath=True)
                total = total * weight + cute.math.exp2(sink_log2 - final, fastmath=True)
                top = final
            inv = Float32(0.0)
            lse[r] = -Float32.inf
            if total > Float32(0.0):
                inv = cute.arch.rcp_approx(total) * weight
                lse[r] = (top + cute.math.log2(total, fastmath=True)) * Float32(LN2)
            if cutlass.const_expr(weights is not None):
                rows = cute.size(out_mn, mode=[0])
                weights[rows + r] = weights[rows + r] * inv
                inv = inv * weights[r]
            row = out_mn[r, None]
            row.store(row.load() * inv)
