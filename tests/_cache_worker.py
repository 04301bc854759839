"""Helper process for tests/test_cache.py: get_or_build some keys, print one JSON line.

    python tests/_cache_worker.py ROOT KEY [KEY ...] [--log F] [--sleep S] [--started F]
                                  [--ready F --go F] [--no-compile] [--held F --release F]

The fake build appends "<pid>\\n" to --log, writes kernel.so (random bytes, so two builds can be
told apart), touches --started, sleeps --sleep seconds, then writes its last file. With --ready
and --go the process signals that it is up and waits for the go file, so many workers race.
With --held and --release it keeps its entries pinned (as a process loading them does), touches
the held file, and waits for the release file before it reads them.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

# Load fa4gen/cache.py by path rather than through the fa4gen package, whose __init__ pulls in
# the whole compiler: 16 racing workers then start in a fraction of the time, and only the
# cache's own imports are exercised (it must stay importable on its own: hot path).
_SPEC = importlib.util.spec_from_file_location(
    "fa4gen_cache_under_test", Path(__file__).resolve().parents[1] / "fa4gen" / "cache.py"
)
cache_module = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = cache_module
_SPEC.loader.exec_module(cache_module)
CacheMiss, KernelCache = cache_module.CacheMiss, cache_module.KernelCache


def make_build(log: str, sleep: float, started: str | None):
    def build(out: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        (out / "kernel.so").write_bytes(os.urandom(64 * 1024))
        (out / "kernel.py").write_text("# generated kernel source\n")
        if started:
            Path(started).touch()
        time.sleep(sleep)
        (out / "plan.json").write_text('{"tile_m": 128}\n')

    return build


def wait_for(path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.005)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("keys", nargs="+")
    parser.add_argument("--log", default=os.devnull)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--started")
    parser.add_argument("--ready")
    parser.add_argument("--go")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--held")
    parser.add_argument("--release")
    args = parser.parse_args()

    cache = KernelCache(args.root)
    build = make_build(args.log, args.sleep, args.started)
    if args.ready:
        Path(args.ready).touch()
    if args.go:
        wait_for(args.go)
    with cache.pinned():
        found = []
        for key in args.keys:
            try:
                found.append(
                    (
                        key,
                        *cache.get_or_build(
                            key, {"name": "worker"}, build, no_compile=args.no_compile, miss_message="miss"
                        ),
                    )
                )
            except CacheMiss:
                found.append((key, None, False))
        if args.held:
            Path(args.held).touch()
            wait_for(args.release)
        results = []
        for key, entry, built in found:
            if entry is None:
                results.append({"key": key, "hit": False})
                continue
            digest = hashlib.sha256(entry.file("kernel.so").read_bytes()).hexdigest()
            results.append({"key": key, "hit": not built, "built": built, "digest": digest})
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
