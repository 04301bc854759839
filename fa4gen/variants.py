"""Spec -> the variant's expressions and run-time arguments, decided in one place.

Built-in score modifiers are expressions over the same language users write (``fa4gen.expr``),
so every variant has one CuTe rendering (in the emitted kernel) and one PyTorch rendering (the
test reference). The run-time arguments a variant needs beyond q, k, v (sink logits, prefix
lengths, cumulative sequence lengths, ALiBi slopes, bias tables, declared aux tensors and
scalars) are listed once, in the order the compiled kernel takes them: the compiler builds its
fake arguments from this list, the emitted module unpacks it, and the callable fills it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Union

from fa4gen.expr import AuxTensor, Expression, parse

if TYPE_CHECKING:
    from fa4gen.spec import AttentionSpec

Dim = Union[int, str]  # an integer, a size name (B, Hq, Hkv, Sq, Sk), "docs+1", or a block-mask size


@dataclass(frozen=True)
class Extra:
    """One run-time value: a kernel argument after num_ctas (``Lowered.extras``) or a call input
    the callable derives kernel arguments from (``Lowered.inputs``)."""

    name: str  # keyword of the call (aux tensors and scalars: their key in aux={...})
    role: Literal[
        "sinks",
        "prefix_lengths",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "doc_key_ranges",
        "doc_tiles",
        "doc_query_ranges",
        "block_count",
        "block_index",
        "block_full",
        "bwd_block_count",
        "bwd_block_index",
        "bwd_block_full",
        "bwd_block_turn",
        "alibi_slopes",
        "rel_bias",
        "aux",
        "scalar",
        "aux_grad",
    ]
    dtype: Literal["float32", "int32"]
    shape: tuple[Dim, ...] = ()  # () for a scalar
    trainable: bool = False  # the spec declares requires_grad: the backward gives its gradient

    @property
    def is_tensor(self) -> bool:
        return self.role != "scalar"


@dataclass(frozen=True)
class Lowered:
    score: Expression | None  # the score modifier (applied to the scaled score, before softcap)
    mask: Expression | None  # an expression mask (ANDed with the structural masks)
    extras: tuple[Extra, ...]  # the kernel's run-time arguments, in order
    # call arguments checked like extras that the kernel does not take: the callable derives
    # kernel tables from them (cu_seqlens -> every query row's key range)
    inputs: tuple[Extra, ...] = ()

    def for_backward(self) -> Lowered:
        """The backward kernel's extras: it walks keys, not query rows, so a document mask's
        per-row key ranges and ranked query tiles give way to every packed key's query rows
        (fa4gen.runtime.document_query_ranges), and an expression mask's block mask to its
        transpose (fa4gen.blockmask.build_backward_block_mask)."""
        extras: list[Extra] = []
        for extra in self.extras:
            if extra.role == "doc_key_ranges":
                # per packed key: [lo, hi) of the query rows that see it, and how many key tiles
                # below its tile some query sees (the deterministic backward's turns)
                extras.append(Extra("doc_query_ranges", "doc_query_ranges", "int32", ("Sk", 3)))
            elif extra.role == "block_count":
                # per key tile: the query tiles it walks, lowest first, and per query tile
                # whether every pair is visible and the key tile's deterministic turn
                extras.append(Extra("bwd_block_count", "bwd_block_count", "int32", ("mask_B", "mask_H", "N")))
                extras += [
                    Extra(f"bwd_block_{name}", f"bwd_block_{name}", "int32", ("mask_B", "mask_H", "N", "M"))
                    for name in ("index", "full", "turn")
                ]
            elif extra.role not in ("doc_tiles", "block_index", "block_full"):
                extras.append(extra)
        # the trainable tensors' fp32 gradients, zeroed by the callable, summed into by the kernel
        # (names no declared one can take: declared names never start with "_")
        extras += [Extra(grad_name(e.name), "aux_grad", "float32", e.shape) for e in self.trainable]
        return Lowered(score=self.score, mask=self.mask, extras=tuple(extras), inputs=self.inputs)

    @property
    def trainable(self) -> tuple[Extra, ...]:
        """The run-time tensors that receive gradients, in the kernel's order."""
        return tuple(e for e in self.extras if e.trainable)


def grad_name(name: str) -> str:
    """The backward's argument holding the gradient of run-time tensor ``name``."""
    return f"_grad_{name}"


_KIND = {"float32": "float", "int32": "int"}


def alibi_expression() -> str:
    # positions aligned bottom-right, as the causal mask: query i sits at key i + Sk - Sq
    return "score - alibi_slopes[h] * abs(q_idx + (seqlen_k - seqlen_q) - kv_idx)"


