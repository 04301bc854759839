"""Hostile spec files: nothing a spec says may run as code, and every refusal is one clear line.

Each accepted spec is emitted and its module imported (as the compiler does) with a payload that
would create a file if any of the user's text reached the module as code; one is taken through
the real `fa4gen compile` CLI into a fresh cache. Hypothesis adds any comment text to valid
expressions: the comment never reaches the generated source.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa4gen.compiler import import_source
from fa4gen.emitter import emit
from fa4gen.expr import AuxTensor, ExpressionError, parse, render_text
from fa4gen.planner import plan
from fa4gen.spec import AttentionSpec
from fa4gen.specfile import spec_from_yaml

ROOT = Path(__file__).resolve().parent.parent
SENTINEL = "FA4GEN_PWNED_SENTINEL"


def _payload(path: Path) -> str:
    return f'str(__import__("os").system("touch {path}"))'


def _breakouts(path: Path) -> list[str]:
    """Comment texts that break out of a docstring, a comment or a string literal if pasted raw."""
    code = _payload(path)
    return [
        f'""" + {code} + """',
        f"''' + {code} + '''",
        f'" + {code} + "',
        f"\\ {SENTINEL} \\",  # a backslash does nothing in a comment; in a docstring it escapes
        f"\\N{{BULLET}} {SENTINEL}",
        f"\u2028{code}",  # a line break to str.splitlines, not to Python
        f"\u0085{code}",
        f"{SENTINEL} " + "x" * 1500,
        f"ｑ_idx ｂ {SENTINEL}",  # look-alike letters are fine inside a comment
    ]


def _accepted_specs(path: Path) -> list[AttentionSpec]:
    specs = []
    for comment in _breakouts(path):
        specs.append(AttentionSpec(mask={"kind": "expression", "expr": f"q_idx >= kv_idx  # {comment}"}))
        specs.append(AttentionSpec(score_mod={"kind": "expression", "expr": f"score * 0.5  # {comment}"}))
    specs.append(
        AttentionSpec(
            aux={"bias": {"dtype": "float32", "shape": [16]}},
            score_mod={"kind": "expression", "expr": f"score + bias[15]  # {_breakouts(path)[0]}"},
        )
    )
    return specs


def test_accepted_hostile_comments_never_reach_the_module(tmp_path, monkeypatch):
    target = tmp_path / "PWNED"
    monkeypatch.syspath_prepend(str(tmp_path))
    for index, spec in enumerate(_accepted_specs(target)):
        text = spec.mask.expr if spec.mask is not None else spec.score_mod.expr
        assert "#" not in text and SENTINEL not in text and "import" not in text
        emitted = emit(spec, plan(spec, "sm_90a"), module_name=f"fa4gen_hostile_{index}")
        assert emitted.source.isascii()
        assert str(target) not in emitted.source and SENTINEL not in emitted.source
        source = tmp_path / f"fa4gen_hostile_{index}.py"
        source.write_text(emitted.source)
        module = import_source(source, f"fa4gen_hostile_{index}")
        assert callable(module.make_kernel)
        assert not target.exists(), f"spec {index} ran code: {text!r}"


def _rejected_cases() -> list[tuple[str, dict, str]]:
    """(label, spec fields, words the one-line reason holds)."""
    bias16 = {"bias": {"dtype": "float32", "shape": [16]}}
    return [
        ("nul", {"mask": {"kind": "expression", "expr": "q_idx >= kv_idx\x00"}}, "control character U+0000"),
        ("escape", {"mask": {"kind": "expression", "expr": "q_idx >= kv_idx\x1b[2J"}}, "control character U+001B"),
        ("fullwidth name", {"mask": {"kind": "expression", "expr": "ｑ_idx >= kv_idx"}}, "non-ASCII character"),
        ("cyrillic name", {"score_mod": {"kind": "expression", "expr": "score + kv_іdx"}}, "non-ASCII character"),
        ("string literal", {"score_mod": {"kind": "expression", "expr": 'score + len("""x""")'}}, "unknown function"),
        ("str constant", {"mask": {"kind": "expression", "expr": '"""x"""'}}, "literal"),
        ("attribute", {"mask": {"kind": "expression", "expr": "q_idx.__class__ == 1"}}, "Attribute"),
        ("lambda", {"score_mod": {"kind": "expression", "expr": "(lambda: score)()"}}, "where, min"),
        (
            "code after a comment",
            {"mask": {"kind": "expression", "expr": "q_idx >= kv_idx # x\\\n__import__('os')"}},
            "not a valid expression",
        ),
        (
            "carriage return",
            {"mask": {"kind": "expression", "expr": "q_idx >= kv_idx # x\r__import__('os')"}},
            "not a valid expression",
        ),
        ("too long", {"score_mod": {"kind": "expression", "expr": "score  # " + "x" * 5000}}, "longer than 2000"),
        (
            "fullwidth aux",
            {
                "aux": {"bias": bias16["bias"], "ｂias": {"dtype": "float32", "shape": [16]}},
                "score_mod": {"kind": "expression", "expr": "score + bias[0]"},
            },
            "Python reads it as 'bias'",
        ),
        (
            "fullwidth scalar",
            {"scalars": {"ｂ": "float32"}, "score_mod": {"kind": "expression", "expr": "score + b"}},
            "Python reads it as 'b'",
        ),
        ("keyword scalar", {"scalars": {"class": "float32"}}, "not a Python keyword"),
        ("dunder aux", {"aux": {"__class__": bias16["bias"]}}, "does not start with _"),
        (
            "index past dim",
            {"aux": bias16, "score_mod": {"kind": "expression", "expr": "score + bias[100]"}},
            "index 100 of bias (dim 0) is out of range: the dim has size 16",
        ),
        (
            "negative index",
            {"aux": bias16, "score_mod": {"kind": "expression", "expr": "score + bias[-5]"}},
            "index -5 of bias (dim 0) is negative",
        ),
        (
            "folded index",
            {"aux": bias16, "score_mod": {"kind": "expression", "expr": "score + bias[4 * 4]"}},
            "index 16 of bias (dim 0) is out of range",
        ),
    ]


@pytest.mark.parametrize("label,fields,words", _rejected_cases(), ids=[c[0] for c in _rejected_cases()])
def test_rejected_hostile_specs_say_why_in_one_place(label, fields, words, tmp_path):
    with pytest.raises(ValueError) as info:
        spec_from_yaml(yaml.safe_dump(fields, allow_unicode=True))
    message = str(info.value)
    assert words in message
    assert "Traceback" not in message and "SyntaxError" not in message


def test_the_issue_yaml_compiles_through_the_cli_without_running_anything(tmp_path):
    """The spec file of issue 31, end to end: cross-compiled into a fresh cache, nothing ran."""
    target = tmp_path / "PWNED"
    path = tmp_path / "hostile.yaml"
    path.write_text(
        f'head_dim: 128\nmask: {{kind: expression, expr: \'q_idx >= kv_idx  # """ + {_payload(target)} + """\'}}\n'
    )
    env = {**os.environ, "FA4GEN_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "fa4gen.cli", "compile", str(path), "--arch", "sm_90a"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not target.exists()
    kernels = list((tmp_path / "cache").rglob("kernel.py"))
    assert kernels and all("__import__" not in k.read_text() for k in kernels)


_ATOMS = st.sampled_from(["score", "q_idx", "kv_idx", "h", "b", "seqlen_q", "2", "0.5", "bias[h]"])


@st.composite
def _number_text(draw, depth=0):
    if depth > 3 or draw(st.booleans()):
        return draw(_ATOMS)
    op = draw(st.sampled_from(["+", "-", "*", "/", "min", "max", "where", "neg"]))
    left, right = draw(_number_text(depth + 1)), draw(_number_text(depth + 1))
    if op in ("min", "max"):
        return f"{op}({left}, {right})"
    if op == "where":
        return f"where({left} < {right}, {left}, {right})"
    if op == "neg":
        return f"-({left})"
    return f"({left}) {op} ({right})"


AUX = {"bias": AuxTensor("float", 1, (None,))}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_number_text(), st.text(max_size=80))
def test_any_comment_is_dropped_or_refused_and_canonical_text_is_a_fixed_point(body, comment):
    base = parse(body, aux=AUX)
    try:
        commented = parse(f"{body}  # {comment}", aux=AUX)
    except ExpressionError as exc:
        assert "\n" not in exc.reason
        return
    assert commented.root == base.root
    assert commented.text == base.text == render_text(base.root)
    assert commented.text.isascii() and "#" not in commented.text
    assert parse(commented.text, aux=AUX).root == base.root  # re-parsing the canonical text gives the tree


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_any_text_parses_to_safe_canonical_text_or_a_clean_error(text):
    try:
        expr = parse(text, aux=AUX)
    except ExpressionError:
        return
    assert expr.text.isascii() and "#" not in expr.text and '"' not in expr.text and "\\" not in expr.text
    assert parse(expr.text, aux=AUX).root == expr.root
