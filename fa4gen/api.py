"""The four stages end to end: plan, emit, compile (or hit the cache), load.

``build`` produces (or finds) an artifact for any supported arch on any machine, GPU or not;
``compile`` builds for the current GPU (or the arch given) and loads the callable.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import fa4gen.background as background
from fa4gen._version import __version__
from fa4gen.arch import Arch, detect_arch, require_supported
from fa4gen.cache import CacheEntry, CacheMiss, KernelCache, default_cache_root, make_key
from fa4gen.emitter import emit
from fa4gen.planner import (
    Plan,
    SeqlenSplit,
    backward_plan,
    backward_problem,
    first_call_plan,
    plan,
    plan_problem,
    seqlen_splits,
)
from fa4gen.runtime import AttentionKernel, SplitKernel, load_function
from fa4gen.spec import AttentionSpec
from fa4gen.toolchain import source_fingerprint, toolchain

NO_COMPILE_ENV = "FA4GEN_NO_COMPILE"
BUILD_INFO_FILE = "build.json"


@dataclass(frozen=True)
class BuildResult:
    spec: AttentionSpec
    plan: Plan
    key: str
    entry: CacheEntry
    built_now: bool
    # the planner's plans for ranges of query lengths (planner.seqlen_splits), built beside it
    splits: tuple[tuple[SeqlenSplit, BuildResult], ...] = ()

    @property
    def any_built_now(self) -> bool:
        return self.built_now or any(built.built_now for _, built in self.splits)


def cache_key_parts(spec: AttentionSpec, kernel_plan: Plan, arch: Arch) -> dict[str, Any]:
    """Everything an artifact depends on, and nothing else (no paths, hosts, users or times)."""
    return {
        "spec": spec.canonical(),
        "plan": json.loads(kernel_plan.schedule_json()),  # what the kernel is built from: reasons left out
        "arch": arch.value,
        "fa4gen": {"version": __version__, "sources": source_fingerprint()},
        "toolchain": toolchain(),
    }


def _no_compile_default() -> bool:
    return os.environ.get(NO_COMPILE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _miss_message(spec: AttentionSpec, arch: Arch, cache: KernelCache) -> str:
    return (
        f"no cached kernel for spec ({spec.summary()}) on {arch.value} in {cache.root}, and compiling "
        f"is disabled ({NO_COMPILE_ENV}=1 or no_compile=True). Warm the cache where the spec lives, "
        f"e.g. `fa4gen warm specs/ --arch {arch.value}`, and ship that cache directory here."
    )


Progress = Callable[[str], None]


def build(
    spec: AttentionSpec,
    arch: Arch | str = Arch.SM90A,
    *,
    cache_dir: str | Path | None = None,
    no_compile: bool | None = None,
    cache: KernelCache | None = None,
    kernel_plan: Plan | None = None,
    progress: Progress | None = None,
) -> BuildResult:
    """Plan, emit and compile ``spec`` for ``arch`` into the cache, or find it there: the
    planner's plan and its plans for ranges of query lengths (``BuildResult.splits``), since
    ``fa4gen.compile`` picks among them per call.

    ``kernel_plan`` replaces the planner's default and builds only that plan (tuning compares
    candidate plans). ``progress``, if given, is called in this thread once per kernel as it is
    finished, with one line such as "compiled bfloat16 d128 causal for sm_90a (short plan) in
    12.3 s" or "cached bfloat16 d128 causal for sm_90a (default plan)"; it costs nothing else.

    Every kernel of the call stays pinned in the cache until it returns, so eviction
    (``FA4GEN_CACHE_SIZE_LIMIT``) never removes one kernel of a spec to make room for another."""
    target = require_supported(arch)
    cache = cache or KernelCache(cache_dir)
    with cache.pinned():
        if kernel_plan is not None:
            return _build_plan(spec, target, kernel_plan, cache, no_compile, progress, "given")
        main = _build_plan(spec, target, plan(spec, target), cache, no_compile, progress, "default")
        return _with_splits(main, cache, no_compile, progress)


def build_training(
    spec: AttentionSpec,
    arch: Arch | str = Arch.SM90A,
    *,
    cache_dir: str | Path | None = None,
    no_compile: bool | None = None,
    cache: KernelCache | None = None,
    progress: Progress | None = None,
) -> tuple[BuildResult, BuildResult]:
    """What training with ``spec`` runs, built into the cache (or found there): the forward with
    its LSE (``training_spec``, every length range) and the backward. ValueError naming the spec
    field where the spec has no backward."""
    target = require_supported(arch)
    cache = cache or KernelCache(cache_dir)
    with_lse = training_spec(spec)
    backward_kernel_plan = backward_plan(with_lse, target)  # (raises before anything compiles)
    with cache.pinned():
        forward = build(with_lse, target, cache=cache, no_compile=no_compile, progress=progress)
        backward = _build_plan(with_lse, target, backward_kernel_plan, cache, no_compile, progress, "backward")
    return forward, backward


def _with_splits(
    result: BuildResult, cache: KernelCache, no_compile: bool | None, progress: Progress | None = None
) -> BuildResult:
    """``result`` with the planner's plans for ranges of query lengths built beside it."""
    target = Arch.parse(result.plan.arch)
    splits = tuple(
        (split, _build_plan(result.spec, target, split.plan, cache, no_compile, progress, split.label))
        for split in seqlen_splits(result.spec, target)
    )
    return replace(result, splits=splits)


