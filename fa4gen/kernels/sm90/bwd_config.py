"""The Hopper backward kernels' configuration: every compile-time constant they read, and the one
check of whether a configuration can run (``bwd_config_problem``: the planner asserts its plans
pass it, ``fa4gen.build`` refuses a hand-made plan that fails it, the kernel's constructor checks
it again). Imports no CuTe DSL, so planning stays cheap.

One backward is three launches (fa4gen.kernels.sm90.bwd): the preprocess (rowsum(dO * O), the
LSE in log2 units, dQ's fp32 accumulator zeroed), the main kernel (one CTA per key tile and KV
head: dK and dV in registers over the group's query heads and query tiles, dQ added to the fp32
accumulator, in a fixed key-tile order when deterministic), and the postprocess (dQ scaled and rounded).
"""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel, ConfigDict

from fa4gen.arch import WARPGROUP_THREADS, WGMMA_M
from fa4gen.kernels.sm90.config import ELEMENT_BYTES, SMEM_RESERVE_BYTES, extent_problem, resource_problem

DqSplit = Literal["m", "n"]
DkvSplit = Literal["m", "n", "t"]
# registers a consumer thread needs besides its accumulators (addresses, loop state, the LSE
# and dPsum of its columns): FA3's budget for 240-register consumers is 216 for accumulators
ACCUMULATOR_HEADROOM = 24


class KeyTileOrder(enum.IntEnum):
    """How the main kernel's grid launches the key tiles of each (KV head, batch): a run-time
    argument (fa4gen.backward.key_tile_order), so one kernel serves every order."""

    NATURAL = 0  # a (KV head, batch)'s key tiles one after another, lowest first
    REVERSED = 1  # the same, highest first (a deterministic backward past the SM count)
    OUTERMOST = 2  # key tile 0 of every (KV head, batch), then key tile 1, ...


