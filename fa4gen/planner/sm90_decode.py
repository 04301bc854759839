"""The sm_90a decode planner: spec -> Sm90DecodeConfig, with a reason per choice.

Decode runs short query sequences over a KV cache (fa4gen.kernels.sm90.decode): the query rows
of a KV head's group packed into one tile, the keys split over CTAs at run time. ``decode_problem``
says which variants have no decode kernel; their launches stay on the forward kernel.
"""

from __future__ import annotations

from fa4gen.arch import MMA_K_GRANULE, WGMMA_M
from fa4gen.kernels.sm90.decode_config import PAGE_BOX, Sm90DecodeConfig, decode_config_problem
from fa4gen.planner.fields import variant_fields
from fa4gen.planner.model import Plan, SeqlenSplit
from fa4gen.planner.sm90_tables import (
    DECODE_MAX_PACKED_ROWS,
    DECODE_MAX_ROWS_MHA,
    DECODE_PAIR_REGISTERS,
    RESCALE_THRESHOLD_LOG2,
    SM90_DECODE_Q_REGISTERS_MAX_HEAD_DIM,
    SM90_DECODE_REGISTER_SPLIT,
    SM90_DECODE_TILES,
    SM90_DECODE_WIDE_REGISTER_SPLIT,
    SM90_DECODE_WIDE_TILES,
    SM90_PAGED_PRODUCER_REGS,
)
from fa4gen.spec import AttentionSpec

KERNEL = "HopperAttentionDecode"
VARIANT_FIELDS = (
    "head_dim",
    "head_dim_v",
    "qhead_per_kvhead",
    "scale_log2",
    "window_left",
    "window_right",
    "chunk",
    "expression_mask",
    "sinks",
    "return_lse",
    "extra_names",
)


WIDE_REASON = (
    f"two consumer warpgroups, {2 * WGMMA_M} packed rows: launches over a cache of more than {WGMMA_M} packed rows "
    "(query rows x query heads per KV head) read each K/V tile once per 128 rows, not once per 64"
)
PAGED_REASON = (
    f"K/V from a page pool through a page table: {PAGE_BOX}-key TMA boxes (the smallest page), each from its "
    "own page, so any page size that is a multiple of it runs without a recompile"
)


def _round_up(value: int, granule: int) -> int:
    return (value + granule - 1) // granule * granule


def decode_problem(spec: AttentionSpec) -> str:
    """Why ``spec`` has no decode kernel on sm_90a ("" when it has one), naming the spec field."""
    if spec.mask_kind == "prefix_lm":
        return "mask: prefix_lm has no decode kernel (its prefix is per batch entry, not per cache)"
    if spec.is_varlen:
        return "mask: document (packed sequences) has no decode kernel; pass per-entry cache lengths instead"
    return ""


