"""First call of a new attention variant: fa4gen against flash-attn-4, each in fresh processes (H200).

    source .devfull/b/setup.sh && python3 benchmarks/first_call.py --out first_call.json
    python3 benchmarks/first_call.py --quick      # variant a only, one repeat

Issue 33 item 5: the first call of a variant neither library has compiled, fa4gen at most 0.8x
flash-attn-4's, both with their imports paid or both without; and ``import fa4gen`` under 0.5 s
beyond torch. Every measurement is a fresh ``python -c`` process that first imports torch and
creates the CUDA context (untimed: any PyTorch program pays those), with empty caches of its own:

  imports paid      times the library's import (``import fa4gen`` / ``from flash_attn.cute import
                    flash_attn_func``), then fa4gen.compile(spec) + the first call, or
                    flash-attn-4's first call (which compiles); total = import + first call
  imports not paid  the CuTe DSL compiler (cutlass, cutlass.cute and the DSL modules both
                    libraries' kernels use), apache-tvm-ffi and the library are imported untimed
                    first, fa4gen with the modules its first call would import (its kernel
                    package, jinja2, diskcache, the DSL's tvm-ffi builder: FA4GEN_DEFERRED), as
                    flash-attn-4's import brings all of its own; times compile + first call
                    (each row records the modules the timed part still imported)
  one process       both libraries, imports pre-paid as above, on the same variant one after the
                    other, in each order (what the first pays once, the second finds done)

Caches. fa4gen: FA4GEN_CACHE_DIR and cache_dir= name a folder that does not exist yet (fa4gen
makes it). flash-attn-4 4.0.0b36 keeps compiled kernels in a per-process dict keyed by its
compile options (flash_attn.cute.cache_utils.JITCache); its disk cache (JITPersistentCache: AOT
objects exported with tvm-ffi) is used only with FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1, in
FLASH_ATTENTION_CUTE_DSL_CACHE_DIR (default /tmp/$USER/flash_attention_cute_dsl_cache): each
child sets it to 0 and points the folder at its own empty one all the same. The CuTe DSL's file
cache of compiled IR (CUTE_DSL_CACHE_DIR, default /tmp/$USER/cutlass_python_cache) is skipped
by cute.compile (it passes no_cache=True), and CUDA's JIT cache (CUDA_CACHE_PATH) serves PTX
only; both point at the child's empty folder too. One untimed process first imports everything,
so .pyc files and the page cache are warm for every timed one.

Repeats are fresh processes; the table shows medians. Jobs run in priority order (variant a's
repeats, then one of every other cell, then the rest) until --time-limit; what did not fit is
listed as skipped. Outputs are checked against an fp32 reference after the timing (and against
each other where one process ran both), so neither library is timed doing nothing. After its
timing, a cell's first repeat waits for fa4gen's planner's kernel to take over (untimed: when it
runs, and whether it gives the same bits); the other repeats exit at once, and the background
builds they leave are killed before the next process starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

RESULT_TAG = "FIRST_CALL_RESULT "
LIBS = ("fa4gen", "fa4")
LABELS = {"fa4gen": "fa4gen", "fa4": "flash-attn-4"}
TARGET_RATIO = 0.8
TARGET_IMPORT_S = 0.5
# what both libraries' Hopper kernels import from the CuTe DSL: pre-imported where imports are not paid
DSL_MODULES = (
    "cutlass",
    "cutlass.cute",
    "tvm_ffi",
    "cutlass.cute.nvgpu.warpgroup",
    "cutlass.cute.nvgpu.cpasync",
    "cutlass.pipeline",
    "cutlass.utils",
    "cutlass.utils.hopper_helpers",
    "cutlass.cute.runtime",
)
# what fa4gen's first call imports itself (``import fa4gen`` defers them to stay under 0.5 s):
# pre-imported too where imports are not paid, as flash-attn-4's import brings all of its own
FA4GEN_DEFERRED = (
    "fa4gen.tuned",
    "fa4gen.backward",
    "jinja2",
    "diskcache",
    "cutlass.cutlass_dsl.tvm_ffi_provider",
    "cutlass.base_dsl.tvm_ffi_builder",
)
FA4GEN_KERNEL_PACKAGE = "fa4gen.kernels"  # every module under it: what generated sources import
# the child: load this file by path (nothing added to sys.path), run child(config)
CHILD_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('fa4gen_bench_first_call', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = module\n"
    "spec.loader.exec_module(module)\n"
    "module.child(sys.argv[2])\n"
)


@dataclasses.dataclass(frozen=True)
class Variant:
    key: str
    head_dim: int
    causal: bool = False
    softcap: float | None = None
    window: int | None = None  # W keys up to and including the diagonal: window_left = W - 1
    q_heads: int = 32
    kv_heads: int = 8
    batch: int = 1
    seqlen: int = 2048

    @property
    def name(self) -> str:
        words = [f"d{self.head_dim}", f"gqa{self.q_heads // self.kv_heads}", "causal" if self.causal else "non-causal"]
        if self.softcap is not None:
            words.append(f"softcap {self.softcap:g}")
        if self.window is not None:
            words.append(f"window {self.window}")
        return f"{self.key}: " + " ".join(words) + f" B{self.batch} S{self.seqlen}"

    @property
    def window_left(self) -> int | None:
        return None if self.window is None else self.window - 1

    def fa4gen_spec_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "head_dim": self.head_dim,
            "qhead_per_kvhead": self.q_heads // self.kv_heads,
            "causal": self.causal,
            "dtype": "bfloat16",
        }
        if self.softcap is not None:
            kwargs["softcap"] = self.softcap
        if self.window is not None:
            kwargs["window_left"] = self.window_left
        return kwargs

    def fa4_kwargs(self) -> dict[str, Any]:
        window = (self.window_left, 0) if self.window is not None else (None, None)
        return {"causal": self.causal, "window_size": window, "softcap": self.softcap or 0.0}


VARIANTS = {
    "a": Variant("a", 128, causal=True, softcap=30.0),  # the issue's
    "b": Variant("b", 128),
    "c": Variant("c", 64, causal=True),
    "d": Variant("d", 128, causal=True, window=1024),
}


@dataclasses.dataclass(frozen=True)
class Job:
    kind: str  # warmup | import | paid | notpaid | both
    variant: str | None = None
    libs: tuple[str, ...] = ()
    repeat: int = 0

    @property
    def label(self) -> str:
        return " ".join(part for part in (self.kind, self.variant, "+".join(self.libs), f"#{self.repeat}") if part)


# ---------------------------------------------------------------------------------------------
# the child process


def reference(q, k, v, *, causal: bool, window_left: int | None, softcap: float | None):
    """fp32 attention of (B, Sq, Hq, D) q against (B, Sk, Hkv, D) k, v: query head h reads key head
    h // (Hq / Hkv); causal and the window aligned bottom-right (as both libraries)."""
    import torch

    ratio = q.shape[2] // k.shape[2]
    qf = q.float()
    kf = k.float().repeat_interleave(ratio, dim=2)
    vf = v.float().repeat_interleave(ratio, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * q.shape[-1] ** -0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    rows = torch.arange(seqlen_q, device=q.device).view(-1, 1) + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=q.device).view(1, -1)
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if causal:
        keep &= cols <= rows
    if window_left is not None:
        keep &= cols >= rows - window_left
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), vf)


