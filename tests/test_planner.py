"""Tests of fa4gen.planner and fa4gen.arch: sm_90a tile tables, resource limits, reasons. CPU only."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fa4gen.arch import Arch, UnsupportedArchError, arch_for_capability, require_supported
from fa4gen.planner import (
    MMA_K_GRANULE,
    NO_SPLIT_TAIL,
    SPLIT_NEEDS,
    Plan,
    candidates,
    plan,
    plan_for_seqlen,
    plan_problem,
    seqlen_splits,
    sm90_register_pool,
    sm90_smem_bytes,
    split_workspace_shape,
)
from fa4gen.sm90_tables import (
    PAIR_TAIL_MIN_TILES,
    PAIR_TAIL_ROUNDS,
    RESCALE_THRESHOLD_LOG2,
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
PLAN_FIELDS = tuple(name for name in Plan.model_fields if name != "reasons")


def _spec(head_dim: int, head_dim_v: int, **extra) -> AttentionSpec:
    return AttentionSpec(head_dim=head_dim, head_dim_v=head_dim_v, **extra)


def check_plan_invariants(spec: AttentionSpec, p: Plan) -> None:
    """Everything that must hold for any sm_90a plan."""
    assert p.arch == "sm_90a"
    assert p.kernel == "HopperAttentionForward"
    assert p.tile_m == 64 * p.num_consumer_warpgroups
    assert p.tile_m == 64 * p.num_consumer_warpgroups
    assert p.tile_n % 16 == 0 and 16 <= p.tile_n <= 256
    assert p.kv_stages >= 2
    assert p.head_dim_padded % MMA_K_GRANULE == 0 and p.head_dim_padded >= spec.head_dim
    assert p.head_dim_v_padded % MMA_K_GRANULE == 0 and p.head_dim_v_padded >= spec.dv
    assert p.head_dim_padded - spec.head_dim < MMA_K_GRANULE  # padded to the next granule only
    assert p.head_dim_v_padded - spec.dv < MMA_K_GRANULE
    expected_smem = sm90_smem_bytes(
        p.tile_m, p.tile_n, p.kv_stages, p.head_dim_padded, p.head_dim_v_padded, 2, p.o_staging, p.q_stages,
        not p.p_in_registers,
    )
    assert p.smem_bytes == expected_smem
    assert p.q_stages in (1, 2) and (p.o_staging != "over_q" or p.q_stages == 1)
    assert p.smem_bytes <= SMEM_LIMIT
    threads_per_warpgroup = 128
    total_regs = threads_per_warpgroup * (p.producer_regs + p.num_consumer_warpgroups * p.consumer_regs)
    # the launch gives each of the CTA's threads the same registers, a multiple of 8
    launch_per_thread = 65536 // (threads_per_warpgroup * (p.num_consumer_warpgroups + 1)) // 8 * 8
    assert total_regs <= launch_per_thread * threads_per_warpgroup * (p.num_consumer_warpgroups + 1)
    assert total_regs <= CAPS.registers_per_sm
    assert p.consumer_regs <= CAPS.max_regs_per_thread
    assert p.producer_regs % 8 == 0 and p.consumer_regs % 8 == 0  # setmaxnreg granularity
    assert p.skip_masked_tiles == spec.has_mask


# --------------------------------------------------------------------------- table


@pytest.mark.parametrize("head_dim, head_dim_v", TABLE_DIMS, ids=[f"d{a}-{b}" for a, b in TABLE_DIMS])
def test_plan_table(head_dim, head_dim_v):
    spec = _spec(head_dim, head_dim_v)
    p = plan(spec, "sm_90a")
    check_plan_invariants(spec, p)
    assert p.tile_m == 64 * p.num_consumer_warpgroups
    widest = max(p.head_dim_padded, p.head_dim_v_padded)
    assert p.num_consumer_warpgroups == (3 if widest <= 96 else 2)
    # at 3 warpgroups (160 registers) P leaves the registers once O is wider than 64
    assert p.p_in_registers == (widest <= 64 or p.num_consumer_warpgroups == 2)
    assert p.tile_n % 16 == 0 and p.tile_n <= 256
    assert p.kv_stages >= 2
    assert p.smem_bytes <= Arch.SM90A.caps.smem_bytes_per_cta
    # O gets its own buffer whenever it fits, else P's tile where P is in shared memory and dv
    # fits in it, else one warpgroup's buffer (beside the last V stage for 2 warpgroups, but
    # where d192 splits its tail at every length; taken in turn otherwise), else Q's rows (only
    # where dv <= d)
    p_smem = not p.p_in_registers
    dims = (p.tile_m, p.tile_n, p.kv_stages, p.head_dim_padded, p.head_dim_v_padded, 2)
    own_fits = sm90_smem_bytes(*dims, "own", 1, p_smem) <= SMEM_LIMIT
    over_p_fits = p_smem and p.head_dim_v_padded <= p.tile_n
    shared_fits = sm90_smem_bytes(*dims, "shared", 1, p_smem) <= SMEM_LIMIT
    over_v = p.num_consumer_warpgroups == 2 and p.head_dim_v_padded <= p.head_dim_padded and not p.split_tail
    one = "over_v" if over_v else "shared"
    expected = "own" if own_fits else "over_p" if over_p_fits else one if shared_fits else "over_q"
    assert p.o_staging == expected
    assert p.o_staging != "over_q" or p.head_dim_v_padded <= p.head_dim_padded
    # a second Q buffer whenever it fits beside O's staging, which must not be Q's rows
    two_q = sm90_smem_bytes(*dims, p.o_staging, 2, p_smem)
    assert (p.q_stages == 2) == (p.o_staging != "over_q" and two_q <= SMEM_LIMIT)
    for name in PLAN_FIELDS:
        assert p.reasons.get(name, "").strip(), f"plan field {name!r} has no reason"
    assert set(p.reasons) <= set(PLAN_FIELDS), "reasons for fields the plan does not have"


def test_every_field_including_arch_has_a_reason():
    p = plan(AttentionSpec(), "sm_90a")
    missing = [name for name in PLAN_FIELDS if not p.reasons.get(name, "").strip()]
    assert missing == []


@pytest.mark.parametrize(
    "head_dim, head_dim_v, tile_n, kv_stages",
    [(128, 128, 128, 2), (64, 64, 128, 2), (256, 256, 64, 2), (192, 128, 128, 2)],
)
def test_plan_exact_main_rows(head_dim, head_dim_v, tile_n, kv_stages):
    p = plan(_spec(head_dim, head_dim_v), "sm_90a")
    assert (p.tile_n, p.kv_stages) == (tile_n, kv_stages)
    assert (p.head_dim_padded, p.head_dim_v_padded) == (head_dim, head_dim_v)
    assert p.p_in_registers is True
    assert p.num_consumer_warpgroups == (3 if head_dim <= 64 else 2)


def test_plan_d192_d192_shrinks_to_fit():
    # Q + 2 x 128-key K/V tiles at d192/192 is 241 KB > 227 KB: the planner must shrink tile_n
    p = plan(_spec(192, 192), "sm_90a")
    assert sm90_smem_bytes(128, 128, 2, 192, 192, 2, False) > SMEM_LIMIT
    assert p.tile_n < 128 and p.kv_stages == 2
    assert sm90_smem_bytes(128, p.tile_n + MMA_K_GRANULE, 2, 192, 192, 2, False) > SMEM_LIMIT  # largest that fits
    assert "shrunk" in p.reasons["tile_n"]


def test_plan_pads_odd_head_dims():
    p = plan(_spec(24, 200), "sm_90a")
    assert (p.head_dim_padded, p.head_dim_v_padded) == (32, 208)
    p = plan(_spec(8, 8), "sm_90a")
    assert (p.head_dim_padded, p.head_dim_v_padded) == (16, 16)


def test_tile_table_is_ordered_and_covers_all_head_dims():
    bounds = [row.max_head_dim for row in SM90_FWD_TILES]
    assert bounds == sorted(bounds)
    assert bounds[-1] >= 256
    for row in SM90_FWD_TILES:
        assert row.tile_n % 16 == 0 and row.kv_stages >= 2 and row.reason.strip()


def test_exhaustive_head_dim_pairs_fit():
    seen_tiles = set()
    for head_dim in HEAD_DIMS:
        for head_dim_v in HEAD_DIMS:
            spec = _spec(head_dim, head_dim_v)
            p = plan(spec, "sm_90a")
            check_plan_invariants(spec, p)
            seen_tiles.add((p.tile_n, p.kv_stages))
    assert {(128, 2), (64, 2)} <= seen_tiles


def test_plan_depends_on_dims_not_on_variant_flags():
    base = plan(AttentionSpec(head_dim=128), "sm_90a")
    for other in (AttentionSpec(head_dim=128, dtype="fp16"), AttentionSpec(head_dim=128, qhead_per_kvhead=8),
                  AttentionSpec(head_dim=128, softcap=30.0), AttentionSpec(head_dim=128, return_lse=True)):
        p = plan(other, "sm_90a")
        assert (p.tile_n, p.kv_stages, p.smem_bytes) == (base.tile_n, base.kv_stages, base.smem_bytes)


# --------------------------------------------------------------------------- masks


@pytest.mark.parametrize(
    "fields, masked",
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
        ({"softcap": 50.0}, False),
        ({"qhead_per_kvhead": 8, "return_lse": True}, False),
        ({"causal": False, "window_left": None, "window_right": None}, False),
    ],
)
def test_skip_masked_tiles_iff_causal_or_window(fields, masked):
    spec = AttentionSpec(**fields)
    p = plan(spec, "sm_90a")
    has_window = spec.window_left is not None or spec.window_right is not None
    assert p.skip_masked_tiles is masked
    assert p.skip_masked_tiles == (spec.causal or has_window)
    assert p.reasons["skip_masked_tiles"].strip()


# --------------------------------------------------------------------------- model properties


def test_plan_is_frozen():
    p = plan(AttentionSpec(), "sm_90a")
    with pytest.raises(ValidationError, match="frozen"):
        p.tile_n = 64  # type: ignore[misc]
    assert p.tile_n == 128


def test_plan_rejects_extra_fields():
    data = plan(AttentionSpec(), "sm_90a").model_dump()
    with pytest.raises(ValidationError, match="Extra inputs"):
        Plan.model_validate({**data, "unexpected": 1})


@pytest.mark.parametrize("head_dim, head_dim_v", TABLE_DIMS)
def test_plan_json_round_trip(head_dim, head_dim_v):
    p = plan(_spec(head_dim, head_dim_v, causal=True), "sm_90a")
    again = Plan.model_validate_json(p.model_dump_json())
    assert again == p
    assert again.canonical_json() == p.canonical_json()


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


def test_describe_lists_every_field():
    p = plan(AttentionSpec(causal=True), "sm_90a")
    text = p.describe()
    assert text.startswith("plan for sm_90a (HopperAttentionForward)")
    for name in PLAN_FIELDS:
        assert f"  {name} " in text


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


def test_arch_caps():
    assert Arch.SM90A.supported and not Arch.SM100A.supported
    assert CAPS.smem_bytes_per_cta == 227 * 1024
    assert CAPS.compute_capability == (9, 0)
    assert CAPS.warpgroup_mma and CAPS.tma and CAPS.setmaxnreg


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


# --------------------------------------------------------------------------- exponential unit relief


@pytest.mark.parametrize(
    "fields",
    [{"head_dim": 64}, {"head_dim": 32}, {"head_dim": 96}, {"head_dim": 128}, {"head_dim": 256},
     {"head_dim": 128, "softcap": 50.0}, {"head_dim": 64, "softcap": 30.0}],
)
def test_exp2_stays_on_mufu_by_default(fields):
    """The FMA-unit polynomial measured slower on the H200 at every share (BENCHMARKS.md): the
    table keeps it off and says so; tuning still tries it."""
    p = plan(AttentionSpec(**fields), "sm_90a")
    assert p.exp2_poly_period == 0
    assert "measured slower" in p.reasons["exp2_poly_period"]


def test_conditional_rescale_is_on_by_default():
    p = plan(AttentionSpec(), "sm_90a")
    assert p.rescale_threshold == 8.0
    assert "2^8" in p.reasons["rescale_threshold"]


def test_key_tiles_without_mask_code_run_against_a_stale_max_where_measured():
    """Up to d128 (dv too), without a document or expression mask, key tiles without mask code
    skip the tile's row max (Plan.stale_max, measured faster there), which needs the rescale
    threshold; d192, d256 and those masks find it every step. Tuning tries the other choice."""
    from fa4gen.sm90_tables import STALE_MAX_REASON

    for fields in ({"head_dim": 64}, {"head_dim": 64, "causal": True}, {"head_dim": 64, "window_left": 256},
                   {"head_dim": 64, "score_mod": {"kind": "alibi"}}, {"head_dim": 96}, {"head_dim": 128},
                   {"head_dim": 128, "softcap": 30.0, "causal": True}, {"head_dim": 128, "qhead_per_kvhead": 8},
                   {"head_dim": 128, "mask": {"kind": "chunked", "size": 256}}, {"head_dim": 128, "head_dim_v": 64}):
        spec = AttentionSpec(**fields)
        p = plan(spec, "sm_90a")
        assert p.stale_max and p.reasons["stale_max"] == STALE_MAX_REASON, spec.summary()
        assert p.rescale_threshold == 8.0 and "2^8" in p.reasons["rescale_threshold"], spec.summary()
        assert all(s.plan.stale_max for s in seqlen_splits(spec, "sm_90a")), spec.summary()
        assert any(not c.stale_max for c in candidates(spec, "sm_90a"))
    for fields in ({"head_dim": 192, "head_dim_v": 128}, {"head_dim": 256, "causal": True}, {"head_dim": 128,
                   "head_dim_v": 256}, {"head_dim": 128, "mask": {"kind": "document"}},
                   {"head_dim": 64, "mask": {"kind": "expression", "expr": "kv_idx <= q_idx"}}):
        spec = AttentionSpec(**fields)
        p = plan(spec, "sm_90a")
        assert not p.stale_max and "every key tile finds its row max" in p.reasons["stale_max"], spec.summary()
        assert p.rescale_threshold == 8.0
        assert any(c.stale_max for c in candidates(spec, "sm_90a")), spec.summary()
    # a stale max needs the threshold and the overlapped schedule; rescaling every tile drops it
    base = plan(AttentionSpec(head_dim=64), "sm_90a")
    assert plan_problem(base.model_copy(update={"rescale_threshold": 0.0})) == \
        "stale_max needs the overlapped schedule and a rescale threshold"
    assert plan_problem(base.model_copy(update={"intra_warpgroup_overlap": False, "pingpong": False}))
    every = [c for c in candidates(AttentionSpec(head_dim=128), "sm_90a") if c.rescale_threshold == 0.0]
    assert every and not any(c.stale_max for c in every)


def test_d128_without_a_mask_chains_its_query_tiles_where_measured():
    """Chained query tiles (Plan.chain_query_tiles) measured faster only at d128 without a mask;
    masked, score-modified and other head dims keep them off, and say why; so does a spec that
    returns the LSE (measured slower chained), at every length, and tuning tries them there."""
    for chained in (AttentionSpec(head_dim=128), AttentionSpec(head_dim=128, qhead_per_kvhead=8),
                    AttentionSpec(head_dim=128, head_dim_v=64)):
        p = plan(chained, "sm_90a")
        assert p.chain_query_tiles and "d128 without a mask" in p.reasons["chain_query_tiles"], chained.summary()
        assert not plan_problem(p)
    for kept in (AttentionSpec(head_dim=128, causal=True), AttentionSpec(head_dim=128, window_left=256),
                 AttentionSpec(head_dim=128, softcap=50.0), AttentionSpec(head_dim=128, score_mod={"kind": "alibi"}),
                 AttentionSpec(head_dim=64), AttentionSpec(head_dim=96), AttentionSpec(head_dim=192, head_dim_v=128),
                 AttentionSpec(head_dim=256), AttentionSpec(head_dim=128, return_lse=True)):
        for p in (plan(kept, "sm_90a"), *(split.plan for split in seqlen_splits(kept, "sm_90a"))):
            assert not p.chain_query_tiles and "chaining them" in p.reasons["chain_query_tiles"], kept.summary()
            assert "without LSE: with it" in p.reasons["chain_query_tiles"]
    # tuning tries the other choice where the kernel allows it
    assert any(p.chain_query_tiles for p in candidates(AttentionSpec(head_dim=128, causal=True), "sm_90a"))
    assert any(not p.chain_query_tiles for p in candidates(AttentionSpec(head_dim=128), "sm_90a"))
    assert any(p.chain_query_tiles for p in candidates(AttentionSpec(head_dim=128, return_lse=True), "sm_90a"))
    assert not any(p.chain_query_tiles for p in candidates(AttentionSpec(head_dim=256), "sm_90a"))


@pytest.mark.parametrize("update", [{"num_consumer_warpgroups": 3, "tile_m": 192}, {"o_staging": "over_q", "q_stages": 1},
                                    {"intra_warpgroup_overlap": False, "pingpong": False}])
def test_chained_query_tiles_need_their_kernel_shape(update):
    base = plan(AttentionSpec(head_dim=128), "sm_90a")
    assert base.chain_query_tiles and not plan_problem(base)
    problem = plan_problem(base.model_copy(update=update))
    assert problem.startswith("chain_query_tiles needs") and "O in its own buffer" in problem


def test_o_goes_over_the_last_v_stage_where_two_warpgroups_measured_faster():
    """With room for one warpgroup's O buffer only (d192 and d256), warpgroup 1 stages O over its
    last key tile's V stage (o_staging "over_v": no turn at a shared buffer), except where that
    measured slower: d192 without a mask, whose tail is split at every length, and a window;
    those take the buffer in turn, and the reason says why. ``fa4gen tune`` tries the other."""
    for spec in (AttentionSpec(head_dim=256), AttentionSpec(head_dim=256, causal=True),
                 AttentionSpec(head_dim=192, head_dim_v=128, causal=True), AttentionSpec(head_dim=256, softcap=30.0)):
        p = plan(spec, "sm_90a")
        assert p.o_staging == "over_v" and "neither waits for the other's" in p.reasons["o_staging"], spec.summary()
        assert any(c.o_staging == "shared" for c in candidates(spec, "sm_90a")), spec.summary()
    for spec in (AttentionSpec(head_dim=192, head_dim_v=128), AttentionSpec(head_dim=256, window_left=1024)):
        p = plan(spec, "sm_90a")
        assert p.o_staging == "shared" and "over_v" in p.reasons["o_staging"], spec.summary()
    for spec, length in ((AttentionSpec(head_dim=256), 8192), (AttentionSpec(head_dim=128), 512)):
        p = plan_for_seqlen(spec, "sm_90a", length)
        assert p.o_staging == ("over_v" if spec.head_dim == 256 else "own")


def test_q_barriers_per_warpgroup_where_one_q_buffer_serves_two():
    """One Q buffer for 2 warpgroups (d192, d256) gets a pair of barriers per warpgroup's rows,
    but not under a left window (measured slower: Gemma 2); two Q buffers (d128), or 3
    warpgroups with one (d96 at most lengths), keep a pair per buffer. ``fa4gen tune`` tries the
    other choice wherever there are 2 or more warpgroups; one warpgroup cannot have it."""
    specs = [AttentionSpec(head_dim=d, head_dim_v=dv, causal=c, window_left=w, softcap=cap)
             for d, dv in ((64, None), (96, None), (128, None), (192, 128), (256, None))
             for c in (False, True) for w in (None, 1024) for cap in (None, 30.0)]
    kinds = set()
    for spec in specs:
        for length in (512, 2048, 16384):
            p = plan_for_seqlen(spec, "sm_90a", length)
            want = p.q_stages == 1 and p.num_consumer_warpgroups == 2 and spec.left_bound is None
            assert p.q_per_warpgroup == want, (spec.summary(), length)
            assert ("its own, and it starts once they are in" in p.reasons["q_per_warpgroup"]) and \
                p.reasons["q_per_warpgroup"].startswith("a warpgroup's") == want
            kinds.add((spec.head_dim, want))
        flipped = [c for c in candidates(spec, "sm_90a") if c.q_per_warpgroup != plan(spec, "sm_90a").q_per_warpgroup]
        assert flipped or plan(spec, "sm_90a").num_consumer_warpgroups == 1, spec.summary()
    assert {(192, True), (256, True), (256, False), (128, False)} <= kinds
    one = plan(AttentionSpec(head_dim=128, causal=True), "sm_90a").model_copy(
        update={"num_consumer_warpgroups": 1, "tile_m": 64, "pingpong": False, "q_per_warpgroup": True})
    assert plan_problem(one).startswith("q_per_warpgroup needs 2 or more")


@pytest.mark.parametrize("update", [{"num_consumer_warpgroups": 3, "tile_m": 192, "consumer_regs": 160,
                                     "producer_regs": 32},
                                    {"intra_warpgroup_overlap": False, "pingpong": False}])
def test_o_over_v_needs_two_overlapped_warpgroups(update):
    base = plan(AttentionSpec(head_dim=256), "sm_90a")
    assert base.o_staging == "over_v" and not plan_problem(base)
    assert plan_problem(base.model_copy(update=update)).startswith("o_staging over_v needs")
    chained = plan(AttentionSpec(head_dim=128), "sm_90a")
    assert plan_problem(chained.model_copy(update={"o_staging": "over_v", "q_stages": 1})).startswith(
        "chain_query_tiles needs")


def test_long_head_major_launches_split_their_tail():
    """Every spec without a mask runs the head-major order; its launches from its tile row's
    split-tail length on (2048 query rows at d64, measured there; 4096 elsewhere) run a
    plan that splits the ragged last round (Plan.split_tail: the long length range, the d96
    row's long plan where it has one), shorter ones a plan without it, and both say why; d192's
    row splits at every length in its own plan (no length range); masked specs never split. The
    kernel's workspace is one slot per CTA and consumer warpgroup."""
    d192 = AttentionSpec(head_dim=192, head_dim_v=128, softcap=30.0)
    assert plan(d192, "sm_90a").split_tail and not seqlen_splits(d192, "sm_90a")
    assert plan(d192, "sm_90a").split_tail_min_key_tiles == SPLIT_TAIL_EVERY_LENGTH.min_key_tiles
    assert SPLIT_TAIL_EVERY_LENGTH.reason in plan(d192, "sm_90a").reasons["split_tail"]
    for split, row in ((AttentionSpec(head_dim=128), SPLIT_TAIL), (AttentionSpec(head_dim=64), SPLIT_TAIL_FROM_2048),
                       (AttentionSpec(head_dim=96, softcap=30.0), SPLIT_TAIL),
                       (AttentionSpec(head_dim=256, sinks=True), SPLIT_TAIL),
                       (AttentionSpec(head_dim=128, score_mod={"kind": "alibi"}), SPLIT_TAIL)):
        base = plan(split, "sm_90a")
        assert not base.split_tail and f"at least {row.min_seqlen_q} query rows run this plan with a split tail" \
            in base.reasons["split_tail"]
        long = plan_for_seqlen(split, "sm_90a", row.min_seqlen_q)
        assert plan_for_seqlen(split, "sm_90a", row.min_seqlen_q - 1) != long
        assert long.split_tail and long.split_tail_min_key_tiles == row.min_key_tiles
        assert long.tile_order == "head_major" and "equal runs of key tiles" in long.reasons["split_tail"]
        assert row.reason in long.reasons["split_tail"]
        assert not plan_problem(long) and split_workspace_shape(base, 132) is None
        words = 64 * long.head_dim_v_padded // 128 + 4
        assert split_workspace_shape(long, 132) == (132, long.num_consumer_warpgroups, words, 128)
    for kept in (AttentionSpec(head_dim=128, causal=True), AttentionSpec(head_dim=128, window_left=256),
                 AttentionSpec(head_dim=64, mask={"kind": "expression", "expr": "kv_idx <= q_idx"}),
                 AttentionSpec(head_dim=128, mask="document")):
        p = plan(kept, "sm_90a")
        assert not p.split_tail and SPLIT_NEEDS in p.reasons["split_tail"], kept.summary()
        assert not any(s.plan.split_tail for s in seqlen_splits(kept, "sm_90a"))
    assert any(p.split_tail for p in candidates(AttentionSpec(head_dim=128), "sm_90a"))
    assert not any(p.split_tail for p in candidates(AttentionSpec(head_dim=128, causal=True), "sm_90a"))


@pytest.mark.parametrize("update", [{"persistent": False}, {"rotate_key_tiles": True},
                                    {"tile_order": "heavy_first"}, {"skip_masked_tiles": True}])
def test_split_tail_needs_a_persistent_head_major_launch_without_mask(update):
    base = plan_for_seqlen(AttentionSpec(head_dim=64), "sm_90a", SPLIT_TAIL_FROM_2048.min_seqlen_q)
    assert base.split_tail and not plan_problem(base)
    assert plan_problem(base.model_copy(update=update)) == f"split_tail needs {SPLIT_NEEDS}"
    assert not plan_problem(base.model_copy(update={**update, "split_tail": False}))


def test_tuning_candidates_vary_the_exponential_split():
    found = candidates(AttentionSpec(head_dim=64), "sm_90a")
    periods = {p.exp2_poly_period for p in found}
    assert {0, 2, 3, 4, 8} <= periods
    assert {p.rescale_threshold for p in found} == {0.0, 8.0}
    assert len({p.canonical_json() for p in found}) == len(found)


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
    p = plan(AttentionSpec(**fields), "sm_90a")
    assert (p.num_consumer_warpgroups, p.tile_n) == (warpgroups, tile_n)
    if warpgroups == 2 and fields.get("head_dim") == 64:
        assert "needs more than 160 registers" in p.reasons["num_consumer_warpgroups"]


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
        ({"mask": {"kind": "expression", "expr": "kv_idx <= q_idx"}}, "head_major"),
        ({"softcap": 30.0}, "head_major"),
        ({"causal": True, "softcap": 30.0, "sinks": True}, "paired"),
        ({"head_dim": 256, "causal": True, "window_left": 4096}, "heavy_first"),  # registers: no run-time choice
        ({"head_dim": 256, "causal": True}, "paired"),
    ],
)
def test_tile_order_follows_the_work_per_query_tile(fields, order):
    p = plan(AttentionSpec(**{"head_dim": 128, **fields}), "sm_90a")
    assert p.tile_order == order
    if order == "paired":  # the reason says when a window lets pairs run
        assert ("window" in p.reasons["tile_order"]) == ("window_left" in fields)
    # only pairs end in a tail, and the reasons say so
    tail = (p.pair_tail_rounds, p.pair_tail_min_tiles)
    assert tail == ((PAIR_TAIL_ROUNDS, PAIR_TAIL_MIN_TILES) if order == "paired" else (0, 0))
    assert (f"at least {PAIR_TAIL_MIN_TILES} query tiles" in p.reasons["pair_tail_rounds"]) == (order == "paired")
    if order != "paired":
        assert p.reasons["pair_tail_rounds"] == "not the paired order: no pairs"
        assert p.reasons["pair_tail_min_tiles"] == "no tail"


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
    causal one), measured faster there; where the variant already runs those tiles there is
    nothing to switch to. Long launches run 144-key tiles at d96 and, without a mask, split
    their tail."""
    from fa4gen.planner import seqlen_splits
    from fa4gen.sm90_tables import SM90_D96_SHORT

    spec = AttentionSpec(**fields)
    splits = {s.label: s for s in seqlen_splits(spec, "sm_90a")}
    assert list(splits) == labels
    main = plan(spec, "sm_90a")
    if "short" in splits:
        split = splits["short"]
        short = split.plan
        assert main.num_consumer_warpgroups == 3
        plain = spec.left_bound is None and spec.mask_kind is None and spec.score_mod is None \
            and spec.softcap is None
        if spec.head_dim == 64 and plain:  # 192-row tiles give way to 256 rows of 64 keys on 4 warpgroups
            assert (short.tile_m, short.tile_n, short.kv_stages, short.num_consumer_warpgroups) == (256, 64, 4, 4)
            assert (short.producer_regs, short.consumer_regs, short.p_in_registers) == (24, 112, True)
            assert short.rescale_threshold == RESCALE_THRESHOLD_LOG2 and short.stale_max
        else:  # 192-row tiles on 3 warpgroups give way to 128 rows on 2
            assert (short.tile_m, short.num_consumer_warpgroups, short.p_in_registers) == (128, 2, True)
            assert (short.producer_regs, short.consumer_regs) == (24, 240)
        assert short.q_stages == 2 and not plan_problem(short)
        assert short.reasons["num_consumer_warpgroups"].endswith(split.reason)
        assert short.tile_order == main.tile_order and short.smem_bytes <= 227 * 1024
        assert (split.min_seqlen_q, split.max_seqlen_q) == (1, 1024) and "1024 query rows" in split.reason
        assert "at most 1024 query rows" in split.describe()
    if "long" in splits:
        split = splits["long"]
        # where the tile row's long tiles start, or else its split tail (d64: 2048)
        row = next(r for r in SM90_FWD_TILES if max(spec.head_dim, spec.head_dim_v or 0) <= r.max_head_dim)
        start = row.long.min_seqlen_q if row.long else row.split_tail.min_seqlen_q
        assert (split.min_seqlen_q, split.max_seqlen_q) == (start, None) and f"{start} query rows" in split.reason
        assert f"at least {start} query rows" in split.describe()
        assert split.plan.split_tail == (not spec.has_mask) == ("split_tail" in split.reason)
        if split.plan.tile_n != main.tile_n:  # d96: 144-key tiles on the same 3 warpgroups, P through smem
            assert (split.plan.tile_m, split.plan.tile_n, main.tile_n) == (192, 144, 128)
            assert not split.plan.p_in_registers and split.reason.startswith(split.plan.reasons["tile_n"])
        else:  # the main plan with the split tail
            unsplit = split.plan.model_copy(update={**NO_SPLIT_TAIL, "reasons": main.reasons})
            assert unsplit == main
    assert [r.max_head_dim for r in SM90_FWD_TILES if r.short] == [64, 96]
    assert [s.row for s in SM90_FWD_TILES[1].short] == [SM90_D96_SHORT]


def test_length_ranges_cover_each_length_once():
    from fa4gen.planner import SeqlenSplit, plan_for_seqlen, seqlen_splits

    spec = AttentionSpec(head_dim=64, causal=True)
    splits = seqlen_splits(spec, "sm_90a")
    main = plan(spec, "sm_90a")
    for seqlen in (1, 1024, 1025, 4096, 10**6):
        covering = [s for s in splits if s.covers(seqlen)]
        assert len(covering) <= 1
        assert plan_for_seqlen(spec, "sm_90a", seqlen) == (covering[0].plan if covering else main)
    assert plan_for_seqlen(spec, "sm_90a", 1024).tile_m == 256
    assert plan_for_seqlen(spec, "sm_90a", 1025) == main
    middle = SeqlenSplit(label="middle", min_seqlen_q=2048, max_seqlen_q=4096, plan=main, reason="r")
    long = SeqlenSplit(label="long", min_seqlen_q=8192, plan=main, reason="r")
    assert [n for n in (2047, 2048, 4096, 4097) if middle.covers(n)] == [2048, 4096]
    assert [n for n in (8191, 8192, 10**9) if long.covers(n)] == [8192, 10**9]
    assert (middle.rows(), long.rows()) == ("2048 to 4096 query rows", "at least 8192 query rows")


def test_l2_head_groups_are_a_tuning_candidate_of_ordered_plans():
    """The heaviest-first order in L2-sized head groups (FlashAttention-3's) is offered to
    `fa4gen tune` for causal and other uneven-work plans; the table does not choose it yet."""
    for fields, offered in (({"causal": True}, True), ({"mask": "prefix_lm"}, True), ({}, False)):
        spec = AttentionSpec(head_dim=128, **fields)
        assert plan(spec, "sm_90a").l2_group_bytes == 0
        grouped = [p for p in candidates(spec, "sm_90a") if p.l2_group_bytes]
        assert bool(grouped) == offered, fields
        for p in grouped:
            assert p.tile_order == "heavy_first" and p.l2_group_bytes == Arch.SM90A.caps.l2_bytes


def test_rotated_key_tiles_are_a_tuning_candidate_without_mask_bounds():
    """Visiting key tiles from an offset per query tile is only valid where no mask bound ties
    the order to key positions: offered to `fa4gen tune` for plain kernels, off in the table."""
    for fields, offered in (({}, True), ({"softcap": 30.0, "sinks": True}, True), ({"causal": True}, False),
                            ({"window_left": 64, "window_right": 64}, False),
                            ({"mask": {"kind": "expression", "expr": "kv_idx <= q_idx"}}, False)):
        spec = AttentionSpec(head_dim=128, **fields)
        assert not plan(spec, "sm_90a").rotate_key_tiles
        assert any(p.rotate_key_tiles for p in candidates(spec, "sm_90a")) == offered, fields


def test_mask_runs_follow_the_structural_bounds():
    """Masked and interior key tiles run in separate loops wherever structural bounds order them
    (causal, windows, chunks, prefix-LM, documents), never for an expression mask (its block
    list has no such order) nor without a mask; where they apply, `fa4gen tune` may flip them."""
    for fields, runs in (({}, False), ({"causal": True}, True), ({"window_left": 64, "window_right": 8}, True),
                         ({"mask": {"kind": "chunked", "size": 256}}, True), ({"mask": "prefix_lm"}, True),
                         ({"causal": True, "mask": "document"}, True), ({"softcap": 30.0}, False),
                         ({"mask": {"kind": "expression", "expr": "kv_idx <= q_idx"}}, False)):
        spec = AttentionSpec(head_dim=128, **fields)
        base = plan(spec, "sm_90a")
        assert base.mask_runs is runs, fields
        assert any(p.mask_runs != runs for p in candidates(spec, "sm_90a")) is runs, fields


def test_interior_first_tile_where_no_right_bound_cuts_it_up_to_d192():
    """The first key tile gets a form without mask code where it can lie inside every row's
    bounds (no causal or right-window bound, no expression mask), at head dims up to 192 (at d256
    the second form cost 0.92x); where it applies, `fa4gen tune` may flip it."""
    for fields, applies in (({}, True), ({"mask": "prefix_lm"}, True), ({"window_left": 64}, True),
                            ({"mask": "document"}, True), ({"softcap": 30.0}, True), ({"causal": True}, False),
                            ({"window_left": 64, "window_right": 8}, False),
                            ({"mask": {"kind": "chunked", "size": 256}}, False),
                            ({"causal": True, "mask": "document"}, False),
                            ({"mask": {"kind": "expression", "expr": "kv_idx <= q_idx"}}, False)):
        for head_dim in (64, 128, 192, 256):
            spec = AttentionSpec(head_dim=head_dim, head_dim_v=min(head_dim, 128) if head_dim == 192 else None,
                                 **fields)
            base = plan(spec, "sm_90a")
            assert base.interior_first_tile is (applies and head_dim <= 192), (fields, head_dim)
            assert "interior_first_tile" in base.reasons
            flipped = any(p.interior_first_tile != base.interior_first_tile for p in candidates(spec, "sm_90a"))
            assert flipped is applies, (fields, head_dim)


def test_measured_schedule_options_are_tuning_candidates_off_in_the_table():
    """Turnless tile edges (ping-pong plans only) and the pinned P.V wait (overlapped plans)
    measured no faster on the H200: off in the table, offered to `fa4gen tune`."""
    for head_dim in (64, 128, 256):
        spec = AttentionSpec(head_dim=head_dim, causal=True)
        base = plan(spec, "sm_90a")
        assert not base.turnless_edges and not base.pinned_pv_wait
        found = candidates(spec, "sm_90a")
        assert any(p.pinned_pv_wait for p in found)
        assert any(p.turnless_edges for p in found) is base.pingpong, head_dim
        assert all(p.pingpong or not p.turnless_edges for p in found)


def test_interleaved_heads_are_a_candidate_of_the_head_major_order():
    """Interleaving the query tiles of 2 heads is offered to `fa4gen tune` where the order is
    head-major (uniform work per query tile); the table finishes one head before the next."""
    for fields, offered in (({}, True), ({"softcap": 30.0}, True), ({"causal": True}, False),
                            ({"window_left": 256, "window_right": 0}, False)):
        spec = AttentionSpec(head_dim=128, **fields)
        base = plan(spec, "sm_90a")
        assert base.head_interleave == 1
        assert ("interleaves" not in base.reasons["head_interleave"]) and base.reasons["head_interleave"]
        assert any(p.head_interleave == 2 for p in candidates(spec, "sm_90a")) is offered, fields


def test_narrow_windows_run_without_pingpong():
    """A window that spans at most two key tiles per query tile leaves too few MMAs to take
    turns over: ping-pong off (measured 1.12x on the H200), offered back to `fa4gen tune`;
    wider windows, chunks and plain causal keep it."""
    for fields, narrow in (({"head_dim": 64, "causal": True, "window_left": 128, "sinks": True}, True),
                           ({"head_dim": 128, "window_left": 64, "window_right": 64}, True),
                           ({"head_dim": 128, "causal": True, "window_left": 129}, False),
                           ({"head_dim": 128, "causal": True, "window_left": 1024}, False),
                           ({"head_dim": 64, "mask": {"kind": "chunked", "size": 128}}, False),
                           ({"head_dim": 128, "causal": True}, False)):
        spec = AttentionSpec(**fields)
        base = plan(spec, "sm_90a")
        assert base.pingpong is not narrow, fields
        assert ("narrow window" in base.reasons["pingpong"]) is narrow, fields
        if narrow:
            assert any(p.pingpong for p in candidates(spec, "sm_90a")), fields


def test_wide_windows_give_the_producer_more_registers():
    """A window or the causal pairs at d > 192 move 8 registers per consumer thread to the
    producer, whose loop spilled at 24 (the SASS check in test_crosscompile holds every kernel
    to zero spills); other kernels keep 24 / 240. Every split fits the CTA's launch pool, not
    just the SM."""
    for fields, split in (({"head_dim": 256, "qhead_per_kvhead": 2, "causal": True, "window_left": 4096}, (40, 232)),
                          ({"head_dim": 256, "window_left": 512, "window_right": 512}, (40, 232)),
                          ({"head_dim": 256, "causal": True}, (40, 232)),
                          ({"head_dim": 256}, (24, 240)),
                          ({"head_dim": 256, "mask": "document"}, (24, 240)),
                          ({"head_dim": 192, "head_dim_v": 128, "causal": True}, (24, 240)),
                          ({"head_dim": 192, "head_dim_v": 128, "causal": True, "window_left": 1024}, (24, 240)),
                          ({"head_dim": 128, "causal": True, "window_left": 1024}, (24, 240)),
                          ({"head_dim": 64, "causal": True, "window_left": 1024}, (24, 240))):
        p = plan(AttentionSpec(**fields), "sm_90a")
        assert (p.producer_regs, p.consumer_regs) == split, fields
        assert ("spilled" in p.reasons["producer_regs"]) is (split == (40, 232)), fields
        assert f"<= {sm90_register_pool(p.num_consumer_warpgroups)}" in p.reasons["consumer_regs"]
    assert sm90_register_pool(2) == 168 * 384 and sm90_register_pool(3) == 128 * 512


def test_a_split_over_the_register_pool_is_refused_before_compiling(tmp_path):
    """32 + 2 x 240 registers fit the SM's 65536 but not the 64512 the launch gives a 384-thread
    CTA: setmaxnreg.inc would hang the GPU, so build refuses the plan, naming the fields."""
    import fa4gen

    spec = AttentionSpec(head_dim=128)
    over = plan(spec, "sm_90a").model_copy(update={"producer_regs": 32})
    assert "over the CTA's pool of 64512" in plan_problem(over)
    assert not plan_problem(plan(spec, "sm_90a"))
    with pytest.raises(ValueError, match="producer_regs 32 .* consumer_regs 240"):
        fa4gen.build(spec, "sm_90a", kernel_plan=over, cache_dir=tmp_path)
    assert not any(tmp_path.rglob("kernel.cubin"))


def test_the_gpu_tests_plan_premises_hold():
    """Plan properties the GPU tests assert before they launch (tests/test_gpu.py), checked here
    too, so that a planner change that breaks one fails in CI rather than first on the GPU: the
    chained d128 kernel without LSE, the long-range split tails, O over V for the keyless runs."""
    from gpu_cases import keyless_cases, variant_specs

    specs = variant_specs()
    for length in (17, 300, 700, 1000):
        p = plan_for_seqlen(specs["dense-gqa2"], "sm_90a", length)
        assert p.chain_query_tiles and p.q_stages == 2 and not p.split_tail, length
    for name, (length, keys) in {"dense-gqa2+lse": (4100, 4200)}.items():
        p = plan_for_seqlen(specs[name], "sm_90a", length)
        assert p.split_tail and -(-keys // p.tile_n) >= p.split_tail_min_key_tiles, name
    assert all(p.o_staging == "over_v" for _, p in keyless_cases().values())
