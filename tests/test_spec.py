"""Tests of fa4gen.spec: validation messages, resolved values, YAML and JSON-schema I/O. CPU only."""

from __future__ import annotations

import builtins
import json
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import fa4gen
from fa4gen.spec import AttentionSpec, spec_json_schema
from fa4gen.specfile import SpecFileError, dump_spec, load_spec, spec_from_yaml

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"
SPEC_FILES = sorted(SPECS_DIR.glob("*.yaml"))
FIELDS = tuple(AttentionSpec.model_fields)
VALID_HEAD_DIMS = tuple(range(8, 257, 8))

# `fa4gen.compile` is the package's public name for plan+build+load; the check below needs Python's.
py_compile_source = builtins.compile


# --------------------------------------------------------------------------- bad specs

BAD_SPECS = [
    # (id, fields, substrings that str(ValidationError) must contain)
    ("head_dim_0", {"head_dim": 0}, ["head_dim", "head_dim=0", "multiples of 8 from 8 to 256"]),
    ("head_dim_7", {"head_dim": 7}, ["head_dim", "head_dim=7", "multiples of 8"]),
    ("head_dim_12", {"head_dim": 12}, ["head_dim", "head_dim=12", "multiples of 8"]),
    ("head_dim_264", {"head_dim": 264}, ["head_dim", "head_dim=264", "from 8 to 256"]),
    ("head_dim_neg8", {"head_dim": -8}, ["head_dim", "head_dim=-8", "multiples of 8"]),
    ("head_dim_abc", {"head_dim": "abc"}, ["head_dim", "'abc'", "valid integer"]),
    ("head_dim_frac", {"head_dim": 64.5}, ["head_dim", "64.5", "valid integer"]),
    ("head_dim_v_300", {"head_dim_v": 300}, ["head_dim_v", "head_dim_v=300", "multiples of 8 from 8 to 256"]),
    ("dtype_float32", {"dtype": "float32"}, ["dtype", "'float32'", "allowed are bfloat16 (bf16), float16 (fp16)"]),
    ("dtype_int8", {"dtype": "int8"}, ["dtype", "'int8'", "allowed are bfloat16"]),
    ("dtype_number", {"dtype": 16}, ["dtype", "16", "'bfloat16' or 'float16'"]),
    ("ratio_0", {"qhead_per_kvhead": 0}, ["qhead_per_kvhead", "qhead_per_kvhead=0", "allowed is 1..256"]),
    ("ratio_neg1", {"qhead_per_kvhead": -1}, ["qhead_per_kvhead", "qhead_per_kvhead=-1", "allowed is 1..256"]),
    ("ratio_1000", {"qhead_per_kvhead": 1000}, ["qhead_per_kvhead", "qhead_per_kvhead=1000", "allowed is 1..256"]),
    ("window_left_neg1", {"window_left": -1}, ["window_left", "window_left=-1", "integer in 0.."]),
    ("window_right_neg5", {"window_right": -5}, ["window_right", "window_right=-5", "integer in 0.."]),
    ("softcap_0", {"softcap": 0}, ["softcap", "softcap=0.0", "finite number > 0"]),
    ("softcap_neg1", {"softcap": -1}, ["softcap", "softcap=-1.0", "finite number > 0"]),
    ("softcap_inf", {"softcap": math.inf}, ["softcap", "softcap=inf", "finite number > 0"]),
    ("softcap_nan", {"softcap": math.nan}, ["softcap", "softcap=nan", "finite number > 0"]),
    ("scale_0", {"softmax_scale": 0}, ["softmax_scale", "softmax_scale=0.0", "finite number > 0"]),
    ("scale_neg2", {"softmax_scale": -2}, ["softmax_scale", "softmax_scale=-2.0", "finite number > 0"]),
    ("scale_nan", {"softmax_scale": math.nan}, ["softmax_scale", "softmax_scale=nan", "finite number > 0"]),
    (
        "causal_window_right",
        {"causal": True, "window_right": 3},
        ["window_right=3", "causal=true", "drop window_right or set causal=false"],
    ),
    ("unknown_headdim", {"headdim": 128}, ["headdim", "Extra inputs are not permitted"]),
    ("plan_field_tile_n", {"tile_n": 64}, ["tile_n", "Extra inputs are not permitted"]),
    ("causal_maybe", {"causal": "maybe"}, ["causal", "'maybe'", "valid boolean"]),
]


