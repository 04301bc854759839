"""The sm_90a planner tables: one tile row per head-dim bucket (with the rows some launch lengths
or variants take instead) and the measured constants of the schedule, each with the reason behind
it. ``fa4gen.planner`` reads them; nothing here computes a plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fa4gen.spec import AttentionSpec


@dataclass(frozen=True)
class SplitTail:
    """Where a row's launches split their ragged last round (Plan.split_tail): from
    ``min_seqlen_q`` query rows, a length range of its own (the split's code slows the launches it
    splits nothing in), and there only where the query tiles visit at least ``min_key_tiles`` key
    tiles; ``reason`` says what was measured. ``min_seqlen_q`` 1: every launch, in the row's own
    plan (no length range: where the code measured no slower, one kernel fewer)."""

    min_seqlen_q: int
    min_key_tiles: int
    reason: str

    @property
    def every_length(self) -> bool:
        """Whether every launch splits, in the row's own plan (no length range of its own)."""
        return self.min_seqlen_q <= 1

    def long_reason(self) -> str:
        return f"from {self.min_seqlen_q} query rows the ragged last round of tiles is split between CTAs (split_tail)"

    def elsewhere(self) -> str:
        """Why a plan of the shorter launches keeps whole tiles."""
        return (f"launches of at least {self.min_seqlen_q} query rows run this plan with a split tail (the long "
                "length range), shorter ones whole tiles: kernels that carry the split tail's code measured "
                "0.93-0.99x at S <= 2048 where they split nothing (H200 grid 2026-12-01-s14d against -s13d), and "
                "still 0.98x at d128 S=512-2048, 0.98-0.99x at d256, 0.98x at d96 S=1024 and d64 S=512 once whole "
                "tiles no longer weighed O in a merge (both orders, 2026-12-02-s18a/b), so short launches run a "
                "kernel without it")


# persistent head-major launches: T query tiles on G CTAs take ceil(T / G) rounds where T / G would
# do (2048 tiles on 132 SMs: 16 rounds for 15.5, the d128 and GQA cells of the grid)
SPLIT_TAIL_HOW = (
    "the last full round and the ragged one run as equal runs of key tiles, one per CTA, and a tile cut between "
    "two CTAs is merged by the one that runs its first key tiles (fa4gen.kernels.sm90_split): 2048 query tiles "
    "on 132 SMs take 15.5 tile-times instead of 16")
SPLIT_TAIL = SplitTail(4096, 32, (
    "Only where query tiles visit at least 32 key tiles: against whole tiles on the H200 (geometric mean of both "
    "orders, 2026-12-01-s14a) 1.015-1.031x at d128 S=4096-16384, 1.037x at d64 S=4096, 1.009x at 16384, "
    "1.010-1.023x at d96, 1.010x at GQA 4, 0.989x at d192; with 4-16 key tiles (-s17a) d128 0.90x at S=512, "
    "0.96x at 1024, 0.99x at 2048, d256 0.91x, 0.96x and 0.99x, d96 S=2048 1.015x (not worth a fourth "
    "kernel per spec: its 144-key row starts at 4096): shorter runs pay more for their extra prologues "
    "and epilogues (and, at d128, the chained tiles' broken chain) than the ragged round costs; with the "
    "merge outside O's registers (-s18a) d128 0.94x, 0.97x and 1.01x, d256 S=1024-2048 0.95x and 0.99x"))
SPLIT_TAIL_FROM_2048 = SplitTail(2048, 16, (
    "From 2048 query rows and 16 key tiles (d64's 128-key tiles): against whole tiles on the H200 (geometric "
    "mean of both orders, 2026-12-01-s17a) 1.020x at S=2048, 1.037x at S=4096 (-s14a); the 256-row short tiles "
    "0.94x and 0.99x at S=512-1024"))

SPLIT_TAIL_EVERY_LENGTH = SplitTail(1, 16, (
    "At every length, from 16 key tiles (128-key tiles at d192, dv 128): the split's code in the kernel of "
    "shorter launches, where it splits nothing, measured 1.006x at S=512 and 1.025x at S=1024 against the "
    "kernel without it (geometric means of both orders on the H200, 2026-12-02-s18b; 1.024x at S=1024 in "
    "-s18a), so one kernel serves every length; split, 1.028x at S=2048 (-s17a)"))


