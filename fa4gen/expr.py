"""A small, safe expression language for attention variants written in YAML.

A YAML file cannot hold a Python callable, so score modifiers and masks are written as
expressions, e.g. ``score - slope[h] * abs(q_idx - kv_idx)`` or ``(q_idx // 1024) == (kv_idx // 1024)``.
An expression is parsed with Python's ``ast`` into a whitelisted, typed tree and never evaluated
as Python. The tree is then rendered two ways: a PyTorch evaluation (the test reference, built by
walking the tree with torch operations) and CuTe DSL source for the emitted kernel module.

The language:
- variables: ``score`` (float; only where a score is being modified), ``b``, ``h``, ``q_idx``,
  ``kv_idx``, ``seqlen_q``, ``seqlen_k`` (int), and the scalars and aux tensors the spec declares;
- literals: integers, floats, ``True`` / ``False``;
- arithmetic ``+ - * / //`` and unary ``-``; comparisons ``< <= > >= == !=`` (chains allowed);
  ``and`` / ``or`` / ``not``;
- functions ``where(c, a, b)``, ``min(a, b)``, ``max(a, b)``, ``abs``, ``exp``, ``exp2``, ``log``,
  ``tanh``;
- aux tensors indexed by int expressions: ``bias[h, q_idx - kv_idx]``.
Anything else (attribute access, other calls, lambdas, comprehensions, strings, ``**``,
conditional expressions, dunder names...) is rejected with an error that points at it.

Only the tree leaves this module: ``Expression.text`` is the canonical text rendered from it
(comments and layout dropped), so no character a user wrote reaches generated code. Outside
comments an expression is ASCII: Python folds look-alike letters (fullwidth, ligatures) into
ASCII names, which would let ``ｂ`` silently read the batch index ``b``.
"""

from __future__ import annotations

import ast
import io
import math
import re
import tokenize
from dataclasses import dataclass
from typing import Any, Literal, Mapping

Type = Literal["int", "float", "bool"]
INDEX_VARIABLES = ("b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k")
MAX_LENGTH = 2000
MAX_NODES = 400
MAX_DEPTH = 40
UNARY_FUNCTIONS = ("abs", "exp", "exp2", "log", "tanh")


class ExpressionError(ValueError):
    """A rejected expression; the message shows the text (escaped, one line) with a caret under the
    offending part."""

    def __init__(self, text: str, node: ast.AST | None, reason: str):
        column = _absolute_column(text, node)
        super().__init__(f"{reason}{_pointer(text, column)}")
        self.reason = reason
        self.column = column


def _absolute_column(text: str, node: ast.AST | None) -> int | None:
    """The node's offset into the whole text (ast counts per line; text is ASCII outside comments,
    so its byte columns are character columns)."""
    column = getattr(node, "col_offset", None)
    if column is None:
        return None
    lines = re.split(r"(?<=\r\n)|(?<=\r)(?!\n)|(?<=\n)", text)  # Python's line ends, not str.splitlines'
    return sum(len(line) for line in lines[: node.lineno - 1]) + column


def _pointer(text: str, column: int | None) -> str:
    if column is None:
        return ""
    shown, at = escaped(text), len(escaped(text[:column]))
    if at > 80:  # a window around the caret keeps the message short
        shown, at = "..." + shown[at - 60 :], 63
    if len(shown) > at + 60:
        shown = shown[: at + 57] + "..."
    return f"\n  {shown}\n  {' ' * at}^"


@dataclass(frozen=True)
class AuxTensor:
    dtype: Literal["int", "float"]
    ndim: int
    dims: tuple[int | None, ...] | None = None  # fixed sizes (None: a call-time size); checks constant indices


@dataclass(frozen=True)
class Node:
    kind: str  # const, var, neg, not, bin, cmp, and, or, call, index
    type: Type
    value: Any = None  # const value / var or aux name / operator / function name
    args: tuple[Node, ...] = ()


@dataclass(frozen=True)
class Expression:
    text: str
    root: Node
    uses: frozenset[str]  # variable, scalar and aux names it reads


_BIN_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//"}
_CMP_OPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}


def _join(a: Type, b: Type) -> Type:
    return "float" if "float" in (a, b) else "int"


