"""Tests of fa4gen.planner's forward and decode plans and fa4gen.arch: sm_90a tile tables, resource
limits, plan values. CPU only. The config's one check: test_config_check.py; the backward's plans:
test_planner_bwd.py.

Plans are checked by value; reasons only in that every schedule field that varies has one and
that a cited decision id is a heading of docs/decisions.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from fa4gen.arch import (
    MMA_K_GRANULE,
    WARPGROUP_THREADS,
    WGMMA_M,
    Arch,
    UnsupportedArchError,
    arch_for_capability,
    require_supported,
)
from fa4gen.kernels.sm90.config import (
    Sm90FwdConfig,
    config_problem,
    config_smem_bytes,
    o_staging_fits,
    register_pool,
    smem_bytes,
    split_partial_words,
)
from fa4gen.planner import (
    Plan,
    SeqlenSplit,
    candidates,
    plan,
    plan_for_seqlen,
    plan_problem,
    seqlen_splits,
    split_workspace_shape,
)
from fa4gen.planner.candidates import NO_SPLIT_TAIL
from fa4gen.planner.sm90 import O_STAGING, variant_fields
from fa4gen.planner.sm90_tables import (
    PAIR_TAIL_MIN_TILES,
    PAIR_TAIL_ROUNDS,
    RESCALE_THRESHOLD_LOG2,
    SM90_D96_SHORT,
    SM90_DECODE_Q_REGISTERS_MAX_HEAD_DIM,
    SM90_FWD_TILES,
    SPLIT_TAIL,
    SPLIT_TAIL_EVERY_LENGTH,
    SPLIT_TAIL_FROM_2048,
)
from fa4gen.spec import AttentionSpec

CAPS = Arch.SM90A.caps
SMEM_LIMIT = CAPS.smem_bytes_per_cta
HEAD_DIMS = tuple(range(8, 257, 8))
TABLE_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256), (8, 8), (24, 200), (192, 192)]
CONFIG_FIELDS = tuple(Sm90FwdConfig.model_fields)
SPEC_FIELDS = tuple(variant_fields(AttentionSpec()))  # the config fields the spec fixes
SCHEDULE_FIELDS = tuple(name for name in CONFIG_FIELDS if name not in SPEC_FIELDS)
DECISIONS = Path(__file__).resolve().parent.parent / "docs" / "decisions.md"
EXPRESSION = {"kind": "expression", "expr": "kv_idx <= q_idx"}
# specs over every table row and every kind of mask and score modifier
VARIANT_FIELDS = [
    {},
    {"causal": True},
    {"window_left": 256},
    {"window_left": 64, "window_right": 64},
    {"causal": True, "window_left": 1024},
    {"mask": "document"},
    {"causal": True, "mask": "document"},
    {"mask": {"kind": "chunked", "size": 256}},
    {"mask": "prefix_lm"},
    {"mask": EXPRESSION},
    {"softcap": 30.0},
    {"score_mod": "alibi"},
    {"return_lse": True},
    {"sinks": True, "causal": True},
]
GRID = [AttentionSpec(head_dim=d, head_dim_v=dv, **fields) for d, dv in TABLE_DIMS for fields in VARIANT_FIELDS]


def _spec(head_dim: int, head_dim_v: int, **extra) -> AttentionSpec:
    return AttentionSpec(head_dim=head_dim, head_dim_v=head_dim_v, **extra)


def _config(spec: AttentionSpec) -> Sm90FwdConfig:
    return plan(spec, "sm_90a").config


def _grid_plans() -> list[tuple[AttentionSpec, Plan]]:
    """Every grid spec's forward plan and its length ranges' forward plans (decode's: below)."""
    return [
        (spec, p)
        for spec in GRID
        for p in (plan(spec, "sm_90a"), *(s.plan for s in seqlen_splits(spec, "sm_90a")))
        if not p.is_decode
    ]


@pytest.mark.parametrize("ratio", [1, 4, 7, 8, 64])
def test_decode_plans_hold_their_invariants(ratio):
    """Every variant with a decode kernel gets one plan per head dim 8..256: the spec's fields as
    the forward's, tiles that fit shared memory and the registers, the decode range first of the
    length ranges; packed documents and prefix-LM have none."""
    from fa4gen.kernels.sm90.decode_config import PAGE_BOX, decode_config_problem, decode_smem_bytes
    from fa4gen.planner import first_call_plan
    from fa4gen.planner.sm90_decode import decode_max_seqlen_q, decode_problem

    for spec in GRID:
        spec = spec.model_copy(update={"qhead_per_kvhead": ratio})
        splits = seqlen_splits(spec, "sm_90a")
        decode = [s for s in splits if s.plan.is_decode]
        if spec.is_varlen or spec.mask_kind == "prefix_lm":
            assert not decode and decode_problem(spec).startswith("mask:")
            continue
        assert splits[0] is decode[0] and decode[0].label == "decode"
        c = decode[0].plan.config
        fields = {name: value for name, value in variant_fields(spec).items() if name in type(c).model_fields}
        assert {name: getattr(c, name) for name in fields} == fields
        assert decode[0].max_seqlen_q == decode_max_seqlen_q(spec) >= 1
        assert decode[0].max_seqlen_q * ratio <= 64 or ratio == 1 or decode[0].max_seqlen_q == 1
        assert 0 <= c.head_dim_padded - spec.head_dim < MMA_K_GRANULE and c.kv_stages >= 2
        assert decode_smem_bytes(c) == decode[0].plan.smem_bytes <= SMEM_LIMIT
        assert not decode_config_problem(c) and not plan_problem(decode[0].plan)
        assert first_call_plan(decode[0].plan) is None  # (a cache miss builds decode's own kernel)
        # the cache-only kernels last: 128 packed rows over a contiguous cache, and over a page pool
        # decode's schedule and the wide one, for page-table launches only
        wide, paged, paged_wide = splits[-3:]
        assert [s.label for s in splits[-3:]] == ["decode-wide", "paged", "paged-wide"]
        assert wide.cache_only and not wide.page_table and paged.page_table and paged_wide.page_table
        assert not any(s.covers(q) or s.plain for s in splits[-3:] for q in (1, 64, 4096))
        w = wide.plan.config
        assert (c.consumer_warpgroups, c.tile_m, w.consumer_warpgroups, w.tile_m) == (1, 64, 2, 128)
        assert w.ctas_per_sm == 1 and not w.paged and decode_smem_bytes(w) <= SMEM_LIMIT
        for narrow, over_pages in ((c, paged.plan.config), (w, paged_wide.plan.config)):
            assert over_pages.paged and over_pages.tile_n % PAGE_BOX == 0 and over_pages.tile_n // PAGE_BOX <= 32
            # the same kernel but for where K/V come from; 64 rows wide, the walk unrolled in more registers
            assert over_pages.page_walk_unrolled == (narrow.tile_m == 64) and not narrow.page_walk_unrolled
            regs = {"producer_regs": narrow.producer_regs, "consumer_regs": narrow.consumer_regs}
            assert over_pages.model_copy(update={"paged": False, "page_walk_unrolled": False, **regs}) == narrow
            assert over_pages.producer_regs >= (32 if over_pages.page_walk_unrolled else 24)
            # an unrolled walk in 24 registers spills, and a contiguous kernel has no pages to walk
            for bad in ({"producer_regs": 24}, {"paged": False}):
                bad = {"page_walk_unrolled": True, **bad}
                assert "page_walk_unrolled" in decode_config_problem(over_pages.model_copy(update=bad))
        assert c.q_in_registers == w.q_in_registers == (c.head_dim_padded <= SM90_DECODE_Q_REGISTERS_MAX_HEAD_DIM)
        for split in splits[-3:]:
            assert split.plan.is_decode and not plan_problem(split.plan) and first_call_plan(split.plan) is None
        assert "up to 64 packed rows" in paged.rows() and "more than 64 packed rows" in paged_wide.rows()
        assert "seqused_k of more than 64" in wide.rows()


def _forward_splits(spec: AttentionSpec) -> list:
    """The length ranges that run the forward kernel (all but the decode kernels)."""
    return [s for s in seqlen_splits(spec, "sm_90a") if not s.plan.is_decode]


def check_plan_invariants(spec: AttentionSpec, p: Plan) -> None:
    """Everything that must hold for any sm_90a plan."""
    c = p.config
    assert p.arch == "sm_90a"
    assert p.kernel == "HopperAttentionForward"
    assert {name: getattr(c, name) for name in SPEC_FIELDS} == variant_fields(spec)
    assert (c.head_dim, c.head_dim_v, c.qhead_per_kvhead) == (spec.head_dim, spec.dv, spec.qhead_per_kvhead)
    assert c.tile_m == WGMMA_M * c.num_consumer_warpgroups
    assert c.tile_n % MMA_K_GRANULE == 0 and 16 <= c.tile_n <= 256
    assert c.kv_stages >= 2
    assert c.head_dim_padded % MMA_K_GRANULE == 0 and 0 <= c.head_dim_padded - spec.head_dim < MMA_K_GRANULE
    assert c.head_dim_v_padded % MMA_K_GRANULE == 0 and 0 <= c.head_dim_v_padded - spec.dv < MMA_K_GRANULE
    expected_smem = smem_bytes(
        c.tile_m,
        c.tile_n,
        c.kv_stages,
        c.head_dim_padded,
        c.head_dim_v_padded,
        c.o_staging,
        c.q_stages,
        not c.p_in_registers,
    )
    assert p.smem_bytes == config_smem_bytes(c) == expected_smem <= SMEM_LIMIT
    assert c.q_stages in (1, 2) and (c.o_staging not in ("over_q", "over_v") or c.q_stages == 1)
    threads = WARPGROUP_THREADS * (c.num_consumer_warpgroups + 1)
    total_regs = WARPGROUP_THREADS * (c.producer_regs + c.num_consumer_warpgroups * c.consumer_regs)
    # the launch gives each of the CTA's threads the same registers, a multiple of 8
    assert total_regs <= 65536 // threads // 8 * 8 * threads <= CAPS.registers_per_sm
    assert c.consumer_regs <= CAPS.max_regs_per_thread
    assert c.producer_regs % 8 == 0 and c.consumer_regs % 8 == 0  # setmaxnreg granularity
    assert not plan_problem(p) and not config_problem(c)


# --------------------------------------------------------------------------- table


@pytest.mark.parametrize("head_dim, head_dim_v", TABLE_DIMS, ids=[f"d{a}-{b}" for a, b in TABLE_DIMS])
def test_plan_table(head_dim, head_dim_v):
    spec = _spec(head_dim, head_dim_v)
    p = plan(spec, "sm_90a")
    c = p.config
    check_plan_invariants(spec, p)
    widest = max(c.head_dim_padded, c.head_dim_v_padded)
    assert c.num_consumer_warpgroups == (3 if widest <= 96 else 2)
    # at 3 warpgroups (160 registers) P leaves the registers once O is wider than 64
    assert c.p_in_registers == (widest <= 64 or c.num_consumer_warpgroups == 2)
    # O is staged in the first place of O_STAGING that fits with one Q buffer (over V gives way
    # to the shared buffer where the tail is split at every length); Q gets a second buffer
    # wherever that fits beside it
    p_smem = not c.p_in_registers
    dims = (c.tile_m, c.tile_n, c.kv_stages, c.head_dim_padded, c.head_dim_v_padded)

    def fits(o_staging: str, q_stages: int) -> bool:
        return (
            o_staging_fits(
                o_staging, c.tile_n, c.head_dim_padded, c.head_dim_v_padded, q_stages, p_smem, c.num_consumer_warpgroups
            )
            and smem_bytes(*dims, o_staging, q_stages, p_smem) <= SMEM_LIMIT
        )

    expected = next(o for o in O_STAGING if fits(o, 1))
    if expected == "over_v" and c.split_tail:
        expected = "shared"
    assert c.o_staging == expected
    assert (c.q_stages == 2) == fits(c.o_staging, 2)


@pytest.mark.parametrize(
    "head_dim, head_dim_v, tile_n, kv_stages",
    [(128, 128, 128, 2), (64, 64, 128, 2), (256, 256, 64, 2), (192, 128, 128, 2)],
)
def test_plan_exact_main_rows(head_dim, head_dim_v, tile_n, kv_stages):
    c = _config(_spec(head_dim, head_dim_v))
    assert (c.tile_n, c.kv_stages) == (tile_n, kv_stages)
    assert (c.head_dim_padded, c.head_dim_v_padded) == (head_dim, head_dim_v)
    assert c.p_in_registers is True
    assert c.num_consumer_warpgroups == (3 if head_dim <= 64 else 2)


def test_plan_d192_d192_shrinks_to_fit():
    # Q + 2 x 128-key K/V tiles at d192/192 is 241 KB > 227 KB: the planner shrinks tile_n to
    # the largest that fits, keeping 2 stages
    c = _config(_spec(192, 192))
    assert c.tile_n < 128 and c.kv_stages == 2

    def fits(tile_n: int) -> bool:
        return any(
            o_staging_fits(o, tile_n, 192, 192, 1, False, 2) and smem_bytes(128, tile_n, 2, 192, 192, o) <= SMEM_LIMIT
            for o in O_STAGING
        )

    assert fits(c.tile_n) and not fits(c.tile_n + MMA_K_GRANULE) and not fits(128)


def test_plan_pads_odd_head_dims():
    c = _config(_spec(24, 200))
    assert (c.head_dim_padded, c.head_dim_v_padded) == (32, 208)
    assert (c.head_dim, c.head_dim_v) == (24, 200)
    c = _config(_spec(8, 8))
    assert (c.head_dim_padded, c.head_dim_v_padded) == (16, 16)


def test_tile_table_is_ordered_and_covers_all_head_dims():
    bounds = [row.max_head_dim for row in SM90_FWD_TILES]
    assert bounds == sorted(bounds)
    assert bounds[-1] >= 256
    for row in SM90_FWD_TILES:
        assert row.tile_n % 16 == 0 and row.kv_stages >= 2 and row.reason.strip()
    assert [r.max_head_dim for r in SM90_FWD_TILES if r.short] == [64, 96]
    assert [s.row for s in SM90_FWD_TILES[1].short] == [SM90_D96_SHORT]


def test_exhaustive_head_dim_pairs_fit():
    seen_tiles = set()
    for head_dim in HEAD_DIMS:
        for head_dim_v in HEAD_DIMS:
            spec = _spec(head_dim, head_dim_v)
            p = plan(spec, "sm_90a")
            check_plan_invariants(spec, p)
            seen_tiles.add((p.config.tile_n, p.config.kv_stages))
    assert {(128, 2), (64, 2)} <= seen_tiles


def test_every_plan_of_the_grid_holds_the_invariants():
    for spec, p in _grid_plans():
        check_plan_invariants(spec, p)


def test_plan_depends_on_dims_not_on_variant_flags():
    base = _config(AttentionSpec(head_dim=128))
    for other in (
        AttentionSpec(head_dim=128, dtype="fp16"),
        AttentionSpec(head_dim=128, qhead_per_kvhead=8),
        AttentionSpec(head_dim=128, softcap=30.0),
        AttentionSpec(head_dim=128, return_lse=True),
    ):
        c = _config(other)
        assert (c.tile_n, c.kv_stages, config_smem_bytes(c)) == (base.tile_n, base.kv_stages, config_smem_bytes(base))


def test_the_spec_fixes_its_own_fields():
    """The variant's constants come from the spec as the kernel reads them (dv unpadded beside
    its padded extent; chunks as a right bound of 0 and a chunk size; documents as varlen)."""
    c = _config(AttentionSpec(head_dim=128, head_dim_v=64, qhead_per_kvhead=4, softmax_scale=0.5))
    assert (c.head_dim, c.head_dim_v, c.head_dim_v_padded, c.qhead_per_kvhead) == (128, 64, 64, 4)
    assert c.scale_log2 == pytest.approx(0.5 * 1.4426950408889634)
    assert _config(AttentionSpec(softcap=30.0)).scale_log2 == pytest.approx(1.4426950408889634)  # scaled before
    c = _config(AttentionSpec(head_dim=128, mask={"kind": "chunked", "size": 256}))
    assert (c.window_left, c.window_right, c.chunk, c.prefix_lm, c.document) == (None, 0, 256, False, False)
    c = _config(AttentionSpec(head_dim=128, causal=True, window_left=100, sinks=True, return_lse=True))
    assert (c.window_left, c.window_right, c.chunk, c.sinks, c.return_lse) == (100, 0, None, True, True)
    assert _config(AttentionSpec(mask="document")).document and _config(AttentionSpec(mask="prefix_lm")).prefix_lm
    assert _config(AttentionSpec(mask=EXPRESSION)).expression_mask
    assert not _config(AttentionSpec(causal=True)).expression_mask


# --------------------------------------------------------------------------- masks


@pytest.mark.parametrize(
    "fields, structural",
    [
        ({}, False),
        ({"causal": True}, True),
        ({"causal": True, "window_right": 0}, True),
        ({"window_left": 0}, True),
        ({"window_left": 4096}, True),
        ({"window_right": 0}, True),
        ({"window_right": 128}, True),
        ({"window_left": 256, "window_right": 256}, True),
        ({"causal": True, "window_left": 4096}, True),
        ({"mask": {"kind": "chunked", "size": 256}}, True),
        ({"mask": "prefix_lm"}, True),
        ({"mask": "document"}, True),
        ({"mask": EXPRESSION}, False),
        ({"softcap": 50.0}, False),
        ({"qhead_per_kvhead": 8, "return_lse": True}, False),
        ({"causal": False, "window_left": None, "window_right": None}, False),
    ],
)
def test_mask_bounds_are_structural_iff_causal_window_chunk_prefix_or_documents(fields, structural):
    spec = AttentionSpec(**fields)
    c = _config(spec)
    assert c.structural_mask is structural
    assert spec.has_mask == (structural or c.expression_mask)


# --------------------------------------------------------------------------- model properties


def test_plan_and_config_are_frozen():
    p = plan(AttentionSpec(), "sm_90a")
    with pytest.raises(ValidationError, match="frozen"):
        p.config = p.config  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        p.config.tile_n = 64  # type: ignore[misc]
    assert p.config.tile_n == 128


def test_plan_and_config_reject_extra_fields():
    p = plan(AttentionSpec(), "sm_90a")
    with pytest.raises(ValidationError, match="Extra inputs"):
        Plan.model_validate({**p.model_dump(), "unexpected": 1})
    with pytest.raises(ValidationError, match="Extra inputs"):
        Sm90FwdConfig.model_validate({**p.config.model_dump(), "persistent": True})  # a removed option
    with pytest.raises(ValidationError, match="Field required"):
        Sm90FwdConfig.model_validate({k: v for k, v in p.config.model_dump().items() if k != "tile_n"})


@pytest.mark.parametrize("head_dim, head_dim_v", TABLE_DIMS)
def test_plan_json_round_trip(head_dim, head_dim_v):
    p = plan(_spec(head_dim, head_dim_v, causal=True), "sm_90a")
    again = Plan.model_validate_json(p.model_dump_json())
    assert again == p
    assert again.canonical_json() == p.canonical_json()
    assert again.schedule_json() == p.schedule_json()


def test_schedule_json_is_the_plan_without_reasons():
    p = plan(AttentionSpec(head_dim=128, causal=True), "sm_90a")
    other = p.model_copy(update={"reasons": {"tile_n": "another wording"}})
    assert other.schedule_json() == p.schedule_json() and other.canonical_json() != p.canonical_json()
    assert p.with_config("why", tile_n=64).schedule_json() != p.schedule_json()


def test_with_config_changes_the_config_and_gives_the_changes_a_reason():
    p = plan(AttentionSpec(head_dim=128), "sm_90a")
    q = p.with_config("a test", kv_stages=3, pingpong=False)
    assert (q.config.kv_stages, q.config.pingpong) == (3, False)
    assert q.config.model_copy(update={"kv_stages": p.config.kv_stages, "pingpong": True}) == p.config
    assert q.reasons == {**p.reasons, "kv_stages": "a test", "pingpong": "a test"}
    assert (q.arch, q.kernel) == (p.arch, p.kernel)


def test_plan_is_deterministic():
    spec = AttentionSpec(head_dim=192, head_dim_v=128, causal=True, window_left=1024)
    first = plan(spec, "sm_90a")
    for _ in range(3):
        again = plan(spec, "sm_90a")
        assert again == first
        assert again.canonical_json() == first.canonical_json()
        assert again.describe() == first.describe()
    assert plan(spec, Arch.SM90A) == first
    assert plan(spec) == first  # sm_90a is the default target


def test_equal_canonical_specs_plan_equal():
    assert plan(AttentionSpec(head_dim=128), "sm_90a") == plan(AttentionSpec(head_dim=128, head_dim_v=128), "sm_90a")


def test_describe_lists_every_config_field():
    p = plan(AttentionSpec(causal=True), "sm_90a")
    text = p.describe()
    assert text.startswith("plan for sm_90a (HopperAttentionForward)")
    for name in (*CONFIG_FIELDS, "smem_bytes"):
        assert f"  {name} " in text


# --------------------------------------------------------------------------- reasons


def test_every_schedule_field_that_varies_has_a_reason():
    plans = [p for _, p in _grid_plans()]
    varies = [name for name in SCHEDULE_FIELDS if len({getattr(p.config, name) for p in plans}) > 1]
    assert {"tile_n", "num_consumer_warpgroups", "o_staging", "split_tail", "tile_order"} <= set(varies)
    missing = sorted({name for p in plans for name in varies if not p.reasons.get(name, "").strip()})
    assert missing == []


def test_reasons_name_config_fields_only():
    for _, p in _grid_plans():
        assert set(p.reasons) <= set(CONFIG_FIELDS)
        assert all(p.reasons.get(name, "").strip() for name in SPEC_FIELDS)


def _cited_decisions() -> dict[str, str]:
    """Decision id -> a reason that cites it, over the plans, length ranges and table rows."""
    texts = [reason for _, p in _grid_plans() for reason in p.reasons.values()]
    texts += [s.reason for spec in GRID for s in seqlen_splits(spec, "sm_90a")]
    for row in SM90_FWD_TILES:
        texts += [row.reason, row.unmasked_chain or "", row.split_tail.reason, *(s.row.reason for s in row.short)]
        texts += [row.long.row.reason] if row.long else []
    return {match: text for text in texts for match in re.findall(r"\bdecision ([a-z0-9]+(?:-[a-z0-9]+)*)", text)}


def test_cited_decisions_are_headings_of_the_decisions_document():
    cited = _cited_decisions()
    assert cited, "no reason cites a decision id"
    if not DECISIONS.exists():
        pytest.skip(f"{DECISIONS.relative_to(DECISIONS.parent.parent)} is not written yet")
    headings = set()
    for line in DECISIONS.read_text().splitlines():
        if line.startswith("#"):
            headings.update(re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)*", line.lower()))
    missing = {decision: text for decision, text in cited.items() if decision not in headings}
    assert missing == {}


# --------------------------------------------------------------------------- arch


def test_sm100a_is_reserved():
    with pytest.raises(UnsupportedArchError, match="reserved") as info:
        plan(AttentionSpec(), "sm_100a")
    assert "sm_90a" in str(info.value)  # says what is supported
    with pytest.raises(UnsupportedArchError):
        plan(AttentionSpec(), Arch.SM100A)
    with pytest.raises(UnsupportedArchError):
        require_supported("sm_100a")


@pytest.mark.parametrize("target", ["sm_80", "sm_89", "sm_120a", "hopper", ""])
def test_unknown_arch_names_known_targets(target):
    with pytest.raises(ValueError, match="known targets") as info:
        plan(AttentionSpec(), target)
    message = str(info.value)
    assert "sm_90a" in message and "sm_100a" in message
    assert repr(target) in message
    with pytest.raises(ValueError, match="known targets"):
        Arch.parse(target)


@pytest.mark.parametrize("text", ["sm_90a", "SM_90A", "sm90a", "sm_90", " sm_90a "])
def test_arch_parse_accepts_spellings(text):
    assert Arch.parse(text) is Arch.SM90A
    assert require_supported(text) is Arch.SM90A


def test_arch_parse_passes_enum_through():
    assert Arch.parse(Arch.SM90A) is Arch.SM90A
    assert Arch.parse("sm_100a") is Arch.SM100A
    assert Arch.parse("sm_100") is Arch.SM100A


def test_arch_caps_and_constants():
    assert Arch.SM90A.supported and not Arch.SM100A.supported
    assert CAPS.smem_bytes_per_cta == 227 * 1024
    assert CAPS.compute_capability == (9, 0)
    assert CAPS.warpgroup_mma and CAPS.tma and CAPS.setmaxnreg
    assert (WARPGROUP_THREADS, WGMMA_M, MMA_K_GRANULE) == (128, 64, 16)


def test_arch_for_capability():
    assert arch_for_capability(9, 0) is Arch.SM90A


@pytest.mark.parametrize("major, minor", [(8, 0), (8, 9), (7, 5), (9, 1), (12, 0)])
def test_arch_for_unsupported_capability(major, minor):
    with pytest.raises(UnsupportedArchError) as info:
        arch_for_capability(major, minor)
    message = str(info.value)
    assert f"compute capability {major}.{minor}" in message
    assert "sm_90a" in message


def test_arch_for_reserved_capability():
    with pytest.raises(UnsupportedArchError, match="reserved"):
        arch_for_capability(10, 0)


# --------------------------------------------------------------------------- schedule choices


def test_conditional_rescale_is_on_by_default():
    assert _config(AttentionSpec()).rescale_threshold == RESCALE_THRESHOLD_LOG2 == 8.0
    assert {p.config.rescale_threshold for _, p in _grid_plans()} == {8.0}


def test_key_tiles_without_mask_code_run_against_a_stale_max_where_measured():
    """Up to d128 (dv too), without a document or expression mask, key tiles without mask code
    skip the tile's row max (stale_max), which needs the rescale threshold; d192, d256 and those
    masks find it every step. Tuning tries the other choice; rescaling every tile drops it."""
    for fields in (
        {"head_dim": 64},
        {"head_dim": 64, "causal": True},
        {"head_dim": 64, "window_left": 256},
        {"head_dim": 64, "score_mod": {"kind": "alibi"}},
        {"head_dim": 96},
        {"head_dim": 128},
        {"head_dim": 128, "softcap": 30.0, "causal": True},
        {"head_dim": 128, "qhead_per_kvhead": 8},
        {"head_dim": 128, "mask": {"kind": "chunked", "size": 256}},
        {"head_dim": 128, "head_dim_v": 64},
    ):
        spec = AttentionSpec(**fields)
        c = _config(spec)
        assert c.stale_max and c.rescale_threshold == 8.0, spec.summary()
        assert all(s.plan.config.stale_max for s in _forward_splits(spec)), spec.summary()
        assert any(not p.config.stale_max for p in candidates(spec, "sm_90a"))
    for fields in (
        {"head_dim": 192, "head_dim_v": 128},
        {"head_dim": 256, "causal": True},
        {"head_dim": 128, "head_dim_v": 256},
        {"head_dim": 128, "mask": {"kind": "document"}},
        {"head_dim": 64, "mask": EXPRESSION},
    ):
        spec = AttentionSpec(**fields)
        c = _config(spec)
        assert not c.stale_max and c.rescale_threshold == 8.0, spec.summary()
        assert any(p.config.stale_max for p in candidates(spec, "sm_90a")), spec.summary()
    found = candidates(AttentionSpec(head_dim=128), "sm_90a")
    every = [p.config for p in found if p.config.rescale_threshold == 0.0]
    assert every and not any(c.stale_max for c in every)
    assert {p.config.rescale_threshold for p in found} == {0.0, 8.0}


def test_d128_without_a_mask_chains_its_query_tiles_where_measured():
    """Chained query tiles measured faster only at d128 without a mask and without the LSE;
    masked, score-modified and other head dims keep them off at every length; tuning tries the
    other choice where the kernel allows it."""
    for chained in (
        AttentionSpec(head_dim=128),
        AttentionSpec(head_dim=128, qhead_per_kvhead=8),
        AttentionSpec(head_dim=128, head_dim_v=64),
    ):
        assert _config(chained).chain_query_tiles, chained.summary()
    for kept in (
        AttentionSpec(head_dim=128, causal=True),
        AttentionSpec(head_dim=128, window_left=256),
        AttentionSpec(head_dim=128, softcap=50.0),
        AttentionSpec(head_dim=128, score_mod={"kind": "alibi"}),
        AttentionSpec(head_dim=64),
        AttentionSpec(head_dim=96),
        AttentionSpec(head_dim=192, head_dim_v=128),
        AttentionSpec(head_dim=256),
        AttentionSpec(head_dim=128, return_lse=True),
    ):
        for p in (plan(kept, "sm_90a"), *(split.plan for split in _forward_splits(kept))):
            assert not p.config.chain_query_tiles, kept.summary()
    assert any(p.config.chain_query_tiles for p in candidates(AttentionSpec(head_dim=128, causal=True), "sm_90a"))
    assert any(not p.config.chain_query_tiles for p in candidates(AttentionSpec(head_dim=128), "sm_90a"))
    assert any(p.config.chain_query_tiles for p in candidates(AttentionSpec(head_dim=128, return_lse=True), "sm_90a"))
    assert not any(p.config.chain_query_tiles for p in candidates(AttentionSpec(head_dim=256), "sm_90a"))


OVER_V = (
    AttentionSpec(head_dim=256),
    AttentionSpec(head_dim=256, causal=True),
    AttentionSpec(head_dim=192, head_dim_v=128, causal=True),
    AttentionSpec(head_dim=256, softcap=30.0),
)
SHARED_O = (AttentionSpec(head_dim=192, head_dim_v=128), AttentionSpec(head_dim=256, window_left=1024))


def test_o_goes_over_the_last_v_stage_where_two_warpgroups_measured_faster():
    """With room for one warpgroup's O buffer only (d192 and d256), warpgroup 1 stages O over its
    last key tile's V stage, except where that measured slower: d192 without a mask, whose tail
    is split at every length, and a window; those take the buffer in turn."""
    for spec in OVER_V:
        assert _config(spec).o_staging == "over_v", spec.summary()
    for spec in SHARED_O:
        assert _config(spec).o_staging == "shared", spec.summary()
    for spec, length in ((AttentionSpec(head_dim=256), 8192), (AttentionSpec(head_dim=128), 512)):
        assert plan_for_seqlen(spec, "sm_90a", length).config.o_staging == ("over_v" if spec.head_dim == 256 else "own")


def test_tuning_tries_the_other_one_buffer_o_staging():
    """Where the table chose over V or the shared buffer by measurement, tuning tries the other."""
    for spec in OVER_V:
        assert any(p.config.o_staging == "shared" for p in candidates(spec, "sm_90a")), spec.summary()
    for spec in SHARED_O:
        assert any(p.config.o_staging == "over_v" for p in candidates(spec, "sm_90a")), spec.summary()


def test_q_barriers_per_warpgroup_where_one_q_buffer_serves_two():
    """One Q buffer for 2 warpgroups (d192, d256) gets a pair of barriers per warpgroup's rows,
    but not under a left window; two Q buffers (d128), or 3 warpgroups with one, keep a pair per
    buffer. Tuning tries the other choice wherever there are 2 or more warpgroups."""
    specs = [
        AttentionSpec(head_dim=d, head_dim_v=dv, causal=c, window_left=w, softcap=cap)
        for d, dv in ((64, None), (96, None), (128, None), (192, 128), (256, None))
        for c in (False, True)
        for w in (None, 1024)
        for cap in (None, 30.0)
    ]
    kinds = set()
    for spec in specs:
        for length in (512, 2048, 16384):
            c = plan_for_seqlen(spec, "sm_90a", length).config
            want = c.q_stages == 1 and c.num_consumer_warpgroups == 2 and spec.left_bound is None
            assert c.q_per_warpgroup == want, (spec.summary(), length)
            kinds.add((spec.head_dim, want))
        base = _config(spec)
        flipped = [p for p in candidates(spec, "sm_90a") if p.config.q_per_warpgroup != base.q_per_warpgroup]
        assert flipped or base.num_consumer_warpgroups == 1, spec.summary()
    assert {(192, True), (256, True), (256, False), (128, False)} <= kinds


def test_long_head_major_launches_split_their_tail():
    """Every spec without a mask runs the head-major order; its launches from its tile row's
    split-tail length on (2048 query rows at d64, 4096 elsewhere) run a plan that splits the
    ragged last round (the long length range, the d96 row's long plan where it has one), shorter
    ones a plan without it; d192's row splits at every length in its own plan; masked specs never
    split. The kernel's workspace is one slot per CTA and consumer warpgroup."""
    d192 = AttentionSpec(head_dim=192, head_dim_v=128, softcap=30.0)
    assert _config(d192).split_tail and not _forward_splits(d192)
    assert _config(d192).split_tail_min_key_tiles == SPLIT_TAIL_EVERY_LENGTH.min_key_tiles
    for split, row in (
        (AttentionSpec(head_dim=128), SPLIT_TAIL),
        (AttentionSpec(head_dim=64), SPLIT_TAIL_FROM_2048),
        (AttentionSpec(head_dim=96, softcap=30.0), SPLIT_TAIL),
        (AttentionSpec(head_dim=256, sinks=True), SPLIT_TAIL),
        (AttentionSpec(head_dim=128, score_mod={"kind": "alibi"}), SPLIT_TAIL),
    ):
        base = plan(split, "sm_90a")
        assert not base.config.split_tail and base.config.split_tail_min_key_tiles == 0
        long = plan_for_seqlen(split, "sm_90a", row.min_seqlen_q)
        assert plan_for_seqlen(split, "sm_90a", row.min_seqlen_q - 1) != long
        assert long.config.split_tail and long.config.split_tail_min_key_tiles == row.min_key_tiles
        assert long.config.tile_order == "head_major"
        assert not plan_problem(long) and split_workspace_shape(base, 132) is None
        words = split_partial_words(long.config.head_dim_v_padded)
        assert words == 64 * long.config.head_dim_v_padded // 128 + 4
        assert split_workspace_shape(long, 132) == (132, long.config.num_consumer_warpgroups, words, 128)
    for kept in (
        AttentionSpec(head_dim=128, causal=True),
        AttentionSpec(head_dim=128, window_left=256),
        AttentionSpec(head_dim=64, mask=EXPRESSION),
        AttentionSpec(head_dim=128, mask="document"),
    ):
        assert not _config(kept).split_tail, kept.summary()
        assert not any(s.plan.config.split_tail for s in _forward_splits(kept))
    assert any(p.config.split_tail for p in candidates(AttentionSpec(head_dim=128), "sm_90a"))
    assert not any(p.config.split_tail for p in candidates(AttentionSpec(head_dim=128, causal=True), "sm_90a"))
    assert NO_SPLIT_TAIL == {"split_tail": False, "split_tail_min_key_tiles": 0}


@pytest.mark.parametrize(
    "fields, warpgroups, tile_n",
    [
        ({"head_dim": 64}, 3, 128),
        ({"head_dim": 64, "causal": True, "softcap": 30.0}, 3, 128),
        ({"head_dim": 64, "score_mod": "alibi"}, 2, 128),
        ({"head_dim": 64, "mask": {"kind": "chunked", "size": 256}}, 2, 128),
        ({"head_dim": 64, "window_left": 8, "window_right": 8}, 2, 128),
        ({"head_dim": 64, "causal": True, "window_left": 128, "sinks": True}, 2, 128),
        ({"head_dim": 256}, 2, 64),
        ({"head_dim": 256, "causal": True, "softcap": 50.0}, 2, 64),
        ({"head_dim": 256, "causal": True, "window_left": 4096}, 2, 64),
        ({"head_dim": 256, "mask": "document"}, 2, 64),
        ({"head_dim": 128, "score_mod": {"kind": "relative_bias", "max_distance": 8}}, 2, 128),
    ],
)
def test_register_hungry_variants_get_registers(fields, warpgroups, tile_n):
    """Per-score bounds, coordinates and aux loads spilled at 3 warpgroups (d64) and with 80-key
    tiles at d256 (checked in SASS by the cross-compile tests): the planner steps back."""
    c = _config(AttentionSpec(**fields))
    assert (c.num_consumer_warpgroups, c.tile_n) == (warpgroups, tile_n)


@pytest.mark.parametrize(
    "fields, order",
    [
        ({}, "head_major"),
        ({"causal": True}, "paired"),
        ({"causal": True, "window_left": 4096}, "paired"),  # pairs while the window cuts no row
        ({"window_left": 128, "window_right": 0}, "paired"),  # causal spelled as a window
        ({"window_left": 200, "window_right": 30}, "heavy_first"),  # two-sided: pairs are uneven
        ({"mask": {"kind": "chunked", "size": 1024}}, "heavy_first"),
        ({"mask": "prefix_lm"}, "heavy_first"),
        ({"mask": "document", "causal": True}, "heavy_first"),
        ({"mask": EXPRESSION}, "head_major"),
        ({"softcap": 30.0}, "head_major"),
        ({"causal": True, "softcap": 30.0, "sinks": True}, "paired"),
        ({"head_dim": 256, "causal": True, "window_left": 4096}, "heavy_first"),  # registers: no run-time choice
        ({"head_dim": 256, "causal": True}, "paired"),
    ],
)
def test_tile_order_follows_the_work_per_query_tile(fields, order):
    c = _config(AttentionSpec(**{"head_dim": 128, **fields}))
    assert c.tile_order == order
    # only pairs end in a tail
    tail = (c.pair_tail_rounds, c.pair_tail_min_tiles)
    assert tail == ((PAIR_TAIL_ROUNDS, PAIR_TAIL_MIN_TILES) if order == "paired" else (0, 0))


@pytest.mark.parametrize(
    "fields, labels",
    [
        ({"head_dim": 96}, ["short", "long"]),
        ({"head_dim": 96, "causal": True}, ["short", "long"]),
        ({"head_dim": 80, "softcap": 30.0, "return_lse": True}, ["short", "long"]),
        ({"head_dim": 96, "causal": True, "window_left": 256}, []),  # already 2 warpgroups; a window: no pairs
        ({"head_dim": 96, "score_mod": "alibi"}, ["long"]),  # the split tail alone (no 144-key tiles)
        ({"head_dim": 64}, ["short", "long"]),  # 4 warpgroups on 64-key tiles up to 1024 rows
        ({"head_dim": 64, "causal": True}, ["short"]),
        ({"head_dim": 64, "causal": True, "qhead_per_kvhead": 4, "return_lse": True}, ["short"]),
        ({"head_dim": 64, "softcap": 30.0}, ["long"]),  # 4 warpgroups only where measured: no softcap
        ({"head_dim": 64, "causal": True, "softcap": 30.0}, ["short"]),  # ... causal: 2 warpgroups instead
        ({"head_dim": 64, "causal": True, "window_left": 128, "sinks": True}, []),  # already 2 warpgroups
        ({"head_dim": 128, "causal": True}, []),
        ({"head_dim": 192, "head_dim_v": 128, "causal": True}, []),
        ({"head_dim": 192, "head_dim_v": 128}, []),  # the split tail in its one plan
        ({"head_dim": 256}, ["long"]),
        ({"head_dim": 256, "causal": True}, []),  # 64-key tiles at every length
    ],
)
def test_length_ranges_that_run_another_plan(fields, labels):
    """Short launches run 128-row tiles where the table's row has them (d96; d64 causal with
    more than the causal mask) or 256-row tiles on 4 warpgroups (d64 without a mask but the
    causal one); where the variant already runs those tiles there is nothing to switch to. Long
    launches run 144-key tiles at d96 and, without a mask, split their tail."""
    spec = AttentionSpec(**fields)
    every = seqlen_splits(spec, "sm_90a")
    assert every[0].label == "decode" and every[0].plan.is_decode  # (test_decode_plans_hold_their_invariants)
    assert (
        [s.label for s in every if not s.plain]
        == ["decode-wide", "paged", "paged-wide"]
        == [s.label for s in every[-3:]]
    )
    splits = {s.label: s for s in every[1:-3]}
    assert list(splits) == labels
    main = _config(spec)
    if "short" in splits:
        split = splits["short"]
        short = split.plan.config
        assert main.num_consumer_warpgroups == 3
        plain = spec.left_bound is None and spec.mask_kind is None and spec.score_mod is None and spec.softcap is None
        if spec.head_dim == 64 and plain:  # 192-row tiles give way to 256 rows of 64 keys on 4 warpgroups
            assert (short.tile_m, short.tile_n, short.kv_stages, short.num_consumer_warpgroups) == (256, 64, 4, 4)
            assert (short.producer_regs, short.consumer_regs, short.p_in_registers) == (24, 112, True)
            assert short.rescale_threshold == RESCALE_THRESHOLD_LOG2 and short.stale_max
        else:  # 192-row tiles on 3 warpgroups give way to 128 rows on 2
            assert (short.tile_m, short.num_consumer_warpgroups, short.p_in_registers) == (128, 2, True)
            assert (short.producer_regs, short.consumer_regs) == (24, 240)
        assert short.q_stages == 2 and not config_problem(short)
        assert short.tile_order == main.tile_order and config_smem_bytes(short) <= SMEM_LIMIT
        assert (split.min_seqlen_q, split.max_seqlen_q) == (1, 1024)
        assert split.rows() == "at most 1024 query rows"
    if "long" in splits:
        split = splits["long"]
        long = split.plan.config
        # where the tile row's long tiles start, or else its split tail (d64: 2048)
        row = next(r for r in SM90_FWD_TILES if max(spec.head_dim, spec.head_dim_v or 0) <= r.max_head_dim)
        start = row.long.min_seqlen_q if row.long else row.split_tail.min_seqlen_q
        assert (split.min_seqlen_q, split.max_seqlen_q) == (start, None)
        assert split.rows() == f"at least {start} query rows"
        assert long.split_tail == (not spec.has_mask)
        if long.tile_n != main.tile_n:  # d96: 144-key tiles on the same 3 warpgroups, P through smem
            assert (long.tile_m, long.tile_n, main.tile_n) == (192, 144, 128)
            assert not long.p_in_registers
        else:  # the main plan with the split tail
            assert long.model_copy(update=NO_SPLIT_TAIL) == main
    for split in splits.values():
        assert split.plan.config != main and split.reason.strip()
        assert {name: getattr(split.plan.config, name) for name in SPEC_FIELDS} == variant_fields(spec)


def test_length_ranges_cover_each_length_once():
    spec = AttentionSpec(head_dim=64, causal=True)
    splits = seqlen_splits(spec, "sm_90a")
    main = plan(spec, "sm_90a")
    for seqlen in (1, 16, 17, 1024, 1025, 4096, 10**6):
        covering = [s for s in splits if s.covers(seqlen)]
        # the decode range, first, overlaps the short one: the first that covers a length runs it
        assert len(covering) <= 1 or [s.label for s in covering] == ["decode", "short"]
        assert plan_for_seqlen(spec, "sm_90a", seqlen) == (covering[0].plan if covering else main)
    assert plan_for_seqlen(spec, "sm_90a", 16).is_decode and not plan_for_seqlen(spec, "sm_90a", 17).is_decode
    assert plan_for_seqlen(spec, "sm_90a", 1024).config.tile_m == 256
    assert plan_for_seqlen(spec, "sm_90a", 1025) == main
    middle = SeqlenSplit(label="middle", min_seqlen_q=2048, max_seqlen_q=4096, plan=main, reason="r")
    long = SeqlenSplit(label="long", min_seqlen_q=8192, plan=main, reason="r")
    assert [n for n in (2047, 2048, 4096, 4097) if middle.covers(n)] == [2048, 4096]
    assert [n for n in (8191, 8192, 10**9) if long.covers(n)] == [8192, 10**9]
    assert (middle.rows(), long.rows()) == ("2048 to 4096 query rows", "at least 8192 query rows")


def test_mask_runs_follow_the_structural_bounds():
    """Masked and interior key tiles run in separate loops wherever structural bounds order them
    (causal, windows, chunks, prefix-LM, documents), never for an expression mask nor without a
    mask; where they apply, tuning may flip them."""
    for fields, runs in (
        ({}, False),
        ({"causal": True}, True),
        ({"window_left": 64, "window_right": 8}, True),
        ({"mask": {"kind": "chunked", "size": 256}}, True),
        ({"mask": "prefix_lm"}, True),
        ({"causal": True, "mask": "document"}, True),
        ({"softcap": 30.0}, False),
        ({"mask": EXPRESSION}, False),
    ):
        spec = AttentionSpec(head_dim=128, **fields)
        assert _config(spec).mask_runs is runs, fields
        assert any(p.config.mask_runs != runs for p in candidates(spec, "sm_90a")) is runs, fields


def test_interior_first_tile_where_no_right_bound_cuts_it_up_to_d192():
    """The first key tile gets a form without mask code where it can lie inside every row's
    bounds (no causal or right-window bound, no expression mask), at head dims up to 192; where
    it applies, tuning may flip it."""
    for fields, applies in (
        ({}, True),
        ({"mask": "prefix_lm"}, True),
        ({"window_left": 64}, True),
        ({"mask": "document"}, True),
        ({"softcap": 30.0}, True),
        ({"causal": True}, False),
        ({"window_left": 64, "window_right": 8}, False),
        ({"mask": {"kind": "chunked", "size": 256}}, False),
        ({"causal": True, "mask": "document"}, False),
        ({"mask": EXPRESSION}, False),
    ):
        for head_dim in (64, 128, 192, 256):
            spec = AttentionSpec(
                head_dim=head_dim, head_dim_v=min(head_dim, 128) if head_dim == 192 else None, **fields
            )
            base = _config(spec)
            assert base.interior_first_tile is (applies and head_dim <= 192), (fields, head_dim)
            flipped = any(p.config.interior_first_tile != base.interior_first_tile for p in candidates(spec, "sm_90a"))
            assert flipped is applies, (fields, head_dim)


def test_narrow_windows_run_without_pingpong():
    """A window that spans at most two key tiles per query tile leaves too few MMAs to take
    turns over: ping-pong off, offered back to tuning; wider windows, chunks and plain causal
    keep it."""
    for fields, narrow in (
        ({"head_dim": 64, "causal": True, "window_left": 128, "sinks": True}, True),
        ({"head_dim": 128, "window_left": 64, "window_right": 64}, True),
        ({"head_dim": 128, "causal": True, "window_left": 129}, False),
        ({"head_dim": 128, "causal": True, "window_left": 1024}, False),
        ({"head_dim": 64, "mask": {"kind": "chunked", "size": 128}}, False),
        ({"head_dim": 128, "causal": True}, False),
    ):
        spec = AttentionSpec(**fields)
        assert _config(spec).pingpong is not narrow, fields
        if narrow:
            assert any(p.config.pingpong for p in candidates(spec, "sm_90a")), fields


def test_wide_windows_give_the_producer_more_registers():
    """A window or the causal pairs at d > 192 move 8 registers per consumer thread to the
    producer, whose loop spilled at 24 (the SASS check in test_crosscompile holds every kernel
    to zero spills); other kernels keep 24 / 240. Every split fits the CTA's launch pool, not
    just the SM."""
    for fields, split in (
        ({"head_dim": 256, "qhead_per_kvhead": 2, "causal": True, "window_left": 4096}, (40, 232)),
        ({"head_dim": 256, "window_left": 512, "window_right": 512}, (40, 232)),
        ({"head_dim": 256, "causal": True}, (40, 232)),
        ({"head_dim": 256}, (24, 240)),
        ({"head_dim": 256, "mask": "document"}, (24, 240)),
        ({"head_dim": 192, "head_dim_v": 128, "causal": True}, (24, 240)),
        ({"head_dim": 192, "head_dim_v": 128, "causal": True, "window_left": 1024}, (24, 240)),
        ({"head_dim": 128, "causal": True, "window_left": 1024}, (24, 240)),
        ({"head_dim": 64, "causal": True, "window_left": 1024}, (24, 240)),
    ):
        c = _config(AttentionSpec(**fields))
        assert (c.producer_regs, c.consumer_regs) == split, fields
        assert WARPGROUP_THREADS * (c.producer_regs + 2 * c.consumer_regs) <= register_pool(2)


def test_register_pool_is_what_the_launch_gives_the_cta():
    """ptxas gives every thread the most registers one CTA per SM allows, rounded down to 8."""
    assert register_pool(2) == 168 * 384 == 64512 and register_pool(3) == 128 * 512
    assert register_pool(4) == 96 * 640 and register_pool(1) == 255 * 256
    assert all(register_pool(w) <= CAPS.registers_per_sm for w in (1, 2, 3, 4))