@dataclass(frozen=True)
class TileRow:
    max_head_dim: int  # applies when max(head_dim, head_dim_v) (padded) is at most this
    consumer_warpgroups: int
    tile_n: int
    kv_stages: int
    pingpong: bool
    exp2_poly_period: int
    reason: str
    p_in_registers: bool = True  # False: P goes through shared memory (S + O fill the registers)
    # specs without a mask or score modifier that keep the row's warpgroups and O's own buffer
    # chain their query tiles (Plan.chain_query_tiles), for this measured reason; None: they do not
    unmasked_chain: str | None = None
    # launches whose longest query sequence is short (or long) run another row, chosen per
    # call (all compile together: a tile is a compile-time shape); of the short rows, the first
    # that takes the spec
    short: tuple[ShortRow, ...] = ()
    long: LongRow | None = None
    # specs without a mask split their launches' ragged last round from here on (a long row
    # starts where it does)
    split_tail: SplitTail = SPLIT_TAIL


@dataclass(frozen=True)
class ShortRow:
    max_seqlen_q: int  # launches with at most this many query rows run ``row``
    row: TileRow
    # which specs take it: "any"; "causal": those with the causal bound (right_bound 0); "plain":
    # no mask but the causal bound, no score modifier, softcap or sinks (the shapes it was measured on)
    takes: Literal["any", "causal", "plain"] = "any"

    def takes_spec(self, spec: AttentionSpec) -> bool:
        if self.takes == "causal":
            return spec.right_bound == 0
        if self.takes == "plain":
            return (spec.right_bound in (None, 0) and spec.left_bound is None and spec.mask_kind is None
                    and spec.score_mod is None and spec.softcap is None and not spec.sinks)
        return True


@dataclass(frozen=True)
class LongRow:
    min_seqlen_q: int  # launches with at least this many query rows run ``row``
    row: TileRow


SM90_D64_SHORT = TileRow(64, 2, 128, 2, True, 0, "d64 causal, at most 1024 query rows: 128-row tiles on 2 "
                         "warpgroups measured 3-12% faster than the 192-row tiles (H200 grids: 245 vs 238 TFLOP/s "
                         "at S=512, 312 vs 278 at S=1024), whose diagonal tiles idle more rows; non-causal d64 "
                         "measured 8-10% slower on them")
SM90_D64_SHORT_4WG = TileRow(
    64, 4, 64, 4, True, 0, "d64, at most 1024 query rows, no mask but the causal one: 4 consumer warpgroups "
    "(256-row tiles) on 64-key tiles, 4 K/V stages. A d64 warpgroup's own chain (Q.K^T, softmax, P.V) sets the "
    "pace, not the tensor cores or MUFU: a 192-row tile whose last rows lie past Sq, passed by, took as long as "
    "a whole one (-s16a), so a fourth warpgroup adds throughput; S, P and O fit 112 registers at 64 keys. "
    "Against the 192-row (non-causal) and 128-row (causal) tiles, geometric means of both orders on the H200 "
    "(2026-12-01-s16c): 1.035x at S=512, 1.015x at 1024, causal 1.088x at 512 and 1.105x at 1024 (3 stages "
    "1.018-1.092x, 6 stages 1.025-1.106x); from S=2048 on 0.89-0.93x (-s16b): shorter key tiles double the "
    "per-tile steps")
SM90_D96_SHORT = TileRow(96, 2, 128, 2, True, 0, "d96, at most 1024 query rows: 128-row tiles on 2 warpgroups with "
                         "P in registers measured 13-19% faster than the 192-row tiles (H200 grids: 470 vs 406 "
                         "TFLOP/s at S=512, causal 370 vs 310 at S=1024), whose last tile leaves up to a third of "
                         "its rows idle; from S=2048 on the 192-row tiles win")

SM90_D96_LONG = TileRow(96, 3, 144, 2, True, 0, "d96, at least 4096 query rows: 144-key tiles (flash-attn-4's), "
                        "with O staged over P, measured 1.01-1.03x the 128-key ones (order-balanced A/Bs on the "
                        "H200 at S=8192 and 16384, causal and not; at S=2048 0.96-0.97x, whose last key tile is "
                        "78% padding; 160-key tiles measured 0.98-1.01x, -s13b)", p_in_registers=False)

