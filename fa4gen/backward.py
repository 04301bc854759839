"""Training: the backward kernel's callable and the autograd function around a compiled forward.

``BackwardKernel`` runs one compiled backward (fa4gen.kernels.sm90.bwd): ``dq, dk, dv =
kernel(q, k, v, out, dout, lse)``. ``TrainingKernels`` are what a call that autograd records runs
(``AttentionKernel.__call__`` through the custom op, whose autograd formula is in
fa4gen.custom_op): the forward of the spec with its LSE (the only tensor saved beside the inputs
and the output), and in the backward the spec's backward kernel, both from the same cache as
every other kernel.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from fa4gen.blockmask import build_backward_block_mask
from fa4gen.kernels.sm90.bwd_config import KeyTileOrder
from fa4gen.planner import Plan, backward_workspace_shapes
from fa4gen.runtime import (
    BlockMaskCache,
    DocumentTableCache,
    document_query_ranges,
    multiprocessor_count,
    tables_can_build,
    variant_arguments,
)
from fa4gen.spec import AttentionSpec
from fa4gen.tensor_checks import check_output, check_tensor, packed_as_batch, tma_aligned, validate_inputs
from fa4gen.variants import grad_name, lower

GRADS = ("dq", "dk", "dv")
PACKED = ("q", "k", "v", "out", "dout", *GRADS)
# the run-time tensors a backward takes by keyword (besides aux={...}), as the forward took them
VARIANT_TENSORS = ("sinks", "alibi_slopes", "rel_bias", "prefix_lengths", "cu_seqlens_q", "cu_seqlens_k")


class BackwardKernel:
    """A compiled backward: ``dq, dk, dv = kernel(q, k, v, out, dout, lse, dlse=None)``, then the
    sink logits' gradient for a spec with sinks, then the fp32 gradients of the run-time tensors
    the spec trains (``requires_grad``: ALiBi slopes, the relative-bias table, aux tensors in
    name order).

    q, k, v, out are the forward's (see ``AttentionKernel``), dout the gradient of out (any
    strides: it is made contiguous where it has to be), lse the forward's (B, Hq, Sq) float32
    log-sum-exp and dlse its gradient, if the LSE was used. Returns dq, dk, dv of q's, k's and
    v's shapes and dtype (written into ``dq`` / ``dk`` / ``dv`` where given); dk and dv are
    reduced over each KV head's query heads (GQA). ``variant``: the run-time values the forward
    took (``sinks=``, ``alibi_slopes=``, ``rel_bias=``, ``prefix_lengths=``, ``cu_seqlens_q=`` /
    ``cu_seqlens_k=``, ``aux=``), checked as the forward checks them. With a document mask the
    tensors are packed as the forward's: (total, H, D), lse and dlse (H, total)."""

    def __init__(self, spec: AttentionSpec, plan: Plan, function: Any, *, key: str = "", path: Path | None = None):
        self.spec, self.plan, self.key, self.path = spec, plan, key, path
        self._function = function
        self._lowered = lower(spec).for_backward()
        # an expression mask's backward block-mask tables, built by the callable after the checks
        self._tables = tuple(e for e in self._lowered.extras if e.role.startswith("bwd_block_"))
        self._checked = dataclasses.replace(
            self._lowered, extras=tuple(e for e in self._lowered.extras if e not in self._tables)
        )
        self._doc_table = DocumentTableCache()  # documents: the last call's table
        self._block_masks = BlockMaskCache()  # expression masks, per shape and aux values

    def __repr__(self) -> str:
        return f"BackwardKernel({self.spec.summary()}, arch={self.plan.arch}, key={self.key[:12]})"

    def __call__(self, q, k, v, out, dout, lse, dlse=None, *, dq=None, dk=None, dv=None, **variant):
        if not self.spec.is_varlen:
            return self._run(q, k, v, out, dout, lse, dlse, (dq, dk, dv), variant)
        # packed documents: (total, H, D) tensors and an (H, total) LSE, as the forward's; the
        # kernel sees batch 1
        packed = [_packed(name, t) for name, t in zip(PACKED, (q, k, v, out, dout, dq, dk, dv))]
        rows = [t.unsqueeze(0) if hasattr(t, "unsqueeze") else t for t in (lse, dlse)]
        grads = self._run(*packed[:5], *rows, tuple(packed[5:]), variant)
        given = (dq, dk, dv)  # (written in place: the caller's own tensors come back)
        return (*(g.squeeze(0) if t is None else t for g, t in zip(grads[:3], given)), *grads[3:])

    def _run(self, q, k, v, out, dout, lse, dlse, outputs, variant):
        import torch

        batch, seqlen_q, heads_q = validate_inputs(self.spec, q, k, v)
        o_shape, lse_shape = (batch, seqlen_q, heads_q, self.spec.dv), (batch, heads_q, seqlen_q)
        check_output("out", out, o_shape, q.dtype, q.device)
        if not isinstance(dout, torch.Tensor) or tuple(dout.shape) != o_shape or dout.dtype != q.dtype:
            raise ValueError(f"dout must be a tensor of shape {o_shape} and dtype {q.dtype}, got {_described(dout)}")
        dout = _contiguous_rows(dout)
        check_tensor("dout", dout, self.spec, self.spec.dv)
        check_output("lse", lse, lse_shape, torch.float32, q.device)
        if dlse is None:
            dlse = torch.zeros(lse_shape, dtype=torch.float32, device=q.device)
        elif not isinstance(dlse, torch.Tensor) or tuple(dlse.shape) != lse_shape or dlse.device != q.device:
            raise ValueError(f"dlse must be a tensor of shape {lse_shape} on {q.device}, got {_described(dlse)}")
        dlse = dlse.float()  # (autograd hands it in any strides, e.g. expanded from a sum)
        grads = []
        for name, given, t in zip(GRADS, outputs, (q, k, v)):
            if given is None:
                given = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            else:
                check_output(name, given, tuple(t.shape), t.dtype, t.device)
            grads.append(given)
        dq, dk, dv = grads
        given = {name: variant.pop(name, None) for name in VARIANT_TENSORS}
        aux = variant.pop("aux", None)
        if variant:
            raise TypeError(f"unexpected keyword arguments: {', '.join(sorted(variant))}")
        if self.spec.is_varlen and tables_can_build(given["cu_seqlens_q"], given["cu_seqlens_k"]):
            given["doc_query_ranges"] = self._document_table(given["cu_seqlens_q"], given["cu_seqlens_k"], q, k)
        trained = self._trained_sums(given, aux, q.device)
        given.update(trained)
        extras = self._extras(q, k, given, aux)
        trained = tuple(trained.values())
        if seqlen_q == 0 or batch == 0:  # nothing flows back: dK and dV are zero
            empty = (torch.zeros(heads_q, dtype=torch.float32, device=q.device),) if self.spec.sinks else ()
            return dq, dk.zero_(), dv.zero_(), *empty, *trained
        groups = dq_groups(self.plan, k.shape[1])
        shapes = backward_workspace_shapes(self.plan, batch, heads_q, seqlen_q, groups)
        work = {
            name: torch.empty(shape, dtype=torch.int32 if name == "dq_order" else torch.float32, device=q.device)
            for name, shape in shapes.items()
        }
        sms = multiprocessor_count(q.device)
        splits = head_splits(self.plan, batch, k.shape[2], k.shape[1], sms)
        order = key_tile_order(self.plan, batch, k.shape[2] * splits, k.shape[1], sms)
        sums = self._partial_sums(k, splits)
        lse, dlse = lse.contiguous(), dlse.contiguous()
        workspaces = (work["dq_accum"], work["dpsum"], work["lse_log2"], work["dq_order"], *sums)
        self._function(q, k, v, out, dout, lse, dlse, dq, dk, dv, *workspaces, splits, order, *extras)
        if splits > 1:  # the partials' sums, rounded
            dk.copy_(sums[0][:, : k.shape[1], :, : self.spec.head_dim])
            dv.copy_(sums[1][:, : k.shape[1], :, : self.spec.dv])
        if self.spec.sinks:
            return dq, dk, dv, sink_gradient(given["sinks"], work["lse_log2"], work["dpsum"]), *trained
        return dq, dk, dv, *trained

    def _trained_sums(self, given, aux, device) -> dict:
        """Zeroed fp32 sums for the gradients of the run-time tensors the spec trains, by kernel
        argument name, shaped like the tensors given (a missing or malformed one gets none here:
        variant_arguments names it)."""
        import torch

        sums = {}
        for extra in self._lowered.trainable:
            source = (aux or {}).get(extra.name) if extra.role == "aux" else given.get(extra.role)
            if isinstance(source, torch.Tensor):
                sums[grad_name(extra.name)] = torch.zeros(source.shape, dtype=torch.float32, device=device)
        return sums

    def _extras(self, q, k, given, aux) -> list:
        """The kernel's extras (variant_arguments); an expression mask's backward block mask,
        built (and cached) once the values it reads have passed their checks."""
        lowered, tables = self._lowered, self._tables
        if not tables:
            return variant_arguments(self.spec, q, k, given, aux, lowered=lowered)
        values = iter(variant_arguments(self.spec, q, k, given, aux, lowered=self._checked))
        batch, seqlen_q, heads, seqlen_k = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
        c = self.plan.config
        mask = self._block_masks.get(
            lowered.mask,
            (batch, heads, seqlen_q, seqlen_k, q.device),
            aux,
            lambda: build_backward_block_mask(
                self.spec,
                c.tile_m,
                c.tile_n,
                batch,
                heads,
                seqlen_q,
                seqlen_k,
                {"aux": dict(aux or {})},
                q.device,
                descending=c.dq_descending,
            ),
        )
        return [
            getattr(mask, e.role.removeprefix("bwd_block_")) if e in tables else next(values) for e in lowered.extras
        ]

    def _document_table(self, cu_seqlens_q, cu_seqlens_k, q, k):
        """``document_query_ranges`` for this kernel's key tiles (``DocumentTableCache``)."""
        return self._doc_table.get(
            cu_seqlens_q,
            cu_seqlens_k,
            (q.shape[1], k.shape[1]),
            lambda: document_query_ranges(self.spec, self.plan.config.tile_n, cu_seqlens_q, cu_seqlens_k, k.shape[1]),
        )

    def _partial_sums(self, k, splits: int):
        """dK's and dV's fp32 sums over whole key tiles, zeroed, where the query heads are split
        over CTAs; else stand-ins the kernel does not touch."""
        import torch

        c = self.plan.config
        if splits == 1:
            return tuple(
                torch.empty((1, 1, 1, width), dtype=torch.float32, device=k.device)
                for width in (c.head_dim_padded, c.head_dim_v_padded)
            )
        keys = -(-k.shape[1] // c.tile_n) * c.tile_n
        return tuple(
            torch.zeros((k.shape[0], keys, k.shape[2], width), dtype=torch.float32, device=k.device)
            for width in (c.head_dim_padded, c.head_dim_v_padded)
        )


# masked GQA backwards share a KV head's query heads out over two CTAs below this many CTAs per SM
# (decision bwd-tiles: GQA 4 causal at 512 CTAs 384 -> 394-398 TFLOP/s with 4, GQA 8 at 256 CTAs
# 311 -> 370 with 2)
SPLIT_BELOW_CTAS_PER_SM = 4


def head_splits(plan: Plan, batch: int, kv_heads: int, seqlen_k: int, sms: int) -> int:
    """CTAs per KV head and key tile: 2 where a mask makes the CTAs' work unequal, one per KV head
    would give fewer than SPLIT_BELOW_CTAS_PER_SM CTAs per SM, and the KV head has an even number
    of query heads (with two, the fp32 sum of the partials is the same in either order: dK and dV
    stay bit-identical from run to run), else 1. Without a mask the CTAs are equal and splitting
    only adds the sums (decision bwd-tiles)."""
    c = plan.config
    unequal = any(c.query_bounds) or c.expression_mask
    ctas = -(-seqlen_k // c.tile_n) * kv_heads * batch
    return 2 if unequal and c.qhead_per_kvhead % 2 == 0 and ctas < SPLIT_BELOW_CTAS_PER_SM * sms else 1


# a deterministic backward's dQ groups: at most this many partial accumulators, one more per
# this many key tiles (decision bwd-deterministic)
MAX_DQ_GROUPS = 4
KEY_TILES_PER_DQ_GROUP = 4


def dq_groups(plan: Plan, seqlen_k: int) -> int:
    """Over how many partial accumulators a deterministic backward deals each query tile's dQ
    turns (round-robin: a key tile waits only for the tiles of its group before it, so the chain
    of turns is 1/groups as long; the postprocess adds the partials in group order). 1 unless the
    plan has dq_grouped_turns."""
    if not plan.config.dq_grouped_turns:
        return 1
    key_tiles = -(-seqlen_k // plan.config.tile_n)
    return max(1, min(MAX_DQ_GROUPS, key_tiles // KEY_TILES_PER_DQ_GROUP))


# the most CTAs per SM that launch heaviest key tiles first (decision bwd-key-tile-order)
OUTERMOST_MAX_CTAS_PER_SM = 8


def key_tile_order(plan: Plan, batch: int, groups: int, seqlen_k: int, sms: int) -> int:
    """How the grid launches key tiles (KeyTileOrder), for ``groups`` CTAs per key tile and batch
    entry (KV heads times head splits):
    - a deterministic backward that adds dQ in descending key-tile order (Sm90BwdConfig.dq_descending):
      its key tiles wait on higher ones; lowest (heaviest) first they balance better and wait only
      on CTAs of their own (batch, head), which all fit on the GPU at once while there are no more
      key tiles than SMs (one CTA each). Past that, highest first, so every CTA waits only on CTAs
      launched before it (decision bwd-deterministic);
    - under a right bound (causal) without deterministic mode, with more CTAs than SMs but at most
      OUTERMOST_MAX_CTAS_PER_SM per SM: key tile 0 of every (KV head, batch) first, then key tile
      1, ...: the lowest key tiles see the most query tiles, so the heaviest CTAs start first and
      the light ones fill the tail. With more, shorter CTAs the tail is short and the natural
      order's CTAs of one (KV head, batch), which read the same Q and dO, running together in L2
      is worth more (decision bwd-key-tile-order);
    - else each (KV head, batch)'s key tiles in turn, lowest first (its CTAs share Q and dO in L2)."""
    c = plan.config
    key_tiles = -(-seqlen_k // c.tile_n)
    if c.deterministic:
        reverse = c.dq_descending and key_tiles > sms
        return int(KeyTileOrder.REVERSED if reverse else KeyTileOrder.NATURAL)
    if c.window_right is not None and sms < key_tiles * groups * batch <= OUTERMOST_MAX_CTAS_PER_SM * sms:
        return int(KeyTileOrder.OUTERMOST)
    return int(KeyTileOrder.NATURAL)


def sink_gradient(sinks, lse_log2, dpsum):
    """The sink logits' gradient, (Hq,) float32: each row gave its sink probability
    exp(sink - LSE) and no value, so d sink = -sum over rows of that probability times the row's
    dPsum (rowsum(dO * O) - dLSE); padded rows have LSE +inf and dPsum 0."""
    import torch

    probs = torch.exp2(sinks.float().view(1, -1, 1) * math.log2(math.e) - lse_log2)
    return -(probs * dpsum).sum(dim=(0, 2))


def _packed(name: str, t: Any):
    """A packed (total, H, D) tensor as the kernel's (1, total, H, D); None stays None."""
    return None if t is None else packed_as_batch(name, t)


def _described(t: Any) -> str:
    return f"{tuple(t.shape)} {t.dtype}" if hasattr(t, "shape") else type(t).__name__


def _contiguous_rows(t):
    """``t`` where TMA can read it (last dim contiguous, 16-byte strides), else a contiguous copy:
    autograd hands gradients in whatever strides the next op produced."""
    return t if t.stride(-1) == 1 and tma_aligned(t) else t.contiguous()


class TrainingKernels:
    """The kernels autograd runs for one spec: its forward with the LSE and its backward (the
    latter compiled, or found in the cache, on the first backward)."""

    def __init__(self, spec: AttentionSpec, forward_kernel, backward_loader):
        self.returns_lse, self.sinks = spec.return_lse, spec.sinks
        self.forward_kernel = forward_kernel  # AttentionKernel of the spec with return_lse
        self._backward_loader = backward_loader
        self._backward: BackwardKernel | None = None

    def backward_kernel(self) -> BackwardKernel:
        if self._backward is None:
            self._backward = self._backward_loader()
        return self._backward
