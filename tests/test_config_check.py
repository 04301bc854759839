"""The Hopper forward config's one feasibility check (fa4gen.kernels.sm90.config.config_problem): one
case per rule, and the planner, tuning, build and kernel constructor all running it."""

from __future__ import annotations

import re

import pytest

from fa4gen.arch import Arch
from fa4gen.kernels.sm90.config import Sm90FwdConfig, config_problem
from fa4gen.planner import candidates, plan, plan_for_seqlen, plan_problem
from fa4gen.planner.candidates import NO_SPLIT_TAIL
from fa4gen.planner.sm90_tables import SPLIT_TAIL_FROM_2048
from fa4gen.spec import AttentionSpec

CAPS = Arch.SM90A.caps


def _config(spec: AttentionSpec) -> Sm90FwdConfig:
    return plan(spec, "sm_90a").config


def _long_d64() -> Sm90FwdConfig:
    return plan_for_seqlen(AttentionSpec(head_dim=64), "sm_90a", SPLIT_TAIL_FROM_2048.min_seqlen_q).config


# (rule, base spec or config, update that breaks the rule, a word the problem names, update that
# meets the rule again or None)
RULES = [
    ("k-granule", AttentionSpec(head_dim=128), {"tile_n": 72}, "tile_n", {"tile_n": 64}),
    ("k-granule-head-dim", AttentionSpec(head_dim=128), {"head_dim_padded": 136}, "head_dim_padded", None),
    ("k-granule-positive", AttentionSpec(head_dim=128), {"tile_n": 0}, "tile_n", None),
    ("padding-holds-head-dims", AttentionSpec(head_dim=128), {"head_dim_v_padded": 112}, "padded", None),
    (
        "warpgroups-1-to-4",
        AttentionSpec(head_dim=128, causal=True),
        {"num_consumer_warpgroups": 5},
        "num_consumer_warpgroups",
        None,
    ),
    ("kv-stages-at-least-1", AttentionSpec(head_dim=128, causal=True), {"kv_stages": 0}, "kv_stages", {"kv_stages": 1}),
    ("q-stages-1-or-2", AttentionSpec(head_dim=128, causal=True), {"q_stages": 3}, "q_stages", {"q_stages": 1}),
    (
        "chain-needs-2-warpgroups",
        AttentionSpec(head_dim=128),
        {"num_consumer_warpgroups": 3, "producer_regs": 32, "consumer_regs": 160},
        "chain_query_tiles",
        {"chain_query_tiles": False, "kv_stages": 1, "q_stages": 1},
    ),
    (
        "chain-needs-o-own",
        AttentionSpec(head_dim=128),
        {"o_staging": "shared"},
        "chain_query_tiles",
        {"chain_query_tiles": False},
    ),
    (
        "chain-needs-no-expression-mask",
        AttentionSpec(head_dim=128),
        {"expression_mask": True},
        "chain_query_tiles",
        {"chain_query_tiles": False, "interior_first_tile": False},
    ),
    (
        "over-v-needs-2-warpgroups",
        AttentionSpec(head_dim=256),
        {"num_consumer_warpgroups": 3, "producer_regs": 32, "consumer_regs": 160},
        "o_staging",
        None,
    ),
    (
        "q-per-warpgroup-needs-2-warpgroups",
        AttentionSpec(head_dim=128, causal=True),
        {"num_consumer_warpgroups": 1, "pingpong": False, "q_per_warpgroup": True},
        "q_per_warpgroup",
        {"num_consumer_warpgroups": 1, "pingpong": False, "q_per_warpgroup": False},
    ),
    (
        "pingpong-needs-2-warpgroups",
        AttentionSpec(head_dim=128, causal=True),
        {"num_consumer_warpgroups": 1},
        "pingpong",
        {"num_consumer_warpgroups": 1, "pingpong": False},
    ),
    (
        "stale-max-needs-a-threshold",
        AttentionSpec(head_dim=64),
        {"rescale_threshold": 0.0},
        "stale_max",
        {"rescale_threshold": 0.0, "stale_max": False},
    ),
    (
        "split-tail-needs-head-major",
        _long_d64(),
        {"tile_order": "heavy_first"},
        "split_tail",
        {"tile_order": "heavy_first", **NO_SPLIT_TAIL},
    ),
    (
        "split-tail-needs-no-mask-bounds",
        _long_d64(),
        {"window_left": 256},
        "split_tail",
        {"window_left": 256, **NO_SPLIT_TAIL},
    ),
    (
        "split-tail-needs-no-expression-mask",
        _long_d64(),
        {"expression_mask": True, "interior_first_tile": False},
        "split_tail",
        {"expression_mask": True, "interior_first_tile": False, **NO_SPLIT_TAIL},
    ),
    (
        "mask-runs-need-mask-bounds",
        AttentionSpec(head_dim=128, causal=True),
        {"window_right": None},
        "mask_runs",
        {"window_right": None, "mask_runs": False},
    ),
    (
        "mask-runs-need-no-expression-mask",
        AttentionSpec(head_dim=128, causal=True),
        {"expression_mask": True},
        "mask_runs",
        {"expression_mask": True, "mask_runs": False},
    ),
    (
        "interior-first-tile-needs-no-right-bound",
        AttentionSpec(head_dim=64),
        {"window_right": 0},
        "interior_first_tile",
        {"window_right": 0, "interior_first_tile": False},
    ),
    (
        "interior-first-tile-needs-no-expression-mask",
        AttentionSpec(head_dim=64),
        {"expression_mask": True},
        "interior_first_tile",
        {"expression_mask": True, "interior_first_tile": False},
    ),
    (
        "pair-tail-needs-pairs",
        AttentionSpec(head_dim=128, causal=True),
        {"tile_order": "heavy_first"},
        "pair_tail_rounds",
        {"tile_order": "heavy_first", "pair_tail_rounds": 0},
    ),
    ("o-over-p-needs-p-in-smem", AttentionSpec(head_dim=128, causal=True), {"o_staging": "over_p"}, "over_p", None),
    (
        "o-over-q-needs-one-q-buffer",
        AttentionSpec(head_dim=128, causal=True),
        {"o_staging": "over_q"},
        "over_q",
        {"o_staging": "over_q", "q_stages": 1},
    ),
    (
        "o-over-q-needs-dv-within-d",
        AttentionSpec(head_dim=64, head_dim_v=128, causal=True),
        {"o_staging": "over_q", "q_stages": 1},
        "over_q",
        None,
    ),
    ("shared-memory", AttentionSpec(head_dim=128, causal=True), {"kv_stages": 4}, "shared memory", None),
    ("register-pool", AttentionSpec(head_dim=128), {"producer_regs": 32}, "producer_regs", {"producer_regs": 24}),
]


