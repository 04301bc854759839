"""Artifact -> callable: load a compiled kernel without the CuTe DSL compiler.

Loading needs only the CuTe DSL runtime library (preloaded with RTLD_GLOBAL, found through the
installed package's files, never by importing it) and apache-tvm-ffi. The callable validates its
tensors against the spec before every launch and runs on torch's current stream.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import fa4gen.background as background
from fa4gen.blockmask import build_block_mask, check_block_mask
from fa4gen.compiler import ENTRY, LIBRARY_FILE
from fa4gen.handles import register
from fa4gen.kv_cache import (
    cache_capacity,
    check_cache_lengths,
    decode_arguments,
    kept_per_stream,
    unused_block_mask,
)
from fa4gen.planner import Plan, SeqlenSplit, split_workspace_shape
from fa4gen.spec import AttentionSpec
from fa4gen.tensor_checks import (
    check_extra_tensor,
    check_output,
    check_scalar,
    packed_as_batch,
    validate_aux_for_mask,
    validate_inputs,
)
from fa4gen.variants import lower, standard_alibi_slopes

RUNTIME_LIB_ENV = "FA4GEN_CUTE_RUNTIME_LIB"  # explicit path to libcute_dsl_runtime.so
RUNTIME_LIB = "libcute_dsl_runtime.so"


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
    Over a KV cache, ``seqused_k`` (int32 (B,)) gives each entry's length; with ``page_table``
    (int32 (B, max pages)) k and v are a page pool (pages, page size, Hkv, D), page size a
    multiple of 16, read through the table (``paged_kernel``).
    """

    def __init__(
        self,
        spec: AttentionSpec,
        plan: Plan,
        function: Any,
        *,
        key: str = "",
        path: Path | None = None,
        splits: tuple[SplitKernel, ...] = (),
        builder: Callable[[], tuple[Any, Path, Any]] | None = None,
    ):
        self.spec = spec
        self.plan = plan
        self.key = key
        self.path = path
        self.splits = splits  # the kernels of the planner's plans for ranges of query lengths
        self._cache_kernels: dict[bool, list] = {}  # paged -> decode kernels by rows per tile (_cache_kernel)
        self._function = function
        # () -> (function, entry path, pending): builds and loads this plan's kernel on its first
        # launch (fa4gen.compile on a cache miss), so a first call compiles only the kernel it
        # runs; or a first-call kernel, with the plan's building elsewhere (fa4gen.background)
        self._builder = builder
        self._pending = None  # background.PendingBuild of this plan's kernel while a first-call one runs
        self._build_lock = threading.Lock()
        self._block_masks = BlockMaskCache()  # expression masks, per shape and aux values
        self._doc_tables = DocumentTableCache()  # document masks: the last call's tables
        self._lowered = lower(spec)  # parsed once: calls only look it up
        self.handle = op_handle(self)  # names this kernel to the torch custom op (fa4gen.custom_op)
        # () -> fa4gen.backward.TrainingKernels: what autograd runs (set by fa4gen.compile)
        self.training: Callable[[], Any] | None = None

    def __repr__(self) -> str:
        splits = "".join(f", {s.split.label} ({s.split.rows()})={s.kernel.key[:12]}" for s in self.splits)
        return f"AttentionKernel({self.spec.summary()}, arch={self.plan.arch}, key={self.key[:12]}{splits})"

    @property
    def built(self) -> bool:
        """Whether a kernel for this plan is compiled and loaded (its length ranges' may not be):
        the plan's own, or its first-call kernel while the plan's builds (``building``)."""
        return self._function is not None

    @property
    def building(self) -> bool:
        """Whether a first-call kernel runs while this plan's builds in another process."""
        return self._pending is not None

    def prepare(self, ranges: bool = True) -> AttentionKernel:
        """Build and load the kernels of every length range now rather than on first use (what
        ``fa4gen.compile`` leaves for later on a cache miss), waiting for those building in the
        background; ``ranges=False``: this plan's kernel only. Returns self."""
        for kernel in (self, *(split.kernel for split in self.splits if ranges)):
            kernel._loaded_function()
            kernel._take_over(wait=True)
        return self

    def _loaded_function(self):
        if self._function is None:
            with self._build_lock:  # one build per kernel, whichever thread launches first
                if self._function is None:
                    if self._builder is None:
                        raise RuntimeError(f"{self!r} has no compiled function and nothing to build it with")
                    self._function, self.path, self._pending = self._builder()
        return self._function

    def _take_over(self, wait: bool = False):
        """The function to launch: the plan's own once its background build is done (a waitpid
        per call until then), else the first-call kernel; a failed build leaves the latter."""
        pending = self._pending
        if pending is not None:
            with self._build_lock:
                if self._pending is not None:
                    try:
                        done = self._pending.poll(wait)
                    except background.BackgroundBuildFailed:
                        done, self._pending = None, None
                    if done is not None:
                        (self._function, self.path), self._pending = done, None
        return self._function

    def kernel_for(self, seqlen_q: int | None) -> AttentionKernel:
        """The kernel that runs a launch whose longest query sequence is ``seqlen_q`` rows: the
        kernel of the length range that covers it, else this one (also when the length is unknown)."""
        covering = (s.kernel for s in self.splits if seqlen_q is not None and s.split.covers(seqlen_q))
        return next(covering, self)

    def __call__(self, q, k, v, *, out=None, lse=None, **variant):
        """Run on torch's current stream. ``out`` / ``lse`` may be preallocated outputs; the
        other keywords are the variant's run-time values (see ``AttentionSpec``): each is
        required exactly when the spec uses it. With a document mask q, k, v are packed
        (total, H, D) tensors delimited by ``cu_seqlens_q`` / ``cu_seqlens_k`` (``max_seqlen_q``
        picks the kernel of its length range, if any; tiles cover the packed tokens). An
        expression mask runs with a block mask: ``block_mask`` from ``self.block_mask(...)``,
        else one built on the GPU and cached per shape, scalar values and aux tensors.

        While torch.compile traces (or with fake / meta tensors) the call is the custom op
        ``torch.ops.fa4gen.forward`` (fa4gen.ops), which Dynamo and CUDA graphs treat as one
        opaque kernel; eager calls launch directly."""
        if _records_grad(q, k, v, *_trainable_inputs(variant)):
            return self._with_grad(q, k, v, out, lse, variant)
        if _traced(q):
            from fa4gen.custom_op import call

            return call(self.handle, self.spec, q, k, v, out=out, lse=lse, **variant)
        if variant.get("page_table") is not None:
            kernel = self.paged_kernel(q.shape[1])
        elif variant.get("seqused_k") is not None:
            kernel = self.decode_kernel(q.shape[1])
        else:
            kernel = self.kernel_for(_longest_query(self.spec, q, variant.get("max_seqlen_q")))
        return kernel._launch(q, k, v, out=out, lse=lse, **variant)

    def decode_kernel(self, seqlen_q: int = 1) -> AttentionKernel:
        """The decode kernel that runs a launch of ``seqlen_q`` query rows over a KV cache with
        per-entry lengths (``seqused_k``), whatever its query length; ValueError where the variant
        has none."""
        return self._cache_kernel(False, seqlen_q)

    def paged_kernel(self, seqlen_q: int = 1) -> AttentionKernel:
        """The decode kernel that runs a launch of ``seqlen_q`` query rows with a ``page_table``
        (over a paged KV cache), whatever its query length; ValueError where the variant has none."""
        return self._cache_kernel(True, seqlen_q)

    def _cache_kernel(self, paged: bool, seqlen_q: int) -> AttentionKernel:
        """Of this kernel and the splits' the decode kernels of that layout (``paged`` or not), the
        one with the fewest rows per tile that holds the launch's packed rows (query rows x query
        heads per KV head), else the one with the most."""
        from fa4gen.planner.sm90_decode import decode_problem

        found = self._cache_kernels.get(paged)
        if found is None:  # once per kernel: a launch only scans the (one or two) kernels found
            kernels = (k for k in (self, *(s.kernel for s in self.splits)) if k.plan.is_decode)
            found = sorted((k for k in kernels if k.plan.config.paged == paged), key=lambda k: k.plan.config.tile_m)
            self._cache_kernels[paged] = found
        if not found:
            argument, kernel = ("page_table", "paged decode kernel") if paged else ("seqused_k", "decode kernel")
            raise ValueError(
                f"{argument}= needs the {kernel}, which this spec has none of: {decode_problem(self.spec)}"
            )
        rows = max(seqlen_q, 1) * self.spec.qhead_per_kvhead
        return next((k for k in found if rows <= k.plan.config.tile_m), found[-1])

    def _with_grad(self, q, k, v, out, lse, variant):
        """The call under autograd: the custom op on the forward with its LSE, whose autograd
        formula runs the backward (fa4gen.custom_op). A spec without a backward raises when the
        training kernels are first made (api._training_factory), before anything compiles."""
        from fa4gen.custom_op import call_with_grad

        given = [name for name, value in (("out", out), ("lse", lse)) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)}=: output buffers are not supported while autograd records the call")
        trains = {"sinks", *(e.name for e in self._lowered.trainable)}
        untrained = [
            f"{name}="
            for name, value in variant.items()
            if name not in trains and getattr(value, "requires_grad", False)
        ]
        untrained += [
            f"aux[{name!r}]"
            for name, value in (variant.get("aux") or {}).items()
            if name not in trains and getattr(value, "requires_grad", False)
        ]
        if untrained:
            raise ValueError(
                f"{', '.join(untrained)} requires grad, but the spec does not train it: declare requires_grad: true "
                "(an aux tensor's, or score_mod's for ALiBi slopes and relative-bias tables)"
            )
        if self.training is None:
            raise RuntimeError(f"{self!r} was not made by fa4gen.compile, which gives it its backward")
        if _traced(q):  # torch.compile sees the custom op and its registered autograd formula
            return call_with_grad(self, q, k, v, variant)
        from fa4gen.custom_op import run_with_grad

        return run_with_grad(self, q, k, v, variant)

    def _launch(
        self,
        q,
        k,
        v,
        *,
        out=None,
        lse=None,
        sinks=None,
        alibi_slopes=None,
        rel_bias=None,
        prefix_lengths=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        aux=None,
        block_mask=None,
        seqused_k=None,
        page_table=None,
    ):
        """Validate, then launch this kernel (see ``__call__``)."""
        import torch

        paged = self.plan.is_decode and self.plan.config.paged
        if (page_table is not None) != paged:
            raise ValueError(
                "page_table= runs on the paged decode kernel (AttentionKernel.paged_kernel), and only that one"
            )
        if lse is not None and not self.spec.return_lse:
            raise ValueError("lse= was given, but the spec was compiled without return_lse")
        varlen = self.spec.is_varlen
        if varlen:
            q, k, v = (packed_as_batch(name, t) for name, t in (("q", q), ("k", k), ("v", v)))
        batch, seqlen_q, heads_q = validate_inputs(self.spec, q, k, v, page_table)
        given_out, given_lse = out, lse
        out, lse = self._outputs(q, out, lse)
        given = {
            "sinks": sinks,
            "alibi_slopes": alibi_slopes,
            "rel_bias": rel_bias,
            "prefix_lengths": prefix_lengths,
            "cu_seqlens_q": cu_seqlens_q,
            "cu_seqlens_k": cu_seqlens_k,
        }
        if varlen and tables_can_build(cu_seqlens_q, cu_seqlens_k):
            given["doc_key_ranges"], given["doc_tiles"] = self._document_tables(cu_seqlens_q, cu_seqlens_k, seqlen_q)
        given.update(self._block_mask_arguments(q, k, block_mask, aux))
        extras = variant_arguments(
            self.spec,
            q,
            k,
            given,
            aux,
            max_seqlens=(max_seqlen_q, max_seqlen_k),
            lowered=self._lowered,
            seqlen_k=cache_capacity(k, page_table),  # a page pool's: an entry's, not one page's
        )
        if seqused_k is not None:
            check_cache_lengths(seqused_k, batch, q.device)
        if out.numel() > 0:
            function = self._function or self._loaded_function()  # built on a first launch only
            if self._pending is not None and not torch.cuda.is_current_stream_capturing():
                function = self._take_over()  # (a graph being captured keeps what it has)
            if self.plan.is_decode:
                self._launch_decode(function, q, k, v, out, lse, seqused_k, page_table, extras)
            else:
                num_ctas = multiprocessor_count(q.device)
                work, flags = split_workspace(self.plan, q.device, num_ctas)
                function(q, k, v, out, lse, work, flags, num_ctas, *extras)
        if varlen:
            out = out.squeeze(0) if given_out is None else given_out
            lse = None if lse is None else lse.squeeze(0) if given_lse is None else given_lse
        return (out, lse) if self.spec.return_lse else out

    def _outputs(self, q, out, lse):
        """(out, lse) to write: the given ones checked (a document mask's packed ones seen with
        batch 1, as the kernel sees q), or new ones."""
        import torch

        batch, seqlen_q, heads_q = q.shape[:3]
        o_shape, lse_shape = (batch, seqlen_q, heads_q, self.spec.dv), (batch, heads_q, seqlen_q)
        if self.spec.is_varlen:  # outputs keep the packed layout the caller uses; the kernel sees batch 1
            out = None if out is None else packed_as_batch("out", out, check=False)
            lse = lse.unsqueeze(0) if isinstance(lse, torch.Tensor) else lse
        if out is None:
            out = torch.empty(o_shape, dtype=q.dtype, device=q.device)
        else:
            check_output("out", out, o_shape, q.dtype, q.device)
        if self.spec.return_lse:
            if lse is None:
                lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
            else:
                check_output("lse", lse, lse_shape, torch.float32, q.device)
        return out, lse

    def _block_mask_arguments(self, q, k, block_mask, aux) -> dict:
        """An expression mask's block mask tensors: the given one (checked) or one built and
        cached for the call's shape; the decode kernel evaluates the mask on every key tile it
        runs, so its launches take stand-ins (a given block mask, made for the forward's tiles,
        goes unused)."""
        if block_mask is not None and self._lowered.mask is None:
            raise ValueError("block_mask= was given, but the spec has no expression mask")
        if self._lowered.mask is None:
            return {}
        if self.plan.is_decode:
            return dict(zip(("block_count", "block_index", "block_full"), unused_block_mask(q.device)))
        if block_mask is None:
            block_mask = self._cached_block_mask(q, k, aux)
        batch, seqlen_q, heads_q = q.shape[:3]
        check_block_mask(block_mask, self.plan, batch, heads_q, seqlen_q, k.shape[1], q.device)
        return {"block_count": block_mask.count, "block_index": block_mask.index, "block_full": block_mask.full}

    def _launch_decode(self, function, q, k, v, out, lse, seqused_k, page_table, extras) -> None:
        """The decode kernel with its split count (from the sizes and this device's SMs), split
        partials, counters and cache lengths (fa4gen.kv_cache.decode_arguments)."""
        o_part, lse_part, seqused_k, counters, splits = decode_arguments(
            self.plan, q, k, seqused_k, page_table, multiprocessor_count(q.device)
        )
        function(q, k, v, out, lse, o_part, lse_part, seqused_k, page_table, counters, splits, *extras)

    def _document_tables(self, cu_seqlens_q, cu_seqlens_k, total: int):
        """``document_tables`` for this kernel's tiles (``DocumentTableCache``)."""
        c = self.plan.config
        return self._doc_tables.get(
            cu_seqlens_q,
            cu_seqlens_k,
            (total,),
            lambda: document_tables(self.spec, c.tile_m, c.tile_n, cu_seqlens_q, cu_seqlens_k, total),
        )

    def block_mask(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int, *, aux=None, device="cuda"):
        """Build the block mask of this kernel's expression mask for one shape (on the GPU), to
        pass as ``block_mask=`` to every call (and layer) with that shape and aux values."""
        validate_aux_for_mask(self.spec, aux)
        tiles = self.kernel_for(seqlen_q).plan  # the tiles of the kernel that runs this shape
        return build_block_mask(self.spec, tiles, batch, heads, seqlen_q, seqlen_k, {"aux": dict(aux or {})}, device)

    def _cached_block_mask(self, q, k, aux):
        """A block mask for this call, reused while the shape, the scalars and the aux tensors the
        mask reads stay the same (``BlockMaskCache``)."""
        batch, heads, seqlen_q, seqlen_k = q.shape[0], q.shape[2], q.shape[1], k.shape[1]
        return self._block_masks.get(
            self._lowered.mask,
            (batch, heads, seqlen_q, seqlen_k, q.device),
            aux,
            lambda: self.block_mask(batch, heads, seqlen_q, seqlen_k, aux=aux, device=q.device),
        )


