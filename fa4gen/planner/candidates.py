"""Tuning candidates: the planner's plan first, then single-step variations of it that fit the
hardware, which ``fa4gen tune`` times on a GPU to pick a plan by measurement."""

from __future__ import annotations

from fa4gen.arch import MMA_K_GRANULE, Arch, require_supported
from fa4gen.kernels.sm90.config import config_problem
from fa4gen.planner.model import Plan
from fa4gen.planner.sm90 import O_STAGING, plan_sm90, sm90_row, split_tail_applies
from fa4gen.planner.sm90_tables import (
    NO_PAIR_TAIL,
    PAIR_TAIL_MIN_TILES,
    PAIR_TAIL_ROUNDS,
    RESCALE_THRESHOLD_LOG2,
    SM90_REGISTER_SPLIT,
)
from fa4gen.spec import AttentionSpec

TUNE_TILE_N_STEPS = (-32, -16, 16, 32)  # key-tile sizes tried around the table's choice
REGISTER_HEADROOM = 32  # per-thread registers kept for addresses, softmax state and the pipeline
NO_SPLIT_TAIL = {"split_tail": False, "split_tail_min_key_tiles": 0}  # config fields of whole tiles only


def sm90_fits(p: Plan) -> bool:
    """The kernel's own check, and a register estimate (S fp32 + P 16-bit + O fp32 per thread)."""
    c = p.config
    fragments = c.tile_n // 2 + (c.tile_n // 4 if c.p_in_registers else 0) + c.head_dim_v_padded // 2
    return (
        not config_problem(c)
        and fragments + REGISTER_HEADROOM <= c.consumer_regs
        and 32 <= c.tile_n <= 256
        and c.tile_n % MMA_K_GRANULE == 0
    )


def sm90_refit(p: Plan, why: str) -> Plan:
    """A candidate whose buffers overflow shared memory (or whose O staging no longer fits)
    gives up the second Q buffer, then stages O in the first place of O_STAGING that fits."""
    updates = [{}, {"q_stages": 1}] + [{"q_stages": 1, "o_staging": o} for o in O_STAGING]
    for update in updates:
        refit = p.with_config(f"{why}, to fit shared memory", **update) if update else p
        if sm90_fits(refit):
            return refit
    return p


def _flips(spec: AttentionSpec, base: Plan) -> list[tuple[str, dict] | None]:
    c = base.config
    return [
        ("ping-pong flipped", {"pingpong": not c.pingpong}) if c.num_consumer_warpgroups > 1 else None,
        ("mask runs flipped", {"mask_runs": not c.mask_runs}) if spec.has_mask and not c.expression_mask else None,
        ("interior first tile flipped", {"interior_first_tile": not c.interior_first_tile})
        if c.window_right is None and not c.expression_mask
        else None,
        (
            "split tail flipped",
            NO_SPLIT_TAIL
            if c.split_tail
            else {"split_tail": True, "split_tail_min_key_tiles": sm90_row(spec).split_tail.min_key_tiles},
        )
        if split_tail_applies(spec)
        else None,
        ("causal pairs in whole rounds to the end", NO_PAIR_TAIL) if c.pair_tail_rounds else None,
        (f"{3 - c.q_stages} Q buffers", {"q_stages": 3 - c.q_stages}),
        ("causal tiles heaviest first", {"tile_order": "heavy_first", **NO_PAIR_TAIL})
        if c.tile_order == "paired"
        else None,
        (
            "query tiles unchained" if c.chain_query_tiles else "query tiles chained",
            {"chain_query_tiles": not c.chain_query_tiles},
        ),
        (
            "documents' query tiles in ranked pairs",
            {"tile_order": "paired", "pair_tail_rounds": PAIR_TAIL_ROUNDS, "pair_tail_min_tiles": PAIR_TAIL_MIN_TILES},
        )
        if spec.is_varlen and c.tile_order == "heavy_first"
        else None,
        ("O rescaled every tile", {"rescale_threshold": 0.0, "stale_max": False})
        if c.rescale_threshold
        else (
            f"O rescaled past a threshold of 2^{RESCALE_THRESHOLD_LOG2:g}",
            {"rescale_threshold": RESCALE_THRESHOLD_LOG2},
        ),
        (
            ("Q barriers per buffer", {"q_per_warpgroup": False})
            if c.q_per_warpgroup
            else ("Q barriers per warpgroup", {"q_per_warpgroup": True})
        )
        if c.num_consumer_warpgroups > 1
        else None,
        ("O staged in the shared buffer", {"o_staging": "shared", "q_stages": 1})
        if c.o_staging == "over_v"
        else ("O staged over V", {"o_staging": "over_v", "q_stages": 1})
        if c.o_staging == "shared"
        else None,
        ("every key tile's row max found", {"stale_max": False})
        if c.stale_max
        else ("key tiles against the running max", {"stale_max": True, "rescale_threshold": RESCALE_THRESHOLD_LOG2}),
    ]


def _shape_flips(base: Plan) -> list[tuple[str, dict]]:
    c = base.config
    flips = [
        (f"{stages} K/V stages", {"kv_stages": stages}) for stages in (c.kv_stages - 1, c.kv_stages + 1) if stages >= 2
    ]  # (one stage would leave the producer nothing to load ahead)
    flips += [(f"tile_n {c.tile_n + step}", {"tile_n": c.tile_n + step}) for step in TUNE_TILE_N_STEPS]
    other = 2 if c.num_consumer_warpgroups == 3 else 3  # 2 <-> 3, 4 -> 3 consumer warpgroups
    producer_regs, consumer_regs = SM90_REGISTER_SPLIT[other]
    # as in the planner: P leaves the registers only for the 160 of 3 warpgroups
    flips.append(
        (
            f"{other} consumer warpgroups",
            {
                "num_consumer_warpgroups": other,
                "producer_regs": producer_regs,
                "consumer_regs": consumer_regs,
                "p_in_registers": c.p_in_registers or other == 2,
            },
        )
    )
    return flips


def candidates(spec: AttentionSpec, arch: Arch | str = Arch.SM90A) -> list[Plan]:
    """The planner's plan first, then its single-step variations that fit the hardware."""
    require_supported(arch)  # (sm_90a is the one planned arch)
    base = plan_sm90(spec)
    found = [base]
    for why, update in [f for f in _flips(spec, base) if f is not None] + _shape_flips(base):
        variant = sm90_refit(base.with_config(f"tuning candidate: {why}", **update), why)
        if sm90_fits(variant) and all(variant.config != p.config for p in found):
            found.append(variant)
    return found
