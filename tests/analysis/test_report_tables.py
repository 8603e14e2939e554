"""The report's tables for people: titles with units, the per-phase table turned (phases as
rows) when a row per configuration would be wider than 8 columns, empty sections as one line."""

from __future__ import annotations

from kfac_hpc.analysis.collect import collect
from kfac_hpc.analysis.output import build_tables
from kfac_hpc.analysis.report import build_blocks, to_markdown
from kfac_hpc.analysis.schema import PHASES
from tests.helpers.synthetic_runs import SyntheticRun, write_sweep


def _blocks(root, phases, nodes=(1, 2)):
    runs = [
        SyntheticRun(f"{'kfac' if k else 'sgd'}-n{n}", n, 0.05, phases, kfac=k, steps=20)
        for n in nodes
        for k in (False, True)
    ]
    write_sweep(root, runs)
    collection = collect(root)
    return build_blocks(collection, build_tables(collection), {}, None, None)


def _phase_table(blocks):
    (table,) = [b for b in blocks if b.kind == "table" and b.text.startswith("Time per step")]
    return table


def test_few_phases_are_columns_with_their_unit(tmp_path):
    table = _phase_table(_blocks(tmp_path, {"forward": 0.02, "grad_allreduce": 0.0004}))
    assert table.titles == ["configuration", "nodes", "forward (ms)", "grad allreduce (µs)"]
    assert table.cells[0] == ["SGD", "1", "20.0", "400"]


def test_all_twelve_phases_turn_into_rows_in_one_unit(tmp_path):
    phases = {p: 0.001 * (i + 1) for i, p in enumerate(PHASES)}  # 1 .. 12 ms
    table = _phase_table(_blocks(tmp_path, phases))
    assert table.titles == [
        "phase",
        "SGD, 1 node",
        "SGD, 2 nodes",
        "K-FAC, grad workers 1/1, 1 node",
        "K-FAC, grad workers 1/1, 2 nodes",
    ]
    assert "(ms," in table.text
    assert [row[0] for row in table.cells] == [p.replace("_", " ") for p in PHASES]
    assert table.cells[1] == ["forward", "2.00", "2.00", "2.00", "2.00"]


def test_sections_without_data_are_one_line_saying_why(tmp_path):
    markdown = to_markdown(_blocks(tmp_path, {"forward": 0.02}), tmp_path)
    assert "No target was set: pass `--target-accuracy` or `--target-loss`." in markdown
    assert "No point was requeued: each ran in one attempt." in markdown
    assert "No file problem was worked around." in markdown
    assert "e-0" not in markdown and "time_to_target_s" not in markdown
