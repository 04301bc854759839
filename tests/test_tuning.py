"""Plan tuning: candidate plans, the record of the winner, and compile() using it (CPU; the
timing itself is injected here and runs on the GPU in `fa4gen tune`)."""

from __future__ import annotations

import json

import pytest

import fa4gen
from fa4gen import api, tuned, tuning
from fa4gen.arch import WARPGROUP_THREADS, WGMMA_M, Arch
from fa4gen.kernels.sm90.config import config_problem, config_smem_bytes, register_pool
from fa4gen.planner import candidates

SPECS = [
    fa4gen.AttentionSpec(head_dim=64, causal=True),
    fa4gen.AttentionSpec(head_dim=128, qhead_per_kvhead=4),
    fa4gen.AttentionSpec(head_dim=192, head_dim_v=128, causal=True),
    fa4gen.AttentionSpec(head_dim=256, softcap=30.0, window_left=512, causal=True),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.summary())
def test_candidates_start_with_the_default_and_all_fit(spec):
    plans = candidates(spec, "sm_90a")
    assert plans[0] == fa4gen.plan(spec, "sm_90a")
    assert len(plans) >= 3
    assert len({p.canonical_json() for p in plans}) == len(plans)
    base = plans[0].config.model_dump()
    for p in plans:
        c = p.config
        assert not config_problem(c)
        assert p.smem_bytes == config_smem_bytes(c) <= Arch.SM90A.caps.smem_bytes_per_cta
        assert c.o_staging != "over_q" or c.q_stages == 1
        assert c.tile_m == WGMMA_M * c.num_consumer_warpgroups and c.tile_n % 16 == 0
        assert WARPGROUP_THREADS * (c.producer_regs + c.num_consumer_warpgroups * c.consumer_regs) <= register_pool(
            c.num_consumer_warpgroups
        )
        # a candidate varies the schedule only (the spec's own constants stay) and gives each change a reason
        changed = [name for name, value in c.model_dump().items() if base[name] != value]
        assert not set(changed) & set(_spec_fields(spec)), changed
        assert all(p.reasons.get(name, "").strip() for name in changed), changed


def _spec_fields(spec):
    from fa4gen.planner.sm90 import variant_fields

    return variant_fields(spec)


def _fake_measure(spec, plan, seqlens, cache_dir):
    # pretend smaller key tiles win, so the winner is not the planner's default
    return [1000.0 / plan.config.tile_n * (1 + i) for i, _ in enumerate(seqlens)]


def test_tune_records_the_fastest_and_compile_uses_it_on_that_gpu(tmp_path, monkeypatch):
    spec = SPECS[1]
    result = tuning.tune(spec, "sm_90a", cache_dir=tmp_path, device="NVIDIA H200", measure=_fake_measure)
    assert result.best.config.tile_n == min(p.config.tile_n for p in candidates(spec))
    assert result.best != fa4gen.plan(spec, "sm_90a")
    record = json.loads(result.path.read_text())
    assert record["device"] == "NVIDIA H200" and len(record["measurements"]) == len(candidates(spec))
    assert tuning.tuned_plan(tmp_path, spec, Arch.SM90A, "NVIDIA H200") == result.best
    assert tuning.tuned_plan(tmp_path, spec, Arch.SM90A, "NVIDIA H100 80GB HBM3") is None

    def kernel_stub(spec, target, kernel_plan, cache, refuse, splits=(), first_call=True):  # the plan compile() loads
        return ("kernel", kernel_plan)

    monkeypatch.setattr(tuned, "current_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(api, "_kernel", kernel_stub)
    assert fa4gen.compile(spec, arch="sm_90a", cache_dir=tmp_path) == ("kernel", result.best)
    monkeypatch.setattr(tuned, "current_device_name", lambda: "NVIDIA H100 80GB HBM3")
    default = fa4gen.plan(spec, "sm_90a")
    assert fa4gen.compile(spec, arch="sm_90a", cache_dir=tmp_path) == ("kernel", default)  # another GPU


def test_no_gpu_and_broken_records(tmp_path):
    spec = SPECS[0]
    with pytest.raises(fa4gen.UnsupportedArchError, match="no CUDA device"):
        tuning.tune(spec, "sm_90a", cache_dir=tmp_path, measure=_fake_measure)
    path = tuning.record_plan(tmp_path, spec, Arch.SM90A, "GPU X", fa4gen.plan(spec), [])
    path.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="ignoring the tuned plan"):
        assert tuning.tuned_plan(tmp_path, spec, Arch.SM90A, "GPU X") is None


