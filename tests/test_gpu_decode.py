"""The decode kernel (fa4gen.kernels.sm90.decode) against the fp32 reference on the GPU.

Launches over a KV cache: short query sequences, per-entry cache lengths (``seqused_k``, incl. 0
and 1), the keys split over 1 to many CTAs (the split count forced here, chosen by size in
production), with every mask and score modifier the decode kernel takes; contiguous caches and
paged ones (page tables in random order, shared pages, entries out of range). Outputs are
poisoned with NaN first, and so is every cache slot past an entry's length (a serving cache's
unused slots hold anything); the bound is 2x PyTorch's own bf16 error (fa4gen.testing), whose
reference reads the clean cache. Kernels come from the cache, warmed by tests/warm_gpu_cache.py.
"""

from __future__ import annotations

import pytest
from gpu_cases import decode_specs, variant_inputs

import fa4gen
import fa4gen.kernels.sm90.decode_splits as split_policy
from fa4gen.testing import assert_close_to_reference, gather_pages

pytestmark = pytest.mark.gpu

SPECS = decode_specs()
KV_HEADS = 2
# (batch, Sq, cache capacity Sk): one key; ragged tiles; Sq 16 (64-128 packed rows: at G >= 6 the
# 128-row kernel); Sq 40 (40-320 rows: 128-row tiles whose last may fill one warpgroup or part of it)
SHAPES = [(1, 1, 1), (3, 1, 1000), (2, 4, 4097), (4, 2, 333), (1, 16, 2000), (2, 40, 900)]


def _lengths(batch: int, capacity: int, seed: int):
    """Cache lengths with the edges: 0, 1 and the full capacity among random ones."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, capacity + 1, (batch,), generator=gen)
    edges = [0, 1, capacity]
    for i in range(min(batch, len(edges))):
        lengths[i] = edges[(i + seed) % len(edges)]
    return lengths.to(torch.int32).cuda()


def _run(spec, attn, q, k, v, args):
    import torch

    out = torch.full((*q.shape[:-1], spec.dv), float("nan"), device="cuda", dtype=q.dtype)
    lse = None
    if spec.return_lse:
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda")
        attn(q, k, v, out=out, lse=lse, **args)
    else:
        attn(q, k, v, out=out, **args)
    torch.cuda.synchronize()
    return out, lse


def _poisoned_past(cache, lengths):
    """``cache`` (B, Sk, H, D) with every slot at or past its entry's length NaN."""
    import torch

    positions = torch.arange(cache.shape[1], device=cache.device).view(1, -1)
    past = positions >= lengths.long().view(-1, 1)
    return cache.masked_fill(past.view(*past.shape, 1, 1), float("nan"))