# sm_90a forward. Shared memory holds Q (tile_m x d) plus kv_stages x (K tile + V tile);
# registers hold S (64 x tile_n), P and O (64 x dv) per consumer warpgroup.
SM90_FWD_TILES: tuple[TileRow, ...] = (
    TileRow(64, 3, 128, 2, True, 0, "small d: 3 consumer warpgroups (tile_m 192) keep the tensor cores fed "
            "between softmaxes; S, P, O fit 160 registers",
            short=(ShortRow(1024, SM90_D64_SHORT_4WG, takes="plain"), ShortRow(1024, SM90_D64_SHORT, takes="causal")),
            split_tail=SPLIT_TAIL_FROM_2048),
    TileRow(96, 3, 128, 2, True, 0, "d96: 3 consumer warpgroups (tile_m 192) keep the tensor cores fed; S and O "
            "take 112 of 160 registers, so P goes through shared memory (launches of 4096 query rows or more "
            "run 144-key tiles)", p_in_registers=False,
            short=(ShortRow(1024, SM90_D96_SHORT),), long=LongRow(4096, SM90_D96_LONG)),
    TileRow(128, 2, 128, 2, True, 0, "d128: 128x128 tiles, 2 stages fill 160 KB; S, P and O fit 240 registers "
            "(160-, 176- and 192-key tiles, which leave no room for a second Q buffer, measured 0.90-0.96x at "
            "S=2048-4096, 0.97-0.98x at 8192 and 0.995-1.007x at 16384 on the H200, 2026-12-01-s13a)",
            unmasked_chain="d128 without a mask: each query tile's last P.V is issued with the next tile's first "
            "Q.K^T and its epilogue runs during that tile's first softmax (fa4gen.kernels.sm90_chain): geometric "
            "means of 6 order-alternating A/Bs per cell on the H200, 1.020x at S=1024, 1.003-1.007x at S=2048-16384 "
            "and GQA 4, 0.995x at S=512 (2026-12-01-s13c); causal d128 measured 0.98-1.00x, d96 and causal d64 on "
            "128-row tiles 0.93-0.96x, and they keep it off. The producer sends the next tile's Q one key tile "
            "into this one (q_ahead; Nsight Compute put 2.6% of the S=1024 kernel's stall samples on the consumers' "
            "Q wait): 1.026x at S=512, 1.020x at 1024, 1.007x at 2048, 1.016-1.018x at GQA 4 and 8 S=1024, "
            "0.99-1.00x from 4096; unchained kernels 0.96-1.01x (both orders, 2026-12-02-s19a)"),
    TileRow(192, 2, 128, 2, False, 0, "d<=192 (dv 128): Q + 2 stages of 128-key tiles = 208 KB of 227, which "
            "leaves room for one warpgroup's O", split_tail=SPLIT_TAIL_EVERY_LENGTH),
    TileRow(256, 2, 64, 2, False, 0, "d256: O takes 128 registers, so S shrinks to 64 keys; Q + 2 stages = 192 KB, "
            "which leaves room for one warpgroup's O (o_staging shared). Against 80-key tiles with O over Q "
            "(224 KB, no room) on the H200, order-balanced A/Bs (2026-12-01-s15b/c): 1.04-1.10x at S=512-1024, "
            "1.04-1.06x at S=2048-4096, 1.005-1.016x at S=8192-16384, causal and not"),
)

