"""The decode kernel's run logic on the CPU (CuTe DSL executes `@cute.jit` host functions here):
the kernel's own ``key_run`` for every packed query tile and split, against brute force over
fa4gen.testing.visible_keys (written independently); the paged kernel's page walk against the
reference's gather through the page table; and the host's split counts."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Int32
from cutlass.cute.runtime import from_dlpack

import fa4gen
from fa4gen.kernels.common.variant import VariantArgs
from fa4gen.kernels.sm90.decode_config import MAX_SPLITS, PAGE_BOX
from fa4gen.kernels.sm90.decode_splits import decode_splits
from fa4gen.planner.sm90_decode import plan_decode_sm90

GROUP_CASES = {
    "causal-gqa4": dict(head_dim=128, qhead_per_kvhead=4, causal=True),
    "dense-gqa6": dict(head_dim=96, qhead_per_kvhead=6),
    "window-gqa8": dict(head_dim=128, qhead_per_kvhead=8, causal=True, window_left=127),
    "two-sided-mha": dict(head_dim=64, window_left=200, window_right=40),
    "chunked-gqa2": dict(head_dim=128, qhead_per_kvhead=2, mask={"kind": "chunked", "size": 256}),
    "d256-gqa8": dict(head_dim=256, qhead_per_kvhead=8, causal=True),
}
# (Sq, cache length): decode, speculative rows, Sq > length (rows before the cache), empty cache
SIZES = [(1, 1), (1, 1000), (4, 4097), (16, 700), (3, 2), (5, 0), (100, 3000)]


def _kernel(spec: fa4gen.AttentionSpec, paged: bool = False, wide: bool = False):
    namespace: dict = {}
    plan = plan_decode_sm90(spec, paged=paged, wide=wide)
    exec(compile(fa4gen.emit(spec, plan).source, "<emitted>", "exec"), namespace)  # noqa: S102 - our own output
    return namespace["make_kernel"]()


def _runs(kernel, seqlen_q: int, length: int, splits: int) -> torch.Tensor:
    """key_run of every (packed query tile, split): (lo, count, split_lo, split_hi)."""
    tiles = -(-seqlen_q * kernel.group // kernel.tile_m)
    out = torch.full((tiles, splits, 4), -1, dtype=torch.int32)

    @cute.jit
    def run(out: cute.Tensor, tiles: Int32, splits: Int32, seqlen_q: Int32, length: Int32):
        args = VariantArgs((), ())
        for m in cutlass.range(tiles, unroll=1):
            for s in cutlass.range(splits, unroll=1):
                lo, count, split_lo, split_hi = kernel.key_run(m, s, splits, Int32(0), seqlen_q, length, args)
                out[m, s, 0], out[m, s, 1], out[m, s, 2], out[m, s, 3] = lo, count, split_lo, split_hi

    run(from_dlpack(out), tiles, splits, seqlen_q, length)
    return out


@pytest.mark.parametrize("wide", [False, True], ids=["64rows", "128rows"])
@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: "sq{}-len{}".format(*s))
@pytest.mark.parametrize("name", sorted(GROUP_CASES))
def test_splits_cover_each_visible_key_tile_once(name, sizes, splits, wide):
    """Every key tile holding a key some packed row of the tile sees is run by exactly one split,
    no split runs a tile past the cache length, and a tile that is not fully visible to every
    row of the tile runs the mask (at or past split_hi, or below split_lo); tiles of 64 packed
    rows, and of 128 (two consumer warpgroups)."""
    from fa4gen.testing import visible_keys

    spec = fa4gen.AttentionSpec(**GROUP_CASES[name])
    kernel = _kernel(spec, wide=wide)
    seqlen_q, length = sizes
    tile_n, group, tile_m = kernel.tile_n, kernel.group, kernel.tile_m
    runs = _runs(kernel, seqlen_q, length, splits)
    width = max(-(-length // tile_n), 1) * tile_n
    visible = torch.zeros(seqlen_q, width, dtype=torch.bool)
    visible[:, :length] = visible_keys(spec, seqlen_q, length)[0, 0] if length else False
    rows = visible.repeat_interleave(group, dim=0)  # packed row g + G * s is query s
    for m in range(runs.shape[0]):
        mine = rows[m * tile_m : (m + 1) * tile_m]
        seen = []
        for s in range(splits):
            lo, count, split_lo, split_hi = runs[m, s].tolist()
            assert count >= 0
            seen += list(range(lo, lo + count))
            for n in range(lo, lo + count):
                assert n * tile_n < max(length, 1), f"split {s} runs key tile {n} past the cache length {length}"
                tile = mine[:, n * tile_n : (n + 1) * tile_n]
                if not tile.all():
                    assert n >= split_hi or n < split_lo, f"key tile {n} is partial but runs no mask"
        assert len(seen) == len(set(seen)), f"query tile {m}: a key tile runs in two splits"
        needed = {n for n in range(width // tile_n) if mine[:, n * tile_n : (n + 1) * tile_n].any()}
        assert needed <= set(seen), f"query tile {m}: key tiles {sorted(needed - set(seen))} never run"


def _walk(kernel, table: torch.Tensor, tiles: int, page_size: int, num_pages: int) -> torch.Tensor:
    """(page_of, row_box_of) of every box of key tiles 0 .. tiles-1 of one batch entry."""
    boxes = kernel.tile_n // PAGE_BOX
    out = torch.full((tiles, boxes, 2), -1, dtype=torch.int32)

    @cute.jit
    def run(out: cute.Tensor, table: cute.Tensor, tiles: Int32, page_size: Int32, num_pages: Int32):
        for n in cutlass.range(tiles, unroll=1):
            for c in cutlass.range(boxes, unroll=1):
                out[n, c, 0] = kernel.page_of(table, n, c, page_size, table.shape[0], num_pages)
                out[n, c, 1] = kernel.row_box_of(n, c, page_size)

    run(from_dlpack(out), from_dlpack(table), tiles, page_size, num_pages)
    return out


@pytest.mark.parametrize("page_size", [16, 48, 128, 256])
@pytest.mark.parametrize(
    "name, wide", [("causal-gqa4", False), ("two-sided-mha", False), ("d256-gqa8", True)]
)  # 64-, 128- and 32-key tiles
def test_page_walk_reads_each_key_from_its_page(name, wide, page_size):
    """Each box of a key tile reads the pool rows that hold its keys (the reference's gather
    through the same table, clamped alike), entries out of range included; tiles past an
    entry's pages read inside the pool."""
    from fa4gen.testing import gather_pages

    kernel = _kernel(fa4gen.AttentionSpec(**GROUP_CASES[name]), paged=True, wide=wide)
    num_pages, max_pages = 9, 5
    table = torch.tensor([7, -1, 3, 10**6, 0], dtype=torch.int32)
    # pool[p, r] = the pool row p * page_size + r, as one head of width 1
    pool = torch.arange(num_pages * page_size, dtype=torch.int64).view(num_pages, page_size, 1, 1)
    gathered = gather_pages(pool, table.view(1, -1)).view(-1)  # key -> pool row
    tiles = -(-max_pages * page_size // kernel.tile_n) + 1  # one tile past the capacity
    walk = _walk(kernel, table, tiles, page_size, num_pages)
    for n in range(tiles):
        for c in range(kernel.tile_n // PAGE_BOX):
            page, row = walk[n, c].tolist()
            assert 0 <= page < num_pages and 0 <= row < page_size // PAGE_BOX
            first = n * kernel.tile_n + c * PAGE_BOX
            if first < max_pages * page_size:
                read = torch.arange(PAGE_BOX) + page * page_size + row * PAGE_BOX
                assert torch.equal(read, gathered[first : first + PAGE_BOX]), f"tile {n} box {c}"


@pytest.mark.parametrize(
    "sizes, expected",
    [
        ((1, 8, 1, 32768, 4, 64, 64, 132), 16),  # Llama-3-8B decode at batch 1: one CTA per SM
        ((8, 8, 1, 32768, 4, 64, 64, 132), 2),  # half the SMs, long runs: HBM-bound, split
        ((8, 8, 1, 4096, 4, 64, 64, 132), 1),  # half the SMs, 64 key tiles: the merge costs more
        ((8, 8, 16, 1024, 4, 64, 64, 132), 1),
        ((4, 8, 1, 4096, 4, 64, 64, 132), 4),  # a quarter of the SMs: split
        ((8, 8, 1, 4096, 4, 64, 64, 132, True), 2),  # paged: at 64 key tiles its boxes need every SM
        ((8, 8, 1, 1024, 4, 64, 64, 132, True), 1),  # ... at 16 not
        ((64, 8, 1, 4096, 4, 64, 64, 132, True), 1),
        ((64, 8, 1, 4096, 4, 64, 64, 132), 1),  # the launch fills the SMs already
        ((1, 8, 1, 1024, 4, 64, 64, 132), 4),  # short caches: at least 4 key tiles per split
        ((1, 1, 1, 10**7, 1, 64, 64, 132), MAX_SPLITS),
        ((1, 8, 16, 32768, 8, 64, 64, 132), 8),  # 128 packed rows: two 64-row query tiles per KV head
        ((1, 8, 16, 32768, 8, 128, 64, 132), 16),  # ... or one 128-row tile
        ((2, 8, 40, 4096, 4, 128, 64, 132), 4),  # 160 rows: two 128-row tiles, 32 CTAs
    ],
)
def test_split_counts(sizes, expected):
    assert decode_splits(*sizes) == expected
