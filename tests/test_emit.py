"""Tests of fa4gen.emitter: golden outputs per spec file, and the structure of emitted modules.

Golden files live in tests/golden/<spec stem>.<arch>.py; after an intended change to the template,
planner or spec dumping, regenerate them with ``python tests/regen_golden.py`` and review the diff.
"""

from __future__ import annotations

import ast
import builtins
import difflib
import importlib.util
import math
import types
from pathlib import Path

import pytest

import fa4gen
from fa4gen.api import training_spec
from fa4gen.emitter import emit
from fa4gen.expr import render_cute
from fa4gen.kernels.sm90.config import Sm90FwdConfig
from fa4gen.planner import backward_plan, backward_problem, plan, seqlen_splits
from fa4gen.spec import AttentionSpec
from fa4gen.specfile import dump_spec, load_spec
from fa4gen.variants import lower

TESTS_DIR = Path(__file__).resolve().parent
SPECS_DIR = TESTS_DIR.parent / "specs"
GOLDEN_DIR = TESTS_DIR / "golden"
SPEC_FILES = sorted(SPECS_DIR.glob("*.yaml"))
SPEC_IDS = [p.stem for p in SPEC_FILES]
# (spec file, label) of every length range the planner gives another plan
SPLIT_GOLDENS = [(p, s.label) for p in SPEC_FILES for s in seqlen_splits(load_spec(p), "sm_90a")]
BACKWARD_GOLDENS = [p for p in SPEC_FILES if not backward_problem(load_spec(p))]
ARCH = "sm_90a"
DIFF_LINES = 40
LOG2E = math.log2(math.e)

EXTRA_SPECS = {
    "default": AttentionSpec(),
    "window-both": AttentionSpec(head_dim=64, window_left=128, window_right=32),
    "softcap-scale": AttentionSpec(head_dim=96, softcap=30.0, softmax_scale=0.125, dtype="fp16"),
    "mqa-d8": AttentionSpec(head_dim=8, qhead_per_kvhead=256, return_lse=True),
    "d192-d192": AttentionSpec(head_dim=192, head_dim_v=192, causal=True),
}


def _all_specs() -> list:
    params = [pytest.param(load_spec(p), id=p.stem) for p in SPEC_FILES]
    params += [pytest.param(s, id=name) for name, s in EXTRA_SPECS.items()]
    return params


def _source(spec: AttentionSpec) -> str:
    return emit(spec, plan(spec, ARCH)).source


def _golden_mismatch_message(golden: Path, expected: str, actual: str) -> str:
    diff = list(
        difflib.unified_diff(
            expected.splitlines(keepends=True),
            actual.splitlines(keepends=True),
            fromfile=f"{golden.relative_to(TESTS_DIR.parent)} (golden)",
            tofile="emitted",
        )
    )
    shown = "".join(diff[:DIFF_LINES])
    more = f"\n... ({len(diff) - DIFF_LINES} more diff lines)" if len(diff) > DIFF_LINES else ""
    return (
        f"emitted source differs from {golden.name}. If the change is intended, run "
        f"`python tests/regen_golden.py` and review the golden diff.\n{shown}{more}"
    )


# --------------------------------------------------------------------------- goldens


def test_there_are_spec_files():
    assert len(SPEC_FILES) >= 6


@pytest.mark.parametrize("spec_path", SPEC_FILES, ids=SPEC_IDS)
def test_emit_matches_golden(spec_path):
    golden = GOLDEN_DIR / f"{spec_path.stem}.{ARCH}.py"
    assert golden.exists(), f"no golden {golden.name}: run `python tests/regen_golden.py`"
    expected = golden.read_text()
    actual = _source(load_spec(spec_path))
    assert actual == expected, _golden_mismatch_message(golden, expected, actual)


