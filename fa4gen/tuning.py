"""Plans chosen by measurement on the device they run on (``fa4gen tune``).

``tune`` compiles the planner's candidate plans for a spec (``planner.candidates``), times each
on a few shapes on the current GPU, and records the fastest in the cache directory, keyed by
(arch, GPU name, spec), where it beats the planner's default by more than ``MIN_GAIN`` (else the
default: a closer win is the noise of a shared GPU). ``fa4gen.compile`` then uses the recorded
plan on a GPU of that name in place of the planner's default (calls in a length range of
``planner.seqlen_splits`` still run that range's plan); everywhere else (other GPUs, CPU-only
cross-compiles, ``fa4gen warm``) the planner's table applies. Records are small JSON files
written atomically; a record that no longer parses as a Plan (an older fa4gen) is ignored with
a warning.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fa4gen.arch import Arch, UnsupportedArchError
from fa4gen.cache import make_key
from fa4gen.planner import Plan, SeqlenSplit, candidates, seqlen_splits
from fa4gen.spec import AttentionSpec

TUNED_DIR = "tuned"
DEFAULT_SEQLENS = (2048, 8192)
DEFAULT_ROUNDS = 4  # even: see tune()
# A candidate replaces the planner's default only when its score beats the default's by more
# than this share: on the shared H200 (session 25, BENCHMARKS.md), three of six tune calls (d256
# causal and d128 causal, three each) recorded a candidate 0.4-1.7% ahead of the default, a
# different one each time, and each of those read 0.955-0.988x of the default in another call
MIN_GAIN = 0.02


def current_device_name() -> str | None:
    """Name of the current CUDA device (host-side query), or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.cuda.current_device())


