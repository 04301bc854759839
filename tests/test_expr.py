"""The expression language: accepted expressions (typed, evaluated with torch against
hand-written references), rejected ones (hostile inputs included) with errors that point at the
offending part, and the CuTe DSL rendering cross-compiled for sm_90a."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fa4gen.expr import AuxTensor, ExpressionError, evaluate_torch, parse, render_cute

SQ, SK = 7, 11
Q = torch.arange(SQ).view(-1, 1)
K = torch.arange(SK).view(1, -1)
SCORE = torch.randn(SQ, SK, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
SLOPES = torch.tensor([0.5, 0.25, 0.125])
BIAS = torch.randn(3, 2 * SK + 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
ENV = {"score": SCORE, "b": 0, "h": 2, "q_idx": Q, "kv_idx": K, "slope": SLOPES, "bias": BIAS, "window": 3, "cap": 20.0}
AUX = {"slope": AuxTensor("float", 1), "bias": AuxTensor("float", 2)}
SCALARS = {"window": "int", "cap": "float"}


def _parse(text, **kw):
    return parse(text, scalars=SCALARS, aux=AUX, **kw)


ACCEPTED = [
    ("score - slope[h] * abs(q_idx - kv_idx)", "float", SCORE - SLOPES[2] * (Q - K).abs()),
    ("cap * tanh(score / cap)", "float", 20.0 * torch.tanh(SCORE / 20.0)),
    ("score + bias[h, min(max(q_idx - kv_idx + 11, 0), 22)]", "float", SCORE + BIAS[2, (Q - K + 11).clamp(0, 22)]),
    ("where(kv_idx <= q_idx, score, score * 0.5)", "float", torch.where(K <= Q, SCORE, SCORE * 0.5)),
    ("exp2(score) + exp(-score) - log(2.0)", "float", torch.exp2(SCORE) + torch.exp(-SCORE) - math.log(2.0)),
    ("(q_idx // 4) == (kv_idx // 4) and kv_idx <= q_idx", "bool", ((Q // 4) == (K // 4)) & (K <= Q)),
    ("q_idx - window <= kv_idx <= q_idx", "bool", (Q - 3 <= K) & (K <= Q)),
    ("not (kv_idx > q_idx) or h == 0", "bool", ~(K > Q) | (torch.tensor(2) == 0)),
    ("True", "bool", torch.tensor(True)),
]


@pytest.mark.parametrize("text, kind, expected", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_accepted_expressions_evaluate_like_the_reference(text, kind, expected):
    expr = _parse(text, result="condition" if kind == "bool" else "number")
    assert expr.root.type == kind
    got = evaluate_torch(expr, ENV)
    assert torch.equal(got, expected) if kind == "bool" else torch.allclose(got.double(), expected.double())


REJECTED = [
    ("__import__('os').system('echo hi')", "can be called"),
    ("score.__class__", "Attribute is not allowed"),
    ("(lambda: 1)()", "only where, min, max"),
    ("[s for s in score]", "ListComp is not allowed"),
    ("'text'", "literal 'text' is not allowed"),
    ("open('f')", "unknown function 'open'"),
    ("exec('1')", "unknown function 'exec'"),
    ("score ** 2", "operator Pow is not allowed"),
    ("score if q_idx else 0.0", "IfExp is not allowed"),
    ("(x := 1)", "NamedExpr is not allowed"),
    ("f'{score}'", "JoinedStr is not allowed"),
    ("score[0]", "only declared aux tensors can be indexed"),
    ("slope", "must be indexed"),
    ("slope[1.5]", "indices of slope must be integers"),
    ("slope[h, h]", "slope has 1 dim(s), indexed with 2"),
    ("where(score, 1.0, 2.0)", "expected a condition"),
    ("min(1)", "min() takes 2 argument(s), got 1"),
    ("exp(x=1.0)", "takes no keyword arguments"),
    ("1e400", "literal inf is not allowed"),
    ("q_idx // 2.0", "// needs integer operands"),
    ("True + score", "expected a number here"),
    ("secret * score", "unknown name 'secret'"),
    ("__builtins__", "name '__builtins__' is not allowed"),
    ("score +", "not a valid expression"),
    ("2**40 + 0", "operator Pow is not allowed"),
    ("4294967296 + score", "does not fit in int32"),
    ("abs(" * 60 + "score" + ")" * 60, "too large"),
    ("-" * 500 + "score", "too large"),
    ("1+" * 900 + "1", "too large"),
    ("score + " * 400 + "1.0", "longer than 2000 characters"),
    ("", "non-empty"),
]


@pytest.mark.parametrize("text, message", REJECTED, ids=[r[0][:40] for r in REJECTED])
def test_rejected_expressions_point_at_the_problem(text, message):
    with pytest.raises(ExpressionError) as info:
        _parse(text)
    assert message in str(info.value)


def test_error_caret_points_at_the_offending_node():
    with pytest.raises(ExpressionError) as info:
        _parse("score + slope[h] * q_idx.real")
    lines = str(info.value).splitlines()
    assert lines[-1].index("^") - 2 == len("score + slope[h] * ")


def test_result_kind_is_checked():
    with pytest.raises(ExpressionError, match="a mask must be a condition"):
        _parse("score * 2.0", result="condition")
    with pytest.raises(ExpressionError, match="a score modifier must be a number"):
        _parse("kv_idx <= q_idx")
    with pytest.raises(ExpressionError, match="unknown name 'score'"):
        parse("score > 0.0", score=False, result="condition")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="scoreqidxkvh_[](),.+-*/<=>! 0123456789aiwtl'", max_size=60))
def test_any_text_is_accepted_or_rejected_cleanly(text):
    try:
        _parse(text)
    except ExpressionError:
        pass


def _compile_rendered(tmp_path, functions: dict[str, str]):
    """Write the rendered expressions into a real module of @cute.jit functions, apply them in a
    small kernel and cross-compile it for sm_90a (no GPU needed)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    lines = ["import cutlass", "import cutlass.cute as cute", "from cutlass import Float32, Int32", ""]
    for name, body in functions.items():
        lines += ["@cute.jit", f"def {name}(score, b, h, q_idx, kv_idx, slope, cap):", f"    return {body}", ""]
    lines += [
        "@cute.kernel",
        "def apply(out: cute.Tensor, slope: cute.Tensor):",
        "    tidx, _, _ = cute.arch.thread_idx()",
        "    q_idx = Int32(tidx // 8); kv_idx = Int32(tidx % 8); s = Float32(tidx) * Float32(0.01)",
    ]
    for i, name in enumerate(functions):
        lines.append(
            f"    out[tidx, {i}] = Float32({name}(s, Int32(0), Int32(1), q_idx, kv_idx, slope, Float32(20.0)))"
        )
    lines += [
        "",
        "@cute.jit",
        "def launch(out: cute.Tensor, slope: cute.Tensor):",
        "    apply(out, slope).launch(grid=(1, 1, 1), block=(64, 1, 1))",
        "",
    ]
    path = tmp_path / "rendered_module.py"
    path.write_text("\n".join(lines))
    spec = importlib.util.spec_from_file_location("rendered_module", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["rendered_module"] = module
    spec.loader.exec_module(module)
    import cutlass

    out = make_fake_compact_tensor(cutlass.Float32, (64, len(functions)), stride_order=(1, 0))
    slope = make_fake_compact_tensor(cutlass.Float32, (4,))
    return cute.compile(module.launch, out, slope, options="--gpu-arch sm_90a")


@pytest.mark.slow
def test_rendered_cute_code_cross_compiles(tmp_path):
    aux = {"slope": AuxTensor("float", 1)}
    texts = {
        "alibi": "score - slope[h] * abs(q_idx - kv_idx)",
        "softcap": "cap * tanh(score / cap)",
        "causal_or_local": "where(kv_idx <= q_idx and q_idx - kv_idx < 4, score, score - 1000.0)",
        "mixed": "max(min(score, 2.0), -2.0) + exp2(score) * (q_idx // 2)",
        "divided": "where(kv_idx / 3 <= q_idx / 3, score / cap, score)",
    }
    rendered = {name: render_cute(parse(text, scalars={"cap": "float"}, aux=aux)) for name, text in texts.items()}
    assert "cute.math.tanh" in rendered["softcap"] and "cutlass.select_" in rendered["causal_or_local"]
    assert _compile_rendered(tmp_path, rendered) is not None


@pytest.mark.parametrize(
    "text, straight_line, ieee",
    [
        ("score / cap", 1, 0),
        ("score + (kv_idx - q_idx) / seqlen_k", 1, 0),
        ("kv_idx / 3 <= 2", 0, 1),  # a mask's decision at an exact quotient stays the reference's
        ("where(kv_idx / 3 <= q_idx / 3, score / cap, score)", 1, 2),
    ],
)
def test_divisions_render_straight_line_except_under_comparisons(text, straight_line, ieee):
    """Decision expression-division: div.full.f32 (no slow-path call) for values, IEEE division
    where the quotient is compared."""
    condition = "<=" in text and not text.startswith("where")
    source = render_cute(parse(text, scalars={"cap": "float"}, result="condition" if condition else "number"))
    assert source.count("full=True") == straight_line
    assert source.count(") / Float32(") == ieee
