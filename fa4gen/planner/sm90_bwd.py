"""The sm_90a backward planner: spec -> Sm90BwdConfig, with a reason per choice.

The tiles come from sm90_tables.SM90_BWD_TILES; every plan passes the backward's one check
(bwd_config_problem), asserted on the way out. ``backward_problem`` says, in one line naming the
spec field, which variants have no backward kernel yet.
"""

from __future__ import annotations

import math

from fa4gen.arch import MMA_K_GRANULE
from fa4gen.expr import ExpressionError
from fa4gen.expr_grad import aux_gradient, derivative
from fa4gen.kernels.sm90.bwd_config import Sm90BwdConfig, bwd_config_problem
from fa4gen.planner.model import Plan
from fa4gen.planner.sm90_tables import (
    SM90_BWD_PLAIN_WIDE_ROWS,
    SM90_BWD_REGISTER_SPLIT,
    SM90_BWD_TILES,
    BwdTileRow,
)
from fa4gen.spec import AttentionSpec
from fa4gen.variants import lower

KERNEL = "HopperAttentionBackward"
LOG2E = math.log2(math.e)


def _round_up(value: int, granule: int) -> int:
    return (value + granule - 1) // granule * granule


def backward_problem(spec: AttentionSpec) -> str:
    """Why ``spec`` has no backward kernel on sm_90a ("" when it has one)."""
    lowered = lower(spec)
    if lowered.score is not None:
        try:
            derivative(lowered.score, "score")
        except ExpressionError as exc:
            return f"score_mod: no derivative with respect to score: {str(exc).splitlines()[0]}"
    if spec.deterministic and lowered.trainable:
        names = ", ".join(extra.name for extra in lowered.trainable)
        return (
            f"deterministic: true with trainable tensors ({names}): their gradients are atomic sums in no "
            "fixed order; train them without deterministic mode"
        )
    for extra in lowered.trainable:
        try:
            aux_gradient(lowered.score, extra.name)
        except ExpressionError as exc:
            return f"{extra.name}: no gradient: {str(exc).splitlines()[0]}"
    return ""


def _tile_row(width: int, variant: dict) -> BwdTileRow:
    """The schedule's row for the padded head dim ``width``: the plain rows' own where the variant
    computes per score at most one compare beyond P and dS (no mask but a right bound, no soft cap
    or score modifier)."""
    masked = ("window_left", "chunk", "softcap")
    plain = all(variant[name] is None for name in masked) and not any(
        variant[name] for name in ("prefix_lm", "document", "expression_mask", "score_mod")
    )
    if plain and width <= SM90_BWD_PLAIN_WIDE_ROWS.max_head_dim:
        return SM90_BWD_PLAIN_WIDE_ROWS
    return next(r for r in SM90_BWD_TILES if width <= r.max_head_dim)


def plan_bwd_sm90(spec: AttentionSpec) -> Plan:
    """The backward's plan for ``spec`` (ValueError naming the field where it has none)."""
    if problem := backward_problem(spec):
        raise ValueError(f"no backward for this spec ({spec.summary()}): {problem}")
    dqk, dv = _round_up(spec.head_dim, MMA_K_GRANULE), _round_up(spec.dv, MMA_K_GRANULE)
    producer_regs, consumer_regs = SM90_BWD_REGISTER_SPLIT
    lowered = lower(spec)
    variant = dict(
        head_dim=spec.head_dim,
        head_dim_v=spec.dv,
        qhead_per_kvhead=spec.qhead_per_kvhead,
        softmax_scale=spec.scale,
        # a modified score leaves score_grad in natural-log units, as in the forward
        scale_log2=LOG2E if lowered.score is not None else spec.scale * LOG2E,
        softcap=spec.softcap,
        score_mod=lowered.score is not None,
        extra_names=tuple(extra.name for extra in lowered.for_backward().extras),
        window_left=spec.left_bound,
        window_right=spec.right_bound,
        chunk=spec.mask.size if spec.mask_kind == "chunked" else None,
        prefix_lm=spec.mask_kind == "prefix_lm",
        document=spec.mask_kind == "document",
        expression_mask=lowered.mask is not None,
        aux_grads=tuple(extra.name for extra in lowered.trainable),
        deterministic=spec.deterministic,
    )
    row = _tile_row(max(dqk, dv), variant)
    config = Sm90BwdConfig(
        **variant,
        head_dim_padded=dqk,
        head_dim_v_padded=dv,
        num_consumer_warpgroups=2,
        tile_m=row.tile_m,
        q_stages=row.q_stages,
        dq_stages=row.dq_stages,
        dq_writer=spec.deterministic or row.dq_writer,
        producer_regs=producer_regs,
        consumer_regs=consumer_regs,
        dq_split=row.dq_split,
        dkv_split=row.dkv_split,
        keys_per_warpgroup=row.keys_per_warpgroup,
    )
    problem = bwd_config_problem(config)
    assert not problem, f"the backward planner made a plan that cannot run: {problem}"
    why = dict.fromkeys(variant, "from the spec")
    if spec.deterministic:
        why["deterministic"] = (
            "from the spec: each query tile's dQ takes the key tiles' sums in a fixed order (descending under "
            "a right bound), one semaphore per query tile and warpgroup (decision bwd-deterministic)"
        )
    why.update(
        head_dim_padded="the head dim rounded up to the MMA's K granule (16)",
        head_dim_v_padded="the head dim rounded up to the MMA's K granule (16)",
        num_consumer_warpgroups="two consumer warpgroups, dK and dV in their registers",
        tile_m=row.reason,
        q_stages=row.reason,
        dq_stages=row.reason,
        dq_writer=(
            "deterministic: a producer warp issues dQ's reduce-adds, so the turns and the wait for each sum to "
            "land stall no MMA (decision bwd-deterministic)"
            if spec.deterministic
            else "128 query rows, dQ split by rows: the dQ writer warp issues the 16 reduce-adds per consumer warp and "
            "step, which stalled the MMA warps (1.05-1.15x at d64; decision bwd-deterministic)"
            if row.dq_writer
            else "a consumer warp issues dQ's reduce-adds, left running during the next step"
        ),
        dq_grouped_turns="off: dQ's turns in one chain per query tile (grouped turns not yet measured on a GPU; "
        "decision bwd-deterministic)",
        dq_split=row.reason,
        dkv_split=row.reason,
        keys_per_warpgroup=row.reason,
        producer_regs="the TMA warp needs few registers; the consumers take the rest",
        consumer_regs="the TMA warp needs few registers; the consumers take the rest",
    )
    return Plan(arch="sm_90a", kernel=KERNEL, config=config, reasons=why)