@pytest.mark.parametrize("spec_path,label", SPLIT_GOLDENS, ids=[f"{p.stem}.{label}" for p, label in SPLIT_GOLDENS])
def test_length_range_plans_match_golden(spec_path, label):
    golden = GOLDEN_DIR / f"{spec_path.stem}.{label}.{ARCH}.py"
    assert golden.exists(), f"no golden {golden.name}: run `python tests/regen_golden.py`"
    expected = golden.read_text()
    spec = load_spec(spec_path)
    split = next(s for s in seqlen_splits(spec, ARCH) if s.label == label)
    actual = emit(spec, split.plan).source
    assert actual == expected, _golden_mismatch_message(golden, expected, actual)


@pytest.mark.parametrize("spec_path", BACKWARD_GOLDENS, ids=[p.stem for p in BACKWARD_GOLDENS])
def test_backward_matches_golden(spec_path):
    golden = GOLDEN_DIR / f"{spec_path.stem}.backward.{ARCH}.py"
    assert golden.exists(), f"no golden {golden.name}: run `python tests/regen_golden.py`"
    spec = training_spec(load_spec(spec_path))
    actual = emit(spec, backward_plan(spec, ARCH)).source
    assert actual == golden.read_text(), _golden_mismatch_message(golden, golden.read_text(), actual)


def test_no_stale_goldens():
    stems = {p.stem for p in SPEC_FILES} | {f"{p.stem}.{label}" for p, label in SPLIT_GOLDENS}
    stems |= {f"{p.stem}.backward" for p in BACKWARD_GOLDENS}
    stale = [g.name for g in GOLDEN_DIR.glob("*.py") if g.name.removesuffix(f".{ARCH}.py") not in stems]
    assert not stale, f"goldens without a spec file: {stale}; run `python tests/regen_golden.py`"


def test_golden_mismatch_message_is_helpful():
    golden = GOLDEN_DIR / "x.sm_90a.py"
    expected = "".join(f"line {i}\n" for i in range(200))
    actual = expected.replace("line 3\n", "line three\n").replace("line 150\n", "")
    actual = actual.replace("line 1", "LINE 1")  # 1, 10..19, 100..199: well over DIFF_LINES changes
    message = _golden_mismatch_message(golden, expected, actual)
    assert "python tests/regen_golden.py" in message
    assert "-line 3\n" in message and "+line three\n" in message
    assert "more diff lines" in message
    assert message.count("\n") < DIFF_LINES + 5


def test_regen_golden_check_is_clean():
    module_spec = importlib.util.spec_from_file_location("regen_golden", TESTS_DIR / "regen_golden.py")
    regen = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(regen)
    split_goldens = {GOLDEN_DIR / f"{p.stem}.{label}.{ARCH}.py" for p, label in SPLIT_GOLDENS}
    split_goldens |= {GOLDEN_DIR / f"{p.stem}.backward.{ARCH}.py" for p in BACKWARD_GOLDENS}
    assert regen.expected_goldens().keys() == {GOLDEN_DIR / f"{s}.{ARCH}.py" for s in SPEC_IDS} | split_goldens
    assert regen.main(["--check"]) == 0


# --------------------------------------------------------------------------- structure


