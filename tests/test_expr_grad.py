"""Symbolic derivatives of expressions (fa4gen.expr_grad): golden derivatives, torch's conventions at
non-differentiable points, rejected cases, and, over random expressions, the derivatives against
torch.autograd of the PyTorch rendering and the simplifier against the unsimplified tree."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from fa4gen.expr import AuxTensor, Expression, ExpressionError, evaluate_torch, parse, render_cute, render_text
from fa4gen.expr_grad import (
    MAX_DERIVATIVE_NODES,
    AuxGradient,
    accumulate_aux_gradient,
    aux_gradient,
    check_differentiable,
    derivative,
    simplify,
)

B, H, SQ, SK = 2, 3, 4, 5
SHAPE = (B, H, SQ, SK)
AUX = {
    "slope": AuxTensor("float", 1, (H,)),
    "bias": AuxTensor("float", 2, (H, 17)),
    "ids": AuxTensor("int", 1, (SK,)),
}
SCALARS = {"cap": "float", "window": "int"}
FLOAT_LEAVES = ("score", "cap", "slope", "bias")  # what gets requires_grad


@pytest.fixture(autouse=True)
def float64_literals():
    """evaluate_torch makes literals with torch.tensor(x): in float64 they match autograd exactly."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _parse(text, **kw):
    return parse(text, scalars=SCALARS, aux=AUX, **kw)


