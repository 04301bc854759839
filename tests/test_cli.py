"""Tests of the ``fa4gen`` command line (CPU only).

Every test uses its own cache directory under tmp_path. The tests marked ``slow`` share one real
cross-compile (a head_dim=64 window spec for sm_90a), made once per module by the ``built`` fixture;
tests that damage or clear a cache work on a copy of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

import fa4gen
from fa4gen import toolchain
from fa4gen.api import cache_key_parts
from fa4gen.arch import Arch
from fa4gen.cache import make_key
from fa4gen.cli import app, human_size, parse_duration
from fa4gen.planner import first_call_plan, seqlen_splits

SMALL_SPEC = "head_dim: 64\n"
# the cache tests' spec: one plan, so one entry (an unmasked spec adds its long-range plan)
# one plan, one kernel (packed documents have no length ranges): the cache tests count entries
CACHE_SPEC = "head_dim: 64\ncausal: true\nwindow_left: 128\nmask: document\n"
ISOLATED_ENV = (
    "FA4GEN_CACHE_DIR",
    "FA4GEN_NO_COMPILE",
    "FA4GEN_CACHE_TRUSTED",
    "FA4GEN_CACHE_SIZE_LIMIT",
    "FA4GEN_TOOLCHAIN",
)


def _isolate(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ISOLATED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "200")  # wide rich tables: no cell is folded


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    _isolate(monkeypatch)


def run(*args: object, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(app, [str(arg) for arg in args], env=env, catch_exceptions=False)


def write_spec(directory: Path, text: str = SMALL_SPEC, name: str = "spec.yaml") -> Path:
    path = directory / name
    path.write_text(text)
    return path


def assert_one_line_error(result: Result, *needles: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0]


@dataclass(frozen=True)
class Built:
    cache: Path
    spec_file: Path
    key: str
    first: Result
    second: Result


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """One real compile through the CLI, then a second compile of the same spec."""
    cache = tmp_path_factory.mktemp("cli-cache")
    spec_file = write_spec(tmp_path_factory.mktemp("cli-spec"), CACHE_SPEC)
    spec = fa4gen.load_spec(spec_file)
    key = make_key(cache_key_parts(spec, fa4gen.plan(spec, Arch.SM90A), Arch.SM90A))
    with pytest.MonkeyPatch.context() as monkeypatch:
        _isolate(monkeypatch)
        first = run("compile", spec_file, "--arch", "sm_90a", "--cache-dir", cache)
        second = run("compile", spec_file, "--arch", "sm_90a", "--cache-dir", cache)
    return Built(cache, spec_file, key, first, second)


@pytest.fixture
def cache_copy(built: Built, tmp_path: Path) -> Path:
    """A private copy of the built cache, for tests that damage or empty it."""
    return Path(shutil.copytree(built.cache, tmp_path / "cache-copy"))


# ----------------------------------------------------------------------------- stages
def test_schema_is_the_spec_json_schema() -> None:
    result = run("schema")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == fa4gen.spec_json_schema()
    assert "head_dim" in json.loads(result.stdout)["properties"]


def test_plan_shows_what_first_calls_run(tmp_path: Path) -> None:
    result = run("plan", write_spec(tmp_path), "--arch", "sm_90a", "--first-call", "--json")
    spec = fa4gen.AttentionSpec(head_dim=64)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == first_call_plan(fa4gen.plan(spec, "sm_90a")).model_dump_json(indent=2)
    text = run("plan", write_spec(tmp_path), "--first-call").stdout
    assert text.count("(decision first-call-plan)") >= 3 and "stale_max" in text  # the plan and its ranges


def test_plan_prints_schedule_with_reasons(tmp_path: Path) -> None:
    result = run("plan", write_spec(tmp_path), "--arch", "sm_90a")
    spec = fa4gen.AttentionSpec(head_dim=64)
    expected = fa4gen.plan(spec, "sm_90a")
    assert result.exit_code == 0, result.output
    # the plan, then decode's, the short range's (4 consumer warpgroups), the long range's (the
    # split tail) and the KV-cache kernels'
    splits = seqlen_splits(spec, "sm_90a")
    labels = ("decode", "short", "long", "decode-wide", "paged", "paged-wide")
    assert tuple(split.label for split in splits) == labels
    ranges = "\n\n".join(split.describe() for split in splits)
    assert result.stdout.strip() == f"{expected.describe()}\n\n{ranges}"
    assert "plan for sm_90a" in result.stdout
    assert expected.reasons["tile_n"] in result.stdout


def test_plan_json_round_trips(tmp_path: Path) -> None:
    result = run("plan", write_spec(tmp_path, "head_dim: 128\ncausal: true\n"), "--json")
    assert result.exit_code == 0, result.output
    expected = fa4gen.plan(fa4gen.AttentionSpec(head_dim=128, causal=True), "sm_90a")
    assert fa4gen.Plan.model_validate_json(result.stdout) == expected


def test_plan_and_emit_the_backward(tmp_path: Path) -> None:
    """--backward: the backward's plan (for the spec with its LSE) and its source; a spec without
    a backward is one error line naming the field."""
    from fa4gen.api import training_spec
    from fa4gen.planner import backward_plan

    spec_file = write_spec(tmp_path, "head_dim: 128\ncausal: true\nqhead_per_kvhead: 4\n")
    spec = training_spec(fa4gen.load_spec(spec_file))
    result = run("plan", spec_file, "--backward", "--json")
    assert result.exit_code == 0, result.output
    assert fa4gen.Plan.model_validate_json(result.stdout) == backward_plan(spec)
    result = run("emit", spec_file, "--backward")
    assert result.exit_code == 0, result.output
    assert result.stdout == fa4gen.emit(spec, backward_plan(spec)).source
    assert "HopperAttentionBackward(CONFIG" in result.stdout
    refused = write_spec(
        tmp_path,
        "head_dim: 64\ndeterministic: true\nscore_mod: {kind: relative_bias, max_distance: 8, requires_grad: true}\n",
    )
    assert_one_line_error(run("plan", refused, "--backward"), "deterministic: true with trainable tensors")


def test_emit_to_stdout_and_file(tmp_path: Path) -> None:
    spec = fa4gen.AttentionSpec(head_dim=64)
    source = fa4gen.emit(spec, fa4gen.plan(spec, "sm_90a")).source
    result = run("emit", write_spec(tmp_path), "--arch", "sm_90a")
    assert result.exit_code == 0, result.output
    assert result.stdout == source
    out = tmp_path / "kernel.py"
    result = run("emit", write_spec(tmp_path), "-o", out)
    assert result.exit_code == 0, result.output
    assert out.read_text() == source
    assert result.stdout == ""


def test_plan_and_emit_show_the_plans_of_length_ranges(tmp_path: Path) -> None:
    """d96 has plans for decode, short and long query sequences: `plan` prints them after the default,
    and `--seqlen N` selects the plan a launch of N rows runs in `plan --json` and `emit`."""
    from fa4gen.planner import seqlen_splits

    spec = fa4gen.AttentionSpec(head_dim=96, causal=True)
    splits = seqlen_splits(spec, "sm_90a")
    decode, short, long = splits[:3]  # (then the KV-cache kernels)
    main = fa4gen.plan(spec, "sm_90a")
    spec_file = write_spec(tmp_path, "head_dim: 96\ncausal: true\n")
    result = run("plan", spec_file)
    assert result.exit_code == 0, result.output
    ranges = "\n\n".join(split.describe() for split in splits)
    assert result.stdout.strip() == f"{main.describe()}\n\n{ranges}"
    for seqlen, expected in (
        (1, decode.plan),
        (16, decode.plan),
        (17, short.plan),
        (1024, short.plan),
        (1025, main),
        (4095, main),
        (4096, long.plan),
        (16384, long.plan),
    ):
        result = run("plan", spec_file, "--seqlen", str(seqlen), "--json")
        assert result.exit_code == 0, result.output
        assert fa4gen.Plan.model_validate_json(result.stdout) == expected
        result = run("emit", spec_file, "--seqlen", str(seqlen))
        assert result.exit_code == 0, result.output
        assert result.stdout == fa4gen.emit(spec, expected).source
    assert run("plan", spec_file, "--seqlen", "0").exit_code != 0


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("command", ["plan", "emit", "compile"])
def test_bad_spec_is_one_line_naming_the_field(tmp_path: Path, command: str) -> None:
    spec_file = write_spec(tmp_path, "head_dim: 100\n")
    result = run("--cache-dir", tmp_path / "cache", command, spec_file, "--arch", "sm_90a")
    assert_one_line_error(result, "head_dim", "multiples of 8")


def test_unknown_field_and_malformed_yaml(tmp_path: Path) -> None:
    assert_one_line_error(run("plan", write_spec(tmp_path, "head_dimm: 64\n")), "head_dimm")
    assert_one_line_error(run("plan", write_spec(tmp_path, "head_dim: [64\n")), "error: ")
    assert_one_line_error(run("plan", write_spec(tmp_path, "- 64\n")), "mapping")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty spec file: write at least one field, e.g. head_dim: 128"),
        ("# just a comment\n", "empty spec file"),
        ("head_dim: 64\nhead_dim: 128\n", "line 2, column 1: duplicate key 'head_dim'"),
        ("head_dim: true\n", "head_dim: got a boolean"),
        ("scalars:\n a: &a [x,x]\n b: [*a,*a]\n", "aliases (*a) are not allowed"),
        ("[" * 100_000, "larger than 64 KiB"),
        ("dtype: " + "x" * 60_000 + "\n", "xxx... is not supported"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "emit", "compile"])
def test_spec_file_errors_are_one_line_naming_the_file(tmp_path: Path, command: str, text: str, needle: str) -> None:
    spec_file = write_spec(tmp_path, text, name="bad-spec.yaml")
    result = run("--cache-dir", tmp_path / "cache", command, spec_file)
    assert_one_line_error(result, f"error: {spec_file}: ", needle)
    assert len(result.stderr) < 300


def test_non_utf8_spec_file_is_named(tmp_path: Path) -> None:
    spec_file = tmp_path / "latin1.yaml"
    spec_file.write_bytes(b"head_dim: 64 # caf\xe9\n")
    assert_one_line_error(run("plan", spec_file), f"{spec_file}: not UTF-8 text")


@pytest.fixture
def fresh_toolchain():
    """toolchain() is memoised per process: forget it around a test that changes FA4GEN_TOOLCHAIN."""
    toolchain.toolchain.cache_clear()
    yield
    toolchain.toolchain.cache_clear()


@pytest.mark.parametrize(
    "value",
    [
        "garbage",
        "cutlass-dsl=4.8.1",
        "cutlass-dsl=4.8.1,cuda=cu99",
        "cutlass-dsl=,cuda=cu13",
        "cutlass-dsl=4.8.1,cuda=cu13,extra=1",
    ],
)
@pytest.mark.parametrize("command", ["compile", "warm"])
def test_malformed_toolchain_override_is_one_line(
    tmp_path: Path, fresh_toolchain: None, command: str, value: str
) -> None:
    result = run("--cache-dir", tmp_path / "cache", command, write_spec(tmp_path), env={"FA4GEN_TOOLCHAIN": value})
    assert_one_line_error(
        result, f"FA4GEN_TOOLCHAIN={value!r} is not a toolchain", "expected the form cutlass-dsl=4.8.1,cuda=cu13"
    )
    assert not (tmp_path / "cache" / "entries").exists() or not list((tmp_path / "cache" / "entries").iterdir())


def test_version_reports_a_malformed_toolchain_override(tmp_path: Path, fresh_toolchain: None) -> None:
    result = run("--cache-dir", tmp_path, "version", env={"FA4GEN_TOOLCHAIN": "garbage"})
    assert result.exit_code == 0
    assert "CuTe DSL    unavailable (FA4GEN_TOOLCHAIN='garbage' is not a toolchain" in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("compile", "SPEC"),
        ("warm", "SPEC"),
        ("cache", "ls"),
        ("cache", "verify"),
        ("cache", "clear"),
        ("cache", "drop", "kernel.ptx"),
        ("cache", "export", "out.tar.gz"),
        ("cache", "import", "in.tar.gz"),
    ],
)
def test_malformed_size_limit_is_one_line_for_every_cache_command(tmp_path: Path, args: tuple[str, ...]) -> None:
    spec_file = write_spec(tmp_path)
    argv = [spec_file if arg == "SPEC" else tmp_path / arg if arg.endswith(".tar.gz") else arg for arg in args]
    result = run("--cache-dir", tmp_path / "cache", *argv, env={"FA4GEN_CACHE_SIZE_LIMIT": "garbage"})
    assert_one_line_error(result, "FA4GEN_CACHE_SIZE_LIMIT", "'garbage'")


def test_unknown_arch_in_warm_is_one_line(tmp_path: Path) -> None:
    result = run("--cache-dir", tmp_path / "cache", "warm", write_spec(tmp_path), "--arch", "sm_90a,sm_75")
    assert_one_line_error(result, "unknown arch 'sm_75'", "sm_90a")


@pytest.mark.parametrize("command", ["plan", "emit", "compile"])
def test_reserved_arch_is_rejected(tmp_path: Path, command: str) -> None:
    result = run("--cache-dir", tmp_path / "cache", command, write_spec(tmp_path), "--arch", "sm_100a")
    assert_one_line_error(result, "sm_100a", "reserved")


def test_unknown_arch_and_missing_file(tmp_path: Path) -> None:
    assert_one_line_error(run("plan", write_spec(tmp_path), "--arch", "sm_75"), "sm_75", "sm_90a")
    assert_one_line_error(run("plan", tmp_path / "missing.yaml"), "missing.yaml")


def test_no_compile_on_empty_cache_points_to_warm(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = run("compile", write_spec(tmp_path), "--arch", "sm_90a", "--no-compile", "--cache-dir", cache)
    assert_one_line_error(result, "fa4gen warm", str(cache))
    assert fa4gen.KernelCache(cache).entries() == []


def test_no_compile_environment_variable_is_honoured(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = run("compile", write_spec(tmp_path), "--cache-dir", cache, env={"FA4GEN_NO_COMPILE": "1"})
    assert_one_line_error(result, "fa4gen warm")


def test_import_pins_the_archive_digest(tmp_path: Path) -> None:
    archive = tmp_path / "empty.tar.gz"
    assert run("cache", "export", archive, "--cache-dir", tmp_path / "source").exit_code == 0
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    wrong = hashlib.sha256(b"something else").hexdigest()
    result = run("cache", "import", archive, "--sha256", wrong, "--cache-dir", tmp_path / "c")
    assert_one_line_error(result, wrong)
    assert "sha256" in result.stderr.lower()
    for given in (digest, digest.upper()):
        result = run("cache", "import", archive, "--sha256", given, "--cache-dir", tmp_path / "c")
        assert result.exit_code == 0 and result.stdout.startswith("imported 0 entries"), result.output
    for bad in ("abc", digest[:-1] + "g", digest + "0"):
        result = run("cache", "import", archive, "--sha256", bad, "--cache-dir", tmp_path / "c")
        assert result.exit_code == 2 and "not a SHA-256 digest" in result.output


def test_import_help_says_an_archive_is_code() -> None:
    text = " ".join(run("cache", "import", "--help").stdout.split())
    assert "An archive is code" in text and "import only archives from a source you trust" in text
    assert "catch corruption, not malice" in text and "--sha256" in text


def test_import_of_a_bad_archive_fails_cleanly(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.tar.gz"
    garbage.write_bytes(b"not an archive")
    assert_one_line_error(run("cache", "import", garbage, "--cache-dir", tmp_path / "c"), "garbage.tar.gz")
    missing = tmp_path / "missing.tar.gz"
    assert_one_line_error(run("cache", "import", missing, "--cache-dir", tmp_path / "c"), "missing.tar.gz")


def test_bad_duration_is_a_usage_error(tmp_path: Path) -> None:
    result = run("cache", "clear", "--older-than", "3 fortnights", "--cache-dir", tmp_path)
    assert result.exit_code == 2
    assert "--older-than" in result.output


# ----------------------------------------------------------------------------- cache location
def test_empty_cache_listing_names_the_root(tmp_path: Path) -> None:
    result = run("cache", "ls", "--cache-dir", tmp_path / "c")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"cache is empty ({tmp_path / 'c'})"
    assert json.loads(run("cache", "ls", "--json", "--cache-dir", tmp_path / "c").stdout) == []


def test_global_option_and_environment_choose_the_cache(tmp_path: Path) -> None:
    result = run("--cache-dir", tmp_path / "global", "cache", "ls")
    assert f"({tmp_path / 'global'})" in result.stdout
    result = run("cache", "ls", env={"FA4GEN_CACHE_DIR": str(tmp_path / "from-env")})
    assert f"({tmp_path / 'from-env'})" in result.stdout
    result = run("--cache-dir", tmp_path / "global", "cache", "ls", "--cache-dir", tmp_path / "local")
    assert f"({tmp_path / 'local'})" in result.stdout


def test_version_names_toolchain_and_cache_root(tmp_path: Path) -> None:
    result = run("--cache-dir", tmp_path, "version")
    assert result.exit_code == 0
    assert f"fa4gen      {fa4gen.__version__}" in result.stdout
    assert "nvidia-cutlass-dsl" in result.stdout
    assert str(tmp_path) in result.stdout


def test_module_entry_point_runs(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ISOLATED_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "fa4gen.cli", "schema"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["title"] == "AttentionSpec"


def test_every_package_is_in_the_wheel() -> None:
    """A package directory missing from pyproject's list works in an editable install and is
    absent from the wheel a Docker image installs."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parent.parent
    declared = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(root).parts) for init in (root / "fa4gen").rglob("__init__.py")}
    assert found | {"fa4gen.templates"} == declared