@pytest.mark.parametrize("fields, expected", [pytest.param(f, e, id=i) for i, f, e in BAD_SPECS])
def test_bad_spec_is_rejected_with_a_helpful_message(fields, expected):
    with pytest.raises(ValidationError) as info:
        AttentionSpec(**fields)
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} missing from:\n{message}"


@pytest.mark.parametrize("fields", [pytest.param(f, id=i) for i, f, _ in BAD_SPECS if i != "causal_window_right"])
def test_bad_field_error_is_located_at_the_field(fields):
    with pytest.raises(ValidationError) as info:
        AttentionSpec.model_validate(fields)
    locs = [err["loc"] for err in info.value.errors()]
    assert locs == [(next(iter(fields)),)]


@pytest.mark.parametrize("fields", [pytest.param(f, id=i) for i, f, _ in BAD_SPECS])
def test_bad_spec_is_rejected_from_yaml_too(fields):
    if any(isinstance(v, float) and not math.isfinite(v) for v in fields.values()):
        text = "\n".join(f"{k}: {'.nan' if math.isnan(v) else '.inf'}" for k, v in fields.items())
    else:
        text = yaml.safe_dump(fields)
    with pytest.raises(SpecFileError):
        spec_from_yaml(text)


# --------------------------------------------------------------------------- good specs


def test_defaults():
    spec = AttentionSpec()
    assert spec.dtype == "bfloat16"
    assert spec.head_dim == 128
    assert spec.head_dim_v is None and spec.dv == 128
    assert spec.qhead_per_kvhead == 1
    assert spec.causal is False
    assert spec.window_left is None and spec.window_right is None
    assert spec.softcap is None and spec.softmax_scale is None
    assert spec.return_lse is False
    assert spec.left_bound is None and spec.right_bound is None
    assert spec.has_mask is False