class _Checker:
    def __init__(self, text: str, variables: Mapping[str, Type], aux: Mapping[str, AuxTensor]):
        self.text, self.variables, self.aux = text, variables, aux
        self.uses: set[str] = set()
        self.nodes = 0

    def fail(self, node: ast.AST, reason: str) -> ExpressionError:
        return ExpressionError(self.text, node, reason)

    def number(self, node: ast.AST, depth: int) -> Node:
        out = self.visit(node, depth)
        if out.type == "bool":
            raise self.fail(node, "expected a number here, got a condition")
        return out

    def condition(self, node: ast.AST, depth: int) -> Node:
        out = self.visit(node, depth)
        if out.type != "bool":
            raise self.fail(node, "expected a condition (a comparison, and/or/not, True/False)")
        return out

    def visit(self, node: ast.AST, depth: int = 0) -> Node:
        self.nodes += 1
        if depth > MAX_DEPTH or self.nodes > MAX_NODES:
            raise self.fail(node, f"expression too large (at most {MAX_NODES} parts, nesting {MAX_DEPTH})")
        handler = getattr(self, f"visit_{type(node).__name__}", None)
        if handler is None:
            raise self.fail(node, f"{type(node).__name__} is not allowed in an expression")
        return handler(node, depth + 1)

    def visit_Constant(self, node: ast.Constant, depth: int) -> Node:
        value = node.value
        if isinstance(value, bool):
            return Node("const", "bool", value)
        if isinstance(value, int):
            if abs(value) >= 2**31:
                raise self.fail(node, f"integer {value} does not fit in int32")
            return Node("const", "int", value)
        if isinstance(value, float) and math.isfinite(value):
            return Node("const", "float", value)
        raise self.fail(node, f"literal {value!r} is not allowed: use a finite number or True/False")

    def visit_Name(self, node: ast.Name, depth: int) -> Node:
        name = node.id
        if name.startswith("__"):
            raise self.fail(node, f"name {name!r} is not allowed")
        if name in self.variables:
            self.uses.add(name)
            return Node("var", self.variables[name], name)
        if name in self.aux:
            raise self.fail(node, f"aux tensor {name!r} must be indexed, e.g. {name}[h]")
        known = ", ".join(sorted(self.variables))
        raise self.fail(node, f"unknown name {name!r}: known are {known}")

    def visit_UnaryOp(self, node: ast.UnaryOp, depth: int) -> Node:
        if isinstance(node.op, ast.USub):
            operand = self.number(node.operand, depth)
            return Node("neg", operand.type, None, (operand,))
        if isinstance(node.op, ast.Not):
            return Node("not", "bool", None, (self.condition(node.operand, depth),))
        raise self.fail(node, f"operator {type(node.op).__name__} is not allowed")

    def visit_BinOp(self, node: ast.BinOp, depth: int) -> Node:
        op = _BIN_OPS.get(type(node.op))
        if op is None:
            raise self.fail(node, f"operator {type(node.op).__name__} is not allowed (use + - * / //)")
        left, right = self.number(node.left, depth), self.number(node.right, depth)
        if op == "//" and "float" in (left.type, right.type):
            raise self.fail(node, "// needs integer operands")
        result: Type = "float" if op == "/" else _join(left.type, right.type)
        return Node("bin", result, op, (left, right))

    def visit_Compare(self, node: ast.Compare, depth: int) -> Node:
        parts, left = [], self.number(node.left, depth)
        for op, comparator in zip(node.ops, node.comparators):
            symbol = _CMP_OPS.get(type(op))
            if symbol is None:
                raise self.fail(node, f"comparison {type(op).__name__} is not allowed")
            right = self.number(comparator, depth)
            parts.append(Node("cmp", "bool", symbol, (left, right)))
            left = right
        return parts[0] if len(parts) == 1 else Node("and", "bool", None, tuple(parts))

    def visit_BoolOp(self, node: ast.BoolOp, depth: int) -> Node:
        kind = "and" if isinstance(node.op, ast.And) else "or"
        return Node(kind, "bool", None, tuple(self.condition(v, depth) for v in node.values))

    def visit_Call(self, node: ast.Call, depth: int) -> Node:
        if not isinstance(node.func, ast.Name):
            raise self.fail(node, "only where, min, max, abs, exp, exp2, log and tanh can be called")
        name = node.func.id
        if node.keywords:
            raise self.fail(node, f"{name}() takes no keyword arguments")
        arity = {"where": 3, "min": 2, "max": 2, **{f: 1 for f in UNARY_FUNCTIONS}}
        if name not in arity:
            raise self.fail(node, f"unknown function {name!r}: allowed are {', '.join(arity)}")
        if len(node.args) != arity[name]:
            raise self.fail(node, f"{name}() takes {arity[name]} argument(s), got {len(node.args)}")
        if name == "where":
            cond = self.condition(node.args[0], depth)
            a, b = self.number(node.args[1], depth), self.number(node.args[2], depth)
            return Node("call", _join(a.type, b.type), name, (cond, a, b))
        args = tuple(self.number(arg, depth) for arg in node.args)
        if name in ("min", "max"):
            return Node("call", _join(args[0].type, args[1].type), name, args)
        return Node("call", args[0].type if name == "abs" else "float", name, args)

    def visit_Subscript(self, node: ast.Subscript, depth: int) -> Node:
        if not isinstance(node.value, ast.Name) or node.value.id not in self.aux:
            raise self.fail(
                node, f"only declared aux tensors can be indexed (declared: {', '.join(self.aux) or 'none'})"
            )
        name, tensor = node.value.id, self.aux[node.value.id]
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if len(items) != tensor.ndim:
            raise self.fail(node, f"{name} has {tensor.ndim} dim(s), indexed with {len(items)}")
        indices = []
        for axis, item in enumerate(items):
            index = self.visit(item, depth)
            if index.type != "int":
                raise self.fail(item, f"indices of {name} must be integers")
            self.check_constant_index(item, name, tensor, axis, index)
            indices.append(index)
        self.uses.add(name)
        return Node("index", tensor.dtype, name, tuple(indices))

    def check_constant_index(self, item: ast.AST, name: str, tensor: AuxTensor, axis: int, index: Node) -> None:
        """A constant index is checked here: the kernel reads aux tensors without bounds checks."""
        value = _constant_int(index)
        if value is None:
            return
        size = None if tensor.dims is None else tensor.dims[axis]
        if value < 0:
            raise self.fail(item, f"index {value} of {name} (dim {axis}) is negative: indices count from 0")
        if size is not None and value >= size:
            raise self.fail(item, f"index {value} of {name} (dim {axis}) is out of range: the dim has size {size}")


