"""Tests of fa4gen.specfile: loading spec files is bounded, strict, and fails with one line (CPU only).

Every refusal is a ``SpecFileError`` (a ValueError) whose text is one line starting with the
source's name; hostile inputs (alias bombs, deep nesting, huge files) are refused after work bounded by
the caps, not by the input's size.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fa4gen import specfile
from fa4gen.spec import AttentionSpec
from fa4gen.specfile import (
    EMPTY_MESSAGE,
    MAX_DEPTH,
    MAX_PROBLEM,
    MAX_SPEC_BYTES,
    SpecFileError,
    dump_spec,
    load_spec,
    spec_from_yaml,
)

# 342 bytes: nine levels of nine aliases each, 9^9 strings once expanded
ALIAS_BOMB = "scalars:\n" + "".join(
    f" {name}: &{name} [{','.join([prev] * 9)}]\n"
    for name, prev in zip("abcdefghi", ["lol", "*a", "*b", "*c", "*d", "*e", "*f", "*g", "*h"])
)


def refused(text: str, source: str = "spec.yaml") -> str:
    """The one-line message spec_from_yaml gives for ``text``."""
    with pytest.raises(SpecFileError) as info:
        spec_from_yaml(text, source)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{source}: "), message
    assert info.value.source == source and message == f"{source}: {info.value.problem}"
    return message


def quickly_refused(text: str) -> str:
    """``refused``, with the work it did before refusing bounded by the spec's caps, whatever the
    input's size: at most MAX_NODES + 1 values composed (a count, not a time: timings flake on a
    loaded machine)."""
    composed = 0
    compose = specfile._SpecLoader.compose_node

    def counted(loader, parent, index):
        nonlocal composed
        composed += 1
        return compose(loader, parent, index)

    with mock.patch.object(specfile._SpecLoader, "compose_node", counted):
        message = refused(text)
    assert composed <= specfile.MAX_NODES + 1, (composed, message)
    return message


# ----------------------------------------------------------------------------- bounded before validation
def test_alias_bomb_is_refused_at_once() -> None:
    assert len(ALIAS_BOMB.encode()) == 342
    assert (
        quickly_refused(ALIAS_BOMB) == "spec.yaml: line 3, column 9: aliases (*a) are not allowed in a spec: "
        "write the value out"
    )


def test_any_alias_is_refused_even_a_harmless_one() -> None:
    assert "aliases (*d) are not allowed" in refused("head_dim: &d 64\nhead_dim_v: *d\n")


@pytest.mark.parametrize(
    "text",
    [
        "[" * 60_000,
        "{a: " * 16_000,
        "a:\n" + "".join(" " * i + "- \n" for i in range(1, 300)),
        "".join(" " * i + f"k{i}:\n" for i in range(300)),
    ],
)
def test_deep_nesting_is_refused_at_once(text: str) -> None:
    assert len(text) <= MAX_SPEC_BYTES
    assert f"nested deeper than {MAX_DEPTH} levels" in quickly_refused(text)


def test_many_values_are_refused_at_once() -> None:
    assert "more than 2000 values" in quickly_refused("x: [" + "1," * 30_000 + "]\n")


def test_nesting_a_spec_needs_is_accepted() -> None:
    spec = spec_from_yaml(
        "aux: {bias: {dtype: float32, shape: [Hq, 16]}}\nscore_mod: {kind: expression, expr: 'score + bias[h, 0]'}\n"
    )
    assert spec.aux["bias"].shape == ("Hq", 16)


def test_oversized_text_and_file_are_refused_before_parsing(tmp_path: Path) -> None:
    text = "[" * 100_000  # today a 1,100-line RecursionError; now the size check comes first
    assert "larger than 64 KiB" in quickly_refused(text)
    big = tmp_path / "big.yaml"
    big.write_text("dtype: " + "x" * (1024 * 1024))
    with pytest.raises(SpecFileError, match=r"big\.yaml: larger than 64 KiB"):
        load_spec(big)


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_size_limit_is_checked_before_reading_everything() -> None:
    with pytest.raises(SpecFileError, match="larger than 64 KiB"):
        load_spec("/dev/zero")  # endless: reading it all would never return


def test_long_values_are_cut_in_messages() -> None:
    message = refused("dtype: " + "x" * 60_000 + "\n")
    assert len(message) < 200 and "xxx..." in message and "allowed are bfloat16" in message
    message = refused("mask: {kind: expression, expr: '" + "q_idx + " * 6_000 + "'}\n")
    assert len(message) <= len("spec.yaml: ") + MAX_PROBLEM


def test_long_integers_are_refused_plainly() -> None:
    assert "has 5000 characters: too long" in refused("head_dim: " + "9" * 5000 + "\n")


# ----------------------------------------------------------------------------- strict
@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n", "null\n", "~\n"])
def test_empty_spec_file_is_an_error(text: str, tmp_path: Path) -> None:
    assert refused(text).endswith(EMPTY_MESSAGE)
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(SpecFileError, match=f"^{path}: empty spec file"):
        load_spec(path)


def test_explicit_empty_mapping_is_the_default_spec() -> None:
    assert dump_spec(AttentionSpec()) == "{}\n"
    assert spec_from_yaml("{}\n") == AttentionSpec()


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("head_dim: 64\nhead_dim: 128\n", "line 2, column 1: duplicate key 'head_dim'"),
        ("aux: {bias: {dtype: float32, shape: [1], dtype: int32}}\n", "line 1, column 42: duplicate key 'dtype'"),
        ("mask:\n  kind: chunked\n  size: 4\n  size: 8\n", "line 4, column 3: duplicate key 'size'"),
        ("scalars: {a: float32, a: int32}\n", "duplicate key 'a'"),
    ],
)
def test_duplicate_keys_are_refused_at_every_level(text: str, where: str) -> None:
    assert where in refused(text)


def test_merge_keys_are_refused() -> None:
    assert "merge keys (<<) are not allowed" in refused("<<: {head_dim: 64}\ncausal: true\n")


@pytest.mark.parametrize(
    ("text", "tag"),
    [
        ("head_dim: !!int 64\n", "!!int"),
        ("head_dim: !!int\n", "!!int"),
        ("x: !!binary aGk=\n", "!!binary"),
        ("!!set {a}\n", "!!set"),
        ("head_dim: !custom 64\n", "!custom"),
        ("!!python/object/apply:os.system ['true']\n", "!!python/object/apply"),
    ],
)
def test_explicit_tags_are_refused(text: str, tag: str) -> None:
    assert f"tags ({tag}" in refused(text)


@pytest.mark.parametrize(
    ("text", "field", "wanted"),
    [
        ("head_dim: true\n", "head_dim", "an integer"),
        ("window_left: off\n", "window_left", "an integer"),  # YAML 1.1: off is false, which pydantic reads as 0
        ("qhead_per_kvhead: yes\n", "qhead_per_kvhead", "an integer"),
        ("softcap: true\n", "softcap", "a number"),
        ("mask: {kind: chunked, size: true}\n", "mask.size", "an integer"),
        ("mask: {kind: sliding_window, left: no}\n", "mask.left", "an integer"),
        ("score_mod: {kind: relative_bias, max_distance: on}\n", "score_mod.max_distance", "an integer"),
        ("aux: {bias: {dtype: float32, shape: [16, true]}}\n", "aux.bias.shape.1", "an integer"),
    ],
)
def test_booleans_are_not_numbers(text: str, field: str, wanted: str) -> None:
    message = refused(text)
    assert f"spec.yaml: {field}: got a boolean" in message and message.endswith(f"allowed: {wanted}")
    assert "=1" not in message


def test_booleans_where_booleans_belong() -> None:
    assert spec_from_yaml("causal: yes\nsinks: on\nreturn_lse: true\n") == AttentionSpec(
        causal=True, sinks=True, return_lse=True
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "head_dim: [64\n",
            "spec.yaml: line 2, column 1: expected ',' or ']', but got '<stream end>' "
            "(while parsing a flow sequence from line 1)",
        ),
        ("head_dim: 64\x00\n", "spec.yaml: line 1: character #x0000 is not allowed in YAML"),
        ("a: 1\n---\nb: 2\n", "but found another document"),
        ("- head_dim: 64\n", "spec.yaml: a spec must be a mapping of fields (e.g. head_dim: 128), got list"),
        ("head_dim: 2001-13-45\n", "spec.yaml: cannot read a value: month must be in 1..12"),
    ],
)
def test_yaml_errors_are_one_line(text: str, expected: str) -> None:
    assert expected in refused(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("head_dim: 100\n", "spec.yaml: head_dim=100 is not supported: allowed are multiples of 8 from 8 to 256"),
        (
            "head_dim: 3\nwindow_left: -1\nsoftcap: 0\n",
            "head_dim=3 is not supported: allowed are multiples of 8 from 8 to 256 (and 2 more errors)",
        ),
        (
            "head_dim: abc\n",
            "spec.yaml: head_dim: Input should be a valid integer, unable to parse string as an integer (got 'abc')",
        ),
        (
            "head_dimm: 64\n",
            "spec.yaml: head_dimm: unknown field; allowed: aux, causal, deterministic, dtype, head_dim,",
        ),
        (
            "mask: {kind: chunked, size: 4, sizee: 3}\n",
            "spec.yaml: mask.chunked.sizee: unknown field; allowed: kind, size",
        ),
        (
            "aux: {b: {dtype: float32, shape: [1], x: 1}}\n",
            "spec.yaml: aux.b.x: unknown field; allowed: dtype, requires_grad, shape",
        ),
        ("causal: true\nwindow_right: 5\n", "spec.yaml: window_right=5 conflicts with causal=true"),
    ],
)
def test_validation_errors_are_one_line_with_a_count(text: str, expected: str) -> None:
    assert expected in refused(text)


# ----------------------------------------------------------------------------- files
def test_every_file_error_names_the_file(tmp_path: Path) -> None:
    binary = tmp_path / "latin1.yaml"
    binary.write_bytes("head_dim: 64\n# caf\u00e9\n".encode("latin-1"))
    with pytest.raises(SpecFileError, match=rf"^{binary}: not UTF-8 text: byte 0xe9 on line 2$"):
        load_spec(binary)
    with pytest.raises(SpecFileError, match=rf"^{tmp_path / 'missing.yaml'}: No such file or directory$"):
        load_spec(tmp_path / "missing.yaml")
    with pytest.raises(SpecFileError, match=rf"^{tmp_path}: Is a directory$"):
        load_spec(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("head_dim: 100\n")
    with pytest.raises(SpecFileError, match=rf"^{bad}: head_dim=100"):
        load_spec(str(bad))


def test_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbfhead_dim: 64\n")
    assert load_spec(path) == AttentionSpec(head_dim=64)


def test_spec_file_error_is_a_value_error() -> None:
    assert issubclass(SpecFileError, ValueError)
    assert str(SpecFileError("x.yaml", "first line\nsecond line")) == "x.yaml: first line"


# ----------------------------------------------------------------------------- fuzzing
YAML_PIECES = [
    "head_dim",
    "head_dim_v",
    "causal",
    "mask",
    "kind",
    "expression",
    "expr",
    "scalars",
    "aux",
    "shape",
    "dtype",
    "softcap",
    "window_left",
    "sliding_window",
    "chunked",
    "size",
    "left",
    ": ",
    ":",
    "\n",
    "  ",
    "- ",
    "[",
    "]",
    "{",
    "}",
    ", ",
    "&a ",
    "*a",
    "<<: ",
    "!!python/name:os.system ",
    "!!binary ",
    "!!set ",
    "!!int ",
    "!!float ",
    "!!timestamp ",
    "!!omap ",
    "!!str ",
    "? ",
    "|\n",
    ">\n",
    "# ",
    "'",
    '"',
    "\\",
    "\t",
    "---\n",
    "...\n",
    "%YAML 1.1\n",
    "true",
    "yes",
    "off",
    "null",
    "~",
    "64",
    "128",
    "1e999",
    ".inf",
    ".nan",
    "-8",
    "0x40",
    "0o17",
    "1:30",
    "2001-12-14",
    "bf16",
    "float32",
    "B",
    "Hq",
    "q_idx >= kv_idx",
    "score * 2",
    "\x00",
    "\ufeff",
    "\u2028",
    "\u00e9",
    "9" * 50,
]
yamlish = st.lists(st.sampled_from(YAML_PIECES) | st.text(max_size=4), max_size=40).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(yamlish)
@example(ALIAS_BOMB)
@example("head_dim: 64\nmask: {kind: chunked, size: 8}\n")
@example("!!set {? [1]: }")
@example("x: !!timestamp 2001-01-01 00:00:00 +99:00")
def test_fuzz_yaml_text_gives_a_spec_or_one_spec_file_error(text: str) -> None:
    try:
        spec = spec_from_yaml(text, "fuzz.yaml")
    except SpecFileError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("fuzz.yaml: ")
        assert len(exc.problem) <= MAX_PROBLEM
        return
    assert isinstance(spec, AttentionSpec)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200) | yamlish.map(lambda text: text.encode("utf-8", "surrogatepass")))
def test_fuzz_file_bytes_give_a_spec_or_one_spec_file_error(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "fuzz.yaml"
        path.write_bytes(data)
        try:
            assert isinstance(load_spec(path), AttentionSpec)
        except SpecFileError as exc:
            assert "\n" not in str(exc) and str(exc).startswith(f"{path}: ")
