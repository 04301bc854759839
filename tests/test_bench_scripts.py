"""The analysis helpers of the device-side benchmark scripts (benchmarks/), on made-up inputs:
what they print is what A/B decisions and stall breakdowns in BENCHMARKS.md rest on."""

from __future__ import annotations

import csv
import math
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
