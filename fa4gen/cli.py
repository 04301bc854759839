"""The ``fa4gen`` command line: every compiler stage, the kernel cache, and cache warming
(its machinery in fa4gen.warm).

    fa4gen plan spec.yaml --arch sm_90a          the schedule and the reason for each choice
    fa4gen emit spec.yaml -o kernel.py           the generated CuTe-DSL source
    fa4gen compile spec.yaml --arch sm_90a       build into the cache (or find it there)
    fa4gen tune spec.yaml --arch sm_90a          on a GPU: time candidate plans, record the fastest
    fa4gen warm specs/ --arch sm_90a -j 4        build every spec under a directory, in parallel
    fa4gen cache ls | verify | clear | export | import
    fa4gen from-hf config.json --out specs/      one spec per attention layer type of a transformers model

``--cache-dir`` may be given before the command (global) or after it; it defaults to
``$FA4GEN_CACHE_DIR``, then ``$XDG_CACHE_HOME/fa4gen``, then ``~/.cache/fa4gen``.
Expected failures (a bad spec file, an unsupported arch, a malformed FA4GEN_* variable, a cache
problem) print one line and exit 1; usage errors (a bad option) exit 2.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Annotated, Callable, Iterator, Optional

import typer
import yaml
from pydantic import ValidationError

import fa4gen
from fa4gen.api import BUILD_INFO_FILE, _no_compile_default, training_spec
from fa4gen.arch import Arch, UnsupportedArchError
from fa4gen.cache import CacheEntry, CacheError, CacheWarning, KernelCache, default_cache_root
from fa4gen.compiler import LIBRARY_FILE, PTX_FILE, CompileError
from fa4gen.planner import Plan, backward_plan, first_call_plan, plan_for_seqlen, seqlen_splits
from fa4gen.spec import AttentionSpec
from fa4gen.specfile import load_spec
from fa4gen.toolchain import ToolchainError, toolchain
from fa4gen.tuning import MIN_GAIN, tune
from fa4gen.warm import (
    SPEC_SUFFIXES,
    STATUS_STYLES,
    WarmJob,
    candidate_jobs,
    collect_spec_files,
    describe_error,
    make_console,
    warm_results,
    warm_table,
)

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])", re.IGNORECASE)
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# Failures a user can fix: reported as one line, never with a traceback.
_EXPECTED_ERRORS = (
    ValidationError,
    yaml.YAMLError,
    ValueError,
    UnsupportedArchError,
    CacheError,
    CompileError,
    ToolchainError,
    OSError,
)
_SHA256_RE = re.compile(r"[0-9a-fA-F]{64}")

app = typer.Typer(name="fa4gen", no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False)
cache_app = typer.Typer(help="Inspect and manage the on-disk kernel cache.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")

CacheDirOption = Annotated[
    Optional[Path],
    typer.Option(
        "--cache-dir",
        help="Kernel cache directory [default: $FA4GEN_CACHE_DIR or ~/.cache/fa4gen]",
        file_okay=False,
        show_default=False,
    ),
]
SpecArgument = Annotated[Path, typer.Argument(help="Spec YAML file.", dir_okay=False, show_default=False)]
ArchOption = Annotated[str, typer.Option("--arch", help="Target architecture, e.g. sm_90a.")]
BackwardOption = Annotated[
    bool,
    typer.Option("--backward", help="The spec's backward (dQ, dK, dV), for the spec with its LSE: what training runs."),
]
SeqlenOption = Annotated[
    Optional[int],
    typer.Option(
        "--seqlen",
        min=1,
        help="The plan that a launch whose longest query sequence has this many rows runs "
        "(the planner splits some specs by length).",
        show_default=False,
    ),
]


# ----------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _reporting_errors() -> Iterator[None]:
    """Turn expected failures into ``error: ...`` and exit 1; cache warnings into one line each."""
    failure: BaseException | None = None
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CacheWarning)
            try:
                yield
            except _EXPECTED_ERRORS as exc:
                failure = exc
    finally:  # outside catch_warnings, so re-issued warnings reach the normal machinery
        _flush_warnings(caught)
    if failure is not None:
        typer.echo(f"error: {describe_error(failure)}", err=True)
        raise typer.Exit(1)


def _flush_warnings(caught: list[warnings.WarningMessage]) -> None:
    for item in caught:
        if issubclass(item.category, CacheWarning):
            typer.echo(f"warning: {item.message}", err=True)
        else:  # back through the active filters, as if never caught
            warnings.warn_explicit(item.message, item.category, item.filename, item.lineno, source=item.source)


def _cache_root(ctx: typer.Context, cache_dir: Path | None) -> Path:
    """The command's --cache-dir, else the global one, else the default root (absolute)."""
    root = cache_dir or (ctx.obj or {}).get("cache_dir") or default_cache_root()
    return Path(root).expanduser().absolute()


