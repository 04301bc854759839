"""Block masks of expression masks (fa4gen.blockmask), checked on the CPU against a brute-force
classification of every (query tile, key tile) from the reference mask."""

from __future__ import annotations

import pytest
import torch

import fa4gen
from fa4gen.api import training_spec
from fa4gen.blockmask import BlockMask, build_backward_block_mask, build_block_mask, check_block_mask
from fa4gen.planner import backward_plan
from fa4gen.testing import visible_mask
from fa4gen.variants import lower

SPECS = {
    "streaming": fa4gen.AttentionSpec(
        causal=True,
        mask={"kind": "expression", "expr": "kv_idx < sinks_n or q_idx - kv_idx < window"},
        scalars={"sinks_n": "int32", "window": "int32"},
    ),
    "per-head-dilated": fa4gen.AttentionSpec(
        head_dim=64,
        mask={
            "kind": "expression",
            "expr": "(kv_idx // 32 - q_idx // 32) // (h + 1) * (h + 1) == kv_idx // 32 - q_idx // 32",
        },
    ),
    "per-batch-length": fa4gen.AttentionSpec(
        head_dim=64,
        mask={"kind": "expression", "expr": "kv_idx < lengths[b]"},
        aux={"lengths": {"dtype": "int32", "shape": ["B"]}},
    ),
    "empty-rows-window": fa4gen.AttentionSpec(
        window_left=100, mask={"kind": "expression", "expr": "kv_idx + 40 <= q_idx"}
    ),
    # per query head, 2 query heads per KV head: the backward's CTAs walk a group's union
    "per-head-gqa2": fa4gen.AttentionSpec(
        head_dim=64,
        qhead_per_kvhead=2,
        mask={"kind": "expression", "expr": "kv_idx + h * 150 <= q_idx + 100 or kv_idx // 64 == 3"},
    ),
}
AUX = {
    "streaming": {"sinks_n": 4, "window": 150},
    "per-head-dilated": {},
    "per-batch-length": {"lengths": torch.tensor([37, 300, 1], dtype=torch.int32)},
    "empty-rows-window": {},
    "per-head-gqa2": {},
}


