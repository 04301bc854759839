"""Plan -> source: render the variant's CuTe-DSL module from a jinja2 template.

The template holds only what differs per variant (the score modifier with the spec's constants,
and the wiring of the plan's numbers into the kernel class); it is rendered deterministically, so
the same (spec, plan) always gives byte-identical source (checked by golden-file tests).
"""

from __future__ import annotations

import keyword
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from fa4gen._version import __version__
from fa4gen.expr import escaped as _escaped
from fa4gen.expr import render_cute
from fa4gen.planner import Plan
from fa4gen.spec import AttentionSpec
from fa4gen.specfile import dump_spec
from fa4gen.variants import lower

# kernel class -> (its module and its config's module under fa4gen.kernels, template file)
KERNEL_TEMPLATES = {
    "HopperAttentionForward": ("sm90.fwd", "sm90.config", "sm90_fwd.py.jinja"),
    "HopperAttentionBackward": ("sm90.bwd", "sm90.bwd_config", "sm90_bwd.py.jinja"),
    "HopperAttentionDecode": ("sm90.decode", "sm90.decode_config", "sm90_decode.py.jinja"),
}


class EmittedKernel(BaseModel):
    """Generated source of one kernel module plus the name it is imported under."""

    model_config = ConfigDict(frozen=True)

    module_name: str
    template: str
    source: str


def templates_dir() -> Path:
    """Installed wheels ship the templates as package data (fa4gen/templates); a source checkout
    keeps them in the repository's top-level templates/."""
    packaged = Path(__file__).parent / "templates"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "templates"


def _comment(text: str) -> str:
    """Comment lines that hold nothing but printable ASCII: Python ends a comment at characters
    str.splitlines does not split on, so only escaped text is safe whatever the source."""
    lines = text.rstrip("\n").splitlines()
    return "\n".join(("#   " + _escaped(line)).rstrip() for line in lines)


def _py_literal(value) -> str:
    """A config value as Python source: numbers, booleans, None, and strings or tuples of strings
    the config validated (escaped all the same)."""
    if value is None or isinstance(value, (bool, int)):
        return repr(value)
    if isinstance(value, float):
        return _float_literal(value)
    if isinstance(value, str):
        return ascii(value)
    if isinstance(value, tuple) and all(isinstance(item, str) for item in value):
        return "(" + "".join(f"{ascii(item)}, " for item in value) + ")"
    raise ValueError(f"refusing to emit a config value of type {type(value).__name__}")


def _py_string(text: str) -> str:
    """A Python string literal of text (a docstring, say): escaped, never pasted raw."""
    return ascii(str(text))


def _float_literal(value: float) -> str:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"cannot emit non-finite constant {value}")
    return repr(value)


def _identifier(name: str) -> str:
    """A name spliced into code as a token: checked here too, not only by the spec's validation."""
    if not (isinstance(name, str) and name.isascii() and name.isidentifier() and not keyword.iskeyword(name)):
        raise ValueError(f"refusing to emit {name!r}: not an ASCII identifier")
    return name


@lru_cache(maxsize=1)
def _environment():
    import jinja2  # deferred: a cache hit never renders

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["comment"] = _comment
    env.filters["float_literal"] = _float_literal
    env.filters["py_string"] = _py_string
    env.filters["py_literal"] = _py_literal
    env.filters["identifier"] = _identifier
    return env


@dataclass(frozen=True)
class AuxReadCode:
    """One read of a trainable tensor in the score modifier, rendered for the backward kernel."""

    grad: str  # the kernel argument holding the tensor's gradient (variants.grad_name)
    text: str  # the read as written, for the docstring
    indices: tuple[str, ...]
    derivative: str  # d score_mod / d (the element read)
    uniform: bool  # the element depends only on b, h, sizes and scalars: one per step


# what stays the same over a step of the backward (one query head of one batch entry)
STEP_UNIFORM = frozenset({"b", "h", "seqlen_q", "seqlen_k"})


def _aux_reads(spec: AttentionSpec, lowered, names: dict[str, str]) -> list[AuxReadCode]:
    from fa4gen.expr_grad import aux_gradient
    from fa4gen.variants import grad_name

    uniform = STEP_UNIFORM | set(spec.scalars)
    reads = []
    for extra in lowered.trainable:
        for read in aux_gradient(lowered.score, extra.name).reads:
            reads.append(
                AuxReadCode(
                    grad=grad_name(extra.name),
                    text=f"{extra.name}[{', '.join(index.text for index in read.indices)}]",
                    indices=tuple(render_cute(index, names) for index in read.indices),
                    derivative=render_cute(read.derivative, names),
                    uniform=all(index.uses <= uniform for index in read.indices),
                )
            )
    return reads


def emit(spec: AttentionSpec, plan: Plan, module_name: str = "fa4gen_kernel") -> EmittedKernel:
    kernel_module, config_module, template_name = KERNEL_TEMPLATES[plan.kernel]
    template = _environment().get_template(template_name)
    lowered = lower(spec).for_backward() if plan.is_backward else lower(spec)
    # aux tensors and scalars live on the kernel's run-time argument holder
    names = {extra.name: f"args.{extra.name}" for extra in lowered.extras}
    score_grad_code = None  # the backward's d(score_mod)/d(score), derived from the parsed tree
    aux_reads: list[AuxReadCode] = []  # and per read of a trainable tensor, its derivative
    if plan.is_backward and lowered.score is not None:
        from fa4gen.expr_grad import derivative

        score_grad_code = render_cute(derivative(lowered.score, "score"), names)
        aux_reads = _aux_reads(spec, lowered, names)
    source = template.render(
        version=__version__,
        spec=spec,
        plan=plan,
        spec_yaml=dump_spec(spec.canonicalized()),
        kernel_module=kernel_module,
        config_module=config_module,
        config_class=type(plan.config).__name__,
        softcap=spec.softcap,
        scale=spec.scale,
        score_code=None if lowered.score is None else render_cute(lowered.score, names),
        score_text=None if lowered.score is None else lowered.score.text,
        score_grad_code=score_grad_code,
        mask_code=None if lowered.mask is None else render_cute(lowered.mask, names),
        mask_text=None if lowered.mask is None else lowered.mask.text,
        extras=lowered.extras,
        aux_reads=aux_reads,
    )
    if not source.isascii():  # every user-derived part is a validated token or escaped text
        raise ValueError("emitted source is not ASCII: a spec value reached the template unescaped")
    return EmittedKernel(module_name=module_name, template=template_name, source=source)