def _constant_int(node: Node) -> int | None:
    """The value of an int subtree without variables (None where it reads any, or divides by 0)."""
    if node.type != "int":
        return None
    if node.kind == "const":
        return node.value
    args = [_constant_int(arg) for arg in node.args]
    if not args or any(a is None for a in args):
        return None
    if node.kind == "neg":
        return -args[0]
    if node.kind == "bin" and node.value in ("+", "-", "*"):
        a, b = args
        return a + b if node.value == "+" else a - b if node.value == "-" else a * b
    if node.kind == "bin" and node.value == "//" and args[1] != 0:
        return args[0] // args[1]
    if node.kind == "call" and node.value in ("min", "max", "abs"):
        return {"min": min, "max": max, "abs": abs}[node.value](*args)
    return None


def _syntax_position(exc: SyntaxError) -> ast.AST | None:
    """A SyntaxError's place as a node position (its offset counts from 1)."""
    if not exc.lineno or not exc.offset:
        return None
    return ast.Pass(lineno=exc.lineno, col_offset=max(exc.offset - 1, 0))


def _check_characters(text: str) -> None:
    """Control characters anywhere, and non-ASCII outside comments, are refused with a caret."""
    for column, char in enumerate(text):
        if (ord(char) < 0x20 and char not in "\t\n\r") or ord(char) == 0x7F:
            raise ExpressionError("", None, f"control character U+{ord(char):04X} at column {column} is not allowed")
    try:
        code = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type != tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError, ValueError):
        code = [text]  # not tokenizable: no comment can be told apart, so every character counts
    for part in code:
        if not part.isascii():
            bad = next(c for c in part if not c.isascii())
            raise ExpressionError(
                "",
                None,
                f"non-ASCII character {bad!r} (U+{ord(bad):04X}) in "
                f"'{_printable(part)}': expressions are ASCII outside comments",
            )


def escaped(text: str) -> str:
    """ASCII-printable form of text: what an error message may echo."""
    shown = text.encode("ascii", "backslashreplace").decode("ascii")
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in shown)


