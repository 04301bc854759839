"""Spec files: YAML in (safe loader, plain data only, bounded) and out.

A spec file is untrusted input (CI images warm specs taken from model repositories), so loading
is bounded before anything is validated: the file's size, the nesting depth, no aliases, no
duplicate keys. Every failure is a ``SpecFileError`` whose text is one line,
``SOURCE: field: what is wrong``, with each echoed value cut to a few dozen characters.
"""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from fa4gen.spec import AttentionSpec

MAX_SPEC_BYTES = 64 * 1024  # real specs are a few hundred bytes; this bounds parsing and every message
MAX_DEPTH = 16  # a spec nests at most 4 deep (aux.NAME.shape.0); PyYAML's composer recurses per level
MAX_NODES = 2000  # values in one spec (a real one has a few dozen): bounds the work before validation
MAX_INT_DIGITS = 40  # Python refuses to parse ints over 4300 digits with an unhelpful message
MAX_SHOWN = 80  # characters of one echoed value (a name, a quoted string) in a message
MAX_PROBLEM = 400  # characters of one message, whatever it quotes
EMPTY_MESSAGE = "empty spec file: write at least one field, e.g. head_dim: 128"
TOO_LARGE_MESSAGE = f"larger than {MAX_SPEC_BYTES // 1024} KiB: a spec is a few fields"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_LONG_RUN = re.compile(rf"'[^'\n]{{{MAX_SHOWN},}}'|\"[^\"\n]{{{MAX_SHOWN},}}\"|\S{{{MAX_SHOWN + 1},}}")


class SpecFileError(ValueError):
    """A spec that cannot be loaded: ``str()`` is one line naming the source, the field and the problem."""

    def __init__(self, source: str, problem: str):
        self.source = source
        self.problem = _shorten(problem)
        super().__init__(f"{source}: {self.problem}")


def _shorten(text: str) -> str:
    """The first line of ``text`` with long quoted values and long words cut, and the whole capped."""
    line = next((part.strip() for part in str(text).splitlines() if part.strip()), "")
    line = _LONG_RUN.sub(lambda m: _cut(m.group(0), quoted=m.group(0)[0] in "'\"" and len(m.group(0)) > 1), line)
    return _cut(line, limit=MAX_PROBLEM)


def _cut(text: str, limit: int = MAX_SHOWN, quoted: bool = False) -> str:
    if len(text) <= limit:
        return text
    return text[: limit - 3 - quoted] + "..." + (text[-1] if quoted else "")


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing what a spec never needs and an attacker would use."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        # Aliases are refused, not counted: a spec has nothing worth sharing, and a few hundred
        # bytes of nested aliases expand to billions of nodes for whatever walks the data later.
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None,
                None,
                f"aliases (*{_cut(event.anchor)}) are not allowed in a spec: write the value out",
                event.start_mark,
            )
        # Explicit tags (!!int, !!binary, !!python/...) likewise: PyYAML's constructors crash on some
        # malformed tagged values, and plain YAML already spells every value a spec takes.
        if getattr(event, "tag", None) not in (None, "!"):
            tag = _cut(event.tag.replace("tag:yaml.org,2002:", "!!"))
            raise yaml.composer.ComposerError(
                None, None, f"tags ({tag}) are not allowed in a spec: write the plain value", event.start_mark
            )
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise yaml.composer.ComposerError(
                None, None, f"more than {MAX_NODES} values (a spec has a few dozen)", event.start_mark
            )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels (a spec needs 4)", event.start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def fetch_flow_collection_start(self, token_class: Any) -> None:
        # "[[[[..." on one line: refused here, since the scanner's look-ahead over a line of
        # unclosed brackets costs quadratic time before the composer sees the first node
        if self.flow_level >= MAX_DEPTH:
            raise yaml.scanner.ScannerError(
                None, None, f"nested deeper than {MAX_DEPTH} levels (a spec needs 4)", self.get_mark()
            )
        super().fetch_flow_collection_start(token_class)

    def construct_bounded_int(self, node: Any) -> int:
        text = self.construct_scalar(node)
        if len(text) > MAX_INT_DIGITS:
            raise yaml.constructor.ConstructorError(
                None, None, f"integer {_cut(text, 20)} has {len(text)} characters: too long", node.start_mark
            )
        return self.construct_yaml_int(node)

    def construct_mapping(self, node: Any, deep: bool = False) -> dict:
        """Every mapping, at any level: duplicate keys and merge keys (``<<``) are errors."""
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        "merge keys (<<) are not allowed in a spec: write the fields out",
                        key_node.start_mark,
                    )
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {_cut(repr(key))}: give each field once", key_node.start_mark
                    )
        return super().construct_mapping(node, deep=deep)


_SpecLoader.add_constructor("tag:yaml.org,2002:int", _SpecLoader.construct_bounded_int)


def load_spec(path: str | Path) -> AttentionSpec:
    """Read a spec from a YAML file; any problem is a one-line ``SpecFileError`` naming the file."""
    source = str(path)
    return _validate(_parse(_read(Path(path), source), source), source)


def spec_from_yaml(text: str, source: str = "<string>") -> AttentionSpec:
    """A spec from YAML text; ``source`` names it in errors (a file name, a URL)."""
    if len(text) > MAX_SPEC_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecFileError(source, TOO_LARGE_MESSAGE)
    return _validate(_parse(text, source), source)


