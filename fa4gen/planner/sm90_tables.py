"""The sm_90a planner tables: one tile row per head-dim bucket (with the rows some launch lengths
or variants take instead) and the measured constants of the schedule. Each reason is a line or
two citing its decision id; the measurements behind it are in docs/decisions.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fa4gen.spec import AttentionSpec


@dataclass(frozen=True)
class SplitTail:
    """Where a row's launches split their ragged last round (split_tail): from ``min_seqlen_q``
    query rows, a length range of its own (the split's code slows the launches it splits nothing
    in), and there only where the query tiles visit at least ``min_key_tiles`` key tiles.
    ``min_seqlen_q`` 1: every launch, in the row's own plan (no length range of its own)."""

    min_seqlen_q: int
    min_key_tiles: int
    reason: str

    @property
    def every_length(self) -> bool:
        """Whether every launch splits, in the row's own plan (no length range of its own)."""
        return self.min_seqlen_q <= 1

    def long_reason(self) -> str:
        return f"from {self.min_seqlen_q} query rows the ragged last round of tiles is split between CTAs"

    def elsewhere(self) -> str:
        """Why a plan of the shorter launches keeps whole tiles."""
        return (
            f"launches of at least {self.min_seqlen_q} query rows split their tail (the long range); the split's "
            "code slows shorter ones (decision split-tail)"
        )


SPLIT_TAIL = SplitTail(4096, 32, "from 4096 query rows and 32 key tiles per query tile (decision split-tail)")
SPLIT_TAIL_FROM_2048 = SplitTail(2048, 16, "d64: from 2048 query rows and 16 key tiles (decision split-tail)")
SPLIT_TAIL_EVERY_LENGTH = SplitTail(1, 16, "d192: at every length, from 16 key tiles (decision split-tail)")


@dataclass(frozen=True)
class TileRow:
    max_head_dim: int  # applies when max(head_dim, head_dim_v) (padded) is at most this
    consumer_warpgroups: int
    tile_n: int
    kv_stages: int
    pingpong: bool
    reason: str
    p_in_registers: bool = True  # False: P goes through shared memory (S + O fill the registers)
    # specs without a mask or score modifier that keep the row's warpgroups and O's own buffer
    # chain their query tiles, for this reason; None: they do not
    unmasked_chain: str | None = None
    # launches whose longest query sequence is short (or long) run another row, chosen per call
    # (all compile together: a tile is a compile-time shape); of the short rows, the first that
    # takes the spec
    short: tuple[ShortRow, ...] = ()
    long: LongRow | None = None
    # specs without a mask split their launches' ragged last round from here on
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
            return (
                spec.right_bound in (None, 0)
                and spec.left_bound is None
                and spec.mask_kind is None
                and spec.score_mod is None
                and spec.softcap is None
                and not spec.sinks
            )
        return True


@dataclass(frozen=True)
class LongRow:
    min_seqlen_q: int  # launches with at least this many query rows run ``row``
    row: TileRow


SM90_D64_SHORT = TileRow(
    max_head_dim=64,
    consumer_warpgroups=2,
    tile_n=128,
    kv_stages=2,
    pingpong=True,
    reason="d64 causal, at most 1024 query rows: 128-row tiles idle fewer diagonal rows (decision tile-table)",
)
SM90_D64_SHORT_4WG = TileRow(
    max_head_dim=64,
    consumer_warpgroups=4,
    tile_n=64,
    kv_stages=4,
    pingpong=True,
    reason="d64 plain or causal, at most 1024 query rows: a warpgroup's own chain sets the pace, so 4 "
    "warpgroups on 64-key tiles add throughput (decision tile-table)",
)
SM90_D96_SHORT = TileRow(
    max_head_dim=96,
    consumer_warpgroups=2,
    tile_n=128,
    kv_stages=2,
    pingpong=True,
    reason="d96, at most 1024 query rows: 128-row tiles leave fewer rows idle (decision tile-table)",
)
SM90_D96_LONG = TileRow(
    max_head_dim=96,
    consumer_warpgroups=3,
    tile_n=144,
    kv_stages=2,
    pingpong=True,
    p_in_registers=False,
    reason="d96, at least 4096 query rows: 144-key tiles with O staged over P (decision tile-table)",
)