def test_alternating_rounds_cancel_drift(tmp_path):
    """A GPU that slows down steadily during the run (30% per pass, far more than the 3% the best
    candidate is ahead) must not hand the win to the candidates measured first."""
    spec = fa4gen.AttentionSpec(head_dim=128)
    plans = candidates(spec, "sm_90a")
    best = plans[-1]
    calls = []

    def drifting(spec_, plan, seqlens, cache_dir):
        calls.append(plan)
        true_speed = 103.0 if plan == best else 100.0
        return [true_speed * (1.0 - 0.3 * len(calls) / len(plans)) for _ in seqlens]

    result = tuning.tune(spec, "sm_90a", cache_dir=tmp_path, device="GPU", measure=drifting, rounds=4)
    assert len(calls) == 4 * len(plans)
    assert all(row["rounds"] == 4 for row in result.rows)
    assert result.best == best
    calls.clear()
    single = tuning.tune(spec, "sm_90a", cache_dir=tmp_path, device="GPU", measure=drifting, rounds=1)
    assert single.best != best  # what one fixed-order pass would have picked


def _one_ahead(share: float):
    """A measure where the last candidate is ``share`` faster than all the others (no drift)."""

    def measure(spec, plan, seqlens, cache_dir):
        ahead = plan == candidates(spec, "sm_90a")[-1]
        return [100.0 * (1.0 + share) if ahead else 100.0 for _ in seqlens]

    return measure


@pytest.mark.parametrize(
    "share, min_gain, recorded",
    [(0.01, tuning.MIN_GAIN, "default"), (0.03, tuning.MIN_GAIN, "fastest"), (0.01, 0.0, "fastest")],
)
def test_a_winner_within_the_margin_leaves_the_default_recorded(tmp_path, share, min_gain, recorded):
    """The fastest candidate is recorded only when it beats the planner's default by more than
    min_gain (tuning.MIN_GAIN: the tuner's noise on a shared GPU); else the default is."""
    spec = fa4gen.AttentionSpec(head_dim=128)
    plans = candidates(spec, "sm_90a")
    result = tuning.tune(spec, "sm_90a", cache_dir=tmp_path, device="GPU", measure=_one_ahead(share), min_gain=min_gain)
    assert result.fastest == len(plans) - 1
    expected = plans[0] if recorded == "default" else plans[-1]
    assert result.best == expected and result.chosen == plans.index(expected)
    assert tuning.tuned_plan(tmp_path, spec, Arch.SM90A, "GPU") == expected
    assert len(json.loads(result.path.read_text())["measurements"]) == len(plans)  # every candidate kept


def test_negative_min_gain_is_refused(tmp_path):
    with pytest.raises(ValueError, match="min_gain must be >= 0"):
        tuning.tune(SPECS[0], "sm_90a", cache_dir=tmp_path, device="GPU", measure=_fake_measure, min_gain=-0.01)


