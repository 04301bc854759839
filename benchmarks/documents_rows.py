"""Packed documents: how a query tile's rows get their key ranges, timed on the GPU.

    python benchmarks/documents_rows.py        # on the GPU, with the variants table's documents

The planner's documents kernel, on the documents of benchmarks/variants.py, in two ways on the
same inputs and in alternating order (6 timings each): as built (a tile inside one document
computes its rows' ranges from its document's bounds, `runtime.document_tables` columns 5-8),
and with every tile flagged as spanning documents, so each row's range is loaded from the table
(the kernel of session 7 did this for every tile). Both must give the same output.
"""

from __future__ import annotations

import sys
from pathlib import Path

import fa4gen
from fa4gen import bench
from fa4gen.runtime import AttentionKernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import variants as V  # noqa: E402


class RowLoads(AttentionKernel):
    """The same kernel, its tables telling it that no tile lies inside one document (flagged once
    per table, as the tables themselves are built once: a copy per call would be timed too)."""

    _flagged: tuple = (None, None)

    def _document_tables(self, cu_seqlens_q, cu_seqlens_k, total: int):
        ranges, tiles = super()._document_tables(cu_seqlens_q, cu_seqlens_k, total)
        if self._flagged[0] is not tiles:
            flagged = tiles.clone()
            flagged[:, 5] = 0
            self._flagged = (tiles, flagged)
        return ranges, self._flagged[1]


def main() -> None:
    docs = next(v for v in V.variants() if v.spec.is_varlen)
    spec, q_heads = docs.spec, bench.HIDDEN // docs.spec.head_dim
    inputs = V.make_inputs(docs, q_heads // spec.qhead_per_kvhead, q_heads)
    args = docs.make_args(inputs)
    total = docs.batch * docs.seqlen
    flops = V.attention_flops(spec, 1, total, total, q_heads, args)
    built = fa4gen.compile(spec)
    kernels = {
        "as built": built,
        "row loads": RowLoads(spec=spec, plan=built.plan, function=built._function, key="rows", path=built.path),
    }
    tiles = built._document_tables(args["cu_seqlens_q"], args["cu_seqlens_k"], total)[1]
    print(f"{docs.name}: {tiles.shape[0]} query tiles, {int(tiles[:, 5].sum())} inside one document", flush=True)
    q, k, v = inputs[0]
    ref = built(q, k, v, **args).float()
    differ = (kernels["row loads"](q, k, v, **args).float() - ref).abs().max().item()
    print(f"max|row loads - as built| = {differ:.1e}", flush=True)
    timings = {name: [] for name in kernels}
    for turn in range(6):
        for name in list(kernels)[:: 1 if turn % 2 == 0 else -1]:
            run = kernels[name]
            timings[name].append(flops / bench.time_ms(lambda q, k, v, run=run: run(q, k, v, **args), inputs) / 1e9)
    for name, values in timings.items():
        print(f"{name:10} TFLOP/s {' '.join(f'{x:.0f}' for x in values)}", flush=True)
    print(f"as built / row loads = {sum(timings['as built']) / sum(timings['row loads']):.3f}", flush=True)


if __name__ == "__main__":
    main()
