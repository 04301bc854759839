"""Compare two kernels' main loops from Nsight Compute's per-instruction SASS tables (the CSV
files ``ncu_counters.py --out-dir`` writes on the GPU machine), or place one kernel's time by
how often its code runs:

    python benchmarks/sass_stalls.py OURS.csv PEER.csv [TOP]
    python benchmarks/sass_stalls.py counts KERNEL.csv [GROUPS [TOP]]

``counts`` groups the instructions by their execution count (code that runs once per key tile,
once per query tile, once per CTA, ... has one count each) and prints each group's share of the
stall samples, its instruction range and samples per execution, then the TOP instructions of
the GROUPS heaviest groups with their largest stall reasons. Samples per execution of a query
tile's prologue against the main loop's say what a query tile costs beyond its key tiles.

The main loop is the set of instructions executed most often (every one of its instructions
runs once per warp and key tile). For each kernel it prints the loop's size, its warp-stall
samples per iteration, and per opcode the count in the loop and the samples per thousand
iterations, side by side; then the TOP instructions of each loop by stall samples with their
three largest stall reasons. Samples per iteration compare the time one key tile takes (both
kernels keep the same warps resident); divide by the key-tile width to compare per key.
"""

from __future__ import annotations

import collections
import csv
import sys
from dataclasses import dataclass

STALLS = (
    "stall_barrier",
    "stall_dispatch",
    "stall_long_sb",
    "stall_math",
    "stall_mio",
    "stall_not_selected",
    "stall_selected",
    "stall_short_sb",
    "stall_wait",
    "stall_branch_resolving",
    "stall_no_inst",
)


@dataclass(frozen=True)
class Instruction:
    index: int
    text: str
    samples: int
    executed: int
    stalls: dict[str, int]

    @property
    def opcode(self) -> str:
        words = self.text.split()
        word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        return word.split(".")[0]


def _number(text: str) -> int:
    try:
        return int(text.replace(",", ""))
    except ValueError:
        return 0


def load(path: str) -> list[Instruction]:
    """The instructions of the CSV's kernel (its first row names the kernel, the second the columns)."""
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    header = rows[1]
    column = {name: header.index(name) for name in ("Source", "# Samples", "Instructions Executed", *STALLS)}
    found = []
    for index, row in enumerate(rows[2:]):
        text = row[column["Source"]].strip()
        if text:
            found.append(
                Instruction(
                    index,
                    text,
                    _number(row[column["# Samples"]]),
                    _number(row[column["Instructions Executed"]]),
                    {s: _number(row[column[s]]) for s in STALLS},
                )
            )
    return found


def main_loop(instructions: list[Instruction]) -> tuple[list[Instruction], int]:
    """(the loop's instructions, its iterations): those executed most often."""
    iterations = max(i.executed for i in instructions)
    return [i for i in instructions if i.executed == iterations], iterations


def compare(ours: str, peer: str, top: int = 20) -> None:
    loops = {}
    for label, path in (("ours", ours), ("peer", peer)):
        instructions = load(path)
        loop, iterations = main_loop(instructions)
        loops[label] = (loop, iterations)
        total = sum(i.samples for i in instructions)
        in_loop = sum(i.samples for i in loop)
        print(
            f"{label}: {path}: {len(loop)} instructions in the loop, {iterations} warp iterations, "
            f"{in_loop / iterations * 1000:.1f} samples per 1000 iterations ({in_loop / total:.0%} of all samples)"
        )
    counts = {label: collections.Counter(i.opcode for i in loop) for label, (loop, _) in loops.items()}
    samples = {label: collections.Counter() for label in loops}
    for label, (loop, _) in loops.items():
        for i in loop:
            samples[label][i.opcode] += i.samples
    opcodes = sorted(
        set(counts["ours"]) | set(counts["peer"]), key=lambda op: -(samples["ours"][op] + samples["peer"][op])
    )
    print(f"\n{'opcode':12} {'ours':>5} {'peer':>5} {'ours/1k it':>11} {'peer/1k it':>11}")
    for op in opcodes:
        per = {label: samples[label][op] / loops[label][1] * 1000 for label in loops}
        print(f"{op:12} {counts['ours'][op]:5d} {counts['peer'][op]:5d} {per['ours']:11.1f} {per['peer']:11.1f}")
    for label, (loop, iterations) in loops.items():
        print(f"\n{label}: the loop's {top} instructions with the most stall samples (per 1000 iterations)")
        for i in sorted(sorted(loop, key=lambda i: -i.samples)[:top], key=lambda i: i.index):
            reasons = sorted(((n, s[6:]) for s, n in i.stalls.items()), reverse=True)[:3]
            shown = ", ".join(f"{name} {n / iterations * 1000:.1f}" for n, name in reasons if n)
            print(f"{i.index:6d} {i.samples / iterations * 1000:7.1f}  {i.text[:58]:58}  {shown}")


def _reasons(i: Instruction, scale: float) -> str:
    reasons = sorted(((n, s[6:]) for s, n in i.stalls.items()), reverse=True)[:3]
    return ", ".join(f"{name} {n * scale:.2f}%" for n, name in reasons if n)


def by_count(path: str, groups: int = 4, top: int = 12) -> None:
    """The kernel's stall samples by the execution count of its instructions (see the docstring)."""
    instructions = load(path)
    total = sum(i.samples for i in instructions) or 1
    grouped = collections.defaultdict(list)
    for i in instructions:
        grouped[i.executed].append(i)
    ranked = sorted(grouped.items(), key=lambda item: -sum(i.samples for i in item[1]))
    print(f"{path}: {len(instructions)} instructions, {total} stall samples")
    print(f"{'executions':>11} {'instrs':>6} {'first':>6} {'last':>6} {'samples':>8} {'per 1k exec':>11}")
    for executed, members in ranked:
        samples = sum(i.samples for i in members)
        if samples / total < 0.001:
            continue
        per = samples / executed * 1000 if executed else 0.0
        print(
            f"{executed:11d} {len(members):6d} {members[0].index:6d} {members[-1].index:6d} "
            f"{samples / total:8.2%} {per:11.2f}"
        )
    scale = 100 / total
    for executed, members in ranked[:groups]:
        print(f"\nexecuted {executed} times: the {top} instructions with the most samples (% of all)")
        for i in sorted(sorted(members, key=lambda i: -i.samples)[:top], key=lambda i: i.index):
            print(f"{i.index:6d} {i.samples * scale:6.2f}%  {i.text[:58]:58}  {_reasons(i, scale)}")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "counts":
        by_count(sys.argv[2], *(int(a) for a in sys.argv[3:5]))
    elif len(sys.argv) >= 3:
        compare(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 20)
    else:
        sys.exit(__doc__)