def human_size(size: int) -> str:
    """Bytes in binary units: 512 B, 163.0 KiB, 2.5 GiB."""
    if size < 1024:
        return f"{size} B"
    value, unit = float(size), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        value, unit = value / 1024, larger
        if value < 1024:
            break
    return f"{value:.1f} {unit}"


def _age(timestamp: float, now: float) -> str:
    seconds = max(0.0, now - timestamp)
    for unit, width in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= width:
            return f"{int(seconds // width)}{unit} ago"
    return "just now"


def parse_duration(text: str) -> float:
    """Seconds in a duration such as 45s, 30m, 12h, 7d or 2w."""
    match = _DURATION_RE.fullmatch(text.strip())
    if match is None:
        raise typer.BadParameter(
            f"{text!r} is not a duration: use a number and a unit, e.g. 30m, 12h, 7d", param_hint="'--older-than'"
        )
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


# ----------------------------------------------------------------------------- top level
@app.callback()
def _global_options(ctx: typer.Context, cache_dir: CacheDirOption = None) -> None:
    """JIT kernel-generation compiler for attention variants (CuTe DSL)."""
    ctx.obj = {"cache_dir": cache_dir}


@app.command("compile")
def compile_command(
    ctx: typer.Context,
    spec_file: SpecArgument,
    arch: ArchOption = Arch.SM90A.value,
    no_compile: Annotated[
        bool, typer.Option("--no-compile", help="Fail on a cache miss instead of compiling (or FA4GEN_NO_COMPILE=1).")
    ] = False,
    cache_dir: CacheDirOption = None,
) -> None:
    """Build a spec into the kernel cache (or find it there); print the plan and the entry.
    A line per kernel goes to stderr as each is built or found (a spec has up to three plans)."""
    with _reporting_errors():
        spec, root = load_spec(spec_file), _cache_root(ctx, cache_dir)
        started = time.perf_counter()
        with _build_progress(f"building {spec.summary()} for {arch}") as report:
            result = fa4gen.build(
                spec,
                arch,
                cache_dir=root,
                no_compile=no_compile or None,  # None: env decides
                progress=report,
            )
        elapsed = time.perf_counter() - started
    for built, heading in ((result, ""), *((b, f"{s.label} sequences ({s.rows()}):\n") for s, b in result.splits)):
        status = _build_status(built.entry, built.built_now, elapsed)
        typer.echo(
            f"{heading}{built.plan.describe()}\n\nkey     {built.key}\npath    {built.entry.path}\n"
            f"status  {status}\nsize    {human_size(built.entry.meta.get('size', 0))}"
        )


@contextlib.contextmanager
def _build_progress(description: str) -> Iterator[Callable[[str], None]]:
    """A callback that prints a line to stderr, under a spinner showing ``description`` on a terminal."""
    console = make_console(stderr=True)
    if not console.is_terminal:
        yield lambda line: typer.echo(line, err=True)
        return
    with console.status(description):
        yield lambda line: console.print(line, markup=False)


def _build_status(entry: CacheEntry, built_now: bool, elapsed: float) -> str:
    if not built_now:
        return "cache hit"
    seconds = elapsed
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        seconds = float(json.loads((entry.path / BUILD_INFO_FILE).read_text())["compile_seconds"])
    return f"compiled in {seconds:.1f} s"