@pytest.mark.parametrize(
    "alias, dtype",
    [
        ("bf16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("bfloat16", "bfloat16"),
        ("fp16", "float16"),
        ("FP16", "float16"),
        ("half", "float16"),
        ("float16", "float16"),
    ],
)
def test_dtype_aliases_normalise(alias, dtype):
    spec = AttentionSpec(dtype=alias)
    assert spec.dtype == dtype
    assert spec == AttentionSpec(dtype=dtype)
    assert spec.canonical()["dtype"] == dtype


@pytest.mark.parametrize("head_dim", [8, 64, 96, 128, 192, 256])
def test_default_softmax_scale_is_inverse_sqrt_head_dim(head_dim):
    spec = AttentionSpec(head_dim=head_dim)
    assert spec.softmax_scale is None
    assert spec.scale == pytest.approx(1.0 / math.sqrt(head_dim), rel=1e-15)
    assert spec.canonical()["softmax_scale"] == spec.scale
    explicit = AttentionSpec(head_dim=head_dim, softmax_scale=1.0 / math.sqrt(head_dim))
    assert explicit.canonical() == spec.canonical()


def test_explicit_softmax_scale_is_used():
    spec = AttentionSpec(softmax_scale=0.5)
    assert spec.scale == 0.5
    assert spec.canonical()["softmax_scale"] == 0.5


def test_causal_implies_right_bound_zero():
    spec = AttentionSpec(causal=True)
    assert spec.right_bound == 0
    assert spec.left_bound is None
    assert spec.has_mask
    # causal with an explicit window_right=0 is allowed and is the same computation
    same = AttentionSpec(causal=True, window_right=0)
    assert same.right_bound == 0
    assert same.canonical() == spec.canonical()


def test_windows_set_bounds():
    spec = AttentionSpec(window_left=128, window_right=16)
    assert (spec.left_bound, spec.right_bound) == (128, 16)
    assert spec.has_mask
    assert AttentionSpec(window_left=0).has_mask
    assert AttentionSpec(window_right=0).right_bound == 0


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_canonical_head_dim_v_default_equals_explicit(head_dim):
    implicit = AttentionSpec(head_dim=head_dim)
    explicit = AttentionSpec(head_dim=head_dim, head_dim_v=head_dim)
    assert implicit != explicit  # the models differ...
    assert implicit.canonical() == explicit.canonical()  # ...but they compute the same thing
    assert implicit.canonical_json() == explicit.canonical_json()
    assert implicit.canonical()["head_dim_v"] == head_dim


def test_canonical_differs_when_computation_differs():
    base = AttentionSpec()
    for other in (
        AttentionSpec(head_dim_v=64),
        AttentionSpec(causal=True),
        AttentionSpec(softcap=30.0),
        AttentionSpec(dtype="fp16"),
        AttentionSpec(return_lse=True),
        AttentionSpec(window_left=8),
    ):
        assert other.canonical_json() != base.canonical_json()


def test_canonical_json_is_stable_and_sorted():
    a = AttentionSpec(head_dim=64, causal=True, qhead_per_kvhead=4, softcap=30.0)
    b = AttentionSpec.model_validate({"softcap": 30.0, "qhead_per_kvhead": 4, "causal": True, "head_dim": 64})
    text = a.canonical_json()
    assert text == b.canonical_json() == a.canonical_json()
    decoded = json.loads(text)
    assert list(decoded) == sorted(decoded)
    assert set(decoded) == set(FIELDS)
    assert decoded == a.canonical()
    assert text == json.dumps(a.canonical(), sort_keys=True, separators=(",", ":"))
    assert " " not in text


def test_summary_names_the_variant():
    spec = AttentionSpec(
        head_dim=192, head_dim_v=128, qhead_per_kvhead=4, causal=True, window_left=256, softcap=50.0, return_lse=True
    )
    summary = spec.summary()
    for part in ("bfloat16", "d192/128", "gqa4", "causal", "window(256,0)", "softcap50", "lse"):
        assert part in summary


# --------------------------------------------------------------------------- frozen


def test_spec_is_frozen():
    spec = AttentionSpec()
    with pytest.raises(ValidationError, match="frozen"):
        spec.head_dim = 64  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        spec.causal = True  # type: ignore[misc]
    assert spec.head_dim == 128 and spec.causal is False


def test_model_copy_update_works():
    spec = AttentionSpec(head_dim=64, causal=True)
    copy = spec.model_copy(update={"return_lse": True})
    assert copy.return_lse is True
    assert spec.return_lse is False
    assert copy.head_dim == 64 and copy.causal is True
    assert copy == AttentionSpec(head_dim=64, causal=True, return_lse=True)


def test_specs_are_hashable_and_compare_by_value():
    assert AttentionSpec(head_dim=64) == AttentionSpec(head_dim=64)
    assert hash(AttentionSpec(head_dim=64)) == hash(AttentionSpec(head_dim=64))
    assert len({AttentionSpec(), AttentionSpec(), AttentionSpec(causal=True)}) == 2


# --------------------------------------------------------------------------- YAML

# scale / softcap and scale * log2(e) stay inside float32 for any pair drawn from this range
positive_floats = st.floats(min_value=1e-15, max_value=1e15, allow_nan=False, allow_infinity=False)
windows = st.none() | st.integers(min_value=0, max_value=2**20)


@st.composite
def valid_specs(draw) -> AttentionSpec:
    causal = draw(st.booleans())
    return AttentionSpec(
        dtype=draw(st.sampled_from(["bfloat16", "float16", "bf16", "fp16", "half"])),
        head_dim=draw(st.sampled_from(VALID_HEAD_DIMS)),
        head_dim_v=draw(st.none() | st.sampled_from(VALID_HEAD_DIMS)),
        qhead_per_kvhead=draw(st.integers(min_value=1, max_value=256)),
        causal=causal,
        window_left=draw(windows),
        window_right=draw(st.sampled_from([None, 0]) if causal else windows),
        softcap=draw(st.none() | positive_floats),
        softmax_scale=draw(st.none() | positive_floats),
        return_lse=draw(st.booleans()),
    )


@settings(max_examples=100, deadline=None)
@given(valid_specs())
def test_yaml_round_trip(spec):
    text = dump_spec(spec)
    again = spec_from_yaml(text)
    assert again == spec
    assert again.canonical_json() == spec.canonical_json()
    assert dump_spec(again) == text  # dumping is a fixed point


def test_dump_spec_writes_file_and_load_spec_reads_it(tmp_path):
    spec = AttentionSpec(head_dim=96, qhead_per_kvhead=8, window_left=512, softcap=30.0, dtype="fp16")
    path = tmp_path / "s.yaml"
    text = dump_spec(spec, path)
    assert path.read_text() == text
    assert load_spec(path) == spec
    assert load_spec(str(path)) == spec


def test_dump_spec_lists_only_non_defaults_sorted():
    assert dump_spec(AttentionSpec()) == "{}\n"
    text = dump_spec(AttentionSpec(qhead_per_kvhead=4, causal=True, head_dim=64))
    assert text == "causal: true\nhead_dim: 64\nqhead_per_kvhead: 4\n"


@pytest.mark.parametrize("path", SPEC_FILES, ids=[p.stem for p in SPEC_FILES])
def test_spec_file_loads(path):
    spec = load_spec(path)
    assert isinstance(spec, AttentionSpec)
    assert path.read_text().startswith("#"), "each spec file starts with a comment naming the model"
    raw = yaml.safe_load(path.read_text())
    assert set(raw) <= set(FIELDS)
    assert spec_from_yaml(dump_spec(spec)) == spec


def test_spec_files_present():
    stems = {p.stem for p in SPEC_FILES}
    assert {"llama3-8b", "mistral-7b", "gemma2-local", "vit", "deepseek-style", "qwen-fp16"} <= stems


@pytest.mark.parametrize(
    "stem, expected",
    [
        ("llama3-8b", dict(head_dim=128, qhead_per_kvhead=4, causal=True, dtype="bfloat16")),
        ("mistral-7b", dict(head_dim=128, qhead_per_kvhead=4, causal=True, window_left=4095)),
        ("gemma2-local", dict(head_dim=256, qhead_per_kvhead=2, causal=True, window_left=4095, softcap=50.0)),
        ("vit", dict(head_dim=64, causal=False)),
        (
            "deepseek-style",
            dict(head_dim=192, head_dim_v=128, causal=True, return_lse=True, softmax_scale=0.1352337788608801),
        ),
        ("qwen-fp16", dict(dtype="float16", head_dim=128, qhead_per_kvhead=8, causal=True)),
    ],
)
def test_spec_file_contents(stem, expected):
    assert load_spec(SPECS_DIR / f"{stem}.yaml") == AttentionSpec(**expected)


@pytest.mark.parametrize(
    "payload",
    [
        '!!python/object/apply:os.system ["touch {marker}"]',
        'head_dim: !!python/object/apply:os.system ["touch {marker}"]',
        '!!python/object/new:subprocess.check_output [["touch", "{marker}"]]',
        "!!python/name:os.system",
    ],
)
def test_yaml_python_tags_are_rejected_and_not_executed(tmp_path, payload):
    marker = tmp_path / "pwned"
    text = payload.format(marker=marker)
    with pytest.raises((yaml.constructor.ConstructorError, ValueError)):
        spec_from_yaml(text)
    spec_file = tmp_path / "evil.yaml"
    spec_file.write_text(text)
    with pytest.raises((yaml.constructor.ConstructorError, ValueError)):
        load_spec(spec_file)
    assert not marker.exists(), "a YAML tag ran code"


@pytest.mark.parametrize(
    "text, kind",
    [
        ("- head_dim: 64\n- causal: true\n", "list"),
        ("42\n", "int"),
        ("just a string\n", "str"),
        ("[1, 2]\n", "list"),
        ("true\n", "bool"),
    ],
)
def test_yaml_top_level_must_be_a_mapping(text, kind):
    with pytest.raises(ValueError, match="mapping") as info:
        spec_from_yaml(text)
    assert not isinstance(info.value, ValidationError)
    assert kind in str(info.value)


def test_explicit_empty_mapping_is_the_default_spec(tmp_path):
    """`{}` is what dump_spec writes for the default spec; an empty file is an error (test_specfile)."""
    assert spec_from_yaml("{}\n") == AttentionSpec()
    path = tmp_path / "empty.yaml"
    path.write_text("{}\n")
    assert load_spec(path) == AttentionSpec()


def test_yaml_values_go_through_validation():
    assert spec_from_yaml("dtype: fp16\nhead_dim: 64\n") == AttentionSpec(dtype="float16", head_dim=64)
    with pytest.raises(SpecFileError, match="head_dim=100"):
        spec_from_yaml("head_dim: 100\n")
    with pytest.raises(SpecFileError, match="tile_n"):
        spec_from_yaml("head_dim: 64\ntile_n: 128\n")


# --------------------------------------------------------------------------- JSON schema


def test_json_schema():
    schema = spec_json_schema()
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == set(FIELDS)
    for name, prop in schema["properties"].items():
        assert prop.get("description"), f"{name} has no description"
    assert schema["properties"]["dtype"]["enum"] == ["bfloat16", "float16"]
    text = json.dumps(schema, sort_keys=True, allow_nan=False)
    assert json.loads(text) == schema
    assert spec_json_schema() == schema  # stable


# --------------------------------------------------------------------------- fuzzing

WILD_VALUES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # nan, inf, subnormals, +-max
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "bf16",
            "fp16",
            "half",
            "BFloat16",
            "float32",
            "128",
            "64",
            "-8",
            "nan",
            "inf",
            "1e-3",
            "true",
            "false",
            "yes",
            "0",
            " 8 ",
        ]
    )
)
PLAUSIBLE = {
    "dtype": st.sampled_from(["bfloat16", "float16", "bf16", "fp16"]),
    "head_dim": st.sampled_from(VALID_HEAD_DIMS),
    "head_dim_v": st.none() | st.sampled_from(VALID_HEAD_DIMS),
    "qhead_per_kvhead": st.integers(min_value=1, max_value=256),
    "causal": st.booleans(),
    "window_left": st.none() | st.integers(min_value=0, max_value=2**40),
    "window_right": st.none() | st.integers(min_value=0, max_value=2**40),
    "softcap": st.none() | st.floats(min_value=0, exclude_min=True, allow_infinity=False),
    "softmax_scale": st.none() | st.floats(min_value=0, exclude_min=True, allow_infinity=False),
    "return_lse": st.booleans(),
    "mask": st.none()
    | st.sampled_from(["none", "causal", "prefix_lm", "document", "chunked", "bogus"])
    | st.fixed_dictionaries({"kind": st.just("chunked"), "size": st.integers(-5, 2**31)})
    | st.fixed_dictionaries(
        {
            "kind": st.just("sliding_window"),
            "left": st.none() | st.integers(-1, 4096),
            "right": st.none() | st.integers(-1, 4096),
        }
    )
    | st.fixed_dictionaries(
        {
            "kind": st.just("expression"),
            "expr": st.sampled_from(
                ["kv_idx <= q_idx", "q_idx // w == kv_idx // w", "score > 0", "t[h] > 0", "__import__('os')", "kv_idx"]
            ),
        }
    ),
    "score_mod": st.none()
    | st.sampled_from(["alibi", "softcap", "relative_bias", "nope"])
    | st.fixed_dictionaries({"kind": st.just("alibi"), "slopes": st.sampled_from(["standard", "tensor", "x"])})
    | st.fixed_dictionaries({"kind": st.just("relative_bias"), "max_distance": st.integers(-1, 70000)})
    | st.fixed_dictionaries({"kind": st.just("softcap"), "cap": st.floats(-1, 100)})
    | st.fixed_dictionaries(
        {
            "kind": st.just("expression"),
            "expr": st.sampled_from(
                ["score * 2", "score - t[h] * abs(q_idx - kv_idx)", "q_idx < 3", "score + w", "open('x')"]
            ),
        }
    ),
    "sinks": st.booleans(),
    "deterministic": st.booleans(),
    "aux": st.sampled_from(
        [
            {},
            {"t": {"dtype": "float32", "shape": ["Hq"]}},
            {"t": {"dtype": "int8", "shape": [4]}},
            {"score": {"dtype": "float32", "shape": [4]}},
            {"t": {"dtype": "int32", "shape": []}},
        ]
    ),
    "scalars": st.sampled_from([{}, {"w": "int32"}, {"w": "float32"}, {"w": "float64"}, {"q_idx": "int32"}]),
}


