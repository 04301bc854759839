"""The torch custom op ``torch.ops.fa4gen.forward``: fa4gen's kernels as torch.compile sees them.

Dynamo, AOTAutograd and Inductor see each attention call as one opaque op whose fake
implementation only computes output shapes, so a model that calls fa4gen traces with
``fullgraph=True`` and symbolic batch and sequence lengths: the kernel picks the plan of the
call's length range, counts SMs and builds its tables at run time, never while tracing. CUDA
graphs capture the op like any kernel launch.

The op names what it runs with a string handle (fa4gen.handles, registered by whoever runs it): a compiled
``AttentionKernel`` (its ``__call__`` uses the op whenever it is traced), or a spec whose kernel
is compiled on the op's first real call (``fa4gen.ops.attention``). It returns ``(out, lse)``
whether or not the spec returns the LSE (then ``lse`` is empty): the shape an autograd formula
registered on it needs. Eager calls under autograd skip the op and its autograd wrapper
(``run_with_grad``, an autograd.Function onto the same kernels): that wrapper's host time made
eager training steps host-bound.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from fa4gen.handles import live_object
from fa4gen.handles import registered as _registered
from fa4gen.spec import AttentionSpec
from fa4gen.variants import Extra, lower

TENSOR_ARGUMENTS = (
    "sinks",
    "alibi_slopes",
    "rel_bias",
    "prefix_lengths",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "seqused_k",
    "page_table",
)


# ----------------------------------------------------------------------------- the op
@torch.library.custom_op("fa4gen::forward", mutates_args=())
def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel: str,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    rel_bias: torch.Tensor | None,
    prefix_lengths: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    seqused_k: torch.Tensor | None,
    page_table: torch.Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    block_tensors: list[torch.Tensor],
    block_sizes: list[int],
    aux_names: str,
    aux_tensors: list[torch.Tensor],
    scalar_names: str,
    scalar_values: list[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``kernel`` (a handle) over q, k, v: (out, lse), lse empty unless the spec
    returns it. ``block_tensors`` / ``block_sizes`` are a BlockMask's (count, index, full) and
    (tile_m, tile_n, seqlen_q, seqlen_k), or empty; aux tensors and scalars come by name (names
    joined by commas: the schema has no list of strings, and spec names are identifiers)."""
    registered = _registered(kernel)
    spec = registered.spec
    variant = _variant(
        spec,
        (sinks, alibi_slopes, rel_bias, prefix_lengths, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table),
        (max_seqlen_q, max_seqlen_k),
        (block_tensors, block_sizes),
        (aux_names, aux_tensors, scalar_names, scalar_values),
    )
    with torch.no_grad():  # (the op's autograd formula is below: the kernel itself records nothing)
        result = registered.runner()(q, k, v, **variant)
    if spec.return_lse:
        return result
    return result, q.new_empty((0,), dtype=torch.float32)


def _variant(spec: AttentionSpec, tensors, max_seqlens, blocks, named) -> dict[str, Any]:
    """``AttentionKernel.__call__``'s keywords from the op's flat arguments (after q, k, v, kernel)."""
    variant: dict[str, Any] = {name: t for name, t in zip(TENSOR_ARGUMENTS, tensors, strict=True) if t is not None}
    for name, value in zip(("max_seqlen_q", "max_seqlen_k"), max_seqlens, strict=True):
        if value is not None:
            variant[name] = value
    block_tensors, block_sizes = blocks
    if block_tensors:
        from fa4gen.blockmask import BlockMask

        variant["block_mask"] = BlockMask(*block_tensors, *block_sizes)
    aux_names, aux_tensors, scalar_names, scalar_values = named
    aux = dict(zip(_names(aux_names), aux_tensors, strict=True))
    aux.update((n, _scalar(spec, n, value)) for n, value in zip(_names(scalar_names), scalar_values, strict=True))
    if aux:
        variant["aux"] = aux
    return variant