# sm_90a forward. Shared memory holds Q (tile_m x d) plus kv_stages x (K tile + V tile);
# registers hold S (64 x tile_n), P and O (64 x dv) per consumer warpgroup.
SM90_FWD_TILES: tuple[TileRow, ...] = (
    TileRow(
        max_head_dim=64,
        consumer_warpgroups=3,
        tile_n=128,
        kv_stages=2,
        pingpong=True,
        reason="small d: 3 consumer warpgroups keep the tensor cores fed; S, P, O fit 160 registers "
        "(decision tile-table)",
        short=(ShortRow(1024, SM90_D64_SHORT_4WG, takes="plain"), ShortRow(1024, SM90_D64_SHORT, takes="causal")),
        split_tail=SPLIT_TAIL_FROM_2048,
    ),
    TileRow(
        max_head_dim=96,
        consumer_warpgroups=3,
        tile_n=128,
        kv_stages=2,
        pingpong=True,
        p_in_registers=False,
        reason="d96: 3 consumer warpgroups; S and O take 112 of 160 registers, so P goes through shared "
        "memory (decision tile-table)",
        short=(ShortRow(1024, SM90_D96_SHORT),),
        long=LongRow(4096, SM90_D96_LONG),
    ),
    TileRow(
        max_head_dim=128,
        consumer_warpgroups=2,
        tile_n=128,
        kv_stages=2,
        pingpong=True,
        reason="d128: 128x128 tiles, 2 stages; S, P and O fit 240 registers (decision tile-table)",
        unmasked_chain="d128 without a mask: each query tile's last P.V goes with the next tile's first Q.K^T "
        "(decision chain-query-tiles)",
    ),
    TileRow(
        max_head_dim=192,
        consumer_warpgroups=2,
        tile_n=128,
        kv_stages=2,
        pingpong=False,
        reason="d<=192 (dv 128): Q + 2 stages of 128-key tiles = 208 KB of 227 (decision tile-table)",
        split_tail=SPLIT_TAIL_EVERY_LENGTH,
    ),
    TileRow(
        max_head_dim=256,
        consumer_warpgroups=2,
        tile_n=64,
        kv_stages=2,
        pingpong=False,
        reason="d256: O takes 128 registers, so S shrinks to 64 keys; Q + 2 stages = 192 KB (decision tile-table)",
    ),
)

# Causal pairs come in whole rounds, so the last round is ragged; the last PAIR_TAIL_ROUNDS rounds
# go as single tiles, heaviest first, in launches with PAIR_TAIL_MIN_TILES query tiles per head
PAIR_TAIL_ROUNDS = 2
PAIR_TAIL_MIN_TILES = 20
NO_PAIR_TAIL = {"pair_tail_rounds": 0, "pair_tail_min_tiles": 0}  # config fields of a schedule without the tail
RESCALE_THRESHOLD_LOG2 = 8.0  # probabilities stay below 2^8: exact in fp32, fine in bf16/fp16 P
# key tiles without mask code skip the tile's row max up to these head dims, and not with the
# mask kinds it measured slower on (decision stale-max)
STALE_MAX_MAX_D = 128
STALE_MAX_SKIPS_MASKS = ("document", "expression")
# (producer, consumer) registers per thread by consumer warpgroups: 128 x (p + W x c) fits the
# CTA's register pool (config.register_pool; decision register-split)
SM90_REGISTER_SPLIT = {2: (24, 240), 3: (32, 160), 4: (24, 112)}
# a window (or the causal pairs) at d > 192: the producer's per-tile bounds spilled at 24
# registers (decision wide-window-split)
SM90_WIDE_WINDOW_SPLIT = (40, 232)
# d256 with per-score registers (bounds, coordinates): S back to 64 keys (decision pressure-step-back)
SM90_PRESSURE_MAX_TILE_N_D256 = 64
# the widest head dim whose kernels trace the first key tile a second time (decision interior-first-tile)
INTERIOR_FIRST_TILE_MAX_D = 192
# first calls on a cache miss run key tiles of at most this many keys: a third less to compile, on
# every sum in another order (decision first-call-plan)
FIRST_CALL_TILE_N = 64


@dataclass(frozen=True)
class BwdTileRow:
    """The backward's schedule for a head-dim bucket (fa4gen.kernels.sm90.bwd_config)."""

    max_head_dim: int  # applies when max(head_dim, head_dim_v) (padded) is at most this
    tile_m: int
    dq_split: Literal["m", "n"]
    dkv_split: Literal["m", "n", "t"]
    q_stages: int
    dq_stages: int
    reason: str
    # dQ's reduce-adds issued by the dQ writer warp, not by a consumer warp (decision bwd-deterministic)
    dq_writer: bool = False
    # keys per warpgroup (Sm90BwdConfig.keys_per_warpgroup: 64 but with dkv_split t)
    keys_per_warpgroup: int = 64