def _field_values(key: str) -> st.SearchStrategy:
    """One value in three from the wide strategy, else a plausible one, so that both the
    rejecting and the planning/emitting paths are exercised often."""
    return st.integers(0, 2).flatmap(lambda pick: WILD_VALUES if pick == 0 else PLAUSIBLE[key])


fuzz_dicts = st.sets(st.sampled_from(FIELDS)).flatmap(
    lambda keys: st.fixed_dictionaries({key: _field_values(key) for key in sorted(keys)})
)


def _validate_plan_emit(data: dict):
    try:
        spec = AttentionSpec.model_validate(data)
    except ValidationError:
        return None
    kernel_plan = fa4gen.plan(spec, "sm_90a")
    emitted = fa4gen.emit(spec, kernel_plan)
    py_compile_source(emitted.source, "k.py", "exec")
    return spec


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fuzz_dicts)
@example({"softcap": True, "softmax_scale": 1.2460659279417838e308})  # big scale is fine with a softcap
@example({"softmax_scale": 1.7e308})  # derived float32 constant overflows: rejected
@example({"softcap": 5e-324})  # known overflow
@example({"head_dim": True, "causal": "yes", "dtype": "HALF"})
def test_fuzz_spec_validates_plans_and_emits_or_raises_validation_error(data):
    _validate_plan_emit(data)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=10) | st.sampled_from(FIELDS), WILD_VALUES, max_size=6))
