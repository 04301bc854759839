"""Spec + arch -> Plan: which kernel runs the spec, its config, and a reason for every choice.

``model`` holds the plan and its check (the kernel family's ``config_problem``), ``sm90`` the
sm_90a default choices over the tables in ``sm90_tables``, ``candidates`` the variations
``fa4gen tune`` times.
"""

from __future__ import annotations

from fa4gen.arch import Arch, require_supported
from fa4gen.planner.candidates import candidates
from fa4gen.planner.model import Plan, SeqlenSplit, backward_workspace_shapes, plan_problem, split_workspace_shape
from fa4gen.planner.sm90 import first_call_sm90, plan_sm90, splits_sm90
from fa4gen.planner.sm90_bwd import backward_problem, plan_bwd_sm90
from fa4gen.spec import AttentionSpec

_PLANNERS = {Arch.SM90A: plan_sm90}
_SPLIT_PLANNERS = {Arch.SM90A: splits_sm90}
_FIRST_CALL_PLANNERS = {Arch.SM90A: first_call_sm90}
_BACKWARD_PLANNERS = {Arch.SM90A: plan_bwd_sm90}


def plan(spec: AttentionSpec, arch: Arch | str = Arch.SM90A) -> Plan:
    """Lower a spec to the schedule its kernel runs on ``arch`` (for the lengths that no
    ``seqlen_splits`` entry covers)."""
    return _PLANNERS[require_supported(arch)](spec)


def seqlen_splits(spec: AttentionSpec, arch: Arch | str = Arch.SM90A) -> tuple[SeqlenSplit, ...]:
    """The plans that launches with query sequences in a given range run instead of
    ``plan(spec, arch)`` (``fa4gen.compile`` picks per call: the first range that covers a
    length runs it, so the decode range, first, takes the shortest lengths from the short one)."""
    return _SPLIT_PLANNERS[require_supported(arch)](spec)


def first_call_plan(p: Plan) -> Plan | None:
    """A plan that computes what ``p`` computes and compiles faster, for the first calls of a
    kernel missing from the cache while ``p`` builds in the background; None: build ``p``."""
    return _FIRST_CALL_PLANNERS[require_supported(p.arch)](p)


def backward_plan(spec: AttentionSpec, arch: Arch | str = Arch.SM90A) -> Plan:
    """The schedule of ``spec``'s backward (dQ, dK, dV) on ``arch``; ValueError naming the spec
    field where it has none (``backward_problem``)."""
    return _BACKWARD_PLANNERS[require_supported(arch)](spec)


def plan_for_seqlen(spec: AttentionSpec, arch: Arch | str, seqlen_q: int) -> Plan:
    """The plan a launch whose longest query sequence has ``seqlen_q`` rows runs."""
    return next((s.plan for s in seqlen_splits(spec, arch) if s.covers(seqlen_q)), plan(spec, arch))


__all__ = [
    "Plan",
    "backward_plan",
    "backward_problem",
    "backward_workspace_shapes",
    "SeqlenSplit",
    "candidates",
    "first_call_plan",
    "plan",
    "plan_for_seqlen",
    "plan_problem",
    "seqlen_splits",
    "split_workspace_shape",
]
