"""Cold compile time per spec on this machine (no GPU needed): one fresh process per spec.

    python benchmarks/compile_times.py specs/*.yaml

Prints a markdown table: the process's wall time (Python start, imports, plan, emit, compile,
link, cache write) and ``cute.compile`` alone (recorded in the entry's build.json).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(paths: list[str]) -> None:
    print("| spec | process wall s | cute.compile s |\n|---|---|---|")
    for path in paths:
        with tempfile.TemporaryDirectory() as cache:
            started = time.perf_counter()
            subprocess.run(["fa4gen", "compile", path, "--arch", "sm_90a", "--cache-dir", cache],
                           check=True, capture_output=True)
            wall = time.perf_counter() - started
            info = json.loads(next(Path(cache, "entries").glob("*/build.json")).read_text())
            print(f"| {Path(path).stem} | {wall:.1f} | {info['compile_seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
