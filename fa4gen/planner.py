"""Spec + arch -> Plan: the tile and pipeline schedule, with a reason for every choice.

The plan is a frozen model: everything the kernel class needs as compile-time constants, and
nothing that depends on the machine doing the planning. The per-arch tables (one row per
head-dim bucket, each with the one-line reason behind it) live in fa4gen.sm90_tables.
"""

from __future__ import annotations

import json
from typing import Literal
from pydantic import BaseModel, ConfigDict

from fa4gen.arch import Arch, require_supported
from fa4gen.sm90_tables import (
    CHAIN_WITHOUT_LSE,
    EXP2_POLY_PERIOD_SOFTCAP,
    NO_PAIR_TAIL,
    PAIR_TAIL_MIN_TILES,
    PAIR_TAIL_ROUNDS,
    Q_PER_WARPGROUP_REASON,
    Q_PREFETCH_REASON,
    RESCALE_THRESHOLD_LOG2,
    SM90_FWD_TILES,
    SM90_REGISTER_SPLIT,
    SM90_WIDE_WINDOW_SPLIT,
    SPLIT_TAIL_HOW,
    STALE_MAX_MAX_D,
    STALE_MAX_REASON,
    STALE_MAX_SKIPS_MASKS,
    TileRow,
)
from fa4gen.spec import AttentionSpec

WARPGROUP_MMA_M = 64  # rows of one Hopper warpgroup MMA
WARPGROUP_THREADS = 128
MMA_K_GRANULE = 16  # K extent of one 16-bit wgmma; head dims are zero-padded (by TMA) to this
SMEM_RESERVE_BYTES = 1024  # mbarriers, the tile info words (sm90_fwd.publish_tile) and alignment slack