def _read(path: Path, source: str) -> str:
    """The file's text, reading at most one byte past the size limit."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecFileError(source, exc.strerror or type(exc).__name__) from exc
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecFileError(source, TOO_LARGE_MESSAGE)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise SpecFileError(source, f"not UTF-8 text: byte 0x{raw[exc.start]:02x} on line {line}") from exc


def _parse(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - _SpecLoader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        raise SpecFileError(source, _yaml_problem(exc)) from exc
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise SpecFileError(source, f"line {line}: character #x{exc.character:04x} is not allowed in YAML") from exc
    except (yaml.YAMLError, ValueError, OverflowError) as exc:  # e.g. a date such as 2001-13-45
        raise SpecFileError(source, f"cannot read a value: {exc}") from exc


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    """``line L, column C: problem (context from line L2)`` from PyYAML's multi-line message."""
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = exc.problem or exc.context or "not valid YAML"
    if exc.problem and exc.context:
        start = f" from line {exc.context_mark.line + 1}" if exc.context_mark is not None else ""
        problem += f" ({exc.context}{start})"
    return where + problem


def _validate(data: Any, source: str) -> AttentionSpec:
    if data is None:  # an empty or comment-only file; "{}" (dump_spec's default spec) is a mapping
        raise SpecFileError(source, EMPTY_MESSAGE)
    if not isinstance(data, dict):
        raise SpecFileError(
            source, f"a spec must be a mapping of fields (e.g. head_dim: 128), got {type(data).__name__}"
        )
    misplaced = _misplaced_bool(AttentionSpec, data, ())
    if misplaced is not None:
        loc, value, wanted = misplaced
        raise SpecFileError(
            source,
            f"{_field(loc)}: got a boolean ({str(value).lower()}; YAML reads "
            f"true/false/yes/no/on/off as booleans); allowed: {wanted}",
        )
    try:
        return AttentionSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecFileError(source, _validation_problem(exc)) from exc


def _field(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


def _validation_problem(exc: ValidationError) -> str:
    """The first error as ``field: what is wrong``, and how many more there are."""
    errors = exc.errors(include_url=False)
    error, loc = errors[0], tuple(errors[0]["loc"])
    message = error["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if error["type"] == "extra_forbidden":
        model = _model_at(loc[:-1])
        message = "unknown field" + (f"; allowed: {', '.join(sorted(model.model_fields))}" if model else "")
    elif error["type"] not in ("value_error", "assertion_error", "missing", "union_tag_invalid") and "input" in error:
        message += f" (got {_cut(repr(error['input']))})"
    if loc and not message.startswith(f"{loc[-1]}="):  # the model's own messages name the field
        message = f"{_field(loc)}: {message}"
    more = len(errors) - 1
    return message + (f" (and {more} more error{'s' if more > 1 else ''})" if more else "")


# ---------------------------------------------------------------------------- the model's field types
def _options(annotation: Any) -> tuple:
    """The alternatives of an annotation, Optional / Union / Annotated flattened."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(option for arg in get_args(annotation) for option in _options(arg))
    return (annotation,)


def _models(options: tuple) -> list[type[BaseModel]]:
    return [
        option
        for option in options
        if isinstance(option, type) and get_origin(option) is None and issubclass(option, BaseModel)
    ]


def _tagged(models: list[type[BaseModel]], tag: Any) -> type[BaseModel] | None:
    """The one model among ``models``, or the one whose ``kind`` literal is ``tag``."""
    if len(models) == 1:
        return models[0]
    for model in models:
        kind = model.model_fields.get("kind")
        if kind is not None and isinstance(tag, str) and tag in get_args(kind.annotation):
            return model
    return None


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The model whose fields ``loc`` (a pydantic error location, union tags included) points into."""
    model: type[BaseModel] | None = AttentionSpec
    annotation: Any = None
    for part in loc:
        if model is None:
            options = _options(annotation)
            dicts = [option for option in options if get_origin(option) is dict]
            if dicts:  # part is a key of the mapping
                annotation = get_args(dicts[0])[1]
                model = _tagged(_models(_options(annotation)), None)
                continue
            model = _tagged(_models(options), part)  # part is the union's tag
            if model is None:
                return None
            continue
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        annotation, model = field.annotation, None
        models = _models(_options(annotation))
        if len(models) == 1 and get_origin(annotation) is not dict:
            model = models[0]
    return model


def _misplaced_bool(annotation: Any, value: Any, loc: tuple) -> tuple[tuple, bool, str] | None:
    """(where, value, what belongs there) of the first YAML boolean where the model wants a number:
    pydantic reads true as 1 there, so `head_dim: true` would be reported as head_dim=1."""
    options = _options(annotation)
    if isinstance(value, bool):
        if bool in options or not {int, float} & set(options):
            return None
        return loc, value, "an integer" if int in options else "a number"
    children: list[tuple[Any, Any, Any]] = []
    if isinstance(value, dict):
        model = _tagged(_models(options), value.get("kind"))
        dicts = [option for option in options if get_origin(option) is dict]
        if model is not None:
            children = [
                (model.model_fields[k].annotation, v, k)
                for k, v in value.items()
                if isinstance(k, str) and k in model.model_fields
            ]
        elif dicts:
            children = [(get_args(dicts[0])[1], v, k) for k, v in value.items()]
    elif isinstance(value, list):
        sequences = [option for option in options if get_origin(option) in (tuple, list)]
        if sequences:
            children = [(get_args(sequences[0])[0], v, i) for i, v in enumerate(value)]
    for child_annotation, child, part in children:
        found = _misplaced_bool(child_annotation, child, (*loc, part))
        if found is not None:
            return found
    return None


def dump_spec(spec: AttentionSpec, path: str | Path | None = None) -> str:
    """The spec as YAML (only fields that differ from their defaults); written to ``path`` if given."""
    data = spec.model_dump(exclude_defaults=True)
    text = yaml.safe_dump(data, sort_keys=True) if data else "{}\n"
    if path is not None:
        Path(path).write_text(text)
    return text
