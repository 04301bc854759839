"""fa4gen kernels inside model code that torch.compile traces: ``fa4gen.ops.attention(spec, ...)``.

``fa4gen.compile(spec)`` compiles (or loads) when it is called; inside a traced model that would
run while Dynamo traces. ``attention`` names the spec's kernel to the custom op instead
(``fa4gen.custom_op``) and compiles it on the op's first real call, once per process.
"""

from __future__ import annotations

import hashlib
import threading

import torch

from fa4gen.custom_op import _op_arguments, call, check_keywords
from fa4gen.handles import live_object, register
from fa4gen.runtime import _records_grad, _traced
from fa4gen.spec import AttentionSpec

_COMPILED: dict[str, object] = {}  # spec's canonical JSON -> its compiled kernel
_BACKWARDS: dict[str, object] = {}  # ... -> its backward kernel
_COMPILE_LOCK = threading.Lock()


_HANDLES: dict[int, tuple[AttentionSpec, str]] = {}  # id(spec) -> (spec, handle): the spec kept, so ids stay its


def spec_handle(spec: AttentionSpec) -> str:
    """The op's name for ``spec``'s kernel, registered to be compiled on the op's first real call
    (memoised per spec object: decode steps call it once per layer)."""
    known = _HANDLES.get(id(spec))
    if known is not None and known[0] is spec:
        return known[1]
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"fa4gen.ops takes an AttentionSpec, got {type(spec).__name__}")
    handle = "spec-" + hashlib.sha256(spec.canonical_json().encode()).hexdigest()[:32]
    _HANDLES[id(spec)] = (spec, register(handle, spec, lambda: _kernel(spec), backward=lambda: _backward(spec)))
    return handle


def _backward(spec: AttentionSpec):
    """The spec's backward kernel, once per process (every training step's backward asks for it)."""
    from fa4gen.api import compile_backward

    return _once(_BACKWARDS, spec, compile_backward)


_TRAINING: dict[int, tuple[AttentionSpec, AttentionSpec]] = {}  # id(spec) -> (spec, the spec with its LSE)


@torch._dynamo.assume_constant_result
def _traced_training_handle(spec_id: int) -> str:
    """``spec_handle`` of the LSE-returning spec training runs for the spec whose id this is
    (as ``_traced_handle``)."""
    from fa4gen.api import training_spec

    spec = _live_spec(spec_id)
    known = _TRAINING.get(spec_id)
    if known is None or known[0] is not spec:
        known = _TRAINING[spec_id] = (spec, training_spec(spec))
    return spec_handle(known[1])


@torch._dynamo.assume_constant_result  # run while Dynamo traces; the graph keeps the name it returns
def _traced_handle(spec_id: int) -> str:
    """``spec_handle`` of the spec whose id this is. Dynamo passes such functions constants only
    (torch 2.11 refuses an object), so the spec comes by id: the traced frame holds it, so the id
    is the live object's (CPython's id is its address)."""
    return spec_handle(_live_spec(spec_id))


def _live_spec(spec_id: int) -> AttentionSpec:
    spec = live_object(spec_id)
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"fa4gen.ops takes an AttentionSpec, got {type(spec).__name__}")
    return spec


def _once(table: dict, spec: AttentionSpec, make):
    """``make(spec)``, once per process and spec (calls only look it up)."""
    key = spec.canonical_json()
    made = table.get(key)
    if made is None:
        with _COMPILE_LOCK:
            made = table.get(key)
            if made is None:
                made = table[key] = make(spec)
    return made


def _kernel(spec: AttentionSpec):
    """The callable that runs ``spec``: ``fa4gen.compile(spec)``, once per process."""
    from fa4gen.api import compile as compile_spec

    return _once(_COMPILED, spec, compile_spec)


def attention(spec: AttentionSpec, q, k, v, *, out=None, lse=None, **variant):
    """``fa4gen.compile(spec)(q, k, v, **variant)`` for model code that torch.compile traces before
    any kernel exists: traced (Dynamo, fake or meta tensors) it is the custom op, whose first real
    call compiles the kernel; run eagerly it launches the kernel directly (no dispatcher in the
    way of a decode step). Same arguments and results as ``AttentionKernel.__call__``."""
    if torch.compiler.is_compiling():
        if _records_grad(q, k, v, variant.get("sinks")) and out is None and lse is None:
            handle = _traced_training_handle(id(spec))
            out, lse = torch.ops.fa4gen.forward(q, k, v, *_op_arguments(handle, variant))
            return (out, lse) if spec.return_lse else out
        return call(_traced_handle(id(spec)), spec, q, k, v, out=out, lse=lse, **variant)
    handle = spec_handle(spec)
    if _traced(q):
        return call(handle, spec, q, k, v, out=out, lse=lse, **variant)
    check_keywords(variant)
    return _kernel(spec)(q, k, v, out=out, lse=lse, **variant)