class DocumentTableCache:
    """The tables last built from a call's cu_seqlens, kept while both are the same unmodified
    tensors (torch's version counter) and the packed sizes the same."""

    def __init__(self):
        self._key, self._tables = None, None

    def get(self, cu_seqlens_q, cu_seqlens_k, sizes: tuple, build):
        key = (_identity(cu_seqlens_q), _identity(cu_seqlens_k), *sizes)
        if self._key != key:
            self._tables, self._key = build(), key
        return self._tables


class BlockMaskCache:
    """Block masks of one kernel by (shape, device, the values of the scalars and the identity
    and version of the aux tensors its mask reads: an aux tensor modified in place is a new
    key), the oldest dropped past BLOCK_MASK_CACHE_SIZE."""

    def __init__(self):
        self._masks: dict = {}

    def get(self, mask, shape: tuple, aux, build):
        values = {name: value for name, value in (aux or {}).items() if name in mask.uses}
        key = (*shape[:-1], str(shape[-1]), tuple(sorted((n, _identity(v)) for n, v in values.items())))
        if key not in self._masks:
            if len(self._masks) >= BLOCK_MASK_CACHE_SIZE:
                self._masks.pop(next(iter(self._masks)))
            self._masks[key] = build()
        return self._masks[key]

    def __len__(self) -> int:
        return len(self._masks)

    def clear(self) -> None:
        self._masks.clear()


