"""Kernels against the fp32 reference on the GPU (marker `gpu`; skipped without one).

Kernels come from the cache (FA4GEN_CACHE_DIR), warmed beforehand with
``python tests/warm_gpu_cache.py DIR`` on any machine; here they are only loaded and run.
Outputs are poisoned with NaN before each launch, inputs are fresh random normals, and the
error bound is 2x PyTorch's own error in the input dtype (fa4gen.testing).
"""

from __future__ import annotations

import pytest
from gpu_cases import (
    SHAPES,
    first_call_cases,
    gpu_specs,
    keyless_cases,
    pair_tail_specs,
    plan_option_cases,
    split_tail_cases,
    variant_inputs,
    variant_specs,
)

import fa4gen
from fa4gen.testing import assert_close_to_reference

pytestmark = pytest.mark.gpu

CASES = {**gpu_specs(), **variant_specs()}
KV_HEADS = 2


def _inputs(spec: fa4gen.AttentionSpec, batch: int, seqlen_q: int, seqlen_k: int, seed: int):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    heads_q = KV_HEADS * spec.qhead_per_kvhead

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    q = randn(batch, seqlen_q, heads_q, spec.head_dim)
    k = randn(batch, seqlen_k, KV_HEADS, spec.head_dim)
    v = randn(batch, seqlen_k, KV_HEADS, spec.dv)
    return q, k, v


def _run_poisoned(spec, attn, q, k, v, args):
    """Launch into NaN-filled outputs; return (out, lse)."""
    import torch

    o_shape = (*q.shape[:-1], spec.dv)
    out = torch.full(o_shape, float("nan"), device="cuda", dtype=q.dtype)
    lse = None
    if spec.return_lse:
        lse_shape = (q.shape[1], q.shape[0]) if spec.is_varlen else (q.shape[0], q.shape[2], q.shape[1])
        lse = torch.full(lse_shape, float("nan"), device="cuda", dtype=torch.float32)
        result = attn(q, k, v, out=out, lse=lse, **args)
        assert result[0] is out and result[1] is lse
    else:
        assert attn(q, k, v, out=out, **args) is out
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-sq{}-sk{}".format(*s))
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(name, shape):
    """Every spec in specs/ (and the variant cases): the expression-rendered reference and, for
    built-in score modifiers, the hand-written one."""
    spec = CASES[name]
    attn = fa4gen.compile(spec)
    q, k, v, args = variant_inputs(spec, *shape, seed=hash((name, shape)) % 2**31, kv_heads=KV_HEADS)
    out, lse = _run_poisoned(spec, attn, q, k, v, args)
    assert_close_to_reference(spec, q, k, v, out, lse, args=args)
    if spec.score_mod is not None and spec.score_mod.kind in ("alibi", "relative_bias"):
        assert_close_to_reference(spec, q, k, v, out, lse, args=args, independent=True)


FIRST_CALL = first_call_cases()
FIRST_CALL_SHAPES = [(3, 4097, 4097), (2, 777, 1280), (1, 17, 1000)]


@pytest.mark.parametrize("shape", FIRST_CALL_SHAPES, ids=lambda s: "b{}-sq{}-sk{}".format(*s))
@pytest.mark.parametrize("name", sorted(FIRST_CALL))
def test_first_call_kernel_agrees_with_the_planner_s(name, shape):
    """What a first call runs while the planner's kernel builds (one loop body for every key
    tile, key tiles of at most 64) gives the planner's O and LSE up to rounding: its sums run in
    another order, and it finds every tile's row max where the planner's kernel may skip it
    (decision first-call-plan). O within one bf16/fp16 unit of its scale, LSE within 2^-20 of its
    magnitude; both within the reference's bound."""
    import torch

    spec, plan, quick = FIRST_CALL[name]
    q, k, v, args = variant_inputs(spec, *shape, seed=hash((name, shape)) % 2**31, kv_heads=KV_HEADS)
    full = _run_poisoned(spec, fa4gen.compile(spec, kernel_plan=plan), q, k, v, args)
    first = _run_poisoned(spec, fa4gen.compile(spec, kernel_plan=quick), q, k, v, args)
    unit = 2.0**-7 if spec.dtype == "bfloat16" else 2.0**-10  # one unit in the last place, at worst
    # absolute: P rounds to 16 bits either way, so an entry moves by up to a unit of O's scale
    torch.testing.assert_close(first[0], full[0], rtol=unit, atol=unit * float(full[0].abs().max()))
    if first[1] is not None:
        torch.testing.assert_close(first[1], full[1], rtol=2.0**-20, atol=2.0**-20)
    assert_close_to_reference(spec, q, k, v, first[0], first[1], args=args)