def _new_modules(before: set[str]) -> dict[str, int]:
    """Modules imported since ``before``, counted by top-level package."""
    counts: dict[str, int] = {}
    for name in set(sys.modules) - before:
        top = name.split(".")[0]
        counts[top] = counts.get(top, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def _import_library(lib: str, deferred: bool = False) -> None:
    """The library's import; ``deferred``: fa4gen's first-call imports too (FA4GEN_DEFERRED and
    every module of its kernel package), for the modes where imports are not paid."""
    if lib == "fa4gen":
        import fa4gen  # noqa: F401

        if deferred:
            import pkgutil

            for name in FA4GEN_DEFERRED:
                importlib.import_module(name)
            package = importlib.import_module(FA4GEN_KERNEL_PACKAGE)
            for found in pkgutil.walk_packages(package.__path__, prefix=f"{FA4GEN_KERNEL_PACKAGE}."):
                importlib.import_module(found.name)
    else:
        from flash_attn.cute import flash_attn_func  # noqa: F401


def _first_call(lib: str, variant: Variant, q, k, v, cache_dir: str, takeover: bool) -> tuple[dict[str, Any], Any]:
    """Import (a dict lookup where done before), compile where separate, first call, second call:
    wall clock around public calls only; ``takeover``: then wait for fa4gen's planner's kernel."""
    import torch

    before = set(sys.modules)
    t0 = time.perf_counter()
    _import_library(lib)
    t1 = time.perf_counter()
    if lib == "fa4gen":
        import fa4gen

        attn = fa4gen.compile(fa4gen.AttentionSpec(**variant.fa4gen_spec_kwargs()), cache_dir=cache_dir)
    else:
        from flash_attn.cute import flash_attn_func

        def attn(q, k, v):
            out = flash_attn_func(q, k, v, **variant.fa4_kwargs())
            return out[0] if isinstance(out, tuple) else out

    t2 = time.perf_counter()
    out = attn(q, k, v)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    attn(q, k, v)
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    tiers = {}
    if lib == "fa4gen" and takeover:  # untimed: wait for the planner's kernel (built in the background), time it
        running = attn.kernel_for(variant.seqlen)
        tiers["first_call_kernel"], first_path = running.building, running.path
        running.prepare(ranges=False)  # the kernel this call runs, not the other length ranges
        tiers["took_over"] = running.path != first_path
        tiers["full_ready_s"] = time.perf_counter() - t1  # from compile() until the planner's kernel runs
        torch.cuda.synchronize()
        t5 = time.perf_counter()
        attn(q, k, v)
        torch.cuda.synchronize()
        tiers["steady_full_ms"] = 1e3 * (time.perf_counter() - t5)
        tiers["bit_identical"] = bool(torch.equal(attn(q, k, v), out))
    row = {
        "import_s": t1 - t0,
        "compile_s": t2 - t1,  # fa4gen.compile(); 0 for flash-attn-4, which compiles in its first call
        "call_s": t3 - t2,
        "first_s": t3 - t1,  # compile + first call
        "total_s": t3 - t0,  # import + compile + first call
        "steady_ms": 1e3 * (t4 - t3),
        "new_modules": _new_modules(before),
        **tiers,
    }
    return row, out


def _check(out, ref) -> dict[str, Any]:
    import torch

    finite = bool(torch.isfinite(out).all())
    err = float((out.float() - ref).abs().max()) if finite else float("nan")
    return {"max_err": err, "ok": finite and err < 0.05}


def _build_info(cache_dir: str) -> dict[str, Any]:
    """fa4gen's build.json files in the (fresh) cache: trace + cute.compile per kernel built."""
    seconds = []  # in the order the kernels were finished: the first-call kernel first
    for path in sorted(Path(cache_dir).rglob("build.json"), key=lambda found: found.stat().st_mtime):
        try:
            seconds.append(float(json.loads(path.read_text())["compile_seconds"]))
        except (OSError, ValueError, KeyError):
            continue
    return {"kernels_built": len(seconds), "compile_seconds": seconds, "compile_seconds_sum": sum(seconds)}


def _environment() -> dict[str, Any]:
    import platform

    import torch

    env = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "apache-tvm-ffi", "fa4gen"):
        try:
            env[dist] = md.version(dist)
        except md.PackageNotFoundError:
            env[dist] = None
    import fa4gen

    env["fa4gen"] = fa4gen.__version__
    env["cache_env"] = {
        name: os.environ.get(name)
        for name in (
            "FA4GEN_LAZY_LOADER",
            "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED",
            "CUTE_DSL_PTXAS_PATH",
            "CUTE_DSL_DISABLE_FILE_CACHING",
        )
    }
    return env