# Exponentials per matmul FLOP fall as 1/d: MUFU (16 ex2 per clock per SM) keeps up with the
# tensor cores (4096 FLOPs per clock) only at d >= 128, and tanh (softcap) doubles its load, so
# FlashAttention-4 moves part of the exponentials to a polynomial on the FMA units. Measured on
# the H200 (BENCHMARKS.md), every share tried made this kernel slower: d64 6-18% at 1 in 4, d96
# 0-6% at 1 in 8, softcap 3-5% at 1 in 2 (the softmax's FMA/ALU work, not MUFU, is the limit
# here). The table keeps every exp2 on MUFU; `fa4gen tune` still tries 1 in 2..8.
EXP2_POLY_PERIOD_SOFTCAP = 0
# Causal pairs come in whole rounds of one per CTA, so P pairs on G CTAs take ceil(P / G)
# pair-times; the last PAIR_TAIL_ROUNDS rounds of them go as single tiles, heaviest first
# (fa4gen.kernels.scheduler; 2 rounds of singles leave room to even out the heaviest ones)
PAIR_TAIL_ROUNDS = 2
PAIR_TAIL_MIN_TILES = 20  # query tiles per head from which pairs end in a tail (see the reason)
NO_PAIR_TAIL = {"pair_tail_rounds": 0, "pair_tail_min_tiles": 0}  # plan fields of a schedule without the tail
RESCALE_THRESHOLD_LOG2 = 8.0  # probabilities stay below 2^8: exact in fp32, fine in bf16/fp16 P
# Key tiles without mask code exponentiate against the rows' running max and find the tile's
# max only where a row sum shows a probability past the threshold (Plan.stale_max): up to these
# head dims, and not with the mask kinds it measured slower on
STALE_MAX_MAX_D = 128
STALE_MAX_SKIPS_MASKS = ("document", "expression")
STALE_MAX_REASON = (
    "key tiles without mask code exponentiate against each row's running max and check the row sums for a "
    "probability past 2^8 (only then is the tile's max found: fa4gen.kernels.softmax.settle), which drops about "
    "80 of the 420 instructions per thread of a d64 128-key step. Against the tile's max found every step, both orders "
    "on the H200 (2026-12-02-s22a): d64 1.036-1.105x, causal 1.013-1.056x (0.997x at S=512); d96 1.040-1.072x; d128 "
    "1.005-1.099x, "
    "GQA 1.048-1.110x, causal 1.005-1.034x; ALiBi 1.122x, softcap 1.107x; d192 causal 0.955-0.973x from S=4096, "
    "d256 0.972-1.013x (spills at d256 causal), documents 0.982x and an expression mask 0.988x, which keep "
    "the max every step")

# (producer, consumer) registers per thread by consumer warpgroups: 128 x (p + W x c) fits the
# CTA's register pool (sm90_register_pool; 4 warpgroups: 640 threads launch at 96 registers, a
# pool of 61440, and 112 hold d64's S, P and O at 64 keys with no spill in SASS)
SM90_REGISTER_SPLIT = {2: (24, 240), 3: (32, 160), 4: (24, 112)}
# A window at d > 192: the producer's per-tile window bounds, K/V head and schedule position
# spilled at 24 registers with GQA or two bounds (7 local loads and stores per tile in SASS); 40
# leave its loop spill-free, and the d256 consumers' code at 232 is the same as at 240 (no
# spills; Gemma 2's kernel: 16 fewer instructions, all the producer's). The causal pairs' schedule
# (its tail's position arithmetic) spilled the same way at d256: 11 local loads and stores.
SM90_WIDE_WINDOW_SPLIT = (40, 232)
# The producer may prefetch the next tile's Q rows into L2 once this tile's first K/V went out
# (Plan.q_prefetch), so that the Q load after the consumers free the one Q buffer reads L2: off
# in every plan (mixed where measured), a tuning candidate
Q_PREFETCH_REASON = (
    "the producer prefetches the next tile's Q rows into L2 as it starts this tile, so their load, once the "
    "consumers free the one Q buffer, reads L2 rather than HBM. Against the plain load on the H200 (both orders, "
    "2026-12-02-s23a): d192 1.013-1.041x at S=512-2048 but 0.98-1.00x from S=4096, d256 0.98-1.00x, d256 causal "
    "0.96-1.00x, d96 0.99-1.00x; with d256's O over V (-s23c) d256 causal 0.98-0.99x. A tuning candidate")
# Each consumer warpgroup's 64 Q rows may have their own full and empty barriers
# (Plan.q_per_warpgroup): the planner takes them where one Q buffer serves 2 warpgroups (d192,
# d256) and no left window bounds the key tiles
Q_PER_WARPGROUP_REASON = (
    "a warpgroup's next Q rows load as soon as it has freed its own, and it starts once they are in, without "
    "waiting for the other warpgroup's rows (with O over V, warpgroup 0's rows wait for warpgroup 1 to have freed "
    "its previous ones). Against one pair of barriers per buffer on the H200 (both orders, 2026-12-02-s24a/b): "
    "d192/128 1.003-1.056x, causal 1.002-1.030x; d256 0.993-1.014x, causal 0.994-1.015x; Gemma 2's d256 window "
    "0.966x and d128's two-buffer chained tiles 0.982-0.986x keep the shared barriers")
# d128's chained query tiles (TileRow.unmasked_chain) stay off where the spec returns the LSE
CHAIN_WITHOUT_LSE = (
    " and without LSE: with it (a training forward) unchained tiles measured 1.062x at d128 S=512, 1.027x at "
    "2048 and 1.037x at 16384 against chained ones on the H200 (both orders, 2026-12-02-s24g), whose long-range "
    "kernel (split tail) spilled 31 local loads and stores")