def _env(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    env = {
        "score": torch.empty(SHAPE, dtype=torch.float64).uniform_(-3, 3, generator=gen),
        "cap": torch.tensor(1.75, dtype=torch.float64),
        "slope": torch.rand(H, generator=gen, dtype=torch.float64) + 0.1,
        "bias": torch.randn(H, 17, generator=gen, dtype=torch.float64),
    }
    env = {name: value.clone().requires_grad_(True) for name, value in env.items()}
    env.update(
        b=torch.arange(B).view(-1, 1, 1, 1),
        h=torch.arange(H).view(1, -1, 1, 1),
        q_idx=torch.arange(SQ).view(1, 1, -1, 1),
        kv_idx=torch.arange(SK).view(1, 1, 1, -1),
        seqlen_q=SQ,
        seqlen_k=SK,
        window=2,
        ids=torch.randint(0, 17, (SK,), generator=gen),
    )
    return env


# ----------------------------------------------------------------------------- golden derivatives
GOLDEN = [
    ("30 * tanh(score / 30)", "1.0 - tanh(score / 30) * tanh(score / 30)", ["cute.math.tanh"]),
    ("score - slope[h] * abs(q_idx - kv_idx)", "1.0", []),
    ("score * 0.5 + slope[h]", "0.5", []),
    ("score + bias[h, min(max(q_idx - kv_idx + 8, 0), 16)]", "1.0", []),
    ("where(kv_idx > q_idx - 100, score, score * 0.5)", "where(kv_idx > q_idx - 100, 1.0, 0.5)", ["cutlass.select_"]),
    (
        "exp(score) / (1 + exp(score))",
        "exp(score) / (1 + exp(score)) - exp(score) * exp(score) / ((1 + exp(score)) * (1 + exp(score)))",
        ["cute.math.exp"],
    ),
    ("max(score, -5.0)", "where(score > -5.0, 1.0, where(score < -5.0, 0.0, 0.5))", ["cutlass.select_"]),
    ("log(1 + score * score)", "2 * score / (1 + score * score)", ["cute.math.div("]),
    ("exp2(score) - 1.0", "0.6931471805599453 * exp2(score)", ["cute.math.exp2"]),
    ("abs(score)", "where(score > 0.0, 1.0, where(score < 0.0, -1.0, 0.0))", ["cutlass.select_"]),
    ("cap * tanh(score / cap)", "1.0 - tanh(score / cap) * tanh(score / cap)", ["cute.math.tanh"]),
    ("score * q_idx", "1.0 * q_idx", ["Float32(q_idx)"]),  # an int factor: the derivative stays float
    ("score / 10", "1.0 / 10", []),  # a divisor folds only where exact: 0.1 is not
    ("-(-score)", "1.0", []),
    ("q_idx - kv_idx", "0.0", []),
]


@pytest.mark.parametrize("text, expected, cute_calls", GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_score_derivatives(text, expected, cute_calls):
    grad = derivative(_parse(text), "score")
    assert grad.text == expected
    assert grad.root.type == "float"
    assert _parse(grad.text).root == grad.root  # the canonical text parses back into the same tree
    assert simplify(grad.root) == grad.root
    source = render_cute(grad)
    for call in cute_calls:
        assert call in source


AUX_GOLDEN = [
    ("score - slope[h] * abs(q_idx - kv_idx)", "slope", [(("h",), "-1.0 * abs(q_idx - kv_idx)")]),
    (
        "score + bias[h, min(max(q_idx - kv_idx + 8, 0), 16)]",
        "bias",
        [(("h", "min(max(q_idx - kv_idx + 8, 0), 16)"), "1.0")],
    ),
    (
        "bias[h, 0] * bias[h, 0] + bias[h, 1] * score + bias[h, ids[kv_idx]]",
        "bias",
        [(("h", "0"), "2 * bias[h, 0]"), (("h", "1"), "score"), (("h", "ids[kv_idx]"), "1.0")],
    ),
    ("where(bias[h, 0] > 0.0, score, 0.0)", "bias", []),  # read only inside a condition: no gradient
    ("score", "bias", []),
]


@pytest.mark.parametrize("text, name, reads", AUX_GOLDEN, ids=[g[0] for g in AUX_GOLDEN])
def test_golden_aux_gradients(text, name, reads):
    grad = aux_gradient(_parse(text), name)
    assert grad.name == name
    got = [(tuple(index.text for index in read.indices), read.derivative.text) for read in grad.reads]
    assert got == reads
    for read in grad.reads:  # kernel source for each read renders (the kernels come later)
        assert render_cute(read.derivative) and all(render_cute(index) for index in read.indices)


def test_scalar_derivative_and_its_cute_source():
    grad = derivative(_parse("cap * tanh(score / cap)"), "cap")
    assert grad.text == "tanh(score / cap) - (1.0 - tanh(score / cap) * tanh(score / cap)) * score / cap"
    source = render_cute(grad, {"cap": "softcap"})
    assert "cute.math.tanh" in source and "Float32(softcap)" in source
    assert grad.uses == {"score", "cap"}


# ----------------------------------------------------------------------------- torch's conventions
def _torch_grad(text: str, points: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    score = torch.tensor(points, dtype=torch.float64, requires_grad=True)
    env = {"score": score, "q_idx": 0, "kv_idx": 0, "h": 0, "b": 0}
    expr = parse(text)
    (expected,) = torch.autograd.grad(evaluate_torch(expr, env).sum(), score)
    got = evaluate_torch(derivative(expr, "score"), env).expand_as(score)
    return got, expected


@pytest.mark.parametrize(
    "text, points, expected",
    [
        ("max(score, -5.0)", [-5.0, -6.0, -4.0], [0.5, 0.0, 1.0]),  # a tie splits evenly
        ("min(score, 1.0)", [1.0, 0.0, 2.0], [0.5, 1.0, 0.0]),
        ("max(score, 2.0 * score)", [0.0, 1.0, -1.0], [1.5, 2.0, 1.0]),  # 0.5 * 1 + 0.5 * 2 at the tie
        ("min(score, score)", [0.0, 3.0], [1.0, 1.0]),
        ("abs(score)", [0.0, -2.0, 2.0], [0.0, -1.0, 1.0]),  # sign(0) = 0
        ("abs(score - 1.0)", [1.0], [0.0]),
        ("where(score > 0.0, score * score, -score)", [0.0, 2.0, -2.0], [-1.0, 4.0, -1.0]),  # the branch taken
        ("log(score)", [0.0, 2.0], [float("inf"), 0.5]),
        ("score / (score - 1.0)", [1.0], [float("nan")]),
    ],
)
def test_non_differentiable_points_follow_torch(text, points, expected):
    got, torch_grad = _torch_grad(text, points)
    want = torch.tensor(expected, dtype=torch.float64)
    assert torch.allclose(torch_grad, want, equal_nan=True)
    assert torch.allclose(got, want, equal_nan=True)


def test_untaken_branch_gives_no_nan_where_torch_does():
    """torch.where's backward multiplies the untaken branch's infinite derivative by 0 (NaN);
    the symbolic derivative takes the branch's derivative only."""
    got, torch_grad = _torch_grad("where(score > 0.0, log(score), 0.0)", [0.0, 2.0])
    assert torch.isnan(torch_grad[0]) and torch_grad[1] == 0.5
    assert got.tolist() == [0.0, 0.5]


# ----------------------------------------------------------------------------- rejected
REJECTED = [
    ("score * h", "h", derivative, "cannot differentiate with respect to 'h': it is an integer", "score * "),
    ("score + window", "window", derivative, "it is an integer", "score + "),
    ("score + bias[h, ids[kv_idx]]", "ids", aux_gradient, "it is an int32 aux tensor", "score + bias[h, "),
    ("score + slope[h]", "slope", derivative, "'slope' is an aux tensor", "score + "),
    ("cap * score", "cap", aux_gradient, "'cap' is a variable, not an aux tensor", ""),
]


@pytest.mark.parametrize("text, wrt, function, message, before", REJECTED, ids=[r[0] for r in REJECTED])
def test_rejected_derivatives_point_at_the_part(text, wrt, function, message, before):
    with pytest.raises(ExpressionError) as info:
        function(_parse(text), wrt)
    assert message in str(info.value)
    assert str(info.value).splitlines()[-1].index("^") - 2 == len(before)


@pytest.mark.parametrize("text, wrt", [("score * h", "h"), ("score + window", "window"), ("bias[h, ids[0]]", "ids")])
def test_check_differentiable_rejects_integers(text, wrt):
    with pytest.raises(ExpressionError, match="only score, float32 scalars and float32 aux tensors"):
        check_differentiable(_parse(text), wrt)


def test_masks_and_huge_derivatives_are_rejected():
    with pytest.raises(ExpressionError, match="a condition"):
        derivative(_parse("score > 0.0", result="condition"), "score")
    # tanh' copies its argument twice: a chain of 30 around a 119-part sum makes ~8000 parts
    terms = [f"exp(score + {k}.0)" for k in range(24)]
    while len(terms) > 1:  # balanced, to stay within the parser's nesting limit
        terms = [f"({a} + {b})" for a, b in zip(terms[::2], terms[1::2])] + terms[len(terms) // 2 * 2 :]
    text = terms[0]
    for _ in range(30):
        text = f"tanh({text})"
    with pytest.raises(ExpressionError, match=f"at most {MAX_DERIVATIVE_NODES}"):
        derivative(_parse(text), "score")
    clamp = "score"
    for k in range(30):  # nested clamps stay linear: each derivative is used once
        clamp = f"max({clamp}, {k}.0)"
    assert len(derivative(_parse(clamp), "score").text) < 20000


def test_shipped_score_modifiers_differentiate():
    """Every spec in specs/ with a score expression: its derivatives w.r.t. score and every float
    input it reads (the built-in ALiBi and relative bias included)."""
    from pathlib import Path

    import fa4gen
    from fa4gen.variants import lower

    found = {}
    for path in sorted(Path(__file__).resolve().parents[1].joinpath("specs").glob("*.yaml")):
        lowered = lower(fa4gen.load_spec(path))
        if lowered.score is None:
            continue
        float_inputs = [e.name for e in lowered.extras if e.dtype == "float32" and e.name in lowered.score.uses]
        found[path.stem] = [derivative(lowered.score, "score").text]
        for name in float_inputs:
            check_differentiable(lowered.score, name)
            if any(e.name == name and e.role == "scalar" for e in lowered.extras):
                found[path.stem].append(derivative(lowered.score, name).text)
            else:
                found[path.stem] += [read.derivative.text for read in aux_gradient(lowered.score, name).reads]
    assert found["alibi-mpt"] == ["1.0", "-1.0 * abs(q_idx + (seqlen_k - seqlen_q) - kv_idx)"]
    assert found["t5-relative-bias"] == ["1.0", "1.0"]
    assert found["expression-score"] == [
        "temperature[h]",
        "score",
        "-log(1.0 + abs(q_idx + (seqlen_k - seqlen_q) - kv_idx))",
    ]


def test_zero_upstream_adds_nothing_where_the_derivative_is_infinite():
    expr = _parse("bias[h, 0] / score")
    env = {"h": torch.tensor([0, 0]), "score": torch.tensor([0.0, 2.0]), "bias": torch.zeros(H, 17)}
    out = accumulate_aux_gradient(aux_gradient(expr, "bias"), env, torch.tensor([0.0, 1.0]), torch.zeros(H, 17))
    assert out[0, 0] == 0.5 and out.abs().sum() == 0.5


def test_unread_names_have_zero_derivative_and_checks_pass():
    expr = _parse("score * 2.0 + bias[h, 0]")
    assert derivative(expr, "cap").text == "0.0"
    assert aux_gradient(expr, "slope").reads == ()
    check_differentiable(expr, "score")
    check_differentiable(expr, "bias")


# ----------------------------------------------------------------------------- random expressions
_INT_LEAVES = ("b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k", "window", "ids[min(max(kv_idx, 0), 4)]")
_FLOAT_LITERALS = ("0.5", "2.0", "1.5", "3.0", "0.25", "30.0", "-1.5", "-0.5", "1")


def _clamp(index: str, top: int) -> str:
    return f"min(max({index}, 0), {top})"


@st.composite
def _ints(draw, depth: int) -> str:
    kind = draw(
        st.sampled_from(["leaf", "literal"] + ["bin", "floordiv", "neg", "abs", "minmax", "where"] * (depth > 0))
    )
    sub = _ints(depth - 1)
    if kind == "leaf":
        return draw(st.sampled_from(_INT_LEAVES))
    if kind == "literal":
        return str(draw(st.integers(0, 9)))
    if kind == "bin":
        return f"({draw(sub)} {draw(st.sampled_from(['+', '-', '*']))} {draw(sub)})"
    if kind == "floordiv":  # int // 0 raises in torch
        return f"({draw(sub)} // {draw(st.integers(1, 4))})"
    if kind in ("neg", "abs"):
        return f"(-{draw(sub)})" if kind == "neg" else f"abs({draw(sub)})"
    if kind == "minmax":
        return f"{draw(st.sampled_from(['min', 'max']))}({draw(sub)}, {draw(sub)})"
    return f"where({draw(_bools(depth - 1))}, {draw(sub)}, {draw(sub)})"


@st.composite
def _bools(draw, depth: int) -> str:
    kind = draw(st.sampled_from(["float", "float", "int"] + ["and", "or", "not"] * (depth > 0)))
    if kind in ("float", "int"):
        numbers = _floats(depth) if kind == "float" else _ints(depth)
        return f"({draw(numbers)} {draw(st.sampled_from(['<', '<=', '>', '>=', '==', '!=']))} {draw(numbers)})"
    if kind == "not":
        return f"(not {draw(_bools(depth - 1))})"
    return f"({draw(_bools(depth - 1))} {kind} {draw(_bools(depth - 1))})"


_FLOAT_KINDS = ["score", "score", "score", "cap", "literal", "slope", "bias", "int"]
_FLOAT_OPS = ["+", "-", "*", "/", "/", "neg", "exp", "exp2", "tanh", "abs", "log", "min", "max", "where"]


@st.composite
def _floats(draw, depth: int) -> str:
    """A random float expression of nesting at most ``depth`` (score drawn often, so most of them
    depend on it), as text for the parser."""
    kind = draw(st.sampled_from(_FLOAT_KINDS if depth == 0 else _FLOAT_KINDS[:3] + _FLOAT_OPS * 2))
    sub = _floats(depth - 1)
    index = _ints(min(depth, 1))
    if kind in ("score", "cap"):
        return kind
    if kind == "literal":
        return draw(st.sampled_from(_FLOAT_LITERALS))
    if kind == "slope":
        return f"slope[{_clamp(draw(index), H - 1)}]"
    if kind == "bias":
        return f"bias[{draw(st.sampled_from(['h', 'b']))}, {_clamp(draw(index), 16)}]"
    if kind == "int":
        return draw(_ints(0))
    if kind in ("+", "-", "*"):
        return f"({draw(sub)} {kind} {draw(sub)})"
    if kind in ("/", "log"):  # mostly kept away from 0 and negatives, so most points are finite
        shape = draw(st.sampled_from(["{}", "(1.0 + {0} * {0})", "(abs({}) + 0.5)"]))
        inner = shape.format(draw(sub))
        return f"({draw(sub)} / {inner})" if kind == "/" else f"log({inner})"
    if kind == "neg":
        return f"(-{draw(sub)})"
    if kind in ("exp", "exp2", "tanh", "abs"):
        return f"{kind}({draw(sub)})"
    if kind in ("min", "max"):
        return f"{kind}({draw(sub)}, {draw(sub)})"
    return f"where({draw(_bools(depth - 1))}, {draw(sub)}, {draw(sub)})"


def _close(got, want, scale, tol=1e-9) -> torch.Tensor:
    """Equal within float64 rounding: relative to the result, to ``scale`` (the sum of the
    magnitudes of the terms added) and to 1 (derivatives that cancel to 0: d(score / score) is 0
    here and about 1e-16 through autograd). Where ``want`` is not finite there is nothing to
    compare, and a value near the top of the float64 range may overflow in one order of
    multiplication and not in another."""
    near_overflow = ~torch.isfinite(got) & (want.abs() > 1e300)
    return ~torch.isfinite(want) | near_overflow | ((got - want).abs() <= tol * (scale + want.abs() + 1.0))


def _parse_drawn(text: str):
    try:
        return _parse(text)
    except ExpressionError as exc:  # a drawn expression may pass the parser's size limits
        assert "too large" in str(exc) or "longer than" in str(exc)
        assume(False)


def _autograd(expr, env, upstream) -> dict:
    out = evaluate_torch(expr, env)
    if not (out.is_floating_point() and out.requires_grad):
        return {name: torch.zeros_like(env[name]) for name in FLOAT_LEAVES}
    inputs = [env[name] for name in FLOAT_LEAVES]
    grads = torch.autograd.grad((out * upstream).sum(), inputs, allow_unused=True, materialize_grads=True)
    return dict(zip(FLOAT_LEAVES, grads))


def _defined(expr, env) -> torch.Tensor:
    """Where every float part of the expression is finite. Outside (log of a negative, overflow,
    even of a part that a division brings back to a finite value) whether a gradient is NaN, 0 or
    finite depends on how each backward formula happens to be written: nothing to compare."""
    defined = torch.ones(SHAPE, dtype=torch.bool)
    with torch.no_grad():
        for node in _nodes(expr.root):
            if node.type == "float":
                defined &= torch.isfinite(evaluate_torch(Expression(render_text(node), node, expr.uses), env))
    return defined


def _nodes(node):
    yield node
    for arg in node.args:
        yield from _nodes(arg)


def _symbolic(expr, env, upstream, defined):
    """The gradients from the symbolic derivatives: per element for score, summed for cap,
    scattered for the aux tensors; with the magnitudes of the terms each sum adds."""
    got, scale = {}, {}
    for name in ("score", "cap"):
        grad = derivative(expr, name)
        event(f"d/d{name} {'is 0' if grad.text == '0.0' else 'depends on the point'}")
        assert grad.root.type == "float"
        _check_reparses(grad)
        terms = torch.where(defined, upstream * evaluate_torch(grad, env).expand(SHAPE), 0.0)
        got[name], scale[name] = (terms, 0.0) if name == "score" else (terms.sum(), terms.abs().sum())
    for name in ("slope", "bias"):
        grad = aux_gradient(expr, name)
        event(f"{name}: {len(grad.reads)} read(s) with a gradient")
        got[name] = accumulate_aux_gradient(grad, env, upstream, torch.zeros_like(env[name]))
        scale[name] = torch.zeros_like(env[name])
        for read in grad.reads:  # the magnitudes, scattered alike
            weighted = torch.where(defined, (upstream * evaluate_torch(read.derivative, env)).abs(), 0.0)
            accumulate_aux_gradient(
                AuxGradient(name, (read._replace(derivative=_parse("1.0")),)), env, weighted, scale[name]
            )
    return got, scale


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_floats(3), st.integers(0, 2**16))
def test_derivatives_match_autograd(text, seed):
    expr = _parse_drawn(text)
    env = _env(seed)
    upstream = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    defined = _defined(expr, env)
    event(f"forward finite at {int(defined.float().mean() * 4)}/4 or more of the points")
    upstream = torch.where(defined, upstream, 0.0)
    want = _autograd(expr, env, upstream)
    # autograd of the simplified tree (an equal function) is an equally valid reference: where the
    # expression cancels (cap / cap), autograd's rounding noise times a large outer derivative
    # (exp(1 / score) near 0) is far from the exact 0 derived here, and the simplified tree has none
    simple = _autograd(Expression(render_text(simplify(expr.root)), simplify(expr.root), expr.uses), env, upstream)
    with torch.no_grad():
        got, scale = _symbolic(expr, env, upstream, defined)
        for name in FLOAT_LEAVES:
            direct = _close(got[name], want[name], scale[name])
            ok = direct | _close(got[name], simple[name], scale[name])
            assert ok.all(), (name, got[name][~ok], want[name][~ok], simple[name][~ok])
            if not direct.all():
                event(f"d/d{name} matches autograd of the simplified tree only")


def _check_reparses(grad) -> None:
    try:
        again = _parse(grad.text)
    except ExpressionError as exc:  # a derivative may pass the parser's size limits
        assert "too large" in str(exc) or "longer than" in str(exc)
        return
    assert again.root == grad.root


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_floats(3), st.integers(0, 2**16))
def test_simplify_keeps_values_and_types(text, seed):
    expr = _parse_drawn(text)
    simple = Expression(render_text(simplify(expr.root)), simplify(expr.root), expr.uses)
    assert simple.root.type == expr.root.type
    assert simplify(simple.root) == simple.root
    _check_reparses(simple)
    env = _env(seed)
    with torch.no_grad():
        before = evaluate_torch(expr, env).double().expand(SHAPE)
        after = evaluate_torch(simple, env).double().expand(SHAPE)
    # where a part is infinite or NaN, 0 * x -> 0 and the lost sign of a zero divisor may change it
    defined = _defined(expr, env)
    ok = ~defined | _close(after, before, 0.0, tol=1e-12)
    assert ok.all(), (expr.text, simple.text, before[~ok], after[~ok])