# ----------------------------------------------------------------------------- helpers
@pytest.mark.parametrize(
    ("text", "seconds"),
    [("45s", 45), ("30m", 1800), ("12h", 43200), ("7d", 604800), ("1.5h", 5400), ("2W", 1209600), (" 0s ", 0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("size", "text"), [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (166942, "163.0 KiB"), (5 * 1024**3, "5.0 GiB")]
)
def test_human_size(size: int, text: str) -> None:
    assert human_size(size) == text


# ----------------------------------------------------------------------------- with a compiled kernel
@pytest.mark.slow
def test_compile_prints_plan_key_and_compile_time(built: Built) -> None:
    assert built.first.exit_code == 0, built.first.output
    out = built.first.stdout
    assert "plan for sm_90a" in out
    assert f"key     {built.key}" in out
    assert f"path    {built.cache / 'entries' / built.key}" in out
    assert "compiled in " in out and " s" in out
    assert "KiB" in out


@pytest.mark.slow
def test_compile_reports_each_finished_kernel(built: Built) -> None:
    for result, status in ((built.first, "compiled"), (built.second, "cached")):  # one plan: one line
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(status) and "sm_90a" in lines[0], result.stderr


@pytest.mark.slow
def test_second_compile_is_a_cache_hit(built: Built) -> None:
    assert built.second.exit_code == 0, built.second.output
    assert "status  cache hit" in built.second.stdout
    assert built.key in built.second.stdout
    assert "compiled in" not in built.second.stdout


@pytest.mark.slow
def test_no_compile_uses_the_cached_kernel(built: Built) -> None:
    result = run("compile", built.spec_file, "--no-compile", "--cache-dir", built.cache)
    assert result.exit_code == 0, result.output
    assert "cache hit" in result.stdout


@pytest.mark.slow
def test_cache_ls_shows_the_entry(built: Built) -> None:
    result = run("cache", "ls", "--cache-dir", built.cache)
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if built.key[:12] in line]
    assert len(rows) == 1
    assert "bfloat16 d64" in rows[0] and "sm_90a" in rows[0] and "KiB" in rows[0]
    assert built.key[:13] not in result.stdout
    assert "1 cached kernel in" in result.stdout
    listed = json.loads(run("cache", "ls", "--json", "--cache-dir", built.cache).stdout)
    rows = [(row["key"], row["summary"], row["arch"]) for row in listed]
    assert rows == [(built.key, "bfloat16 d64 causal window(128,0) document", "sm_90a")]


@pytest.mark.slow
def test_cache_verify_passes(built: Built) -> None:
    result = run("cache", "verify", "--cache-dir", built.cache)
    assert result.exit_code == 0, result.output
    assert "1 ok, 0 broken" in result.stdout


@pytest.mark.slow
def test_truncated_artifact_fails_verify_and_clear_removes_it(built: Built, cache_copy: Path) -> None:
    library = cache_copy / "entries" / built.key / "kernel.so"
    with open(library, "r+b") as f:
        f.truncate(library.stat().st_size // 2)
    result = run("cache", "verify", "--cache-dir", cache_copy)
    assert result.exit_code == 1
    assert f"broken {built.key[:12]}: " in result.stdout and "kernel.so" in result.stdout
    assert "0 ok, 1 broken" in result.stdout
    result = run("cache", "clear", "--cache-dir", cache_copy)
    assert result.exit_code == 0
    assert result.stdout.startswith("removed 1 entry")
    assert "cache is empty" in run("cache", "ls", "--cache-dir", cache_copy).stdout
    assert run("cache", "verify", "--cache-dir", cache_copy).exit_code == 0


@pytest.mark.slow
def test_broken_entry_is_reported_as_a_warning_not_loaded(built: Built, cache_copy: Path) -> None:
    (cache_copy / "entries" / built.key / "kernel.so").write_bytes(b"tampered")
    result = run("compile", built.spec_file, "--no-compile", "--cache-dir", cache_copy)
    assert result.exit_code == 1
    warning, error = result.stderr.strip().splitlines()
    assert warning.startswith(f"warning: fa4gen cache entry {built.key} ") and "kernel.so" in warning
    assert error.startswith("error: no cached kernel") and "fa4gen warm" in error


def test_cache_drop_refuses_the_kernel_library(tmp_path: Path) -> None:
    result = run("cache", "drop", "kernel.ptx", "kernel.so", "--cache-dir", tmp_path)
    assert result.exit_code == 2
    assert "kernel.so is the compiled kernel that loading needs" in result.output


@pytest.mark.slow
def test_cache_drop_ptx_leaves_a_loadable_entry(built: Built, cache_copy: Path) -> None:
    entry = cache_copy / "entries" / built.key
    assert (entry / "kernel.ptx").exists()
    result = run("cache", "drop", "kernel.ptx", "--cache-dir", cache_copy)
    assert result.exit_code == 0 and result.stdout.startswith("dropped kernel.ptx from 1 entry"), result.output
    assert not (entry / "kernel.ptx").exists()
    assert "kernel.ptx" not in json.loads((entry / "meta.json").read_text())["meta"]["files"]
    assert "1 ok, 0 broken" in run("cache", "verify", "--cache-dir", cache_copy).stdout
    result = run("compile", built.spec_file, "--no-compile", "--cache-dir", cache_copy)
    assert result.exit_code == 0 and "cache hit" in result.stdout, result.output


@pytest.mark.slow
def test_clear_filters_by_arch_and_age(built: Built, cache_copy: Path) -> None:
    for option, value in (("--arch", "sm_100a"), ("--older-than", "7d")):
        result = run("cache", "clear", option, value, "--cache-dir", cache_copy)
        assert result.exit_code == 0 and result.stdout.startswith("removed 0 entries"), result.output
    result = run("cache", "clear", "--arch", "sm_90a", "--older-than", "0s", "--cache-dir", cache_copy)
    assert result.stdout.startswith("removed 1 entry")
    assert fa4gen.KernelCache(cache_copy).entries() == []


@pytest.mark.slow
def test_export_import_round_trip(built: Built, tmp_path: Path) -> None:
    archive = tmp_path / "kernels.tar.gz"
    result = run("cache", "export", archive, "--cache-dir", built.cache)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("exported 1 entry")
    other = tmp_path / "other-cache"
    result = run("--cache-dir", other, "cache", "import", archive)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("imported 1 entry")
    listed = json.loads(run("cache", "ls", "--json", "--cache-dir", other).stdout)
    assert [row["key"] for row in listed] == [built.key]
    assert run("cache", "import", archive, "--cache-dir", other).stdout.startswith("imported 0 entries")
    result = run("compile", built.spec_file, "--no-compile", "--cache-dir", other)
    assert result.exit_code == 0 and "cache hit" in result.stdout
