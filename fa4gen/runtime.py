"""Artifact -> callable: load a compiled kernel without the CuTe DSL compiler.

Loading needs only the CuTe DSL runtime library (preloaded with RTLD_GLOBAL, found through the
installed package's files, never by importing it) and apache-tvm-ffi. The callable validates its
tensors against the spec before every launch and runs on torch's current stream.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from fa4gen.compiler import ENTRY, LIBRARY_FILE
from fa4gen.planner import Plan
from fa4gen.spec import AttentionSpec

RUNTIME_LIB_ENV = "FA4GEN_CUTE_RUNTIME_LIB"  # explicit path to libcute_dsl_runtime.so
RUNTIME_LIB = "libcute_dsl_runtime.so"
TENSOR_ALIGN_BYTES = 16


@lru_cache(maxsize=None)
def preload_runtime(cuda_flavour: str = "cu13") -> str:
    """dlopen libcute_dsl_runtime.so globally so artifacts linked against it resolve."""
    explicit = os.environ.get(RUNTIME_LIB_ENV)
    candidates = [Path(explicit)] if explicit else []
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    for root in (spec.submodule_search_locations or []) if spec else []:
        flavours = [cuda_flavour] + [f for f in ("cu13", "cu12") if f != cuda_flavour]
        candidates += [Path(root) / f / "lib" / RUNTIME_LIB for f in flavours]
    for path in candidates:
        if path.is_file():
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            return str(path)
    raise RuntimeError(
        f"cannot find {RUNTIME_LIB}: install nvidia-cutlass-dsl (or nvidia-cutlass-dsl-libs-{cuda_flavour}), "
        f"or point {RUNTIME_LIB_ENV} at the library"
    )


def prepare_loader() -> None:
    """Import apache-tvm-ffi and dlopen the CuTe runtime library now (``import fa4gen`` calls
    this) in a process that already imported torch, i.e. one that will run kernels: the one-time
    ~50-100 ms they cost is paid at import, and ``fa4gen.compile()`` on a cache hit is only
    fa4gen's own lookup. Processes without torch (the CLI, CI cross-compiles) stay lazy, since
    tvm_ffi would import torch (seconds). FA4GEN_LAZY_LOADER=1 always defers. Never raises: a
    missing library is reported when a kernel is actually loaded."""
    if "torch" not in sys.modules or os.environ.get("FA4GEN_LAZY_LOADER", "") not in ("", "0"):
        return
    try:
        from fa4gen.toolchain import toolchain

        preload_runtime(toolchain()["cuda"])
        import tvm_ffi  # noqa: F401
    except Exception:  # reported by load_function, where it matters
        return


def load_function(entry_dir: Path, cuda_flavour: str = "cu13"):
    preload_runtime(cuda_flavour)
    import tvm_ffi

    module = tvm_ffi.load_module(str(Path(entry_dir) / LIBRARY_FILE))
    return getattr(module, ENTRY)


class AttentionKernel:
    """A compiled attention variant: ``o = kernel(q, k, v)`` (or ``o, lse`` with return_lse).

    q: (B, Sq, Hq, head_dim), k: (B, Sk, Hkv, head_dim), v: (B, Sk, Hkv, head_dim_v), CUDA
    tensors of the spec's dtype with the last dim contiguous and 16-byte aligned strides, and
    Hq = qhead_per_kvhead * Hkv. Returns o (B, Sq, Hq, head_dim_v) in the same dtype and, when
    the spec asks, lse (B, Hq, Sq) in float32 (natural log; -inf for rows that see no key).
    """

    def __init__(self, spec: AttentionSpec, plan: Plan, function: Any, *, key: str = "", path: Path | None = None):
        self.spec = spec
        self.plan = plan
        self.key = key
        self.path = path
        self._function = function

    def __repr__(self) -> str:
        return f"AttentionKernel({self.spec.summary()}, arch={self.plan.arch}, key={self.key[:12]})"

    def __call__(self, q, k, v, *, out=None, lse=None):
        """Run on torch's current stream. ``out`` / ``lse`` may be preallocated outputs."""
        import torch

        if lse is not None and not self.spec.return_lse:
            raise ValueError("lse= was given, but the spec was compiled without return_lse")
        batch, seqlen_q, heads_q = validate_inputs(self.spec, q, k, v)
        o_shape = (batch, seqlen_q, heads_q, self.spec.dv)
        if out is None:
            out = torch.empty(o_shape, dtype=q.dtype, device=q.device)
        else:
            _check_output("out", out, o_shape, q.dtype, q.device)
        lse_shape = (batch, heads_q, seqlen_q)
        if self.spec.return_lse:
            if lse is None:
                lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
            else:
                _check_output("lse", lse, lse_shape, torch.float32, q.device)
        if out.numel() > 0:
            self._function(q, k, v, out, lse, multiprocessor_count(q.device))
        return (out, lse) if self.spec.return_lse else out


@lru_cache(maxsize=None)
def _multiprocessor_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device) -> int:
    """SMs of ``device``: how many CTAs a persistent kernel launches (queried at call time, so
    the compiled artifact itself stays machine-independent)."""
    return _multiprocessor_count(device.index if device.index is not None else 0)


def _torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _check_tensor(name: str, t: Any, spec: AttentionSpec, last_dim: int) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dims (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
    if t.dtype != _torch_dtype(spec.dtype):
        raise ValueError(f"{name} has dtype {t.dtype}, but the spec is compiled for torch.{spec.dtype}")
    if t.shape[-1] != last_dim:
        raise ValueError(f"{name} has head dim {t.shape[-1]}, the spec needs {last_dim}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got stride {t.stride(-1)}")
    _check_alignment(name, t)


def _check_alignment(name: str, t: Any) -> None:
    elems = TENSOR_ALIGN_BYTES // t.element_size()
    if t.data_ptr() % TENSOR_ALIGN_BYTES or any(s % elems for s in t.stride()[:-1]):
        raise ValueError(
            f"{name} needs a {TENSOR_ALIGN_BYTES}-byte aligned base and strides that are multiples of "
            f"{elems} elements (got strides {t.stride()}); call .contiguous() first"
        )


def _check_output(name: str, t: Any, shape: tuple, dtype: Any, device: Any) -> None:
    import torch

    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor of shape {shape} and dtype {dtype}, got {got}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the inputs are on {device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim")
    if t.element_size() < 4:  # half-precision outputs share the inputs' 16-byte contract
        _check_alignment(name, t)


def validate_inputs(spec: AttentionSpec, q, k, v) -> tuple[int, int, int]:
    """Raise ValueError naming the argument if q, k, v do not fit the spec; return (B, Sq, Hq)."""
    _check_tensor("q", q, spec, spec.head_dim)
    _check_tensor("k", k, spec, spec.head_dim)
    _check_tensor("v", v, spec, spec.dv)
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
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