@app.command("plan")
def plan_command(
    spec_file: SpecArgument,
    arch: ArchOption = Arch.SM90A.value,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    seqlen: SeqlenOption = None,
    first_call: Annotated[
        bool,
        typer.Option(
            "--first-call",
            help="Show what the first calls run while a kernel missing from the cache builds "
            "(the plan without options that only add code for speed), for each plan.",
        ),
    ] = False,
    backward: BackwardOption = False,
) -> None:
    """Show the tile/pipeline schedule for a spec and the reason behind each choice (and the
    plans for the ranges of query lengths that run another one, where the planner has them)."""
    with _reporting_errors():
        spec = load_spec(spec_file)
        if backward:
            kernel_plan, splits = backward_plan(training_spec(spec), arch), ()
        else:
            kernel_plan = _chosen_plan(spec, arch, seqlen)
            splits = () if seqlen is not None else seqlen_splits(spec, arch)
        if first_call:  # (a plan without such options is its own first-call plan)
            kernel_plan = first_call_plan(kernel_plan) or kernel_plan
            splits = tuple(s.model_copy(update={"plan": first_call_plan(s.plan) or s.plan}) for s in splits)
    if as_json:
        typer.echo(kernel_plan.model_dump_json(indent=2))
    else:
        typer.echo("\n\n".join([kernel_plan.describe(), *(split.describe() for split in splits)]))


def _chosen_plan(spec: AttentionSpec, arch: str, seqlen: int | None) -> Plan:
    """The planner's plan, or with ``seqlen`` the plan that a launch of that length runs."""
    return fa4gen.plan(spec, arch) if seqlen is None else plan_for_seqlen(spec, arch, seqlen)


@app.command("tune")
def tune_command(
    ctx: typer.Context,
    spec_file: SpecArgument,
    arch: ArchOption = Arch.SM90A.value,
    seqlens: Annotated[
        str,
        typer.Option(
            "--seqlens",
            help="Sequence lengths to time, comma-separated [default: 2048,8192 where the main plan runs them]",
            show_default=False,
        ),
    ] = "",
    rounds: Annotated[
        int,
        typer.Option(
            "--rounds", min=1, help="Passes over the candidates (alternating direction; even counts cancel drift)."
        ),
    ] = 4,
    min_gain: Annotated[
        float,
        typer.Option(
            "--min-gain",
            min=0.0,
            help="How much faster than the planner's "
            "default (a share: 0.02 = 2%) the fastest candidate must be to "
            "be recorded; else the default is.",
        ),
    ] = MIN_GAIN,
    cache_dir: CacheDirOption = None,
) -> None:
    """On a GPU: time the planner's candidate plans for a spec and record the fastest (where it
    beats the default by more than --min-gain), which fa4gen.compile then uses on GPUs of this name."""
    with _reporting_errors():
        lengths = tuple(int(part) for part in seqlens.split(",") if part.strip()) or None
        result = tune(
            load_spec(spec_file),
            arch,
            cache_dir=_cache_root(ctx, cache_dir),
            seqlens=lengths,
            log=typer.echo,
            rounds=rounds,
            min_gain=min_gain,
        )
    fastest = result.rows[result.fastest]
    gain = fastest["score"] / result.rows[0]["score"] - 1.0
    typer.echo(f"\nfastest: {fastest['changes']}" + (f" ({gain:+.1%} over the planner default)" if gain else ""))
    if result.chosen != result.fastest:
        typer.echo(f"within {result.min_gain:.1%} of the planner default: the default is recorded")
    typer.echo(f"recorded in {result.path}")