def decode_max_seqlen_q(spec: AttentionSpec) -> int:
    """The longest query sequence a plain launch (no cache lengths) runs on the decode kernel."""
    if spec.qhead_per_kvhead == 1:
        return DECODE_MAX_ROWS_MHA
    return max(1, DECODE_MAX_PACKED_ROWS // spec.qhead_per_kvhead)


def plan_decode_sm90(spec: AttentionSpec, paged: bool = False, wide: bool = False) -> Plan:
    """The decode kernel's plan (``paged``: over a paged cache; ``wide``: two consumer warpgroups,
    128 packed rows per tile); ValueError naming the field where the variant has none."""
    problem = decode_problem(spec)
    if problem:
        raise ValueError(problem)
    variant = {name: value for name, value in variant_fields(spec).items() if name in VARIANT_FIELDS}
    dqk, dv = _round_up(spec.head_dim, MMA_K_GRANULE), _round_up(spec.dv, MMA_K_GRANULE)
    table = SM90_DECODE_WIDE_TILES if wide else SM90_DECODE_TILES
    row = next(r for r in table if max(dqk, dv) <= r.max_head_dim)
    producer_regs, consumer_regs = SM90_DECODE_WIDE_REGISTER_SPLIT if wide else SM90_DECODE_REGISTER_SPLIT
    # paged plans are the contiguous ones, but a 64-row kernel's producer walks the pages unrolled
    unrolled = paged and not wide
    if unrolled:
        producer_regs = SM90_PAGED_PRODUCER_REGS[row.ctas_per_sm]
        if row.ctas_per_sm > 1:
            consumer_regs = DECODE_PAIR_REGISTERS - producer_regs
    config = Sm90DecodeConfig(
        **variant,
        head_dim_padded=dqk,
        head_dim_v_padded=dv,
        tile_n=row.tile_n,
        kv_stages=row.kv_stages,
        paged=paged,
        page_walk_unrolled=unrolled,
        ctas_per_sm=row.ctas_per_sm,
        consumer_warpgroups=2 if wide else 1,
        q_in_registers=dqk <= SM90_DECODE_Q_REGISTERS_MAX_HEAD_DIM,
        rescale_threshold=RESCALE_THRESHOLD_LOG2,
        producer_regs=producer_regs,
        consumer_regs=consumer_regs,
    )
    problem = decode_config_problem(config)
    assert not problem, problem
    regs = "the producer warpgroup only issues TMA; the consumer holds S, P and O"
    if paged:
        regs = (
            "the producer issues TMA and walks the page table, a tile's boxes unrolled (in 24 registers it spills); "
            "the consumer holds S, P and O"
            if unrolled
            else "the producer issues TMA and walks the page table one box at a time (in 24 registers); the "
            "consumers hold S, P and O"
        )
    return Plan(
        arch="sm_90a",
        kernel=KERNEL,
        config=config,
        reasons={
            **dict.fromkeys(variant, "from the spec"),
            "head_dim_padded": f"head_dim {spec.head_dim} rounded up to the MMA's K granule {MMA_K_GRANULE}",
            "head_dim_v_padded": f"head_dim_v {spec.dv} rounded up to {MMA_K_GRANULE}",
            "tile_n": row.reason,
            "kv_stages": row.reason,
            "paged": PAGED_REASON if paged else "K/V contiguous per batch entry, one TMA box per key tile",
            "page_walk_unrolled": (
                "64 rows: a tile's boxes issued in straight-line code, 2-3 us faster than a loop over short caches "
                "(decision paged-kv)"
                if unrolled
                else "128 rows: a loop over a tile's boxes in the producer's 24 registers leaves the consumers 240, "
                "enough for 128-key steps (decision paged-kv)"
                if paged
                else "not paged"
            ),
            "ctas_per_sm": row.reason,
            "consumer_warpgroups": WIDE_REASON if wide else f"one consumer warpgroup: {WGMMA_M} packed rows per tile",
            "q_in_registers": (
                f"head_dim {dqk} <= {SM90_DECODE_Q_REGISTERS_MAX_HEAD_DIM}: Q.K^T reads Q from registers and only K "
                "from shared memory, whose bandwidth bounds the steps of long groups (decision decode-q-registers)"
                if dqk <= SM90_DECODE_Q_REGISTERS_MAX_HEAD_DIM
                else f"head_dim {dqk}: Q in shared memory (at d192 ptxas serialized the MMAs of Q from registers, "
                "and at d256 they would not fit beside O, S and P)"
            ),
            "rescale_threshold": "O rescaled only where a row max grows past 2^8, as in the forward",
            "producer_regs": regs,
            "consumer_regs": regs,
        },
    )


def decode_split(spec: AttentionSpec) -> SeqlenSplit | None:
    """The decode kernel's length range (None where the variant has none)."""
    if decode_problem(spec):
        return None
    top = decode_max_seqlen_q(spec)
    packed = f"{spec.qhead_per_kvhead} query heads per KV head packed into {WGMMA_M}-row tiles"
    why = (
        f"{packed}: each K/V tile read once per group, keys split over CTAs where the launch leaves SMs idle"
        if spec.qhead_per_kvhead > 1
        else "keys split over CTAs where the launch leaves SMs idle"
    )
    return SeqlenSplit(label="decode", max_seqlen_q=top, plan=plan_decode_sm90(spec), reason=why)


def cache_splits(spec: AttentionSpec) -> tuple[SeqlenSplit, ...]:
    """The decode kernels that only launches over a KV cache run (none where the variant has no
    decode kernel): the paged one (every launch that passes a page table), and with two consumer
    warpgroups the contiguous and the paged one for launches of more than 64 packed rows."""
    if decode_problem(spec):
        return ()
    return (
        SeqlenSplit(label="decode-wide", cache_only=True, plan=plan_decode_sm90(spec, wide=True), reason=WIDE_REASON),
        SeqlenSplit(label="paged", page_table=True, plan=plan_decode_sm90(spec, paged=True), reason=PAGED_REASON),
        SeqlenSplit(
            label="paged-wide",
            page_table=True,
            plan=plan_decode_sm90(spec, paged=True, wide=True),
            reason=f"{PAGED_REASON}; {WIDE_REASON}",
        ),
    )