def _printable(text: str) -> str:
    """Text safe to show in a one-line error: escaped, and cut where it is long."""
    shown = escaped(text)
    return shown if len(shown) <= 120 else shown[:117] + "..."


def parse(
    text: str,
    *,
    score: bool = True,
    scalars: Mapping[str, Literal["int", "float"]] | None = None,
    aux: Mapping[str, AuxTensor] | None = None,
    result: Literal["number", "condition"] = "number",
) -> Expression:
    """Parse and type-check ``text``: a score modifier (``result="number"``, ``score`` in scope)
    or a mask (``result="condition"``, True where a key is visible)."""
    if not isinstance(text, str) or not text.strip():
        raise ExpressionError("", None, "an expression must be a non-empty string")
    if len(text) > MAX_LENGTH:
        raise ExpressionError("", None, f"expression longer than {MAX_LENGTH} characters")
    text = text.strip()
    _check_characters(text)
    variables: dict[str, Type] = {name: "int" for name in INDEX_VARIABLES}
    if score:
        variables["score"] = "float"
    for name, kind in (scalars or {}).items():
        if name in variables or not (name.isascii() and name.isidentifier()) or name.startswith("__"):
            raise ExpressionError("", None, f"scalar name {_printable(name)!r} is not allowed")
        variables[name] = kind
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(text, _syntax_position(exc), f"not a valid expression: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError):
        raise ExpressionError(text, None, "expression could not be parsed") from None
    checker = _Checker(text, variables, dict(aux or {}))
    root = checker.visit(tree.body)
    if result == "condition" and root.type != "bool":
        raise ExpressionError(text, tree.body, "a mask must be a condition (True where a key is visible)")
    if result == "number" and root.type == "bool":
        raise ExpressionError(text, tree.body, "a score modifier must be a number, not a condition")
    return Expression(text=render_text(root), root=root, uses=frozenset(checker.uses))


# ----------------------------------------------------------------------------- canonical text
# binding strength as in Python; children that bind less tightly than their parent get parentheses
_PRECEDENCE = {"or": 1, "and": 2, "not": 3, "cmp": 4, "+": 5, "-": 5, "*": 6, "/": 6, "//": 6, "neg": 7}
_ATOM = 8


def _precedence(node: Node) -> int:
    if node.kind == "bin":
        return _PRECEDENCE[node.value]
    return _PRECEDENCE.get(node.kind, _ATOM)


def render_text(node: Node) -> str:
    """The canonical text of a tree: ASCII names, numbers and operators only, and parsing it gives
    the same tree back (so it is a fixed point, and safe to show in generated code)."""

    def wrap(child: Node, tighter_than: int) -> str:
        text = render_text(child)
        return text if _precedence(child) > tighter_than else f"({text})"

    if node.kind == "const":
        return repr(node.value)
    if node.kind == "var":
        return node.value
    if node.kind == "neg":
        return "-" + wrap(node.args[0], _PRECEDENCE["neg"])
    if node.kind == "not":
        return "not " + wrap(node.args[0], _PRECEDENCE["not"] - 1)
    if node.kind in ("and", "or"):  # nested and/or keep their parentheses: the tree stays the same
        return f" {node.kind} ".join(wrap(arg, _PRECEDENCE[node.kind]) for arg in node.args)
    if node.kind == "cmp":
        left, right = node.args
        return f"{wrap(left, _PRECEDENCE['cmp'])} {node.value} {wrap(right, _PRECEDENCE['cmp'])}"
    if node.kind == "bin":
        level = _PRECEDENCE[node.value]  # left-associative: only the right operand needs the tie broken
        left, right = node.args
        return f"{wrap(left, level - 1)} {node.value} {wrap(right, level)}"
    args = ", ".join(render_text(arg) for arg in node.args)
    return f"{node.value}[{args}]" if node.kind == "index" else f"{node.value}({args})"


# ----------------------------------------------------------------------------- PyTorch
_TORCH_BIN = {"+": "add", "-": "sub", "*": "mul", "/": "div", "//": "floor_divide"}
_TORCH_CMP = {"<": "lt", "<=": "le", ">": "gt", ">=": "ge", "==": "eq", "!=": "ne"}


def evaluate_torch(expr: Expression, env: Mapping[str, Any]):
    """Evaluate with torch operations; ``env`` maps variable, scalar and aux names to tensors
    or numbers that broadcast against each other (e.g. q_idx of shape (Sq, 1), kv_idx (1, Sk))."""
    import torch

    def as_tensor(value):
        return value if isinstance(value, torch.Tensor) else torch.tensor(value)

    def walk(node: Node):
        if node.kind == "const":
            return torch.tensor(node.value)
        if node.kind == "var":
            return as_tensor(env[node.value])
        args = [walk(arg) for arg in node.args]
        if node.kind == "neg":
            return -args[0]
        if node.kind == "not":
            return torch.logical_not(args[0])
        if node.kind == "bin":
            if node.value == "/":
                return torch.div(args[0].double(), args[1].double())
            return getattr(torch, _TORCH_BIN[node.value])(args[0], args[1])
        if node.kind == "cmp":
            return getattr(torch, _TORCH_CMP[node.value])(args[0], args[1])
        if node.kind in ("and", "or"):
            combine = torch.logical_and if node.kind == "and" else torch.logical_or
            out = args[0]
            for arg in args[1:]:
                out = combine(out, arg)
            return out
        if node.kind == "index":
            return as_tensor(env[node.value])[tuple(a.long() for a in args)]
        name = node.value
        if name == "where":
            return torch.where(args[0], args[1], args[2])
        if name in ("min", "max"):
            return (torch.minimum if name == "min" else torch.maximum)(args[0], args[1])
        if name == "abs":
            return torch.abs(args[0])
        return getattr(torch, name)(args[0].double() if args[0].dtype in (torch.int32, torch.int64) else args[0])

    return walk(expr.root)


# ----------------------------------------------------------------------------- CuTe DSL
_CUTE_FUNCTIONS = {"exp": "cute.math.exp", "exp2": "cute.math.exp2", "log": "cute.math.log", "tanh": "cute.math.tanh"}


def render_cute(expr: Expression, names: Mapping[str, str] | None = None) -> str:
    """CuTe DSL source for the expression (Float32 / Int32 arithmetic). ``names`` maps variable,
    scalar and aux names to the identifiers they have in the emitted function.

    A division renders as ``div.full.f32`` (within 2 ulp, straight-line code: IEEE ``div.rn.f32``'s
    slow path is a called subroutine, whose call spills registers; decision expression-division),
    except under a comparison, where a mask's decision at an exact quotient (``kv_idx / 3 <= 2``)
    must come out as the reference's does: there it stays IEEE."""
    names = dict(names or {})

    def walk(node: Node, compared: bool = False) -> str:
        if node.kind == "const":
            if node.type == "bool":
                return repr(node.value)
            return f"Float32({node.value!r})" if node.type == "float" else f"Int32({node.value})"
        if node.kind == "var":
            return names.get(node.value, node.value)
        args = [walk(arg, compared or node.kind == "cmp") for arg in node.args]
        if node.kind in ("bin", "cmp", "call") and any(a.type == "float" for a in node.args):
            # mixed int/float operands: convert the ints explicitly, as Python would implicitly
            args = [f"Float32({code})" if a.type == "int" else code for a, code in zip(node.args, args)]
        if node.kind == "neg":
            return f"(-{args[0]})"
        if node.kind == "not":  # bitwise on 1-bit values: no short-circuit branches per score
            return f"(~cutlass.Boolean({args[0]}))"
        if node.kind == "bin":
            if node.value == "/" and compared:
                return f"(Float32({args[0]}) / Float32({args[1]}))"
            if node.value == "/":
                return f"cute.math.div(Float32({args[0]}), Float32({args[1]}), full=True)"
            return f"({args[0]} {node.value} {args[1]})"
        if node.kind == "cmp":
            return f"({args[0]} {node.value} {args[1]})"
        if node.kind in ("and", "or"):
            return "(" + (" & " if node.kind == "and" else " | ").join(args) + ")"
        if node.kind == "index":
            return f"{names.get(node.value, node.value)}[{', '.join(args)}]"
        name = node.value
        if name == "where":
            return f"cutlass.select_({args[0]}, {args[1]}, {args[2]})"
        if name in ("min", "max"):
            return f"cutlass.{name}({args[0]}, {args[1]})"
        if name == "abs":
            return f"cute.math.abs({args[0]})" if node.type == "float" else f"cutlass.max({args[0]}, -{args[0]})"
        return f"{_CUTE_FUNCTIONS[name]}(Float32({args[0]}), fastmath=True)"

    return walk(expr.root)
