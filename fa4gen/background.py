"""Builds in another process: the planner's kernel compiles there while a first call runs a
kernel that compiles in about half the time (``planner.first_call_plan``, decision first-call-plan).

The child is a fresh interpreter with this one's ``sys.path`` and no visible GPU (compiling never
needs one), niced so the caller's work comes first. It builds one plan into the shared disk
cache, whose per-key lock makes concurrent builders of one key wait for the first; the parent
polls it with a ``waitpid`` per launch and loads the kernel from the cache once it exits. A child
still running when the parent exits finishes its build, so the next process finds the kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV = "FA4GEN_FIRST_CALL"  # "full": a cache miss builds the planner's kernel before the first call
MIN_CPUS = 4  # the child needs a core of its own, or it slows the first call it should not delay
LOG_TAIL = 2000  # characters of a failed child's last line quoted in the warning

Loaded = tuple[Any, Path]  # (the kernel's entry point, its cache entry's path)


class FirstCallWarning(UserWarning):
    """The planner's kernel could not be built in the background: the first-call kernel stays."""


CPU_QUOTA = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "quota period", or "max period"


def usable_cpus() -> float:
    """The cores this process may use: its CPU affinity, capped by a container's CPU quota."""
    try:
        cpus: float = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        cpus = os.cpu_count() or 1
    try:
        quota, period = CPU_QUOTA.read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return cpus


def enabled() -> bool:
    """Whether a cache miss may run a first-call kernel while the planner's builds elsewhere."""
    if os.environ.get(ENV, "").strip().lower() == "full":
        return False
    return usable_cpus() >= MIN_CPUS


class PendingBuild:
    """A plan building in a child process; ``poll`` says whether it is done without blocking."""

    def __init__(self, process: subprocess.Popen, log: Any, load: Callable[[], Loaded], what: str):
        self._process = process
        self._log = log
        self._load = load
        self.what = what

    def poll(self, wait: bool = False) -> Loaded | None:
        """The built kernel once the child has exited (loaded from the cache), else None; a
        failed child warns once (FirstCallWarning) and raises BackgroundBuildFailed."""
        code = self._process.wait() if wait else self._process.poll()
        if code is None:
            return None
        self._log.seek(0)
        output = self._log.read().decode(errors="replace")
        self._log.close()
        if code != 0:
            last = (output.strip().splitlines() or ["(no output)"])[-1][-LOG_TAIL:]
            message = (
                f"fa4gen could not build {self.what} in the background (exit status {code}), so its first-call "
                f"kernel keeps running in this process; `fa4gen warm`, or FA4GEN_FIRST_CALL=full in the next "
                f"process, builds it. The child said: {last}"
            )
            warnings.warn(message, FirstCallWarning, stacklevel=3)
            raise BackgroundBuildFailed(message)
        return self._load()


class BackgroundBuildFailed(RuntimeError):
    """The child exited with an error (already reported as a FirstCallWarning)."""


def start(job: dict[str, Any], load: Callable[[], Loaded], what: str) -> PendingBuild:
    """Build ``job`` in a child process (fa4gen.background_child.main says what a job holds)."""
    log = tempfile.TemporaryFile()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    boot = "import sys, json; sys.path[:] = json.loads(sys.argv[1]); from fa4gen.background_child import main; main()"
    process = subprocess.Popen(
        [sys.executable, "-c", boot, json.dumps(sys.path), json.dumps(job)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        close_fds=True,
    )
    return PendingBuild(process, log, load, what)
