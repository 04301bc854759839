"""The decode benchmark's pure parts (benchmarks/decode.py), on the CPU: which cells a run times,
the bytes its TB/s and %HBM count, the page tables it reads through, and the report's ratios on
hand-made rows: the decode numbers in BENCHMARKS.md rest on them."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import decode  # noqa: E402
from decode import Cell  # noqa: E402


def test_full_grid_counts_cells_and_sets_aside_those_over_24_gb():
    full = decode.grid("full")
    # 4 B x 4 Sk x 3 Sq x 3 G x 3 layouts, plus chunked prefill at 2 Sk x 2 B
    assert len(full) == 4 * 4 * 3 * 3 * 3 + 4
    assert len({c.label for c in full}) == len(full)
    kept, skipped = decode.split_cells(full)
    # only B 64 and 128 at Sk 131072 pass 24 GB (34 and 69 GB): every Sq, G and layout of them
    assert {(c.batch, c.seqlen_k) for c in skipped} == {(64, 131072), (128, 131072)}
    assert len(skipped) == 2 * 3 * 3 * 3
    assert len(kept) + len(skipped) == len(full)
    assert Cell(128, 16, 32768, 8, "paged16") in kept  # 17.2 GB: the largest cell that runs
    chunked = [c for c in full if c.kind == "chunked"]
    assert {(c.batch, c.seqlen_q, c.seqlen_k, c.group, c.layout) for c in chunked} == {
        (b, 512, sk, 4, "contiguous") for b in (1, 8) for sk in (4096, 32768)
    }


def test_quick_grid_is_part_of_the_full_one_with_paged_pairs():
    quick = decode.grid("quick")
    assert len(quick) == 4 * 2 * 2 * 2 + 4 * 2 + 2
    assert {c.label for c in quick} <= {c.label for c in decode.grid("full")}
    assert decode.split_cells(quick)[1] == []
    paged = [c for c in quick if c.page_size]
    assert {(c.batch, c.seqlen_k, c.seqlen_q, c.group, c.page_size) for c in paged} == {
        (1, 32768, 1, 4, 16),
        (1, 32768, 1, 4, 128),
        (8, 32768, 1, 8, 16),
        (8, 32768, 1, 8, 128),
        (64, 4096, 1, 4, 16),
        (64, 4096, 1, 4, 128),
        (128, 4096, 1, 8, 16),
        (128, 4096, 1, 8, 128),
    }
    # each paged cell has its contiguous twin, for the paged-vs-contiguous line
    shapes = {(c.batch, c.seqlen_q, c.seqlen_k, c.group) for c in quick if c.layout == "contiguous"}
    assert all((c.batch, c.seqlen_q, c.seqlen_k, c.group) in shapes for c in paged)
    assert [c.label for c in quick if c.kind == "chunked"] == [
        "chunked/B1/Sq512/Sk4096/G4/contiguous",
        "chunked/B1/Sq512/Sk32768/G4/contiguous",
    ]
    assert [s.qhead_per_kvhead for s in decode.specs_of(quick)] == [4, 8]
    assert all(s.causal and s.head_dim == 128 for s in decode.specs_of(quick))


def test_labels_and_match_pin_numbers():
    cell = Cell(8, 1, 32768, 8, "paged16")
    assert cell.label == "decode/B8/Sq1/Sk32768/G8/paged16"
    assert (cell.page_size, cell.q_heads, cell.spec.qhead_per_kvhead) == (16, 64, 8)
    assert Cell(1, 1, 1024, 1).page_size is None
    quick = decode.grid("quick")
    # "B1/" is not "B128/", "Sq1/" is not "Sq16/"
    assert {c.batch for c in decode.select(quick, "B1/")} == {1}
    assert {c.layout for c in decode.select(quick, "paged16,paged128")} == {"paged16", "paged128"}
    assert decode.select(quick, "nothing-matches") == []
    both = decode.select(decode.grid("full"), "B1/+Sk4096/,B8/+paged16")
    assert both and all(("B1/" in c.label and "Sk4096/" in c.label) or "B8/" in c.label for c in both)
    assert {c.layout for c in both if c.batch == 8} == {"paged16"}
    assert {c.seqlen_k for c in both if c.batch == 1} == {4096}
    halves = decode.select(quick, part="1/2") + decode.select(quick, part="2/2")
    assert sorted(c.label for c in halves) == sorted(c.label for c in quick)


def test_kv_bytes_and_the_hbm_limit():
    # 1 x 1024 tokens x 8 heads x (128 + 128) x 2 bytes
    assert Cell(1, 1, 1024, 1).kv_bytes == 4 * 1024 * 1024
    # the same for any query length, group and layout: K and V are read once
    assert Cell(1, 16, 1024, 8, "paged128").kv_bytes == Cell(1, 1, 1024, 1).kv_bytes
    assert Cell(64, 1, 131072, 1).kv_bytes == 64 * 131072 * 8 * 256 * 2 > decode.MAX_KV_BYTES
    assert Cell(8, 1, 32768, 8).hbm_limit_us == pytest.approx(8 * 32768 * 4096 / 4.8e12 * 1e6)
    cell = Cell(8, 1, 32768, 8)  # 1.07 GB
    entry = decode.timing(cell, 0.25)  # 250 us
    assert entry["us"] == pytest.approx(250)
    assert entry["tbps"] == pytest.approx(cell.kv_bytes / 250e-6 / 1e12)
    assert entry["hbm_fraction"] == pytest.approx(entry["tbps"] / 4.8)


def test_page_table_is_a_scattered_permutation():
    generator = torch.Generator().manual_seed(0)
    table = decode.page_table(4, 64, generator)
    assert table.shape == (4, 64) and table.dtype == torch.int32
    assert torch.equal(table.flatten().sort().values, torch.arange(4 * 64, dtype=torch.int32))  # no page shared
    assert not torch.equal(table.flatten(), torch.arange(4 * 64, dtype=torch.int32))
    steps = table[:, 1:].long() - table[:, :-1].long()
    assert (steps == 1).float().mean() < 0.1  # scattered: consecutive tokens rarely on the next page
    same = decode.page_table(4, 64, torch.Generator().manual_seed(0))
    assert torch.equal(table, same)
    assert decode.pages_per_seq(Cell(1, 1, 4096, 1, "paged128")) == 32
    assert decode.pages_per_seq(Cell(1, 1, 4100, 1, "paged16")) == 257  # a last page partly used


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_input_set_shapes_and_random_data(layout):
    cell = Cell(2, 4, 64, 4, layout)
    q, k, v, lens, table = decode.input_set(cell, device="cpu", generator=torch.Generator().manual_seed(1))
    assert q.shape == (2, 4, 32, 128) and q.dtype == torch.bfloat16
    assert lens.dtype == torch.int32 and lens.tolist() == [64, 64]
    if layout == "contiguous":
        assert k.shape == v.shape == (2, 64, 8, 128) and table is None
    else:
        assert k.shape == v.shape == (2 * 4, 16, 8, 128) and table.shape == (2, 4)
    for t in (q, k, v):
        assert (t != 0).float().mean() > 0.99 and t.float().std() > 0.5


def test_causal_mask_aligns_to_the_end_of_the_cache():
    mask = decode.causal_mask(4, 10, dtype=torch.float32)
    assert mask.shape == (1, 1, 4, 10)
    visible = (mask[0, 0] == 0).sum(1).tolist()
    assert visible == [7, 8, 9, 10]  # the last query row sees every key
    assert mask[0, 0, 0, 7] == -math.inf and mask[0, 0, 0, 6] == 0


def _row(cell: Cell, **us: float | str) -> dict:
    """A run's row with these implementations' times in us (a string: its error)."""
    row = decode.cell_row(cell)
    for name in ("fa4gen", *decode.PEERS):
        got = us.get(name, "not installed")
        row[name] = {"error": got} if isinstance(got, str) else decode.timing(cell, got / 1e3)
    return row


def _rows() -> list[dict]:
    big = Cell(8, 1, 32768, 8)  # 1.07 GB: its HBM limit is 223.7 us
    return [
        _row(big, fa4gen=250.0, fa4=300.0, cudnn=500.0, sdpa_flash=400.0),  # 89% HBM
        _row(Cell(8, 1, 32768, 8, "paged16"), fa4gen=275.0, fa4=330.0),  # 81% HBM
        _row(Cell(8, 1, 32768, 8, "paged128"), fa4gen=250.0, fa4="AssertionError: boom"),  # 89% HBM
        _row(Cell(64, 1, 4096, 4), fa4gen=400.0, fa4=200.0, sdpa_flash=600.0),  # 1.07 GB, 56% HBM
        _row(Cell(1, 1, 1024, 1), fa4gen=10.0, cudnn=12.0),  # small: not in the HBM count
        _row(Cell(1, 512, 32768, 4), fa4gen=100.0, fa4=150.0),  # chunked: not a decode cell
        _row(Cell(1, 4, 4096, 4), fa4gen="ValueError: no"),
    ]


def test_report_ratios_best_peer_and_counts():
    rows = _rows()
    assert decode.speed_ratio(rows[0], "fa4") == pytest.approx(1.2)
    assert decode.speed_ratio(rows[2], "fa4") is None  # fa4 raised
    assert decode.speed_ratio(rows[6], "fa4") is None  # fa4gen raised
    assert decode.best_peer(rows[0]) == ("fa4", pytest.approx(300.0))
    assert decode.best_peer(rows[6]) == (None, None)
    assert decode.hbm_count(rows) == (2, 4)  # of the four decode cells of >= 1 GB fa4gen timed
    assert decode.paged_ratios(rows) == {
        "paged16": [pytest.approx(250 / 275)],
        "paged128": [pytest.approx(1.0)],
    }
    assert decode.paged_ratios(rows, "fa4") == {"paged16": [pytest.approx(300 / 330)]}
    lines = decode.summary_lines(rows)
    fa4 = [1.2, 1.2, 0.5, 1.5]  # its time / fa4gen's on the four cells both ran
    expected = math.exp(sum(map(math.log, fa4)) / 4)
    assert f"- fa4gen vs fa4 (its time / fa4gen's): min 0.50x, geometric mean {expected:.2f}x over 4 cells" in lines
    assert any(x.startswith("- fa4gen vs cudnn") and "min 1.20x" in x and "over 2 cells" in x for x in lines)
    best = [1.2, 1.2, 0.5, 1.2, 1.5]  # best peer: fa4, fa4, fa4, cudnn, fa4
    assert any(x.startswith("- fa4gen vs best peer") and f"{decode.geomean(best):.2f}x over 5" in x for x in lines)
    assert any("85% of HBM" in x and x.endswith(": 2 of 4") for x in lines)
    assert any(x.startswith("- fa4gen paged16 vs contiguous") and "min 0.91x" in x for x in lines)
    assert any(x.startswith("- fa4gen failed on 1 cells: decode/B1/Sq4/Sk4096/G4") for x in lines)


def test_report_table_rows():
    lines = decode.table_lines(_rows())
    assert lines[0].split(" | ")[-1] == "fa4gen / best peer |"
    assert len(lines) == 2 + len(_rows())
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    # case, B, Sq, Sk, G, layout, HBM limit, fa4gen us, TB/s, %HBM, fa4, cudnn, sdpa_flash, best, ratio
    assert cells == [
        "decode", "8", "1", "32768", "8", "contiguous", "223.7", "250.0", "4.29", "89",
        "300.0", "500.0", "400.0", "fa4", "1.20x",
    ]  # fmt: skip
    failed = [c.strip() for c in lines[-1].strip("|").split("|")]
    assert failed[7:] == ["-"] * 8


def test_report_reads_rows_files(tmp_path, capsys):
    import json

    env = {"date": "2026-01-01", "device": "H200", "torch": "2", "cuda": "13", "cudnn": 9, "flash-attn-4": "b36"}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"environment": {**env, "fa4gen": "0"}, "rows": _rows()}))
    decode.main(["report", str(path)])
    out = capsys.readouterr().out
    assert out.startswith("Measured 2026-01-01 on H200")
    assert "| decode | 64 | 1 | 4096 | 4 | contiguous |" in out
    assert "- decode cells with >= 1 GB of K/V reaching >= 85% of HBM (4.8 TB/s): 2 of 4" in out


def test_compare_pairs_base_and_new_runs_in_abba_order(tmp_path, capsys):
    import json

    cell, other = Cell(8, 16, 4096, 8), Cell(1, 1, 1024, 4)

    def run(ours: float, theirs: float) -> dict:
        rows = [_row(cell, fa4gen=ours, fa4=theirs), _row(other, fa4gen=2 * ours, fa4="RuntimeError: x")]
        return {"environment": {}, "rows": rows}

    # base, new, new, base: fa4gen 1.5x faster in the new runs, fa4 the same in all four
    runs = [run(60.0, 50.0), run(40.0, 50.0), run(40.0, 50.0), run(60.0, 50.0)]
    paths = []
    for i, found in enumerate(runs):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(found))
    decode.main(["compare", *map(str, paths)])
    out = capsys.readouterr().out
    assert f"| {cell.label} | 60.0 | 40.0 | 1.500x | 1.000 |" in out
    assert f"| {other.label} | 120.0 | 80.0 | 1.500x | - |" in out  # fa4 failed there: no ratio
    assert "- new vs base: min 1.500x, max 1.500x, geometric mean 1.500x over 2 cells" in out
    # in the other order the figure inverts: which runs are the base is positional
    decode.main(["compare", str(paths[1]), str(paths[0])])
    assert "geometric mean 0.667x over 2 cells" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        decode.main(["compare", str(paths[0]), str(paths[1]), str(paths[2])])