@pytest.mark.parametrize(
    "share, says",
    [(0.01, "within 2.0% of the planner default: the default is recorded"), (0.03, "(+3.0% over the planner default)")],
)
def test_tune_command_says_what_it_recorded(tmp_path, monkeypatch, share, says):
    from typer.testing import CliRunner

    from fa4gen import cli

    real_tune = tuning.tune
    monkeypatch.setattr(
        cli, "tune", lambda *args, **kw: real_tune(*args, device="GPU", measure=_one_ahead(share), **kw)
    )
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("head_dim: 128\n")
    result = CliRunner().invoke(
        cli.app, ["--cache-dir", str(tmp_path / "cache"), "tune", str(spec_file)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert "fastest: " in result.output and says in result.output
    assert (share > tuning.MIN_GAIN) != ("the default is recorded" in result.output)


def test_candidates_differ_in_schedule_not_only_in_reasons():
    for spec in (
        fa4gen.AttentionSpec(head_dim=64),
        fa4gen.AttentionSpec(head_dim=128, softcap=30.0),
        fa4gen.AttentionSpec(head_dim=256),
    ):
        schedules = [p.config for p in candidates(spec, "sm_90a")]
        assert all(a != b for i, a in enumerate(schedules) for b in schedules[i + 1 :])


def test_tuning_lengths_that_run_another_plan_are_flagged(tmp_path):
    """A d96 spec's launches of at most 1024 query rows run the planner's short-sequence plan
    (and those of 4096 or more its long-sequence plan) whatever is tuned: timing the candidates
    there measures kernels compile() would not run. By default tune times the lengths outside
    every range (2048 of the default 2048 and 8192)."""
    spec = fa4gen.AttentionSpec(head_dim=96, causal=True)
    with pytest.warns(UserWarning, match="short-sequence plan for at most 1024 query rows.*not 512"):
        tuning.tune(
            spec, "sm_90a", cache_dir=tmp_path, device="GPU", measure=_fake_measure, seqlens=(512, 2048), rounds=1
        )
    timed = []

    def measure(spec_, plan_, seqlens, root):
        timed.append(seqlens)
        return _fake_measure(spec_, plan_, seqlens, root)

    tuning.tune(spec, "sm_90a", cache_dir=tmp_path, device="GPU", measure=measure, rounds=1)
    assert set(timed) == {(2048,)}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tuning.tune(spec, "sm_90a", cache_dir=tmp_path, device="GPU", measure=_fake_measure, seqlens=(2048,), rounds=1)


def test_default_tuning_lengths_avoid_the_length_ranges():
    from fa4gen.planner import SeqlenSplit

    main = fa4gen.plan(fa4gen.AttentionSpec(head_dim=128, causal=True), "sm_90a")
    short = SeqlenSplit(label="short", max_seqlen_q=1024, plan=main, reason="r")
    long = SeqlenSplit(label="long", min_seqlen_q=4096, plan=main, reason="r")
    assert tuning.default_seqlens(()) == tuning.DEFAULT_SEQLENS == (2048, 8192)
    assert tuning.default_seqlens((short, long)) == (2048,)
    assert tuning.default_seqlens((SeqlenSplit(label="all", plan=main, reason="r"),)) == (2048, 8192)
    assert tuning.default_seqlens((SeqlenSplit(label="mid", min_seqlen_q=1024, plan=main, reason="r"),)) == (1023,)


def test_compile_attaches_the_length_range_kernels_unless_a_plan_is_given(tmp_path, monkeypatch):
    """compile() of a d96 causal spec loads the kernels of the planner's length ranges beside its
    plan and beside a tuned plan, but an explicit kernel_plan runs alone (tests and tuning time
    exactly it)."""
    from fa4gen.planner import seqlen_splits

    spec = fa4gen.AttentionSpec(head_dim=96, causal=True)
    ranges = seqlen_splits(spec, "sm_90a")
    recorded = candidates(spec, "sm_90a")[1]

    def fake_kernel(spec_, target, kernel_plan, cache, refuse, splits=(), first_call=True):
        return kernel_plan, splits

    monkeypatch.setattr(api, "_kernel", fake_kernel)
    for device, explicit, main in (
        ("GPU without a record", None, fa4gen.plan(spec, "sm_90a")),
        ("NVIDIA H200", None, recorded),
        ("NVIDIA H200", recorded, recorded),
    ):
        monkeypatch.setattr(tuned, "current_device_name", lambda device=device: device)
        tuning.record_plan(tmp_path, spec, Arch.SM90A, "NVIDIA H200", recorded, [])
        plan_, splits = fa4gen.compile(spec, arch="sm_90a", cache_dir=tmp_path, kernel_plan=explicit)
        assert plan_ == main
        if explicit is None:
            assert [(s.split, s.kernel) for s in splits] == [(s, (s.plan, ())) for s in ranges]
        else:
            assert splits == ()


def test_the_record_holds_the_plan_with_its_config(tmp_path):
    spec = SPECS[1]
    chosen = candidates(spec, "sm_90a")[1]
    path = tuning.record_plan(tmp_path, spec, Arch.SM90A, "GPU", chosen, [{"score": 1.0}])
    record = json.loads(path.read_text())
    assert set(record) == {"spec", "arch", "device", "plan", "measurements", "recorded"}
    assert record["plan"]["config"] == chosen.config.model_dump(mode="json")
    assert set(record["plan"]) == {"arch", "kernel", "config", "reasons"}
    assert tuning.tuned_plan(tmp_path, spec, Arch.SM90A, "GPU") == chosen


def _rewrite_plan(path, edit):
    record = json.loads(path.read_text())
    record["plan"] = edit(record["plan"])
    path.write_text(json.dumps(record))


def test_records_of_an_older_format_are_ignored_with_a_warning(tmp_path):
    """A record written before the kernel config (the plan's fields flat, some since removed)
    is ignored, saying so: compile() runs the planner's plan until `fa4gen tune` runs again."""
    spec = SPECS[1]
    default = fa4gen.plan(spec, "sm_90a")
    path = tuning.record_plan(tmp_path, spec, Arch.SM90A, "GPU", default, [])
    flat = {
        "arch": "sm_90a",
        "kernel": default.kernel,
        **default.config.model_dump(mode="json"),
        "tile_m": default.config.tile_m,
        "persistent": True,
        "exp2_poly_period": 0,
        "smem_bytes": 1,
        "reasons": {},
    }
    _rewrite_plan(path, lambda plan_: flat)
    with pytest.warns(RuntimeWarning, match="ignoring the tuned plan .* older fa4gen.*fa4gen tune again"):
        assert tuning.tuned_plan(tmp_path, spec, Arch.SM90A, "GPU") is None
    # a plan of the new shape with a field the config no longer has: refused by the model
    _rewrite_plan(
        path,
        lambda plan_: {
            **default.model_dump(mode="json"),
            "config": {**default.config.model_dump(mode="json"), "persistent": True},
        },
    )
    with pytest.warns(RuntimeWarning, match="ignoring the tuned plan"):
        assert tuning.tuned_plan(tmp_path, spec, Arch.SM90A, "GPU") is None


@pytest.mark.parametrize(
    "update",
    [{"producer_regs": 64}, {"head_dim": 64}, {"scale_log2": 1.0}],
    ids=["fails-config-problem", "another-head-dim", "another-scale"],
)
def test_records_the_kernel_cannot_run_for_the_spec_are_ignored(tmp_path, update):
    """A record whose config fails the kernel's check (config_problem), or fixes the spec's own
    constants otherwise than the planner does now, would build a broken or wrong kernel."""
    spec = SPECS[1]
    default = fa4gen.plan(spec, "sm_90a")
    path = tuning.record_plan(tmp_path, spec, Arch.SM90A, "GPU", default, [])
    _rewrite_plan(path, lambda plan_: {**plan_, "config": {**plan_["config"], **update}})
    with pytest.warns(RuntimeWarning, match="ignoring the tuned plan"):
        assert tuning.tuned_plan(tmp_path, spec, Arch.SM90A, "GPU") is None


def test_changes_name_the_config_fields_a_candidate_sets():
    spec = fa4gen.AttentionSpec(head_dim=128)
    base = fa4gen.plan(spec, "sm_90a")
    other = base.with_config("test", kv_stages=3, pingpong=False)
    assert tuning._changes(base, base) == "planner default"
    assert tuning._changes(base, other) == "kv_stages=3, pingpong=False"