def test_fuzz_unknown_keys_only_raise_validation_error(data):
    spec = _validate_plan_emit(data)
    if spec is not None:
        assert set(data) <= set(FIELDS)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=60))
def test_fuzz_yaml_text_raises_only_documented_errors(text):
    try:
        spec = spec_from_yaml(text)
    except (ValidationError, ValueError, yaml.YAMLError):
        return
    assert isinstance(spec, AttentionSpec)


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"head_dim": 8}, {"head_dim": 8}),
        ({"head_dim": "128"}, {"head_dim": 128}),
        ({"head_dim": 64.0}, {"head_dim": 64}),
        ({"causal": "true"}, {"causal": True}),
        ({"causal": 1}, {"causal": True}),
        ({"softcap": 30}, {"softcap": 30.0}),
        ({"softcap": "30"}, {"softcap": 30.0}),
        ({"window_left": 0, "window_right": 0}, {"window_left": 0, "window_right": 0}),
        ({"qhead_per_kvhead": 256}, {"qhead_per_kvhead": 256}),
    ],
)
def test_lax_inputs_coerce(fields, expected):
    spec = AttentionSpec.model_validate(fields)
    for name, value in expected.items():
        got = getattr(spec, name)
        assert got == value and type(got) is type(value)


# ------------------------------------------------------------- float32 kernel constants


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"softmax_scale": 1.7e308}, id="huge-scale"),
        pytest.param({"softcap": 1e-310}, id="tiny-softcap"),
        pytest.param({"softcap": 5e-324, "softmax_scale": 1.0}, id="subnormal-softcap"),
    ],
)
def test_spec_with_overflowing_constants_is_rejected(fields):
    with pytest.raises(ValidationError, match="float32"):
        AttentionSpec(**fields)


