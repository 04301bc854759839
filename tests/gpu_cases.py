"""The kernels the GPU tests run, in one place: the warm script compiles exactly these.

GPU test machines may have only the CuTe DSL runtime (no compiler), so these specs are
compiled beforehand (`python tests/warm_gpu_cache.py DIR`) and the cache travels with the tests.
"""

from __future__ import annotations

from pathlib import Path

from fa4gen import AttentionSpec, load_spec

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"

# (batch, seqlen_q, seqlen_k): 1, ragged tiles (17, 1000, 4097), Sq != Sk both ways
# (2, 777, 1280): Sk fills whole key tiles of 64, 80 and 128 (a first key tile without a bound)
SHAPES = [
    (1, 1, 1),
    (3, 17, 17),
    (1, 1000, 1000),
    (3, 4097, 4097),
    (1, 17, 1000),
    (3, 1000, 17),
    (1, 1, 4097),
    (2, 777, 1280),
]


def spec_files() -> list[Path]:
    return sorted(SPECS_DIR.glob("*.yaml"))


def gpu_specs() -> dict[str, AttentionSpec]:
    """Every spec in specs/ with the LSE output on (so O and LSE are both checked), plus each
    spec as written when it has no LSE (the launch path without an LSE tensor)."""
    cases: dict[str, AttentionSpec] = {}
    for path in spec_files():
        spec = load_spec(path)
        cases[f"{path.stem}+lse"] = spec.model_copy(update={"return_lse": True})
        if not spec.return_lse:
            cases[path.stem] = spec
    return cases


def variant_specs() -> dict[str, AttentionSpec]:
    """Variants beyond specs/ that the GPU tests need: boundaries the model configs never reach
    at test sizes (small chunks), combinations, and masks that leave rows without any key."""
    return {
        "chunked-256+lse": AttentionSpec(
            head_dim=64, qhead_per_kvhead=2, mask={"kind": "chunked", "size": 256}, return_lse=True
        ),
        "documents-bidirectional-sinks+lse": AttentionSpec(head_dim=128, mask="document", sinks=True, return_lse=True),
        "window-relbias-softcap+lse": AttentionSpec(
            head_dim=128,
            causal=True,
            window_left=300,
            softcap=20.0,
            return_lse=True,
            score_mod={"kind": "relative_bias", "max_distance": 64},
        ),
        "expression-not-or+lse": AttentionSpec(
            head_dim=128,
            mask={"kind": "expression", "expr": "not (kv_idx > q_idx) and not (q_idx - kv_idx >= 300) or kv_idx == 0"},
            return_lse=True,
        ),
        # d256: short launches run 64-key tiles, long ones the table's 80-key tiles
        "d256-causal-gqa2+lse": AttentionSpec(head_dim=256, causal=True, qhead_per_kvhead=2, return_lse=True),
        # d64 causal: short launches run 4 consumer warpgroups (256-row tiles); specs/ has d64
        # causal only with windows, which keep 2 or 3
        "d64-causal-gqa2+lse": AttentionSpec(head_dim=64, causal=True, qhead_per_kvhead=2, return_lse=True),
        # d128 without a mask chains its query tiles (config.chain_query_tiles) unless it returns
        # the LSE: no spec in specs/ is one
        "dense-gqa2": AttentionSpec(head_dim=128, qhead_per_kvhead=2),
        "dense-gqa2+lse": AttentionSpec(head_dim=128, qhead_per_kvhead=2, return_lse=True),
        "empty-rows+lse": AttentionSpec(
            head_dim=64, mask={"kind": "expression", "expr": "kv_idx + 40 <= q_idx"}, return_lse=True
        ),
        "empty-rows-sinks+lse": AttentionSpec(
            head_dim=64, mask={"kind": "expression", "expr": "kv_idx + 40 <= q_idx"}, sinks=True, return_lse=True
        ),
    }


