"""The Hopper forward kernel's configuration: every compile-time constant it reads, and the one
check of whether a configuration can run.

The planner (fa4gen.planner) produces a ``Sm90FwdConfig``, the emitted module passes it whole to
``HopperAttentionForward``, and the kernel reads its fields under these names. ``config_problem``
is the only place the rules live: the planner asserts its plans pass it, ``fa4gen.build`` refuses
a hand-made plan that fails it, and the kernel's constructor checks it again. This module imports
no CuTe DSL, so planning stays cheap.
"""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel, ConfigDict

from fa4gen.arch import MMA_K_GRANULE, WARPGROUP_THREADS, WGMMA_M, Arch

TileOrder = Literal["head_major", "heavy_first", "paired"]
OStaging = Literal["own", "over_p", "over_q", "shared", "over_v"]
SMEM_RESERVE_BYTES = 1024  # mbarriers, the tile info words (fwd.publish_tile) and alignment slack
ELEMENT_BYTES = 2  # q, k, v and o are 16-bit


class NamedBarrier(enum.IntEnum):
    """Named barrier ids (0 is __syncthreads); each base is followed by one id per consumer
    warpgroup, so the bases are at least 4 apart."""

    TURN = 1  # ping-pong: the consumers take turns issuing MMAs
    EPILOGUE = 8  # a consumer warpgroup's epilogue
    O_TURN = 12  # turns at a shared O staging buffer


class Sm90FwdConfig(BaseModel):
    """Compile-time constants of one Hopper forward kernel (see fa4gen.kernels.sm90.fwd)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # the variant (from the spec)
    head_dim: int
    head_dim_v: int
    qhead_per_kvhead: int
    scale_log2: float  # multiplier of scores before exp2 (softmax_scale * log2(e), or log2(e) after score_mod)
    window_left: int | None
    window_right: int | None
    chunk: int | None  # chunked attention: causal within chunks of this many keys
    prefix_lm: bool
    document: bool  # packed documents (varlen)
    expression_mask: bool  # a mask_mod and its block mask
    sinks: bool
    return_lse: bool
    extra_names: tuple[str, ...]  # the variant's run-time arguments, in order
    # the schedule (from the planner)
    head_dim_padded: int  # K extent of Q.K^T as loaded (TMA zero-fills the tail)
    head_dim_v_padded: int  # N extent of P.V as loaded
    num_consumer_warpgroups: int  # MMA/softmax warpgroups, 64 query rows each
    tile_n: int  # keys per main-loop step
    kv_stages: int  # depth of the K and V shared-memory rings
    q_stages: int  # Q buffers: 2 let the next tile's Q load while this one computes
    q_per_warpgroup: bool  # each warpgroup's Q rows have their own full/empty barriers
    producer_regs: int  # setmaxnreg of the TMA producer warpgroup
    consumer_regs: int  # setmaxnreg of each consumer warpgroup
    p_in_registers: bool  # P feeds P.V from registers (else through shared memory)
    pingpong: bool  # the consumer warpgroups take turns issuing MMAs
    mask_runs: bool  # masked and interior key tiles in separate loops
    interior_first_tile: bool  # a first key tile no bound cuts runs without mask code
    tile_order: TileOrder  # see fa4gen.kernels.common.scheduler
    pair_tail_rounds: int  # paired: the last rounds of pairs go as single tiles
    pair_tail_min_tiles: int  # ... in launches with at least this many query tiles per head
    chain_query_tiles: bool  # a query tile's last P.V goes with the next tile's first Q.K^T
    split_tail: bool  # the ragged last round's key tiles spread over every CTA
    split_tail_min_key_tiles: int  # ... where query tiles visit at least this many key tiles
    o_staging: OStaging  # where O is staged for its TMA store
    rescale_threshold: float  # log2 growth of a row max before O is rescaled (0: every tile)
    stale_max: bool  # key tiles without mask code skip the tile's row max

    @property
    def tile_m(self) -> int:
        return WGMMA_M * self.num_consumer_warpgroups

    @property
    def structural_mask(self) -> bool:
        """Whether mask bounds order the key tiles (windows, chunks, prefix-LM, documents)."""
        return (
            self.window_left is not None
            or self.window_right is not None
            or self.chunk is not None
            or self.prefix_lm
            or self.document
        )

    @property
    def p_smem(self) -> bool:
        return not self.p_in_registers


def smem_bytes(
    tile_m: int, tile_n: int, stages: int, dqk: int, dv: int, o_staging: str, q_stages: int = 1, p_smem: bool = False
) -> int:
    """Q tile(s) + K/V ring + the O staging buffer (where O has one) + P (where not in registers)."""
    q = q_stages * tile_m * dqk
    o = {"own": tile_m * dv, "shared": WGMMA_M * dv, "over_v": WGMMA_M * dv}.get(o_staging, 0)
    kv = stages * tile_n * (dqk + dv)
    p = tile_m * tile_n if p_smem else 0
    return (q + o + kv + p) * ELEMENT_BYTES + SMEM_RESERVE_BYTES


def config_smem_bytes(c: Sm90FwdConfig) -> int:
    return smem_bytes(
        c.tile_m, c.tile_n, c.kv_stages, c.head_dim_padded, c.head_dim_v_padded, c.o_staging, c.q_stages, c.p_smem
    )


def o_staging_fits(
    o_staging: str, tile_n: int, dqk: int, dv: int, q_stages: int, p_smem: bool, warpgroups: int
) -> bool:
    """Whether O's (64 x dv) staging tile can sit where ``o_staging`` puts it."""
    if o_staging == "over_p":
        return p_smem and dv <= tile_n
    if o_staging in ("over_q", "over_v"):
        fits = dv <= dqk and q_stages == 1
        return fits and (o_staging == "over_q" or (warpgroups == 2 and tile_n >= WGMMA_M))
    return True