def _paged(k, v, lengths, page_size: int, seed: int):
    """The caches k, v (B, Sk, H, D) as one page pool in random page order: (pool_k, pool_v,
    poisoned_k, poisoned_v, page_table). Page 0 holds no key; entry 1 shares entry 0's first
    page where both fill it; table slots past an entry's pages point out of the pool (-1 or
    10**6, clamped by the kernel); the poisoned pools hold NaN in every slot no entry reads."""
    import torch

    batch, seqlen_k = k.shape[:2]
    max_pages = -(-seqlen_k // page_size)
    gen = torch.Generator().manual_seed(seed)
    order = (torch.randperm(batch * max_pages, generator=gen) + 1).view(batch, max_pages)
    lens = lengths.cpu().long()
    if batch > 1 and min(lens[0].item(), lens[1].item()) >= page_size:
        order[1, 0] = order[0, 0]  # a shared prefix page: its keys must then match entry 0's
        k, v = k.clone(), v.clone()
        k[1, :page_size], v[1, :page_size] = k[0, :page_size], v[0, :page_size]
    used = -(-lens // page_size)
    for b in range(batch):
        order[b, used[b] :] = -1 if b % 2 else 10**6
    pools = []
    for cache in (k, v):
        pool = torch.zeros(batch * max_pages + 1, page_size, *cache.shape[2:], dtype=cache.dtype, device=cache.device)
        padded = torch.nn.functional.pad(cache, (0, 0, 0, 0, 0, max_pages * page_size - seqlen_k))
        for b in range(batch):
            for j in range(used[b]):
                pool[order[b, j]] = padded[b, j * page_size : (j + 1) * page_size]
        pools.append(pool)
    valid = torch.zeros(pools[0].shape[:2], dtype=torch.bool)
    for b in range(batch):
        for j in range(used[b]):
            valid[order[b, j], : min(page_size, lens[b].item() - j * page_size)] = True
    hidden = (~valid).view(*valid.shape, 1, 1).to(k.device)
    poisoned = [pool.masked_fill(hidden, float("nan")) for pool in pools]
    return (*pools, *poisoned, order.to(torch.int32).cuda())


@pytest.mark.parametrize("splits", [1, 3, None], ids=["1split", "3splits", "auto"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-sq{}-sk{}".format(*s))
@pytest.mark.parametrize("name", sorted(SPECS))
def test_decode_with_cache_lengths(name, shape, splits, monkeypatch):
    spec = SPECS[name]
    if splits is not None:
        monkeypatch.setattr(split_policy, "decode_splits", lambda *sizes: splits)
    attn = fa4gen.compile(spec)
    seed = hash((name, shape, splits)) % 2**31
    q, k, v, args = variant_inputs(spec, *shape, seed=seed, kv_heads=KV_HEADS)
    args["seqused_k"] = lengths = _lengths(shape[0], shape[2], seed)
    out, lse = _run(spec, attn, q, _poisoned_past(k, lengths), _poisoned_past(v, lengths), args)
    assert_close_to_reference(spec, q, k, v, out, lse, args=args)


PAGED_SHAPES = [(1, 1, 1), (3, 1, 1000), (2, 4, 4097), (1, 16, 2000), (2, 40, 900)]


@pytest.mark.parametrize("splits", [1, None], ids=["1split", "auto"])
@pytest.mark.parametrize("page_size", [16, 128], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("shape", PAGED_SHAPES, ids=lambda s: "b{}-sq{}-sk{}".format(*s))
@pytest.mark.parametrize("name", sorted(SPECS))
def test_paged_decode(name, shape, page_size, splits, monkeypatch):
    """A paged cache: the same results as the contiguous cache the page table describes."""
    spec = SPECS[name]
    if splits is not None:
        monkeypatch.setattr(split_policy, "decode_splits", lambda *sizes: splits)
    attn = fa4gen.compile(spec)
    seed = hash((name, shape, page_size, splits)) % 2**31
    q, k, v, args = variant_inputs(spec, *shape, seed=seed, kv_heads=KV_HEADS)
    args["seqused_k"] = _lengths(shape[0], shape[2], seed)
    pool_k, pool_v, bad_k, bad_v, table = _paged(k, v, args["seqused_k"], page_size, seed)
    out, lse = _run(spec, attn, q, bad_k, bad_v, {**args, "page_table": table})
    assert_close_to_reference(spec, q, pool_k, pool_v, out, lse, args={**args, "page_table": table})


@pytest.mark.parametrize("page_size", [32, 48, 256])
@pytest.mark.parametrize("splits", [1, 4], ids=["1split", "4splits"])
def test_paged_page_sizes(page_size, splits, monkeypatch):
    """Any page size that is a multiple of 16 runs on the one compiled kernel; without seqused_k
    each entry's keys fill its table's pages."""
    spec = SPECS["llama-gqa4"]
    monkeypatch.setattr(split_policy, "decode_splits", lambda *sizes: splits)
    attn = fa4gen.compile(spec)
    q, k, v, args = variant_inputs(spec, 3, 2, 3 * page_size, seed=page_size, kv_heads=KV_HEADS)
    full = _lengths(3, 3 * page_size, 0).fill_(3 * page_size)
    pool_k, pool_v, _, _, table = _paged(k, v, full, page_size, page_size)
    out, lse = _run(spec, attn, q, pool_k, pool_v, {"page_table": table})
    assert_close_to_reference(spec, q, pool_k, pool_v, out, lse, args={"page_table": table})


def test_paged_matches_the_gathered_cache():
    """The reference's gather is what the kernel reads: the paged launch equals the contiguous
    launch over gather_pages' cache, to the bit."""
    import torch

    spec = SPECS["window-sinks"]
    attn = fa4gen.compile(spec)
    q, k, v, args = variant_inputs(spec, 4, 1, 5000, seed=11, kv_heads=KV_HEADS)
    args["seqused_k"] = _lengths(4, 5000, 11)
    pool_k, pool_v, _, _, table = _paged(k, v, args["seqused_k"], 16, 11)
    paged, _ = _run(spec, attn, q, pool_k, pool_v, {**args, "page_table": table})
    contiguous, _ = _run(spec, attn, q, gather_pages(pool_k, table), gather_pages(pool_v, table), args)
    assert torch.equal(paged, contiguous)


@pytest.mark.parametrize("splits", [1, 5], ids=["1split", "5splits"])
@pytest.mark.parametrize("name", ["llama-gqa4", "window-sinks", "mha-d64"])
def test_plain_decode_launch_picks_the_decode_kernel(name, splits, monkeypatch):
    """Without cache lengths a short query launch runs the decode kernel too (its length range),
    every key of the cache visible."""
    spec = SPECS[name]
    monkeypatch.setattr(split_policy, "decode_splits", lambda *sizes: splits)
    attn = fa4gen.compile(spec)
    assert attn.kernel_for(1).plan.kernel == "HopperAttentionDecode"
    q, k, v, args = variant_inputs(spec, 2, 1, 3001, seed=splits, kv_heads=KV_HEADS)
    out, lse = _run(spec, attn, q, k, v, args)
    assert_close_to_reference(spec, q, k, v, out, lse, args=args)


def test_cache_lengths_past_the_capacity_are_clamped():
    """A length past the cache (or negative) reads no key outside it: clamped to [0, Sk]."""
    import torch

    spec = SPECS["llama-gqa4"]
    attn = fa4gen.compile(spec)
    q, k, v, args = variant_inputs(spec, 3, 1, 500, seed=7, kv_heads=KV_HEADS)
    out, lse = _run(spec, attn, q, k, v, {"seqused_k": torch.tensor([10**6, -5, 250], dtype=torch.int32).cuda()})
    lengths = torch.tensor([500, 0, 250], dtype=torch.int32).cuda()
    assert_close_to_reference(spec, q, k, v, out, lse, args={"seqused_k": lengths})


@pytest.mark.parametrize("seqlen_q", [2, 12], ids=["64rows", "128rows"])
def test_split_counters_come_back_down_across_launches_and_graphs(seqlen_q, monkeypatch):
    """The last split of each query tile merges the partials and lowers its counter: repeated
    launches, eager and replayed from a CUDA graph, give the same bits (a counter left up would
    make a later launch merge too early, or never); 12 query rows x 8 heads run the 128-row
    kernel, whose two warpgroups count in on their own counters."""
    import torch

    import fa4gen.kv_cache

    spec = SPECS["window-sinks"]
    monkeypatch.setattr(split_policy, "decode_splits", lambda *sizes: 6)
    attn = fa4gen.compile(spec)
    assert attn.decode_kernel(seqlen_q).plan.config.tile_m == (128 if seqlen_q == 12 else 64)
    q, k, v, args = variant_inputs(spec, 3, seqlen_q, 3000, seed=5, kv_heads=KV_HEADS)
    args["seqused_k"] = _lengths(3, 3000, 5)
    first, first_lse = _run(spec, attn, q, k, v, args)
    assert_close_to_reference(spec, q, k, v, first, first_lse, args=args)
    for _ in range(3):
        again, again_lse = _run(spec, attn, q, k, v, args)
        assert torch.equal(again, first) and torch.equal(again_lse, first_lse)
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured, captured_lse = attn(q, k, v, **args)
    for _ in range(3):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, first) and torch.equal(captured_lse, first_lse)
    assert all(not c.any() for c in fa4gen.kv_cache._SPLIT_COUNTERS.values())