def _module_constants(tree: ast.Module) -> dict[str, object]:
    """Module-level NAME = literal (or NAME = other_name) assignments; CONFIG is read by _config."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Name):
                out[node.targets[0].id] = value.id
            elif not isinstance(value, ast.Call):
                out[node.targets[0].id] = ast.literal_eval(value)
    return out


def _config(source: str) -> Sm90FwdConfig:
    """The emitted CONFIG: Sm90FwdConfig(field=<literal>, ...), one keyword per field."""
    (node,) = [
        n
        for n in ast.parse(source).body
        if isinstance(n, ast.Assign) and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["CONFIG"]
    ]
    call = node.value
    assert isinstance(call, ast.Call) and ast.unparse(call.func) == "Sm90FwdConfig" and not call.args
    return Sm90FwdConfig(**{k.arg: ast.literal_eval(k.value) for k in call.keywords})


def _make_kernel_call(tree: ast.Module) -> ast.Call:
    (func,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "make_kernel"]
    (ret,) = [n for n in ast.walk(func) if isinstance(n, ast.Return)]
    assert isinstance(ret.value, ast.Call)
    return ret.value


@pytest.mark.parametrize("spec", _all_specs())
def test_emitted_source_structure(spec):
    kernel_plan = plan(spec, ARCH)
    emitted = emit(spec, kernel_plan)
    source = emitted.source
    builtins.compile(source, "k.py", "exec")
    tree = ast.parse(source)

    assert source.startswith(f"# Generated by fa4gen {fa4gen.__version__}: do not edit.")
    for tag in ("{{", "}}", "{%", "%}", "{#", "#}"):
        assert tag not in source, f"jinja leftover {tag!r}"
    assert source.endswith("\n") and not source.endswith("\n\n")
    assert all(line == line.rstrip() for line in source.splitlines()), "trailing whitespace"

    lines = source.splitlines()
    header = lines[: lines.index("import cuda.bindings.driver as cuda")]
    assert all(line.startswith("#") for line in header)
    for yaml_line in dump_spec(spec.canonicalized()).splitlines():
        assert f"#   {yaml_line}".rstrip() in header, f"spec line {yaml_line!r} not in header"
    (plan_line,) = [line for line in header if line.startswith("# plan:")]
    assert kernel_plan.arch in plan_line and kernel_plan.kernel in plan_line

    assert [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "make_kernel"]
    assert [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "entry"]
    imports = {(n.module, a.name) for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("fa4gen.kernels.sm90.fwd", kernel_plan.kernel) in imports
    assert ("fa4gen.kernels.sm90.config", "Sm90FwdConfig") in imports
    assert emitted.template == "sm90_fwd.py.jinja"

    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    constants = _module_constants(tree)
    config = _config(source)
    lowered = lower(spec)
    assert "SCALE_LOG2" not in constants and "EXTRAS" not in constants  # both live in CONFIG
    if lowered.score is not None:  # the expression (built-in or the user's), scaled first
        assert "score_mod" in functions and constants["SCORE_MOD"] == "score_mod"
        assert constants["SOFTMAX_SCALE"] == spec.scale
        assert render_cute(lowered.score, {e.name: f"args.{e.name}" for e in lowered.extras}) in source
        assert config.scale_log2 == LOG2E
        assert ("SOFTCAP" in constants) == (spec.softcap is not None)
    elif spec.softcap is not None:
        assert "score_mod" in functions
        assert constants["SCORE_MOD"] == "score_mod"
        assert constants["SOFTCAP"] == spec.softcap
        assert f"SOFTCAP = {spec.softcap!r}" in source
        assert constants["PRE_TANH"] == spec.scale / spec.softcap
        assert config.scale_log2 == LOG2E
    else:
        assert "score_mod" not in functions
        assert "SOFTCAP" not in constants
        assert constants["SCORE_MOD"] is None
        assert "SCORE_MOD = None" in source
        assert config.scale_log2 == spec.scale * LOG2E
    assert (constants["MASK_MOD"] == "mask_mod") == (lowered.mask is not None)


@pytest.mark.parametrize("spec", _all_specs())
def test_emitted_config_is_the_plans(spec):
    kernel_plan = plan(spec, ARCH)
    source = _source(spec)
    assert _config(source) == kernel_plan.config
    call = _make_kernel_call(ast.parse(source))
    assert ast.unparse(call.func) == kernel_plan.kernel
    assert [ast.unparse(a) for a in call.args] == ["CONFIG"]
    assert {kw.arg: ast.unparse(kw.value) for kw in call.keywords} == {"score_mod": "SCORE_MOD", "mask_mod": "MASK_MOD"}


@pytest.mark.parametrize("spec", _all_specs())
def test_config_variant_fields_match_spec(spec):
    """The fields the spec fixes reach the kernel under its names (spec.dv is the real V dim)."""
    config = plan(spec, ARCH).config
    lowered = lower(spec)
    assert {
        name: getattr(config, name)
        for name in (
            "head_dim",
            "head_dim_v",
            "qhead_per_kvhead",
            "window_left",
            "window_right",
            "chunk",
            "prefix_lm",
            "document",
            "expression_mask",
            "sinks",
            "return_lse",
            "extra_names",
        )
    } == {
        "head_dim": spec.head_dim,
        "head_dim_v": spec.dv,
        "qhead_per_kvhead": spec.qhead_per_kvhead,
        "window_left": spec.left_bound,
        "window_right": spec.right_bound,
        "chunk": spec.mask.size if spec.mask_kind == "chunked" else None,
        "prefix_lm": spec.mask_kind == "prefix_lm",
        "document": spec.mask_kind == "document",
        "expression_mask": lowered.mask is not None,
        "sinks": spec.sinks,
        "return_lse": spec.return_lse,
        "extra_names": tuple(extra.name for extra in lowered.extras),
    }
    assert config.head_dim_padded >= config.head_dim and config.head_dim_v_padded >= config.head_dim_v


@pytest.mark.parametrize(
    "stem, fields, snippets",
    [
        (
            "gemma2-local",
            {"window_left": 4095, "window_right": 0, "head_dim": 256, "qhead_per_kvhead": 2, "tile_n": 64},
            ["SOFTCAP = 50.0", "SCORE_MOD = score_mod"],
        ),
        ("mistral-7b", {"window_left": 4095, "window_right": 0, "qhead_per_kvhead": 4}, ["SCORE_MOD = None"]),
        ("llama3-8b", {"window_left": None, "window_right": 0, "qhead_per_kvhead": 4, "tile_n": 128}, []),
        ("vit", {"head_dim": 64, "window_left": None, "window_right": None, "kv_stages": 2}, []),
        ("deepseek-style", {"head_dim": 192, "head_dim_v": 128, "return_lse": True, "window_right": 0}, []),
        ("qwen-fp16", {"qhead_per_kvhead": 8, "return_lse": False}, ["#   dtype: float16"]),
    ],
)
def test_emitted_constants_for_spec_files(stem, fields, snippets):
    source = _source(load_spec(SPECS_DIR / f"{stem}.yaml"))
    config = _config(source)
    assert {name: getattr(config, name) for name in fields} == fields
    for snippet in snippets:
        assert snippet in source, f"{snippet!r} missing from the {stem} kernel"


def test_softcap_constants_are_exact():
    spec = AttentionSpec(head_dim=256, softcap=50.0)
    constants = _module_constants(ast.parse(_source(spec)))
    assert constants["PRE_TANH"] == pytest.approx(1 / 16 / 50, rel=1e-15)
    spec = AttentionSpec(head_dim=64, softmax_scale=0.5)
    assert _config(_source(spec)).scale_log2 == pytest.approx(0.5 / math.log(2), rel=1e-15)


@pytest.mark.parametrize("spec", _all_specs())
def test_emit_is_deterministic(spec):
    kernel_plan = plan(spec, ARCH)
    first = emit(spec, kernel_plan)
    second = emit(spec, kernel_plan)
    assert first == second
    assert first.source == second.source == emit(spec, plan(spec, ARCH)).source


def test_reasons_do_not_reach_the_source():
    """The header holds the spec and a one-line plan note: goldens change only when code does."""
    for spec in (load_spec(SPECS_DIR / "gemma2-local.yaml"), AttentionSpec()):
        kernel_plan = plan(spec, ARCH)
        reworded = kernel_plan.model_copy(update={"reasons": {name: "x" for name in kernel_plan.reasons}})
        assert emit(spec, reworded).source == emit(spec, kernel_plan).source


def test_emit_module_name():
    spec = AttentionSpec()
    emitted = emit(spec, plan(spec, ARCH), module_name="fa4gen_kernel_abc")
    assert emitted.module_name == "fa4gen_kernel_abc"
    assert emitted.source == _source(spec)  # the name is not baked into the source
    assert emit(spec, plan(spec, ARCH)).module_name == "fa4gen_kernel"


# --------------------------------------------------------------------------- executing the module


class _FakeFloat32(float):
    inf = math.inf


def _stub_import(kernels: dict[str, object]):
    """An __import__ that serves the emitted module's imports from stubs (no GPU, no CUTLASS),
    and refuses everything else: the generated module must import nothing more."""
    cute = types.SimpleNamespace(
        jit=lambda fn: fn,
        math=types.SimpleNamespace(tanh=lambda x, fastmath=False: math.tanh(x)),
        Tensor=object,
    )
    cutlass = types.SimpleNamespace(cute=cute, Float32=_FakeFloat32, Int32=int)
    cuda = types.SimpleNamespace(bindings=types.SimpleNamespace(driver=types.SimpleNamespace(CUstream=object)))
    kernel_module = types.SimpleNamespace(**kernels)
    config_module = types.SimpleNamespace(Sm90FwdConfig=Sm90FwdConfig)

    def fake_import(name, globals=None, locals=None, fromlist=(), level=0):
        if name in ("cutlass", "cutlass.cute"):
            return cutlass
        if name == "cuda.bindings.driver":
            return cuda
        if name == "fa4gen.kernels.sm90.fwd" and fromlist:
            return kernel_module
        if name == "fa4gen.kernels.sm90.config" and fromlist == ("Sm90FwdConfig",):
            return config_module  # plain pydantic: the real one
        raise ImportError(f"emitted module imports {name!r}")

    return fake_import


@pytest.mark.parametrize("spec", _all_specs())
def test_emitted_module_runs_with_stubs(spec):
    kernel_plan = plan(spec, ARCH)
    captured = {}

    class FakeKernel:
        def __init__(self, config, score_mod=None, mask_mod=None):
            captured.update(config=config, score_mod=score_mod, mask_mod=mask_mod)

    namespace = {
        "__builtins__": {**vars(builtins), "__import__": _stub_import({kernel_plan.kernel: FakeKernel})},
        "__name__": "fa4gen_kernel",
    }
    exec(builtins.compile(_source(spec), "k.py", "exec"), namespace)
    kernel = namespace["make_kernel"]()
    assert isinstance(kernel, FakeKernel)
    config = captured["config"]
    assert config == kernel_plan.config and isinstance(config, Sm90FwdConfig)
    assert (captured["mask_mod"] is not None) == config.expression_mask
    if spec.score_mod is not None:  # expressions: checked by cross-compiling and on the GPU
        assert captured["score_mod"] is not None and config.scale_log2 == LOG2E
    elif spec.softcap is None:
        assert captured["score_mod"] is None
        assert config.scale_log2 == spec.scale * LOG2E
    else:
        score_mod = captured["score_mod"]
        assert config.scale_log2 == LOG2E
        for s in (-1000.0, -3.0, 0.0, 0.5, 7.0, 1e6):
            want = spec.softcap * math.tanh(s * spec.scale / spec.softcap)
            assert score_mod(s, 0, 0, 0, 0, 1, 1, None) == pytest.approx(want, rel=1e-12, abs=1e-12)
        assert abs(score_mod(1e9, 0, 0, 0, 0, 1, 1, None)) <= spec.softcap


@pytest.mark.parametrize("spec_path", SPEC_FILES, ids=SPEC_IDS)
def test_emitted_module_builds_the_real_kernel_object(spec_path):
    """The generated wiring matches the real kernel class's constructor (CPU only: nothing traced)."""
    pytest.importorskip("cutlass")
    spec = load_spec(spec_path)
    kernel_plan = plan(spec, ARCH)
    module = types.ModuleType("fa4gen_kernel_under_test")
    exec(builtins.compile(_source(spec), str(spec_path.stem) + ".py", "exec"), module.__dict__)
    kernel = module.make_kernel()
    assert type(kernel).__name__ == kernel_plan.kernel
    assert type(kernel).__module__ == "fa4gen.kernels.sm90.fwd"
    assert kernel.cfg == kernel_plan.config