def test_window_beyond_int32_indexing_is_rejected():
    with pytest.raises(ValidationError, match="window_left"):
        AttentionSpec(window_left=2**40)


def test_causal_and_window_right_zero_share_a_canonical_form():
    assert AttentionSpec(causal=True).canonical() == AttentionSpec(window_right=0).canonical()


# --------------------------------------------------------------------------- variants (masks, score mods, sinks, aux)

BAD_VARIANTS = [
    ("mask_unknown_kind", {"mask": "diagonal"}, ["mask", "'diagonal'", "chunked", "prefix_lm", "document"]),
    ("chunk_zero", {"mask": {"kind": "chunked", "size": 0}}, ["mask.chunked.size", "greater than or equal to 1"]),
    ("chunk_missing_size", {"mask": {"kind": "chunked"}}, ["mask.chunked.size", "Field required"]),
    ("chunk_extra_key", {"mask": {"kind": "chunked", "size": 8, "causal": False}}, ["causal", "Extra inputs"]),
    ("prefix_and_causal", {"mask": "prefix_lm", "causal": True}, ["prefix_lm", "drop causal"]),
    (
        "chunk_and_window_right",
        {"mask": {"kind": "chunked", "size": 64}, "window_right": 5},
        ["chunked is causal within each chunk", "window_right=5"],
    ),
    ("mask_causal_twice", {"mask": "none", "causal": True}, ["mask: none", "causal=True", "set the mask once"]),
    (
        "window_twice",
        {"mask": {"kind": "sliding_window", "left": 8}, "window_left": 16},
        ["mask: sliding_window", "window_left=16"],
    ),
    (
        "window_zero_twice",
        {"mask": {"kind": "sliding_window", "left": 5}, "window_left": 0},
        ["mask: sliding_window", "window_left=0"],
    ),
    ("softcap_twice", {"score_mod": {"kind": "softcap", "cap": 30}, "softcap": 50.0}, ["softcap", "set the cap once"]),
    ("score_mod_unknown", {"score_mod": "rope"}, ["score_mod", "'rope'", "alibi", "relative_bias"]),
    ("alibi_bad_slopes", {"score_mod": {"kind": "alibi", "slopes": "learned"}}, ["slopes", "'standard' or 'tensor'"]),
    (
        "relbias_zero",
        {"score_mod": {"kind": "relative_bias", "max_distance": 0}},
        ["max_distance", "greater than or equal to 1"],
    ),
    (
        "expr_attribute",
        {"score_mod": {"kind": "expression", "expr": "score.real"}},
        ["score_mod.expr", "Attribute is not allowed", "^"],
    ),
    (
        "expr_import",
        {"mask": {"kind": "expression", "expr": "__import__('os').system('x')"}},
        ["mask.expr", "only where, min, max"],
    ),
    (
        "expr_mask_is_number",
        {"mask": {"kind": "expression", "expr": "kv_idx - q_idx"}},
        ["mask.expr", "a mask must be a condition"],
    ),
    (
        "expr_undeclared_aux",
        {"score_mod": {"kind": "expression", "expr": "score + bias[h]"}},
        ["score_mod.expr", "only declared aux tensors can be indexed"],
    ),
    (
        "expr_undeclared_scalar",
        {"mask": {"kind": "expression", "expr": "kv_idx < w"}},
        ["mask.expr", "unknown name 'w'"],
    ),
    ("aux_reserved_name", {"aux": {"score": {"dtype": "float32", "shape": [4]}}}, ["'score' is not allowed"]),
    ("aux_bad_dtype", {"aux": {"t": {"dtype": "float64", "shape": [4]}}}, ["aux.t.dtype", "'float32' or 'int32'"]),
    ("aux_bad_dim", {"aux": {"t": {"dtype": "float32", "shape": ["H"]}}}, ["aux.t.shape", "'B'", "'Hq'"]),
    ("aux_no_dims", {"aux": {"t": {"dtype": "float32", "shape": []}}}, ["aux.t.shape", "at least 1 item"]),
    (
        "aux_and_scalar",
        {"aux": {"t": {"dtype": "float32", "shape": [4]}}, "scalars": {"t": "int32"}},
        ["t declared both as aux tensor and as scalar"],
    ),
    ("scalar_bad_dtype", {"scalars": {"w": "int64"}}, ["scalars.w", "'float32' or 'int32'"]),
    ("sinks_maybe", {"sinks": "maybe"}, ["sinks", "valid boolean"]),
]


