"""The sm_90a planner's default choices: spec -> Sm90FwdConfig, with a reason per choice.

The tile rows and measured constants are in sm90_tables; each reason cites the decision id whose
measurements are in docs/decisions.md. Nothing here checks whether a config can run: every plan
made here passes the kernel family's one check (config_problem), asserted on the way out.
"""

from __future__ import annotations

from fa4gen.arch import MMA_K_GRANULE, WGMMA_M, Arch
from fa4gen.kernels.sm90.config import (
    Sm90FwdConfig,
    config_problem,
    o_staging_fits,
    register_pool,
    smem_bytes,
)
from fa4gen.planner.fields import variant_fields
from fa4gen.planner.model import Plan, SeqlenSplit
from fa4gen.planner.sm90_decode import cache_splits, decode_split
from fa4gen.planner.sm90_tables import (
    FIRST_CALL_TILE_N,
    INTERIOR_FIRST_TILE_MAX_D,
    PAIR_TAIL_MIN_TILES,
    PAIR_TAIL_ROUNDS,
    RESCALE_THRESHOLD_LOG2,
    SM90_FWD_TILES,
    SM90_PRESSURE_MAX_TILE_N_D256,
    SM90_REGISTER_SPLIT,
    SM90_WIDE_WINDOW_SPLIT,
    STALE_MAX_MAX_D,
    STALE_MAX_SKIPS_MASKS,
    TileRow,
)
from fa4gen.spec import AttentionSpec

KERNEL = "HopperAttentionForward"
# Where the epilogue stages O for its TMA store, by preference (decision o-staging): its own
# buffer; over the warpgroup's P tile; over V (warpgroup 1) beside one buffer (warpgroup 0); one
# buffer the warpgroups take in turn; over the warpgroup's own Q rows.
O_STAGING = ("own", "over_p", "over_v", "shared", "over_q")


def _round_up(value: int, granule: int) -> int:
    return (value + granule - 1) // granule * granule


def _register_pressure(spec: AttentionSpec) -> str:
    """What in the variant adds per-score registers, or "" when nothing does."""
    if spec.score_mod is not None:
        return f"a {spec.score_mod.kind} score modifier"
    if spec.mask_kind is not None:
        return f"a {spec.mask_kind} mask"
    if spec.left_bound is not None and spec.right_bound is not None:
        return "a two-sided window"
    return ""


def _register_fit(spec: AttentionSpec, row: TileRow, width: int) -> tuple[int, int, str]:
    """(warpgroups, tile_n, why): the row, stepped back where per-score registers would spill."""
    warpgroups, tile_n, why = row.consumer_warpgroups, row.tile_n, row.reason
    pressure = _register_pressure(spec)
    if pressure and warpgroups > 2:
        warpgroups, why = 2, f"{pressure} needs more registers: 2 warpgroups (decision pressure-step-back)"
    if pressure and tile_n > SM90_PRESSURE_MAX_TILE_N_D256 and width > 192:
        tile_n, why = SM90_PRESSURE_MAX_TILE_N_D256, f"{pressure} at d256: 64-key S (decision pressure-step-back)"
    return warpgroups, tile_n, why


def _register_split(spec: AttentionSpec, warpgroups: int, width: int, tile_order: str) -> tuple[int, int, str]:
    producer, consumer = SM90_REGISTER_SPLIT[warpgroups]
    if warpgroups == 2 and width > 192 and (spec.left_bound is not None or tile_order == "paired"):
        producer, consumer = SM90_WIDE_WINDOW_SPLIT
        return (
            producer,
            consumer,
            "d > 192 with a window or causal pairs: the producer spilled at 24 (decision wide-window-split)",
        )
    return (
        producer,
        consumer,
        "the producer only issues TMA: its registers go to the consumers (decision register-split)",
    )


def _tile_order(spec: AttentionSpec) -> tuple[str, str]:
    """How query tiles are handed to CTAs (fa4gen.kernels.common.scheduler), and why."""
    wide_window = spec.left_bound is not None and max(spec.head_dim, spec.dv) > 192
    if spec.right_bound == 0 and spec.mask_kind is None and not wide_window:
        return "paired", "causal: query tiles M-1-j and j of a head in one CTA, equal work (decision tile-order)"
    if (
        spec.left_bound is not None
        or spec.right_bound is not None
        or spec.mask_kind in {"chunked", "prefix_lm", "document"}
    ):
        return "heavy_first", "work per query tile differs: heaviest first, in a snake (decision tile-order)"
    return "head_major", "equal work per query tile: CTAs running together share a head's K/V (decision tile-order)"


