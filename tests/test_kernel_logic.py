"""The kernel's tile logic, run on the CPU: CuTe DSL executes `@cute.jit` host functions here, so
these tests call the kernel's own scheduler, tile bounds, key-tile order and mask flags (no GPU,
no copy of the logic) and check them against brute force.

- Schedules: every order hands out every (query tile, head, batch) exactly once, for persistent
  grids of any size (as many CTAs as work units too), with the structure each order promises.
- Key tiles: for every structural mask, the key tiles a query tile visits are exactly the ones
  holding a key one of its rows sees (fa4gen.testing.visible_keys, written independently), each
  once, in the promised order; every tile that is not fully visible runs the mask code, and a
  3-warpgroup kernel's warpgroup passes by only tiles none of its rows sees.
- Per-thread masking: each thread's wgmma fragment coordinates, row intervals and applied mask
  reproduce visible_keys score by score.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Int32
from cutlass.cute.runtime import from_dlpack

import fa4gen
from fa4gen.kernels.common.layout import rows_cols_view
from fa4gen.kernels.common.scheduler import TileScheduler
from fa4gen.kernels.common.variant import VariantArgs
from fa4gen.kernels.sm90.state import LaunchSizes
from fa4gen.planner.sm90_tables import PAIR_TAIL_MIN_TILES
from fa4gen.runtime import document_query_ranges, document_tables
from fa4gen.testing import visible_keys
from fa4gen.variants import lower


@cute.jit
def _store_row(out: cute.Tensor, row: Int32, values: tuple):
    """out[row, j] = values[j] for every j."""
    for j in cutlass.range_constexpr(len(values)):
        out[row, j] = values[j]


def _walk(
    scheduler: TileScheduler,
    num_m_blocks: int,
    heads: int,
    batches: int,
    grid: int,
    seqlen_k: int,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """(cta, item, m_block, head, batch, tile, rank) of every valid item of every CTA, in issue
    order (``order``: the ranking of a ranked scheduler, the kernel's first column of it)."""
    units = num_m_blocks * heads * batches
    rows = grid * (2 * (units // grid + 1) + 8 + 2 * heads * batches // grid)  # room for a tail's items
    out = torch.full((rows, 7), -1, dtype=torch.int32)
    order = torch.arange(max(num_m_blocks, 1), dtype=torch.int32) if order is None else order
    order = order.view(-1, 1).contiguous()

    @cute.jit
    def run(
        out: cute.Tensor,
        order: cute.Tensor,
        num_m_blocks: Int32,
        num_heads: Int32,
        num_batches: Int32,
        grid: Int32,
        seqlen_k: Int32,
    ):
        heads_batches = num_heads * num_batches
        pairs = scheduler.pairs_now(seqlen_k)
        items = scheduler.items_per_cta(num_m_blocks, heads_batches, grid, pairs)
        for cta in cutlass.range(grid, unroll=1):
            for item in cutlass.range(items, unroll=1):
                tile = scheduler.tile_of(item, cta, num_m_blocks, heads_batches, grid, pairs)
                if scheduler.valid(tile, num_m_blocks, heads_batches, grid, pairs):
                    m_block, head, batch, rank = scheduler.decode(
                        tile, num_m_blocks, num_heads, num_batches, grid, pairs, order
                    )
                    _store_row(out, cta * items + item, (cta, item, m_block, head, batch, tile, rank))

    run(from_dlpack(out), from_dlpack(order), num_m_blocks, heads, batches, grid, seqlen_k)
    return out[out[:, 0] >= 0]


def _assert_every_tile_once(walked: torch.Tensor, num_m_blocks: int, heads: int, batches: int) -> None:
    seen = sorted(map(tuple, walked[:, 2:5].tolist()))
    expected = [(m, h, b) for m in range(num_m_blocks) for h in range(heads) for b in range(batches)]
    assert seen == sorted(expected)


SIZES = [(6, 4, 2), (7, 3, 1), (1, 5, 3), (33, 2, 2), (4, 1, 1)]  # (query tiles, heads, batches)


@pytest.mark.parametrize("order", ["head_major", "heavy_first", "paired"])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "m{}-h{}-b{}".format(*s))
@pytest.mark.parametrize("grid", [1, 5, 132, 0], ids=lambda g: f"grid{g}" if g else "grid-units")
def test_every_order_hands_out_every_tile_once(order, size, grid):
    """Persistent grids smaller and larger than the work, and one CTA per unit (grid 0 here:
    as many CTAs as work units)."""
    scheduler = TileScheduler(order)
    m, h, b = size
    if grid == 0:
        grid = m * h * b if order != "paired" else (m // 2 + m % 2) * h * b
    walked = _walk(scheduler, m, h, b, grid, seqlen_k=1000)
    _assert_every_tile_once(walked, m, h, b)
    if order == "paired":  # an item pair of one CTA: tiles M-1-j and j of one head, equal work
        for first, second in zip(walked[:-1].tolist(), walked[1:].tolist()):
            if first[0] == second[0] and first[1] % 2 == 0 and second[1] == first[1] + 1:
                assert first[2] + second[2] == m - 1 and first[3:5] == second[3:5]
    if order == "heavy_first":  # each CTA goes from heavier (higher) query tiles to lighter ones
        for cta in walked[:, 0].unique().tolist():
            mine = walked[walked[:, 0] == cta][:, 2].tolist()
            assert mine == sorted(mine, reverse=True)


TAIL_SIZES = [(20, 3, 1), (21, 4, 2), (33, 2, 2), (86, 5, 1), (43, 7, 2)]  # at least PAIR_TAIL_MIN_TILES


@pytest.mark.parametrize("tail_rounds", [1, 2])
@pytest.mark.parametrize("size", TAIL_SIZES, ids=lambda s: "m{}-h{}-b{}".format(*s))
@pytest.mark.parametrize("grid", [1, 5, 7, 132])
def test_paired_tail_hands_out_every_tile_once_heaviest_first(tail_rounds, size, grid):
    """Pairs in whole rounds, then the rest as single tiles: every tile once; each CTA's pairs
    join M-1-j and j of one head; after them its tiles never get heavier."""
    m, h, b = size
    assert m >= PAIR_TAIL_MIN_TILES
    scheduler = TileScheduler("paired", tail_rounds=tail_rounds, tail_min_tiles=PAIR_TAIL_MIN_TILES)
    walked = _walk(scheduler, m, h, b, grid, seqlen_k=1000)
    _assert_every_tile_once(walked, m, h, b)
    front = max((m // 2) * h * b // grid - tail_rounds, 0)
    for cta in walked[:, 0].unique().tolist():
        mine = walked[walked[:, 0] == cta]
        pairs, tail = mine[mine[:, 1] < 2 * front], mine[mine[:, 1] >= 2 * front]
        assert len(pairs) == 2 * front  # whole rounds: every CTA runs as many pairs
        for first, second in zip(pairs[0::2].tolist(), pairs[1::2].tolist()):
            assert first[2] + second[2] == m - 1 and first[3:5] == second[3:5]
        assert tail[:, 2].tolist() == sorted(tail[:, 2].tolist(), reverse=True)  # query tile m: m + 1 key tiles


@pytest.mark.parametrize("size", [s for s in SIZES if s[0] < 20] + [(19, 3, 2)], ids=lambda s: "m{}-h{}-b{}".format(*s))
@pytest.mark.parametrize("grid", [1, 7, 132])
def test_paired_tail_only_with_many_query_tiles(size, grid):
    """Below PAIR_TAIL_MIN_TILES query tiles per head the schedule is the one without a tail."""
    m, h, b = size
    assert m < PAIR_TAIL_MIN_TILES
    scheduler = TileScheduler("paired", tail_rounds=2, tail_min_tiles=PAIR_TAIL_MIN_TILES)
    with_tail = _walk(scheduler, m, h, b, grid, seqlen_k=1000)
    assert torch.equal(with_tail, _walk(TileScheduler("paired"), m, h, b, grid, seqlen_k=1000))


@pytest.mark.parametrize(
    "size, grid",
    [((86, 32, 1), 132), ((43, 32, 2), 132), ((128, 16, 1), 132), ((43, 21, 2), 132), ((64, 10, 2), 132)],
    ids=["d64-16k", "d64-8k", "d128-16k", "d96-8k", "d192-8k"],
)
def test_paired_tail_balances_the_last_round(size, grid):
    """The grid's causal cells on 132 SMs: work per CTA (query tile m costs m + 1 key tiles)
    within 2% of an even split with the tail, and below whole rounds of pairs (2.3-5.5% over it)."""
    m, h, b = size
    ideal = m * (m + 1) / 2 * h * b / grid

    def slowest(scheduler):
        walked = _walk(scheduler, m, h, b, grid, seqlen_k=1000)
        _assert_every_tile_once(walked, m, h, b)
        work = torch.zeros(grid)
        work.index_add_(0, walked[:, 0].long(), (walked[:, 2] + 1).float())
        return work.max().item()

    with_tail = slowest(TileScheduler("paired", tail_rounds=2, tail_min_tiles=PAIR_TAIL_MIN_TILES))
    assert with_tail <= 1.02 * ideal
    assert with_tail < slowest(TileScheduler("paired"))  # 1.023-1.055x the even split: what the tail mends


def _walk_split(num_m_blocks: int, heads: int, grid: int, n_keys: int, min_keys: int = 1) -> torch.Tensor:
    """(cta, item, tile, first, end) of every valid item of a split-tail head-major schedule, in
    issue order: the kernel's own scheduler calls (TileScheduler.split_segment)."""
    scheduler = TileScheduler("head_major", split_tail=True, split_min_keys=min_keys)
    rows = grid * (num_m_blocks * heads // grid + 4)
    out = torch.full((rows, 5), -1, dtype=torch.int32)

    @cute.jit
    def run(out: cute.Tensor, num_m_blocks: Int32, heads: Int32, grid: Int32, n_keys: Int32):
        items = scheduler.items_per_cta(num_m_blocks, heads, grid, False, n_keys)
        for cta in cutlass.range(grid, unroll=1):
            split_run = scheduler.split_run(cta, num_m_blocks, heads, grid, n_keys)
            for item in cutlass.range(items, unroll=1):
                tile = scheduler.tile_of(item, cta, num_m_blocks, heads, grid, False)
                ok = scheduler.valid(tile, num_m_blocks, heads, grid, False)
                tile, ok, first, end = scheduler.split_segment(item, split_run, n_keys, tile, ok)
                if ok:
                    _store_row(out, cta * items + item, (cta, item, tile, first, end))

    run(from_dlpack(out), num_m_blocks, heads, grid, n_keys)
    return out[out[:, 0] >= 0]


@pytest.mark.parametrize(
    "size, grid, n_keys",
    [
        ((128, 16), 132, 128),
        ((32, 64), 132, 32),
        ((8, 256), 132, 8),
        ((86, 32), 132, 86),
        ((22, 128), 132, 22),
        ((7, 3), 5, 1),
        ((7, 3), 5, 9),
        ((33, 4), 7, 33),
        ((5, 5), 7, 3),
        ((4, 1), 5, 6),
        ((12, 11), 132, 17),
    ],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_split_tail_runs_every_key_tile_once_in_equal_runs(size, grid, n_keys):
    """Every (tile, key tile) once; the items before the split tail are whole tiles; the tail
    gives every CTA a run within one key tile of the others; a cut tile has one writer (its last
    key tiles, the first item of CTA c + 1's tail) and one finisher (its first key tiles, the
    last item of CTA c): the slot protocol of fa4gen.kernels.sm90.split."""
    m, h = size
    units = m * h
    walked = _walk_split(m, h, grid, n_keys).tolist()
    covered = torch.zeros(units, n_keys, dtype=torch.int32)
    for _, _, tile, first, end in walked:
        covered[tile, first:end] += 1
    assert torch.equal(covered, torch.ones_like(covered))
    rounds, rest = divmod(units, grid)
    start = (rounds - 1) * grid if rest and rounds else units
    tail = [row for row in walked if row[2] >= start]
    assert all(row[3] == 0 and row[4] == n_keys for row in walked if row[2] < start)
    if start == units:
        assert not tail and len(walked) == units
        return
    runs = torch.zeros(grid, dtype=torch.int64)
    for cta, _, _, first, end in tail:
        runs[cta] += end - first
    assert runs.max() - runs.min() <= 1 and runs.min() >= n_keys
    for cta in range(grid):
        mine = [row for row in tail if row[0] == cta]
        assert 1 <= len(mine) <= 3 and [row[2] for row in mine] == sorted(row[2] for row in mine)
        for position, (_, _, tile, first, end) in enumerate(mine):
            if first > 0:  # a writer: the first of its run, and its finisher is the CTA before it
                assert position == 0 and end == n_keys
                finisher = [row for row in tail if row[2] == tile and row[3] == 0]
                assert len(finisher) == 1 and finisher[0][0] == cta - 1 and finisher[0][4] == first
                assert finisher[0] == [row for row in tail if row[0] == cta - 1][-1]
            elif end < n_keys:  # a finisher: the last of its run
                assert position == len(mine) - 1


def test_split_tail_only_with_enough_key_tiles():
    """Below the plan's split_tail_min_key_tiles the launch runs whole tiles only, exactly the
    schedule without a split tail."""
    walked = _walk_split(32, 64, 132, 31, min_keys=32)
    assert all(row[3] == 0 and row[4] == 31 for row in walked.tolist()) and len(walked) == 32 * 64
    plain = _walk(TileScheduler("head_major"), 32, 64, 1, 132, seqlen_k=1000)
    assert walked[:, 2].tolist() == plain[:, 5].tolist()
    assert (_walk_split(32, 64, 132, 32, min_keys=32)[:, 3] > 0).any()


def test_ranked_heavy_first_follows_the_given_order():
    """Packed documents: the query tiles come in the order of the run-time ranking."""
    order = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32)
    walked = _walk(TileScheduler("heavy_first", ranked=True), 5, 2, 1, grid=1, seqlen_k=700, order=order)
    _assert_every_tile_once(walked, 5, 2, 1)
    assert walked[:, 2].tolist() == [3, 3, 0, 0, 4, 4, 1, 1, 2, 2]
    assert walked[:, 6].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # the row of the ranking each came from


@pytest.mark.parametrize("num_m_blocks", [5, 6])
def test_ranked_pairs_join_the_heaviest_and_the_lightest(num_m_blocks):
    """Packed documents in pairs: the j-th heaviest query tile of the ranking, then the j-th
    lightest (the middle one alone when the count is odd)."""
    order = torch.tensor({5: [3, 0, 4, 1, 2], 6: [4, 0, 5, 1, 3, 2]}[num_m_blocks], dtype=torch.int32)
    walked = _walk(TileScheduler("paired", ranked=True), num_m_blocks, 1, 1, grid=1, seqlen_k=700, order=order)
    _assert_every_tile_once(walked, num_m_blocks, 1, 1)
    ranking = order.tolist()
    expected = []
    for j in range(num_m_blocks // 2):
        expected += [ranking[j], ranking[num_m_blocks - 1 - j]]
    expected += [ranking[num_m_blocks // 2]] if num_m_blocks % 2 else []
    assert walked[:, 2].tolist() == expected
    assert [ranking[r] for r in walked[:, 6].tolist()] == expected


@pytest.mark.parametrize("seqlen_k, pairs", [(129, True), (130, False)])
def test_window_pairs_only_while_the_window_cuts_no_row(seqlen_k, pairs):
    walked = _walk(TileScheduler("paired", pair_limit=129), 4, 2, 1, grid=1, seqlen_k=seqlen_k)
    _assert_every_tile_once(walked, 4, 2, 1)
    first_two = walked[:2, 2].tolist()
    assert first_two == ([3, 0] if pairs else [3, 3])  # pairs, or heaviest first over heads


# ----------------------------------------------------------------------------- key tiles
MAX_EXTRAS = 4  # run-time tensors of the structural masks: documents have four


def _kernel(spec: fa4gen.AttentionSpec, plan: fa4gen.Plan):
    """The kernel object exactly as the emitted module builds it."""
    namespace: dict = {}
    exec(compile(fa4gen.emit(spec, plan).source, "<emitted>", "exec"), namespace)  # noqa: S102 - our own output
    kernel = namespace["make_kernel"]()
    kernel.dtype = cutlass.BFloat16 if spec.dtype == "bfloat16" else cutlass.Float16  # set by __call__
    return kernel


def _padded(extras: tuple) -> list:
    """A host function takes its tensors one by one: the extras padded to MAX_EXTRAS."""
    return list(extras) + [torch.zeros(1, dtype=torch.int32)] * (MAX_EXTRAS - len(extras))


@cute.jit
def _mask_code(kernel, t, i: Int32, n_block: Int32) -> Int32:
    """The mask code key tile ``i`` (``n_block``) of tile ``t`` runs: 0 none, 1 the end compare
    alone, 2 the start compare too."""
    # as sm90.mainloop: the start compare where the tile lies below split_lo (the
    # first tile and tiles under a run-time flag); the first tile runs the mask
    # unless the kernel may leave it out and the tile lies below split_hi
    by_tile = Int32(1)
    if cutlass.const_expr(not kernel.key_tiles.starts_at_zero):
        if n_block < t.split_lo:
            by_tile = Int32(2)
    flag = Int32(0)
    if i == 0:
        flag = by_tile
        if cutlass.const_expr(kernel.cfg.interior_first_tile):
            if n_block < t.split_hi:
                if n_block >= t.split_lo:
                    flag = Int32(0)
    if cutlass.const_expr(kernel.cfg.mask_runs):  # the run the tile falls in decides
        right_end, left_start = kernel.mask_run_bounds(t, 0)
        if cutlass.const_expr(kernel.has_right_mask):
            if i > 0:
                if i < right_end:
                    flag = Int32(1)  # the right run: the end compare alone
        if cutlass.const_expr(kernel.has_left_mask):
            if i >= left_start:
                flag = Int32(2)
    elif kernel.needs_mask(None, t, i, n_block):
        flag = by_tile
    return flag


def _key_tiles(kernel, seqlen_q: int, seqlen_k: int, batches: int, extras: tuple):
    """Per (batch, query tile): the visited key tiles in order, the mask code each runs (0: none,
    1: the end compare alone, 2: the start compare too), and (n_min, n_max, then per consumer
    warpgroup the leading tiles it passes by)."""
    num_m = -(-seqlen_q // kernel.tile_m)
    num_n = -(-seqlen_k // kernel.tile_n) + 1
    visit = torch.full((batches * num_m, num_n), -1, dtype=torch.int32)
    masked = torch.full((batches * num_m, num_n), -1, dtype=torch.int32)
    bounds = torch.full((batches * num_m, 2 + kernel.num_consumers), -1, dtype=torch.int32)

    count, padded = len(extras), _padded(extras)

    @cute.jit
    def run(
        visit: cute.Tensor,
        masked: cute.Tensor,
        bounds: cute.Tensor,
        seqlen_q: Int32,
        seqlen_k: Int32,
        num_batches: Int32,
        e0: cute.Tensor,
        e1: cute.Tensor,
        e2: cute.Tensor,
        e3: cute.Tensor,
    ):
        # as launch_sizes, on one CTA (whole rounds only, so a split tail never cuts a tile here)
        sizes = LaunchSizes(
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            num_heads=1,
            num_batches=num_batches,
            num_m_blocks=cute.ceil_div(seqlen_q, kernel.tile_m),
            heads_batches=num_batches,
            n_keys=cutlass.max(cute.ceil_div(seqlen_k, kernel.tile_n), 1),
            grid=1,
            pairs=kernel.scheduler.pairs_now(seqlen_k),
            args=VariantArgs(kernel.cfg.extra_names, (e0, e1, e2, e3)[:count]),
        )
        items = kernel.scheduler.items_per_cta(sizes.num_m_blocks, sizes.heads_batches, 1, sizes.pairs, sizes.n_keys)
        for item in cutlass.range(items, unroll=1):
            tile = kernel.scheduler.tile_of(item, 0, sizes.num_m_blocks, sizes.heads_batches, 1, sizes.pairs)
            if kernel.scheduler.valid(tile, sizes.num_m_blocks, sizes.heads_batches, 1, sizes.pairs):
                t = kernel.tile_info(tile, sizes, Int32(0), sizes.n_keys)
                row = t.batch * sizes.num_m_blocks + t.m_block
                bounds[row, 0] = t.n_min
                bounds[row, 1] = t.n_max
                if cutlass.const_expr(kernel.skips_masked_tiles):  # as consume_tile: per warpgroup
                    for wg in cutlass.range_constexpr(kernel.num_consumers):
                        end = kernel.key_tiles.rows_tile_end(
                            t.m_block * kernel.tile_m + wg * 64, t.batch, seqlen_q, seqlen_k, sizes.args
                        )
                        bounds[row, 2 + wg] = cutlass.min(cutlass.max(t.n_max - end, 0), t.n_count)
                for i in cutlass.range(t.n_count, unroll=1):
                    n_block = kernel.key_block(t, i, sizes.args)
                    visit[row, i] = n_block
                    masked[row, i] = _mask_code(kernel, t, i, n_block)

    run(
        from_dlpack(visit),
        from_dlpack(masked),
        from_dlpack(bounds),
        seqlen_q,
        seqlen_k,
        batches,
        *(from_dlpack(value) for value in padded),
    )
    return visit, masked, bounds


def _extras(spec: fa4gen.AttentionSpec, kernel, seqlen_q: int, batches: int, args: dict) -> tuple:
    """The run-time tensors the kernel reads, by name (CPU tensors: only their values matter)."""
    values = dict(args)
    if spec.is_varlen:  # the callable's tables (checked here against visible_keys, written apart)
        values["doc_key_ranges"], values["doc_tiles"] = document_tables(
            spec, kernel.tile_m, kernel.tile_n, args["cu_seqlens_q"], args["cu_seqlens_k"], seqlen_q
        )
    return tuple(values[extra.name] for extra in lower(spec).extras)


def _case_arguments(spec: fa4gen.AttentionSpec, seqlen_q: int, seqlen_k: int) -> tuple[int, dict]:
    """(batches, run-time values): two batch entries with different prefixes for prefix-LM;
    for documents, several lengths (one document without queries, one without keys) packed to
    (Sq, Sk)."""
    if spec.mask_kind == "prefix_lm":
        return 2, {"prefix_lengths": torch.tensor([seqlen_k // 3, 0], dtype=torch.int32)}
    if spec.is_varlen:
        q_docs, k_docs = [seqlen_q // 2, 0, seqlen_q - seqlen_q // 2 - 5, 5], [seqlen_k // 3, 7, 0]
        k_docs.append(seqlen_k - sum(k_docs))
        return 1, {
            name: torch.tensor([0] + list(torch.tensor(docs).cumsum(0)), dtype=torch.int32)
            for name, docs in (("cu_seqlens_q", q_docs), ("cu_seqlens_k", k_docs))
        }
    return 1, {}


KEY_TILE_CASES = {
    "plain": (dict(head_dim=128), {}),
    "causal": (dict(head_dim=128, causal=True), {}),
    "causal-d64": (dict(head_dim=64, causal=True), {}),
    "causal-d64-4wg": (
        dict(head_dim=64, causal=True),  # the short range's 256-row tiles on 4 warpgroups
        {"num_consumer_warpgroups": 4, "tile_n": 64, "kv_stages": 4, "producer_regs": 24, "consumer_regs": 112},
    ),
    "causal-d256": (dict(head_dim=256, causal=True), {}),
    "window": (dict(head_dim=128, window_left=200, window_right=30), {}),
    "window-left-only": (dict(head_dim=128, window_left=200), {}),
    "causal-window": (dict(head_dim=128, causal=True, window_left=300), {}),
    "chunked": (dict(head_dim=64, mask={"kind": "chunked", "size": 256}), {}),
    "prefix-lm": (dict(head_dim=128, mask="prefix_lm"), {}),
    "documents": (dict(head_dim=128, causal=True, mask="document"), {}),
    "documents-window": (dict(head_dim=128, window_left=100, window_right=0, mask="document"), {}),
    "documents-paired": (dict(head_dim=128, causal=True, mask="document"), {"tile_order": "paired"}),
    "causal-flags": (dict(head_dim=128, causal=True), {"mask_runs": False}),
    "window-flags": (dict(head_dim=128, window_left=200, window_right=30), {"mask_runs": False}),
    "documents-flags": (dict(head_dim=128, causal=True, mask="document"), {"mask_runs": False}),
}
SHAPES = [(1000, 1000), (300, 1000), (1000, 300), (17, 700), (129, 129), (300, 1024)]  # last: Sk fills its tiles


def _walked_key_tiles(name: str, shape: tuple[int, int]):
    """KEY_TILE_CASES[name] at (Sq, Sk): its plan, kernel, batch count, the walk of _key_tiles and
    the visible keys per (batch, query row), padded with invisible keys to whole key tiles."""
    fields, plan_update = KEY_TILE_CASES[name]
    spec = fa4gen.AttentionSpec(**fields)
    plan = fa4gen.plan(spec, "sm_90a").with_config("test case", **plan_update)
    kernel = _kernel(spec, plan)
    seqlen_q, seqlen_k = shape
    batches, args = _case_arguments(spec, seqlen_q, seqlen_k)
    walk = _key_tiles(kernel, seqlen_q, seqlen_k, batches, _extras(spec, kernel, seqlen_q, batches, args))
    visible = visible_keys(spec, seqlen_q, seqlen_k, args=args)
    num_n = -(-seqlen_k // kernel.tile_n)
    padded = torch.zeros(visible.shape[0], seqlen_q, num_n * kernel.tile_n, dtype=torch.bool)
    padded[:, :, :seqlen_k] = visible[:, 0]  # keys past Sk: never visible
    return plan, kernel, batches, walk, padded


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "sq{}-sk{}".format(*s))
@pytest.mark.parametrize("name", sorted(KEY_TILE_CASES))
def test_key_tiles_visited_are_the_visible_ones_and_partial_ones_run_the_mask(name, shape):
    plan, kernel, batches, (visit, masked, bounds), padded = _walked_key_tiles(name, shape)
    tile_m, tile_n = kernel.tile_m, kernel.tile_n
    num_m, num_n = -(-shape[0] // tile_m), -(-shape[1] // tile_n)
    for b in range(batches):
        for m in range(num_m):
            row = b * num_m + m
            n_min, n_max = bounds[row, :2].tolist()
            count = max(n_max - n_min, 0)
            order = visit[row, :count].tolist()
            assert sorted(order) == list(range(n_min, n_max)), (b, m)  # each tile of the range once
            assert order == list(range(n_max - 1, n_min - 1, -1))  # from the highest down
            rows = padded[min(b, padded.shape[0] - 1), m * tile_m : (m + 1) * tile_m]
            if kernel.skips_masked_tiles:  # a warpgroup passes by only tiles none of its rows sees
                for wg in range(kernel.num_consumers):
                    skip = bounds[row, 2 + wg].item()
                    assert 0 <= skip <= count
                    mine = rows[wg * 64 : (wg + 1) * 64]
                    for n in order[:skip]:
                        assert not mine[:, n * tile_n : (n + 1) * tile_n].any(), (m, wg, n)
            for n in range(num_n):
                tile = rows[:, n * tile_n : (n + 1) * tile_n]
                if tile.any():
                    assert n in order, f"query tile {m} skips key tile {n}, which holds visible keys"
                if n in order and not tile.all():
                    assert masked[row, order.index(n)] >= 1, f"query tile {m}: key tile {n} is partial, unmasked"
                if n in order and masked[row, order.index(n)] == 1:  # the end compare alone: every
                    # row's visible keys in the tile are a prefix of its columns
                    assert torch.equal(tile, tile.int().cumprod(dim=1).bool()), f"query tile {m}: key tile {n}"
            if plan.config.stale_max:  # a row meets its first key in the first tile or in mask code
                _assert_first_keys_in_mask_code(rows, order, masked[row], tile_n, m)


def _assert_first_keys_in_mask_code(rows: torch.Tensor, order: list, masked: torch.Tensor, tile_n: int, m: int):
    """config.stale_max: a key tile without mask code exponentiates against the rows' running max,
    so every row that sees a key there must have seen one in an earlier visited tile."""
    seen = torch.zeros(rows.shape[0], dtype=torch.bool)
    for i, n in enumerate(order):
        here = rows[:, n * tile_n : (n + 1) * tile_n].any(dim=1)
        if i > 0 and masked[i] == 0:
            assert not (here & ~seen).any(), f"query tile {m}: a row sees its first key in key tile {n}, no mask code"
        seen |= here


@pytest.mark.parametrize(
    "shape", [(1000, 1063), (1100, 1163), (1000, 1127), (700, 828)], ids=lambda s: "sq{}-sk{}".format(*s)
)
@pytest.mark.parametrize("name", ["causal", "causal-d64", "causal-d64-4wg", "causal-window", "chunked", "prefix-lm"])
def test_rows_meet_their_first_key_in_mask_code_with_a_stale_max(name, shape):
    """Key offsets where a query tile's first row ends its keys at a key tile's top (Sk - Sq =
    63 at 192-row tiles of 128 keys, 127 at 256-row tiles of 64): that row sees none of the
    tiles above, so with a stale max its first key tile runs the mask code (the bound counts it
    as crossed, masking.bounds_of_rows), where the row finds its max."""
    plan, kernel, batches, (visit, masked, bounds), padded = _walked_key_tiles(name, shape)
    assert plan.config.stale_max
    tile_m, tile_n = kernel.tile_m, kernel.tile_n
    num_m = -(-shape[0] // tile_m)
    for b in range(batches):
        for m in range(num_m):
            row = b * num_m + m
            count = max(bounds[row, 1].item() - bounds[row, 0].item(), 0)
            rows = padded[min(b, padded.shape[0] - 1), m * tile_m : (m + 1) * tile_m]
            _assert_first_keys_in_mask_code(rows, visit[row, :count].tolist(), masked[row], tile_n, m)


def _masked_scores(
    kernel, seqlen_q: int, seqlen_k: int, batches: int, extras: tuple, by_document: bool = False
) -> torch.Tensor:
    """(batches, M * tile_m, N * tile_n): 0 where the kernel's per-thread masking (row_ranges +
    apply on each thread's wgmma C fragment) keeps a score, -inf where it masks it.
    ``by_document``: packed documents' row ranges from each tile's document bounds in the
    ranking, as the kernel's consumers take them, else from the per-row table."""
    num_m, num_n = -(-seqlen_q // kernel.tile_m), -(-seqlen_k // kernel.tile_n)
    out = torch.full((batches * num_m * kernel.tile_m, num_n * kernel.tile_n), float("nan"))
    count, padded = len(extras), _padded(extras)

    @cute.jit
    def run(
        out: cute.Tensor,
        seqlen_q: Int32,
        seqlen_k: Int32,
        num_batches: Int32,
        e0: cute.Tensor,
        e1: cute.Tensor,
        e2: cute.Tensor,
        e3: cute.Tensor,
    ):
        args = VariantArgs(kernel.cfg.extra_names, (e0, e1, e2, e3)[:count])
        num_m_blocks = cute.ceil_div(seqlen_q, kernel.tile_m)
        qk_mma = kernel._make_qk_mma()
        identity = cute.make_identity_tensor((64, kernel.tile_n))
        for batch in cutlass.range(num_batches, unroll=1):
            for m_block in cutlass.range(num_m_blocks, unroll=1):
                document = None
                if cutlass.const_expr(by_document):  # the ranking's row of this query tile
                    ranking = args.doc_tiles
                    rank = Int32(0)
                    for r in cutlass.range(num_m_blocks, unroll=1):
                        if ranking[r, 0] == m_block:
                            rank = r
                    document = (ranking[rank, 5], ranking[rank, 6], ranking[rank, 7], ranking[rank, 8])
                # the kernel compares the rows' starts only in key tiles below split_lo
                _, split_lo, _, _ = kernel.key_tiles.bounds(m_block, batch, seqlen_q, seqlen_k, args)
                for wg in cutlass.range_constexpr(kernel.num_consumers):
                    row_base = m_block * kernel.tile_m + wg * 64
                    for thread in cutlass.range(128, unroll=1):
                        coords = rows_cols_view(qk_mma.get_slice(thread).partition_C(identity))
                        starts, ends = kernel.key_tiles.row_ranges(
                            coords, row_base, batch, seqlen_q, seqlen_k, args, document
                        )
                        for n_block in cutlass.range(cute.ceil_div(seqlen_k, kernel.tile_n), unroll=1):
                            scores = cute.make_rmem_tensor(coords.shape, cutlass.Float32)
                            scores.fill(0.0)
                            kernel.key_tiles.apply(
                                scores, coords, starts, ends, n_block * kernel.tile_n, n_block < split_lo
                            )
                            for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
                                for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                                    out[
                                        (batch * num_m_blocks * kernel.tile_m) + row_base + coords[r, 0][0],
                                        n_block * kernel.tile_n + coords[0, c][1],
                                    ] = scores[r, c]

    arguments = (from_dlpack(out), seqlen_q, seqlen_k, batches, *(from_dlpack(value) for value in padded))
    cute.compile(run, *arguments, options="--gpu-arch sm_90a")(*arguments)  # wgmma atoms check the arch
    return out.view(batches, num_m * kernel.tile_m, num_n * kernel.tile_n)


@pytest.mark.parametrize("shape", [(1000, 1000), (300, 1000), (129, 129)], ids=lambda s: "sq{}-sk{}".format(*s))
@pytest.mark.parametrize(
    "name", ["causal", "causal-d64", "window", "chunked", "prefix-lm", "documents", "documents-window"]
)
def test_per_thread_masking_keeps_exactly_the_visible_scores(name, shape):
    """Every thread's rows and columns of its wgmma fragment (layout.rows_cols_view), the row
    intervals it computes (masking.row_ranges) and the mask it applies (masking.apply), over
    every (query tile, key tile), give exactly fa4gen.testing.visible_keys."""
    fields, plan_update = KEY_TILE_CASES[name]
    spec = fa4gen.AttentionSpec(**fields)
    kernel = _kernel(spec, fa4gen.plan(spec, "sm_90a").with_config("test case", **plan_update))
    seqlen_q, seqlen_k = shape
    batches, args = _case_arguments(spec, seqlen_q, seqlen_k)
    visible = visible_keys(spec, seqlen_q, seqlen_k, args=args)[:, 0].expand(batches, -1, -1)
    # documents: both ways to a row's range (a tile inside one document, and the per-row table)
    for by_document in (False, True) if spec.is_varlen else (False,):
        scores = _masked_scores(
            kernel, seqlen_q, seqlen_k, batches, _extras(spec, kernel, seqlen_q, batches, args), by_document
        )
        kept = scores[:, :seqlen_q, :seqlen_k] == 0
        assert not scores[:, :seqlen_q, :seqlen_k].isnan().any(), "a score no thread holds"
        assert torch.equal(kept, visible), f"by_document={by_document}"
        assert (scores[:, :seqlen_q, seqlen_k:] == float("-inf")).all()  # the ragged tile's keys past Sk


# --------------------------------------------------------------------------- the backward's mask
BACKWARD_MASK_CASES = {
    name: KEY_TILE_CASES[name][0]
    for name in (
        "plain",
        "causal",
        "window",
        "window-left-only",
        "causal-window",
        "chunked",
        "prefix-lm",
        "documents",
        "documents-window",
    )
}


def _backward_key_ranges(kernel, seqlen_q: int, seqlen_k: int, batches: int, extras: tuple):
    """Per (batch, key): [lo, hi) of the query rows that see it; per (batch, key tile): the
    query tiles the CTA walks, as the backward kernel computes them (masking.key_query_range),
    and per (batch, key tile, query tile it walks) its deterministic turn (key_tiles_before)."""
    keys = -(-seqlen_k // kernel.tile_n) * kernel.tile_n
    ranges = torch.full((batches, keys, 2), -1, dtype=torch.int32)
    tiles = torch.full((batches, keys // kernel.tile_n, 2), -1, dtype=torch.int32)
    turns = torch.full((batches, keys // kernel.tile_n, -(-seqlen_q // kernel.tile_m)), -1, dtype=torch.int32)
    count, padded = len(extras), _padded(extras)

    @cute.jit
    def run(
        ranges: cute.Tensor,
        tiles: cute.Tensor,
        turns: cute.Tensor,
        seqlen_q: Int32,
        seqlen_k: Int32,
        e0: cute.Tensor,
        e1: cute.Tensor,
        e2: cute.Tensor,
        e3: cute.Tensor,
    ):
        args = VariantArgs(kernel.cfg.extra_names, (e0, e1, e2, e3)[:count])
        for b in cutlass.range(ranges.shape[0], unroll=1):
            for key in cutlass.range(ranges.shape[1], unroll=1):
                lo, hi = kernel.key_queries.key_query_range(key, b, seqlen_q, seqlen_k, args)
                ranges[b, key, 0] = lo
                ranges[b, key, 1] = hi
            for n in cutlass.range(tiles.shape[1], unroll=1):
                m_min, m_max = kernel.key_queries.query_tiles_of_keys(n, b, seqlen_q, seqlen_k, args)
                tiles[b, n, 0] = m_min
                tiles[b, n, 1] = m_max
                for m in cutlass.range(m_min, m_max, unroll=1):
                    if cutlass.const_expr(kernel.cfg.dq_descending):
                        turns[b, n, m] = kernel.key_queries.key_tiles_after(n, m, b, seqlen_q, seqlen_k, args)
                    else:
                        turns[b, n, m] = kernel.key_queries.key_tiles_before(n, m, b, seqlen_q, seqlen_k, args)

    run(
        from_dlpack(ranges),
        from_dlpack(tiles),
        from_dlpack(turns),
        seqlen_q,
        seqlen_k,
        *(from_dlpack(v) for v in padded),
    )
    return ranges, tiles, turns


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "sq{}-sk{}".format(*s))
@pytest.mark.parametrize("name", sorted(BACKWARD_MASK_CASES))
def test_backward_sees_each_key_from_exactly_the_queries_that_see_it(name, shape):
    """The backward walks keys, not queries: for every key, [lo, hi) is exactly the set of rows
    that see it (visible_keys, written apart), and each key tile's query tiles cover them."""
    from fa4gen.api import training_spec
    from fa4gen.planner import backward_plan

    spec = training_spec(fa4gen.AttentionSpec(**BACKWARD_MASK_CASES[name]))
    kernel = _kernel(spec, backward_plan(spec))
    seqlen_q, seqlen_k = shape
    batches, args = _case_arguments(spec, seqlen_q, seqlen_k)
    if spec.is_varlen:  # the backward's table (checked here against visible_keys, written apart)
        cu = (args["cu_seqlens_q"], args["cu_seqlens_k"])
        args["doc_query_ranges"] = document_query_ranges(spec, kernel.tile_n, *cu, seqlen_k)
    extras = tuple(args[extra.name] for extra in lower(spec).for_backward().extras)
    ranges, tiles, turns = _backward_key_ranges(kernel, seqlen_q, seqlen_k, batches, extras)
    visible = visible_keys(spec, seqlen_q, seqlen_k, args=args)  # (B or 1, 1, Sq, Sk)
    rows = torch.arange(seqlen_q).view(-1, 1)
    for b in range(batches):
        seen = visible[min(b, visible.shape[0] - 1), 0]
        lo, hi = ranges[b, :seqlen_k, 0].view(1, -1), ranges[b, :seqlen_k, 1].view(1, -1)
        assert torch.equal((rows >= lo) & (rows < hi), seen), f"batch {b}: a key's query range"
        assert (ranges[b, seqlen_k:, 1] <= ranges[b, seqlen_k:, 0]).all(), "keys past Sk: no query"
        for n in range(tiles.shape[1]):
            m_min, m_max = tiles[b, n].tolist()
            queries = seen[:, n * kernel.tile_n : (n + 1) * kernel.tile_n].any(dim=1).nonzero().flatten()
            if len(queries):
                assert m_min * kernel.tile_m <= queries.min() and queries.max() < m_max * kernel.tile_m, (b, n)
        # deterministic dQ: a key tile's turn at a query tile counts the key tiles walking it
        # before it: those below, or with a right bound those above (launched first)
        walks = (torch.arange(turns.shape[2]).view(1, -1) >= tiles[b, :, :1]) & (
            torch.arange(turns.shape[2]).view(1, -1) < tiles[b, :, 1:]
        )
        order = walks.int().flip(0) if kernel.cfg.dq_descending else walks.int()
        before = order.cumsum(dim=0) - 1
        expected = torch.where(walks, before.flip(0) if kernel.cfg.dq_descending else before, -1)
        assert torch.equal(turns[b], expected.int()), f"batch {b}: turns at dQ"