@pytest.mark.parametrize(
    "name, tiles",
    [
        (
            "phi3-mini+lse",
            {"main": (192, 128), "short": (128, 128), "long": (192, 144), "decode": (64, 64), "paged": (64, 64)},
        ),
        ("dense-gqa2+lse", {"main": (128, 128), "long": (128, 128), "decode": (64, 64), "paged": (64, 64)}),
        (
            "vit+lse",
            {"main": (192, 128), "short": (256, 64), "long": (192, 128), "decode": (64, 128), "paged": (64, 128)},
        ),
        ("d64-causal-gqa2+lse", {"main": (192, 128), "short": (256, 64), "decode": (64, 128), "paged": (64, 128)}),
    ],
)
def test_each_length_range_runs_its_plan(name, tiles):
    """The default callable carries the planner's kernels for ranges of query lengths (d96:
    128-row tiles for short sequences and 144-key tiles for long ones; d64: 4 consumer
    warpgroups on 256-row tiles for short ones; without a mask, the split tail for long ones):
    each launch runs the kernel of its length, and all match the reference on either side of
    each boundary."""
    from fa4gen.planner import plan_for_seqlen, seqlen_splits

    spec = CASES[name]
    splits = seqlen_splits(spec, "sm_90a")
    attn = fa4gen.compile(spec)
    assert [(s.split, s.kernel.plan) for s in attn.splits] == [(split, split.plan) for split in splits]
    assert {
        "main": (attn.plan.config.tile_m, attn.plan.config.tile_n),
        **{s.label: (s.plan.config.tile_m, s.plan.config.tile_n) for s in splits},
    } == tiles
    for split in (s for s in splits if s.plain):  # (KV-cache launches: test_gpu_decode.py)
        edge = split.max_seqlen_q if split.max_seqlen_q is not None else split.min_seqlen_q - 1
        for seqlen_q in (edge, edge + 1):
            assert attn.kernel_for(seqlen_q).plan == plan_for_seqlen(spec, "sm_90a", seqlen_q)
            q, k, v, args = variant_inputs(spec, 1, seqlen_q, seqlen_q + 76, seed=seqlen_q, kv_heads=KV_HEADS)
            out, lse = _run_poisoned(spec, attn, q, k, v, args)
            assert_close_to_reference(spec, q, k, v, out, lse, args=args)


