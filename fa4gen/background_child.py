"""The child process of fa4gen.background: builds one plan into a kernel cache and exits."""

from __future__ import annotations

import json
import os
import sys

from fa4gen.api import _build_plan
from fa4gen.arch import Arch
from fa4gen.background import LOG_TAIL
from fa4gen.cache import KernelCache
from fa4gen.planner import Plan
from fa4gen.spec import AttentionSpec


def main() -> None:
    """The child: build one plan into a cache. ``job``: spec (canonical dict), plan (dict),
    arch, cache (root) and key (what the parent expects the plan's key to be)."""
    try:
        os.nice(10)
    except OSError:
        pass
    job = json.loads(sys.argv[2])
    try:
        spec, plan = AttentionSpec.model_validate(job["spec"]), Plan.model_validate(job["plan"])
        result = _build_plan(spec, Arch.parse(job["arch"]), plan, KernelCache(job["cache"]), False)
    except Exception as exc:  # one line for the parent's warning
        sys.exit(f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:LOG_TAIL])
    if result.key != job["key"]:  # another toolchain or source tree than the parent's
        sys.exit(f"built key {result.key[:16]}, the caller expected {job['key'][:16]}")