class Plan(BaseModel):
    """How one spec runs on one arch. Every field is a compile-time constant of the kernel."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    arch: str
    kernel: str  # kernel class that runs this plan
    tile_m: int  # query rows per CTA (= 64 x consumer warpgroups)
    tile_n: int  # key rows per main-loop step
    kv_stages: int  # depth of the K and V shared-memory ring buffers
    q_stages: int  # Q buffers: 2 lets the next tile's Q load while this tile computes
    q_prefetch: bool  # the producer prefetches the next tile's Q into L2 as it starts this tile
    q_per_warpgroup: bool  # each consumer warpgroup's Q rows have their own full/empty barriers
    num_consumer_warpgroups: int
    producer_regs: int  # setmaxnreg for the TMA producer warpgroup
    consumer_regs: int  # setmaxnreg for each MMA/softmax warpgroup
    head_dim_padded: int  # K extent of Q.K^T as loaded (TMA zero-fills the tail)
    head_dim_v_padded: int  # N extent of P.V as loaded
    p_in_registers: bool  # P feeds the P.V wgmma from registers (no shared-memory round trip)
    skip_masked_tiles: bool  # key tiles that a mask empties are never loaded nor computed
    intra_warpgroup_overlap: bool
    pingpong: bool
    turnless_edges: bool  # ping-pong: a query tile's first Q.K^T and last P.V take no turn
    mask_runs: bool  # masked and interior key tiles in separate loops (no per-tile mask branch)
    interior_first_tile: bool  # a query tile's first key tile runs no mask code where no bound cuts it
    pinned_pv_wait: bool  # overlapped tiles: the P.V wait held behind the softmax (K released after it)
    persistent: bool  # one CTA per SM walks the tile order (SM count is a run-time argument)
    tile_order: Literal["head_major", "heavy_first", "paired"]  # see fa4gen.kernels.scheduler
    pair_tail_rounds: int  # paired, persistent: the last rounds of pairs go as single tiles, heaviest first
    pair_tail_min_tiles: int  # ... in launches with at least this many query tiles per head
    l2_group_bytes: int  # heaviest-first order: heads go in groups whose K/V fits this (0: no groups)
    head_interleave: int  # head-major order: query tiles of this many heads interleaved (1: one head after another)
    rotate_key_tiles: bool  # without mask bounds: query tile m visits key tiles from m below the top
    chain_query_tiles: bool  # a query tile's last P.V issued with the next tile's first Q.K^T
    split_tail: bool  # persistent head-major: the ragged last round's key tiles spread over every CTA
    split_tail_min_key_tiles: int  # ... in launches whose query tiles visit at least this many key tiles
    o_staging: Literal["own", "over_p", "over_q", "shared", "over_v"]  # where O is staged for its TMA store (see O_STAGING)
    exp2_poly_period: int  # every k-th exponential of a row by polynomial on the FMA units (0: none)
    rescale_threshold: float  # log2 growth of a row max before O is rescaled (0: every tile)
    stale_max: bool  # key tiles without mask code skip the tile's row max (checked by the row sums)
    smem_bytes: int
    reasons: dict[str, str]

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))

    def describe(self) -> str:
        lines = [f"plan for {self.arch} ({self.kernel})"]
        for name, value in self.model_dump(exclude={"reasons"}).items():
            reason = self.reasons.get(name, "")
            lines.append(f"  {name:26} {str(value):10} {reason}")
        return "\n".join(lines)





def sm90_register_pool(warpgroups: int) -> int:
    """The registers setmaxnreg shares out within a CTA of ``warpgroups`` consumers and the
    producer: ptxas launches every thread with the most registers one CTA per SM allows, rounded
    down to 8 (168 at 384 threads: 64512, not the SM's 65536). A split over the pool makes
    setmaxnreg.inc wait forever."""
    caps = Arch.SM90A.caps
    threads = WARPGROUP_THREADS * (warpgroups + 1)
    return min(caps.max_regs_per_thread, caps.registers_per_sm // threads // 8 * 8) * threads


def _register_split(spec: AttentionSpec, warpgroups: int, width: int, tile_order: str) -> tuple[int, int, str]:
    """(producer, consumer) setmaxnreg targets, and why the producer gets its share."""
    producer, consumer = SM90_REGISTER_SPLIT[warpgroups]
    why = "the producer only issues TMA: give its registers to the consumers"
    if warpgroups == 2 and width > 192 and (spec.left_bound is not None or tile_order == "paired"):
        producer, consumer = SM90_WIDE_WINDOW_SPLIT
        what = "a window" if spec.left_bound is not None else "the causal pairs"
        measured = "" if spec.left_bound is not None else " (1.00x of 24 / 240 at d256 on the H200, 2026-12-01-s15d)"
        why = (f"{what} at d > 192: the producer's per-tile bounds and schedule position spilled at "
               f"{SM90_REGISTER_SPLIT[2][0]} registers; {producer} leave it spill-free and the consumers do not "
               f"spill at {consumer}{measured}")
    return producer, consumer, why


def _round_up(value: int, granule: int) -> int:
    return (value + granule - 1) // granule * granule


# Where the epilogue stages O for its TMA store, by preference: its own buffer (Q is released
# after the main loop, so the next tile's Q loads during this epilogue); over the warpgroup's P
# tile when P goes through shared memory (free once the last P.V has read it; the next tile's
# first P waits for the store to have read it); over the warpgroup's own Q rows (Q is released
# only after the store has read them, so the next tile's Q loads after this epilogue). Between the
# last two: with 2 consumer warpgroups, one 64-row buffer for the first and the V stage of the
# tile's last key tile for the second (held until its store has read it); or one 64-row buffer
# that the warpgroups take in turn (Q is released before the last P.V either way, so the next
# tile's Q loads during it and the epilogue).
O_STAGING = ("own", "over_p", "over_v", "shared", "over_q")


def sm90_smem_bytes(
    tile_m: int, tile_n: int, stages: int, dqk: int, dv: int, elem_bytes: int, o_staging: str, q_stages: int = 1,
    p_smem: bool = False,
) -> int:
    """Q tile(s) + K/V ring + (when in its own buffer) the O staging buffer + (when not in
    registers) P."""
    q = q_stages * tile_m * dqk
    o = {"own": tile_m * dv, "shared": WARPGROUP_MMA_M * dv, "over_v": WARPGROUP_MMA_M * dv}.get(o_staging, 0)
    kv = stages * tile_n * (dqk + dv)
    p = tile_m * tile_n if p_smem else 0
    return (q + o + kv + p) * elem_bytes + SMEM_RESERVE_BYTES


SM90_PRESSURE_MAX_TILE_N_D256 = 64


def _register_pressure(spec: AttentionSpec) -> str:
    """What in the variant adds per-score registers (bounds per row, coordinates, aux loads),
    or "" when nothing does: plain, causal-only and softcap kernels fit the table's rows."""
    if spec.score_mod is not None:
        return f"a {spec.score_mod.kind} score modifier (coordinates per score)"
    if spec.mask_kind is not None:
        return f"a {spec.mask_kind} mask (bounds per row)"
    if spec.left_bound is not None and spec.right_bound is not None:
        return "a two-sided window (both bounds checked per tile)"
    return ""


def _exp2_split(spec: AttentionSpec, row: TileRow) -> tuple[int, str]:
    """How many exponentials leave MUFU for the FMA units, and why."""
    if spec.softcap is not None and EXP2_POLY_PERIOD_SOFTCAP:
        return EXP2_POLY_PERIOD_SOFTCAP, (f"softcap's tanh also runs on MUFU: 1 in {EXP2_POLY_PERIOD_SOFTCAP} "
                                          "exponentials by polynomial on the FMA units")
    if row.exp2_poly_period:
        return row.exp2_poly_period, (f"d <= {row.max_head_dim}: exponentials outpace MUFU, so 1 in "
                                      f"{row.exp2_poly_period} runs as a polynomial on the FMA units")
    return 0, (f"d <= {row.max_head_dim}: every exp2 on MUFU (the FMA-unit polynomial measured slower on the "
               "H200 at every share, see EXP2_POLY_PERIOD_SOFTCAP)")


def _sm90_register_fit(spec: AttentionSpec, row: TileRow, head_dim: int) -> tuple[int, str, int, str]:
    """(warpgroups, why, tile_n, why): the table's row, stepped back where the variant's
    per-score registers would spill."""
    warpgroups, warpgroup_reason = row.consumer_warpgroups, row.reason
    tile_n, tile_reason = row.tile_n, row.reason
    pressure = _register_pressure(spec)
    if pressure and warpgroups > 2:
        # measured: 50-80 registers spilled at the 160 of 3 warpgroups; 2 warpgroups get 240
        warpgroup_reason = (f"{pressure} needs more than {SM90_REGISTER_SPLIT[warpgroups][1]} registers per "
                            f"thread: 2 warpgroups at {SM90_REGISTER_SPLIT[2][1]}")
        warpgroups = 2
    if pressure and tile_n > SM90_PRESSURE_MAX_TILE_N_D256 and head_dim > 192:
        # d256 keeps 128 O registers: with per-score bounds the 80-key S tile spilled (26-42)
        tile_n = SM90_PRESSURE_MAX_TILE_N_D256
        tile_reason = f"{row.reason}; {pressure} at d256: S back to {tile_n} keys so nothing spills"
    return warpgroups, warpgroup_reason, tile_n, tile_reason


def _tile_order(spec: AttentionSpec) -> tuple[str, str]:
    """How query tiles are handed to CTAs (fa4gen.kernels.scheduler), and why."""
    wide_window = spec.left_bound is not None and max(spec.head_dim, spec.dv) > 192
    if spec.right_bound == 0 and spec.mask_kind is None and not wide_window:
        window = "" if spec.left_bound is None else (
            f"; with the {spec.left_bound}-key window only while it cuts no row (Sk <= {spec.left_bound + 1}, "
            "checked at run time), heaviest first otherwise")
        return "paired", ("causal: one CTA runs query tiles M-1-j and j of one head back to back (equal work "
                          "per pair, so a static schedule balances) and a round's CTAs share few heads, so K/V "
                          f"is read from HBM about once (heaviest-first over all heads re-read it per tile){window}")
    if spec.left_bound is not None or spec.right_bound is not None or spec.mask_kind in {
            "chunked", "prefix_lm", "document"}:
        why = ("work per query tile differs: the heaviest tiles start first, in a snake order that pairs heavy "
               "and light tiles per CTA")
        if wide_window and spec.right_bound == 0:
            why += ("; a causal window at d > 192 does not choose pairs at run time (the choice costs registers "
                    "that its 64-key tiles do not have: SASS spilled)")
        return "heavy_first", why
    return "head_major", "equal work per query tile: the CTAs running together share one head's K/V in L2"


def o_staging_fits(o_staging: str, tile_n: int, dqk: int, dv: int, q_stages: int, p_smem: bool,
                   warpgroups: int) -> bool:
    """Whether O's (64 x dv) staging tile can sit where ``o_staging`` puts it."""
    if o_staging == "over_p":
        return p_smem and dv <= tile_n
    if o_staging == "over_q":
        return dv <= dqk and q_stages == 1
    if o_staging == "over_v":  # (and the overlapped, unchained schedule: plan_problem)
        return warpgroups == 2 and dv <= dqk and q_stages == 1 and tile_n >= WARPGROUP_MMA_M
    return True


def _sm90_fit_smem(tile_m: int, tile_n: int, stages: int, dqk: int, dv: int, p_regs: bool):
    """Shrink the K/V ring (then the key tile) until Q, K/V, (if not in registers) P and O
    (staged where it can go without a buffer) fit; then stage O in the first place of O_STAGING
    that fits and give Q a second buffer where it fits. Returns (tile_n, stages, o_staging,
    q_stages, shrunk)."""
    limit = Arch.SM90A.caps.smem_bytes_per_cta
    p_smem = not p_regs

    def fits(o_staging: str, n: int, k: int, q_stages: int = 1) -> bool:
        return (o_staging_fits(o_staging, n, dqk, dv, q_stages, p_smem, tile_m // WARPGROUP_MMA_M)
                and sm90_smem_bytes(tile_m, n, k, dqk, dv, 2, o_staging, q_stages, p_smem) <= limit)

    shrunk = False
    while not any(fits(o, tile_n, stages) for o in O_STAGING):
        if stages > 2:
            stages -= 1
        else:
            tile_n -= MMA_K_GRANULE
        shrunk = True
    o_staging = next(o for o in O_STAGING if fits(o, tile_n, stages))
    two_q = fits(o_staging, tile_n, stages, 2)
    return tile_n, stages, o_staging, 2 if two_q else 1, shrunk


def _sm90_row(spec: AttentionSpec) -> TileRow:
    width = max(_round_up(spec.head_dim, MMA_K_GRANULE), _round_up(spec.dv, MMA_K_GRANULE))
    return next(r for r in SM90_FWD_TILES if width <= r.max_head_dim)


def _plan_sm90(spec: AttentionSpec, row: TileRow | None = None) -> Plan:
    """The plan of ``row`` (default: the table's row for the spec's head dims)."""
    dqk = _round_up(spec.head_dim, MMA_K_GRANULE)
    dv = _round_up(spec.dv, MMA_K_GRANULE)
    row = row or _sm90_row(spec)
    warpgroups, warpgroup_reason, tile_n, tile_reason = _sm90_register_fit(spec, row, max(dqk, dv))
    tile_order, order_reason = _tile_order(spec)
    producer_regs, consumer_regs, producer_reason = _register_split(spec, warpgroups, max(dqk, dv), tile_order)
    exp2_period, exp2_reason = _exp2_split(spec, row)
    # a row that sends P through smem for its register budget keeps P in registers once the
    # variant steps back to fewer warpgroups (more registers each)
    p_regs = row.p_in_registers or warpgroups != row.consumer_warpgroups
    keeps_row = not spec.has_mask and warpgroups == row.consumer_warpgroups  # the row's measured shape, no mask
    stale = max(dqk, dv) <= STALE_MAX_MAX_D and spec.mask_kind not in STALE_MAX_SKIPS_MASKS
    tile_m = WARPGROUP_MMA_M * warpgroups
    tile_n, stages, o_staging, q_stages, shrunk = _sm90_fit_smem(tile_m, tile_n, row.kv_stages, dqk, dv, p_regs)
    if shrunk:
        tile_reason = f"{row.reason}; shrunk to fit {Arch.SM90A.caps.smem_bytes_per_cta // 1024} KB of shared memory"
    plain = keeps_row and spec.score_mod is None and spec.softcap is None and o_staging == "own"
    chain = row.unmasked_chain if plain and not spec.return_lse else None  # (LSE: CHAIN_WITHOUT_LSE)
    split_everywhere = row.split_tail.every_length and _split_tail_applies(spec)
    if o_staging == "over_v" and (split_everywhere or spec.left_bound is not None):
        o_staging = "shared"  # (where O over V measured slower: the "shared" reason)
    fields = dict(
        arch=Arch.SM90A.value, kernel="HopperAttentionForward", tile_m=tile_m, tile_n=tile_n, kv_stages=stages,
        q_stages=q_stages, q_prefetch=False, num_consumer_warpgroups=warpgroups, producer_regs=producer_regs,
        q_per_warpgroup=q_stages == 1 and warpgroups == 2 and spec.left_bound is None,
        consumer_regs=consumer_regs, head_dim_padded=dqk, head_dim_v_padded=dv, p_in_registers=p_regs,
        skip_masked_tiles=spec.has_mask, intra_warpgroup_overlap=True,
        pingpong=row.pingpong and not _narrow_window(spec, tile_m, tile_n),
        turnless_edges=False, mask_runs=_mask_runs_apply(spec),
        interior_first_tile=_interior_first_tile_applies(spec) and max(dqk, dv) <= INTERIOR_FIRST_TILE_MAX_D,
        pinned_pv_wait=False, persistent=True,
        tile_order=tile_order, pair_tail_rounds=PAIR_TAIL_ROUNDS if tile_order == "paired" else 0,
        pair_tail_min_tiles=PAIR_TAIL_MIN_TILES if tile_order == "paired" else 0,
        l2_group_bytes=0, head_interleave=1, rotate_key_tiles=False, chain_query_tiles=chain is not None,
        split_tail=split_everywhere, split_tail_min_key_tiles=row.split_tail.min_key_tiles if split_everywhere else 0,
        o_staging=o_staging,
        exp2_poly_period=exp2_period, rescale_threshold=RESCALE_THRESHOLD_LOG2, stale_max=stale,
        smem_bytes=sm90_smem_bytes(tile_m, tile_n, stages, dqk, dv, 2, o_staging, q_stages, not p_regs),
    )
    why = {"tile_n": tile_reason, "kv_stages": tile_reason, "exp2_poly_period": exp2_reason,
           "tile_order": order_reason, "producer_regs": producer_reason,
           **({"chain_query_tiles": chain} if chain else {}),
           "num_consumer_warpgroups": f"{warpgroups} MMA warpgroups share each K/V tile: {warpgroup_reason}"}
    planned = Plan(**fields, reasons={**_sm90_reasons(spec, fields), **why})
    assert not plan_problem(planned), plan_problem(planned)
    return planned


def _narrow_window(spec: AttentionSpec, tile_m: int, tile_n: int) -> bool:
    """Whether a window bounded on both sides spans at most two key tiles per query tile."""
    if spec.left_bound is None or spec.right_bound is None:
        return False
    return spec.left_bound + spec.right_bound + tile_m <= 2 * tile_n


# the widest head dim whose kernels trace the first key tile a second time, without mask code
INTERIOR_FIRST_TILE_MAX_D = 192


def _interior_first_tile_applies(spec: AttentionSpec) -> bool:
    """Whether a query tile's first key tile can lie inside every row's bounds: not under a causal
    or right-window bound (it cuts the highest key tile of every query tile) nor an expression
    mask (its block list decides per tile)."""
    return spec.right_bound is None and spec.mask_kind != "expression"


def _mask_runs_apply(spec: AttentionSpec) -> bool:
    """Whether structural bounds order the key tiles into masked and interior runs: any mask but
    an expression (its block list has no such order, with or without bounds beside it)."""
    return spec.has_mask and spec.mask_kind != "expression"


def _sm90_reasons(spec: AttentionSpec, f: dict) -> dict[str, str]:
    """The reason for each sm_90a plan field that follows from the others."""
    return {**_sm90_tile_reasons(spec, f), **_sm90_overlap_reasons(spec, f), **_sm90_order_reasons(spec, f),
            **_sm90_memory_reasons(f)}


def _sm90_tile_reasons(spec: AttentionSpec, f: dict) -> dict[str, str]:
    caps = Arch.SM90A.caps
    regs_total = WARPGROUP_THREADS * (f["producer_regs"] + f["num_consumer_warpgroups"] * f["consumer_regs"])
    return {
        "arch": f"target {Arch.SM90A.value}: {caps.note}",
        "kernel": "warp-specialized Hopper forward: TMA producer warp, wgmma consumer warpgroups",
        "tile_m": f"{f['num_consumer_warpgroups']} consumer warpgroups x {WARPGROUP_MMA_M} rows each",
        "q_stages": "a second Q buffer fits: the next tile's Q loads while this one computes (no wait "
        "for Q between tiles)" if f["q_stages"] == 2 else
        "one Q buffer (no room for a second): the next tile's Q loads once this tile's main loop is done",
        "consumer_regs": f"{f['num_consumer_warpgroups']}x128 threads x {f['consumer_regs']} + 128 x "
        f"{f['producer_regs']} = {regs_total} <= {sm90_register_pool(f['num_consumer_warpgroups'])} registers "
        "(the CTA's pool at launch)",
        "head_dim_padded": f"wgmma K granule is {MMA_K_GRANULE}; TMA zero-fills the padding",
        "head_dim_v_padded": f"kept to a multiple of {MMA_K_GRANULE}; the store masks padded columns",
        "p_in_registers": "P converts in registers to the A operand of the P.V wgmma (no smem traffic)"
        if f["p_in_registers"] else "S and O fill the registers of 3 warpgroups: each warpgroup writes its P tile "
        "to shared memory (stmatrix) for the P.V wgmma",
        "skip_masked_tiles": "causal/window bounds give the key-tile range per query tile; "
        "tiles outside are neither loaded nor computed, and only boundary tiles run mask code"
        if spec.has_mask
        else "no structural mask: every key tile is used; only the ragged last tile is masked",
    }


def _sm90_overlap_reasons(spec: AttentionSpec, f: dict) -> dict[str, str]:
    return {
        "intra_warpgroup_overlap": "softmax of tile n runs while the tensor cores do P.V of tile n+1 "
        "(S lives beside the previous P and O: fits the register budget at every tile size in the table)",
        "pingpong": "consumer warpgroups take turns issuing MMAs (named barriers), so one's softmax "
        "overlaps another's MMAs" if f["pingpong"] else
        "off for a narrow window: a query tile sees at most two key tiles, too few MMAs to take turns over "
        "(measured on the H200 without ping-pong: 1.12x at d64 gqa8 causal window 128, S=4096 and 16384)"
        if _narrow_window(spec, f["tile_m"], f["tile_n"]) else
        "off for large d: the long P.V MMAs already cover the softmax (ping-pong at d192/d256 measured 0.98-1.01x "
        "per cell on the H200, 1.00x over 8 cells)",
        "turnless_edges": "a query tile's first Q.K^T and last P.V are issued outside the ping-pong turns "
        "(as flash-attn-4's Hopper path does): a warpgroup changes tile without waiting on the others"
        if f["turnless_edges"] else
        "every MMA issue takes a ping-pong turn (turnless first and last MMAs of a "
        "query tile, a tuning candidate, measured 0.97-1.03x per cell, 0.995x over 14 cells on the H200)"
        if f["pingpong"] else "no ping-pong: no turns to take",
        "mask_runs": "key tiles crossing a mask bound and interior ones run in separate loops, traced with and "
        "without the mask code: no key tile branches on a mask flag (measured on the H200 against one loop with a flag "
        "per tile: 1.04x over 12 causal and window cells, 1.10x at d128 causal S=8192)" if f["mask_runs"] else
        "one loop over the key tiles; a run-time flag per tile selects the mask code" if _mask_runs_apply(spec)
        else "no mask bounds that order the key tiles (none, or an expression's block mask): one loop",
        "interior_first_tile": "a query tile's first key tile, which may cross a bound (the ragged end of Sk), is "
        "traced twice and runs without mask code where it crosses none (Sk a multiple of tile_n): measured on the "
        "H200 1.07x at d64 S=512, 1.05x at 1024, 1.03x at d128 S=512, 1.02x at d96 S=1024"
        if f["interior_first_tile"] else
        "d > 192: the first key tile's second form moves ptxas's Q.K^T descriptors out of uniform registers (344 "
        "R2UR against 36 in the d256 kernel) and measured 0.92x at d256 S=512 on the H200: it always runs the mask"
        if _interior_first_tile_applies(spec) else
        "a causal or right-window bound cuts every query tile's first key tile (or an expression's block mask "
        "decides): it always runs the mask",
        "pinned_pv_wait": "the K stage is released after the softmax, with a barrier index that depends on the row "
        "sums, so ptxas keeps the P.V wait behind the whole softmax" if f["pinned_pv_wait"] else
        "the K stage is released as soon as S is computed, and ptxas puts the P.V wait after 11-26 of the 66 "
        "exponentials of a 128-key tile; pinning the wait behind the softmax (a tuning candidate) measured 0.99x over "
        "22 cells on the H200 (0.93-0.97x at d64 causal): ping-pong already fills that wait",
    }


def _sm90_order_reasons(spec: AttentionSpec, f: dict) -> dict[str, str]:
    return {
        "l2_group_bytes": f"the heads of the heaviest-first order go in groups whose K/V fits {f['l2_group_bytes']} "
        "bytes of L2, so the CTAs running together read the same K/V tiles (FlashAttention-3's longest-first order)"
        if f["l2_group_bytes"] else "one group of all heads (L2-sized head groups, a tuning candidate, measured "
        "0.88-1.03x of the causal pairs on the H200 persistent, about even one-shot)",
        "head_interleave": f"the head-major order interleaves the query tiles of {f['head_interleave']} heads, so "
        "the CTAs running together read that many K/V streams, fewer CTAs on each tile at a time"
        if f["head_interleave"] > 1 else "the head-major order finishes one head's query tiles before the next "
        "head's (2 heads interleaved, a tuning candidate, measured 0.95-1.04x per cell, 0.998x over 15 non-causal "
        "cells at S=2048-16384 on the H200)" if f["tile_order"] == "head_major"
        else "not the head-major order: nothing to interleave",
        "pair_tail_rounds": f"causal pairs come in whole rounds, one per CTA, so the last one is ragged (d64 "
        f"causal S=16384 on 132 SMs: 10.4 rounds in 11); where a head has at least {f['pair_tail_min_tiles']} query "
        f"tiles, the pairs of the last {f['pair_tail_rounds']} rounds and the middle tiles run as single tiles "
        "heaviest first, which evens the CTAs out to within a few key tiles (simulated on the grid's causal "
        "cells: 0.99 of an even split, 0.93-0.98 in whole rounds). Against whole rounds on the H200: d64 causal "
        "S=8192 1.06x, S=16384 1.04x, d128 S=16384 1.02x, d192 1.02-1.03x, d256 S=4096-16384 1.01-1.02x; with "
        "4-8 query tiles (S <= 1024) 0.92x at d256 and 0.96-0.98x at d128, hence the minimum"
        if f["pair_tail_rounds"] else "whole rounds of causal pairs to the end" if f["tile_order"] == "paired"
        else "not the paired order: no pairs",
        "pair_tail_min_tiles": "see pair_tail_rounds" if f["pair_tail_rounds"] else "no tail",
        "rotate_key_tiles": "query tile m visits its key tiles from m below the top and around, so the CTAs "
        "of one head read different K/V tiles at a time" if f["rotate_key_tiles"] else "key tiles from the "
        "highest down: the CTAs of one head read the same K/V tile at about the same time, from L2 (the "
        "rotated order, a tuning candidate, measured 0.87-1.02x on the H200)",
        "chain_query_tiles": "each query tile's last P.V goes with the next tile's first Q.K^T (a tuning candidate)"
        if f["chain_query_tiles"] else "each query tile ends with its own last P.V and epilogue; chaining them "
        "into the next tile's first step (fa4gen.kernels.sm90_chain, a tuning candidate where "
        f"{CHAIN_NEEDS}) measured 0.93-1.00x except at d128 without a mask{CHAIN_WITHOUT_LSE}",
        "split_tail": _split_tail_reason(_sm90_row(spec)) if f["split_tail"] else
        _sm90_row(spec).split_tail.elsewhere() if _split_tail_applies(spec) else
        f"not {SPLIT_NEEDS}: whole tiles to the end",
        "split_tail_min_key_tiles": "see split_tail" if f["split_tail"] else "no split tail",
    }


def _sm90_memory_reasons(f: dict) -> dict[str, str]:
    caps = Arch.SM90A.caps
    return {
        "persistent": "one CTA per SM loops over tiles, so the producer loads the next tile while "
        "consumers finish this one (one CTA per tile measured 0.92-0.99x at S=2048, even at S>=4096 causal)",
        "o_staging": {
            "own": "O has its own staging buffer: Q is freed after the main loop, so the next tile's Q loads "
                   "during this tile's epilogue",
            "over_p": "no room for an O buffer: O is staged over the warpgroup's P tile, free once the last P.V "
                      "has read it (Q is still freed after the main loop; the next tile's first P waits for the "
                      "store to have read the tile)",
            "over_q": "no room for an O buffer: O is staged over each warpgroup's own Q rows (the next tile's Q "
                      "loads after this tile's epilogue)",
            "over_v": "room for one warpgroup's O, not two: warpgroup 0 stages O there, warpgroup 1 over the V "
                      "stage of the tile's last key tile, which it frees once its store has read it (and once "
                      "warpgroup 0's last P.V has: a barrier per tile parity), so neither waits for the other's "
                      "store, and Q is freed before the last P.V. Against the buffer taken in turn on the H200 "
                      "(both orders, 2026-12-02-s23c): d256 1.007-1.020x at S=512-8192, causal 1.014-1.034x "
                      "(1.00x at 16384); d192 causal 1.013-1.027x",
            "shared": "room for one warpgroup's O, not two: the warpgroups stage O there in turn (each store has "
                      "read it before the next warpgroup writes), so Q is freed before the last P.V and the next "
                      "tile's Q loads during it and the epilogue. Against O over Q on the H200 (order-balanced "
                      "A/Bs, 2026-12-01-s15b): d192 1.02-1.05x at S=512-4096, 1.01x at 16384; d256 1.05-1.10x "
                      "at S=512-1024; Gemma 2's d256 window 1.04x. O stored from registers instead (32-bit stores, "
                      "no buffer) measured 0.87-0.96x on the geometric means of d64-d256 cells (-s15a). Warpgroup "
                      "1's O over the last V stage (over_v) measured 0.974-1.002x at d192 without a mask, whose "
                      "tail is split at every length, and 0.979x with Gemma 2's d256 window (2026-12-02-s23c): "
                      "those keep the buffer taken in turn",
        }[f["o_staging"]],
        "rescale_threshold": f"O is rescaled only when a row max grows by more than 2^{RESCALE_THRESHOLD_LOG2:g}: "
        "most tiles skip the multiply of the O accumulator (FlashAttention-4; rescaling every tile, as "
        "flash-attn-4's Hopper path does, is a tuning candidate: 0.96-1.02x on the H200, measured before P's "
        "conversions were pinned above the skip's branch; with them, 0.91-1.01x at every head dim but d64, -zw)",
        "q_per_warpgroup": Q_PER_WARPGROUP_REASON if f["q_per_warpgroup"] else "one full and one empty barrier "
        f"per Q buffer, which all warpgroups share (barriers per warpgroup's rows: {Q_PER_WARPGROUP_REASON})",
        "q_prefetch": Q_PREFETCH_REASON if f["q_prefetch"] else f"the next tile's Q loads from HBM (prefetching "
        f"it into L2 first: {Q_PREFETCH_REASON})",
        "stale_max": STALE_MAX_REASON if f["stale_max"] else f"every key tile finds its row max before its "
        f"exponentials (a stale max: {STALE_MAX_REASON})",
        "smem_bytes": f"{f['q_stages']} x Q {'+ O ' if f['o_staging'] == 'own' else ''}"
        f"{'' if f['p_in_registers'] else '+ P '}+ {f['kv_stages']} x (K + V) tiles + barriers, of "
        f"{caps.smem_bytes_per_cta} available",
    }


class SeqlenSplit(BaseModel):
    """Another plan for launches whose longest query sequence has between ``min_seqlen_q`` and
    ``max_seqlen_q`` rows (None: no upper limit); ``fa4gen.compile`` picks per call."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    label: str  # names the range in CLI output and golden files (e.g. short)
    min_seqlen_q: int = 1
    max_seqlen_q: int | None = None
    plan: Plan
    reason: str

    def covers(self, seqlen_q: int) -> bool:
        return self.min_seqlen_q <= seqlen_q and (self.max_seqlen_q is None or seqlen_q <= self.max_seqlen_q)

    def rows(self) -> str:
        if self.max_seqlen_q is None:
            return f"at least {self.min_seqlen_q} query rows"
        return f"at most {self.max_seqlen_q} query rows" if self.min_seqlen_q <= 1 else \
            f"{self.min_seqlen_q} to {self.max_seqlen_q} query rows"

    def describe(self) -> str:
        return f"{self.label} sequences ({self.rows()}) run this plan instead: {self.reason}\n{self.plan.describe()}"


def _split_tail_applies(spec: AttentionSpec) -> bool:
    """Whether the spec's plans may split their tail (Plan.split_tail): no mask, so the tiles
    go head-major and all visit the same key tiles."""
    return not spec.has_mask and _tile_order(spec)[0] == "head_major"


def _split_tail_reason(row: TileRow) -> str:
    return f"{SPLIT_TAIL_HOW}. {row.split_tail.reason}"


def _with_split_tail(p: Plan, row: TileRow) -> Plan:
    return p.model_copy(update={
        "split_tail": True, "split_tail_min_key_tiles": row.split_tail.min_key_tiles,
        "reasons": {**p.reasons, "split_tail": _split_tail_reason(row), "split_tail_min_key_tiles": "see split_tail"}})


def _splits_sm90(spec: AttentionSpec) -> tuple[SeqlenSplit, ...]:
    base = _plan_sm90(spec)
    splits = []
    row = _sm90_row(spec)
    short, long = next((s for s in row.short if s.takes_spec(spec)), None), row.long
    if short is not None:
        short_plan = _plan_sm90(spec, short.row)
        if _schedule(short_plan) != _schedule(base):  # the variant may already choose the same schedule
            splits.append(SeqlenSplit(label="short", max_seqlen_q=short.max_seqlen_q, plan=short_plan,
                                      reason=short.row.reason))
    long_split = None
    if long is not None and not _register_pressure(spec):
        long_plan = _plan_sm90(spec, long.row)
        # only where the variant keeps the row's warpgroups (the measured shape), and not the base's
        if long_plan.num_consumer_warpgroups == long.row.consumer_warpgroups and \
                _schedule(long_plan) != _schedule(base):
            long_split = SeqlenSplit(label="long", min_seqlen_q=long.min_seqlen_q, plan=long_plan,
                                     reason=long.row.reason)
    if _split_tail_applies(spec) and not row.split_tail.every_length:  # long launches split their tail
        start = row.split_tail.min_seqlen_q  # (from the long row's start, if any)
        assert long_split is None or long_split.min_seqlen_q == start, "a long row must start where the split tail does"
        why = row.split_tail.long_reason()
        long_split = SeqlenSplit(
            label="long", min_seqlen_q=start, plan=_with_split_tail(base if long_split is None else long_split.plan, row),
            reason=why if long_split is None else f"{long_split.reason}; {why}")
    if long_split is not None:
        splits.append(long_split)
    return tuple(splits)


_PLANNERS = {Arch.SM90A: _plan_sm90}
_SPLIT_PLANNERS = {Arch.SM90A: _splits_sm90}


def plan(spec: AttentionSpec, arch: Arch | str = Arch.SM90A) -> Plan:
    """Lower a spec to the schedule its kernel runs on ``arch`` (for the lengths that no
    ``seqlen_splits`` entry covers)."""
    target = require_supported(arch)
    return _PLANNERS[target](spec)


def seqlen_splits(spec: AttentionSpec, arch: Arch | str = Arch.SM90A) -> tuple[SeqlenSplit, ...]:
    """The plans that launches with query sequences in a given range run instead of
    ``plan(spec, arch)`` (``fa4gen.compile`` picks per call; the ranges do not overlap)."""
    target = require_supported(arch)
    return _SPLIT_PLANNERS[target](spec)


def plan_for_seqlen(spec: AttentionSpec, arch: Arch | str, seqlen_q: int) -> Plan:
    """The plan a launch whose longest query sequence has ``seqlen_q`` rows runs."""
    return next((s.plan for s in seqlen_splits(spec, arch) if s.covers(seqlen_q)), plan(spec, arch))


# ----------------------------------------------------------------------------- tuning candidates
TUNE_TILE_N_STEPS = (-32, -16, 16, 32)  # key-tile sizes tried around the table's choice
TUNE_EXP2_POLY_PERIODS = (0, 2, 3, 4, 8)  # share of exponentials on the FMA units: none, 1/2 ... 1/8
REGISTER_HEADROOM = 32  # per-thread registers kept for addresses, softmax state and the pipeline


def split_partial_words(head_dim_v_padded: int) -> int:
    """fp32 words per thread of one split-tail partial (fa4gen.kernels.sm90_split): its O
    fragment (64 x dv / 128 words) and its 2 rows' maxima and sums."""
    return WARPGROUP_MMA_M * head_dim_v_padded // WARPGROUP_THREADS + 4


def split_workspace_shape(p: Plan, num_ctas: int) -> tuple[int, int, int, int] | None:
    """The split tail's fp32 workspace: per CTA and consumer warpgroup, each thread's partial
    (split_partial_words), thread fastest; its int32 flags are the first two modes. None
    without a split tail."""
    if not p.split_tail:
        return None
    return num_ctas, p.num_consumer_warpgroups, split_partial_words(p.head_dim_v_padded), WARPGROUP_THREADS


def plan_smem_bytes(p: Plan) -> int:
    """The shared memory a plan's buffers take."""
    return sm90_smem_bytes(p.tile_m, p.tile_n, p.kv_stages, p.head_dim_padded, p.head_dim_v_padded, 2,
                           p.o_staging, p.q_stages, not p.p_in_registers)


OVER_V_NEEDS = "the overlapped schedule on 2 consumer warpgroups, unchained"
CHAIN_NEEDS = "the overlapped schedule runs on 2 consumer warpgroups with O in its own buffer"
SPLIT_NEEDS = "a persistent head-major launch without a mask or rotated key tiles"
NO_SPLIT_TAIL = {"split_tail": False, "split_tail_min_key_tiles": 0}  # plan fields of whole tiles only


def plan_problem(p: Plan) -> str:
    """Why the GPU cannot run ``p`` at all ("" when it can): shared memory over the limit, a
    register split over the CTA's pool (setmaxnreg.inc would wait forever), or chained query
    tiles or a split tail without what they need (the kernel's constructor refuses them)."""
    if p.chain_query_tiles and not (p.intra_warpgroup_overlap and p.num_consumer_warpgroups == 2
                                    and p.o_staging == "own"):
        return f"chain_query_tiles needs {CHAIN_NEEDS}"
    if p.o_staging == "over_v" and not (p.intra_warpgroup_overlap and p.num_consumer_warpgroups == 2
                                        and not p.chain_query_tiles):
        return f"o_staging over_v needs {OVER_V_NEEDS}"
    if p.q_per_warpgroup and p.num_consumer_warpgroups < 2:
        return "q_per_warpgroup needs 2 or more consumer warpgroups (one warpgroup has the buffer's barriers)"
    if p.stale_max and not (p.intra_warpgroup_overlap and p.rescale_threshold > 0):
        return "stale_max needs the overlapped schedule and a rescale threshold"
    if p.split_tail and not (p.persistent and p.tile_order == "head_major" and not p.skip_masked_tiles
                             and not p.rotate_key_tiles):
        return f"split_tail needs {SPLIT_NEEDS}"
    limit = Arch.SM90A.caps.smem_bytes_per_cta
    if plan_smem_bytes(p) > limit:
        return f"its buffers take {plan_smem_bytes(p)} bytes of shared memory, over the {limit} available"
    registers = WARPGROUP_THREADS * (p.producer_regs + p.num_consumer_warpgroups * p.consumer_regs)
    pool = sm90_register_pool(p.num_consumer_warpgroups)
    if registers > pool:
        return (f"producer_regs {p.producer_regs} + {p.num_consumer_warpgroups} x consumer_regs {p.consumer_regs} "
                f"take {registers} registers, over the CTA's pool of {pool}")
    return ""


def sm90_fits(p: Plan) -> bool:
    """Shared memory, the register split and a register estimate (S fp32 + P 16-bit + O fp32 per
    thread) fit."""
    fragments = p.tile_n // 2 + (p.tile_n // 4 if p.p_in_registers else 0) + p.head_dim_v_padded // 2
    o_ok = o_staging_fits(p.o_staging, p.tile_n, p.head_dim_padded, p.head_dim_v_padded, p.q_stages,
                          not p.p_in_registers, p.num_consumer_warpgroups)
    return (not plan_problem(p) and fragments + REGISTER_HEADROOM <= p.consumer_regs
            and o_ok and 32 <= p.tile_n <= 256 and p.tile_n % MMA_K_GRANULE == 0)


def sm90_variant(base: Plan, why: str, **update) -> Plan:
    changed = base.model_copy(update=update)
    smem = plan_smem_bytes(changed)
    reasons = {**base.reasons, **{field: f"tuning candidate: {why}" for field in update}}
    return changed.model_copy(update={"smem_bytes": smem, "reasons": reasons})


def _schedule(p: Plan) -> dict:
    """What a plan makes the kernel do (reasons and the derived smem figure aside)."""
    return p.model_dump(exclude={"reasons", "smem_bytes"})


def candidates(spec: AttentionSpec, arch: Arch | str = Arch.SM90A) -> list[Plan]:
    """The planner's plan first, then single-step variations of it that fit the hardware:
    what ``fa4gen tune`` times on a GPU to pick a plan by measurement."""
    base = plan(spec, arch)
    found = [base]
    flips = [
        ("ping-pong flipped", {"pingpong": not base.pingpong, "turnless_edges": False})
        if base.intra_warpgroup_overlap else None,
        ("tile edges' turns flipped", {"turnless_edges": not base.turnless_edges}) if base.pingpong else None,
        ("mask runs flipped", {"mask_runs": not base.mask_runs}) if _mask_runs_apply(spec) else None,
        ("interior first tile flipped", {"interior_first_tile": not base.interior_first_tile})
        if _interior_first_tile_applies(spec) else None,
        ("P.V wait pin flipped", {"pinned_pv_wait": not base.pinned_pv_wait}) if base.intra_warpgroup_overlap else None,
        ("serial schedule", {"intra_warpgroup_overlap": False, "pingpong": False, "turnless_edges": False}),
        ("persistence flipped", {"persistent": not base.persistent, **NO_PAIR_TAIL, **NO_SPLIT_TAIL}),
        ("split tail flipped", NO_SPLIT_TAIL if base.split_tail else
         {"split_tail": True, "split_tail_min_key_tiles": _sm90_row(spec).split_tail.min_key_tiles})
        if base.tile_order == "head_major" and not spec.has_mask else None,
        ("causal pairs in whole rounds to the end", NO_PAIR_TAIL)
        if base.pair_tail_rounds else None,
        (f"{3 - base.q_stages} Q buffers", {"q_stages": 3 - base.q_stages}),
        ("causal tiles heaviest first", {"tile_order": "heavy_first", **NO_PAIR_TAIL})
        if base.tile_order == "paired" else None,
        ("heaviest first in L2-sized head groups", {"tile_order": "heavy_first", **NO_PAIR_TAIL,
                                                    "l2_group_bytes": Arch.SM90A.caps.l2_bytes})
        if base.tile_order != "head_major" else None,
        ("key tiles rotated per query tile", {"rotate_key_tiles": True, **NO_SPLIT_TAIL})
        if not spec.has_mask else None,
        ("query tiles chained" if not base.chain_query_tiles else "query tiles unchained",
         {"chain_query_tiles": not base.chain_query_tiles}),
        ("query tiles of 2 heads interleaved", {"head_interleave": 2}) if base.tile_order == "head_major" else None,
        ("documents' query tiles in ranked pairs", {"tile_order": "paired", "pair_tail_rounds": PAIR_TAIL_ROUNDS,
                                                    "pair_tail_min_tiles": PAIR_TAIL_MIN_TILES})
        if spec.is_varlen and base.tile_order == "heavy_first" else None,
    ]
    for period in TUNE_EXP2_POLY_PERIODS:
        flips.append((f"1 in {period} exp2 by polynomial" if period else "every exp2 on MUFU",
                      {"exp2_poly_period": period}))
    flips.append(("O rescaled every tile", {"rescale_threshold": 0.0, "stale_max": False}) if base.rescale_threshold
                 else (f"O rescaled past a threshold of 2^{RESCALE_THRESHOLD_LOG2:g}",
                       {"rescale_threshold": RESCALE_THRESHOLD_LOG2}))
    if base.num_consumer_warpgroups > 1:
        flips.append(("Q barriers per buffer", {"q_per_warpgroup": False}) if base.q_per_warpgroup else
                     ("Q barriers per warpgroup", {"q_per_warpgroup": True}))
    flips.append(("next Q not prefetched", {"q_prefetch": False}) if base.q_prefetch else
                 ("next Q prefetched into L2", {"q_prefetch": True}))
    flips.append(("every key tile's row max found", {"stale_max": False}) if base.stale_max else
                 ("key tiles against the running max", {"stale_max": True, "rescale_threshold": RESCALE_THRESHOLD_LOG2}))
    for stages in (base.kv_stages - 1, base.kv_stages + 1):
        if stages >= 2:  # (one stage would leave the producer nothing to load ahead)
            flips.append((f"{stages} K/V stages", {"kv_stages": stages}))
    for step in TUNE_TILE_N_STEPS:
        flips.append((f"tile_n {base.tile_n + step}", {"tile_n": base.tile_n + step}))
    other = 2 if base.num_consumer_warpgroups == 3 else 3  # 2 <-> 3, 4 -> 3 consumer warpgroups
    producer_regs, consumer_regs = SM90_REGISTER_SPLIT[other]
    # as in the planner: P leaves the registers only for the 160 of 3 warpgroups
    flips.append((f"{other} consumer warpgroups", {"num_consumer_warpgroups": other, "tile_m": 64 * other,
                                                    "producer_regs": producer_regs,
                                                    "consumer_regs": consumer_regs,
                                                    "p_in_registers": base.p_in_registers or other == 2}))
    for why, update in filter(None, flips):
        variant = sm90_refit(sm90_variant(base, why, **update), why)
        if sm90_fits(variant) and all(_schedule(variant) != _schedule(p) for p in found):
            found.append(variant)
    return found


def sm90_refit(p: Plan, why: str) -> Plan:
    """A candidate whose buffers overflow shared memory (or whose O staging no longer fits it,
    e.g. over P once P stays in registers) gives up the second Q buffer, then stages O in the
    first place of O_STAGING that fits, as the planner's own fit does."""
    updates = [{}, {"q_stages": 1}] + [{"q_stages": 1, "o_staging": o} for o in O_STAGING]
    for update in updates:
        refit = sm90_variant(p, f"{why}, to fit shared memory", **update) if update else p
        if sm90_fits(refit):
            return refit
    return p