BLOCK_MASK_CACHE_SIZE = 16


def _traced(q) -> bool:
    """Whether this call is traced rather than run: torch.compile (Dynamo), or tensors without
    data (fake or meta) from make_fx / torch.export / shape propagation."""
    import torch

    if torch.compiler.is_compiling():
        return True
    return isinstance(q, torch.Tensor) and (type(q) not in (torch.Tensor, torch.nn.Parameter) or q.is_meta)


def _trainable_inputs(variant: dict) -> list:
    """The call's run-time tensors autograd may track: sink logits, ALiBi slopes, bias tables, aux."""
    aux = variant.get("aux") or {}
    return [variant.get("sinks"), variant.get("alibi_slopes"), variant.get("rel_bias"), *aux.values()]


def _records_grad(*inputs) -> bool:
    """Whether autograd records this call (grad mode on and an input requiring a gradient: q, k,
    v or a run-time tensor, ``_trainable_inputs``)."""
    import torch

    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


def op_handle(kernel: AttentionKernel) -> str:
    """The custom op's name for ``kernel`` (fa4gen.handles), registered for the process: fixed by
    the kernels it runs (their cache keys), so a graph traced in one process names the same
    kernel in the next. Kernels built outside the cache (no key) get a name of their own."""
    keys = [kernel.key, *(split.kernel.key for split in kernel.splits)] if kernel.key else [f"object-{id(kernel)}"]
    handle = "kernel-" + hashlib.sha256("\0".join(keys).encode()).hexdigest()[:32]
    return register(handle, kernel.spec, lambda: kernel, backward=lambda: kernel.training().backward_kernel())


