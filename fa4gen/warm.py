"""``fa4gen warm``'s machinery: one job per (spec file, arch[, tuning candidate | training]),
hits settled in this process, misses compiled in worker processes, and the report; with the
one-line error texts the command line prints.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
import warnings
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import typer
from pydantic import ValidationError

import fa4gen
from fa4gen.api import NO_COMPILE_ENV, build_training
from fa4gen.cache import CacheMiss, CacheWarning
from fa4gen.planner import candidates
from fa4gen.specfile import SpecFileError, load_spec

SPEC_SUFFIXES = (".yaml", ".yml")
STATUS_STYLES = {"compiled": "green", "cached": "cyan", "failed": "bold red"}  # report rows


def describe_error(exc: BaseException) -> str:
    """One line naming what went wrong; pydantic errors list each bad field and why."""
    if isinstance(exc, ValidationError):
        problems = []
        for error in exc.errors(include_url=False):
            field = ".".join(str(part) for part in error["loc"]) or "spec"
            problems.append(f"{field}: {error['msg']}")
        return "invalid spec: " + "; ".join(problems)
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return " ".join(str(exc).split()) or type(exc).__name__


def failure_reason(exc: BaseException) -> str:
    """``ExceptionType: first line of its message``, for one row of the warm report (whose spec
    column already names the file)."""
    if isinstance(exc, SpecFileError):
        return f"{type(exc).__name__}: {exc.problem}"
    text = describe_error(exc) if isinstance(exc, (ValidationError, OSError)) else str(exc)
    lines = text.strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def make_console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=False)


def warm_one(
    spec_file: str,
    arch: str,
    cache_dir: str,
    no_compile: bool = False,
    candidate: int | None = None,
    training: bool = False,
) -> dict[str, Any] | None:
    """Build one (spec file, arch) pair, or its tuning candidate number ``candidate``, or with
    ``training`` what training runs (the forward with its LSE and the backward); runs in a
    worker process, so plain data in and out. With ``no_compile`` (the parent's quick pass) a
    cache miss returns None: compile it later."""
    started = time.perf_counter()
    # cache warnings go back to the parent, which prints each once (not once per worker)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CacheWarning)
        try:
            spec = load_spec(spec_file)
            if training:
                forward, backward = build_training(spec, arch, cache_dir=cache_dir, no_compile=no_compile)
                built = forward.any_built_now or backward.built_now
            else:
                kernel_plan = None if candidate is None else candidates(spec, arch)[candidate]
                result = fa4gen.build(spec, arch, cache_dir=cache_dir, no_compile=no_compile, kernel_plan=kernel_plan)
                built = result.any_built_now
            row = {"status": "compiled" if built else "cached", "error": None}
        except CacheMiss:
            if no_compile:
                return None
            raise
        except Exception as exc:  # every failure becomes a row of the report, never a crash
            row = {"status": "failed", "error": failure_reason(exc)}
    notes = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    return {**row, "seconds": time.perf_counter() - started, "warnings": notes}


@dataclass(frozen=True)
class WarmJob:
    spec_file: Path
    arch: str
    candidate: int | None = None  # index into planner.candidates(spec, arch); None: the default plan
    training: bool = False  # the forward with its LSE and the backward (api.build_training)

    @property
    def label(self) -> str:
        suffix = "" if self.candidate is None else f" [candidate {self.candidate}]"
        return str(self.spec_file) + suffix + (" [training]" if self.training else "")


def candidate_jobs(spec_file: Path, arch: str) -> list[WarmJob]:
    """Every tuning candidate of one spec (the default plan is candidate 0); an invalid spec or
    arch gives the plain job, whose build reports the error."""
    try:
        count = len(candidates(load_spec(spec_file), arch))
    except Exception:
        return [WarmJob(spec_file, arch)]
    return [WarmJob(spec_file, arch, None if index == 0 else index) for index in range(count)]


def collect_spec_files(paths: list[Path], exclude: Path | None = None) -> list[Path]:
    """Every *.yaml / *.yml file among `paths` (directories searched recursively), sorted;
    files under `exclude` (the cache, whose entries hold spec.yaml copies) are skipped."""
    found: set[Path] = set()
    for path in paths:
        if path.is_dir():
            found.update(p for p in path.rglob("*") if p.suffix.lower() in SPEC_SUFFIXES and p.is_file())
        else:
            found.add(path)
    if exclude is not None:
        found = {p for p in found if not p.absolute().is_relative_to(exclude)}
    return sorted(found)


def run_jobs(jobs: list[WarmJob], cache_root: Path, workers: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = [{} for _ in jobs]
    printed: set[str] = set()  # warnings already shown (workers report the same ones)
    context = multiprocessing.get_context("spawn")
    with job_progress(len(jobs)) as finished, ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures: dict[Future, int] = {
            pool.submit(
                warm_one, str(job.spec_file), job.arch, str(cache_root), False, job.candidate, job.training
            ): index
            for index, job in enumerate(jobs)
        }
        try:
            for future in as_completed(futures):
                index = futures[future]
                try:
                    results[index] = future.result()
                except Exception as exc:  # the worker process itself died (killed, out of memory)
                    results[index] = {"status": "failed", "seconds": 0.0, "error": failure_reason(exc)}
                finished(jobs[index], results[index])
                for note in results[index].get("warnings", ()):
                    if note not in printed:
                        printed.add(note)
                        typer.echo(f"warning: {note}", err=True)
        except BaseException:  # e.g. Ctrl-C: do not start the jobs still queued
            for future in futures:
                future.cancel()
            raise
    return results


@contextlib.contextmanager
def job_progress(total: int) -> Iterator[Callable[[WarmJob, dict[str, Any]], None]]:
    """A callback for each finished job: a progress bar on a terminal, else one line each on stderr
    (a CI log shows what is happening during a long compile, not a minute of silence)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = make_console(stderr=True)
    done = 0

    def line(job: WarmJob, result: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        reason = f": {result['error']}" if result["error"] else ""
        typer.echo(
            f"[{done}/{total}] {result['status']} {job.label} {job.arch} in {result['seconds']:.1f} s{reason}", err=True
        )

    if not console.is_terminal:
        yield line
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("warming", total=total)
        yield lambda job, result: progress.update(task, advance=1, description=f"{job.spec_file.name} {job.arch}")


def warm_table(jobs: list[WarmJob], results: list[dict[str, Any]]):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="fa4gen warm")
    for name in ("spec", "arch", "status", "seconds", "reason"):
        table.add_column(
            name,
            overflow="fold",
            no_wrap=name in ("arch", "status", "seconds"),
            justify="right" if name == "seconds" else "left",
        )
    for job, result in zip(jobs, results):
        status = result["status"]
        table.add_row(
            job.label,
            job.arch,
            f"[{STATUS_STYLES[status]}]{status}[/]",
            f"{result['seconds']:.2f}",
            escape(result["error"] or ""),
        )
    return table


def warm_results(work: list[WarmJob], root: Path, jobs: int, refuse: bool) -> list[dict[str, Any]]:
    """One result per job: hits and invalid specs settled here (milliseconds each), misses compiled
    in worker processes, or with ``refuse`` reported as failed."""
    results = [warm_one(str(job.spec_file), job.arch, str(root), True, job.candidate, job.training) for job in work]
    notes = [note for result in results if result is not None for note in result["warnings"]]
    for note in dict.fromkeys(notes):  # each cache warning once
        typer.echo(f"warning: {note}", err=True)
    misses = [index for index, result in enumerate(results) if result is None]
    if not misses:
        return results
    settled = len(work) - len(misses)
    if refuse:
        reason = f"CacheMiss: not in the cache, and compiling is disabled (--no-compile or {NO_COMPILE_ENV}=1)"
        for index in misses:
            results[index] = {"status": "failed", "seconds": 0.0, "error": reason}
        typer.echo(f"{len(misses)} of {len(work)} not in the cache; compiling is disabled", err=True)
        return results
    workers = min(jobs, len(misses))
    typer.echo(
        f"{settled} of {len(work)} settled without compiling (cached or invalid); compiling "
        f"{len(misses)} with {workers} worker{'s' if workers > 1 else ''}",
        err=True,
    )
    os.environ.setdefault("FA4GEN_LAZY_LOADER", "1")  # workers compile; they never load a kernel
    for index, result in zip(misses, run_jobs([work[i] for i in misses], root, workers)):
        results[index] = result
    return results
