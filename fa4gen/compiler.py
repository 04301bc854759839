"""Source -> artifact: trace the emitted module with cute.compile and link a shared object.

Runs on any machine, GPU or not: the target comes from ``--gpu-arch`` (always explicit), inputs
are fake tensors whose batch, sequence and head counts are symbolic, and nothing queries a
device. The artifact is a TVM-FFI shared object loadable with only the CuTe DSL runtime library
and apache-tvm-ffi (see ``fa4gen.runtime``).
"""

from __future__ import annotations

import gc
import importlib.util
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fa4gen.emitter import EmittedKernel
from fa4gen.planner import Plan, split_workspace_shape
from fa4gen.spec import AttentionSpec
from fa4gen.specfile import dump_spec
from fa4gen.variants import lower

ENTRY = "fa4gen_attention"  # exported symbol of every artifact
SOURCE_FILE = "kernel.py"
LIBRARY_FILE = "kernel.so"
PTX_FILE = "kernel.ptx"
CUBIN_FILE = "kernel.cubin"
ELEMENT_ALIGN = 8  # strides in elements: 16 bytes of 16-bit data, what TMA requires


class CompileError(RuntimeError):
    """A spec that validated did not compile: a bug in fa4gen, reported with the spec and plan."""


def _fake_bshd(spec: AttentionSpec, dim: int):
    """A (B, S, H, dim) tensor of the spec's dtype: symbolic sizes and strides, dim contiguous."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[spec.dtype]
    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), dim)
    stride = tuple(cute.sym_int64(divisibility=ELEMENT_ALIGN) for _ in range(3)) + (1,)
    return make_fake_tensor(dtype, shape, stride=stride, assumed_align=16)


def _fake_lse():
    """A (B, H, S) fp32 tensor, rows contiguous."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32())
    return make_fake_tensor(cutlass.Float32, shape, stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)


def _fake_extras(spec: AttentionSpec, backward: bool = False) -> list[Any]:
    """The variant's run-time arguments (fa4gen.variants.lower, one place for their order; the
    backward's, ``Lowered.for_backward``): tensors compact row-major, sizes symbolic unless the
    spec fixes them; scalars."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    scalar_type = {"float32": cutlass.Float32, "int32": cutlass.Int32}
    extras = []
    lowered = lower(spec)
    for extra in (lowered.for_backward() if backward else lowered).extras:
        element = scalar_type[extra.dtype]
        if extra.is_tensor:
            shape = tuple(dim if isinstance(dim, int) else cute.sym_int32() for dim in extra.shape)
            order = tuple(reversed(range(len(shape))))
            extras.append(make_fake_compact_tensor(element, shape, stride_order=order, assumed_align=4))
        else:
            extras.append(element(0))
    return extras


def fake_backward_arguments(spec: AttentionSpec, plan: Plan) -> list[Any]:
    """Stand-ins for the backward's (q, k, v, o, do, lse, dlse, dq, dk, dv, dq_accum, dpsum,
    lse_log2, dq_order, dk_accum, dv_accum, head_splits, key_tile_order, *extras, stream): the
    workspaces compact
    fp32 (dq_order int32; planner.backward_workspace_shapes), their padded head dims and the
    semaphores' warpgroups static; head_splits and key_tile_order run-time Int32s."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    def workspace(*static: int, dtype=cutlass.Float32):
        shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), *static)
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=16)

    d, dv = spec.head_dim, spec.dv
    tensors = [_fake_bshd(spec, dim) for dim in (d, d, dv, dv, dv)]
    outputs = [_fake_bshd(spec, dim) for dim in (d, d, dv)]
    accum = workspace(plan.config.head_dim_padded)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    sums = [workspace(plan.config.head_dim_padded), workspace(plan.config.head_dim_v_padded)]
    rows = [workspace(), workspace()]
    order = workspace(plan.config.num_consumer_warpgroups, dtype=cutlass.Int32)
    extras = _fake_extras(spec, backward=True)
    return [
        *tensors,
        _fake_lse(),
        _fake_lse(),
        *outputs,
        accum,
        *rows,
        order,
        *sums,
        cutlass.Int32(1),
        cutlass.Int32(0),
        *extras,
        stream,
    ]