class SplitKernel(NamedTuple):
    """The kernel that launches whose longest query sequence ``split`` covers run."""

    split: SeqlenSplit
    kernel: AttentionKernel


def _longest_query(spec: AttentionSpec, q, max_seqlen_q) -> int | None:
    """Query rows of the longest sequence in a launch, or None where the arguments do not say
    (a packed launch without ``max_seqlen_q``, or arguments that validation will reject)."""
    if spec.is_varlen:
        return max_seqlen_q if isinstance(max_seqlen_q, int) else None
    shape = getattr(q, "shape", None)
    return shape[1] if shape is not None and len(shape) == 4 else None


def tables_can_build(cu_seqlens_q, cu_seqlens_k) -> bool:
    """Whether both cu_seqlens are int32 vectors of one length >= 2, so the document tables can
    be built from them (malformed ones build nothing: variant_arguments names what is wrong)."""
    import torch

    return all(
        isinstance(t, torch.Tensor)
        and t.ndim == 1
        and t.dtype == torch.int32
        and t.shape == cu_seqlens_q.shape
        and t.shape[0] >= 2
        for t in (cu_seqlens_q, cu_seqlens_k)
    )


def document_tables(spec: AttentionSpec, tile_m: int, tile_n: int, cu_seqlens_q, cu_seqlens_k, total: int):
    """The kernel's document tables for ``total`` packed query rows (torch, on cu_seqlens' device):
    - key ranges, (total, 2) int32: the [start, end) of packed keys each row sees (its document's
      keys, causal / window bounds aligned to the document's end; end == start: none). The kernel
      reads a row's range with one load where cu_seqlens would take two dependent ones, at every
      query tile's start, on the consumers' critical path;
    - the query tiles ranked by their work, most first, (tiles, 9) int32: the persistent schedule
      hands out the heaviest first (work restarts at every document, so tile order alone does not
      rank it). Each row is (query tile, key range of its first row, key range of its last row,
      whether its rows lie in one document, then that document's shift from a row to its key
      position and its key range [start, end)): the kernel finds a tile's key-tile bounds with
      one load after decoding its rank, and a tile inside one document its rows' key ranges with
      none."""
    import torch

    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    rows = torch.arange(total, device=cu_q.device)
    docs = (torch.searchsorted(cu_q, rows, right=True) - 1).clamp_(0, cu_q.shape[0] - 2)
    start, end = cu_k[docs], cu_k[docs + 1]
    position = rows + end - cu_q[docs + 1]
    if spec.right_bound is not None:
        end = torch.minimum(end, position + spec.right_bound + 1)
    if spec.left_bound is not None:
        start = torch.maximum(start, position - spec.left_bound)
    end = torch.maximum(end, start)
    first = torch.arange(0, total, tile_m, device=cu_q.device)
    last = (first + tile_m).clamp(max=total) - 1
    work = (-(-end[last] // tile_n) - start[first] // tile_n).clamp(min=0)
    order = torch.argsort(work, descending=True, stable=True)
    first_doc, last_doc = docs[first[order]], docs[last[order]]
    # a tile inside one document: its rows' ranges follow from the document's key bounds and
    # the shift from row to key position (masking.row_ranges), with no load per row
    single = (first_doc == last_doc).long()
    shift = cu_k[first_doc + 1] - cu_q[first_doc + 1]
    tiles = torch.stack(
        (
            order,
            start[first[order]],
            end[first[order]],
            start[last[order]],
            end[last[order]],
            single,
            shift,
            cu_k[first_doc],
            cu_k[first_doc + 1],
        ),
        dim=1,
    )
    return torch.stack((start, end), dim=1).to(torch.int32).contiguous(), tiles.to(torch.int32).contiguous()


def document_query_ranges(spec: AttentionSpec, tile_n: int, cu_seqlens_q, cu_seqlens_k, total_k: int):
    """The backward's document table, (total_k, 3) int32 (torch, on cu_seqlens' device): per
    packed key, [lo, hi) of the packed query rows that see it (its document's rows, causal /
    window bounds aligned to the document's end as in ``document_tables``; hi == lo: none, keys
    past the last document's end included), then how many key tiles below its own some row
    sees (the deterministic backward counts its turns with it: masking.key_tiles_before). Both
    lo and hi never decrease with the key."""
    import torch

    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    keys = torch.arange(total_k, device=cu_k.device)
    docs = (torch.searchsorted(cu_k, keys, right=True) - 1).clamp_(0, cu_k.shape[0] - 2)
    lo, hi = cu_q[docs].clone(), cu_q[docs + 1].clone()
    shift = cu_k[docs + 1] - cu_q[docs + 1]  # a row's key position is row + shift
    if spec.right_bound is not None:
        lo = torch.maximum(lo, keys - shift - spec.right_bound)
    if spec.left_bound is not None:
        hi = torch.minimum(hi, keys - shift + spec.left_bound + 1)
    outside = keys >= cu_k[docs + 1]  # past the last document's keys
    lo = torch.where(outside, cu_q[-1], lo.clamp(max=cu_q[-1]))
    hi = torch.maximum(hi, lo)
    hi = torch.where(outside, lo, hi)
    tiles = -(-total_k // tile_n)
    seen = torch.zeros(tiles * tile_n, dtype=torch.bool, device=keys.device)
    seen[:total_k] = hi > lo
    with_queries = seen.view(tiles, tile_n).any(dim=1).long()
    before = (torch.cumsum(with_queries, 0) - with_queries).repeat_interleave(tile_n)[:total_k]
    return torch.stack((lo, hi, before), dim=1).to(torch.int32).contiguous()


def _identity(value):
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), value._version, tuple(value.shape), str(value.dtype))
    return ("value", value)


@lru_cache(maxsize=None)
def _multiprocessor_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device) -> int:
    """SMs of ``device``: how many CTAs a persistent kernel launches (queried at call time, so
    the compiled artifact itself stays machine-independent)."""
    return _multiprocessor_count(device.index if device.index is not None else 0)