class Sm90BwdConfig(BaseModel):
    """Compile-time constants of one Hopper backward (see fa4gen.kernels.sm90.bwd)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # the variant (from the spec)
    head_dim: int
    head_dim_v: int
    qhead_per_kvhead: int
    softmax_scale: float  # dQ and dK are scaled by it (dS is the gradient of the scaled score)
    scale_log2: float  # multiplier of raw scores before exp2 (softmax_scale * log2(e))
    softcap: float | None  # scores were soft-capped: dS carries tanh's derivative
    score_mod: bool  # an expression score modifier: its value and derivative come from score_grad
    extra_names: tuple[str, ...]  # the variant's run-time arguments, in order (fa4gen.variants.lower)
    window_left: int | None  # keys before a query's position it sees (None: all)
    window_right: int | None  # keys after it (0: causal; None: all)
    chunk: int | None  # chunked attention: causal within chunks of this many keys
    prefix_lm: bool  # keys below the batch entry's prefix length are seen by every row
    # packed documents: every key's query rows come from a table (runtime.document_query_ranges),
    # causal / window bounds aligned to each document's end
    document: bool
    # an expression mask: the query tiles each key tile walks come from the backward's block mask
    # (fa4gen.blockmask.build_backward_block_mask), mask_mod from the emitted module
    expression_mask: bool
    # run-time tensors that train (requires_grad): the kernel adds each score's share of their
    # gradient (the emitted aux_grad's derivatives) into fp32 sums
    aux_grads: tuple[str, ...]
    # the key tiles add into dQ in a fixed order (a semaphore per query tile and warpgroup's
    # share): gradients bit-identical from run to run
    deterministic: bool
    # the schedule (from the planner)
    # dQ's reduce-adds issued by a warp of the producer warpgroup (the consumers hand it each
    # staged dQ by named barrier) instead of a consumer warp: its waits (a deterministic turn, a
    # sum landing) stall no MMA. Deterministic backwards need it.
    dq_writer: bool
    # deterministic: each query tile's dQ turns dealt round-robin over a run-time number of partial
    # accumulators with a semaphore each (backward.dq_groups), which the postprocess adds in group
    # order: a key tile waits only for the tiles of its group. Off until measured on a GPU.
    dq_grouped_turns: bool = False
    head_dim_padded: int
    head_dim_v_padded: int
    num_consumer_warpgroups: int
    tile_m: int  # query rows per step
    q_stages: int  # Q and dO buffers (with their rows' LSE and dPsum): the next step's load during this one
    dq_stages: int  # dQ staging buffers: a step's TMA reduce-add runs on while the next computes
    producer_regs: int
    consumer_regs: int
    dq_split: DqSplit  # dQ = dS.K split over the warpgroups by query rows (m) or head dim (n)
    # dK and dV split over the warpgroups by keys (m: each owns 64 keys of the CTA's tile, P^T and
    # dS^T feed their MMAs from registers) or by head-dim columns (n: the warpgroups share 64 keys
    # and split S^T by query rows; P^T and dS^T go through shared memory; head dims past 128). With
    # two warpgroups, the multiples of 16 checked below make every half a multiple of 8 (wgmma's N).
    # t: computed transposed, keys on the MMA's N side (dK^T = Q^T.dS, dV^T = dO^T.P), each
    # warpgroup owning keys_per_warpgroup keys over every head-dim row; S and dP untransposed
    # (query rows on M, the keys split as dK^T's), P and dS through shared memory. Frees the key
    # tile from multiples of 64: 96 keys at d192/128, where 128 outgrow the registers.
    dkv_split: DkvSplit
    # keys each warpgroup owns (m: 64, the MMA's M; t: a multiple of 8, the MMA's N); n: the
    # tile's 64 keys, shared
    keys_per_warpgroup: int = WGMMA_M

    @property
    def tile_n(self) -> int:
        return self.keys_per_warpgroup * (1 if self.dkv_split == "n" else self.num_consumer_warpgroups)

    @property
    def transposed(self) -> bool:
        """Whether the step computes S, dP, dK^T and dV^T (dkv_split t), not S^T, dP^T, dK and dV."""
        return self.dkv_split == "t"

    @property
    def dkv_ways(self) -> int:
        """Warpgroups sharing each key's dK and dV (and S^T's tile, by query rows)."""
        return self.num_consumer_warpgroups if self.dkv_split == "n" else 1

    @property
    def query_bounds(self) -> tuple[bool, bool]:
        """Whether the structural mask bounds a key's lowest query (0 without a right bound, chunks,
        a prefix or documents) and its highest (Sq - 1 without a left bound, chunks or documents)."""
        starts = self.window_right is not None or self.chunk is not None or self.prefix_lm or self.document
        ends = self.window_left is not None or self.chunk is not None or self.document
        return starts, ends

    @property
    def dq_descending(self) -> bool:
        """The deterministic backward's order of key tiles at each query tile's dQ: descending
        where a right bound makes higher key tiles start their ascending walk at higher query
        tiles (they reach a query tile first: none waits in the steady state, decision
        bwd-deterministic), ascending otherwise (every key tile starts at the same query tile)."""
        return self.window_right is not None


def bwd_smem_bytes(c: Sm90BwdConfig) -> int:
    """K and V (one tile each), Q and dO (q_stages each) with their rows' LSE and dPsum, dS (one
    tile, and P's beside it unless dkv_split is m), dQ's fp32 staging (dq_stages tiles)."""
    k_v = c.tile_n * (c.head_dim_padded + c.head_dim_v_padded)
    q_do = c.q_stages * c.tile_m * (c.head_dim_padded + c.head_dim_v_padded)
    ds = c.tile_m * c.tile_n * (1 if c.dkv_split == "m" else 2)
    fp32 = c.q_stages * 2 * c.tile_m + c.dq_stages * c.tile_m * c.head_dim_padded
    return (k_v + q_do + ds) * ELEMENT_BYTES + fp32 * 4 + SMEM_RESERVE_BYTES


def bwd_accumulator_registers(c: Sm90BwdConfig) -> int:
    """fp32 registers per consumer thread at the peak: its share of dK and dV (every split deals
    the tile's keys x head-dim columns evenly over the warpgroups), with either its share of S and
    dP (keys x query rows) or of dQ (tile_m x head_dim) beside them."""
    threads = WARPGROUP_THREADS * c.num_consumer_warpgroups
    dk_dv = c.tile_n * (c.head_dim_padded + c.head_dim_v_padded) // threads
    s_dp = 2 * c.tile_n * c.tile_m // threads
    dq = c.tile_m * c.head_dim_padded // threads
    return dk_dv + max(s_dp, dq)


def dkv_split_problem(c: Sm90BwdConfig) -> str:
    """Whether dK and dV can split as ``dkv_split`` says ("" when they can)."""
    if c.dkv_split != "t":
        if c.keys_per_warpgroup != WGMMA_M:
            return f"dkv_split {c.dkv_split} needs keys_per_warpgroup = {WGMMA_M} (t sets it)"
        return ""
    # (with two warpgroups a multiple of 8 also makes the key tile a multiple of 16: dQ's K)
    if c.keys_per_warpgroup % 8 or c.keys_per_warpgroup > 128:
        return "dkv_split t needs keys_per_warpgroup a multiple of 8 up to 128 (the MMA's N)"
    if c.head_dim_padded % WGMMA_M or c.head_dim_v_padded % WGMMA_M:
        return f"dkv_split t needs head dims divisible by {WGMMA_M} (dK^T's and dV^T's M)"
    if c.tile_m != WGMMA_M or c.dq_split != "n":
        return "dkv_split t needs tile_m = 64 and dq_split n (dQ = dS.K over the shared dS)"
    if c.document:
        return "dkv_split t reads each query row's keys; packed documents give the backward each key's query rows"
    return ""


def dq_split_problem(c: Sm90BwdConfig) -> str:
    """Whether dQ's MMA can split as ``dq_split`` says ("" when it can)."""
    w = c.num_consumer_warpgroups
    if c.dq_split == "m":
        if c.tile_m != WGMMA_M * w:
            return f"dq_split m needs tile_m = {WGMMA_M * w} (64 query rows per warpgroup)"
        return ""
    if c.tile_m != WGMMA_M:
        return "dq_split n needs tile_m = 64"
    if c.head_dim_padded % (8 * w):
        return f"dq_split n needs head_dim_padded divisible by {8 * w}"
    return ""


def bwd_config_problem(c: Sm90BwdConfig) -> str:
    """Why the GPU cannot run ``c`` ("" when it can)."""
    extents = extent_problem(c, "tile_m")
    if extents:
        return extents
    if c.num_consumer_warpgroups != 2 or c.q_stages not in (1, 2) or c.dq_stages not in (1, 2):
        return "the backward runs 2 consumer warpgroups, 1 or 2 Q stages and 1 or 2 dQ stages"
    if c.deterministic and not c.dq_writer:
        return "a deterministic backward takes its dQ turns on the dQ writer warp (dq_writer)"
    if c.dq_grouped_turns and not c.deterministic:
        return "dq_grouped_turns orders a deterministic backward's dQ turns: it needs deterministic"
    if c.tile_m > 256 or c.tile_m % 8:
        return "tile_m must be a multiple of 8 up to 256 (the N extent of S^T = K.Q^T)"
    if problem := dq_split_problem(c):
        return problem
    if problem := dkv_split_problem(c):
        return problem
    if problem := resource_problem(bwd_smem_bytes(c), c.producer_regs, c.consumer_regs, c.num_consumer_warpgroups):
        return problem
    accumulators = bwd_accumulator_registers(c)
    if accumulators > c.consumer_regs - ACCUMULATOR_HEADROOM:
        return (
            f"its accumulators take {accumulators} registers per thread, over the "
            f"{c.consumer_regs - ACCUMULATOR_HEADROOM} a {c.consumer_regs}-register consumer has for them "
            "(dkv_split n halves dK and dV per thread)"
        )
    return ""