@forward.register_fake
def _(q, k, v, kernel, *args):
    spec = _registered(kernel).spec
    varlen = spec.is_varlen
    if q.dim() != (3 if varlen else 4):
        layout = "(total_tokens, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
        raise ValueError(f"q must be {layout} for this spec ({spec.summary()}), got shape {tuple(q.shape)}")
    if q.shape[-1] != spec.head_dim or v.shape[-1] != spec.dv:
        raise ValueError(f"head dims: q {q.shape[-1]}, v {v.shape[-1]}; the spec needs {spec.head_dim} and {spec.dv}")
    out = q.new_empty((*q.shape[:-1], spec.dv))
    if not spec.return_lse:
        return out, q.new_empty((0,), dtype=torch.float32)
    rows = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("fa4gen::backward", mutates_args=())
def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    kernel: str,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    rel_bias: torch.Tensor | None,
    prefix_lengths: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    aux_names: str,
    aux_tensors: list[torch.Tensor],
    scalar_names: str,
    scalar_values: list[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(dq, dk, dv, dsinks, trained) of the forward ``kernel`` (a handle) ran, with the run-time
    values it took (fa4gen.backward.BackwardKernel); dsinks is empty without sinks, trained holds
    the fp32 gradients of the tensors the spec trains (``trained_sources``' order)."""
    registered = _registered(kernel)
    if registered.backward is None:
        raise ValueError(f"the kernel {kernel!r} was registered without a backward")
    named = (aux_names, aux_tensors, scalar_names, scalar_values)
    tensors = (sinks, alibi_slopes, rel_bias, prefix_lengths, cu_seqlens_q, cu_seqlens_k, None, None)
    variant = _variant(registered.spec, tensors, (None, None), ([], []), named)
    grads = registered.backward()(q, k, v, out, dout, lse, dlse, **variant)
    dq, dk, dv, *rest = grads
    dsinks = rest.pop(0) if registered.spec.sinks else q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dsinks, list(rest)


@backward.register_fake
def _(q, k, v, out, dout, lse, dlse, kernel, sinks, alibi_slopes, rel_bias, *args):
    spec = _registered(kernel).spec
    dsinks = q.new_empty((0,) if sinks is None else tuple(sinks.shape), dtype=torch.float32)
    aux_names, aux_tensors = args[3], args[4]
    sources = trained_sources(spec, alibi_slopes, rel_bias, dict(zip(_names(aux_names), aux_tensors)))
    trained = [t.new_empty(t.shape, dtype=torch.float32) for t in sources]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks, trained


@lru_cache(maxsize=256)
def trainable(spec: AttentionSpec) -> tuple[Extra, ...]:
    """``lower(spec).trainable``, parsed once per spec: the training path looks it up on every
    backward (parsing a score modifier costs ~0.25 ms)."""
    return lower(spec).trainable


def trained_sources(spec: AttentionSpec, alibi_slopes, rel_bias, aux: dict) -> list[torch.Tensor]:
    """The run-time tensors the spec trains (``requires_grad``), in the backward's order."""
    by_role = {"alibi_slopes": alibi_slopes, "rel_bias": rel_bias}
    return [aux[e.name] if e.role == "aux" else by_role[e.role] for e in trainable(spec)]


# the forward op's arguments after q, k, v that the backward takes: kernel, sinks, alibi_slopes,
# rel_bias, prefix_lengths, cu_seqlens_q, cu_seqlens_k, then the aux names, tensors, scalar names
# and values (fa4gen::forward's order; seqused_k and page_table are inference only)
_BACKWARD_ARGUMENTS = (3, 4, 5, 6, 7, 8, 9, 16, 17, 18, 19)
SINKS_INPUT = 4
ALIBI_INPUT, REL_BIAS_INPUT, AUX_NAMES_INPUT, AUX_TENSORS_INPUT = 5, 6, 16, 17


def _save_for_backward(ctx, inputs, output) -> None:
    q, k, v = inputs[:3]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    # the gradients mirror the inputs: a list of Nones for each list of tensors, else None (a list
    # of numbers is one leaf to autograd)
    ctx.lists = [
        len(x) if isinstance(x, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in x) else None for x in inputs
    ]
    ctx.arguments = [inputs[i] for i in _BACKWARD_ARGUMENTS]
    ctx.aux_names = inputs[AUX_NAMES_INPUT]


def _forward_gradients(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    spec = _registered(ctx.arguments[0]).spec
    if not spec.return_lse:  # (fa4gen.compile's kernels run the spec with its LSE under autograd)
        raise RuntimeError(f"the forward of {spec.summary()} ran without its LSE: it has no backward")
    dq, dk, dv, dsinks, trained = torch.ops.fa4gen.backward(q, k, v, out, dout, lse, dlse, *ctx.arguments)
    rest = [None if n is None else [None] * n for n in ctx.lists[3:]]
    if ctx.arguments[1] is not None:  # the sinks' gradient, in their dtype
        rest[SINKS_INPUT - 3] = dsinks.to(ctx.arguments[1].dtype)
    aux_names = _names(ctx.aux_names)
    for extra, grad in zip(trainable(spec), trained, strict=True):
        if extra.role == "aux":
            rest[AUX_TENSORS_INPUT - 3][aux_names.index(extra.name)] = grad
        else:
            rest[(ALIBI_INPUT if extra.role == "alibi_slopes" else REL_BIAS_INPUT) - 3] = grad
    return (dq, dk, dv, *rest)


forward.register_autograd(_forward_gradients, setup_context=_save_for_backward)


def _names(joined: str) -> list[str]:
    return joined.split(",") if joined else []


def _scalar(spec: AttentionSpec, name: str, value: float):
    """A scalar as the spec declares it (the op carries every scalar as a float)."""
    if spec.scalars.get(name) == "int32" and float(value).is_integer():
        return int(value)
    return value


# ----------------------------------------------------------------------------- calling it
KEYWORDS = frozenset((*TENSOR_ARGUMENTS, "max_seqlen_q", "max_seqlen_k", "block_mask", "aux"))


def check_keywords(variant: dict[str, Any]) -> None:
    """The run-time values ``AttentionKernel.__call__`` takes (besides out / lse), and no others."""
    unknown = sorted(set(variant) - KEYWORDS)
    if unknown:
        raise TypeError(f"unexpected keyword arguments: {', '.join(unknown)}")


def _op_arguments(handle: str, variant: dict[str, Any]) -> list[Any]:
    """The op's arguments after q, k, v: what ``AttentionKernel.__call__`` takes as keywords."""
    check_keywords(variant)
    variant = dict(variant)
    tensors = [variant.pop(name, None) for name in TENSOR_ARGUMENTS]
    max_q, max_k = variant.pop("max_seqlen_q", None), variant.pop("max_seqlen_k", None)
    block_mask = variant.pop("block_mask", None)
    aux = variant.pop("aux", None) or {}
    block_tensors, block_sizes = [], []
    if block_mask is not None:
        block_tensors = [block_mask.count, block_mask.index, block_mask.full]
        block_sizes = [block_mask.tile_m, block_mask.tile_n, block_mask.seqlen_q, block_mask.seqlen_k]
    named_tensors = [(n, t) for n, t in aux.items() if isinstance(t, torch.Tensor)]
    named_scalars = [(n, s) for n, s in aux.items() if not isinstance(s, torch.Tensor)]
    for name, value in named_scalars:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"aux[{name!r}] must be a tensor or a number, got {type(value).__name__}")
    return [
        handle,
        *tensors,
        max_q,
        max_k,
        block_tensors,
        block_sizes,
        ",".join(n for n, _ in named_tensors),
        [t for _, t in named_tensors],
        ",".join(n for n, _ in named_scalars),
        [float(s) for _, s in named_scalars],
    ]


def _results(spec: AttentionSpec, out, lse, given_out=None, given_lse=None):
    """``AttentionKernel.__call__``'s return value from the op's, written into the given buffers."""
    if given_out is not None:
        given_out.copy_(out)
        out = given_out
    if given_lse is not None:
        given_lse.copy_(lse)
        lse = given_lse
    return (out, lse) if spec.return_lse else out


@torch._dynamo.assume_constant_result  # run while Dynamo traces; the graph keeps the name it returns
def _training_handle(kernel_id: int) -> str:
    """The handle of the forward-with-LSE kernel of the ``AttentionKernel`` whose id this is (made
    on first use: ``fa4gen.backward.TrainingKernels``); by id, as ops._traced_handle."""
    return live_object(kernel_id).training().forward_kernel.handle


def call_with_grad(kernel, q, k, v, variant: dict[str, Any]):
    """``AttentionKernel.__call__`` under autograd: the op on the kernel of the spec with its LSE,
    whose autograd formula runs the backward; returns out (and lse if the spec returns it)."""
    if torch.compiler.is_compiling():
        handle = _training_handle(id(kernel))
    else:
        handle = kernel.training().forward_kernel.handle
    out, lse = torch.ops.fa4gen.forward(q, k, v, *_op_arguments(handle, variant))
    return (out, lse) if kernel.spec.return_lse else out


def call(handle: str, spec: AttentionSpec, q, k, v, *, out=None, lse=None, **variant):
    """The op on ``handle`` (registered for ``spec``), with ``AttentionKernel.__call__``'s
    arguments and results; ``out`` / ``lse`` buffers are filled from the op's outputs."""
    if lse is not None and not spec.return_lse:
        raise ValueError("lse= was given, but the spec was compiled without return_lse")
    result_out, result_lse = torch.ops.fa4gen.forward(q, k, v, *_op_arguments(handle, variant))
    return _results(spec, result_out, result_lse, out, lse)


def run_with_grad(kernel, q, k, v, variant: dict):
    """``AttentionKernel.__call__`` under autograd, run eagerly: an autograd.Function whose forward
    launches the spec's forward with its LSE and whose backward launches the backward kernel,
    with no dispatcher between (the custom op's autograd path costs about 1 ms of host time per
    training step: decision bwd-eager-autograd). Gradients reach q, k, v, the sink logits and the
    tensors the spec trains. Traced calls (torch.compile) take the custom op above instead."""
    slots, tensors = [], []
    if kernel.spec.sinks and variant.get("sinks") is not None:
        slots.append(("sinks", None))
        tensors.append(variant["sinks"])
    for extra in trainable(kernel.spec):
        holder = (variant.get("aux") or {}) if extra.role == "aux" else variant
        key = extra.name if extra.role == "aux" else extra.role
        if holder.get(key) is not None:
            slots.append((extra.role, extra.name))
            tensors.append(holder[key])
    out, lse = _EagerTraining.apply(kernel.training(), variant, tuple(slots), q, k, v, *tensors)
    return (out, lse) if kernel.spec.return_lse else out


class _EagerTraining(torch.autograd.Function):
    """``run_with_grad``'s autograd node: the training kernels launched directly."""

    @staticmethod
    def forward(ctx, training, variant, slots, q, k, v, *tensors):
        out, lse = training.forward_kernel(q, k, v, **variant)  # (grad mode is off in here)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.training, ctx.variant, ctx.slots = training, variant, slots
        ctx.dtypes = [t.dtype for t in tensors]
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, *rest = ctx.training.backward_kernel()(q, k, v, out, dout, lse, dlse, **ctx.variant)
        dsinks = rest.pop(0) if ctx.training.sinks else None
        trained = iter(rest)
        grads = [dsinks if role == "sinks" else next(trained) for role, _ in ctx.slots]
        return None, None, None, dq, dk, dv, *(g.to(t) for g, t in zip(grads, ctx.dtypes))
