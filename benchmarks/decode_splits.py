"""Time the decode kernel at forced split-KV counts, to check ``decode_splits``' choice (on the GPU).

    python benchmarks/decode_splits.py [--out rows.json]
    python benchmarks/decode_splits.py --short [--out rows.json]   # B = 1 over 1k-4k keys, down to a key tile per split
    python benchmarks/decode_splits.py --rule [--out rows.json]    # the rule's other inputs: rows, B, long caches

For each cell (benchmarks/decode.py's: Llama-3-8B heads, causal, contiguous cache read through
``seqused_k``) the kernel runs with each split count up to one per 4 key tiles, timed as the
decode harness times (queued behind a GPU spin, rotating order), next to the count the
heuristic picks. Split counts are a run-time argument: nothing recompiles.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode  # noqa: E402

import fa4gen  # noqa: E402
import fa4gen.kernels.sm90.decode_splits as split_policy  # noqa: E402

CELLS = [
    decode.Cell(1, 1, 1024, 4),
    decode.Cell(1, 1, 4096, 4),
    decode.Cell(1, 1, 32768, 4),
    decode.Cell(1, 1, 131072, 4),
    decode.Cell(8, 1, 1024, 4),
    decode.Cell(8, 1, 4096, 4),
    decode.Cell(1, 4, 32768, 8),
    decode.Cell(8, 16, 1024, 8),
    # 64 packed rows and more (compute-bound steps): do two CTAs per SM pay for their merge?
    decode.Cell(1, 16, 1024, 4),
    decode.Cell(8, 16, 1024, 4),
    decode.Cell(8, 16, 4096, 4),
    decode.Cell(8, 4, 4096, 4),
    decode.Cell(8, 16, 4096, 8),
]
# B = 1 over short caches, where a launch is a few microseconds of latency (cuDNN's cells)
SHORT_CELLS = [decode.Cell(1, 1, sk, g) for sk in (1024, 4096) for g in (1, 4, 8)] + [decode.Cell(1, 4, 4096, 8)]
# what the short cells leave open: tiles of 8-128 packed rows over long and short caches, B 2-4
RULE_CELLS = [
    decode.Cell(1, 1, 32768, 8),
    decode.Cell(1, 4, 1024, 4),
    decode.Cell(1, 4, 4096, 4),
    decode.Cell(1, 4, 1024, 8),
    decode.Cell(1, 16, 4096, 4),
    decode.Cell(1, 16, 32768, 4),
    decode.Cell(1, 16, 1024, 8),
    decode.Cell(1, 16, 4096, 8),
    decode.Cell(1, 16, 32768, 8),
    decode.Cell(2, 1, 1024, 4),
    decode.Cell(4, 1, 1024, 4),
    decode.Cell(2, 4, 4096, 8),
]
COUNTS = (1, 2, 4, 8, 12, 16, 24, 33, 48, 66, 96, 128)


def run_cell(cell: decode.Cell, tiles_per_split: int = 4) -> dict:
    kernel = fa4gen.compile(decode.specs_of([cell])[0])
    tile_n = kernel.decode_kernel(cell.seqlen_q).plan.config.tile_n
    counts = [c for c in COUNTS if c <= max(1, cell.seqlen_k // tile_n // tiles_per_split)]
    inputs = decode.make_inputs(cell)
    heuristic = split_policy.decode_splits
    functions = {}
    for count in (None, *counts):
        split_fn = heuristic if count is None else (lambda *sizes, c=count: c)

        def launch(q, k, v, lens, table, split_fn=split_fn):
            split_policy.decode_splits = split_fn
            try:
                return kernel(q, k, v, seqused_k=lens)
            finally:
                split_policy.decode_splits = heuristic

        functions["auto" if count is None else str(count)] = launch
    timed = decode.time_queued(functions, inputs)
    return {"label": cell.label, "us": {name: ms * 1e3 for name, ms in timed.items() if isinstance(ms, float)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--short", action="store_true", help="SHORT_CELLS, down to one key tile per split")
    parser.add_argument("--rule", action="store_true", help="RULE_CELLS, down to one key tile per split")
    args = parser.parse_args()
    rows = []
    cells = SHORT_CELLS if args.short else RULE_CELLS if args.rule else CELLS
    for cell in cells:
        rows.append(run_cell(cell, 1 if args.short or args.rule else 4))
        best = min(rows[-1]["us"], key=rows[-1]["us"].get)
        times = " ".join(f"{name}={us:.1f}" for name, us in rows[-1]["us"].items())
        print(f"{cell.label:40} best {best:>4}  {times}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