def relative_bias_expression(max_distance: int) -> str:
    d = max_distance
    return f"score + rel_bias[h, min(max(kv_idx - q_idx - (seqlen_k - seqlen_q), -{d}), {d}) + {d}]"


def _builtin_score(spec: AttentionSpec) -> tuple[str | None, list[Extra]]:
    mod = spec.score_mod
    if mod is None:
        return None, []
    if mod.kind == "alibi":
        return alibi_expression(), [Extra("alibi_slopes", "alibi_slopes", "float32", ("Hq",), mod.requires_grad)]
    if mod.kind == "relative_bias":
        width = 2 * mod.max_distance + 1
        extra = Extra("rel_bias", "rel_bias", "float32", ("Hq", width), mod.requires_grad)
        return relative_bias_expression(mod.max_distance), [extra]
    return mod.expr, []


def lower(spec: AttentionSpec) -> Lowered:
    """Parse the spec's expressions against its declarations; raise ValueError naming the field."""
    extras: list[Extra] = []
    inputs: list[Extra] = []
    if spec.sinks:
        extras.append(Extra("sinks", "sinks", "float32", ("Hq",)))
    if spec.mask_kind == "prefix_lm":
        extras.append(Extra("prefix_lengths", "prefix_lengths", "int32", ("B",)))
    if spec.mask_kind == "document":
        inputs += [
            Extra("cu_seqlens_q", "cu_seqlens_q", "int32", ("docs+1",)),
            Extra("cu_seqlens_k", "cu_seqlens_k", "int32", ("docs+1",)),
        ]
        # derived from cu_seqlens by the callable (fa4gen.runtime.document_tables): every packed
        # query row's [start, end) of packed keys, document and causal / window bounds applied
        # (one load per row, no dependent loads), and the query tiles ranked by work, most first
        # (the persistent schedule's order), each with its first and last rows' key ranges and, for
        # a tile inside one document, that document's bounds
        extras += [
            Extra("doc_key_ranges", "doc_key_ranges", "int32", ("Sq", 2)),
            Extra("doc_tiles", "doc_tiles", "int32", ("M", 9)),
        ]
    if spec.mask_kind == "expression":  # filled by fa4gen.blockmask, not by the caller
        extras += [
            Extra("block_count", "block_count", "int32", ("mask_B", "mask_H", "M")),
            Extra("block_index", "block_index", "int32", ("mask_B", "mask_H", "M", "N")),
            Extra("block_full", "block_full", "int32", ("mask_B", "mask_H", "M", "N")),
        ]
    score_text, builtin = _builtin_score(spec)
    extras += builtin
    # sorted by name: the canonical spec (and so the cache key) does not keep declaration order
    extras += [
        Extra(name, "aux", aux.dtype, tuple(aux.shape), aux.requires_grad) for name, aux in sorted(spec.aux.items())
    ]
    extras += [Extra(name, "scalar", dtype) for name, dtype in sorted(spec.scalars.items())]
    tensors = {
        e.name: AuxTensor(_KIND[e.dtype], len(e.shape), tuple(d if isinstance(d, int) else None for d in e.shape))
        for e in extras
        if e.role in ("aux", "alibi_slopes", "rel_bias")
    }
    scalars = {e.name: _KIND[e.dtype] for e in extras if e.role == "scalar"}
    score = mask = None
    if score_text is not None:
        score = _parse_field("score_mod", score_text, tensors, scalars, score=True, result="number")
    if spec.mask_kind == "expression":
        mask = _parse_field("mask", spec.mask.expr, tensors, scalars, score=False, result="condition")
    return Lowered(score=score, mask=mask, extras=tuple(extras), inputs=tuple(inputs))


def _parse_field(field: str, text: str, tensors, scalars, **kwargs) -> Expression:
    from fa4gen.expr import ExpressionError

    try:
        return parse(text, scalars=scalars, aux=tensors, **kwargs)
    except ExpressionError as exc:
        raise ValueError(f"{field}.expr: {exc}") from None


def standard_alibi_slopes(num_heads: int) -> list[float]:
    """The ALiBi paper's slopes: a geometric sequence from 2^(-8/n) for n a power of two; other
    head counts take the power of two below and every other slope of the one above."""
    if num_heads < 1:
        raise ValueError(f"ALiBi needs at least one head, got {num_heads}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    below = 1 << (num_heads.bit_length() - 1)
    if below == num_heads:
        return power_of_two(num_heads)
    return power_of_two(below) + power_of_two(2 * below)[0::2][: num_heads - below]
