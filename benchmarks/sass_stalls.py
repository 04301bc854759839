"""Compare two kernels' main loops from Nsight Compute's per-instruction SASS tables (the CSV
files ``ncu_counters.py --out-dir`` writes on the GPU machine):

    python benchmarks/sass_stalls.py OURS.csv PEER.csv [TOP]

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

STALLS = ("stall_barrier", "stall_dispatch", "stall_long_sb", "stall_math", "stall_mio", "stall_not_selected",
          "stall_selected", "stall_short_sb", "stall_wait", "stall_branch_resolving", "stall_no_inst")


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
            found.append(Instruction(index, text, _number(row[column["# Samples"]]),
                                     _number(row[column["Instructions Executed"]]),
                                     {s: _number(row[column[s]]) for s in STALLS}))
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
        print(f"{label}: {path}: {len(loop)} instructions in the loop, {iterations} warp iterations, "
              f"{in_loop / iterations * 1000:.1f} samples per 1000 iterations ({in_loop / total:.0%} of all samples)")
    counts = {label: collections.Counter(i.opcode for i in loop) for label, (loop, _) in loops.items()}
    samples = {label: collections.Counter() for label in loops}
    for label, (loop, _) in loops.items():
        for i in loop:
            samples[label][i.opcode] += i.samples
    opcodes = sorted(set(counts["ours"]) | set(counts["peer"]),
                     key=lambda op: -(samples["ours"][op] + samples["peer"][op]))
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


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    compare(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 20)
