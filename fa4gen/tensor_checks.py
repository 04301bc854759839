"""Checks of a launch's tensors and scalars against the spec, before anything is launched: each
raises ValueError in one line naming the argument and what is allowed (the forward's callable,
fa4gen.runtime, and the backward's, fa4gen.backward)."""

from __future__ import annotations

from typing import Any

from fa4gen.kv_cache import check_page_table
from fa4gen.spec import AttentionSpec
from fa4gen.variants import Extra, lower

TENSOR_ALIGN_BYTES = 16


def validate_aux_for_mask(spec: AttentionSpec, aux) -> None:
    """Every scalar and aux tensor the expression mask reads must be given."""
    missing = sorted(n for n in lower(spec).mask.uses if n in {**spec.aux, **spec.scalars} and n not in (aux or {}))
    if missing:
        raise ValueError(f"the expression mask reads {', '.join(missing)}: pass them in aux={{...}}")


def torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def check_tensor(name: str, t: Any, spec: AttentionSpec, last_dim: int) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dims (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
    if t.dtype != torch_dtype(spec.dtype):
        raise ValueError(f"{name} has dtype {t.dtype}, but the spec is compiled for torch.{spec.dtype}")
    if t.shape[-1] != last_dim:
        raise ValueError(f"{name} has head dim {t.shape[-1]}, the spec needs {last_dim}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got stride {t.stride(-1)}")
    check_alignment(name, t)


def tma_aligned(t: Any) -> bool:
    """Whether TMA can read ``t``: a 16-byte aligned base and strides (but the last) of 16 bytes."""
    elems = TENSOR_ALIGN_BYTES // t.element_size()
    return t.data_ptr() % TENSOR_ALIGN_BYTES == 0 and not any(s % elems for s in t.stride()[:-1])


def check_alignment(name: str, t: Any) -> None:
    elems = TENSOR_ALIGN_BYTES // t.element_size()
    if not tma_aligned(t):
        raise ValueError(
            f"{name} needs a {TENSOR_ALIGN_BYTES}-byte aligned base and strides that are multiples of "
            f"{elems} elements (got strides {t.stride()}); call .contiguous() first"
        )


def check_output(name: str, t: Any, shape: tuple, dtype: Any, device: Any) -> None:
    import torch

    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor of shape {shape} and dtype {dtype}, got {got}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the inputs are on {device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim")
    if t.element_size() < 4:  # half-precision outputs share the inputs' 16-byte contract
        check_alignment(name, t)


def validate_inputs(spec: AttentionSpec, q, k, v, page_table=None) -> tuple[int, int, int]:
    """Raise ValueError naming the argument if q, k, v (with ``page_table``: k and v a page pool
    (pages, page size, Hkv, D)) do not fit the spec; return (B, Sq, Hq)."""
    check_tensor("q", q, spec, spec.head_dim)
    check_tensor("k", k, spec, spec.head_dim)
    check_tensor("v", v, spec, spec.dv)
    if page_table is not None:
        check_page_table(page_table, q, k, v)
    elif not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    elif k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same seqlen, got k {k.shape[1]} and v {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same number of heads, got k {k.shape[2]} and v {v.shape[2]}")
    if q.shape[2] != k.shape[2] * spec.qhead_per_kvhead:
        raise ValueError(
            f"q has {q.shape[2]} heads and k has {k.shape[2]}: the spec needs q heads = "
            f"{spec.qhead_per_kvhead} x kv heads"
        )
    if k.shape[1] == 0 and q.shape[1] > 0:
        raise ValueError("k and v have seqlen 0: every query needs at least one key")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_cuda:
            raise ValueError(f"{name} is on {t.device}; fa4gen kernels need CUDA tensors")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    return q.shape[0], q.shape[1], q.shape[2]


def packed_as_batch(name: str, t: Any, check: bool = True):
    """A packed (total, H, D) tensor as the kernel's (1, total, H, D)."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if check and t.dim() != 3:
        raise ValueError(
            f"{name} must be packed as (total_tokens, heads, head_dim) for a document mask, got shape {tuple(t.shape)}"
        )
    return t.unsqueeze(0) if t.dim() == 3 else t


def resolve_dim(dim, sizes: dict[str, int], name: str) -> int:
    if isinstance(dim, int):
        return dim
    if dim not in sizes:
        raise ValueError(f"{name}: unknown size {dim!r}")
    return sizes[dim]


def check_extra_tensor(extra: Extra, t: Any, sizes: dict[str, int], device: Any) -> None:
    import torch

    dtype = {"float32": torch.float32, "int32": torch.int32}[extra.dtype]
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{extra.name} must be a torch.Tensor of dtype {dtype}, got {type(t).__name__}")
    shape = tuple(resolve_dim(d, sizes, extra.name) for d in extra.shape)
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise ValueError(
            f"{extra.name} must be a {dtype} tensor of shape {shape} "
            f"({', '.join(map(str, extra.shape))}), got {t.dtype} {tuple(t.shape)}"
        )
    if t.device != device:
        raise ValueError(f"{extra.name} is on {t.device}, the inputs are on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{extra.name} must be contiguous; call .contiguous() first")


def check_scalar(extra: Extra, value: Any):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"scalar {extra.name} must be a number, got {type(value).__name__}")
    if extra.dtype == "int32":
        if not isinstance(value, int) or not -(2**31) <= value < 2**31:
            raise ValueError(f"scalar {extra.name} is int32: got {value!r}")
        return int(value)
    return float(value)
