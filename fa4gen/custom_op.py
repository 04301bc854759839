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
registered on it needs.
"""

from __future__ import annotations

from typing import Any

import torch

from fa4gen.handles import registered as _registered
from fa4gen.spec import AttentionSpec

TENSOR_ARGUMENTS = ("sinks", "alibi_slopes", "rel_bias", "prefix_lengths", "cu_seqlens_q", "cu_seqlens_k")


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
    tensors = (sinks, alibi_slopes, rel_bias, prefix_lengths, cu_seqlens_q, cu_seqlens_k)
    variant: dict[str, Any] = {name: t for name, t in zip(TENSOR_ARGUMENTS, tensors, strict=True) if t is not None}
    if max_seqlen_q is not None:
        variant["max_seqlen_q"] = max_seqlen_q
    if max_seqlen_k is not None:
        variant["max_seqlen_k"] = max_seqlen_k
    if block_tensors:
        from fa4gen.blockmask import BlockMask

        variant["block_mask"] = BlockMask(*block_tensors, *block_sizes)
    aux = dict(zip(_names(aux_names), aux_tensors, strict=True))
    aux.update((n, _scalar(spec, n, value)) for n, value in zip(_names(scalar_names), scalar_values, strict=True))
    if aux:
        variant["aux"] = aux
    result = registered.runner()(q, k, v, **variant)
    if spec.return_lse:
        return result
    return result, q.new_empty((0,), dtype=torch.float32)


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


def call(handle: str, spec: AttentionSpec, q, k, v, *, out=None, lse=None, **variant):
    """The op on ``handle`` (registered for ``spec``), with ``AttentionKernel.__call__``'s
    arguments and results; ``out`` / ``lse`` buffers are filled from the op's outputs."""
    if lse is not None and not spec.return_lse:
        raise ValueError("lse= was given, but the spec was compiled without return_lse")
    result_out, result_lse = torch.ops.fa4gen.forward(q, k, v, *_op_arguments(handle, variant))
    return _results(spec, result_out, result_lse, out, lse)