def child(config_json: str) -> None:
    """One measurement (see the module docstring); prints RESULT_TAG + JSON as its last line."""
    config = json.loads(config_json)
    kind, libs = config["kind"], config["libs"]
    started = time.perf_counter()
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    result: dict[str, Any] = {"torch_cuda_s": time.perf_counter() - started}
    if kind == "import":
        before = set(sys.modules)
        t0 = time.perf_counter()
        import fa4gen  # noqa: F401

        result["import_fa4gen_s"] = time.perf_counter() - t0
        result["compiler_imported"] = "cutlass.cute" in sys.modules and "cutlass.cute" not in before
        result["tvm_ffi_imported"] = "tvm_ffi" in sys.modules and "tvm_ffi" not in before
        print(RESULT_TAG + json.dumps(result), flush=True)
        return
    if kind == "warmup":
        for name in DSL_MODULES:
            importlib.import_module(name)
        for lib in LIBS:
            _import_library(lib, deferred=True)
        result["environment"] = _environment()
        print(RESULT_TAG + json.dumps(result), flush=True)
        return

    variant = Variant(**config["variant"])
    torch.manual_seed(0)
    shape_q = (variant.batch, variant.seqlen, variant.q_heads, variant.head_dim)
    shape_kv = (variant.batch, variant.seqlen, variant.kv_heads, variant.head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    if kind in ("notpaid", "both"):
        t0 = time.perf_counter()
        for name in DSL_MODULES:
            importlib.import_module(name)
        for lib in libs:
            _import_library(lib, deferred=True)
        result["preimport_s"] = time.perf_counter() - t0
    cache_dir = os.environ["FA4GEN_CACHE_DIR"]
    outputs = {}
    result["libs"] = {}
    for lib in libs:
        result["libs"][lib], outputs[lib] = _first_call(lib, variant, q, k, v, cache_dir, config["takeover"])
    # untimed from here: correctness, the build breakdown
    ref = reference(q, k, v, causal=variant.causal, window_left=variant.window_left, softcap=variant.softcap)
    for lib in libs:
        result["libs"][lib].update(_check(outputs[lib], ref))
    if len(libs) == 2:
        result["max_abs_diff_fa4gen_fa4"] = float((outputs["fa4gen"].float() - outputs["fa4"].float()).abs().max())
    if "fa4gen" in libs:
        result["libs"]["fa4gen"]["build"] = _build_info(cache_dir)
    print(RESULT_TAG + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# the parent


class ChildFailed(RuntimeError):
    pass


def parse_child_output(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    raise ValueError("no result line")


def child_env(folder: Path) -> dict[str, str]:
    """The environment of one child: every cache it could read or fill is an empty folder of its own."""
    env = dict(os.environ)
    env.pop("FA4GEN_NO_COMPILE", None)
    env.update(
        {
            "FA4GEN_CACHE_DIR": str(folder / "fa4gen-cache"),  # made by fa4gen
            "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "0",
            "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(folder / "fa4-cache"),
            "CUTE_DSL_CACHE_DIR": str(folder / "cute-dsl-cache"),
            "CUDA_CACHE_PATH": str(folder / "cuda-cache"),
        }
    )
    return env


def stop_builds_in(folder: Path) -> None:
    """Kill the processes whose command line names ``folder`` (fa4gen's background builds into
    the child's cache, which outlive it) and wait for them, so none runs beside the next timing."""
    mark = str(folder).encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if mark in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), 9)
                killed.append(entry)
        except (OSError, ValueError):
            continue
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(p.exists() and _alive(p) for p in killed):
        time.sleep(0.05)


def _alive(entry: Path) -> bool:
    try:
        return (entry / "stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def run_child(job: Job, variants: dict[str, Variant], tmp_root: str | None, timeout: float) -> dict[str, Any]:
    # the planner's kernel taking over is timed in a cell's first repeat; the other processes leave
    # its background build behind, stopped below before the next process starts
    config = {"kind": job.kind, "libs": list(job.libs), "takeover": job.repeat == 0}
    if job.variant is not None:
        config["variant"] = dataclasses.asdict(variants[job.variant])
    folder = Path(tempfile.mkdtemp(prefix="first_call-", dir=tmp_root))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD_BOOT, str(Path(__file__).resolve()), json.dumps(config)],
            capture_output=True,
            text=True,
            env=child_env(folder),
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise ChildFailed(f"{job.label}: no result within {timeout:.0f} s") from exc
    finally:
        stop_builds_in(folder)
        shutil.rmtree(folder, ignore_errors=True)
    try:
        if proc.returncode != 0:
            raise ValueError(f"exit {proc.returncode}")
        return parse_child_output(proc.stdout)
    except ValueError as exc:
        tail = (proc.stderr.strip().splitlines() or [""])[-1]
        sys.stderr.write(proc.stderr[-4000:])
        raise ChildFailed(f"{job.label}: {exc}: {tail}") from None


def plan_jobs(variant_keys: list[str], repeat: int, both_repeat: int, import_repeat: int) -> list[Job]:
    """Priority order: the warm-up, the import timings, every repeat of the first variant, one of
    every other cell, then the other repeats. Each library runs in a process of its own; which goes
    first alternates between repeats."""
    jobs = [Job("warmup", libs=LIBS)] + [Job("import", libs=("fa4gen",), repeat=r) for r in range(import_repeat)]

    def cells(key: str, r: int) -> list[Job]:
        order = LIBS if r % 2 == 0 else LIBS[::-1]
        out = [Job(mode, key, (lib,), r) for mode in ("paid", "notpaid") for lib in order]
        if r < both_repeat:
            out += [Job("both", key, LIBS, r), Job("both", key, LIBS[::-1], r)]
        return out

    first, rest = variant_keys[:1], variant_keys[1:]
    for r in range(repeat):
        jobs += [job for key in first for job in cells(key, r)]
    for r in range(repeat):
        jobs += [job for key in rest for job in cells(key, r)]
    return jobs


def run_jobs(
    jobs: list[Job],
    runner: Callable[[Job], dict[str, Any]],
    time_limit: float,
    clock: Callable[[], float] = time.perf_counter,
    log: Callable[[str], None] = lambda line: None,
) -> tuple[list[dict[str, Any]], list[Job]]:
    """Run jobs in order while the next one is expected to end within ``time_limit`` seconds (each
    kind expected to take as long as its longest run so far); the warm-up always runs."""
    start = clock()
    longest: dict[str, float] = {}
    done: list[dict[str, Any]] = []
    skipped: list[Job] = []
    for job in jobs:
        elapsed = clock() - start
        if job.kind != "warmup" and elapsed + longest.get(job.kind, 0.0) > time_limit:
            skipped.append(job)
            continue
        begin = clock()
        result = runner(job)
        wall = clock() - begin
        longest[job.kind] = max(longest.get(job.kind, 0.0), wall)
        done.append({"job": dataclasses.asdict(job), "wall_s": wall, "result": result})
        log(f"[{clock() - start:6.1f} s] {job.label}: {wall:.1f} s")
    return done, skipped


def median(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


MODES = (
    ("paid", None, "imports paid"),
    ("notpaid", None, "imports not paid"),
    ("both", "fa4gen", "one process, fa4gen first"),
    ("both", "fa4", "one process, flash-attn-4 first"),
)


def _samples(runs: list[dict[str, Any]], kind: str, variant: str, lib: str, first: str | None) -> list[dict]:
    out = []
    for run in runs:
        job = run["job"]
        if job["kind"] != kind or job["variant"] != variant or lib not in job["libs"]:
            continue
        if first is not None and job["libs"][0] != first:
            continue
        out.append(run["result"]["libs"][lib])
    return out


def summarize(runs: list[dict[str, Any]], variant_keys: list[str]) -> list[dict[str, Any]]:
    """One row per variant and mode: the median seconds of each library and their ratio. Imports
    paid: import + compile + first call; otherwise compile + first call."""
    rows = []
    for key in variant_keys:
        for kind, first, mode in MODES:
            row: dict[str, Any] = {"variant": key, "mode": mode}
            for lib in LIBS:
                samples = _samples(runs, kind, key, lib, first)
                field = "total_s" if kind == "paid" else "first_s"
                row[lib] = median(s[field] for s in samples)
                row[f"{lib}_runs"] = len(samples)
            row["ratio"] = row["fa4gen"] / row["fa4"] if row["fa4gen"] is not None and row["fa4"] else None
            rows.append(row)
    return rows


def breakdown(runs: list[dict[str, Any]], variant_keys: list[str]) -> list[dict[str, Any]]:
    """Medians of the parts, imports paid."""
    rows = []
    for key in variant_keys:
        for lib in LIBS:
            samples = _samples(runs, "paid", key, lib, None)
            if not samples:
                continue
            row = {"variant": key, "lib": lib}
            for field in ("import_s", "compile_s", "call_s", "total_s", "steady_ms"):
                row[field] = median(s[field] for s in samples)
            builds = [s["build"] for s in samples if "build" in s]
            row["kernels_built"] = median(b["kernels_built"] for b in builds)
            row["trace_compile_s"] = median(b["compile_seconds"][0] for b in builds if b["compile_seconds"])
            row["full_ready_s"] = median(s["full_ready_s"] for s in samples if "full_ready_s" in s)
            row["bit_identical"] = all(s.get("bit_identical", True) for s in samples)
            rows.append(row)
    return rows


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(rows: list[dict[str, Any]], variants: dict[str, Variant]) -> str:
    lines = [
        "| variant | mode | fa4gen s | flash-attn-4 s | ratio (fa4gen/fa4) | runs |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {variants[row['variant']].name} | {row['mode']} | {_fmt(row['fa4gen'])} | {_fmt(row['fa4'])} "
            f"| {_fmt(row['ratio'])} | {row['fa4gen_runs']}/{row['fa4_runs']} |"
        )
    return "\n".join(lines)


def markdown_breakdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | library | import s | compile() s | first call s | total s | kernels built "
        "| first kernel's trace + cute.compile s | planner's kernel runs after s | second call ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        fa4gen = row["lib"] == "fa4gen"
        lines.append(
            f"| {row['variant']} | {LABELS[row['lib']]} | {_fmt(row['import_s'])} "
            f"| {_fmt(row['compile_s']) if fa4gen else '-'} | {_fmt(row['call_s'])} | {_fmt(row['total_s'])} "
            f"| {_fmt(row['kernels_built'], 0) if fa4gen else '-'} | {_fmt(row['trace_compile_s']) if fa4gen else '-'} "
            f"| {_fmt(row['full_ready_s']) if fa4gen else '-'} | {_fmt(row['steady_ms'], 3)} |"
        )
    return "\n".join(lines)


def correctness(runs: list[dict[str, Any]], variant_keys: list[str]) -> list[str]:
    """Per variant: the largest error against the fp32 reference of each library and the largest
    difference between the two where one process ran both."""
    lines = []
    for key in variant_keys:
        mine = [run for run in runs if run["job"]["variant"] == key]
        if not mine:
            continue
        parts = []
        for lib in LIBS:
            checks = [run["result"]["libs"][lib] for run in mine if lib in run["job"]["libs"]]
            if checks:
                worst = max(c["max_err"] for c in checks)
                bad = sum(not c["ok"] for c in checks)
                parts.append(f"{LABELS[lib]} max|o - ref| {worst:.2e}" + (f" ({bad} FAILED)" if bad else ""))
        firsts = [run["result"]["libs"]["fa4gen"] for run in mine if "fa4gen" in run["job"]["libs"]]
        same = [c["bit_identical"] for c in firsts if "bit_identical" in c]
        if same:
            parts.append(f"first-call kernel = planner's, bit for bit: {sum(same)}/{len(same)}")
        diffs = [run["result"]["max_abs_diff_fa4gen_fa4"] for run in mine if "max_abs_diff_fa4gen_fa4" in run["result"]]
        if diffs:
            parts.append(f"max|fa4gen - fa4| {max(diffs):.2e}")
        lines.append(f"{key}: " + ", ".join(parts))
    return lines


def failed_checks(runs: list[dict[str, Any]]) -> int:
    return sum(not lib["ok"] for run in runs for lib in run["result"].get("libs", {}).values())


def require_flash_attn_4() -> str:
    try:
        version = md.version("flash-attn-4")
    except md.PackageNotFoundError:
        version = None
    if version is None or importlib.util.find_spec("flash_attn") is None:
        raise SystemExit("first_call: flash-attn-4 is not installed (on the H200: source .devfull/b/setup.sh first)")
    return version


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="variant a only, one repeat of everything")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated keys of VARIANTS")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per library, mode and variant")
    parser.add_argument("--both-repeat", type=int, default=1, help="repeats of the one-process mode (each order)")
    parser.add_argument("--import-repeat", type=int, default=5, help="processes timing import fa4gen")
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument(
        "--modes",
        type=lambda text: text.split(","),
        default=["paid", "notpaid", "both"],
        help="which of paid, notpaid and both (one process) to run",
    )
    parser.add_argument("--time-limit", type=float, default=300.0, help="start no job expected to end later (s)")
    parser.add_argument("--child-timeout", type=float, default=300.0)
    parser.add_argument("--tmp", default=None, help="where the children's empty cache folders go")
    parser.add_argument("--out", default="", help="JSON file of every raw number")
    args = parser.parse_args(argv)
    args.variants = [key.strip() for key in args.variants.split(",") if key.strip()]
    unknown = [key for key in args.variants if key not in VARIANTS]
    if unknown or not args.variants:
        parser.error(f"--variants: unknown {unknown}; choose from {','.join(VARIANTS)}")
    if not args.modes or set(args.modes) - {"paid", "notpaid", "both"}:
        parser.error(f"--modes: {','.join(args.modes)}; choose from paid,notpaid,both")
    if args.quick:
        args.variants, args.repeat, args.both_repeat, args.import_repeat = ["a"], 1, 1, 1
    if min(args.repeat, args.import_repeat) < 1 or args.both_repeat < 0:
        parser.error("--repeat and --import-repeat must be at least 1, --both-repeat at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fa4_version = require_flash_attn_4()
    variants = {key: dataclasses.replace(VARIANTS[key], seqlen=args.seqlen) for key in args.variants}
    jobs = [
        job
        for job in plan_jobs(args.variants, args.repeat, args.both_repeat, args.import_repeat)
        if job.kind in ("warmup", "import") or job.kind in args.modes
    ]
    print(f"flash-attn-4 {fa4_version}; {len(jobs)} processes planned, limit {args.time_limit:.0f} s", file=sys.stderr)
    report: dict[str, Any] = {"config": dict(vars(args)), "runs": [], "skipped": []}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        done, skipped = run_jobs(
            jobs, lambda job: run_child(job, variants, args.tmp, args.child_timeout), args.time_limit, log=log
        )
    except ChildFailed as exc:
        save()
        raise SystemExit(f"first_call: child failed: {exc}") from None
    report["environment"] = done[0]["result"].get("environment", {})
    imports = [run["result"] for run in done if run["job"]["kind"] == "import"]
    runs = [run for run in done if run["job"]["kind"] in ("paid", "notpaid", "both")]
    report["runs"], report["imports"] = runs, imports
    report["skipped"] = [dataclasses.asdict(job) for job in skipped]
    report["summary"] = summarize(runs, args.variants)
    report["breakdown"] = breakdown(runs, args.variants)
    save()

    env = report["environment"]
    print(
        f"{env.get('device')}: torch {env.get('torch')} (CUDA {env.get('cuda')}), CuTe DSL "
        f"{env.get('nvidia-cutlass-dsl')}, flash-attn-4 {env.get('flash-attn-4')}, fa4gen {env.get('fa4gen')}\n"
    )
    import_s = median(r["import_fa4gen_s"] for r in imports)
    compiler = sum(r["compiler_imported"] for r in imports)
    print(
        f"import fa4gen beyond torch: {_fmt(import_s, 3)} s (median of {len(imports)}; target < {TARGET_IMPORT_S} s"
        f"{'' if import_s is None else ': met' if import_s < TARGET_IMPORT_S else ': NOT met'}); "
        f"imported the CuTe DSL compiler in {compiler} of {len(imports)}\n"
    )
    print(markdown_breakdown(report["breakdown"]) + "\n")
    for line in correctness(runs, args.variants):
        print(line)
    if skipped:
        print(f"\nskipped (over --time-limit {args.time_limit:.0f} s): {len(skipped)} processes")
    rows = [row for row in report["summary"] if row["ratio"] is not None]
    met = sum(row["ratio"] <= TARGET_RATIO for row in rows)
    target = f"target ratio <= {TARGET_RATIO}: met in {met} of {len(rows)}"
    print(f"\nfirst call of a new variant, median seconds; {target}\n")
    print(markdown(report["summary"], variants))
    bad = failed_checks(runs)
    if bad:
        raise SystemExit(f"first_call: {bad} outputs differ from the fp32 reference (see above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
