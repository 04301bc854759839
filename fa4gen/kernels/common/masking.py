"""Structural masks: the keys each query row sees, which key tiles a query tile needs, and which
of those need mask code.

Every structural mask gives query row i one visible key interval [start(i), end(i)):
- plain: [0, Sk); positions aligned bottom-right, so row i sits at key position p = i + Sk - Sq;
- causal / windows: end <= p + right + 1, start >= p - left;
- chunked(C): start >= (p // C) * C and end <= p + 1 (causal within the chunk);
- prefix-LM: [0, max(p + 1, prefix[b])), the prefix length a run-time tensor per batch;
- document (packed sequences): the interval of the row's own document, with p aligned to that
  document's end, combined with causal / windows as above; the caller computes it per row from
  cu_seqlens (fa4gen.runtime.document_tables), so the kernel reads it with one load, and per
  query tile its document's bounds, so a tile inside one document needs no load per row.
Rows without keys get an empty interval at their start.
Both start(i) and end(i) never decrease with i, so a query tile's key range comes from its first
and last rows alone: tiles in [n_min, split_lo) and [split_hi, n_max) are masked boundary tiles,
tiles in [split_lo, split_hi) are interior (no mask code), and the rest are never loaded. Tiles
at or past split_lo lie at or past every row's start: their mask compares the end alone (one
compare per score), and only tiles below split_lo compare the start too.
"""

from __future__ import annotations

import array
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import arith


def column_offsets(coords_mn: cute.Tensor, row_shape) -> cute.TensorSSA:
    """Each register's column offset from the thread's first column, one row's worth as a constant
    vector shaped ``row_shape``: in an MMA accumulator layout the same for every thread (the
    column mode's strides are static; checked here while tracing)."""
    cols = cute.size(coords_mn, mode=[1])
    columns = [cute.crd2idx((0, c), coords_mn.layout)[1] for c in range(cols)]
    assert all(isinstance(c, int) for c in columns), f"column offsets are not static: {coords_mn.layout}"
    vector = ir.VectorType.get([cols], Int32.mlir_type)
    values = array.array("i", [c - columns[0] for c in columns])
    return cute.TensorSSA(arith.constant(vector, ir.DenseElementsAttr.get(values, type=vector)), row_shape, Int32)