@app.command("emit")
def emit_command(
    spec_file: SpecArgument,
    arch: ArchOption = Arch.SM90A.value,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Write the source here.", dir_okay=False)
    ] = None,
    seqlen: SeqlenOption = None,
    backward: BackwardOption = False,
) -> None:
    """Print the generated CuTe-DSL source of a spec (or write it to a file)."""
    with _reporting_errors():
        spec = load_spec(spec_file)
        if backward:
            spec = training_spec(spec)
            source = fa4gen.emit(spec, backward_plan(spec, arch)).source
        else:
            source = fa4gen.emit(spec, _chosen_plan(spec, arch, seqlen)).source
        if output is not None:
            output.write_text(source)
    if output is None:
        typer.echo(source, nl=False)
    else:
        typer.echo(f"wrote {output} ({len(source.splitlines())} lines)", err=True)


@app.command("schema")
def schema_command() -> None:
    """Print the JSON Schema of the spec format."""
    typer.echo(json.dumps(fa4gen.spec_json_schema(), indent=2))


@app.command("from-hf")
def from_hf_command(
    config: Annotated[Path, typer.Argument(help="A transformers config.json.", dir_okay=False, show_default=False)],
    out: Annotated[
        Path, typer.Option("--out", help="Directory for the spec files (created if missing).", file_okay=False)
    ] = Path("."),
) -> None:
    """Write one spec YAML per attention layer type of a transformers config.json, with
    transformers' semantics (a header comment says which config field each value comes from)."""
    from fa4gen.hf import hf_specs, write_hf_specs

    with _reporting_errors():
        specs = hf_specs(config)
        paths = write_hf_specs(config, out)
    for (name, item), path in zip(specs.items(), paths):
        typer.echo(f"wrote {path}  {name}: {item.spec.summary()}")


@app.command("version")
def version_command(ctx: typer.Context, cache_dir: CacheDirOption = None) -> None:
    """Print the fa4gen version, the CuTe DSL toolchain and the cache root."""
    try:
        found = toolchain()
        tools = f"nvidia-cutlass-dsl {found['cutlass_dsl']} ({found['cuda']})"
    except ToolchainError as exc:
        tools = f"unavailable ({describe_error(exc)})"
    typer.echo(f"fa4gen      {fa4gen.__version__}")
    typer.echo(f"CuTe DSL    {tools}")
    typer.echo(f"cache root  {_cache_root(ctx, cache_dir)}")


# ----------------------------------------------------------------------------- cache
@contextlib.contextmanager
def _opened_cache(ctx: typer.Context, cache_dir: Path | None) -> Iterator[KernelCache]:
    """The selected cache, with expected failures (an untrusted root, ...) reported as one line."""
    with _reporting_errors(), KernelCache(_cache_root(ctx, cache_dir)) as cache:
        yield cache


def _entries(count: int) -> str:
    return f"{count} {'entry' if count == 1 else 'entries'}"


@cache_app.command("ls")
def cache_ls(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print the entries as JSON.")] = False,
    cache_dir: CacheDirOption = None,
) -> None:
    """List cached kernels, most recently used first."""
    with _opened_cache(ctx, cache_dir) as cache:
        entries = cache.entries()
    if as_json:
        fields = ("summary", "arch", "size", "created", "last_use")
        rows = [{"key": e.key, **{f: e.meta.get(f) for f in fields}, "path": str(e.path)} for e in entries]
        typer.echo(json.dumps(rows, indent=2))
    elif not entries:
        typer.echo(f"cache is empty ({cache.root})")
    else:
        make_console().print(_entries_table(entries, cache.root))


def _entries_table(entries: list[CacheEntry], root: Path):
    from rich.table import Table

    now = time.time()
    table = Table(title=f"{len(entries)} cached kernel{'s' if len(entries) != 1 else ''} in {root}")
    table.add_column("key", no_wrap=True)
    table.add_column("spec", overflow="fold")
    for name in ("arch", "size", "created", "last use"):
        table.add_column(name, no_wrap=True, justify="right" if name == "size" else "left")
    for entry in entries:
        meta = entry.meta
        created = datetime.fromtimestamp(meta["created"]).strftime("%Y-%m-%d %H:%M")
        table.add_row(
            entry.key[:12],
            str(meta.get("summary", "?")),
            str(meta.get("arch", "?")),
            human_size(meta["size"]),
            created,
            _age(meta["last_use"], now),
        )
    return table


