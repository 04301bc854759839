"""Tests of ``fa4gen warm``: parallel cache warming in spawned worker processes (CPU only).

The ``warmed`` fixture runs the real command twice in a subprocess over a directory holding two
valid specs and one invalid one, for sm_90a and the reserved sm_100a: the first run compiles
the two valid kernels (the only real compiles in this module), the second must compile nothing.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fa4gen.planner import candidates
from fa4gen.specfile import load_spec
from fa4gen.warm import candidate_jobs, collect_spec_files, warm_one

ISOLATED_ENV = (
    "FA4GEN_CACHE_DIR",
    "FA4GEN_NO_COMPILE",
    "FA4GEN_CACHE_TRUSTED",
    "FA4GEN_CACHE_SIZE_LIMIT",
    "FA4GEN_TOOLCHAIN",
)
SPECS = {
    "causal.yaml": "head_dim: 64\ncausal: true\n",
    "plain.yml": "head_dim: 64\n",
    "nested/bad.yaml": "head_dim: 100\n",
    "nested/README.txt": "not a spec\n",
}


ROOT = Path(__file__).resolve().parent.parent
WARM_SCRIPT = ROOT / "examples" / "ci" / "warm-cache.sh"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ISOLATED_ENV}
    return {**env, "COLUMNS": "250", **extra}


def cli(*args: object, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a fresh interpreter with a clean environment (plus ``env``) and wide tables;
    its output is not a terminal, as in CI."""
    return subprocess.run(
        [sys.executable, "-m", "fa4gen.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=clean_env(**env),
        cwd=cwd,
        timeout=600,
    )


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
    assert set(rows) == {
        (name, arch) for name in ("causal.yaml", "plain.yml", "bad.yaml") for arch in ("sm_90a", "sm_100a")
    }
    assert {key for key, row in rows.items() if row["status"] == "compiled"} == {
        ("causal.yaml", "sm_90a"),
        ("plain.yml", "sm_90a"),
    }
    for arch in ("sm_90a", "sm_100a"):
        reason = rows[("bad.yaml", arch)]["reason"]
        assert rows[("bad.yaml", arch)]["status"] == "failed"
        assert reason.startswith("SpecFileError: head_dim=100") and "multiples of 8" in reason
    for name in ("causal.yaml", "plain.yml"):
        reserved = rows[(name, "sm_100a")]
        assert reserved["status"] == "failed"
        assert reserved["reason"].startswith("UnsupportedArchError:") and "sm_100a" in reserved["reason"]
    assert "2 compiled, 0 cached, 4 failed" in result.stdout
    # one entry per plan: plain d64 and its decode, short- and long-sequence plans (4 consumer
    # warpgroups; the split tail) and three KV-cache kernels (128 rows; paged, 64 and 128 rows),
    # causal d64 and its decode, short-sequence and KV-cache plans
    assert len(warmed.entries_after_first) == 13


@pytest.mark.slow
def test_not_on_a_terminal_each_finished_job_is_a_line(warmed: Warmed) -> None:
    lines = warmed.first.stderr.strip().splitlines()
    assert lines[0] == "4 of 6 settled without compiling (cached or invalid); compiling 2 with 2 workers"
    done = sorted(lines[1:])
    assert [line.split(" ", 1)[0] for line in done] == ["[1/2]", "[2/2]"], lines
    assert {
        line.split(" ")[1:4] == ["compiled", str(Path("specs") / name), "sm_90a"]
        for line in done
        for name in ("causal.yaml", "plain.yml")
    } == {True, False}
    assert all(line.endswith(" s") and " in " in line for line in done)
    assert warmed.second.stderr == ""  # nothing to compile: no progress to report


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
    result = cli(
        "warm",
        specs / "nested" / "bad.yaml",
        specs / "plain.yml",
        "--arch",
        "sm_100a",
        "--cache-dir",
        tmp_path / "cache",
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr
    rows = table_rows(result.stdout)
    assert {key: row["status"] for key, row in rows.items()} == {
        ("bad.yaml", "sm_100a"): "failed",
        ("plain.yml", "sm_100a"): "failed",
    }
    assert not list((tmp_path / "cache").glob("entries/*"))


@pytest.mark.parametrize("how", ["option", "environment"])
def test_no_compile_reports_each_miss_and_compiles_nothing(tmp_path: Path, how: str) -> None:
    specs = write_specs(tmp_path)
    args = ("warm", specs / "plain.yml", specs / "nested" / "bad.yaml", "--cache-dir", tmp_path / "cache")
    result = (
        cli(*args, "--no-compile", cwd=tmp_path) if how == "option" else cli(*args, cwd=tmp_path, FA4GEN_NO_COMPILE="1")
    )
    assert result.returncode == 1, result.stderr
    rows = table_rows(result.stdout)
    assert rows[("plain.yml", "sm_90a")]["status"] == "failed"
    assert rows[("plain.yml", "sm_90a")]["reason"].startswith("CacheMiss: not in the cache, and compiling is disabled")
    assert rows[("bad.yaml", "sm_90a")]["reason"].startswith("SpecFileError:")
    assert "0 compiled, 0 cached, 2 failed" in result.stdout
    assert result.stderr == "1 of 2 not in the cache; compiling is disabled\n"
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
    assert bad["status"] == "failed" and bad["error"].startswith("SpecFileError: head_dim=100 is not supported")
    reserved = warm_one(str(specs / "plain.yml"), "sm_100a", str(tmp_path / "cache"))
    assert reserved["status"] == "failed" and "sm_100a" in reserved["error"]
    assert isinstance(reserved["seconds"], float)
    assert pickle.loads(pickle.dumps(reserved)) == reserved


def test_tuning_candidates_become_one_job_each(tmp_path: Path) -> None:
    specs = write_specs(tmp_path)
    jobs = candidate_jobs(specs / "plain.yml", "sm_90a")
    assert len(jobs) == len(candidates(load_spec(specs / "plain.yml"), "sm_90a")) > 5
    assert jobs[0].candidate is None and [job.candidate for job in jobs[1:]] == list(range(1, len(jobs)))
    assert jobs[3].label.endswith("[candidate 3]")
    # a spec that does not validate stays one job, so its build reports the error
    assert [job.candidate for job in candidate_jobs(specs / "nested" / "bad.yaml", "sm_90a")] == [None]
    miss = warm_one(str(specs / "plain.yml"), "sm_90a", str(tmp_path / "cache"), True, 2)
    assert miss is None  # not compiled yet, and the quick pass never compiles


# ----------------------------------------------------------------------------- examples/ci/warm-cache.sh
def warm_script(*args: object, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the CI script with this interpreter's `fa4gen` and `python3` first on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    path = clean_env()["PATH"]
    return subprocess.run(
        ["bash", str(WARM_SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
        env=clean_env(PATH=f"{bin_dir}{os.pathsep}{path}", **env),
    )


@pytest.mark.skipif(
    shutil.which("fa4gen", path=str(Path(sys.executable).parent)) is None, reason="console script not installed"
)
def test_warm_script_needs_an_archive_path_and_removes_its_temporary_cache(tmp_path: Path) -> None:
    specs = write_specs(tmp_path)
    result = warm_script(specs, cwd=tmp_path)
    assert result.returncode != 0 and "usage: warm-cache.sh SPEC_DIR OUT_ARCHIVE" in result.stderr
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    # bad.yaml fails the first warm (no compile needed to get there): the script stops, and cleans up
    result = warm_script(specs / "nested", tmp_path / "out" / "cache.tar.gz", cwd=tmp_path, TMPDIR=str(scratch))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "0 compiled, 0 cached, 1 failed" in result.stdout
    assert list(scratch.iterdir()) == []
    assert not (tmp_path / "out" / "cache.tar.gz").exists() and not list(tmp_path.glob("*.tar.gz"))


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("fa4gen", path=str(Path(sys.executable).parent)) is None, reason="console script not installed"
)
def test_warm_script_writes_the_archive_where_told_and_keeps_a_redirected_log(warmed: Warmed, tmp_path: Path) -> None:
    specs = tmp_path / "specs"
    specs.mkdir()
    for name in ("causal.yaml", "plain.yml"):  # already in the warmed cache: nothing compiles
        shutil.copy(warmed.root / "specs" / name, specs / name)
    cache = Path(shutil.copytree(warmed.cache, tmp_path / "cache"))
    log = tmp_path / "warm.log"
    with open(log, "a") as handle:  # stdout and stderr appended to one file, as a CI step's `>>log 2>&1`
        result = subprocess.run(
            ["bash", "-c", f'bash "{WARM_SCRIPT}" specs out/cache.tar.gz 2>>"{log}"'],
            stdout=handle,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            timeout=600,
            env=clean_env(
                FA4GEN_CACHE_DIR=str(cache), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
            ),
        )
    text = log.read_text()
    assert result.returncode == 0, text
    assert (tmp_path / "out" / "cache.tar.gz").is_file() and not list(tmp_path.glob("*.tar.gz"))
    assert text.count("0 compiled, 2 cached, 0 failed") == 2  # both runs' reports survive in the log
    digest = hashlib.sha256((tmp_path / "out" / "cache.tar.gz").read_bytes()).hexdigest()
    assert f"sha256 {digest}" in text
    assert cache.is_dir()  # the caller's cache is the caller's: kept


@pytest.mark.slow
def test_warm_training_caches_what_training_runs(tmp_path: Path) -> None:
    """`fa4gen warm --training`: a row per spec for its forward and one for what training runs
    (the forward with its LSE and the backward); afterwards nothing of it needs compiling, and a
    spec without a backward is a failed row naming the field."""
    import fa4gen
    from fa4gen.api import build_training

    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "causal.yaml").write_text("head_dim: 64\ncausal: true\n")
    refused = (
        "head_dim: 64\ndeterministic: true\nscore_mod: {kind: relative_bias, max_distance: 8, requires_grad: true}\n"
    )
    (tmp_path / "specs" / "refused.yaml").write_text(refused)
    cache = tmp_path / "cache"
    result = cli("warm", "specs", "--training", "--arch", "sm_90a", "-j", "2", "--cache-dir", cache, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr  # the refused spec has no backward
    # both specs' forwards and the causal one's training kernels compile; refused's training fails
    assert "3 compiled, 0 cached, 1 failed" in result.stdout
    assert "deterministic: true with trainable tensors" in result.stdout
    spec = fa4gen.load_spec(tmp_path / "specs" / "causal.yaml")
    forward, backward = build_training(spec, "sm_90a", cache_dir=cache, no_compile=True)
    assert backward.plan.is_backward and not backward.built_now and not forward.any_built_now
    fa4gen.build(spec, "sm_90a", cache_dir=cache, no_compile=True)  # the plain forward too