_SPLIT_WORKSPACES: dict = {}  # (device, stream, shape, captured) -> (partials, flags)


def split_workspace(plan: Plan, device, num_ctas: int) -> tuple[Any, Any]:
    """The split tail's workspace (planner.split_workspace_shape), or (None, None) without one.

    One per device, stream and shape, made on first use and kept: kernels on one stream run one
    after another, and every launch leaves the flags as it found them (zero: each finisher lowers
    the flag its writer raised), so no launch pays for a memset. Launches captured into a CUDA
    graph get one of their own, made during the first capture, and each captured launch adds a
    zero fill of its flags to its graph (nothing runs while capturing): every replay starts from
    zero flags, whichever graph made the workspace, and eager launches on the capture stream
    never see a workspace that no replay has filled."""
    import torch

    shape = split_workspace_shape(plan, num_ctas)
    if shape is None:
        return None, None

    def make():
        return (
            torch.empty(shape, dtype=torch.float32, device=device),
            torch.zeros(shape[:2], dtype=torch.int32, device=device),
        )

    return kept_per_stream(_SPLIT_WORKSPACES, shape, device, make, lambda kept: kept[1])


# ----------------------------------------------------------------------------- variant arguments
@lru_cache(maxsize=64)
def _standard_slopes(heads: int, device: str):
    import torch

    return torch.tensor(standard_alibi_slopes(heads), dtype=torch.float32, device=device)