@cache_app.command("clear")
def cache_clear(
    ctx: typer.Context,
    arch: Annotated[Optional[str], typer.Option("--arch", help="Only entries built for this arch.")] = None,
    older_than: Annotated[
        Optional[str],
        typer.Option("--older-than", help="Only entries last used longer ago than this, e.g. 30m, 12h, 7d."),
    ] = None,
    cache_dir: CacheDirOption = None,
) -> None:
    """Remove cached kernels: all of them (broken ones included), or those matching the filters."""
    cutoff = time.time() - parse_duration(older_than) if older_than is not None else None
    with _opened_cache(ctx, cache_dir) as cache:
        target = Arch.parse(arch).value if arch is not None else None

        def matches(entry: CacheEntry) -> bool:
            if target is not None and entry.meta.get("arch") != target:
                return False
            return cutoff is None or entry.meta["last_use"] < cutoff

        filtered = target is not None or cutoff is not None
        removed = cache.clear(predicate=matches if filtered else None)
    typer.echo(f"removed {_entries(removed)} from {cache.root}")


@cache_app.command("verify")
def cache_verify(ctx: typer.Context, cache_dir: CacheDirOption = None) -> None:
    """Re-hash every cached file; exit 1 if any entry is broken."""
    with _opened_cache(ctx, cache_dir) as cache:
        report = cache.verify()
    broken = [(key, problem) for key, problem in report if problem is not None]
    for key, problem in broken:
        typer.echo(f"broken {key[:12]}: {problem}")
    typer.echo(f"{_entries(len(report))} checked in {cache.root}: {len(report) - len(broken)} ok, {len(broken)} broken")
    if broken:
        raise typer.Exit(1)


@cache_app.command("drop")
def cache_drop(
    ctx: typer.Context,
    names: Annotated[
        list[str],
        typer.Argument(
            help=f"Files to remove from every entry, e.g. {PTX_FILE} (kept for inspection; the loader reads "
            f"only {LIBRARY_FILE})."
        ),
    ],
    cache_dir: CacheDirOption = None,
) -> None:
    """Remove inspection files from the cached kernels (and from their records), to ship a smaller cache."""
    if LIBRARY_FILE in names:
        raise typer.BadParameter(
            f"{LIBRARY_FILE} is the compiled kernel that loading needs; drop others, e.g. {PTX_FILE}",
            param_hint="NAMES",
        )
    with _opened_cache(ctx, cache_dir) as cache:
        count = cache.drop_files(names)
    typer.echo(f"dropped {', '.join(names)} from {_entries(count)} in {cache.root}")


@cache_app.command("export")
def cache_export(
    ctx: typer.Context,
    archive: Annotated[Path, typer.Argument(help="Archive to write (tar.gz).", dir_okay=False)],
    cache_dir: CacheDirOption = None,
) -> None:
    """Write every valid cached kernel into one archive, to ship to another machine."""
    with _opened_cache(ctx, cache_dir) as cache:
        count = cache.export(archive)
    typer.echo(f"exported {_entries(count)} to {archive}")


@cache_app.command("import")
def cache_import(
    ctx: typer.Context,
    archive: Annotated[Path, typer.Argument(help="Archive written by `fa4gen cache export`.")],
    sha256: Annotated[
        Optional[str],
        typer.Option(
            "--sha256",
            metavar="HEX",
            show_default=False,
            help="Import only if the archive's SHA-256 is this digest (checked before anything is extracted). "
            "Take the digest from the archive's producer over a channel you trust.",
        ),
    ] = None,
    cache_dir: CacheDirOption = None,
) -> None:
    """Add the kernels of an exported archive to the cache (entries already present are kept).
    An archive is code: each entry's kernel.so is loaded and run by the processes that use the
    cache, so import only archives from a source you trust. The hashes inside an archive (checked
    on import and by `fa4gen cache verify`) catch corruption, not malice: whoever made the archive
    made its hashes too. --sha256 pins the archive to a digest its producer published."""
    if sha256 is not None and not _SHA256_RE.fullmatch(sha256):
        raise typer.BadParameter(
            f"{sha256[:80]!r} is not a SHA-256 digest: give 64 hex digits, e.g. from "
            "`sha256sum ARCHIVE` where the archive was made",
            param_hint="'--sha256'",
        )
    with _opened_cache(ctx, cache_dir) as cache:
        count = cache.import_(archive, sha256=None if sha256 is None else sha256.lower())
    typer.echo(f"imported {_entries(count)} into {cache.root}")


