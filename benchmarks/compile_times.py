"""Cold compile time per spec on this machine (no GPU needed).

    python benchmarks/compile_times.py specs/*.yaml

One process: first the one-time imports every compiling process pays (CuTe DSL, torch and
apache-tvm-ffi, which the DSL's TVM-FFI export loads), then each spec compiled into an empty
cache. Prints a markdown table of trace + ``cute.compile`` per kernel (from the entry's
build.json) and the whole build (plan, emit, compile, export, link, cache write).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path


def main(paths: list[str]) -> None:
    started = time.perf_counter()
    import cutlass.cute  # noqa: F401
    import torch  # noqa: F401
    import tvm_ffi  # noqa: F401

    import fa4gen

    print(f"one-time imports (CuTe DSL, torch, tvm-ffi, fa4gen): {time.perf_counter() - started:.1f} s\n")
    print("| spec | trace + cute.compile s | whole build s |\n|---|---|---|")
    with tempfile.TemporaryDirectory() as cache:
        for path in paths:
            begin = time.perf_counter()
            result = fa4gen.build(fa4gen.load_spec(path), "sm_90a", cache_dir=cache)
            whole = time.perf_counter() - begin
            info = json.loads((result.entry.path / "build.json").read_text())
            print(f"| {Path(path).stem} | {info['compile_seconds']:.1f} | {whole:.1f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