@pytest.mark.parametrize("fields, expected", [pytest.param(f, e, id=i) for i, f, e in BAD_VARIANTS])
def test_bad_variant_is_rejected_with_a_helpful_message(fields, expected):
    with pytest.raises(ValidationError) as info:
        AttentionSpec.model_validate(fields)
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} missing from:\n{message}"
    with pytest.raises(SpecFileError):  # and from YAML
        spec_from_yaml(yaml.safe_dump(fields))


@pytest.mark.parametrize(
    "spelled, flat",
    [
        ({"mask": "causal"}, {"causal": True}),
        ({"mask": {"kind": "causal"}}, {"causal": True}),
        ({"mask": "none"}, {}),
        ({"mask": {"kind": "sliding_window", "left": 100, "right": 0}}, {"window_left": 100, "window_right": 0}),
        ({"mask": {"kind": "sliding_window", "left": 64}}, {"window_left": 64}),
        ({"score_mod": {"kind": "softcap", "cap": 30.0}}, {"softcap": 30.0}),
    ],
)
def test_flat_kinds_fold_into_the_flat_fields(spelled, flat):
    spec = AttentionSpec.model_validate(spelled)
    assert spec.mask is None and spec.score_mod is None
    assert spec == AttentionSpec(**flat)
    assert spec.canonical_json() == AttentionSpec(**flat).canonical_json()