def brute_force(spec, plan, batch, heads, sq, sk, aux):
    mask = visible_mask(spec, sq, sk, args={"aux": aux}, batch=batch, heads=heads).expand(batch, heads, sq, sk)
    m, n = -(-sq // plan.config.tile_m), -(-sk // plan.config.tile_n)
    padded = torch.zeros(batch, heads, m * plan.config.tile_m, n * plan.config.tile_n, dtype=torch.bool)
    padded[:, :, :sq, :sk] = mask
    real = torch.zeros(m * plan.config.tile_m, dtype=torch.bool)
    real[:sq] = True
    tiles = padded.view(batch, heads, m, plan.config.tile_m, n, plan.config.tile_n)
    real = real.view(1, 1, m, plan.config.tile_m, 1, 1)
    nonempty = tiles.any(dim=5).any(dim=3)
    cols_real = torch.zeros(n * plan.config.tile_n, dtype=torch.bool)
    cols_real[:sk] = True
    full = (tiles | ~real).all(dim=5).all(dim=3) & nonempty & cols_real.view(n, plan.config.tile_n).all(dim=1)
    return nonempty, full


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("shape", [(3, 2, 300, 300), (1, 4, 17, 700), (2, 3, 700, 130), (1, 1, 1, 1)])
def test_block_mask_matches_brute_force(name, shape):
    spec, aux = SPECS[name], AUX[name]
    batch, heads, sq, sk = shape
    heads *= spec.qhead_per_kvhead
    if name == "per-batch-length" and batch != 3:
        aux = {"lengths": torch.randint(1, sk + 1, (batch,), dtype=torch.int32)}
    plan = fa4gen.plan(spec)
    bm = build_block_mask(spec, plan, batch, heads, sq, sk, {"aux": aux}, "cpu")
    nonempty, full = brute_force(spec, plan, batch, heads, sq, sk, aux)
    mask_b, mask_h = bm.count.shape[:2]
    uses = lower(spec).mask.uses
    assert mask_b == (batch if "b" in uses else 1) and mask_h == (heads if "h" in uses else 1)
    nonempty, full = nonempty[:mask_b, :mask_h], full[:mask_b, :mask_h]
    assert torch.equal(bm.count, nonempty.sum(-1).int())
    for b in range(mask_b):
        for h in range(mask_h):
            for m in range(bm.count.shape[2]):
                count = int(bm.count[b, h, m])
                listed = bm.index[b, h, m, :count].tolist()
                want = sorted(torch.nonzero(nonempty[b, h, m]).flatten().tolist(), reverse=True)
                assert listed == want  # highest key tile first, as the kernel visits them
                assert bm.full[b, h, m, :count].tolist() == [int(full[b, h, m, i]) for i in listed]
                assert not bm.index[b, h, m, count:].any() and not bm.full[b, h, m, count:].any()


def test_block_mask_skips_tiles_and_checks_its_shape():
    spec, aux = SPECS["streaming"], AUX["streaming"]
    plan = fa4gen.plan(spec)
    bm = build_block_mask(spec, plan, 1, 1, 4096, 4096, {"aux": aux}, "cpu")
    assert 0.7 < bm.sparsity() < 1.0  # a 150-key window and 4 sink keys leave most tiles empty
    check_block_mask(bm, plan, 2, 8, 4096, 4096, torch.device("cpu"))  # shared by batch and heads
    with pytest.raises(ValueError, match="built for Sq=4096, Sk=4096"):
        check_block_mask(bm, plan, 1, 1, 4096, 2048, torch.device("cpu"))
    other = plan.with_config("test", tile_n=64)
    with pytest.raises(ValueError, match="tiles; this kernel uses"):
        check_block_mask(bm, other, 1, 1, 4096, 4096, torch.device("cpu"))
    with pytest.raises(ValueError, match="must come from AttentionKernel.block_mask"):
        check_block_mask("mask", plan, 1, 1, 4096, 4096, torch.device("cpu"))
    assert isinstance(bm, BlockMask)


def test_specs_without_expression_mask_need_none():
    spec = fa4gen.AttentionSpec(causal=True)
    with pytest.raises(ValueError, match="no expression mask"):
        build_block_mask(spec, fa4gen.plan(spec), 1, 1, 8, 8, {}, "cpu")


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("shape", [(3, 2, 300, 300), (1, 4, 17, 700), (2, 3, 700, 130), (1, 1, 1, 1)])
def test_backward_block_mask_walks_each_key_tile_over_the_query_tiles_that_see_it(name, shape):
    """The backward's transpose: per key tile, the query tiles some pair of is visible (for some
    query head of the KV head's group), lowest first; full where every pair is visible for every
    head of the group; turn: how many key tiles below walk that query tile."""
    spec, aux = training_spec(SPECS[name]), AUX[name]
    batch, kv_heads, sq, sk = shape
    group = spec.qhead_per_kvhead
    if name == "per-batch-length" and batch != 3:
        aux = {"lengths": torch.randint(1, sk + 1, (batch,), dtype=torch.int32)}
    plan = backward_plan(spec)
    descending = plan.config.dq_descending
    bm = build_backward_block_mask(
        spec, plan.config.tile_m, plan.config.tile_n, batch, kv_heads * group, sq, sk, {"aux": aux}, "cpu", descending
    )
    nonempty, full = brute_force(spec, plan, batch, kv_heads * group, sq, sk, aux)
    nonempty = nonempty.view(batch, kv_heads, group, *nonempty.shape[2:]).any(dim=2)
    full = full.view(batch, kv_heads, group, *full.shape[2:]).all(dim=2) & nonempty
    mask_b, mask_h = bm.count.shape[:2]
    uses = lower(spec).mask.uses
    assert mask_b == (batch if "b" in uses else 1) and mask_h == (kv_heads if "h" in uses else 1)
    walks, full = nonempty[:mask_b, :mask_h].transpose(2, 3), full[:mask_b, :mask_h].transpose(2, 3)
    ordered = walks.int().flip(2) if descending else walks.int()  # (key tiles in their turns' order)
    before = ordered.cumsum(dim=2) - ordered
    before = before.flip(2) if descending else before
    assert torch.equal(bm.count, walks.sum(-1).int())
    for b in range(mask_b):
        for h in range(mask_h):
            for n in range(bm.count.shape[2]):
                count = int(bm.count[b, h, n])
                listed = bm.index[b, h, n, :count].tolist()
                assert listed == torch.nonzero(walks[b, h, n]).flatten().tolist()  # lowest query tile first
                assert bm.full[b, h, n, :count].tolist() == [int(full[b, h, n, m]) for m in listed]
                assert bm.turn[b, h, n, :count].tolist() == [int(before[b, h, n, m]) for m in listed]
                assert not bm.index[b, h, n, count:].any() and not bm.turn[b, h, n, count:].any()
