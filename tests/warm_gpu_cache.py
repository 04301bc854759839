"""Compile every kernel the GPU tests need into a cache directory (runs without a GPU).

python tests/warm_gpu_cache.py .devcache/kernels
python tests/warm_gpu_cache.py --backward .devcache/kernels       # tests/test_gpu_bwd.py's kernels
python tests/warm_gpu_cache.py --deterministic .devcache/kernels  # its deterministic cases' kernels
python tests/warm_gpu_cache.py --decode .devcache/kernels         # tests/test_gpu_decode.py's kernels
python tests/warm_gpu_cache.py --transposed .devcache/kernels     # the transposed backward's cases
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_cases import (
    AUTOGRAD_CASES,
    backward_specs,
    decode_specs,
    example_specs,
    first_call_cases,
    gpu_specs,
    grouped_turns_plan,
    keyless_cases,
    pair_tail_specs,
    plan_option_cases,  # noqa: E402
    split_tail_cases,
    transposed_plan,
    transposed_specs,
    variant_specs,
)
from hf_cases import hf_gpu_specs  # noqa: E402

import fa4gen  # noqa: E402


def integration_specs() -> dict[str, fa4gen.AttentionSpec]:
    """The kernels examples/transformers_model.py and the integration's GPU tests run."""
    import importlib.util

    from transformers import AutoConfig

    from fa4gen.integrations.transformers import kernel_specs

    path = Path(__file__).resolve().parent.parent / "examples" / "transformers_model.py"
    module_spec = importlib.util.spec_from_file_location("transformers_model_example", path)
    example = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(example)
    return {
        f"integration/{name}/{kind}": spec
        for name, config in example.MODEL_CONFIGS.items()
        for kind, spec in kernel_specs(AutoConfig.for_model(**config)).items()
    }


def main(cache_dir: str) -> None:
    tails = {f"pair-tail/{name}": spec for name, (spec, _) in pair_tail_specs().items()}
    hf = {f"hf/{name}": spec for name, spec in hf_gpu_specs().items()}
    decode = {f"decode/{name}": spec for name, spec in decode_specs().items()}
    every = {**gpu_specs(), **variant_specs(), **example_specs(), **tails, **hf, **integration_specs(), **decode}
    for name, spec in every.items():
        started = time.perf_counter()
        result = fa4gen.build(spec, "sm_90a", cache_dir=cache_dir)
        state = "compiled" if result.any_built_now else "cached"
        print(f"{name:28} {state:8} {time.perf_counter() - started:6.2f} s  {result.key[:12]}", flush=True)
    planned = {
        **plan_option_cases(),
        **{f"keyless/{name}": case for name, case in keyless_cases().items()},
        **{f"split-tail/{name}": case for name, case in split_tail_cases().items()},
    }
    for name, (spec, _, quick) in first_call_cases().items():
        planned[f"first-call/{name}"] = (spec, quick)
    for name, (spec, plan) in planned.items():
        started = time.perf_counter()
        result = fa4gen.build(spec, "sm_90a", cache_dir=cache_dir, kernel_plan=plan)
        state = "compiled" if result.any_built_now else "cached"
        print(f"{name:28} {state:8} {time.perf_counter() - started:6.2f} s  {result.key[:12]}", flush=True)
    warm_backward(cache_dir)


def warm_decode(cache_dir: str) -> None:
    """The decode tests' kernels (each spec's decode and forward kernels)."""
    for name, spec in decode_specs().items():
        started = time.perf_counter()
        result = fa4gen.build(spec, "sm_90a", cache_dir=cache_dir)
        state = "compiled" if result.any_built_now else "cached"
        print(f"decode/{name:21} {state:8} {time.perf_counter() - started:6.2f} s  {result.key[:12]}", flush=True)


def warm_backward(cache_dir: str, deterministic_only: bool = False) -> None:
    """The backward tests' kernels: each spec's training forward (with its LSE) and backward, and
    the plain forward of the specs the tests run through autograd (``deterministic_only``: the
    deterministic cases', and test_deterministic_dk_dv's)."""
    from fa4gen.api import training_spec
    from fa4gen.planner import backward_plan

    for name, spec in backward_specs().items():
        if deterministic_only and not (spec.deterministic or name == "d128-gqa4-causal"):
            continue
        started = time.perf_counter()
        with_lse = training_spec(spec)
        forward = fa4gen.build(with_lse, "sm_90a", cache_dir=cache_dir)
        backward = fa4gen.build(with_lse, "sm_90a", cache_dir=cache_dir, kernel_plan=backward_plan(with_lse))
        if name in AUTOGRAD_CASES:
            fa4gen.build(spec, "sm_90a", cache_dir=cache_dir)
        if spec.deterministic:  # (test_deterministic_dq_groups_sum_in_a_fixed_order)
            fa4gen.build(with_lse, "sm_90a", cache_dir=cache_dir, kernel_plan=grouped_turns_plan(spec))
        state = "compiled" if forward.any_built_now or backward.built_now else "cached"
        print(f"backward/{name:19} {state:8} {time.perf_counter() - started:6.2f} s  {backward.key[:12]}", flush=True)
    if not deterministic_only:
        warm_transposed(cache_dir)


def warm_transposed(cache_dir: str) -> None:
    """test_transposed_backward_matches_reference's kernels: each case's training forward and its
    backward computed transposed (gpu_cases.transposed_plan)."""
    from fa4gen.api import training_spec

    for name, spec in transposed_specs().items():
        started = time.perf_counter()
        with_lse = training_spec(spec)
        forward = fa4gen.build(with_lse, "sm_90a", cache_dir=cache_dir)
        backward = fa4gen.build(with_lse, "sm_90a", cache_dir=cache_dir, kernel_plan=transposed_plan(spec))
        state = "compiled" if forward.any_built_now or backward.built_now else "cached"
        print(f"transposed/{name:17} {state:8} {time.perf_counter() - started:6.2f} s  {backward.key[:12]}", flush=True)


if __name__ == "__main__":
    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    target = next((a for a in sys.argv[1:] if not a.startswith("--")), ".devcache/kernels")
    if flags - {"--backward", "--deterministic", "--decode", "--transposed"}:
        raise SystemExit(f"unknown flags {sorted(flags)}: --backward, --deterministic, --decode, --transposed or none")
    if "--backward" in flags or "--deterministic" in flags:
        warm_backward(target, deterministic_only="--backward" not in flags)
    if "--transposed" in flags:
        warm_transposed(target)
    if "--decode" in flags:
        warm_decode(target)
    if not flags:
        main(target)
