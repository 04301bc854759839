"""Names for what the torch custom op (fa4gen.custom_op) runs, registered by whoever runs it.

No torch here: a compiled kernel registers its name when it is made, at no start-up cost, and the
custom op (which imports torch and registers itself with torch.library) is imported only when a
call is traced.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from fa4gen.spec import AttentionSpec


class Registered(NamedTuple):
    spec: AttentionSpec
    runner: Callable[[], Any]  # () -> the callable that runs it: kernel(q, k, v, **variant)
    # () -> its backward (fa4gen.backward.BackwardKernel), for the op's autograd formula
    backward: Callable[[], Any] | None = None


_REGISTRY: dict[str, Registered] = {}
_LOCK = threading.Lock()


def register(
    handle: str, spec: AttentionSpec, runner: Callable[[], Any], backward: Callable[[], Any] | None = None
) -> str:
    """Name what ``runner()`` returns (a callable like ``AttentionKernel``) ``handle`` for the op,
    with ``backward()`` its backward kernel; the first registration of a handle stays (handles
    name what they run: all are the same)."""
    with _LOCK:
        _REGISTRY.setdefault(handle, Registered(spec, runner, backward))
    return handle


def registered(handle: str) -> Registered:
    found = _REGISTRY.get(handle)
    if found is None:
        raise ValueError(
            f"no fa4gen kernel is registered as {handle!r} in this process: "
            "call fa4gen.compile(spec) or use fa4gen.ops.attention(spec, ...)"
        )
    return found


def live_object(object_id: int) -> Any:
    """The object whose ``id`` this is, for functions Dynamo runs while tracing
    (``torch._dynamo.assume_constant_result``), which it passes constants only (torch 2.11
    refuses objects): valid while the caller holds the object, since CPython's id is its address."""
    return ctypes.cast(object_id, ctypes.py_object).value