@pytest.mark.parametrize("base, update, names, meets", [rule[1:] for rule in RULES], ids=[rule[0] for rule in RULES])
def test_config_problem_rule(base, update, names, meets):
    """Each rule of the one check: the planner's config passes it, the update breaks that rule
    (the problem names what broke), and the update that meets it passes again."""
    config = base if isinstance(base, Sm90FwdConfig) else _config(base)
    assert config_problem(config) == ""
    problem = config_problem(config.model_copy(update=update))
    assert problem and names in problem
    if meets is not None:
        assert config_problem(config.model_copy(update=meets)) == ""


def test_planner_plans_and_tuning_candidates_pass_the_check(monkeypatch):
    """The planner asserts each plan passes config_problem, and the candidates are filtered by
    it: with a check that refuses everything, planning fails and no variation is offered."""
    import importlib

    # (the package's candidates() hides the module of that name from attribute access)
    candidates_module = importlib.import_module("fa4gen.planner.candidates")
    sm90 = importlib.import_module("fa4gen.planner.sm90")

    spec = AttentionSpec(head_dim=128)
    base = plan(spec, "sm_90a")
    assert len(candidates(spec, "sm_90a")) > 1
    monkeypatch.setattr(candidates_module, "config_problem", lambda c: "" if c == base.config else "refused")
    assert candidates(spec, "sm_90a") == [base]
    monkeypatch.setattr(sm90, "config_problem", lambda c: "refused by the check")
    with pytest.raises(AssertionError, match="refused by the check"):
        plan(spec, "sm_90a")


def test_build_refuses_a_plan_the_check_refuses(tmp_path, monkeypatch):
    """32 + 2 x 240 registers fit the SM's 65536 but not the 64512 the launch gives a 384-thread
    CTA: setmaxnreg.inc would hang the GPU, so build refuses the plan with the check's words,
    before emitting or compiling anything; and build asks the same check (plan_problem)."""
    import fa4gen
    from fa4gen.planner import model

    spec = AttentionSpec(head_dim=128)
    over = plan(spec, "sm_90a").with_config("test", producer_regs=32)
    problem = config_problem(over.config)
    assert problem and plan_problem(over) == problem and "producer_regs" in problem
    with pytest.raises(ValueError, match=re.escape(problem)):
        fa4gen.build(spec, "sm_90a", kernel_plan=over, cache_dir=tmp_path)
    monkeypatch.setattr(model, "config_problem", lambda c: "refused by the check")
    with pytest.raises(ValueError, match="refused by the check"):
        fa4gen.build(spec, "sm_90a", kernel_plan=plan(spec, "sm_90a"), cache_dir=tmp_path)
    assert not any(tmp_path.rglob("kernel.cubin"))


def test_the_kernel_constructor_runs_the_check(monkeypatch):
    """fa4gen.kernels.sm90.fwd imports on a CPU; HopperAttentionForward takes the planner's
    config and refuses one that config_problem refuses."""
    fwd = pytest.importorskip("fa4gen.kernels.sm90.fwd")

    good = _config(AttentionSpec(head_dim=128, causal=True))
    kernel = fwd.HopperAttentionForward(good)
    assert (kernel.tile_m, kernel.tile_n) == (good.tile_m, good.tile_n)
    bad = good.model_copy(update={"producer_regs": 32})
    with pytest.raises((AssertionError, ValueError), match=re.escape(config_problem(bad))):
        fwd.HopperAttentionForward(bad)
    monkeypatch.setattr(fwd, "config_problem", lambda c: "refused by the check")
    with pytest.raises((AssertionError, ValueError), match="refused by the check"):
        fwd.HopperAttentionForward(good)


def test_the_gpu_tests_plan_premises_hold():
    """Plan properties the GPU tests assert before they launch (tests/test_gpu.py), checked here
    too, so that a planner change that breaks one fails in CI rather than first on the GPU: the
    chained d128 kernel without LSE, the long-range split tails, O over V for the keyless runs."""
    from gpu_cases import keyless_cases, variant_specs

    specs = variant_specs()
    for length in (33, 300, 700, 1000):  # (up to 32 rows, 2 query heads per KV head: decode)
        c = plan_for_seqlen(specs["dense-gqa2"], "sm_90a", length).config
        assert c.chain_query_tiles and c.q_stages == 2 and not c.split_tail, length
    for name, (length, keys) in {"dense-gqa2+lse": (4100, 4200)}.items():
        c = plan_for_seqlen(specs[name], "sm_90a", length).config
        assert c.split_tail and -(-keys // c.tile_n) >= c.split_tail_min_key_tiles, name
    assert all(p.config.o_staging == "over_v" for _, p in keyless_cases().values())
