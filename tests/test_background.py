"""First calls on a cache miss (fa4gen.background, planner.first_call_plan): the first launch
builds a kernel that compiles in half the time while the planner's builds in a child process,
and the kernel takes over once the child is done. The GPU test that both agree to rounding is
tests/test_gpu.py::test_first_call_kernel_agrees_with_the_planner_s."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
from gpu_cases import gpu_specs, variant_specs

import fa4gen
from fa4gen import api, background
from fa4gen.cache import KernelCache, make_key
from fa4gen.kernels.sm90.config import config_problem
from fa4gen.planner import first_call_plan, plan_problem, seqlen_splits
from fa4gen.planner.sm90 import FIRST_CALL_OFF
from fa4gen.planner.sm90_tables import FIRST_CALL_TILE_N

SPECS = {**gpu_specs(), **variant_specs()}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_first_call_plan_turns_off_only_code_for_speed(name):
    """A plan with any of the options that add traced code for speed alone, or with key tiles wider
    than FIRST_CALL_TILE_N, has a first-call plan: the same schedule with those off and key tiles
    narrowed where the narrower tile fits, runnable, each change with a reason; others have none."""
    spec = SPECS[name]
    for plan in (fa4gen.plan(spec, "sm_90a"), *(s.plan for s in seqlen_splits(spec, "sm_90a"))):
        quick = first_call_plan(plan)
        if plan.is_decode:  # (its one loop body compiles in seconds: no first-call plan)
            assert quick is None
            continue
        on = {name for name in FIRST_CALL_OFF if getattr(plan.config, name)}
        narrow = plan.config.model_copy(update={**dict.fromkeys(on, False), "tile_n": FIRST_CALL_TILE_N})
        narrows = plan.config.tile_n > FIRST_CALL_TILE_N and config_problem(narrow) == ""
        if not on and not narrows:
            assert quick is None
            continue
        assert quick.config.tile_n == (FIRST_CALL_TILE_N if narrows else plan.config.tile_n)
        changed = on | ({"tile_n"} if narrows else set())
        restored = quick.config.model_copy(update={**dict.fromkeys(on, True), "tile_n": plan.config.tile_n})
        assert restored == plan.config
        assert not any(getattr(quick.config, name) for name in FIRST_CALL_OFF) and plan_problem(quick) == ""
        assert all("decision first-call-plan" in quick.reasons[name] for name in changed)
        assert first_call_plan(quick) is None


def test_enabled_needs_spare_cores_and_honours_the_opt_out(monkeypatch, tmp_path):
    monkeypatch.setattr(background.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(background, "CPU_QUOTA", tmp_path / "cpu.max")  # (none: no cgroup quota)
    monkeypatch.delenv(background.ENV, raising=False)
    assert background.enabled() and background.usable_cpus() == 16
    for quota, cpus in (("max 100000", 16), ("200000 100000", 2.0), ("1600000 100000", 16), ("junk", 16)):
        (tmp_path / "cpu.max").write_text(quota + "\n")
        assert background.usable_cpus() == cpus, quota
    assert background.enabled()  # (16 cores under the last quota)
    (tmp_path / "cpu.max").write_text("200000 100000\n")  # a container limited to 2 cores
    assert not background.enabled()
    (tmp_path / "cpu.max").unlink()
    monkeypatch.setenv(background.ENV, "full")
    assert not background.enabled()
    monkeypatch.delenv(background.ENV)
    monkeypatch.setattr(background.os, "sched_getaffinity", lambda pid: {0, 1})
    assert not background.enabled()


class FakePending:
    """A child that finishes after ``polls`` polls (or fails)."""

    def __init__(self, job, load, what, polls=2, fail=False):
        self.job, self.load, self.what, self.polls, self.fail = job, load, what, polls, fail
        self.calls = 0

    def poll(self, wait=False):
        self.calls += 1
        if not wait and self.calls < self.polls:
            return None
        if self.fail:
            warnings.warn("background build failed", background.FirstCallWarning, stacklevel=2)
            raise background.BackgroundBuildFailed("failed")
        return self.load()


def _fake_builds(monkeypatch, tmp_path, fail=False):
    """api with compiles and loads faked: a list of the plans built here, and of the jobs
    started in the background."""
    built, started = [], []

    def fake_build(spec, target, kernel_plan, cache, no_compile, progress=None, label="given"):
        built.append(kernel_plan)
        path = tmp_path / f"k{len(built)}"
        entry = type("Entry", (), {"path": path, "meta": {}})()
        return api.BuildResult(spec=spec, plan=kernel_plan, key="0" * 64, entry=entry, built_now=True)

    def fake_start(job, load, what):
        started.append(FakePending(job, load, what, fail=fail))
        return started[-1]

    monkeypatch.setattr(api, "_build_plan", fake_build)
    monkeypatch.setattr(api, "load_function", lambda path, cuda: f"function of {path.name}")
    monkeypatch.setattr(api, "_tuned_for_this_device", lambda *args: None)
    monkeypatch.setattr(background, "enabled", lambda: True)
    monkeypatch.setattr(background, "start", fake_start)
    return built, started


def test_first_launch_runs_the_first_call_kernel_until_the_planner_s_is_built(monkeypatch, tmp_path):
    built, started = _fake_builds(monkeypatch, tmp_path)
    spec = fa4gen.AttentionSpec(head_dim=128, causal=True, qhead_per_kvhead=4, softcap=30.0)
    kernel = fa4gen.compile(spec, arch="sm_90a", cache_dir=tmp_path / "cache")
    assert not kernel.built and not kernel.building and built == [] and started == []

    assert kernel._loaded_function() == "function of k1"
    assert built == [first_call_plan(kernel.plan)] and kernel.building and kernel.built
    (pending,) = started
    job = pending.job
    assert job["plan"] == kernel.plan.model_dump(mode="json") and job["key"] == kernel.key
    assert job["spec"] == spec.canonical() and job["arch"] == "sm_90a"
    assert json.loads(json.dumps(job)) == job  # what goes on the child's command line

    assert kernel._take_over() == "function of k1" and kernel.building  # the child is not done yet
    assert kernel._take_over() == "function of k2" and not kernel.building  # done: loaded here
    assert built[-1] == kernel.plan and kernel.path == tmp_path / "k2"
    assert kernel.prepare() is kernel and len(started) == 1


def test_prepare_waits_for_the_background_build(monkeypatch, tmp_path):
    built, started = _fake_builds(monkeypatch, tmp_path)
    spec = fa4gen.AttentionSpec(head_dim=64, causal=True)
    kernel = fa4gen.compile(spec, arch="sm_90a", cache_dir=tmp_path / "cache")
    assert kernel.splits  # (d64 causal has a short range)
    kernel._loaded_function()
    assert kernel.building
    kernel.prepare(ranges=False)
    assert not kernel.building and started[0].calls == 1 and built == [first_call_plan(kernel.plan), kernel.plan]
    assert not any(split.kernel.built for split in kernel.splits)  # the other ranges stay unbuilt


def test_a_failed_background_build_warns_and_keeps_the_first_call_kernel(monkeypatch, tmp_path):
    built, _ = _fake_builds(monkeypatch, tmp_path, fail=True)
    spec = fa4gen.AttentionSpec(head_dim=64, window_left=100, window_right=0)
    kernel = fa4gen.compile(spec, arch="sm_90a", cache_dir=tmp_path / "cache")
    kernel._loaded_function()
    with pytest.warns(background.FirstCallWarning):
        assert kernel._take_over(wait=True) == "function of k1"
    assert not kernel.building and kernel._take_over() == "function of k1" and len(built) == 1


@pytest.mark.parametrize("given", [True, False])
def test_given_plans_and_plans_without_a_first_call_plan_build_as_they_are(monkeypatch, tmp_path, given):
    built, started = _fake_builds(monkeypatch, tmp_path)
    spec = fa4gen.AttentionSpec(head_dim=256, mask={"kind": "expression", "expr": "kv_idx <= q_idx"})
    if given:  # the caller's plan runs from the first call
        spec = spec.model_copy(update={"mask": None, "causal": True})
    given_plan = fa4gen.plan(spec) if given else None
    kernel = fa4gen.compile(spec, arch="sm_90a", cache_dir=tmp_path / "cache", kernel_plan=given_plan)
    assert (first_call_plan(kernel.plan) is None) is not given
    assert kernel._loaded_function() == "function of k1" and built == [kernel.plan] and started == []
    assert not kernel.building


def test_the_child_builds_the_plan_into_the_shared_cache(tmp_path):
    """A real child process (cross-compiling, no GPU): the kernel lands in the cache under the
    key the parent computed, and poll loads it from there."""
    spec = fa4gen.AttentionSpec(head_dim=64, causal=True)
    plan = fa4gen.plan(spec, "sm_90a")
    cache = KernelCache(tmp_path / "cache")
    key = make_key(api.cache_key_parts(spec, plan, fa4gen.Arch.SM90A))
    job = {"spec": spec.canonical(), "plan": plan.model_dump(mode="json"), "arch": "sm_90a"}
    job |= {"cache": str(cache.root), "key": key}

    def load():
        entry = cache.lookup(key)
        return "loaded", entry.path

    pending = background.start(job, load, spec.summary())
    assert pending.poll(wait=True) == ("loaded", cache.lookup(key).path)
    assert json.loads((cache.lookup(key).path / "plan.json").read_text())["config"]["mask_runs"]


def test_a_child_that_fails_names_why(tmp_path):
    job = {"spec": {"head_dim": 7}, "plan": {}, "arch": "sm_90a", "cache": str(tmp_path), "key": "0"}
    pending = background.start(job, lambda: pytest.fail("nothing was built"), "a bad job")
    with pytest.warns(background.FirstCallWarning, match="could not build a bad job.*head_dim"):
        with pytest.raises(background.BackgroundBuildFailed):
            pending.poll(wait=True)


def test_the_child_sees_no_gpu_and_this_interpreter_s_path(monkeypatch):
    seen = {}

    def fake_popen(argv, **kwargs):
        seen.update(argv=argv, **kwargs)
        return object()

    monkeypatch.setattr(background.subprocess, "Popen", fake_popen)
    background.start({"x": 1}, lambda: None, "x")
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "" and seen["argv"][0] == sys.executable
    assert json.loads(seen["argv"][3]) == sys.path and json.loads(seen["argv"][4]) == {"x": 1}
    assert seen["stdin"] is subprocess.DEVNULL and seen["stderr"] is subprocess.STDOUT
