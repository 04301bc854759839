"""The plan: which kernel runs a spec on an arch, its config, and a short reason per choice.

A plan is a frozen model: everything the kernel needs as compile-time constants (its config,
fa4gen.kernels.sm90.config) and nothing that depends on the machine doing the planning. Whether
a plan can run is answered by the kernel family's one check (``config_problem``).
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict

from fa4gen.arch import WARPGROUP_THREADS, WGMMA_M
from fa4gen.kernels.sm90.bwd_config import Sm90BwdConfig, bwd_config_problem, bwd_smem_bytes
from fa4gen.kernels.sm90.config import Sm90FwdConfig, config_problem, config_smem_bytes, split_partial_words
from fa4gen.kernels.sm90.decode_config import Sm90DecodeConfig, decode_config_problem, decode_smem_bytes


class Plan(BaseModel):
    """How one spec runs on one arch: the kernel class, its config and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    arch: str
    kernel: str  # kernel class that runs this plan
    # the forward's, the backward's (kernel HopperAttentionBackward) or decode's (HopperAttentionDecode)
    config: Sm90FwdConfig | Sm90BwdConfig | Sm90DecodeConfig
    reasons: dict[str, str]  # config field -> why (fields the spec fixes have none)

    @property
    def smem_bytes(self) -> int:
        if isinstance(self.config, Sm90BwdConfig):
            return bwd_smem_bytes(self.config)
        if isinstance(self.config, Sm90DecodeConfig):
            return decode_smem_bytes(self.config)
        return config_smem_bytes(self.config)

    @property
    def is_backward(self) -> bool:
        return isinstance(self.config, Sm90BwdConfig)

    @property
    def is_decode(self) -> bool:
        return isinstance(self.config, Sm90DecodeConfig)

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))

    def schedule_json(self) -> str:
        """The plan as compact data, reasons left out: what the emitted module records."""
        data = {"arch": self.arch, "kernel": self.kernel, "config": self.config.model_dump()}
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    def with_config(self, why: str, **update) -> Plan:
        """A variation of this plan (tuning candidates, A/B scripts): ``update`` config fields,
        each with ``why`` as its reason."""
        config = self.config.model_copy(update=update)
        return self.model_copy(update={"config": config, "reasons": {**self.reasons, **dict.fromkeys(update, why)}})

    def describe(self) -> str:
        lines = [f"plan for {self.arch} ({self.kernel})"]
        for name, value in self.config.model_dump().items():
            lines.append(f"  {name:26} {str(value):10} {self.reasons.get(name, '')}".rstrip())
        lines.append(f"  {'smem_bytes':26} {self.smem_bytes}")
        return "\n".join(lines)


class SeqlenSplit(BaseModel):
    """Another plan for launches whose longest query sequence has between ``min_seqlen_q`` and
    ``max_seqlen_q`` rows (None: no upper limit); ``fa4gen.compile`` picks per call. With
    ``page_table`` the plan runs launches over a paged KV cache instead, with ``cache_only`` launches
    over a contiguous one (``seqused_k``); the runtime picks among those by their tiles' packed rows
    (fa4gen.runtime.AttentionKernel.decode_kernel and paged_kernel)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    label: str  # names the range in CLI output and golden files (e.g. short)
    min_seqlen_q: int = 1
    max_seqlen_q: int | None = None
    page_table: bool = False
    cache_only: bool = False
    plan: Plan
    reason: str

    @property
    def plain(self) -> bool:
        """Whether launches without a KV cache may run this plan (by their query length)."""
        return not (self.page_table or self.cache_only)

    def covers(self, seqlen_q: int) -> bool:
        """Whether a launch without a KV cache of this longest query length runs this plan."""
        if not self.plain:
            return False
        return self.min_seqlen_q <= seqlen_q and (self.max_seqlen_q is None or seqlen_q <= self.max_seqlen_q)

    def rows(self) -> str:
        if not self.plain:
            cache = "a page_table" if self.page_table else "seqused_k"
            rows = f"more than {WGMMA_M}" if self.plan.config.tile_m > WGMMA_M else f"up to {WGMMA_M}"
            return f"launches with {cache} of {rows} packed rows (query rows x query heads per KV head)"
        if self.max_seqlen_q is None:
            return f"at least {self.min_seqlen_q} query rows"
        if self.min_seqlen_q <= 1:
            return f"at most {self.max_seqlen_q} query rows"
        return f"{self.min_seqlen_q} to {self.max_seqlen_q} query rows"

    def describe(self) -> str:
        return f"{self.label} sequences ({self.rows()}) run this plan instead: {self.reason}\n{self.plan.describe()}"


def plan_problem(p: Plan) -> str:
    """Why the GPU cannot run ``p`` ("" when it can): the kernel family's one check."""
    if isinstance(p.config, Sm90BwdConfig):
        return bwd_config_problem(p.config)
    if isinstance(p.config, Sm90DecodeConfig):
        return decode_config_problem(p.config)
    return config_problem(p.config)


def split_workspace_shape(p: Plan, num_ctas: int) -> tuple[int, int, int, int] | None:
    """The split tail's fp32 workspace: per CTA and consumer warpgroup, each thread's partial
    (split_partial_words), thread fastest; its int32 flags are the first two modes. None
    without a split tail."""
    c = p.config
    if not isinstance(c, Sm90FwdConfig) or not c.split_tail:
        return None
    return num_ctas, c.num_consumer_warpgroups, split_partial_words(c.head_dim_v_padded), WARPGROUP_THREADS


def backward_workspace_shapes(
    p: Plan, batch: int, heads: int, seqlen_q: int, dq_groups: int = 1
) -> dict[str, tuple[int, ...]]:
    """The backward's workspaces (fa4gen.kernels.sm90.bwd): dQ's fp32 accumulator and the rows'
    dPsum and LSE in log2 units, over whole query tiles; ``dq_order`` (int32): deterministic, a
    semaphore per query tile and consumer warpgroup, else a stand-in the kernel does not touch.
    With dq_grouped_turns, dQ's accumulator and semaphores repeat per dQ group (``dq_groups``, a
    run-time choice: backward.dq_groups), whose partials the postprocess adds in group order."""
    c = p.config
    assert isinstance(c, Sm90BwdConfig), "a backward plan"
    assert dq_groups == 1 or (c.dq_grouped_turns and dq_groups > 1), "dQ groups need dq_grouped_turns"
    tiles = -(-max(seqlen_q, 1) // c.tile_m)
    rows = tiles * c.tile_m
    order = (batch, heads, dq_groups * tiles) if c.deterministic else (1, 1, 1)
    order = (*order, c.num_consumer_warpgroups)  # (static in the kernel: the stand-in has it too)
    return {
        "dq_accum": (batch, heads, dq_groups * rows, c.head_dim_padded),
        "dpsum": (batch, heads, rows),
        "lse_log2": (batch, heads, rows),
        "dq_order": order,
    }