@pytest.mark.parametrize("name", ["empty-rows+lse", "empty-rows-sinks+lse"])
def test_rows_without_keys_give_zero_and_minus_infinity(name):
    """Rows that see no key: O = 0 exactly and LSE = -inf (or the sink logit), never NaN."""
    import torch

    spec = CASES[name]
    q, k, v, args = variant_inputs(spec, 2, 300, 300, seed=5, kv_heads=KV_HEADS)
    out, lse = _run_poisoned(spec, fa4gen.compile(spec), q, k, v, args)
    empty = slice(0, 40)  # kv_idx + 40 <= q_idx: queries 0..39 see nothing
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    if spec.sinks:  # LSE = the sink logit (to float32 rounding: it passes through log2 units)
        want = args["sinks"].view(1, -1, 1).expand_as(lse[:, :, empty])
        torch.testing.assert_close(lse[:, :, empty], want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(lse[:, :, empty], torch.full_like(lse[:, :, empty], float("-inf")))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


def test_variant_arguments_are_checked_before_launch():
    import torch

    spec = CASES["alibi-slopes-gqa"]
    attn = fa4gen.compile(spec)
    q, k, v, args = variant_inputs(spec, 1, 64, 64, seed=2, kv_heads=KV_HEADS)
    with pytest.raises(ValueError, match="alibi_slopes= is missing"):
        attn(q, k, v)
    with pytest.raises(ValueError, match="alibi_slopes must be a torch.float32 tensor of shape"):
        attn(q, k, v, alibi_slopes=args["alibi_slopes"][:-1])
    with pytest.raises(ValueError, match="sinks= was given"):
        attn(q, k, v, sinks=args["alibi_slopes"], **args)
    with pytest.raises(ValueError, match="aux has"):
        attn(q, k, v, aux={"x": 1.0}, **args)
    torch.cuda.synchronize()


def test_allocates_outputs_and_runs_on_current_stream():
    import torch

    spec = CASES["llama3-8b"]
    attn = fa4gen.compile(spec)
    q, k, v = _inputs(spec, 2, 333, 555, seed=7)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = attn(q, k, v)
    stream.synchronize()
    assert out.shape == (2, 333, q.shape[2], spec.dv) and out.dtype == q.dtype
    assert_close_to_reference(spec, q, k, v, out)


def test_zero_batch_and_empty_queries():
    import torch

    spec = CASES["vit+lse"]
    attn = fa4gen.compile(spec)
    q, k, v = _inputs(spec, 1, 5, 5, seed=3)
    out, lse = attn(q[:, :0], k, v)
    assert out.shape == (1, 0, q.shape[2], spec.dv) and lse.shape == (1, q.shape[2], 0)
    out, lse = attn(q[:0], k[:0], v[:0])
    assert out.shape[0] == 0 and lse.shape[0] == 0
    torch.cuda.synchronize()


def test_rejects_cpu_tensors_and_bad_heads_before_launch():
    import torch

    spec = CASES["llama3-8b"]
    attn = fa4gen.compile(spec)
    q, k, v = _inputs(spec, 1, 8, 8, seed=1)
    with pytest.raises(ValueError, match="q is on cpu"):
        attn(q.cpu(), k.cpu(), v.cpu())
    with pytest.raises(ValueError, match="q heads"):
        attn(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="dtype"):
        attn(q.float(), k, v)
    torch.cuda.synchronize()


# the keys visited last (the lowest: key tiles go from the highest down) scaled so the running
# max grows there: by 2^8 .. 2^120 (stale-max kernels move their reference up) or past 2^128
# (their exponentials overflow and the scores are computed again)
LATE_GROWTH = {"plain": 1.0, "regrow": 8.0, "overflow": 60.0}
# key offsets (Sk - Sq) where a causal row sees its first key in the first key tile that no
# bound cuts: row 0 at 256-row, 64-key tiles (Sk = Sq + 127), row 192 at 192-row, 128-key tiles
# (Sk = Sq + 63); stale-max kernels run that tile with the mask code (masking.bounds_of_rows)
LATE_GROWTH_SHAPES = [(2, 1000, 1000), (1, 1000, 1127), (1, 1100, 1163), (1, 777, 1280)]


@pytest.mark.parametrize("shape", LATE_GROWTH_SHAPES, ids=lambda s: "b{}-sq{}-sk{}".format(*s))
@pytest.mark.parametrize("growth", sorted(LATE_GROWTH))
@pytest.mark.parametrize(
    "name",
    [
        "d64-causal-gqa2+lse",
        "vit+lse",
        "dense-gqa2+lse",
        "phi3-mini+lse",
        "d256-causal-gqa2+lse",
        "window-relbias-softcap+lse",
        "alibi-mpt+lse",
    ],
)
def test_running_max_growing_late(name, growth, shape):
    """Scores far above the first tiles' in the last key tiles: the online softmax's rescale
    (and a stale max's regrowth or recomputation) still matches the reference."""
    spec = CASES[name]
    attn = fa4gen.compile(spec)
    q, k, v, args = variant_inputs(spec, *shape, seed=hash((name, growth, shape)) % 2**31, kv_heads=KV_HEADS)
    k[:, :100] *= LATE_GROWTH[growth]
    out, lse = _run_poisoned(spec, attn, q, k, v, args)
    assert_close_to_reference(spec, q, k, v, out, lse, args=args)


OPTION_CASES = plan_option_cases()
TAIL_CASES = pair_tail_specs()


@pytest.mark.parametrize(
    "shape", [(2, 1000, 1000), (1, 17, 700), (3, 700, 17), (2, 300, 1280)], ids=lambda s: "b{}-sq{}-sk{}".format(*s)
)
@pytest.mark.parametrize("name", sorted(OPTION_CASES))
def test_plan_option_paths(name, shape):
    """Every plan option away from its default (ping-pong, mask runs, tile order, split tail,
    O staging, Q buffers and barriers, P staging, warpgroup count, rescale threshold, stale max,
    key-tile size, chained tiles) still matches the reference."""
    import torch

    spec, kernel_plan = OPTION_CASES[name]
    attn = fa4gen.compile(spec, kernel_plan=kernel_plan)
    assert attn.plan == kernel_plan
    q, k, v = _inputs(spec, *shape, seed=11)
    out = torch.full((shape[0], shape[1], q.shape[2], spec.dv), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((shape[0], q.shape[2], shape[1]), float("nan"), device="cuda", dtype=torch.float32)
    attn(q, k, v, out=out, lse=lse)
    torch.cuda.synchronize()
    assert_close_to_reference(spec, q, k, v, out, lse)


@pytest.mark.parametrize("ctas", [1, 3, 7])
@pytest.mark.parametrize("name", sorted(TAIL_CASES))
def test_causal_pairs_then_tail_on_few_ctas(monkeypatch, ctas, name):
    """A persistent launch on fewer CTAs than SMs (the SM count is a run-time argument), so the
    causal schedule runs whole rounds of pairs and then, with enough query tiles per head, its
    heaviest-first tail of single tiles."""
    spec, seqlen = TAIL_CASES[name]
    attn = fa4gen.compile(spec)
    assert attn.plan.config.tile_order == "paired" and attn.plan.config.pair_tail_rounds > 0
    monkeypatch.setattr(fa4gen.runtime, "multiprocessor_count", lambda device: ctas)
    q, k, v = _inputs(spec, 2, seqlen, seqlen, seed=5)
    out, lse = _run_poisoned(spec, attn, q, k, v, {})
    assert_close_to_reference(spec, q, k, v, out, lse)


SPLIT_CASES = split_tail_cases()


def _launches_on_ctas(monkeypatch, spec, attn, shape, ctas: int, repeats: int) -> None:
    """Launch on ``ctas`` CTAs: the output against the reference, then ``repeats`` launches more,
    each bit-identical to the first."""
    import torch

    monkeypatch.setattr(fa4gen.runtime, "multiprocessor_count", lambda device: ctas)
    q, k, v, args = variant_inputs(spec, *shape, seed=ctas, kv_heads=KV_HEADS)
    out, lse = _run_poisoned(spec, attn, q, k, v, args)
    assert_close_to_reference(spec, q, k, v, out, lse, args=args)
    for _ in range(repeats):
        again, again_lse = _run_poisoned(spec, attn, q, k, v, args)
        assert torch.equal(again, out) and (lse is None or torch.equal(again_lse, lse))


KEYLESS_CASES = keyless_cases()


@pytest.mark.parametrize("ctas", [1, 3])
@pytest.mark.parametrize("name", sorted(KEYLESS_CASES))
def test_o_over_v_through_runs_of_keyless_tiles(monkeypatch, name, ctas):
    """More queries than keys on few CTAs: each CTA ends with a run of query tiles whose rows see
    no key (bottom-right causal), where nothing on K/V keeps warpgroup 0 from running ahead of
    warpgroup 1, whose O store it orders by a barrier per tile parity (sm90.epilogue.o_tile_over_v;
    two tiles ahead, it would arrive at its barrier twice). Launch after launch matches the reference."""
    spec, kernel_plan = KEYLESS_CASES[name]
    attn = fa4gen.compile(spec, kernel_plan=kernel_plan)
    assert attn.plan.config.o_staging == "over_v"
    _launches_on_ctas(monkeypatch, spec, attn, (2, 1500, 100), ctas, repeats=2)


@pytest.mark.parametrize(
    "shape",
    [(2, 1000, 1000), (3, 300, 2000), (1, 4100, 300), (2, 1000, 17), (8, 2000, 2000)],
    ids=lambda s: "b{}-sq{}-sk{}".format(*s),
)
@pytest.mark.parametrize("ctas", [3, 7, 30, 132])
@pytest.mark.parametrize("name", sorted(SPLIT_CASES))
def test_split_tail_on_few_ctas(monkeypatch, name, ctas, shape):
    """A persistent launch on fewer CTAs than tiles, so the split tail cuts tiles between CTAs
    (a writer's partial merged by its finisher); launched again and again, each output
    bit-identical to the first: every launch leaves the flags down for the next (a flag left up
    would hand a later finisher a stale partial)."""
    spec, kernel_plan = SPLIT_CASES[name]
    attn = fa4gen.compile(spec, kernel_plan=kernel_plan)
    assert attn.kernel_for(shape[1]).plan.config.split_tail
    _launches_on_ctas(monkeypatch, spec, attn, shape, ctas, repeats=8)


@pytest.mark.parametrize(
    "shape", [(3, 700, 1000), (2, 1000, 300), (2, 300, 200), (2, 1000, 17)], ids=lambda s: "b{}-sq{}-sk{}".format(*s)
)
@pytest.mark.parametrize("ctas", [1, 3, 7])
def test_chained_tiles_on_few_ctas(monkeypatch, ctas, shape):
    """The chained d128 kernel (config.chain_query_tiles) on fewer CTAs than query tiles: each CTA
    holds tile after tile across heads and batch entries. Where a tile visits 3 key tiles or
    more, the producer publishes the next tile with its Q one key tile in (q_ahead: 8 and 3 key
    tiles here); with 2 or 1 the next tile's own loads do. Launched again, bit-identical. (The
    chained kernel with LSE on few CTAs: the split tail's "d128-gqa2-chained" case.)"""
    spec = CASES["dense-gqa2"]
    attn = fa4gen.compile(spec)
    config = attn.kernel_for(shape[1]).plan.config
    assert config.chain_query_tiles and config.q_stages == 2 and not config.split_tail
    _launches_on_ctas(monkeypatch, spec, attn, shape, ctas, repeats=2)


@pytest.mark.parametrize(
    "name, shape",
    [
        ("dense-gqa2+lse", (2, 4100, 4200)),  # d128: 33 key tiles of 128, at least the plan's minimum (32)
        ("vit+lse", (2, 2100, 2150)),  # d64: from 2048 query rows, 17 key tiles (the minimum is 16)
    ],
)
@pytest.mark.parametrize("ctas", [7, 30])
def test_long_launches_split_their_tail_as_planned(monkeypatch, ctas, name, shape):
    """The planner's own long-range kernel (split tail from its minimum of key tiles), launched
    on a few CTAs with enough key tiles to split, repeatedly: every output matches the first."""
    spec = CASES[name]
    attn = fa4gen.compile(spec)
    config = attn.kernel_for(shape[1]).plan.config
    assert config.split_tail and -(-shape[2] // config.tile_n) >= config.split_tail_min_key_tiles
    _launches_on_ctas(monkeypatch, spec, attn, shape, ctas, repeats=3)


def test_split_tail_in_a_cuda_graph(monkeypatch):
    """Captured with no launch before it, so its workspace is made during the capture (the flags'
    zero fill a node of the graph): every replay matches an eager launch bit for bit; an eager
    launch on the capture stream before any replay gets a workspace of its own, and so does the
    eager launch on the default stream; a second graph captured on that stream shares the
    captured workspace and zero-fills its flags itself."""
    import torch

    spec, kernel_plan = SPLIT_CASES["d128-gqa2"]
    attn = fa4gen.compile(spec, kernel_plan=kernel_plan)
    monkeypatch.setattr(fa4gen.runtime, "multiprocessor_count", lambda device: 7)
    monkeypatch.setattr(fa4gen.runtime, "_SPLIT_WORKSPACES", {})
    q, k, v, args = variant_inputs(spec, 2, 1000, 1000, seed=17, kv_heads=KV_HEADS)
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured_out, captured_lse = attn(q, k, v, **args)
    with torch.cuda.stream(stream):
        eager_out, eager_lse = _run_poisoned(spec, attn, q, k, v, args)
    torch.cuda.synchronize()
    assert_close_to_reference(spec, q, k, v, eager_out, eager_lse, args=args)
    keys = set(fa4gen.runtime._SPLIT_WORKSPACES)
    assert {key[3] for key in keys if key[1] == stream.cuda_stream} == {True, False}
    for _ in range(4):
        captured_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured_out, eager_out) and torch.equal(captured_lse, eager_lse)
    out, lse = _run_poisoned(spec, attn, q, k, v, args)  # the default stream: its own workspace
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    assert len(fa4gen.runtime._SPLIT_WORKSPACES) == 3
    # a second graph on the capture stream takes the captured workspace as it is, so its launch
    # must zero-fill the flags within the graph: raised beforehand, every flag is down after a
    # replay (those of slots no writer used too, which only the fill lowers: CTA 0 never writes)
    second = torch.cuda.CUDAGraph()
    with torch.cuda.graph(second, stream=stream):
        second_out, second_lse = attn(q, k, v, **args)
    assert len(fa4gen.runtime._SPLIT_WORKSPACES) == 3
    _, flags = next(pair for key, pair in fa4gen.runtime._SPLIT_WORKSPACES.items() if key[3])
    flags.fill_(1000)
    second.replay()
    torch.cuda.synchronize()
    assert not flags.any(), "the second graph did not zero-fill the split tail's flags"
    assert torch.equal(second_out, eager_out) and torch.equal(second_lse, eager_lse)


def test_block_mask_is_cached_reusable_and_follows_aux_values():
    """An expression mask's block mask is built once per shape and aux values, can be built
    explicitly and shared, and new scalar values give new masks without recompiling."""
    import torch

    spec = CASES["streaming-llm"]
    attn = fa4gen.compile(spec)
    q, k, v, args = variant_inputs(spec, 2, 1000, 1000, seed=9, kv_heads=KV_HEADS)
    attn._block_masks.clear()  # the kernel object is shared with earlier tests in this process
    for window in (100, 700):
        args["aux"] = {"sink_tokens": 3, "window": window}
        out, _ = _run_poisoned(spec, attn, q, k, v, args)
        assert_close_to_reference(spec, q, k, v, out, args=args)
    assert len(attn._block_masks) == 2
    attn(q, k, v, **args)
    assert len(attn._block_masks) == 2  # same shape and values: reused
    shared = attn.block_mask(2, q.shape[2], 1000, 1000, aux=args["aux"])
    assert 0.0 < shared.sparsity() < 1.0
    out = attn(q, k, v, block_mask=shared, **args)
    torch.cuda.synchronize()
    assert_close_to_reference(spec, q, k, v, out, args=args)
    with pytest.raises(ValueError, match="built for Sq=1000"):
        attn(q[:, :500], k, v, block_mask=shared, **args)
    with pytest.raises(ValueError, match="reads sink_tokens, window"):
        attn.block_mask(2, q.shape[2], 1000, 1000)