def register_pool(warpgroups: int) -> int:
    """The registers setmaxnreg shares out in a CTA of ``warpgroups`` consumers and the producer:
    ptxas launches every thread with the most registers one CTA per SM allows, rounded down to 8
    (168 at 384 threads: 64512, not the SM's 65536). A split over the pool makes
    setmaxnreg.inc wait forever."""
    caps = Arch.SM90A.caps
    threads = WARPGROUP_THREADS * (warpgroups + 1)
    return min(caps.max_regs_per_thread, caps.registers_per_sm // threads // 8 * 8) * threads


def split_partial_words(head_dim_v_padded: int) -> int:
    """fp32 words per thread of one split-tail partial (sm90.split): its O fragment
    (64 x dv / 128 words) and its 2 rows' maxima and sums."""
    return WGMMA_M * head_dim_v_padded // WARPGROUP_THREADS + 4


def _option_problem(c: Sm90FwdConfig) -> str:
    """Plan options that need others (the kernel has no code for the other combinations)."""
    rules = (
        (
            c.chain_query_tiles,
            c.num_consumer_warpgroups == 2 and c.o_staging == "own" and not c.expression_mask,
            "chain_query_tiles needs 2 consumer warpgroups with O in its own buffer",
        ),
        (
            c.o_staging == "over_v",
            c.num_consumer_warpgroups == 2 and not c.chain_query_tiles,
            "o_staging over_v needs 2 consumer warpgroups, unchained",
        ),
        (c.q_per_warpgroup, c.num_consumer_warpgroups >= 2, "q_per_warpgroup needs 2 or more consumer warpgroups"),
        (c.pingpong, c.num_consumer_warpgroups >= 2, "pingpong needs 2 or more consumer warpgroups"),
        (c.stale_max, c.rescale_threshold > 0, "stale_max needs a rescale threshold"),
        (
            c.split_tail,
            c.tile_order == "head_major" and not c.structural_mask and not c.expression_mask,
            "split_tail needs the head-major order without a mask",
        ),
        (
            c.mask_runs,
            c.structural_mask and not c.expression_mask,
            "mask_runs needs mask bounds and no expression mask",
        ),
        (
            c.interior_first_tile,
            c.window_right is None and not c.expression_mask,
            "interior_first_tile needs a kernel without a right bound or expression mask",
        ),
        (c.pair_tail_rounds > 0, c.tile_order == "paired", "pair_tail_rounds needs the paired order"),
    )
    return next((why for applies, holds, why in rules if applies and not holds), "")


def extent_problem(c, tile: str) -> str:
    """Why the MMA cannot take ``c``'s padded head dims and its ``tile`` field ("" when it can):
    each a positive multiple of the K granule, the padded dims holding the head dims (the
    forward's, backward's and decode's configs share these fields)."""
    for name in ("head_dim_padded", "head_dim_v_padded", tile):
        if getattr(c, name) <= 0 or getattr(c, name) % MMA_K_GRANULE:
            return f"{name}={getattr(c, name)} is not a positive multiple of {MMA_K_GRANULE}"
    if c.head_dim_padded < c.head_dim or c.head_dim_v_padded < c.head_dim_v:
        return "the padded head dims must hold the head dims"
    return ""


def config_problem(c: Sm90FwdConfig) -> str:
    """Why the GPU cannot run ``c`` ("" when it can): an option without what it needs, shared
    memory over the limit, or a register split over the CTA's pool."""
    extents = extent_problem(c, "tile_n")
    if extents:
        return extents
    if c.num_consumer_warpgroups not in (1, 2, 3, 4) or c.kv_stages < 1 or c.q_stages not in (1, 2):
        return "num_consumer_warpgroups must be 1-4, kv_stages at least 1 and q_stages 1 or 2"
    option = _option_problem(c)
    if option:
        return option
    if not o_staging_fits(
        c.o_staging, c.tile_n, c.head_dim_padded, c.head_dim_v_padded, c.q_stages, c.p_smem, c.num_consumer_warpgroups
    ):
        return f"O's staging tile does not fit {c.o_staging}"
    return resource_problem(config_smem_bytes(c), c.producer_regs, c.consumer_regs, c.num_consumer_warpgroups)


def resource_problem(smem: int, producer_regs: int, consumer_regs: int, warpgroups: int) -> str:
    """Why a warp-specialized CTA (a producer and ``warpgroups`` consumer warpgroups) cannot run
    with ``smem`` bytes of shared memory and this setmaxnreg split ("" when it can)."""
    limit = Arch.SM90A.caps.smem_bytes_per_cta
    if smem > limit:
        return f"its buffers take {smem} bytes of shared memory, over the {limit} available"
    registers = WARPGROUP_THREADS * (producer_regs + warpgroups * consumer_regs)
    pool = register_pool(warpgroups)
    if registers > pool:
        return (
            f"producer_regs {producer_regs} + {warpgroups} x consumer_regs {consumer_regs} "
            f"take {registers} registers, over the CTA's pool of {pool}"
        )
    return ""