def test_variant_properties_and_summary():
    chunked = AttentionSpec(mask={"kind": "chunked", "size": 1024})
    assert chunked.right_bound == 0 and chunked.mask_kind == "chunked" and chunked.has_mask
    assert "chunked1024" in chunked.summary()
    docs = AttentionSpec(mask="document", causal=True, sinks=True)
    assert docs.is_varlen and docs.summary().endswith("causal document sinks")
    assert AttentionSpec(score_mod="alibi").summary().endswith("alibi")


def test_aux_declaration_order_does_not_change_the_spec_or_its_kernel_arguments():
    from fa4gen.variants import lower

    aux = {"zeta": {"dtype": "float32", "shape": ["Hq"]}, "alpha": {"dtype": "int32", "shape": [16, "Sk"]}}
    expr = {"kind": "expression", "expr": "score + zeta[h] * alpha[0, kv_idx]"}
    a = AttentionSpec(score_mod=expr, aux=aux, scalars={"w": "float32", "c": "int32"})
    b = AttentionSpec(score_mod=expr, aux=dict(reversed(aux.items())), scalars={"c": "int32", "w": "float32"})
    assert a == b and hash(a) == hash(b) and a.canonical_json() == b.canonical_json()
    assert [e.name for e in lower(a).extras] == [e.name for e in lower(b).extras] == ["alpha", "zeta", "c", "w"]


def test_every_spec_file_round_trips_through_yaml(tmp_path):
    for path in sorted((Path(__file__).resolve().parent.parent / "specs").glob("*.yaml")):
        spec = load_spec(path)
        again = spec_from_yaml(dump_spec(spec))
        assert again == spec and again.canonical_json() == spec.canonical_json(), path.name


@pytest.mark.parametrize(
    "fields,needle",
    [
        (
            {"aux": {"ids": {"dtype": "int32", "shape": ["Hq"], "requires_grad": True}}, "score_mod": "score"},
            "aux.ids.requires_grad: an int32 tensor has no gradient",
        ),
        (
            {
                "aux": {"limit": {"dtype": "float32", "shape": ["B"], "requires_grad": True}},
                "mask": {"kind": "expression", "expr": "kv_idx < limit[b]"},
            },
            "aux.limit.requires_grad: only tensors the score_mod reads have a gradient",
        ),
        ({"score_mod": {"kind": "alibi", "requires_grad": True}}, "only slopes: tensor can train"),
    ],
    ids=["int32", "mask-only", "standard-alibi"],
)
def test_a_tensor_that_cannot_train_is_refused_naming_the_field(fields, needle):
    if fields.get("score_mod") == "score":
        fields = {**fields, "score_mod": {"kind": "expression", "expr": "score + ids[h]"}}
    with pytest.raises(ValueError, match=needle):
        fa4gen.AttentionSpec(head_dim=64, **fields)


def test_trainable_tensors_come_last_in_the_backward_in_kernel_order():
    from fa4gen.variants import grad_name, lower

    spec = fa4gen.AttentionSpec(
        head_dim=64,
        score_mod={"kind": "expression", "expr": "score * t[h] + u[h, 0] + v[h]"},
        aux={
            "v": {"dtype": "float32", "shape": ["Hq"], "requires_grad": True},
            "t": {"dtype": "float32", "shape": ["Hq"], "requires_grad": True},
            "u": {"dtype": "float32", "shape": ["Hq", 2]},
        },
    )
    lowered = lower(spec)
    assert [e.name for e in lowered.trainable] == ["t", "v"]
    backward = lowered.for_backward().extras
    assert [e.name for e in backward] == ["t", "u", "v", grad_name("t"), grad_name("v")]
    assert all(e.role == "aux_grad" and e.shape == ("Hq",) for e in backward[3:])
