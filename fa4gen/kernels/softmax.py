"""Online softmax over key tiles, in fp32 with exp2, for one thread's rows.

Scores arrive as a (rows, columns) register view. Four consecutive lanes share each row (the
wgmma C layout), so row maxima are reduced across the quad; row sums stay per-thread until the
end, when one quad reduction finishes them. Exponentials use base 2 with the softmax scale folded
into one FMA: p = exp2(s * scale_log2 - max * scale_log2).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

QUAD = 4  # lanes that share one row of a wgmma accumulator
LN2 = math.log(2.0)


class OnlineSoftmax:
    def __init__(self, scale_log2: float, num_rows: int):
        self.scale_log2 = scale_log2
        self.num_rows = num_rows

    @cute.jit
    def make_state(self):
        row_max = cute.make_rmem_tensor(cute.make_layout(self.num_rows), Float32)
        row_sum = cute.make_rmem_tensor(cute.make_layout(self.num_rows), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return row_max, row_sum

    @cute.jit
    def update(self, scores_mn: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor) -> cute.Tensor:
        """Turn scores into unnormalised probabilities in place; return each row's correction,
        the factor the output accumulated so far must be multiplied by (see ``rescale``)."""
        scale = Float32(self.scale_log2)
        correction = cute.make_rmem_tensor(cute.make_layout(self.num_rows), Float32)
        for r in cutlass.range_constexpr(cute.size(scores_mn, mode=[0])):
            tile_max = scores_mn[r, 0]
            for c in cutlass.range_constexpr(1, cute.size(scores_mn, mode=[1])):
                tile_max = cute.arch.fmax(tile_max, scores_mn[r, c])
            tile_max = cute.arch.warp_reduction_max(tile_max, threads_in_group=QUAD)
            prev_max = row_max[r]
            new_max = cute.arch.fmax(prev_max, tile_max)
            # a row with no visible key so far keeps max -inf: use 0 so exp2 gives 0, never NaN
            safe_max = new_max
            if new_max == -Float32.inf:
                safe_max = Float32(0.0)
            max_scaled = safe_max * scale
            correction[r] = cute.math.exp2(prev_max * scale - max_scaled, fastmath=True)
            row_max[r] = new_max
            for c in cutlass.range_constexpr(cute.size(scores_mn, mode=[1])):
                scores_mn[r, c] = cute.math.exp2(scores_mn[r, c] * scale - max_scaled, fastmath=True)
            tile_sum = scores_mn[r, None].load().reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            row_sum[r] = row_sum[r] * correction[r] + tile_sum
        return correction

    @cute.jit
    def rescale(self, out_mn: cute.Tensor, correction: cute.Tensor):
        for r in cutlass.range_constexpr(cute.size(out_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(out_mn, mode=[1])):
                out_mn[r, c] = out_mn[r, c] * correction[r]

    @cute.jit
    def finalize(self, out_mn: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, lse: cute.Tensor):
        """Normalise the output rows; write each row's natural-log LSE (-inf for empty rows)."""
        scale = Float32(self.scale_log2)
        for r in cutlass.range_constexpr(cute.size(out_mn, mode=[0])):
            total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=QUAD)
            inv = Float32(0.0)
            lse[r] = -Float32.inf
            if total > Float32(0.0):
                inv = cute.arch.rcp_approx(total)
                lse[r] = (row_max[r] * scale + cute.math.log2(total, fastmath=True)) * Float32(LN2)
            for c in cutlass.range_constexpr(cute.size(out_mn, mode=[1])):
                out_mn[r, c] = out_mn[r, c] * inv
