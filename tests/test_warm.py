"""Tests of ``fa4gen warm``: parallel cache warming in spawned worker processes (CPU only).

The ``warmed`` fixture runs the real command twice in a subprocess over a directory holding two
valid specs and one invalid one, for sm_90a and the reserved sm_100a: the first run compiles
the two valid kernels (the only real compiles in this module), the second must compile nothing.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fa4gen.cli import _candidate_jobs, collect_spec_files, warm_one
from fa4gen.planner import candidates
from fa4gen.specfile import load_spec

ISOLATED_ENV = ("FA4GEN_CACHE_DIR", "FA4GEN_NO_COMPILE", "FA4GEN_CACHE_TRUSTED",
                "FA4GEN_CACHE_SIZE_LIMIT", "FA4GEN_TOOLCHAIN")
SPECS = {
    "causal.yaml": "head_dim: 64\ncausal: true\n",
    "plain.yml": "head_dim: 64\n",
    "nested/bad.yaml": "head_dim: 100\n",
    "nested/README.txt": "not a spec\n",
}


def cli(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a fresh interpreter with a clean environment and wide tables."""
    env = {k: v for k, v in os.environ.items() if k not in ISOLATED_ENV}
    env["COLUMNS"] = "250"
    return subprocess.run([sys.executable, "-m", "fa4gen.cli", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=600)


def table_rows(stdout: str) -> dict[tuple[str, str], dict[str, str]]:
    """(spec file name, arch) -> {"status", "seconds", "reason"} from the rich results table."""
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
        if len(cells) == 5 and cells[2] in ("compiled", "cached", "failed"):
            spec, arch, status, seconds, reason = cells
            rows[(Path(spec).name, arch)] = {"status": status, "seconds": seconds, "reason": reason}
    return rows


def entry_snapshot(cache: Path) -> dict[str, int]:
    return {p.parent.name: p.stat().st_mtime_ns for p in (cache / "entries").glob("*/meta.json")}


@dataclass(frozen=True)
class Warmed:
    root: Path
    cache: Path
    first: subprocess.CompletedProcess[str]
    entries_after_first: dict[str, int]
    second: subprocess.CompletedProcess[str]
    entries_after_second: dict[str, int]


def write_specs(directory: Path) -> Path:
    for name, text in SPECS.items():
        path = directory / "specs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return directory / "specs"


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> Warmed:
    root = tmp_path_factory.mktemp("warm")
    write_specs(root)
    cache = root / "cache"
    args = ("warm", "specs", "--arch", "sm_90a,sm_100a", "-j", "2", "--cache-dir", cache)
    first = cli(*args, cwd=root)
    after_first = entry_snapshot(cache)
    second = cli(*args, cwd=root)
    return Warmed(root, cache, first, after_first, second, entry_snapshot(cache))


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_first_run_compiles_valid_specs_and_reports_failures(warmed: Warmed) -> None:
    result = warmed.first
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    rows = table_rows(result.stdout)
    assert set(rows) == {(name, arch) for name in ("causal.yaml", "plain.yml", "bad.yaml")
                         for arch in ("sm_90a", "sm_100a")}
    assert {key for key, row in rows.items() if row["status"] == "compiled"} == {
        ("causal.yaml", "sm_90a"), ("plain.yml", "sm_90a")}
    for arch in ("sm_90a", "sm_100a"):
        reason = rows[("bad.yaml", arch)]["reason"]
        assert rows[("bad.yaml", arch)]["status"] == "failed"
        assert reason.startswith("ValidationError:") and "head_dim" in reason and "multiples of 8" in reason
    for name in ("causal.yaml", "plain.yml"):
        reserved = rows[(name, "sm_100a")]
        assert reserved["status"] == "failed"
        assert reserved["reason"].startswith("UnsupportedArchError:") and "sm_100a" in reserved["reason"]
    assert "2 compiled, 0 cached, 4 failed" in result.stdout
    # one entry per plan: plain d64 and its short- and long-sequence plans (4 consumer
    # warpgroups; the split tail), causal d64 and its short-sequence plan
    assert len(warmed.entries_after_first) == 5


@pytest.mark.slow
def test_second_run_compiles_nothing(warmed: Warmed) -> None:
    result = warmed.second
    assert result.returncode == 1, result.stderr
    rows = table_rows(result.stdout)
    for name in ("causal.yaml", "plain.yml"):
        row = rows[(name, "sm_90a")]
        assert row["status"] == "cached"
        assert float(row["seconds"]) < 5.0
    assert "0 compiled, 2 cached, 4 failed" in result.stdout
    assert warmed.entries_after_second == warmed.entries_after_first


@pytest.mark.slow
def test_warmed_cache_is_portable(warmed: Warmed, tmp_path: Path) -> None:
    moved = Path(shutil.copytree(warmed.cache, tmp_path / "shipped-cache"))
    spec_file = warmed.root / "specs" / "plain.yml"
    result = cli("compile", spec_file, "--arch", "sm_90a", "--no-compile", "--cache-dir", moved, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "status  cache hit" in result.stdout
    assert str(moved / "entries") in result.stdout


# ----------------------------------------------------------------------------- without compiling
def test_only_failures_exit_1_without_compiling(tmp_path: Path) -> None:
    specs = write_specs(tmp_path)
    result = cli("warm", specs / "nested" / "bad.yaml", specs / "plain.yml", "--arch", "sm_100a",
                 "--cache-dir", tmp_path / "cache", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    rows = table_rows(result.stdout)
    assert {key: row["status"] for key, row in rows.items()} == {
        ("bad.yaml", "sm_100a"): "failed", ("plain.yml", "sm_100a"): "failed"}
    assert not list((tmp_path / "cache").glob("entries/*"))


def test_no_spec_files_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = cli("warm", "empty", "--cache-dir", tmp_path / "cache", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith("error: no spec files")


def test_collect_spec_files_is_recursive_sorted_and_skips_the_cache(tmp_path: Path) -> None:
    specs = write_specs(tmp_path)
    cache_copy = specs / "cache" / "entries" / ("0" * 64)
    cache_copy.mkdir(parents=True)
    (cache_copy / "spec.yaml").write_text("head_dim: 64\n")
    found = collect_spec_files([specs, specs / "plain.yml"], exclude=(specs / "cache").absolute())
    assert found == [specs / "causal.yaml", specs / "nested" / "bad.yaml", specs / "plain.yml"]


def test_worker_takes_and_returns_plain_data(tmp_path: Path) -> None:
    assert pickle.loads(pickle.dumps(warm_one)) is warm_one
    specs = write_specs(tmp_path)
    bad = warm_one(str(specs / "nested" / "bad.yaml"), "sm_90a", str(tmp_path / "cache"))
    assert bad["status"] == "failed" and bad["error"].startswith("ValidationError: invalid spec: head_dim")
    reserved = warm_one(str(specs / "plain.yml"), "sm_100a", str(tmp_path / "cache"))
    assert reserved["status"] == "failed" and "sm_100a" in reserved["error"]
    assert isinstance(reserved["seconds"], float)
    assert pickle.loads(pickle.dumps(reserved)) == reserved


def test_tuning_candidates_become_one_job_each(tmp_path: Path) -> None:
    specs = write_specs(tmp_path)
    jobs = _candidate_jobs(specs / "plain.yml", "sm_90a")
    assert len(jobs) == len(candidates(load_spec(specs / "plain.yml"), "sm_90a")) > 5
    assert jobs[0].candidate is None and [job.candidate for job in jobs[1:]] == list(range(1, len(jobs)))
    assert jobs[3].label.endswith("[candidate 3]")
    # a spec that does not validate stays one job, so its build reports the error
    assert [job.candidate for job in _candidate_jobs(specs / "nested" / "bad.yaml", "sm_90a")] == [None]
    miss = warm_one(str(specs / "plain.yml"), "sm_90a", str(tmp_path / "cache"), True, 2)
    assert miss is None  # not compiled yet, and the quick pass never compiles
