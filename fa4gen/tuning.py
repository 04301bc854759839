"""Plans chosen by measurement on the device they run on (``fa4gen tune``).

``tune`` compiles the planner's candidate plans for a spec (``planner.candidates``), times each
on a few shapes on the current GPU, and records the fastest in the cache directory, keyed by
(arch, GPU name, spec), where it beats the planner's default by more than ``MIN_GAIN`` (else the
default: a closer win is the noise of a shared GPU). ``fa4gen.compile`` then uses the recorded
plan on a GPU of that name in place of the planner's default (calls in a length range of
``planner.seqlen_splits`` still run that range's plan); everywhere else (other GPUs, CPU-only
cross-compiles, ``fa4gen warm``) the planner's table applies.

Records: fa4gen.tuned (where they live and which are ignored).
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fa4gen.arch import Arch, UnsupportedArchError
from fa4gen.planner import Plan, SeqlenSplit, candidates, seqlen_splits
from fa4gen.spec import AttentionSpec
from fa4gen.tuned import current_device_name, record_plan, tuned_plan  # noqa: F401 (tuning's API)

DEFAULT_SEQLENS = (2048, 8192)
DEFAULT_ROUNDS = 4  # even: see tune()
# A candidate replaces the planner's default only when its score beats the default's by more
# than this share: closer winners on the shared H200 did not repeat (decision tune-min-gain)
MIN_GAIN = 0.02


@dataclass
class TuneResult:
    best: Plan  # the recorded plan: the fastest candidate, or the default where none beat it by min_gain
    rows: list[dict] = field(default_factory=list)  # per candidate: changes, TFLOP/s per seqlen, score
    path: Path | None = None
    fastest: int = 0  # the row of the fastest candidate (0: the planner's default)
    chosen: int = 0  # the row of the recorded one: fastest, or 0 where that won by min_gain or less
    min_gain: float = MIN_GAIN


def _changes(base: Plan, other: Plan) -> str:
    """The config fields ``other`` sets otherwise than ``base`` (reasons left out)."""
    before = base.config.model_dump()
    diff = [f"{k}={v}" for k, v in other.config.model_dump().items() if before[k] != v]
    return ", ".join(diff) or "planner default"


def gpu_measure(spec: AttentionSpec, plan: Plan, seqlens: tuple[int, ...], cache_dir: Path | None) -> list[float]:
    """TFLOP/s of ``plan`` on the current GPU at each seqlen (16k tokens, model width 2048)."""
    from fa4gen.api import compile as compile_kernel
    from fa4gen.bench import make_case, make_inputs, time_ms

    kernel = compile_kernel(spec, cache_dir=cache_dir, kernel_plan=plan)
    results = []
    for seqlen in seqlens:
        case = make_case(spec, seqlen)
        results.append(case.flops() / time_ms(kernel, make_inputs(case)) / 1e9)
    return results


def default_seqlens(splits: tuple[SeqlenSplit, ...]) -> tuple[int, ...]:
    """The lengths of ``DEFAULT_SEQLENS`` that no length range covers (a tuned plan replaces only
    the main plan), else the longest below every range, else ``DEFAULT_SEQLENS``."""
    ranges = [split for split in splits if split.plain]
    free = tuple(s for s in DEFAULT_SEQLENS if not any(split.covers(s) for split in ranges))
    below = min(split.min_seqlen_q for split in ranges) - 1 if ranges else 0
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
            warnings.warn(
                f"fa4gen.compile runs the planner's {split.label}-sequence plan for {split.rows()}, "
                f"whatever is tuned: time lengths outside that range, not {', '.join(covered)}",
                UserWarning,
                stacklevel=2,
            )
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
        rows.append(
            {
                "changes": _changes(plans[0], plan),
                "tflops": dict(zip(map(str, seqlens), tflops)),
                "score": score,
                "rounds": len(runs),
            }
        )
        log(f"{rows[-1]['changes']:48} " + " ".join(f"S={s}: {t:.0f}" for s, t in zip(seqlens, tflops)))
    fastest = max(range(len(rows)), key=lambda i: rows[i]["score"])
    chosen = fastest if rows[fastest]["score"] > rows[0]["score"] * (1.0 + min_gain) else 0
    path = record_plan(root, spec, target, device, plans[chosen], rows)
    return TuneResult(best=plans[chosen], rows=rows, path=path, fastest=fastest, chosen=chosen, min_gain=min_gain)
