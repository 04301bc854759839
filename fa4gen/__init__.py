"""fa4gen: a JIT kernel-generation compiler for attention variants.

    spec = fa4gen.AttentionSpec(head_dim=128, qhead_per_kvhead=4, causal=True)
    attn = fa4gen.compile(spec)          # plan -> emit -> compile (or load from the disk cache)
    o = attn(q, k, v)

Stages, each a pure function over frozen models and each visible from the CLI:
``plan(spec, arch) -> Plan``, ``emit(spec, plan) -> EmittedKernel``, ``build(spec, arch)``
(compile into the cache), ``compile(spec)`` (build + load a callable).
"""

from fa4gen._version import __version__  # noqa: E402,F401
from fa4gen.api import BuildResult, build, compile, compile_backward  # noqa: E402,A004,F401 (compile: public, not in __all__)
from fa4gen.arch import Arch, UnsupportedArchError, detect_arch  # noqa: E402
from fa4gen.background import FirstCallWarning  # noqa: E402
from fa4gen.cache import CacheError, CacheMiss, KernelCache, ReadOnlyCacheError, UntrustedCacheError  # noqa: E402
from fa4gen.emitter import EmittedKernel, emit  # noqa: E402
from fa4gen.planner import Plan, plan  # noqa: E402
from fa4gen.runtime import AttentionKernel  # noqa: E402
from fa4gen.runtime import prepare_loader as _prepare_loader  # noqa: E402
from fa4gen.spec import AttentionSpec, spec_json_schema  # noqa: E402
from fa4gen.specfile import dump_spec, load_spec  # noqa: E402

_prepare_loader()

# `compile` is public (fa4gen.compile) but left out of __all__: a star import must not
# shadow the builtin.
__all__ = [
    "Arch",
    "AttentionKernel",
    "AttentionSpec",
    "BuildResult",
    "CacheError",
    "CacheMiss",
    "EmittedKernel",
    "FirstCallWarning",
    "KernelCache",
    "Plan",
    "ReadOnlyCacheError",
    "UnsupportedArchError",
    "UntrustedCacheError",
    "build",
    "compile_backward",
    "detect_arch",
    "dump_spec",
    "emit",
    "load_spec",
    "plan",
    "spec_json_schema",
]