class KeyTileRange:
    """Compile-time mask structure; run-time sizes and tensors (prefix lengths, document key
    ranges) come in as arguments (``args``: the variant's run-time values, see
    fa4gen.kernels.common.variant)."""

    def __init__(
        self,
        tile_m: int,
        tile_n: int,
        left: Optional[int],
        right: Optional[int],
        chunk: Optional[int] = None,
        prefix: bool = False,
        document: bool = False,
        first_keys_masked: bool = False,
    ):
        self.tile_m, self.tile_n = tile_m, tile_n
        self.left, self.right, self.chunk = left, right, chunk
        self.prefix, self.document = prefix, document
        # no row sees its first key in an interior tile (a stale max needs one seen before: see
        # bounds_of_rows); only a right bound can leave a row's keys below the tiles above
        self.first_keys_masked = first_keys_masked and (right is not None or prefix or document)

    @property
    def starts_at_zero(self) -> bool:
        """Whether every row's interval starts at key 0 (no left window, chunk or document)."""
        return self.left is None and self.chunk is None and not self.document

    @property
    def structural(self) -> bool:
        """Whether any bound beyond the ragged end of Sk exists."""
        return self.left is not None or self.right is not None or self.chunk is not None or self.prefix or self.document

    @cute.jit
    def row_range(self, row: Int32, batch: Int32, seqlen_q: Int32, seqlen_k: Int32, args):
        """[start, end) of the keys query row ``row`` sees (end <= start: none)."""
        if cutlass.const_expr(self.document):  # the caller's table holds every bound
            start, end = args.doc_key_ranges[row, 0], args.doc_key_ranges[row, 1]
        else:
            start, end = self.formula_row_range(row, batch, seqlen_q, seqlen_k, args)
        return start, end

    @cute.jit
    def formula_row_range(self, row: Int32, batch: Int32, seqlen_q: Int32, seqlen_k: Int32, args):
        """``row_range`` of every mask but documents, from the sizes (and prefix lengths)."""
        position = row + seqlen_k - seqlen_q
        start, end = self.window_range(position, Int32(0), seqlen_k)
        if cutlass.const_expr(self.chunk is not None):
            start = cutlass.max(start, cutlass.max(position, 0) // self.chunk * self.chunk)
        if cutlass.const_expr(self.prefix):
            end = cutlass.min(cutlass.max(position + 1, args.prefix_lengths[batch]), seqlen_k)
        # a row without keys gets the empty interval [start, start): ends never decrease then
        end = cutlass.max(end, start)
        return start, end

    @cute.jit
    def window_range(self, position: Int32, start: Int32, end: Int32):
        """[start, end) cut by the causal / window bounds around key ``position`` (the row's)."""
        if cutlass.const_expr(self.right is not None):
            end = cutlass.min(end, position + self.right + 1)
        if cutlass.const_expr(self.left is not None):
            start = cutlass.max(start, position - self.left)
        return start, end

    @cute.jit
    def bounds(self, m_block: Int32, batch: Int32, seqlen_q: Int32, seqlen_k: Int32, args):
        """(n_min, split_lo, split_hi, n_max) for query tile ``m_block``; n_max <= n_min: no keys."""
        first_row = m_block * self.tile_m
        last_row = cutlass.min(first_row + self.tile_m, seqlen_q) - 1
        first_start, first_end = self.row_range(first_row, batch, seqlen_q, seqlen_k, args)
        last_start, last_end = self.row_range(last_row, batch, seqlen_q, seqlen_k, args)
        return self.bounds_of_rows(first_start, first_end, last_start, last_end, seqlen_k)

    @cute.jit
    def bounds_of_rows(self, first_start: Int32, first_end: Int32, last_start: Int32, last_end: Int32, seqlen_k: Int32):
        """``bounds`` from the key ranges of a query tile's first and last rows."""
        tile_n = self.tile_n
        n_min = cutlass.max(first_start, 0) // tile_n
        n_max = cute.ceil_div(cutlass.max(last_end, 0), tile_n)
        # from split_lo up, tiles start at or past every row's start; below split_hi they end at
        # or before every row's end (and Sk: the ragged last tile is masked). A tile that both
        # bounds cut lies below split_lo, with the tiles whose mask compares the start.
        split_lo = cute.ceil_div(cutlass.max(last_start, 0), tile_n)
        split_hi = cutlass.min(cutlass.max(first_end, 0), seqlen_k) // tile_n
        if cutlass.const_expr(self.first_keys_masked):
            # every row sees the interior tiles, and a row sees none of the tiles above them
            # only where its keys end at their top: the first row, ending at a tile boundary
            # (never with Sq = Sk causal tiles, whose first row ends one past a multiple of 64).
            # That tile then counts as crossing the bound, so the row meets its first key in mask code.
            split_hi = (cutlass.min(cutlass.max(first_end, 1), seqlen_k) - 1) // tile_n
        split_lo = cutlass.max(cutlass.min(split_lo, n_max), n_min)
        split_hi = cutlass.max(cutlass.min(split_hi, n_max), split_lo)
        return n_min, split_lo, split_hi, n_max

    @cute.jit
    def rows_tile_end(self, first_row: Int32, batch: Int32, seqlen_q: Int32, seqlen_k: Int32, args) -> Int32:
        """One past the highest key tile that rows first_row .. first_row+63 (the rows of one
        warpgroup, those below Sq) can see; 0 when none of them is below Sq."""
        end = Int32(0)
        if first_row < seqlen_q:
            _, last_end = self.row_range(cutlass.min(first_row + 63, seqlen_q - 1), batch, seqlen_q, seqlen_k, args)
            end = cute.ceil_div(cutlass.max(last_end, 0), self.tile_n)
        return end

    @cute.jit
    def row_ranges(
        self,
        coords_mn: cute.Tensor,
        row_base: Int32,
        batch: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        args,
        document=None,
    ):
        """The visible interval of each of this thread's rows, once per query tile. ``document``:
        for packed documents, the tile's (single, shift, key start, key end) from the caller's
        ranking (runtime.document_tables): a tile whose rows all lie in one document computes
        them from its bounds (row + shift is the row's key position), with no load per row."""
        rows = cute.size(coords_mn, mode=[0])
        starts = cute.make_rmem_tensor(cute.make_layout(rows), Int32)
        ends = cute.make_rmem_tensor(cute.make_layout(rows), Int32)
        if cutlass.const_expr(document is not None):
            single, shift, key_start, key_end = document
            if single != 0:
                for r in cutlass.range_constexpr(rows):
                    row = cutlass.min(row_base + coords_mn[r, 0][0], seqlen_q - 1)
                    start, end = self.window_range(row + shift, key_start, key_end)
                    starts[r], ends[r] = start, cutlass.max(end, start)
            else:
                self._rows_by_range(starts, ends, coords_mn, row_base, batch, seqlen_q, seqlen_k, args)
        else:
            self._rows_by_range(starts, ends, coords_mn, row_base, batch, seqlen_q, seqlen_k, args)
        return starts, ends

    @cute.jit
    def _rows_by_range(
        self,
        starts: cute.Tensor,
        ends: cute.Tensor,
        coords_mn: cute.Tensor,
        row_base: Int32,
        batch: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        args,
    ):
        """``row_ranges`` row by row through ``row_range`` (formula, or the documents' table)."""
        for r in cutlass.range_constexpr(cute.size(coords_mn, mode=[0])):
            row = cutlass.min(row_base + coords_mn[r, 0][0], seqlen_q - 1)  # rows past Sq are discarded
            starts[r], ends[r] = self.row_range(row, batch, seqlen_q, seqlen_k, args)

    @cute.jit
    def apply(
        self,
        scores_mn: cute.Tensor,
        coords_mn: cute.Tensor,
        starts: cute.Tensor,
        ends: cute.Tensor,
        col_base: Int32,
        check_start=True,
    ):
        """Set scores outside their row's visible interval to -inf (in place). Per score one compare
        of its constant column offset against a per-row limit, and a select: no control flow, no
        address arithmetic per score. ``check_start``: whether the key tile may lie below a row's
        start (below split_lo, see bounds_of_rows), which costs a second compare per score; a
        Python bool, or a run-time flag that selects one of the two traced forms per tile."""
        if cutlass.const_expr(self.starts_at_zero or isinstance(check_start, bool)):
            self._apply(scores_mn, coords_mn, starts, ends, col_base, not self.starts_at_zero and check_start)
        elif check_start:
            self._apply(scores_mn, coords_mn, starts, ends, col_base, True)
        else:
            self._apply(scores_mn, coords_mn, starts, ends, col_base, False)

    @cute.jit
    def _apply(
        self,
        scores_mn: cute.Tensor,
        coords_mn: cute.Tensor,
        starts: cute.Tensor,
        ends: cute.Tensor,
        col_base: Int32,
        check_start: cutlass.Constexpr[bool],
    ):
        """``apply`` with the start compare traced or not: one vector operation per row and step
        (LLVM splits them into the per-score compares and selects; traced per score they cost
        seconds of compile time)."""
        first_col = col_base + coords_mn[0, 0][1]  # this thread's first column
        offsets = column_offsets(coords_mn, scores_mn[0, None].shape)
        for r in cutlass.range_constexpr(cute.size(scores_mn, mode=[0])):
            visible = visible_columns(offsets, first_col, starts[r], ends[r], check_start)
            row = scores_mn[r, None]
            row.store(cute.where(visible, row.load(), -cutlass.Float32.inf))

    @cute.jit
    def key_query_range(self, key: Int32, batch: Int32, seqlen_q: Int32, seqlen_k: Int32, args):
        """[lo, hi) of the query rows that see key ``key`` (the backward's view of the mask, one
        key per accumulator row): the row_range intervals read the other way. Both never
        decrease with the key; keys past Sk get an empty range."""
        if cutlass.const_expr(self.document):  # the caller's table (runtime.document_query_ranges)
            row = cutlass.min(key, seqlen_k - 1)
            lo, hi = args.doc_query_ranges[row, 0], args.doc_query_ranges[row, 1]
            if key >= seqlen_k:
                lo = hi
        else:
            lo, hi = self.formula_query_range(key, batch, seqlen_q, seqlen_k, args)
        return lo, hi

    @cute.jit
    def formula_query_range(self, key: Int32, batch: Int32, seqlen_q: Int32, seqlen_k: Int32, args):
        """``key_query_range`` of every mask but documents. A row at key position p sees k when
        p - left <= k <= p + right, when k lies in p's chunk (p // C * C <= k <= p), or,
        prefix-LM, when k < its batch entry's prefix length or k <= p."""
        shift = seqlen_k - seqlen_q  # a row's key position is row + shift
        lo, hi = Int32(0), seqlen_q
        if cutlass.const_expr(self.prefix):  # (its end replaces a right bound's: formula_row_range)
            if key >= args.prefix_lengths[batch]:
                lo = cutlass.max(lo, key - shift)
        elif cutlass.const_expr(self.right is not None):
            lo = cutlass.max(lo, key - shift - self.right)
        if cutlass.const_expr(self.left is not None):
            hi = cutlass.min(hi, key - shift + self.left + 1)
        if cutlass.const_expr(self.chunk is not None):
            lo = cutlass.max(lo, key - shift)
            hi = cutlass.min(hi, (key // self.chunk + 1) * self.chunk - shift)
        lo = cutlass.min(lo, seqlen_q)
        if key >= seqlen_k:
            hi = lo
        return lo, cutlass.max(hi, lo)

    @cute.jit
    def query_tiles_of_keys(self, n_block: Int32, batch: Int32, seqlen_q: Int32, seqlen_k: Int32, args):
        """[m_min, m_max) of the query tiles that see some key of key tile ``n_block``: the
        first key's lowest row and the last key's highest. A tile no row sees gets the empty
        range at its first key's lowest row, rounded up, so both ends never decrease with the
        key tile (also where documents or windows leave tiles without queries between others)."""
        first_key = n_block * self.tile_n
        last_key = cutlass.min(first_key + self.tile_n, seqlen_k) - 1
        lo, _ = self.key_query_range(first_key, batch, seqlen_q, seqlen_k, args)
        _, hi = self.key_query_range(last_key, batch, seqlen_q, seqlen_k, args)
        m_min = lo // self.tile_m
        m_max = cute.ceil_div(hi, self.tile_m)
        if first_key >= seqlen_k or hi <= lo:
            m_min = cute.ceil_div(lo, self.tile_m)
            m_max = m_min
        return m_min, m_max

    @cute.jit
    def key_tiles_before(self, n_block: Int32, m_block: Int32, batch: Int32, seqlen_q: Int32, seqlen_k: Int32, args):
        """How many key tiles below ``n_block`` walk query tile ``m_block`` (which ``n_block``
        walks): the deterministic backward's turn at that tile's dQ. Both ends of the key
        tiles' query tiles never decrease, so a binary search finds the first tile whose query
        tiles end past ``m_block``, and every tile from it up to ``n_block`` that has queries
        walks it: their count, from the documents' table of tiles with queries below each
        tile (documents), or all of them (the formula masks leave no tile without queries
        between two with)."""
        first = Int32(0)
        before = n_block
        if cutlass.const_expr(self.structural):
            last = n_block
            while first < last:
                middle = (first + last) // 2
                _, ends = self.query_tiles_of_keys(middle, batch, seqlen_q, seqlen_k, args)
                if ends > m_block:
                    last = middle
                else:
                    first = middle + 1
            before = n_block - first
            if cutlass.const_expr(self.document):
                ranks = args.doc_query_ranges
                before = ranks[n_block * self.tile_n, 2] - ranks[first * self.tile_n, 2]
        return before

    @cute.jit
    def key_tiles_after(self, n_block: Int32, m_block: Int32, batch: Int32, seqlen_q: Int32, seqlen_k: Int32, args):
        """How many key tiles above ``n_block`` walk query tile ``m_block`` (which ``n_block``
        walks): the deterministic backward's turn in descending order. The query tile of each
        key tile's first key's lowest row never decreases (also where a tile has no queries), so
        a binary search finds the last tile whose rows start at or below ``m_block``; every tile
        from ``n_block`` up to it that has queries ends past ``m_block`` (their ends never
        decrease) and walks it: their count, from the documents' table of tiles with queries
        below each tile (documents), or all of them."""
        first, last = n_block, cute.ceil_div(seqlen_k, self.tile_n) - 1
        while first < last:
            middle = (first + last + 1) // 2
            lowest, _ = self.key_query_range(middle * self.tile_n, batch, seqlen_q, seqlen_k, args)
            if lowest // self.tile_m <= m_block:
                first = middle
            else:
                last = middle - 1
        after = first - n_block
        if cutlass.const_expr(self.document):
            ranks = args.doc_query_ranges
            starts, ends = self.query_tiles_of_keys(first, batch, seqlen_q, seqlen_k, args)
            walks = Int32(0)
            if ends > starts:
                walks = Int32(1)
            after = ranks[first * self.tile_n, 2] + walks - ranks[n_block * self.tile_n, 2] - 1
        return after


@cute.jit
def visible_columns(offsets: cute.TensorSSA, first_col: Int32, start: Int32, end: Int32, check_start: bool):
    """Which of a row's columns (``offsets`` from the thread's first column ``first_col``) lie in
    [start, end), as one vector compare (``check_start``: False where start lies at or below
    every column)."""
    visible = offsets < end - first_col
    if cutlass.const_expr(check_start):
        visible = visible & (offsets >= start - first_col)
    return visible