# ----------------------------------------------------------------------------- warm
def _split_arches(text: str) -> list[str]:
    arches = [part.strip() for part in text.split(",") if part.strip()]
    if not arches:
        raise typer.BadParameter("name at least one arch, e.g. sm_90a", param_hint="--arch")
    return list(dict.fromkeys(arches))


@app.command("warm")
def warm_command(
    ctx: typer.Context,
    paths: Annotated[
        list[Path],
        typer.Argument(help="Spec files or directories (searched recursively).", exists=True, show_default=False),
    ],
    arch: ArchOption = Arch.SM90A.value,
    jobs: Annotated[int, typer.Option("--jobs", "-j", min=1, help="Worker processes.")] = 1,
    tuning_candidates: Annotated[
        bool,
        typer.Option(
            "--tuning-candidates",
            help="Also compile every plan `fa4gen tune` times, so a GPU machine "
            "without the compiler can tune (FA4GEN_NO_COMPILE=1).",
        ),
    ] = False,
    training: Annotated[
        bool,
        typer.Option(
            "--training",
            help="Also compile what training runs: each spec's forward with its LSE and its backward, "
            "so training with FA4GEN_NO_COMPILE=1 finds every kernel.",
        ),
    ] = False,
    no_compile: Annotated[
        bool,
        typer.Option(
            "--no-compile",
            help="Compile nothing: report each spec missing from the cache as failed "
            "(or FA4GEN_NO_COMPILE=1), e.g. to check that a shipped cache covers every spec.",
        ),
    ] = False,
    cache_dir: CacheDirOption = None,
) -> None:
    """Compile every spec under PATHS for every arch into the cache; exit 1 if any failed."""
    arches = _split_arches(arch)
    root = _cache_root(ctx, cache_dir)
    with _reporting_errors():  # what every job would fail on alike is one error, not a row per spec
        for target in arches:
            Arch.parse(target)  # unknown: an error here; reserved (sm_100a): a failed row per spec
        KernelCache(root).close()  # FA4GEN_CACHE_SIZE_LIMIT, the root's usability and trust
        toolchain()
    spec_files = collect_spec_files(paths, exclude=root)
    if not spec_files:
        typer.echo(
            f"error: no spec files ({', '.join('*' + s for s in SPEC_SUFFIXES)}) under {', '.join(map(str, paths))}",
            err=True,
        )
        raise typer.Exit(1)
    if tuning_candidates:
        work = [job for spec_file in spec_files for target in arches for job in candidate_jobs(spec_file, target)]
    else:
        work = [WarmJob(spec_file, target) for spec_file in spec_files for target in arches]
    if training:
        work += [WarmJob(spec_file, target, training=True) for spec_file in spec_files for target in arches]
    started = time.perf_counter()
    results = warm_results(work, root, jobs, refuse=no_compile or _no_compile_default())
    make_console().print(warm_table(work, results))
    counts = {status: sum(r["status"] == status for r in results) for status in STATUS_STYLES}
    typer.echo(
        f"{counts['compiled']} compiled, {counts['cached']} cached, {counts['failed']} failed "
        f"in {time.perf_counter() - started:.1f} s ({root})"
    )
    if counts["failed"]:
        raise typer.Exit(1)


def main() -> None:
    # fa4gen's logged warnings (e.g. an unusable cache index) as one "warning: ..." line each,
    # like the cache's corruption warnings, instead of the logging module's bare fallback
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    handler.setLevel(logging.WARNING)
    logging.getLogger("fa4gen").addHandler(handler)
    app()


if __name__ == "__main__":
    main()
