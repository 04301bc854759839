"""The analysis helpers of the device-side benchmark scripts (benchmarks/), on made-up inputs:
what they print is what A/B decisions and stall breakdowns in BENCHMARKS.md rest on."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import ab_kernels  # noqa: E402
import sass_stalls  # noqa: E402


def _sass_table(path: Path, rows: list[tuple[str, int, int, dict[str, int]]]) -> None:
    """A per-instruction table as Nsight Compute's source page writes it: the kernel's name,
    the header, then (SASS, samples, executions, stall samples by reason) per instruction."""
    header = ["Address", "Source", "# Samples", "Instructions Executed", *sass_stalls.STALLS]
    with path.open("w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(["Kernel Name", "k"])
        out.writerow(header)
        for n, (text, samples, executed, stalls) in enumerate(rows):
            out.writerow(
                [hex(n * 16), text, samples, f"{executed:,}", *(stalls.get(reason, 0) for reason in sass_stalls.STALLS)]
            )


def test_counts_groups_samples_by_how_often_code_runs(tmp_path, capsys):
    table = tmp_path / "k.csv"
    _sass_table(
        table,
        [
            ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8], R4", 30, 100, {"stall_long_sb": 30}),  # once per tile
            ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], R24", 10, 700, {"stall_wait": 10}),  # per key tile
            ("WARPGROUP.DEPBAR.LE gsb0, 0x1", 50, 700, {"stall_barrier": 45, "stall_wait": 5}),
            ("EXIT", 10, 4, {}),  # once per warp
        ],
    )
    sass_stalls.by_count(str(table), groups=2, top=5)
    lines = capsys.readouterr().out.splitlines()
    rows = {
        int(line.split()[0]): line.split()
        for line in lines
        if line.strip() and line.split()[0].isdigit() and len(line.split()) == 6
    }
    # per key tile: 2 instructions, 60 of 100 samples, 60 / 700 * 1000 per 1000 executions
    assert rows[700][1:] == ["2", "1", "2", "60.00%", f"{60 / 700 * 1000:.2f}"]
    assert rows[100][1:] == ["1", "0", "0", "30.00%", "300.00"]
    assert rows[4][4] == "10.00%"
    assert list(rows) == [700, 100, 4]  # heaviest group first
    # the two heaviest groups' instructions with their largest reasons, in % of all samples
    assert any("DEPBAR" in line and "barrier 45.00%" in line for line in lines)
    assert any("TRYWAIT" in line and "long_sb 30.00%" in line for line in lines)
    listed = lines[lines.index(next(line for line in lines if line.startswith("executed"))) :]
    assert not any("EXIT" in line for line in listed)  # a third group: not listed with groups=2


def test_combine_cancels_the_position_of_each_order(tmp_path, capsys):
    # B is 4% faster than A on the first label; whichever side runs second reads 2% faster
    forward = tmp_path / "a-b.log"
    backward = tmp_path / "b-a.log"
    forward.write_text(
        "x S=1024   new vs fp32 reference: error 1e-3 (bound 5e-3)\n"
        "x S=1024   old  100.0 new  106.1 new/old 1.061 max|new-old| 0.0e+00\n"
        "y S=2048   old  200.0 new  204.0 new/old 1.020 max|new-old| 0.0e+00\n"
        "z only here   old  50.0 new  60.0 new/old 1.200 max|new-old| 0.0e+00\n"
        "geometric mean new/old over 3: 1.090\n"
    )
    backward.write_text(
        "x S=1024   old  104.0 new  102.0 new/old 0.981 max|new-old| 0.0e+00\n"
        "y S=2048   old  200.0 new  204.0 new/old 1.020 max|new-old| 0.0e+00\n"
    )
    ab_kernels.combine(forward, backward)
    out = capsys.readouterr().out.splitlines()
    x = next(line for line in out if line.startswith("x S=1024"))
    assert x.split()[-1] == f"{math.sqrt((106.1 / 100.0) / (102.0 / 104.0)):.3f}"
    y = next(line for line in out if line.startswith("y S=2048"))
    assert y.split()[-1] == "1.000"  # the same gain both ways is the position alone
    assert not any(line.startswith("z only") for line in out)
    mean = math.exp((math.log(math.sqrt((106.1 / 100.0) / (102.0 / 104.0))) + 0.0) / 2)
    assert out[-1] == f"geometric mean B/A over 2, both orders: {mean:.4f}"


def test_both_runs_the_pair_in_each_order_and_combines(monkeypatch, capsys):
    passes = []

    def fake_run(old_dir, new_dir, rounds, pattern=""):
        passes.append((old_dir.name, new_dir.name, rounds, pattern))
        return {"x S=1024": 1.05} if old_dir.name == "a" else {"x S=1024": 0.99}  # B/A, then A/B

    monkeypatch.setattr(ab_kernels, "run", fake_run)
    ab_kernels.both(Path("a"), Path("b"), 6, "d128")
    assert passes == [("a", "b", 6, "d128"), ("b", "a", 6, "d128")]
    assert capsys.readouterr().out.splitlines()[0].split()[-1] == f"{math.sqrt(1.05 / 0.99):.3f}"


def test_run_returns_each_labels_ratio(monkeypatch, tmp_path, capsys):
    """``run`` (what ``both`` combines) returns new/old per label it timed, from the rounds'
    sums; the GPU parts (loading, inputs, the reference check, the timing) are stand-ins."""
    import json

    import torch

    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    for folder in (old_dir, new_dir):
        folder.mkdir()
        (folder / "index.json").write_text(json.dumps({"x S=1024": {}, "x S=2048": {}, "y S=512": {}}))

    class Kernel:
        spec = type("Spec", (), {"is_varlen": False})()

        def __call__(self, q, k, v):
            return q

    tensors = [torch.ones(1)] * 3
    monkeypatch.setattr(ab_kernels, "_load", lambda directory, label: Kernel())
    monkeypatch.setattr(ab_kernels, "_workload", lambda label, spec: ([tensors], {}, 1.0))
    monkeypatch.setattr(ab_kernels, "_check", lambda *args: None)
    speed = {"x S=1024": 1.10, "x S=2048": 0.95}
    label_of = iter(["x S=1024", "x S=2048"])

    def rounds(functions, workloads, count):
        new = speed[next(label_of)]
        return {"old": [100.0] * count, "new": [100.0 * new] * count}

    monkeypatch.setattr(ab_kernels, "_rounds", rounds)
    gains = ab_kernels.run(old_dir, new_dir, 4, "^x ")
    assert gains == {label: pytest.approx(ratio) for label, ratio in speed.items()}
    assert capsys.readouterr().out.splitlines()[-1] == f"geometric mean new/old over 2: {math.sqrt(1.10 * 0.95):.3f}"


# benchmarks/first_call.py: the parts that run without a GPU

import first_call  # noqa: E402


def test_first_call_child_boot_compiles_and_loads_the_script_by_path(tmp_path):
    compile(first_call.CHILD_BOOT, "<first_call child>", "exec")
    stub = tmp_path / "stub.py"
    stub.write_text("import json\n\ndef child(config):\n    print('noise')\n    print('FIRST_CALL_RESULT ' + config)\n")
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", first_call.CHILD_BOOT, str(stub), '{"x": 1}'], capture_output=True, text=True, check=True
    )
    assert first_call.parse_child_output(out.stdout) == {"x": 1}
    with pytest.raises(ValueError):
        first_call.parse_child_output("noise only\n")


def test_first_call_arguments_and_job_order():
    args = first_call.parse_args([])
    assert (args.variants, args.repeat, args.both_repeat, args.import_repeat) == (["a", "b", "c", "d"], 3, 1, 5)
    quick = first_call.parse_args(["--quick", "--out", "x.json"])
    assert (quick.variants, quick.repeat, quick.both_repeat, quick.import_repeat) == (["a"], 1, 1, 1)
    assert quick.out == "x.json"
    with pytest.raises(SystemExit):
        first_call.parse_args(["--variants", "a,z"])
    assert first_call.parse_args(["--modes", "both"]).modes == ["both"] and args.modes == ["paid", "notpaid", "both"]
    with pytest.raises(SystemExit):
        first_call.parse_args(["--modes", "both,fast"])

    jobs = first_call.plan_jobs(["a", "b", "c", "d"], repeat=3, both_repeat=1, import_repeat=5)
    assert len(jobs) == 1 + 5 + 4 * 3 * 2 * 2 + 4 * 2
    assert jobs[0].kind == "warmup" and all(job.kind == "import" for job in jobs[1:6])
    cells = jobs[6:]
    a_jobs = [i for i, job in enumerate(cells) if job.variant == "a"]
    assert a_jobs == list(range(len(a_jobs))) and len(a_jobs) == 3 * 4 + 2  # the issue's variant first
    firsts = [job for job in cells if job.variant != "a" and job.repeat == 0]
    assert cells.index(firsts[-1]) < min(cells.index(job) for job in cells if job.variant != "a" and job.repeat > 0)
    paid = [job.libs for job in cells if job.variant == "b" and job.kind == "paid"]
    assert paid == [("fa4gen",), ("fa4",), ("fa4",), ("fa4gen",), ("fa4gen",), ("fa4",)]  # alternating order
    both = [job.libs for job in cells if job.kind == "both" and job.variant == "c"]
    assert both == [("fa4gen", "fa4"), ("fa4", "fa4gen")]
    quick_jobs = first_call.plan_jobs(quick.variants, quick.repeat, quick.both_repeat, quick.import_repeat)
    kinds = ["warmup", "import", "paid", "paid", "notpaid", "notpaid", "both", "both"]
    assert [job.kind for job in quick_jobs] == kinds


def test_first_call_stops_the_background_builds_a_child_left_behind(tmp_path):
    folder = tmp_path / "first_call-x"
    job = '{"cache": "' + str(folder / "fa4gen-cache") + '"}'
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", job])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path / "elsewhere")])
    try:
        first_call.stop_builds_in(folder)
        assert left.wait(timeout=5) == -9  # killed, and not left a zombie for the next timing
        assert other.poll() is None  # a process naming another folder runs on
    finally:
        for process in (left, other):
            process.kill()
            process.wait()


def test_first_call_variants_map_to_both_apis():
    import fa4gen

    window = first_call.VARIANTS["d"]
    spec = fa4gen.AttentionSpec(**window.fa4gen_spec_kwargs())
    assert (spec.window_left, spec.causal, spec.qhead_per_kvhead) == (1023, True, 4)
    assert window.fa4_kwargs() == {"causal": True, "window_size": (1023, 0), "softcap": 0.0}
    issue = first_call.VARIANTS["a"]
    spec = fa4gen.AttentionSpec(**issue.fa4gen_spec_kwargs())
    assert (spec.head_dim, spec.softcap, spec.causal, spec.window_left) == (128, 30.0, True, None)
    assert issue.fa4_kwargs() == {"causal": True, "window_size": (None, None), "softcap": 30.0}
    assert first_call.VARIANTS["b"].fa4_kwargs()["causal"] is False
    assert first_call.VARIANTS["c"].fa4gen_spec_kwargs()["head_dim"] == 64


def test_first_call_reference_matches_sdpa_and_softcap():
    import torch

    torch.manual_seed(0)
    q = torch.randn(2, 33, 8, 16)
    k = torch.randn(2, 33, 2, 16)
    v = torch.randn(2, 33, 2, 16)
    kr, vr = (t.repeat_interleave(4, dim=2).transpose(1, 2) for t in (k, v))
    rows, cols = torch.arange(33).view(-1, 1), torch.arange(33).view(1, -1)
    for causal, left in ((False, None), (True, None), (True, 5)):
        keep = torch.ones(33, 33, dtype=torch.bool)
        if causal:
            keep &= cols <= rows
        if left is not None:
            keep &= cols >= rows - left
        expect = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kr, vr, attn_mask=keep)
        got = first_call.reference(q, k, v, causal=causal, window_left=left, softcap=None)
        torch.testing.assert_close(got, expect.transpose(1, 2), atol=1e-5, rtol=1e-5)
    # softcap on one query head (head 5 reads key head 1)
    got = first_call.reference(q, k, v, causal=False, window_left=None, softcap=2.0)
    scores = 2.0 * torch.tanh(q[0, :, 5] @ k[0, :, 1].T / 4.0 / 2.0)
    torch.testing.assert_close(got[0, :, 5], torch.softmax(scores, -1) @ v[0, :, 1], atol=1e-5, rtol=1e-5)


def test_first_call_time_limit_skips_what_would_end_late():
    now = [0.0]
    seconds = {"warmup": 5.0, "import": 2.0, "paid": 10.0, "notpaid": 10.0, "both": 20.0}

    def runner(job):
        now[0] += seconds[job.kind]
        return {"kind": job.kind}

    jobs = first_call.plan_jobs(["a", "b"], repeat=2, both_repeat=1, import_repeat=2)
    done, skipped = first_call.run_jobs(jobs, runner, time_limit=100.0, clock=lambda: now[0])
    assert [run["job"]["kind"] for run in done][:3] == ["warmup", "import", "import"]
    assert now[0] <= 100.0 and len(done) + len(skipped) == len(jobs) and skipped
    assert all(run["wall_s"] == seconds[run["job"]["kind"]] for run in done)


def _run(kind, variant, libs, **per_lib):
    return {
        "job": {"kind": kind, "variant": variant, "libs": list(libs), "repeat": 0},
        "result": {"libs": {lib: per_lib[lib] for lib in libs}},
    }


def _lib(total, first, ok=True, build=None):
    row = {"total_s": total, "first_s": first, "import_s": total - first, "compile_s": 0.5, "call_s": first - 0.5}
    row.update({"steady_ms": 0.2, "max_err": 1e-3, "ok": ok})
    if build is not None:  # (kernels built, the first one's seconds): the first-call kernel, then the planner's
        row["build"] = {"kernels_built": build[0], "compile_seconds": [build[1], 2 * build[1]]}
        row.update({"full_ready_s": 2 * first, "bit_identical": True, "took_over": True})
    return row


def test_first_call_summary_medians_ratios_and_tables():
    runs = [
        _run("paid", "a", ["fa4gen"], fa4gen=_lib(6.0, 4.0, build=(2, 3.0))),
        _run("paid", "a", ["fa4gen"], fa4gen=_lib(9.0, 5.0, build=(2, 4.0))),
        _run("paid", "a", ["fa4gen"], fa4gen=_lib(7.0, 4.5, build=(2, 3.5))),
        _run("paid", "a", ["fa4"], fa4=_lib(8.0, 4.0)),
        _run("notpaid", "a", ["fa4gen"], fa4gen=_lib(3.0, 3.0)),
        _run("notpaid", "a", ["fa4"], fa4=_lib(4.0, 4.0, ok=False)),
        _run("both", "a", ["fa4", "fa4gen"], fa4=_lib(5.0, 5.0), fa4gen=_lib(2.0, 2.0)),
    ]
    runs[-1]["result"]["max_abs_diff_fa4gen_fa4"] = 0.0078125
    rows = {row["mode"]: row for row in first_call.summarize(runs, ["a"])}
    assert (rows["imports paid"]["fa4gen"], rows["imports paid"]["fa4"]) == (7.0, 8.0)  # medians of totals
    assert rows["imports paid"]["ratio"] == pytest.approx(7.0 / 8.0)
    assert (rows["imports paid"]["fa4gen_runs"], rows["imports paid"]["fa4_runs"]) == (3, 1)
    assert rows["imports not paid"]["ratio"] == pytest.approx(0.75)  # first calls, imports left out
    assert rows["one process, flash-attn-4 first"]["ratio"] == pytest.approx(0.4)
    assert rows["one process, fa4gen first"]["fa4gen"] is None and rows["one process, fa4gen first"]["ratio"] is None
    table = first_call.markdown(first_call.summarize(runs, ["a"]), first_call.VARIANTS).splitlines()
    assert table[0] == "| variant | mode | fa4gen s | flash-attn-4 s | ratio (fa4gen/fa4) | runs |"
    assert table[2] == "| a: d128 gqa4 causal softcap 30 B1 S2048 | imports paid | 7.00 | 8.00 | 0.88 | 3/1 |"
    assert table[4] == "| a: d128 gqa4 causal softcap 30 B1 S2048 | one process, fa4gen first | - | - | - | 0/0 |"
    parts = {row["lib"]: row for row in first_call.breakdown(runs, ["a"])}
    assert (parts["fa4gen"]["trace_compile_s"], parts["fa4gen"]["kernels_built"]) == (3.5, 2)
    assert parts["fa4gen"]["full_ready_s"] == 9.0 and parts["fa4"]["full_ready_s"] is None
    assert parts["fa4"]["trace_compile_s"] is None
    lines = first_call.markdown_breakdown(list(parts.values())).splitlines()
    assert lines[2].startswith("| a | fa4gen | 2.50 | 0.50 | 4.00 | 7.00 | 2 | 3.50 | 9.00 |")
    assert lines[3].startswith("| a | flash-attn-4 | 4.00 | - |")
    assert first_call.correctness(runs, ["a"]) == [
        "a: fa4gen max|o - ref| 1.00e-03, flash-attn-4 max|o - ref| 1.00e-03 (1 FAILED), first-call kernel = "
        "planner's, bit for bit: 3/3, max|fa4gen - fa4| 7.81e-03"
    ]
    assert first_call.failed_checks(runs) == 1
    assert first_call.median([]) is None and first_call.median([3.0, 1.0, 2.0]) == 2.0


def test_first_call_fails_in_one_line_without_flash_attn_4(monkeypatch):
    def missing(name):
        raise first_call.md.PackageNotFoundError(name)

    monkeypatch.setattr(first_call.md, "version", missing)
    with pytest.raises(SystemExit) as exc:
        first_call.main(["--quick"])
    message = str(exc.value.code)
    assert "flash-attn-4 is not installed" in message and "\n" not in message


def test_first_call_children_get_empty_caches_of_their_own(tmp_path, monkeypatch):
    monkeypatch.setenv("FA4GEN_NO_COMPILE", "1")
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    env = first_call.child_env(tmp_path)
    assert "FA4GEN_NO_COMPILE" not in env and env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "0"
    for name in ("FA4GEN_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "CUTE_DSL_CACHE_DIR", "CUDA_CACHE_PATH"):
        assert Path(env[name]).parent == tmp_path and not Path(env[name]).exists()


def test_first_call_main_prints_the_tables_and_writes_every_number(monkeypatch, tmp_path, capsys):
    import json

    def fake_child(job, variants, tmp_root, timeout):
        if job.kind == "warmup":
            return {"environment": {"device": "H200", "flash-attn-4": "4.0.0b36"}}
        if job.kind == "import":
            return {"import_fa4gen_s": 0.3, "compiler_imported": False}
        per_lib = {lib: _lib(5.0 if lib == "fa4gen" else 6.0, 4.0, build=(1, 2.0)) for lib in job.libs}
        return {"libs": per_lib} | ({"max_abs_diff_fa4gen_fa4": 0.0} if len(job.libs) == 2 else {})

    monkeypatch.setattr(first_call, "require_flash_attn_4", lambda: "4.0.0b36")
    monkeypatch.setattr(first_call, "run_child", fake_child)
    out = tmp_path / "first_call.json"
    assert first_call.main(["--quick", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "import fa4gen beyond torch: 0.300 s (median of 1; target < 0.5 s: met)" in text
    assert "| a: d128 gqa4 causal softcap 30 B1 S2048 | imports paid | 5.00 | 6.00 | 0.83 | 1/1 |" in text
    assert "target ratio <= 0.8: met in 0 of 4" in text
    saved = json.loads(out.read_text())
    assert len(saved["runs"]) == 6 and saved["imports"] == [{"import_fa4gen_s": 0.3, "compiler_imported": False}]
    assert saved["environment"]["flash-attn-4"] == "4.0.0b36" and not saved["skipped"]


def test_a_backward_plan_ab_changes_config_fields_and_reports_the_ratio(capsys):
    """`backward.py --plan f=v,...`: the planner's backward plan with those fields changed (a name
    that is no config field stops the run), reported per cell as changed / default."""
    import backward

    from fa4gen.spec import AttentionSpec

    plan = backward._changed_plan(AttentionSpec(head_dim=64), "tile_m=128,dq_split=m")
    assert (plan.config.tile_m, plan.config.dq_split, plan.config.q_stages) == (128, "m", 2)
    with pytest.raises(SystemExit, match="'tile' is not a backward config field"):
        backward._changed_plan(AttentionSpec(head_dim=64), "tile=128")
    row = {"name": "d64", "seqlen": 4096, "batch": 4, "label": "tile_m=128"}
    rows = [{**row, "fa4gen": {"bwd_tflops": 400.0}, "alternative": {"bwd_tflops": 440.0}}]
    backward._report_alternative(rows)
    out = capsys.readouterr().out
    assert "| d64 | 4096 | 4 | 400 | 440 | 1.10x |" in out
    assert "tile_m=128 / default: min 1.10x, geometric mean 1.10x over 1 cells" in out


def test_deterministic_plan_ab_times_dq_group_counts(capsys):
    """`backward.py --deterministic --plan dq_grouped_turns=true --dq-groups 1,4`: the plan changed
    is the deterministic spec's, and the report gives each forced dQ group count / default."""
    import argparse

    import backward

    from fa4gen.spec import AttentionSpec

    args = argparse.Namespace(deterministic=True, plan="dq_grouped_turns=true")
    spec = backward._deterministic(AttentionSpec(head_dim=128, causal=True))
    plan = backward._changed_plan(spec, args.plan)
    assert plan.config.deterministic and plan.config.dq_grouped_turns
    row = {"name": "d128 causal", "seqlen": 4096, "batch": 4, "label": "deterministic dq_grouped_turns=true"}
    groups = {"1": {"bwd_tflops": 300.0}, "4": {"bwd_tflops": 380.0}}
    rows = [{**row, "fa4gen": {"bwd_tflops": 400.0}, "alternative": {"bwd_tflops": 320.0}, "groups": groups}]
    backward._report_alternative(rows)
    out = capsys.readouterr().out
    assert "| d128 causal | 4096 | 4 | 400 | 320 | 0.80x | 0.75x | 0.95x |" in out
    assert "deterministic dq_grouped_turns=true, 4 dQ groups / default: min 0.95x" in out