def _build_plan(
    spec: AttentionSpec,
    target: Arch,
    kernel_plan: Plan,
    cache: KernelCache,
    no_compile: bool | None,
    progress: Progress | None = None,
    label: str = "given",
) -> BuildResult:
    """One plan: emit, compile and store under its key (or find it there); ``label`` names the
    plan in the ``progress`` line."""
    if kernel_plan.arch != target.value:
        raise ValueError(f"kernel_plan is for {kernel_plan.arch}, not {target.value}")
    if problem := plan_problem(kernel_plan):
        raise ValueError(f"kernel_plan cannot run: {problem}")
    key = make_key(cache_key_parts(spec, kernel_plan, target))
    meta = {
        "spec": spec.canonical(),
        "summary": spec.summary(),
        "arch": target.value,
        "kernel": kernel_plan.kernel,
        "fa4gen_version": __version__,
        "toolchain": toolchain(),
    }

    def produce(out_dir: Path) -> None:
        from fa4gen.compiler import build_artifact

        emitted = emit(spec, kernel_plan, module_name=f"fa4gen_kernel_{key[:16]}")
        info = build_artifact(spec, kernel_plan, emitted, out_dir)
        (out_dir / BUILD_INFO_FILE).write_text(json.dumps(info, sort_keys=True))

    refuse = _no_compile_default() if no_compile is None else no_compile
    started = time.perf_counter()
    entry, built_now = cache.get_or_build(
        key, meta, produce, no_compile=refuse, miss_message=_miss_message(spec, target, cache)
    )
    if progress is not None:
        what = f"{spec.summary()} for {target.value} ({label} plan)"
        progress(f"compiled {what} in {time.perf_counter() - started:.1f} s" if built_now else f"cached {what}")
    return BuildResult(spec=spec, plan=kernel_plan, key=key, entry=entry, built_now=built_now)


def _tuned_for_this_device(spec: AttentionSpec, target: Arch, cache: KernelCache) -> Plan | None:
    """A plan `fa4gen tune` recorded for this spec on a GPU of this name, if any."""
    from fa4gen.tuned import current_device_name, tuned_plan  # (torch is imported only here)

    device = current_device_name()
    return None if device is None else tuned_plan(cache.root, spec, target, device)


_loaded: dict[tuple[str, tuple[str, ...], str], AttentionKernel] = {}
_caches: dict[str, KernelCache] = {}
_loaded_lock = threading.Lock()


def _process_cache(cache_dir: str | Path | None) -> KernelCache:
    """One KernelCache per root for the process: repeated compile() calls reuse its open index."""
    root = str(Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root())
    with _loaded_lock:
        if root not in _caches:
            _caches[root] = KernelCache(root)
        return _caches[root]