def fake_decode_arguments(spec: AttentionSpec, plan: Plan) -> list[Any]:
    """Stand-ins for the decode kernel's (q, k, v, o, lse, o_part, lse_part, seqused_k,
    page_table, counters, num_splits, *extras, stream): the partials (splits, B, Sq, Hq, Dv) and
    (splits, B, Hq, Sq) compact fp32, the cache lengths (B,) int32, a paged plan's page table (B,
    max pages) int32 (K/V then the page pool (pages, page size, Hkv, D)), the splits' counters
    (B, Hkv, query tiles) int32, the split count a run-time Int32."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    def compact(dtype, *static: int, rank: int):
        shape = tuple(cute.sym_int32() for _ in range(rank - len(static))) + static
        order = tuple(reversed(range(len(shape))))
        return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=16 if static else 4)

    d, dv = spec.head_dim, spec.dv
    return [
        _fake_bshd(spec, d),
        _fake_bshd(spec, d),
        _fake_bshd(spec, dv),
        _fake_bshd(spec, dv),
        _fake_lse() if spec.return_lse else None,
        compact(cutlass.Float32, dv, rank=5),
        compact(cutlass.Float32, rank=4),
        compact(cutlass.Int32, rank=1),
        compact(cutlass.Int32, rank=2) if plan.config.paged else None,
        compact(cutlass.Int32, rank=3),
        cutlass.Int32(1),
        *_fake_extras(spec),
        make_fake_stream(use_tvm_ffi_env_stream=True),
    ]


def fake_arguments(spec: AttentionSpec, plan: Plan) -> list[Any]:
    """Stand-ins for (q, k, v, o, lse, work, flags, num_ctas, *extras, stream): symbolic B, S, H,
    CTA count and aux sizes; static head dims. The extras follow fa4gen.variants.lower (one place
    for their order); the split tail's workspace, planner.split_workspace_shape. A backward plan
    takes the backward's (fake_backward_arguments)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    if plan.is_backward:
        return fake_backward_arguments(spec, plan)
    if plan.is_decode:
        return fake_decode_arguments(spec, plan)

    def bshd(dim: int):
        return _fake_bshd(spec, dim)

    lse = _fake_lse() if spec.return_lse else None
    work = flags = None
    workspace = split_workspace_shape(plan, 1)
    if workspace is not None:
        slots = cute.sym_int32()
        work = make_fake_compact_tensor(
            cutlass.Float32, (slots, *workspace[1:]), stride_order=(3, 2, 1, 0), assumed_align=16
        )
        flags = make_fake_compact_tensor(cutlass.Int32, (slots, workspace[1]), stride_order=(1, 0), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    num_ctas = cutlass.Int32(1)  # a run-time scalar: the SM count of the device it runs on
    extras = _fake_extras(spec)
    return [
        bshd(spec.head_dim),
        bshd(spec.head_dim),
        bshd(spec.dv),
        bshd(spec.dv),
        lse,
        work,
        flags,
        num_ctas,
        *extras,
        stream,
    ]


def import_source(path: Path, module_name: str):
    """Import generated source from a real file (CuTe DSL reads function source to trace it)."""
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    module_spec.loader.exec_module(module)
    return module


def runtime_libraries() -> list[str]:
    import cutlass.cute as cute

    return list(cute.runtime.find_runtime_libraries(enable_tvm_ffi=True))


def link_shared_object(obj: Path, out: Path) -> None:
    """Link against the runtime libraries by soname (no paths baked in: the artifact travels)."""
    args = ["gcc", "-shared", "-o", str(out), str(obj)]
    for lib in runtime_libraries():
        lib_path = Path(lib)
        args += [f"-L{lib_path.parent}", f"-l:{lib_path.name}"]
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompileError(f"linking {out.name} failed: {result.stderr.strip()}")


@contextmanager
def collection_paused():
    """Python's cyclic garbage collector off for a build (restored after, as it was): a build
    makes hundreds of thousands of short-lived objects, and the full collections they trigger
    scan the whole heap (torch's and the caller's too), 0.11-0.13 s of a first call's 1.3 s
    (decision first-call-plan). Reference counting still frees what is not in a cycle."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def build_artifact(spec: AttentionSpec, plan: Plan, emitted: EmittedKernel, out_dir: Path) -> dict[str, Any]:
    """Write source, compile for plan.arch, export + link kernel.so into ``out_dir``."""
    with collection_paused():
        return _build_artifact(spec, plan, emitted, out_dir)


def _build_artifact(spec: AttentionSpec, plan: Plan, emitted: EmittedKernel, out_dir: Path) -> dict[str, Any]:
    import cutlass.cute as cute

    out_dir.mkdir(parents=True, exist_ok=True)
    source_path = out_dir / SOURCE_FILE
    source_path.write_text(emitted.source)
    (out_dir / "spec.yaml").write_text(dump_spec(spec))
    (out_dir / "plan.json").write_text(plan.model_dump_json(indent=2))
    dump_dir = out_dir / "asm"
    dump_dir.mkdir()
    module = import_source(source_path, emitted.module_name)
    started = time.perf_counter()
    try:
        options = f"--gpu-arch {plan.arch} --enable-tvm-ffi --keep-ptx --keep-cubin --dump-dir={dump_dir}"
        # no_jit_engine: the artifact is the exported object; a JIT engine for this process (built
        # when it has a GPU of the target arch) would cost seconds of a first call for nothing
        compiled = cute.compile(module.entry, *fake_arguments(spec, plan), options=options, no_jit_engine=True)
    except Exception as exc:  # surface as one error naming the variant, never raw MLIR alone
        raise CompileError(
            f"fa4gen failed to compile a valid spec ({spec.summary()}) for {plan.arch}; "
            f"this is a bug in fa4gen, please report it with the spec. Cause: {exc}"
        ) from exc
    finally:
        sys.modules.pop(emitted.module_name, None)
    compile_seconds = time.perf_counter() - started
    obj = out_dir / "kernel.o"
    compiled.export_to_c(str(obj), function_name=ENTRY)
    link_shared_object(obj, out_dir / LIBRARY_FILE)
    obj.unlink()
    for suffix, name in ((".ptx", PTX_FILE), (".cubin", CUBIN_FILE)):
        found = sorted(dump_dir.glob(f"*{suffix}"))
        if found:
            shutil.move(str(found[0]), out_dir / name)
    shutil.rmtree(dump_dir, ignore_errors=True)
    return {"compile_seconds": round(compile_seconds, 3), "entry": ENTRY}  # trace + cute.compile