def variant_arguments(
    spec: AttentionSpec,
    q,
    k,
    given: dict[str, Any],
    aux: dict[str, Any] | None,
    max_seqlens: tuple = (None, None),
    lowered=None,
    seqlen_k: int | None = None,
) -> list[Any]:
    """The kernel's extras in order (fa4gen.variants.lower), each checked before any launch, as are
    the call inputs they derive from; ``seqlen_k``: the keys aux sizes "Sk" count (k's dim 1
    unless given: a page pool's is the page size)."""
    lowered = lowered or lower(spec)
    extras = lowered.extras
    wanted = {e.name if e.role == "aux_grad" else e.role for e in (*lowered.inputs, *extras)}
    for name, value in given.items():
        if value is not None and name not in wanted:
            raise ValueError(f"{name}= was given, but the spec ({spec.summary()}) does not use it")
    for name, value in zip(("max_seqlen_q", "max_seqlen_k"), max_seqlens):
        if value is not None and (not spec.is_varlen or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a non-negative int, and only with a document mask")
    aux = dict(aux or {})
    declared = {e.name for e in extras if e.role in ("aux", "scalar")}
    unknown = set(aux) - declared
    if unknown:
        raise ValueError(
            f"aux has {', '.join(sorted(unknown))}, which the spec does not declare "
            f"(declared: {', '.join(sorted(declared)) or 'none'})"
        )
    cu_q = given.get("cu_seqlens_q")
    docs = cu_q.shape[0] if getattr(cu_q, "ndim", 0) == 1 else 0
    seqlen_k = k.shape[1] if seqlen_k is None else seqlen_k
    sizes = {"B": q.shape[0], "Hq": q.shape[2], "Hkv": k.shape[2], "Sq": q.shape[1], "Sk": seqlen_k, "docs+1": docs}
    index = given.get("block_index")
    if index is not None:  # checked against the plan by check_block_mask; here only named
        sizes.update(zip(("mask_B", "mask_H", "M", "N"), index.shape))
    index = given.get("bwd_block_index")
    if index is not None:  # built by the backward's callable for its tiles
        sizes.update(zip(("mask_B", "mask_H", "N", "M"), index.shape))
    tiles = given.get("doc_tiles")
    if tiles is not None:  # built by the callable from the plan's config.tile_m, like the block mask
        sizes["M"] = tiles.shape[0]
    values = []
    for extra in (*lowered.inputs, *extras):  # the inputs first: the kernel's tables come from them
        if extra.role == "scalar":
            if extra.name not in aux:
                raise ValueError(
                    f"aux[{extra.name!r}] is missing: the spec declares scalar {extra.name} ({extra.dtype})"
                )
            values.append(check_scalar(extra, aux[extra.name]))
            continue
        value = aux.get(extra.name) if extra.role == "aux" else given.get(extra.role)
        if extra.role == "aux_grad":  # (the backward's own sums, by argument name)
            value = given.get(extra.name)
        if value is None and extra.role == "alibi_slopes" and spec.score_mod.slopes == "standard":
            value = _standard_slopes(q.shape[2], str(q.device))
        if value is None:
            where = f"aux[{extra.name!r}]" if extra.role == "aux" else f"{extra.name}="
            raise ValueError(
                f"{where} is missing: the spec ({spec.summary()}) needs a {extra.dtype} tensor of "
                f"shape ({', '.join(map(str, extra.shape))})"
            )
        if extra.role == "cu_seqlens_q" and docs < 2:
            raise ValueError("cu_seqlens_q needs at least 2 entries (0 and the total)")
        check_extra_tensor(extra, value, sizes, q.device)
        if extra in extras:
            values.append(value)
    return values