def compile(  # noqa: A001 - the public name users expect: fa4gen.compile(spec)
    spec: AttentionSpec,
    *,
    arch: Arch | str | None = None,
    cache_dir: str | Path | None = None,
    no_compile: bool | None = None,
    kernel_plan: Plan | None = None,
    prepare: bool = False,
) -> AttentionKernel:
    """A callable for ``spec`` on the current GPU: ``o = fa4gen.compile(spec)(q, k, v)``.

    Kernels come from the disk cache (``FA4GEN_CACHE_DIR``): later processes load them in
    milliseconds. The plan is ``kernel_plan`` if given (then it runs every call), else the one
    ``fa4gen tune`` recorded for this spec on a GPU of this name, else the planner's; in the last
    two cases calls whose longest query sequence falls in a range of ``planner.seqlen_splits``
    run that range's plan. A kernel missing from the cache is compiled on the first call that
    runs it, so a first call compiles one kernel, not every range's (``prepare=True`` or
    ``.prepare()`` builds them all now; ``fa4gen warm`` / ``fa4gen.build`` ahead of time). With
    ``no_compile`` (or ``FA4GEN_NO_COMPILE=1``) a cache miss raises ``fa4gen.CacheMiss`` here.
    """
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"fa4gen.compile takes an AttentionSpec, got {type(spec).__name__}")
    target = Arch.parse(arch) if arch is not None else detect_arch()
    cache = _process_cache(cache_dir)
    tuned = None if kernel_plan is not None else _tuned_for_this_device(spec, target, cache)
    refuse = _no_compile_default() if no_compile is None else no_compile
    chosen = kernel_plan or tuned or plan(spec, target)
    ranges = () if kernel_plan is not None else seqlen_splits(spec, target)
    with cache.pinned():  # from lookup until every kernel is loaded: no process evicts one
        splits = tuple(SplitKernel(split, _kernel(spec, target, split.plan, cache, refuse)) for split in ranges)
        # (a plan given by the caller runs from the first call: no first-call kernel stands in)
        kernel = _kernel(spec, target, chosen, cache, refuse, splits, first_call=kernel_plan is None)
    return kernel.prepare() if prepare else kernel


def training_spec(spec: AttentionSpec) -> AttentionSpec:
    """``spec`` with its LSE: the forward autograd runs (the backward reads the LSE), and the spec
    backward kernels are planned and cached under."""
    return spec if spec.return_lse else AttentionSpec.model_validate({**spec.model_dump(), "return_lse": True})


def _training_factory(spec: AttentionSpec, target: Arch, cache: KernelCache, refuse: bool):
    """() -> the TrainingKernels of ``spec``, made on the first call autograd records."""
    from fa4gen.backward import TrainingKernels

    made: list = []

    def training():
        if not made:
            # checked once per kernel (parsing and differentiating a modifier costs ~0.2 ms)
            if problem := backward_problem(spec):
                raise ValueError(f"autograd needs a backward, and this spec ({spec.summary()}) has none: {problem}")
            with_lse = training_spec(spec)
            forward = compile(with_lse, arch=target, cache_dir=cache.root, no_compile=refuse)
            made.append(
                TrainingKernels(
                    spec, forward, lambda: compile_backward(spec, arch=target, cache_dir=cache.root, no_compile=refuse)
                )
            )
        return made[0]

    return training


_backwards: dict[tuple[str, str], Any] = {}