def _record_path(cache_root: Path, spec: AttentionSpec, arch: Arch, device: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower() or "device"
    return Path(cache_root) / TUNED_DIR / arch.value / slug / f"{make_key({'spec': spec.canonical()})}.json"


def tuned_plan(cache_root: Path, spec: AttentionSpec, arch: Arch, device: str) -> Plan | None:
    """The plan recorded for (spec, arch, device), or None."""
    path = _record_path(cache_root, spec, arch, device)
    try:
        record = json.loads(path.read_text())
        plan = Plan.model_validate(record["plan"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"ignoring the tuned plan in {path}: {exc}", RuntimeWarning, stacklevel=2)
        return None
    return plan if plan.arch == arch.value else None


def record_plan(cache_root: Path, spec: AttentionSpec, arch: Arch, device: str, plan: Plan,
                measurements: list[dict]) -> Path:
    path = _record_path(cache_root, spec, arch, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"spec": spec.canonical(), "arch": arch.value, "device": device, "plan": plan.model_dump(),
              "measurements": measurements, "recorded": time.time()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


@dataclass
class TuneResult:
    best: Plan  # the recorded plan: the fastest candidate, or the default where none beat it by min_gain
    rows: list[dict] = field(default_factory=list)  # per candidate: changes, TFLOP/s per seqlen, score
    path: Path | None = None
    fastest: int = 0  # the row of the fastest candidate (0: the planner's default)
    chosen: int = 0  # the row of the recorded one: fastest, or 0 where that won by min_gain or less
    min_gain: float = MIN_GAIN


def _changes(base: Plan, other: Plan) -> str:
    skip = {"reasons", "smem_bytes"}
    diff = [f"{k}={v}" for k, v in other.model_dump(exclude=skip).items() if base.model_dump()[k] != v]
    return ", ".join(diff) or "planner default"


def gpu_measure(spec: AttentionSpec, plan: Plan, seqlens: tuple[int, ...], cache_dir: Path | None) -> list[float]:
    """TFLOP/s of ``plan`` on the current GPU at each seqlen (16k tokens, model width 2048)."""
    import fa4gen
    from fa4gen import bench

    kernel = fa4gen.compile(spec, cache_dir=cache_dir, kernel_plan=plan)
    results = []
    for seqlen in seqlens:
        case = bench.make_case(spec, seqlen)
        results.append(case.flops() / bench.time_ms(kernel, bench.make_inputs(case)) / 1e9)
    return results


def default_seqlens(splits: tuple[SeqlenSplit, ...]) -> tuple[int, ...]:
    """The lengths of ``DEFAULT_SEQLENS`` that no length range covers (a tuned plan replaces only
    the main plan), else the longest below every range, else ``DEFAULT_SEQLENS``."""
    free = tuple(s for s in DEFAULT_SEQLENS if not any(split.covers(s) for split in splits))
    below = min(split.min_seqlen_q for split in splits) - 1 if splits else 0
    return free or ((below,) if below >= 1 else DEFAULT_SEQLENS)


def tune(
    spec: AttentionSpec,
    arch: Arch | str = Arch.SM90A,
    *,
    cache_dir: str | Path | None = None,
    seqlens: tuple[int, ...] | None = None,
    device: str | None = None,
    measure: Callable[[AttentionSpec, Plan, tuple[int, ...], Path | None], list[float]] = gpu_measure,
    log: Callable[[str], None] = lambda line: None,
    rounds: int = DEFAULT_ROUNDS,
    min_gain: float = MIN_GAIN,
) -> TuneResult:
    """Time every candidate plan (``rounds`` passes, alternating direction; mean per candidate)
    and record the one with the best geometric-mean TFLOP/s over ``seqlens`` (default: those of
    ``DEFAULT_SEQLENS`` that run the planner's main plan, not a length range's), where it beats
    the planner's default (the first candidate) by more than ``min_gain``; else the default."""
    if min_gain < 0:
        raise ValueError(f"min_gain must be >= 0 (a share of the default's score), got {min_gain}")
    from fa4gen.cache import KernelCache

    target = Arch.parse(arch)
    device = device or current_device_name()
    if device is None:
        raise UnsupportedArchError("fa4gen tune times kernels on a GPU: no CUDA device is visible")
    root = KernelCache(cache_dir).root
    plans = candidates(spec, target)
    splits = seqlen_splits(spec, target)
    if seqlens is None:
        seqlens = default_seqlens(splits)
    for split in splits:
        covered = [str(seqlen) for seqlen in seqlens if split.covers(seqlen)]
        if covered:
            warnings.warn(f"fa4gen.compile runs the planner's {split.label}-sequence plan for {split.rows()}, "
                          f"whatever is tuned: time lengths outside that range, not {', '.join(covered)}",
                          UserWarning, stacklevel=2)
    # rounds alternate forward and backward through the candidates, and each candidate scores
    # its mean: a shared GPU drifts (clocks, neighbours) over a tuning run, and with an even
    # number of rounds every candidate's average position in time is the same, so linear drift
    # favours none of them (one pass in a fixed order would favour whichever ran first)
    samples: list[list[list[float]]] = [[] for _ in plans]
    for round_ in range(rounds):
        order = range(len(plans)) if round_ % 2 == 0 else reversed(range(len(plans)))
        for index in order:
            samples[index].append(measure(spec, plans[index], seqlens, root))
    rows = []
    for plan, runs in zip(plans, samples):
        tflops = [statistics.fmean(run[i] for run in runs) for i in range(len(seqlens))]
        score = math.exp(sum(map(math.log, tflops)) / len(tflops))
        rows.append({"changes": _changes(plans[0], plan), "tflops": dict(zip(map(str, seqlens), tflops)),
                     "score": score, "rounds": len(runs)})
        log(f"{rows[-1]['changes']:48} " + " ".join(f"S={s}: {t:.0f}" for s, t in zip(seqlens, tflops)))
    fastest = max(range(len(rows)), key=lambda i: rows[i]["score"])
    chosen = fastest if rows[fastest]["score"] > rows[0]["score"] * (1.0 + min_gain) else 0
    path = record_plan(root, spec, target, device, plans[chosen], rows)
    return TuneResult(best=plans[chosen], rows=rows, path=path, fastest=fastest, chosen=chosen, min_gain=min_gain)
