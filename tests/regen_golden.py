"""Regenerate the golden emitter outputs in tests/golden/ from the spec files in specs/.

    python tests/regen_golden.py            # rewrite every golden (and remove stale ones)
    python tests/regen_golden.py --check    # only report which goldens are out of date (exit 1)

Each specs/<stem>.yaml becomes tests/golden/<stem>.<arch>.py holding exactly
``fa4gen.emit(spec, fa4gen.plan(spec, arch)).source``, and for each range of query lengths that
the planner gives another plan (``planner.seqlen_splits``), tests/golden/<stem>.<label>.<arch>.py
with that plan's source, and for a spec with a backward, tests/golden/<stem>.backward.<arch>.py
(the backward's plan, for the spec with its LSE: what autograd builds). Review the diff before
committing: a golden change is a change of the generated kernel code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import fa4gen
from fa4gen.api import training_spec
from fa4gen.planner import backward_plan, backward_problem, seqlen_splits

ROOT = Path(__file__).resolve().parent.parent
SPECS_DIR = ROOT / "specs"
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
ARCHES = ("sm_90a",)


def golden_path(stem: str, arch: str, label: str = "") -> Path:
    return GOLDEN_DIR / f"{stem}{'.' + label if label else ''}.{arch}.py"


def golden_plans(spec: fa4gen.AttentionSpec, arch: str) -> dict[str, tuple[fa4gen.AttentionSpec, fa4gen.Plan]]:
    """The (spec, plan) pairs goldens render, by label: "" for the planner's, then one per length
    range, then "backward" where the spec has one."""
    plans = {"": (spec, fa4gen.plan(spec, arch))}
    plans.update({split.label: (spec, split.plan) for split in seqlen_splits(spec, arch)})
    if not backward_problem(spec):
        plans["backward"] = (training_spec(spec), backward_plan(training_spec(spec), arch))
    return plans


def expected_goldens() -> dict[Path, str]:
    wanted = {}
    for spec_path in sorted(SPECS_DIR.glob("*.yaml")):
        spec = fa4gen.load_spec(spec_path)
        for arch in ARCHES:
            for label, (emitted_spec, kernel_plan) in golden_plans(spec, arch).items():
                wanted[golden_path(spec_path.stem, arch, label)] = fa4gen.emit(emitted_spec, kernel_plan).source
    return wanted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report out-of-date goldens, write nothing")
    args = parser.parse_args(argv)

    wanted = expected_goldens()
    stale = sorted(set(GOLDEN_DIR.glob("*.py")) - set(wanted))
    changed = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]

    if args.check:
        for path in changed:
            print(f"out of date: {path.relative_to(ROOT)}")
        for path in stale:
            print(f"stale (no spec): {path.relative_to(ROOT)}")
        return 1 if changed or stale else 0

    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for path in changed:
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(ROOT)}")
    for path in stale:
        path.unlink()
        print(f"removed {path.relative_to(ROOT)}")
    print(f"{len(wanted)} goldens, {len(changed)} rewritten, {len(stale)} removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