def _fit_smem(tile_m: int, tile_n: int, stages: int, dqk: int, dv: int, p_regs: bool):
    """Shrink the K/V ring (then the key tile) until Q, K/V, P and O fit; stage O in the first
    place of O_STAGING that fits and give Q a second buffer where it fits. Returns (tile_n,
    stages, o_staging, q_stages, shrunk)."""
    limit = Arch.SM90A.caps.smem_bytes_per_cta

    def fits(o_staging: str, n: int, k: int, q_stages: int = 1) -> bool:
        return (
            o_staging_fits(o_staging, n, dqk, dv, q_stages, not p_regs, tile_m // WGMMA_M)
            and smem_bytes(tile_m, n, k, dqk, dv, o_staging, q_stages, not p_regs) <= limit
        )

    shrunk = False
    while not any(fits(o, tile_n, stages) for o in O_STAGING):
        if stages > 2:
            stages -= 1
        else:
            tile_n -= MMA_K_GRANULE
        shrunk = True
    o_staging = next(o for o in O_STAGING if fits(o, tile_n, stages))
    return tile_n, stages, o_staging, 2 if fits(o_staging, tile_n, stages, 2) else 1, shrunk


def sm90_row(spec: AttentionSpec) -> TileRow:
    width = max(_round_up(spec.head_dim, MMA_K_GRANULE), _round_up(spec.dv, MMA_K_GRANULE))
    return next(r for r in SM90_FWD_TILES if width <= r.max_head_dim)


def split_tail_applies(spec: AttentionSpec) -> bool:
    """Whether the spec's plans may split their tail: no mask, so the tiles go head-major."""
    return not spec.has_mask and _tile_order(spec)[0] == "head_major"


def _spec_reasons(fields: dict) -> dict[str, str]:
    return dict.fromkeys(fields, "from the spec")


def plan_sm90(spec: AttentionSpec, row: TileRow | None = None) -> Plan:
    """The plan of ``row`` (default: the table's row for the spec's head dims)."""
    dqk, dv = _round_up(spec.head_dim, MMA_K_GRANULE), _round_up(spec.dv, MMA_K_GRANULE)
    row = row or sm90_row(spec)
    warpgroups, tile_n, tile_reason = _register_fit(spec, row, max(dqk, dv))
    tile_order, order_reason = _tile_order(spec)
    producer_regs, consumer_regs, split_reason = _register_split(spec, warpgroups, max(dqk, dv), tile_order)
    # a row that sends P through smem keeps P in registers once the variant steps back to fewer warpgroups
    p_regs = row.p_in_registers or warpgroups != row.consumer_warpgroups
    tile_m = WGMMA_M * warpgroups
    tile_n, stages, o_staging, q_stages, shrunk = _fit_smem(tile_m, tile_n, row.kv_stages, dqk, dv, p_regs)
    if shrunk:
        tile_reason += f"; shrunk to fit {Arch.SM90A.caps.smem_bytes_per_cta // 1024} KB of shared memory"
    plain = (
        not spec.has_mask
        and warpgroups == row.consumer_warpgroups
        and spec.score_mod is None
        and spec.softcap is None
        and o_staging == "own"
    )
    chain = row.unmasked_chain if plain and not spec.return_lse else None  # (decision chain-query-tiles: LSE)
    split_everywhere = row.split_tail.every_length and split_tail_applies(spec)
    if o_staging == "over_v" and (split_everywhere or spec.left_bound is not None):
        o_staging = "shared"  # (decision o-staging: over V measured slower there)
    narrow = (
        spec.left_bound is not None
        and spec.right_bound is not None
        and (spec.left_bound + spec.right_bound + tile_m <= 2 * tile_n)
    )
    interior_first = spec.right_bound is None and spec.mask_kind != "expression"
    variant = variant_fields(spec)
    config = Sm90FwdConfig(
        **variant,
        head_dim_padded=dqk,
        head_dim_v_padded=dv,
        num_consumer_warpgroups=warpgroups,
        tile_n=tile_n,
        kv_stages=stages,
        q_stages=q_stages,
        q_per_warpgroup=q_stages == 1 and warpgroups == 2 and spec.left_bound is None,
        producer_regs=producer_regs,
        consumer_regs=consumer_regs,
        p_in_registers=p_regs,
        pingpong=row.pingpong and not narrow,
        mask_runs=spec.has_mask and spec.mask_kind != "expression",
        interior_first_tile=interior_first and max(dqk, dv) <= INTERIOR_FIRST_TILE_MAX_D,
        tile_order=tile_order,
        pair_tail_rounds=PAIR_TAIL_ROUNDS if tile_order == "paired" else 0,
        pair_tail_min_tiles=PAIR_TAIL_MIN_TILES if tile_order == "paired" else 0,
        chain_query_tiles=chain is not None,
        split_tail=split_everywhere,
        split_tail_min_key_tiles=row.split_tail.min_key_tiles if split_everywhere else 0,
        o_staging=o_staging,
        rescale_threshold=RESCALE_THRESHOLD_LOG2,
        stale_max=max(dqk, dv) <= STALE_MAX_MAX_D and spec.mask_kind not in STALE_MAX_SKIPS_MASKS,
    )
    why = {
        "tile_n": tile_reason,
        "kv_stages": tile_reason,
        "num_consumer_warpgroups": tile_reason,
        "tile_order": order_reason,
        "producer_regs": split_reason,
        "consumer_regs": split_reason,
        **({"chain_query_tiles": chain} if chain else {}),
        **({"split_tail": row.split_tail.reason} if split_everywhere else {}),
    }
    planned = Plan(
        arch=Arch.SM90A.value,
        kernel=KERNEL,
        config=config,
        reasons={**_spec_reasons(variant), **_reasons(spec, config), **why},
    )
    problem = config_problem(config)
    assert not problem, problem
    return planned


def _reasons(spec: AttentionSpec, c: Sm90FwdConfig) -> dict[str, str]:
    """One line per schedule field that follows from the others."""
    regs = (c.producer_regs + c.num_consumer_warpgroups * c.consumer_regs) * 128
    return {
        "head_dim_padded": f"the wgmma K granule is {MMA_K_GRANULE}; TMA zero-fills the padding",
        "head_dim_v_padded": f"a multiple of {MMA_K_GRANULE}; the store masks padded columns",
        "q_stages": "a second Q buffer fits (decision q-stages)"
        if c.q_stages == 2
        else "no room for a second Q buffer (decision q-stages)",
        "q_per_warpgroup": "one Q buffer serves 2 warpgroups (decision q-per-warpgroup)"
        if c.q_per_warpgroup
        else "one pair of Q barriers per buffer (decision q-per-warpgroup)",
        "p_in_registers": "P feeds P.V from registers (decision p-in-registers)"
        if c.p_in_registers
        else "S and O fill the registers: P goes through shared memory (decision p-in-registers)",
        "pingpong": "consumers take turns issuing MMAs (decision pingpong)"
        if c.pingpong
        else "off: a narrow window or large d, where turns did not pay (decision pingpong)",
        "mask_runs": "masked and interior key tiles in separate loops (decision mask-runs)"
        if c.mask_runs
        else "no mask bounds that order the key tiles",
        "interior_first_tile": "the first key tile runs without mask code where no bound cuts it (decision "
        "interior-first-tile)"
        if c.interior_first_tile
        else "the first key tile always runs the mask (decision interior-first-tile)",
        "pair_tail_rounds": "the last rounds of causal pairs go as single tiles (decision pair-tail)"
        if c.pair_tail_rounds
        else "no pair tail",
        "chain_query_tiles": "each query tile ends with its own last P.V (decision chain-query-tiles)",
        "pair_tail_min_tiles": f"the pair tail from {c.pair_tail_min_tiles} query tiles per head (decision pair-tail)"
        if c.pair_tail_rounds
        else "no pair tail",
        "split_tail": "whole tiles to the end (decision split-tail)",
        "split_tail_min_key_tiles": "split where query tiles visit this many key tiles (decision split-tail)"
        if c.split_tail
        else "no split tail",
        "o_staging": f"O staged {c.o_staging} (decision o-staging)",
        "rescale_threshold": f"O rescaled only when a row max grows past 2^{c.rescale_threshold:g} "
        "(decision rescale-threshold)",
        "stale_max": "key tiles without mask code skip the tile's row max (decision stale-max)"
        if c.stale_max
        else "every key tile finds its row max (decision stale-max)",
        "consumer_regs": f"{regs} registers <= the CTA's pool of {register_pool(c.num_consumer_warpgroups)}",
    }


# Options that add traced code for speed alone (decision first-call-plan): off, every key tile
# runs one loop body where they ran up to four, at half the compile time or less.
FIRST_CALL_OFF = {
    "mask_runs": "one key-tile loop with a mask flag per tile",
    "chain_query_tiles": "each query tile ends with its own last P.V",
    "interior_first_tile": "the first key tile always runs the mask",
    "stale_max": "every key tile finds its row max",
}


def first_call_sm90(p: Plan) -> Plan | None:
    """What a first call runs while ``p`` builds in the background: ``p`` without the options that
    only add code for speed, on key tiles of at most FIRST_CALL_TILE_N; None where that is ``p``
    (a backward has no first-call plan, nor decode, whose one loop body compiles in seconds)."""
    if p.is_backward or p.is_decode:
        return None
    update = {name: False for name in FIRST_CALL_OFF if getattr(p.config, name)}
    reasons = {name: f"first calls: {FIRST_CALL_OFF[name]} (decision first-call-plan)" for name in update}
    if p.config.tile_n > FIRST_CALL_TILE_N:
        narrow = p.config.model_copy(update={**update, "tile_n": FIRST_CALL_TILE_N})
        if not config_problem(narrow):
            update["tile_n"] = FIRST_CALL_TILE_N
            reasons["tile_n"] = (
                f"first calls: {FIRST_CALL_TILE_N}-key tiles, a third less to compile (decision first-call-plan)"
            )
    if not update:
        return None
    quick = p.model_copy(update={"config": p.config.model_copy(update=update), "reasons": {**p.reasons, **reasons}})
    problem = config_problem(quick.config)
    assert not problem, problem
    return quick


def splits_sm90(spec: AttentionSpec) -> tuple[SeqlenSplit, ...]:
    """The plans launches in a range of query lengths run instead of ``plan_sm90(spec)``."""
    base = plan_sm90(spec)
    splits = []
    row = sm90_row(spec)
    short, long = next((s for s in row.short if s.takes_spec(spec)), None), row.long
    if short is not None:
        short_plan = plan_sm90(spec, short.row)
        if short_plan.config != base.config:  # the variant may already choose the same schedule
            splits.append(
                SeqlenSplit(label="short", max_seqlen_q=short.max_seqlen_q, plan=short_plan, reason=short.row.reason)
            )
    long_split = None
    if long is not None and not _register_pressure(spec):
        long_plan = plan_sm90(spec, long.row)
        # only where the variant keeps the row's warpgroups (the measured shape), and not the base's
        if long_plan.config.num_consumer_warpgroups == long.row.consumer_warpgroups and long_plan.config != base.config:
            long_split = SeqlenSplit(
                label="long", min_seqlen_q=long.min_seqlen_q, plan=long_plan, reason=long.row.reason
            )
    if split_tail_applies(spec) and not row.split_tail.every_length:  # long launches split their tail
        start = row.split_tail.min_seqlen_q
        assert long_split is None or long_split.min_seqlen_q == start, "a long row must start where the split tail does"
        why = row.split_tail.long_reason()
        plan = (base if long_split is None else long_split.plan).with_config(
            row.split_tail.reason, split_tail=True, split_tail_min_key_tiles=row.split_tail.min_key_tiles
        )
        long_split = SeqlenSplit(
            label="long",
            min_seqlen_q=start,
            plan=plan,
            reason=why if long_split is None else f"{long_split.reason}; {why}",
        )
    if long_split is not None:
        splits.append(long_split)
    decode = decode_split(spec)
    if decode is not None:  # the first range that covers a length is the one that runs it
        splits.insert(0, decode)
        splits.extend(cache_splits(spec))
    return tuple(splits)