# Up to d128: 128 keys per CTA (64 per consumer warpgroup), dK and dV in registers. 128 query
# rows at d64 (FA3's tile) spilled 95 registers: the LSE and dPsum of 32 columns per thread ride
# beside S^T and dP^T (decision bwd-tiles). Past 128 a warpgroup's dK and dV for 64 keys outgrow
# the accumulator budget (bwd_config.bwd_accumulator_registers): the two warpgroups share 64 keys
# and split dK and dV by head-dim columns (FA3's d256 split); shared memory then holds one dQ
# buffer, and one Q/dO buffer at d256 (decision bwd-wide-heads).
SM90_BWD_TILES = (
    BwdTileRow(
        128,
        64,
        "n",
        "m",
        2,
        2,
        "64 query rows per step, dQ split by head dim; Q/dO and dQ double-buffered (decision bwd-tiles)",
    ),
    BwdTileRow(
        192,
        64,
        "n",
        "n",
        2,
        1,
        "64 keys shared by both warpgroups, dK/dV split by head dim; Q/dO double-buffered, one dQ buffer "
        "(two do not fit in shared memory; decision bwd-wide-heads)",
    ),
    BwdTileRow(
        256,
        64,
        "n",
        "n",
        1,
        1,
        "64 keys shared by both warpgroups, dK/dV split by head dim; one Q/dO and one dQ buffer (the most "
        "shared memory holds; decision bwd-wide-heads)",
    ),
)
# 128 query rows per step (dQ split by rows, the rows' LSE and dPsum read per S^T row) where a
# d <= 64 variant computes per score at most one compare beyond P and dS: no mask but a right bound
# (causal), no soft cap or score modifier. Measured 1.03-1.12x without a mask, 0.98-1.06x causal
# (geometric mean 1.03x) (decision bwd-tiles).
SM90_BWD_PLAIN_WIDE_ROWS = BwdTileRow(
    64,
    128,
    "m",
    "m",
    2,
    2,
    "128 query rows per step (dQ split by rows): a d <= 64 variant with no mask but a right bound, "
    "no soft cap or score modifier has the registers (decision bwd-tiles)",
    # dQ by rows takes 16 TMA reduce-adds per consumer warp and step: the writer warp issues them
    dq_writer=True,
)
SM90_BWD_REGISTER_SPLIT = (24, 240)  # producer, consumers: the forward's 2-warpgroup split


@dataclass(frozen=True)
class DecodeTileRow:
    """The decode kernel's keys per step, ring depth and CTAs per SM for head dims up to
    ``max_head_dim``."""

    max_head_dim: int
    tile_n: int
    kv_stages: int
    ctas_per_sm: int
    reason: str


# A decode step is latency-bound (Q.K^T, softmax and P.V in a chain, 4-64 of its 64 rows real):
# two CTAs per SM run two chains, where shared memory lets them (113 KB each at d128). Their
# rings keep 3 x 32-64 KB of K/V in flight per CTA, past the ~36 KB an SM's share of HBM
# bandwidth needs over a microsecond of latency.
SM90_DECODE_TILES = (
    DecodeTileRow(64, 128, 3, 2, "d <= 64: 128 keys, 3 stages of 32 KB, 2 CTAs per SM"),
    DecodeTileRow(128, 64, 3, 2, "d <= 128: 64 keys, 3 stages of 32 KB, 2 CTAs per SM"),
    DecodeTileRow(256, 64, 3, 1, "d > 128: 64 keys, 3 stages of up to 64 KB, one CTA per SM"),
)
# Two consumer warpgroups, a 128-row tile (launches over a KV cache of more than 64 packed rows):
# a long group's rows share each K/V tile where two 64-row CTAs would each read it. One CTA holds
# the SM, its ring as many bytes in flight as the two CTAs of the rows above (d <= 128).
SM90_DECODE_WIDE_TILES = (
    DecodeTileRow(64, 128, 5, 1, "128 packed rows, d <= 64: 128 keys, 5 stages of 32 KB, one CTA per SM"),
    DecodeTileRow(128, 128, 3, 1, "128 packed rows, d <= 128: 128 keys, 3 stages of 64 KB, one CTA per SM"),
    DecodeTileRow(256, 32, 4, 1, "128 packed rows, d > 128: 32 keys, 4 stages of up to 32 KB (Q takes 64 KB)"),
)
# Q.K^T's A operand from registers up to this head dim (Q's 64 x d bf16: d / 4 registers per thread
# beside O, S and P); past it Q stays in shared memory: at d192 ptxas serialized the 128-row
# kernel's wgmma (one arrive per HGMMA), and d256's 64 registers more would not fit.
SM90_DECODE_Q_REGISTERS_MAX_HEAD_DIM = 128
SM90_DECODE_WIDE_REGISTER_SPLIT = (24, 240)  # producer, each consumer: the forward's 2-warpgroup split
# producer, consumer warpgroup: the producer only issues TMA; 256 registers per thread pair fit
# two CTAs of 256 threads per SM
SM90_DECODE_REGISTER_SPLIT = (24, 232)
DECODE_PAIR_REGISTERS = 256  # producer + consumer registers per thread pair at two CTAs per SM
# paged, 64 rows, by CTAs per SM: the producer walks a tile's boxes unrolled, in 32 registers (40 at
# d256's 32 boxes per tile, one CTA per SM); a rolled walk in 24 issued them slower, 2-3 us more at
# B 8 over 1k keys (decision paged-kv). The 128-row kernels walk rolled in 24, for their consumers'
# 240 registers and 128-key steps.
SM90_PAGED_PRODUCER_REGS = {1: 40, 2: 32}
# Query lengths the decode kernel takes (packed rows = Sq x G, one 64-row tile): GQA launches up to
# 64 packed rows; MHA (nothing to pack) only up to 16 query rows, where a launch still leaves SMs
# idle without split-KV and the forward's overlapped steps win past it.
DECODE_MAX_PACKED_ROWS = 64
DECODE_MAX_ROWS_MHA = 16
