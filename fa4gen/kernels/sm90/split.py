"""The split tail on Hopper: the tile a CTA's run of key tiles cuts in two ends in two CTAs.

With the plan's ``split_tail`` the scheduler (scheduler.py) spreads the last full round and the
ragged one of a persistent head-major launch over every CTA as equal runs of key tiles, so a
tile may be cut between CTAs c and c + 1. Both run the ordinary main loop over their key tiles
(the tile info bounds them); only the end differs (``HopperAttentionForward.epilogue``):
- the writer (CTA c + 1, the tile's last key tiles, first of its run) leaves its unnormalised O,
  row maxima and per-thread row sums in global memory, in slot c + 1 of a workspace with one
  slot per CTA and consumer warpgroup, and every thread adds 1 to the slot's flag (release,
  GPU scope);
- the finisher (CTA c, the first key tiles, last of its run) waits until the flag counts all
  128 writer threads (acquire), lowers it again for the next launch (only then: a single raise
  by every thread would let a late one come after the lowering and leave it up, so that the next
  launch read a stale partial), merges the row statistics as the online softmax merges two key
  ranges, and writes the output as for a whole tile, the partial O added at its weight while O
  is rounded for the store.
Each thread stores and loads its own accumulator fragment, so no layout is shared but the
kernel's own, and consecutive threads touch consecutive words. The writer's run starts with its
part of the cut tile, so its flag rises while the finisher is still busy with its own whole
tiles: the wait is for memory, not for work.

The tile's role travels with its info as one word (``split``): 0 for a whole tile, -(slot + 1)
for a writer, slot + 1 for a finisher.

Two rules keep ptxas from serializing the kernel's wgmmas (C7519/C7520: a warpgroup arrive and
wait at every wgmma, which halved d128's speed even with no tile cut): no branch depends on the
thread (every thread counts itself into the flag; every warp spins on it with a vote as the
loop's condition), and O's registers, the P.V accumulator, are changed the same way on every path (the
statistics merge runs for every tile, only its loads are in a branch; the partial O goes into the
rounded copy that the store stages, in a branch that only reads the accumulator; a writer's output
is written too, past the last row, where the TMA store clips it away). Whole tiles pay no
arithmetic per O element for the split: an earlier merge weighed every tile's O with an empty
partial (an FMUL, an FFMA and a move per element), which measured slower (decision split-tail).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa4gen.arch import WARPGROUP_THREADS
from fa4gen.kernels.common.layout import rows_cols_view
from fa4gen.kernels.sm90.config import NamedBarrier

MERGE_CHUNK = 8  # O words a finisher loads per branch (columns of a row), or 4 where 8 do not divide them


class Sm90SplitTail:
    """Mixin for the Hopper forward kernel: needs softmax, num_consumers and a loop state with
    acc_o, row_max, row_sum, wtidx, split_work and split_flags."""

    @cute.jit
    def split_role(self, first: Int32, end: Int32, n_keys: Int32) -> Int32:
        """The ``split`` word of a segment of visited key tiles first .. end-1 (see above)."""
        cta = cute.arch.block_idx()[0]
        role = Int32(0)
        if first > 0:
            role = -(cta + 1)  # a writer: its own slot
        elif end < n_keys:
            role = cta + 2  # a finisher: its writer's slot, cta + 1
        return role

    @cute.jit
    def _flag(self, loop, slot: Int32, wg: Int32):
        return loop.split_flags.iterator + (slot * self.num_consumers + wg)

    @cute.jit
    def write_partial(self, loop, split: Int32, wg: Int32):
        """A writer (``split`` < 0: -(slot + 1)) leaves this warpgroup's part of the cut tile in
        its slot (O row by row, then the row maxima and sums); each thread then counts itself
        into the slot's flag with a release (its own stores before it), so the flag reaches
        WARPGROUP_THREADS once every word is visible. Other tiles do nothing here."""
        if split < 0:
            work = loop.split_work[-split - 1, wg, None, loop.wtidx]
            out = rows_cols_view(loop.acc_o)
            rows, cols = cute.size(out, mode=[0]), cute.size(out, mode=[1])
            for r in cutlass.range_constexpr(rows):
                for c in cutlass.range_constexpr(cols):
                    work[r * cols + c] = out[r, c]
                work[rows * cols + r] = loop.row_max[r]
                work[rows * cols + rows + r] = loop.row_sum[r]
            cute.arch.atomic_add(self._flag(loop, -split - 1, wg), Int32(1), sem="release", scope="gpu")

    @cute.jit
    def merge_stats(self, loop, split: Int32, wg: Int32) -> cute.Tensor:
        """Fold a finisher's partial row statistics (``split`` > 0: its slot + 1) into its own,
        once the writer's count is complete: both sides are weighed at the larger row max (a row
        that saw no key keeps max -inf and contributes 0, never NaN). Returns each row's weight
        of the own O, then of the writer's (``finalize`` folds 1 / sum into both; ``add_partial``
        uses the second). A whole tile (``split`` 0) merges empty statistics, weights 1 and 0:
        O's registers are left to the plain finalize on every path (a conditional change of the
        wgmma accumulator made ptxas copy it around the next wgmma, C7519), and the partial O is
        added only while it is rounded for the store (``add_partial``), outside the accumulator."""
        out = rows_cols_view(loop.acc_o)  # read for its shape only
        rows, cols = cute.size(out, mode=[0]), cute.size(out, mode=[1])
        stats = cute.make_rmem_tensor(cute.make_layout(2 * rows), Float32)  # maxima, then sums
        for r in cutlass.range_constexpr(rows):
            stats[r] = -Float32.inf
            stats[rows + r] = Float32(0.0)
        if split > 0:
            flag = self._flag(loop, split - 1, wg)
            seen = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
            # a warp-uniform loop: every lane waits for itself, until all the writer's threads
            # have counted in
            while cute.arch.vote_any_sync(seen < WARPGROUP_THREADS):
                seen = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
            # down again for the next launch, once every thread here has seen it up (and every
            # writer thread has counted in: no late arrival can raise it again)
            cute.arch.barrier(barrier_id=NamedBarrier.EPILOGUE + wg, number_of_threads=WARPGROUP_THREADS)
            cute.arch.store(flag, Int32(0), sem="relaxed", scope="gpu")
            work = loop.split_work[split - 1, wg, None, loop.wtidx]
            for i in cutlass.range_constexpr(2 * rows):
                stats[i] = work[rows * cols + i]
        scale = Float32(self.softmax.scale_log2)
        weights = cute.make_rmem_tensor(cute.make_layout(2 * rows), Float32)  # mine, then theirs
        for r in cutlass.range_constexpr(rows):
            top = cute.arch.fmax(loop.row_max[r], stats[r])
            safe = top
            if top == -Float32.inf:
                safe = Float32(0.0)
            weights[r] = cute.math.exp2(loop.row_max[r] * scale - safe * scale, fastmath=True)
            weights[rows + r] = cute.math.exp2(stats[r] * scale - safe * scale, fastmath=True)
            loop.row_sum[r] = loop.row_sum[r] * weights[r] + stats[rows + r] * weights[rows + r]
            loop.row_max[r] = top
        return weights

    @cute.jit
    def add_partial(self, loop, o_low: cute.Tensor, split: Int32, weights: cute.Tensor, wg: Int32):
        """A finisher (``split`` > 0) rounds its output again, now with the writer's O added at
        its weight (``weights`` after ``finalize``: the own O is already normalised in place),
        into ``o_low``, the 16-bit fragment the store stages: only ``o_low`` changes in the
        branch, never the accumulator. Loads go MERGE_CHUNK words at a time (a whole second O
        fragment spilled at dv = 256)."""
        if split > 0:
            out = rows_cols_view(loop.acc_o)
            low = rows_cols_view(o_low)
            rows, cols = cute.size(out, mode=[0]), cute.size(out, mode=[1])
            work = loop.split_work[split - 1, wg, None, loop.wtidx]
            width = MERGE_CHUNK if cols % MERGE_CHUNK == 0 else 4  # (dv is a multiple of 16: 4 divides dv / 4)
            chunk = cute.make_rmem_tensor(cute.make_layout(width), Float32)
            for r in cutlass.range_constexpr(rows):
                for c0 in cutlass.range_constexpr(0, cols, width):
                    for j in cutlass.range_constexpr(width):
                        chunk[j] = work[r * cols + c0 + j]
                    for j in cutlass.range_constexpr(width):
                        low[r, c0 + j] = (out[r, c0 + j] + chunk[j] * weights[rows + r]).to(o_low.element_type)