PREIMPORT_THEN_BUILD = """
import importlib, json, sys, tempfile
import first_call
for name in first_call.DSL_MODULES:
    importlib.import_module(name)
first_call._import_library("fa4gen", deferred=True)
before = set(sys.modules)
import fa4gen
from fa4gen.api import _build_plan, _process_cache
from fa4gen.arch import Arch
from fa4gen.planner import first_call_plan, plan
spec = fa4gen.AttentionSpec(head_dim=64, qhead_per_kvhead=2, causal=True)
fa4gen.compile(spec, arch="sm_90a", cache_dir=tempfile.mkdtemp())  # (a miss: builds nothing yet)
_build_plan(spec, Arch.SM90A, first_call_plan(plan(spec, Arch.SM90A)), _process_cache(tempfile.mkdtemp()), False)
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_first_call_pre_imports_what_fa4gen_s_first_build_would_import():
    # where imports are not paid, the timed part must import none of fa4gen's own dependencies
    out = subprocess.run(
        [sys.executable, "-c", PREIMPORT_THEN_BUILD],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS), *sys.path])},
    )
    imported = json.loads(out.stdout.splitlines()[-1])
    deferred = ("fa4gen", "jinja2", "diskcache", "cutlass.cutlass_dsl", "cutlass.base_dsl.tvm_ffi")
    assert [name for name in imported if name.startswith(deferred)] == []