def compile_backward(
    spec: AttentionSpec,
    *,
    arch: Arch | str | None = None,
    cache_dir: str | Path | None = None,
    no_compile: bool | None = None,
    kernel_plan: Plan | None = None,
):
    """``spec``'s backward on the current GPU (or ``arch``): ``dq, dk, dv = kernel(q, k, v, out,
    dout, lse)`` (fa4gen.backward.BackwardKernel), from the cache or compiled now (CacheMiss with
    ``no_compile``); ValueError naming the spec field if the spec has no backward. The plan is
    ``kernel_plan`` if given (a backward plan, checked as ``build`` checks it), else the planner's.
    Autograd through ``fa4gen.compile(spec)`` calls this on its first backward."""
    from fa4gen.backward import BackwardKernel

    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"fa4gen.compile_backward takes an AttentionSpec, got {type(spec).__name__}")
    target = Arch.parse(arch) if arch is not None else detect_arch()
    spec = training_spec(spec)
    if kernel_plan is None:
        kernel_plan = backward_plan(spec, target)
    elif not kernel_plan.is_backward:
        raise ValueError(f"kernel_plan: a backward plan is needed, got {kernel_plan.kernel}")
    cache = _process_cache(cache_dir)
    refuse = _no_compile_default() if no_compile is None else no_compile
    key = make_key(cache_key_parts(spec, kernel_plan, target))
    with _loaded_lock:
        if (key, str(cache.root)) in _backwards:
            return _backwards[(key, str(cache.root))]
    with cache.pinned():
        entry = _build_plan(spec, target, kernel_plan, cache, refuse, label="backward").entry
        kernel = BackwardKernel(spec, kernel_plan, _function_of(entry), key=key, path=entry.path)
    with _loaded_lock:
        return _backwards.setdefault((key, str(cache.root)), kernel)


def _kernel(
    spec: AttentionSpec,
    target: Arch,
    kernel_plan: Plan,
    cache: KernelCache,
    refuse: bool,
    splits: tuple[SplitKernel, ...] = (),
    first_call: bool = True,
) -> AttentionKernel:
    """The kernel of one plan (memoised per process, with its kernels for length ranges): loaded
    now if the cache has it, else built and loaded on its first launch (CacheMiss if ``refuse``),
    where ``first_call`` allows, with a first-call kernel running while it builds."""
    key = make_key(cache_key_parts(spec, kernel_plan, target))
    memo_key = (key, tuple(split.kernel.key for split in splits), str(cache.root))
    with _loaded_lock:
        kernel = _loaded.get(memo_key)
        if kernel is not None:
            return kernel
        entry = cache.lookup(key)
        function = builder = None
        if entry is not None:
            function = _function_of(entry)
        elif refuse:
            raise CacheMiss(_miss_message(spec, target, cache))
        else:
            builder = _first_launch_builder(spec, target, kernel_plan, cache, key, first_call)
        kernel = AttentionKernel(
            spec=spec,
            plan=kernel_plan,
            function=function,
            key=key,
            path=entry.path if entry is not None else None,
            splits=splits,
            builder=builder,
        )
        kernel.training = _training_factory(spec, target, cache, refuse)  # what autograd runs
        _loaded[memo_key] = kernel
    return kernel


def _first_launch_builder(
    spec: AttentionSpec, target: Arch, kernel_plan: Plan, cache: KernelCache, key: str, first_call: bool
):
    """What a first launch runs to build ``kernel_plan`` (key ``key``): where ``first_call``
    allows, the planner has a first-call plan and a core is spare (fa4gen.background), that plan
    is built here and ``kernel_plan`` in a child process, which the kernel takes over from once
    it is done."""

    def build(which: Plan) -> tuple[Any, Path]:
        with cache.pinned():
            built = _build_plan(spec, target, which, cache, no_compile=False).entry
            return _function_of(built), built.path

    def load_full() -> tuple[Any, Path]:
        entry = cache.lookup(key)
        return (_function_of(entry), entry.path) if entry is not None else build(kernel_plan)

    def first_launch() -> tuple[Any, Path, background.PendingBuild | None]:
        quick = first_call_plan(kernel_plan) if first_call and background.enabled() else None
        if quick is None or cache.lookup(key) is not None:  # (another process may have built it)
            return (*load_full(), None)
        job = {
            "spec": spec.canonical(),
            "plan": kernel_plan.model_dump(mode="json"),
            "arch": target.value,
            "cache": str(cache.root),
            "key": key,
        }
        try:
            pending = background.start(job, load_full, f"{spec.summary()} for {target.value}")
        except OSError:  # no child process here: build the planner's kernel now
            return (*build(kernel_plan), None)
        return (*build(quick), pending)

    return first_launch


def _function_of(entry: CacheEntry):
    """The loaded entry point of a cached kernel, with the CUDA flavour it was built for."""
    return load_function(entry.path, entry.meta.get("toolchain", toolchain())["cuda"])
