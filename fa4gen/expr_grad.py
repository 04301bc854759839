"""Symbolic derivatives of score-modifier expressions, for the backward pass (issue 34).

The backward kernel turns dP into dS per (query, key) element; a score modifier ``f`` sits between
the scaled score and the softmax, so it needs ``df/dscore`` there, and for trainable inputs the
derivative with respect to each float scalar and each float aux element ``f`` reads. They are derived
here on the typed tree of :mod:`fa4gen.expr`, simplified, and returned as Expressions, so the
existing renderers give both the kernel code (``render_cute``) and the reference
(``evaluate_torch``) without a second implementation.

Rules, and where a function has no derivative PyTorch's autograd value is taken:

- ``+ - * /`` and ``-x``: the sum, product and quotient rules (``d(a / b) = da / b - a / (b * b) * db``,
  the form torch's div backward computes); ``exp``, ``exp2`` (times ln 2), ``log`` (``du / u``, so
  ``inf`` at 0 as torch), ``tanh`` (``1 - tanh(u) * tanh(u)``).
- ``abs(u)``: ``du`` where ``u > 0``, ``-du`` where ``u < 0``, and 0 at ``u == 0`` (torch.abs).
- ``min`` / ``max``: the derivative of the argument taken; at a tie half of each (torch.minimum /
  torch.maximum split the gradient evenly), written as weights ``where(a < b, 1.0, where(a > b, 0.0,
  0.5)) * da + ...`` so that each derivative appears once and nested clamps stay linear in size.
- ``where(c, a, b)``: ``where(c, da, db)``. Conditions (comparisons, and / or / not) are piecewise
  constant and have derivative 0 away from their boundaries, as in autograd.
- Int-typed subtrees (``//``, index arithmetic, int scalars, int aux reads) have derivative 0 (torch
  carries no gradient through integers), and so do aux indices: they are int by the language's types.

Where this deliberately differs from autograd: torch.where's backward multiplies the untaken
branch's derivative by 0, which is NaN where that derivative is infinite (``where(score > 0.0,
log(score), 0.0)`` at ``score == 0``); here the untaken branch contributes nothing. The simplifier
reads ``0 * x``, ``0 / x``, ``x - x`` and ``x * y / x`` as 0, 0, 0 and ``y`` also where ``x`` is 0,
infinite or NaN, and does not keep the sign of a zero: values differ only where a part of the
expression is infinite or NaN, i.e. outside its domain.

Rejected with an :class:`~fa4gen.expr.ExpressionError` (caret under the part): a condition (a mask
has no derivative); differentiating with respect to an integer (an index variable, an int32 scalar
or aux tensor); an aux tensor through :func:`derivative` or a variable through :func:`aux_gradient`;
a derivative of more than ``MAX_DERIVATIVE_NODES`` parts. Everything else the forward accepts
differentiates: a name the expression does not read has derivative 0.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping, NamedTuple

from fa4gen.expr import Expression, ExpressionError, Node, evaluate_torch, render_text

# the kernel renders the derivative inline per score element: bound its code like the forward's
MAX_DERIVATIVE_NODES = 4000
LN2 = math.log(2.0)
ZERO = Node("const", "float", 0.0)
ONE = Node("const", "float", 1.0)
HALF = Node("const", "float", 0.5)


class AuxRead(NamedTuple):
    """One distinct read ``name[indices]``: the backward adds ``dS * derivative`` at ``indices``."""

    indices: tuple[Expression, ...]
    derivative: Expression


@dataclass(frozen=True)
class AuxGradient:
    name: str
    reads: tuple[AuxRead, ...]  # reads whose derivative is not identically 0, in order of appearance


# ----------------------------------------------------------------------------- public API
def derivative(expr: Expression, wrt: str) -> Expression:
    """d expr / d ``wrt``, per element, for ``wrt`` = ``score`` or a float scalar (a scalar's
    gradient is this summed over the elements, weighted by dS)."""
    _check_target(expr, wrt, aux=False)
    return _finish(expr, _diff(expr.root, Node("var", "float", wrt)), repr(wrt))


def aux_gradient(expr: Expression, aux: str) -> AuxGradient:
    """The derivative of ``expr`` with respect to each distinct read of the float aux tensor ``aux``.
    Reads written alike read the same element and are merged; reads that differ but hit the same
    element at run time each contribute, so scatter-adding every read gives the gradient."""
    _check_target(expr, aux, aux=True)
    reads: list[Node] = []
    for node in _preorder(expr.root):
        if node.kind == "index" and node.value == aux and node not in reads:
            reads.append(node)
    out = []
    for read in reads:
        found = _diff(expr.root, read)
        if _value(found) != 0:
            indices = tuple(_expression(index) for index in read.args)
            out.append(AuxRead(indices, _finish(expr, found, render_text(read))))
    return AuxGradient(aux, tuple(out))


def check_differentiable(expr: Expression, wrt: str) -> None:
    """Raise ExpressionError where ``expr`` has no derivative the kernel can render with respect to
    ``wrt`` (``score``, a float scalar or a float aux tensor); return None otherwise."""
    if any(node.kind == "index" and node.value == wrt for node in _preorder(expr.root)):
        aux_gradient(expr, wrt)
    else:
        derivative(expr, wrt)


def accumulate_aux_gradient(grad: AuxGradient, env: Mapping[str, Any], upstream, out):
    """Reference scatter: ``out[indices] += upstream * derivative`` for every read (torch tensors
    broadcast as for ``evaluate_torch``; duplicates accumulate). Returns ``out``. An element whose
    upstream gradient is 0 adds nothing, even where the derivative is infinite or NaN there: masked
    keys (dS = 0) may sit where the modifier is undefined, and must not poison a whole table."""
    import torch

    for read in grad.reads:
        value = torch.where(upstream != 0, upstream * evaluate_torch(read.derivative, env), 0.0)
        indices = [evaluate_torch(index, env).long() for index in read.indices]
        *indices, value = torch.broadcast_tensors(*indices, value)
        out.index_put_(tuple(indices), value.to(out.dtype), accumulate=True)
    return out


def simplify(node: Node) -> Node:
    """Fold constants and drop neutral parts in the float-typed parts of a tree: x * 0, x * 1, x + 0,
    --x, constant factors gathered in front, like terms added, where(c, x, x) -> x. Int and
    bool subtrees are kept as written (they are the user's index arithmetic and conditions). The
    type never changes; values change only by rounding (and as the module docstring says for 0 * x)."""
    memo: dict[int, tuple[Node, Node]] = {}  # by identity: derivative trees share subtrees

    def walk(n: Node) -> Node:
        if id(n) in memo:
            return memo[id(n)][1]
        out = n if n.type != "float" else _simplify_top(dataclasses.replace(n, args=tuple(map(walk, n.args))))
        memo[id(n)] = (n, out)  # the key node is kept alive, so its id is not reused
        return out

    return walk(node)


# ----------------------------------------------------------------------------- checks
def _check_target(expr: Expression, wrt: str, *, aux: bool) -> None:
    if expr.root.type == "bool":
        raise ExpressionError(expr.text, None, "a condition (a mask) has no derivative")
    var = next((n for n in _preorder(expr.root) if n.kind == "var" and n.value == wrt), None)
    read = next((n for n in _preorder(expr.root) if n.kind == "index" and n.value == wrt), None)
    if aux and var is not None:
        raise _error(expr, var, f"{wrt!r} is a variable, not an aux tensor: use derivative()")
    if not aux and read is not None:
        raise _error(expr, read, f"{wrt!r} is an aux tensor, differentiated per element: use aux_gradient()")
    found = var or read
    if found is not None and found.type != "float":
        what = "an int32 aux tensor" if found is read else "an integer"
        raise _error(
            expr,
            found,
            f"cannot differentiate with respect to {wrt!r}: it is {what}; "
            "only score, float32 scalars and float32 aux tensors have gradients",
        )


def _finish(expr: Expression, root: Node, what: str) -> Expression:
    root = simplify(root)
    size = _size(root)
    if size > MAX_DERIVATIVE_NODES:
        raise ExpressionError(
            expr.text,
            None,
            f"the derivative with respect to {what} has {size} parts (at most {MAX_DERIVATIVE_NODES}): "
            "write the expression with fewer nested functions",
        )
    return _expression(root)


def _expression(root: Node) -> Expression:
    uses = {n.value for n in _preorder(root) if n.kind in ("var", "index")}
    return Expression(text=render_text(root), root=root, uses=frozenset(uses))


def _preorder(root: Node):
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.args))


def _size(root: Node) -> int:
    """Parts of the tree as rendered (a shared subtree counts at each place), without walking each."""
    memo: dict[int, int] = {}

    def count(node: Node) -> int:
        if id(node) not in memo:
            memo[id(node)] = 1 + sum(count(arg) for arg in node.args)
        return memo[id(node)]

    return count(root)


def _error(expr: Expression, node: Node, reason: str) -> ExpressionError:
    return ExpressionError(expr.text, _locate(expr, node), reason)


def _locate(expr: Expression, target: Node) -> ast.AST | None:
    """The syntax node of ``target`` (by identity) in the expression's canonical text, for the caret:
    the text parses back into the same tree, so the two are walked side by side."""
    try:
        syntax = ast.parse(expr.text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    stack = [(expr.root, syntax)]
    while stack:
        node, syntax = stack.pop()
        if node is target:
            return syntax
        stack.extend(zip(node.args, _syntax_children(node, syntax)))
    return None


def _syntax_children(node: Node, syntax: ast.AST) -> list[ast.AST]:
    if isinstance(syntax, ast.UnaryOp):
        return [syntax.operand]
    if isinstance(syntax, ast.BinOp):
        return [syntax.left, syntax.right]
    if isinstance(syntax, ast.BoolOp):
        return list(syntax.values)
    if isinstance(syntax, ast.Call):
        return list(syntax.args)
    if isinstance(syntax, ast.Subscript):
        return list(syntax.slice.elts) if isinstance(syntax.slice, ast.Tuple) else [syntax.slice]
    if isinstance(syntax, ast.Compare):
        operands = [syntax.left, *syntax.comparators]
        if node.kind == "cmp":
            return operands
        # a chain a < b < c parses into and(a < b, b < c): each link starts at its left operand
        return [
            ast.copy_location(ast.Compare(operands[i], [op], [operands[i + 1]]), operands[i])
            for i, op in enumerate(syntax.ops)
        ]
    return []


# ----------------------------------------------------------------------------- differentiation
def _diff(node: Node, target: Node) -> Node:
    """d node / d target, where target is a float variable or one aux read (a leaf either way)."""
    if node.kind == target.kind and node == target:
        return ONE
    if node.type != "float" or node.kind in ("const", "var", "index"):
        return ZERO
    if node.kind == "neg":
        return _neg(_diff(node.args[0], target))
    if node.kind == "bin":
        a, b = node.args
        da, db = _diff(a, target), _diff(b, target)
        if node.value in ("+", "-"):
            return _bin(node.value, da, db)
        if node.value == "*":
            return _bin("+", _bin("*", da, b), _bin("*", a, db))
        if _value(db) == 0:  # a constant divisor: skip building the a / (b * b) term
            return _bin("/", da, b)
        return _bin("-", _bin("/", da, b), _bin("*", _bin("/", a, _bin("*", b, b)), db))
    return _diff_call(node, target)


def _diff_call(node: Node, target: Node) -> Node:
    name, args = node.value, node.args
    if name == "where":
        return _call("where", args[0], _diff(args[1], target), _diff(args[2], target))
    if name in ("min", "max"):
        # weights rather than where(a < b, da, ...): each derivative appears once, so nested clamps
        # stay linear in size; at a tie each side gets half, as torch.minimum / maximum give
        a, b = args
        taken, other = ("<", ">") if name == "min" else (">", "<")
        weight_a = _call("where", _cmp(taken, a, b), ONE, _call("where", _cmp(other, a, b), ZERO, HALF))
        weight_b = _call("where", _cmp(taken, a, b), ZERO, _call("where", _cmp(other, a, b), ONE, HALF))
        return _bin("+", _bin("*", weight_a, _diff(a, target)), _bin("*", weight_b, _diff(b, target)))
    u = args[0]
    du = _diff(u, target)
    if _value(du) == 0:
        return ZERO
    if name == "abs":  # sign(u) * du, sign(0) = 0 as torch.abs
        sign = _call("where", _cmp(">", u, ZERO), ONE, _call("where", _cmp("<", u, ZERO), _const(-1.0), ZERO))
        return _bin("*", sign, du)
    if name == "log":
        return _bin("/", du, u)
    outer = {
        "exp": lambda: node,
        "exp2": lambda: _bin("*", Node("const", "float", LN2), node),
        "tanh": lambda: _bin("-", ONE, _bin("*", node, node)),
    }[name]()
    return _bin("*", outer, du)


# ----------------------------------------------------------------------------- construction
def _join(*types: str) -> str:
    return "float" if "float" in types else "int"


def _bin(op: str, a: Node, b: Node) -> Node:
    return _simplify_top(Node("bin", "float" if op == "/" else _join(a.type, b.type), op, (a, b)))


def _neg(a: Node) -> Node:
    return _simplify_top(Node("neg", a.type, None, (a,)))


def _call(name: str, *args: Node) -> Node:
    kind = _join(*(a.type for a in args if a.type != "bool"))
    return _simplify_top(Node("call", kind, name, args))


def _cmp(op: str, a: Node, b: Node) -> Node:
    return Node("cmp", "bool", op, (a, b))


def _value(node: Node) -> int | float | None:
    """The number a constant subtree (a literal, or negated literals) stands for; None otherwise."""
    if node.kind == "const" and node.type != "bool":
        return node.value
    if node.kind == "neg":
        inner = _value(node.args[0])
        return None if inner is None else -inner
    return None


def _const(value: int | float) -> Node:
    """A number as parse builds it from its text: a negative number is neg(literal), so the
    rendered text parses back into the same tree."""
    kind = "int" if isinstance(value, int) else "float"
    if value < 0:
        return Node("neg", kind, None, (_const(-value),))
    return Node("const", kind, value if kind == "int" else value + 0.0)  # + 0.0: no -0.0 literal


def _number(value: int | float) -> int | float | None:
    """value as a literal the language holds (int32 or a finite float), or None."""
    if isinstance(value, int) and not -(2**31) < value < 2**31:
        value = float(value)
    return value if math.isfinite(value) else None


def _as_float(node: Node) -> Node:
    """A float node for an int one (the derivative of a float part stays float, as its kernel code)."""
    if node.type == "float":
        return node
    value = _value(node)
    return _const(float(value)) if value is not None else Node("bin", "float", "*", (ONE, node))


# ----------------------------------------------------------------------------- simplification
@dataclass(frozen=True)
class _Product:
    """A float product ``num * over... / (den * under...)``: constants apart from the other factors,
    and constant divisors apart from constant multipliers, so ``30 * (x / 30)`` folds exactly."""

    num: Any
    den: Any = 1
    over: tuple[Node, ...] = ()
    under: tuple[Node, ...] = ()

    def times(self, other: _Product) -> _Product:
        return _Product(self.num * other.num, self.den * other.den, self.over + other.over, self.under + other.under)

    def inverse(self) -> _Product:
        return _Product(self.den, self.num, self.under, self.over)


def _simplify_top(node: Node) -> Node:
    """One float node whose children are simplified: sums and products are rebuilt in normal form."""
    if node.type != "float":
        return node
    out: Node | None = node
    if node.kind == "neg" or (node.kind == "bin" and node.value in ("+", "-")):
        terms: list[_Product] = []
        _split_sum(node, 1, terms)
        out = _build_sum(terms)
    elif node.kind == "bin":
        out = ZERO if _value(node.args[0]) == 0 else _build_product(_split_product(node))
    elif node.kind == "call" and node.value == "where" and node.args[1] == node.args[2]:
        out = node.args[1]
    return _as_float(out if out is not None else node)  # None: a fold would overflow; keep the node


def _split_product(node: Node) -> _Product:
    value = _value(node)
    if value is not None:
        return _Product(value)
    if node.type == "float" and node.kind == "neg":
        return _Product(-1).times(_split_product(node.args[0]))
    if node.type == "float" and node.kind == "bin" and node.value in ("*", "/"):
        left, right = _split_product(node.args[0]), _split_product(node.args[1])
        if node.value == "*":
            return left.times(right)
        if right.num != 0:  # x / 0 stays as written
            return left.times(right.inverse())
    if node.type == "float" and node.kind == "bin" and node.value in ("+", "-") and _leads_negative(node):
        # a sum factor starts positive (-a - b -> -1 * (a + b)): the sign stays with the product's
        # constant, where an enclosing sum writes it as a subtraction
        return _Product(-1, 1, (_neg(node),))
    return _Product(1, 1, (node,))


def _leads_negative(node: Node) -> bool:
    while node.type == "float" and node.kind == "bin" and node.value in ("+", "-"):
        node = node.args[0]
    return _split_product(node).num < 0


def _build_product(product: _Product) -> Node | None:
    """``num * a * b / (den * c)`` with the constant in front, factors found above and below the line
    cancelled (x * y / x -> y), or None where a constant overflows."""
    num, den, over, under = product.num, product.den, list(product.over), []
    for factor in product.under:
        if factor in over:
            over.remove(factor)
        else:
            under.append(factor)
    if den < 0:
        num, den = -num, -den
    if den != 1 and math.isfinite(num / den) and Fraction(num / den) == Fraction(num) / Fraction(den):
        num, den = num / den, 1  # fold a divisor only where the quotient is exact: 30 / 30, 1 / 4
    num, den = _number(num), _number(den)
    if num is None or den is None:
        return None
    if num == 0:
        return ZERO
    body = _chain(over)
    if body is None:
        out = _const(num)
    elif num == 1:
        out = body
    elif num == -1 and body.type == "float":  # -a * b: the sign on the first factor, as one writes it
        out = _negate_first(body)
    else:
        out = Node("bin", _join(body.type, "float" if isinstance(num, float) else "int"), "*", (_const(num), body))
    below = _chain(([_const(den)] if den != 1 else []) + under)
    return out if below is None else Node("bin", "float", "/", (out, below))


def _chain(factors: list[Node]) -> Node | None:
    body = None
    for factor in factors:
        body = factor if body is None else Node("bin", _join(body.type, factor.type), "*", (body, factor))
    return body


def _negate_first(body: Node) -> Node:
    if body.kind == "bin" and body.value == "*":
        return dataclasses.replace(body, args=(_negate_first(body.args[0]), body.args[1]))
    if body.type == "float" and (body.kind == "neg" or (body.kind == "bin" and body.value in ("+", "-"))):
        return _neg(body)  # a sum takes the sign into its terms, as simplify would
    return Node("neg", body.type, None, (body,))


def _split_sum(node: Node, sign: int, terms: list[_Product]) -> None:
    """A float sum as terms, each a product whose constant carries the term's sign."""
    if node.type == "float" and node.kind == "bin" and node.value in ("+", "-"):
        _split_sum(node.args[0], sign, terms)
        _split_sum(node.args[1], sign if node.value == "+" else -sign, terms)
    elif node.type == "float" and node.kind == "neg":
        _split_sum(node.args[0], -sign, terms)
    else:
        terms.append(_Product(sign).times(_split_product(node)))


def _build_sum(terms: list[_Product]) -> Node | None:
    """Like terms added (same factors and divisor), zeros dropped, constants folded into one that
    stays first where the sum started with one (``1.0 - t * t``) and goes last otherwise."""
    constants = [t for t in terms if not t.over and not t.under and t.num != 0]
    if len(constants) > 1:  # one constant keeps its exact num / den form; several fold into a float
        total = sum(t.num / t.den if t.den != 1 else t.num for t in constants)
        constants = [_Product(total)] if total != 0 else []
    merged: list[_Product] = []
    keys: list[tuple] = []
    for term in terms:
        if not term.over and not term.under:
            continue
        # factors compared in any order (score * cap - cap * score is 0); each term keeps its own
        key = (term.den, sorted(map(render_text, term.over)), sorted(map(render_text, term.under)))
        if key in keys:
            at = keys.index(key)
            merged[at] = dataclasses.replace(merged[at], num=merged[at].num + term.num)
        else:
            merged.append(term)
            keys.append(key)
    parts = [m for m in merged if m.num != 0]
    if constants:
        starts_constant = not terms[0].over and not terms[0].under
        parts = [constants[0], *parts] if starts_constant else [*parts, constants[0]]
    out = None
    for part in parts:
        negative = out is not None and part.num < 0
        piece = _build_product(dataclasses.replace(part, num=-part.num) if negative else part)
        if piece is None:
            return None
        out = piece if out is None else Node("bin", _join(out.type, piece.type), "-" if negative else "+", (out, piece))
    return ZERO if out is None else out