def variant_inputs(spec: AttentionSpec, batch: int, seqlen_q: int, seqlen_k: int, seed: int, kv_heads: int = 2):
    """Random q, k, v and the variant's run-time arguments for one shape. Document masks pack
    ``batch`` documents of random lengths (1..seqlen_q queries, 1..seqlen_k keys) into
    (total, H, D) tensors."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    cpu = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    heads_q = kv_heads * spec.qhead_per_kvhead

    def randn(*shape, scale=1.0, kind=torch.float32):
        return (torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32) * scale).to(kind)

    args: dict = {}
    if spec.mask_kind == "document":
        lens_q = torch.randint(1, seqlen_q + 1, (batch,), generator=cpu)
        lens_k = torch.randint(1, seqlen_k + 1, (batch,), generator=cpu)
        zero = torch.zeros(1, dtype=torch.int64)
        args["cu_seqlens_q"] = torch.cat([zero, lens_q.cumsum(0)]).to(torch.int32).cuda()
        args["cu_seqlens_k"] = torch.cat([zero, lens_k.cumsum(0)]).to(torch.int32).cuda()
        q_shape, k_shape = (int(lens_q.sum()), heads_q), (int(lens_k.sum()), kv_heads)
    else:
        q_shape, k_shape = (batch, seqlen_q, heads_q), (batch, seqlen_k, kv_heads)
    q, k = randn(*q_shape, spec.head_dim, kind=dtype), randn(*k_shape, spec.head_dim, kind=dtype)
    v = randn(*k_shape, spec.dv, kind=dtype)
    if spec.sinks:
        args["sinks"] = randn(heads_q, scale=2.0)
    if spec.mask_kind == "prefix_lm":
        args["prefix_lengths"] = torch.randint(0, seqlen_k + 1, (batch,), generator=cpu).to(torch.int32).cuda()
    if spec.score_mod is not None and spec.score_mod.kind == "alibi" and spec.score_mod.slopes == "tensor":
        args["alibi_slopes"] = randn(heads_q).abs() * 0.1
    if spec.score_mod is not None and spec.score_mod.kind == "relative_bias":
        args["rel_bias"] = randn(heads_q, 2 * spec.score_mod.max_distance + 1)
    sizes = {"B": batch, "Hq": heads_q, "Hkv": kv_heads, "Sq": seqlen_q, "Sk": seqlen_k}
    aux = {}
    for name, decl in spec.aux.items():
        shape = [d if isinstance(d, int) else sizes[d] for d in decl.shape]
        aux[name] = (
            randn(*shape).abs() + 0.5
            if decl.dtype == "float32"
            else torch.randint(0, 8, shape, generator=cpu).to(torch.int32).cuda()
        )
    for name, dtype_name in spec.scalars.items():
        aux[name] = (
            int(torch.randint(1, max(2, seqlen_k // 2), (1,), generator=cpu))
            if dtype_name == "int32"
            else float(torch.rand(1, generator=cpu)) * 0.5
        )
    if aux:
        args["aux"] = aux
    return q, k, v, args


def example_specs() -> dict[str, AttentionSpec]:
    """What examples/quickstart.py compiles on a GPU."""
    spec = AttentionSpec(head_dim=128, qhead_per_kvhead=4, causal=True, dtype="bfloat16")
    return {"quickstart": spec, "quickstart+lse": spec.model_copy(update={"return_lse": True})}


def pair_tail_specs() -> dict[str, tuple[AttentionSpec, int]]:
    """Causal specs and a query length (even and odd query-tile counts, 2 and 3 warpgroups)
    that the GPU tests launch on a few CTAs: whole rounds of pairs, then the heaviest-first tail
    (at least the plan's pair_tail_min_tiles query tiles), and one length without a tail."""
    d128 = AttentionSpec(head_dim=128, qhead_per_kvhead=2, causal=True, return_lse=True)
    return {
        "d128-even": (d128, 2560),
        "d128-odd": (d128, 2600),
        "d128-no-tail": (d128, 1100),
        "d64-odd": (AttentionSpec(head_dim=64, causal=True, return_lse=True), 3900),
    }


def split_tail_cases() -> dict[str, tuple[AttentionSpec, object]]:
    """Specs whose plans split the tail (config.split_tail), with the plan of a query length and
    the split allowed from 1 key tile on (the planner's minimum would leave the test shapes
    unsplit), which the GPU tests launch on a few CTAs so that tiles are cut between CTAs: 2
    warpgroups (d128, whose LSE leaves its query tiles unchained, and chained), 3 warpgroups
    whose last query tile has rows past Sq (d64), P through shared memory with O staged over it
    (d96's 144-key tiles), sinks and
    softcap (the row statistics merged before the finalize weighs in the sink, the partial O
    added after it), and the long-range plans of d256 and d192 (one Q buffer, O without a
    buffer of its own; d192's one plan splits at every length)."""
    from fa4gen.planner import plan_for_seqlen

    cases = {}
    for name, spec, seqlen in (
        ("d128-gqa2", AttentionSpec(head_dim=128, qhead_per_kvhead=2, return_lse=True), 1000),
        ("d64", AttentionSpec(head_dim=64, return_lse=True), 1000),
        ("d96-long", AttentionSpec(head_dim=96, return_lse=True), 4100),
        ("d128-sinks-softcap", AttentionSpec(head_dim=128, sinks=True, softcap=30.0, return_lse=True), 1000),
        ("d256-long", AttentionSpec(head_dim=256, return_lse=True), 4100),
        ("d192-long", AttentionSpec(head_dim=192, head_dim_v=128, return_lse=True), 2100),
    ):
        p = plan_for_seqlen(spec, "sm_90a", seqlen)
        cases[name] = (spec, p.with_config("split from 1 key tile", split_tail=True, split_tail_min_key_tiles=1))
    # chained query tiles (d128 chains them without LSE; the tests' split needs the LSE to check)
    spec, p = cases["d128-gqa2"]
    cases["d128-gqa2-chained"] = (spec, p.with_config("chained", chain_query_tiles=True))
    return cases


def first_call_cases() -> dict[str, tuple[AttentionSpec, object, object]]:
    """(spec, planner's plan, first-call plan) for every GPU case and length range whose plan
    has a first-call plan: on random inputs what a first call runs agrees with the planner's kernel to rounding."""
    import fa4gen
    from fa4gen.planner import first_call_plan, seqlen_splits

    cases = {}
    for name, spec in {**gpu_specs(), **variant_specs()}.items():
        plans = {"main": fa4gen.plan(spec, "sm_90a")} | {s.label: s.plan for s in seqlen_splits(spec, "sm_90a")}
        for label, plan in plans.items():
            quick = first_call_plan(plan)
            if quick is not None:
                cases[f"{name}/{label}"] = (spec, plan, quick)
    return cases


def plan_option_cases() -> dict[str, tuple[AttentionSpec, object]]:
    """Each plan option flipped away from the planner's default, on a spec that exercises it:
    the GPU tests run every one of these paths against the reference."""
    import fa4gen
    from fa4gen.planner.candidates import sm90_fits, sm90_refit
    from fa4gen.planner.sm90 import O_STAGING
    from fa4gen.planner.sm90_tables import NO_PAIR_TAIL, SM90_REGISTER_SPLIT

    cases = {}
    for name, spec in {
        "d128-causal": AttentionSpec(head_dim=128, qhead_per_kvhead=2, causal=True, return_lse=True),
        "d64-window": AttentionSpec(head_dim=64, window_left=200, window_right=30, return_lse=True),
        "d256-softcap": AttentionSpec(head_dim=256, softcap=30.0, return_lse=True),
        "d96": AttentionSpec(head_dim=96, return_lse=True),
    }.items():
        base = fa4gen.plan(spec, "sm_90a")
        c = base.config
        other_wgs = 5 - c.num_consumer_warpgroups  # 2 <-> 3
        producer_regs, consumer_regs = SM90_REGISTER_SPLIT[other_wgs]
        flips = {
            "pingpong": {"pingpong": not c.pingpong},
            "mask-runs": {"mask_runs": not c.mask_runs} if spec.has_mask else None,  # structural here
            "interior-first-tile": {"interior_first_tile": not c.interior_first_tile}
            if spec.right_bound is None
            else None,
            # the split tail's code where the plan (short of the long range) has none; it splits
            # nothing on these shapes' few tiles (the split itself on few CTAs: split_tail_cases)
            "split-tail": {"split_tail": True, "split_tail_min_key_tiles": 1}
            if c.tile_order == "head_major" and not spec.has_mask
            else None,
            "tile-order": {"tile_order": "heavy_first" if c.tile_order == "paired" else "paired", **NO_PAIR_TAIL},
            # whole rounds of causal pairs to the end (the tail itself: pair_tail_specs)
            "pair-tail": NO_PAIR_TAIL if c.pair_tail_rounds else None,
            **{f"o-{o.replace('_', '-')}": {"o_staging": o, "q_stages": 1} for o in O_STAGING if o != c.o_staging},
            # O over V as the planner has it, with Q barriers per warpgroup (a warpgroup without a
            # key tile, at Sq > Sk causal and in windows, stages O over its own Q rows)
            "o-over-v-q-per-warpgroup": {"o_staging": "over_v", "q_stages": 1, "q_per_warpgroup": True}
            if c.o_staging != "over_v"
            else None,
            "q-stages": {"q_stages": 3 - c.q_stages},
            "q-per-warpgroup": {"q_per_warpgroup": not c.q_per_warpgroup} if c.num_consumer_warpgroups > 1 else None,
            "p-staging": {"p_in_registers": not c.p_in_registers, "q_stages": 1},
            "warpgroups": {
                "num_consumer_warpgroups": other_wgs,
                "producer_regs": producer_regs,
                "consumer_regs": consumer_regs,
            },
            "rescale-threshold": {"rescale_threshold": 0.0, "stale_max": False}
            if c.rescale_threshold
            else {"rescale_threshold": 8.0},
            "stale-max": {"stale_max": not c.stale_max, "rescale_threshold": 8.0},
            "tile-n": {"tile_n": c.tile_n + 16},
            # chained query tiles where the kernel allows them (held tiles meet causal tiles
            # without keys at Sq > Sk, and the CTA's last tile)
            "chain": {"chain_query_tiles": not c.chain_query_tiles},
        }
        for flip, update in filter(lambda item: item[1] is not None, flips.items()):
            p = base.with_config(f"plan option path: {flip}", **update)
            if flip == "tile-n":  # as tune's candidates: Q and O buffers give way where needed
                p = sm90_refit(p, "16 more keys per tile")
            if sm90_fits(p):  # the kernel's config_problem and a register estimate
                cases[f"{name}/{flip}"] = (spec, p)
    return cases


def keyless_cases() -> dict[str, tuple[AttentionSpec, object]]:
    """O over the last V stage where a mask leaves query tiles without keys (more queries than
    keys): the planner's d256 causal plan (Q barriers per warpgroup) and the plan-option flips
    that stage O over V, with and without them."""
    import fa4gen

    cases = {
        name: case
        for name, case in plan_option_cases().items()
        if case[1].config.o_staging == "over_v" and case[0].has_mask
    }
    spec = AttentionSpec(head_dim=256, causal=True)
    cases["d256-causal"] = (spec, fa4gen.plan(spec, "sm_90a"))
    return cases


AUTOGRAD_CASES = (
    "d128-gqa4-causal",
    "d64-gqa1-dense",
    "d128-lse",
    "d64-relbias",
    "d64-gqa4-causal",
    "gpt-oss-sinks",
    "prefix-lm",
    "packed-documents",
    "streaming-llm",
    "expression-score",
    "t5-relative-bias",
    "d128-alibi-train-gqa2",
    "deepseek-style",
    "gemma2-local",
)  # backward_specs run through autograd (prefix lengths and cu_seqlens through the backward op too)
BACKWARD_SHAPES = [(1, 1, 1), (3, 17, 17), (1, 1000, 1000), (2, 300, 1000), (1, 1000, 300), (1, 4097, 4097)]


def backward_specs() -> dict[str, AttentionSpec]:
    """Every variant the backward runs: head dims, GQA, causal, windows, soft cap, fp16."""
    cases = {}
    for d in (64, 96, 128):
        for ratio in (1, 4):
            for causal in (False, True):
                name = f"d{d}-gqa{ratio}-{'causal' if causal else 'dense'}"
                cases[name] = AttentionSpec(head_dim=d, qhead_per_kvhead=ratio, causal=causal)
    cases["d128-window100"] = AttentionSpec(head_dim=128, qhead_per_kvhead=4, causal=True, window_left=100)
    cases["d64-window-two-sided"] = AttentionSpec(head_dim=64, window_left=64, window_right=32)
    cases["d128-softcap30-causal"] = AttentionSpec(head_dim=128, qhead_per_kvhead=2, causal=True, softcap=30.0)
    cases["d128-fp16-causal"] = AttentionSpec(head_dim=128, dtype="float16", causal=True)
    cases["d128-dv64"] = AttentionSpec(head_dim=128, head_dim_v=64, qhead_per_kvhead=2)
    cases["d80-scale"] = AttentionSpec(head_dim=80, softmax_scale=0.2, causal=True)
    cases["d128-lse"] = AttentionSpec(head_dim=128, qhead_per_kvhead=4, causal=True, return_lse=True)
    # head dims past 128: dK and dV split by head-dim columns (dkv_split n): DeepSeek's 192/128
    # with its LSE, 192/192, d256 dense and causal GQA 4, Gemma 2's local layers (d256, soft cap,
    # window, GQA 2), an odd width past 128
    cases["deepseek-style"] = load_spec(SPECS_DIR / "deepseek-style.yaml")
    cases["d192-dense"] = AttentionSpec(head_dim=192)
    cases["d256-gqa1-dense"] = AttentionSpec(head_dim=256)
    cases["d256-gqa4-causal"] = AttentionSpec(head_dim=256, qhead_per_kvhead=4, causal=True)
    cases["gemma2-local"] = load_spec(SPECS_DIR / "gemma2-local.yaml")
    cases["d144-dv240-window"] = AttentionSpec(head_dim=144, head_dim_v=240, causal=True, window_left=200)
    # score modifiers: their derivative with respect to the score comes from the expression
    cases["d128-alibi-gqa2-causal"] = AttentionSpec(
        head_dim=128, qhead_per_kvhead=2, causal=True, score_mod={"kind": "alibi"}
    )
    cases["d128-alibi-tensor"] = AttentionSpec(head_dim=128, score_mod={"kind": "alibi", "slopes": "tensor"})
    cases["d64-relbias"] = AttentionSpec(head_dim=64, score_mod={"kind": "relative_bias", "max_distance": 64})
    cases["d64-leaky-window"] = AttentionSpec(
        head_dim=64,
        qhead_per_kvhead=2,
        causal=True,
        window_left=300,
        score_mod={"kind": "expression", "expr": "max(score, 0.2 * score) + 0.01 * abs(q_idx - kv_idx)"},
    )
    cases["expression-score"] = load_spec(SPECS_DIR / "expression-score.yaml")  # its temperatures train
    # trainable tensors: T5's bias table (a scatter per score), ALiBi slopes (one sum per step)
    cases["t5-relative-bias"] = load_spec(SPECS_DIR / "t5-relative-bias.yaml")
    cases["d128-alibi-train-gqa2"] = AttentionSpec(
        head_dim=128,
        qhead_per_kvhead=2,
        causal=True,
        score_mod={"kind": "alibi", "slopes": "tensor", "requires_grad": True},
    )
    cases["d256-alibi-train"] = AttentionSpec(
        head_dim=256, causal=True, score_mod={"kind": "alibi", "slopes": "tensor", "requires_grad": True}
    )
    cases["gpt-oss-sinks"] = load_spec(SPECS_DIR / "gpt-oss-sinks.yaml")  # d64, GQA 8, window, sinks
    cases["d128-chunked256"] = AttentionSpec(head_dim=128, qhead_per_kvhead=2, mask={"kind": "chunked", "size": 256})
    cases["prefix-lm"] = load_spec(SPECS_DIR / "prefix-lm.yaml")  # d128, LSE, prefix lengths per batch entry
    # packed documents (documents of random lengths, packed): causal GQA 4, windows with the KV
    # heads' query heads split over two CTAs, no mask beyond the documents
    cases["packed-documents"] = load_spec(SPECS_DIR / "packed-documents.yaml")
    cases["docs-window-gqa2"] = AttentionSpec(
        head_dim=64, qhead_per_kvhead=2, window_left=100, window_right=0, mask="document"
    )
    cases["docs-d96-dense"] = AttentionSpec(head_dim=96, mask="document", return_lse=True)
    cases["docs-d256-causal"] = AttentionSpec(head_dim=256, qhead_per_kvhead=2, causal=True, mask="document")
    # expression masks (block skipping from the backward's block mask): sink keys and a window
    # beside causal bounds, one read per query head (GQA 2: a KV head walks its group's union),
    # one read per batch entry from an aux tensor
    cases["streaming-llm"] = load_spec(SPECS_DIR / "streaming-llm.yaml")
    cases["expr-per-head-gqa2"] = AttentionSpec(
        head_dim=64,
        qhead_per_kvhead=2,
        mask={"kind": "expression", "expr": "kv_idx + h * 150 <= q_idx + 100 or kv_idx // 64 == 3"},
    )
    cases["expr-lengths-d128"] = AttentionSpec(
        head_dim=128,
        mask={"kind": "expression", "expr": "kv_idx < lengths[b] * 100 + 1"},
        aux={"lengths": {"dtype": "int32", "shape": ["B"]}},
    )
    # deterministic: dQ's sums in key-tile order, over every way the key tiles walk query tiles
    for name in DETERMINISTIC_CASES:
        cases[f"{name}-deterministic"] = cases[name].model_copy(update={"deterministic": True})
    return cases


# the backward cases that also run deterministic (dense, causal, GQA, windows with the KV heads'
# query heads split over two CTAs, chunks, prefix-LM, sinks, documents, expression masks, head dims
# past 128, d64's 128-row steps); the first three are also the
# specs of benchmarks/backward.py's cells d96, d128 causal and d128 gqa4 causal, whose
# deterministic cost a run of `--deterministic` measures from the tests' cache
def grouped_turns_plan(spec: AttentionSpec):
    """The planner's backward plan of deterministic ``spec`` with dq_grouped_turns on (the GPU
    tests and tests/warm_gpu_cache.py build it beside the planner's)."""
    from fa4gen.api import training_spec
    from fa4gen.planner import backward_plan

    return backward_plan(training_spec(spec)).with_config("the GPU tests", dq_grouped_turns=True)


def transposed_plan(spec: AttentionSpec):
    """The planner's backward plan of ``spec`` computed transposed (dkv_split t: 96 keys per CTA,
    dK^T and dV^T with keys on the MMA's N side; the GPU tests and tests/warm_gpu_cache.py build
    it beside the planner's)."""
    from fa4gen.api import training_spec
    from fa4gen.kernels.sm90.bwd_config import bwd_config_problem
    from fa4gen.planner import backward_plan

    plan = backward_plan(training_spec(spec)).with_config("the GPU tests", dkv_split="t", keys_per_warpgroup=48)
    if bwd_config_problem(plan.config):  # (192/192: two Q/dO stages do not fit beside 96 keys)
        plan = plan.with_config("the GPU tests", q_stages=1)
    return plan


def transposed_specs() -> dict[str, AttentionSpec]:
    """The variants the transposed backward (transposed_plan) runs: d192/128 and 192/192 over
    every path of its step (plain, soft cap, score modifiers with trainable tensors, windows,
    chunks, prefix-LM, expression masks, sinks, GQA, deterministic dQ)."""
    cases = backward_specs()
    wide = dict(head_dim=192, head_dim_v=128)
    specs = {
        "deepseek-style": cases["deepseek-style"],
        "d192-dense": cases["d192-dense"],
        "d192-gqa4-causal": AttentionSpec(**wide, qhead_per_kvhead=4, causal=True),
        "d192-softcap-window": AttentionSpec(**wide, qhead_per_kvhead=2, causal=True, window_left=150, softcap=30.0),
        "d192-two-sided-sinks": AttentionSpec(**wide, window_left=100, window_right=40, sinks=True),
        "d192-chunked": AttentionSpec(**wide, mask={"kind": "chunked", "size": 256}),
        "d192-prefix": cases["prefix-lm"].model_copy(update=wide),
        "d192-alibi-train": AttentionSpec(
            **wide, causal=True, score_mod={"kind": "alibi", "slopes": "tensor", "requires_grad": True}
        ),
        "d192-leaky": cases["d64-leaky-window"].model_copy(update=wide),
        "d192-streaming": cases["streaming-llm"].model_copy(update=wide),
        "d192-fp16-causal": AttentionSpec(**wide, dtype="float16", causal=True),
    }
    specs["d192-gqa4-causal-deterministic"] = specs["d192-gqa4-causal"].model_copy(update={"deterministic": True})
    return specs


DETERMINISTIC_CASES = (
    "d96-gqa1-dense",
    "d128-gqa1-causal",
    "d128-gqa4-causal",
    "d64-window-two-sided",
    "d128-window100",
    "d128-chunked256",
    "prefix-lm",
    "gpt-oss-sinks",
    "packed-documents",
    "docs-window-gqa2",
    "streaming-llm",
    "expr-per-head-gqa2",
    "d256-gqa4-causal",
    "deepseek-style",
    "d64-gqa4-dense",
)


def decode_specs() -> dict[str, AttentionSpec]:
    """Variants the decode tests run (fa4gen.kernels.sm90.decode): packed GQA ratios 1-8 and head
    dims 64-256 across the forward's masks and score modifiers, each with its LSE."""
    llama = dict(head_dim=128, qhead_per_kvhead=4, causal=True, return_lse=True)
    return {
        "llama-gqa4": AttentionSpec(**llama),
        "mha-d64": AttentionSpec(head_dim=64, causal=True, return_lse=True),
        "gqa8-d256": AttentionSpec(head_dim=256, qhead_per_kvhead=8, causal=True, return_lse=True),
        "gqa6-d96-dense": AttentionSpec(head_dim=96, qhead_per_kvhead=6, return_lse=True),
        "mla-192-128": AttentionSpec(head_dim=192, head_dim_v=128, qhead_per_kvhead=2, causal=True, return_lse=True),
        "window-sinks": AttentionSpec(**{**llama, "qhead_per_kvhead": 8}, window_left=127, sinks=True),
        "softcap-window": AttentionSpec(head_dim=128, qhead_per_kvhead=2, causal=True, window_left=300, softcap=30.0),
        "chunked": AttentionSpec(head_dim=128, qhead_per_kvhead=4, mask={"kind": "chunked", "size": 256}),
        "alibi": AttentionSpec(head_dim=128, qhead_per_kvhead=4, causal=True, score_mod={"kind": "alibi"}),
        "expression": AttentionSpec(
            head_dim=128,
            qhead_per_kvhead=4,
            causal=True,
            return_lse=True,
            score_mod={"kind": "expression", "expr": "score + bias[h] * (kv_idx - q_idx) / seqlen_k"},
            mask={"kind": "expression", "expr": "kv_idx - kv_idx // 7 * 7 != 3 or q_idx == 0"},
            aux={"bias": {"dtype": "float32", "shape": ["Hq"]}},
        ),
    }
