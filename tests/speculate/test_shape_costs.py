"""benchmarks/shape_costs.py: a batched forward's cost per shape, first use apart."""

from __future__ import annotations

import json

import pytest

from helpers import benchmark_script

sc = benchmark_script("shape_costs")


def test_shapes_parse_and_bad_ones_are_refused():
    assert sc.parse_shapes("4x1, 3x2") == [(4, 1), (3, 2)]
    for bad in ("4", "0x2", "3x", "ax2", "3x2x1"):
        with pytest.raises(ValueError):
            sc.parse_shapes(bad)


def test_every_shape_is_timed_in_order_and_reported(tiny_target, tmp_path, capsys):
    rows = sc.shape_costs(str(tiny_target), [(3, 2), (1, 5), (3, 2)], reps=2, threads=1, depth=20)
    assert [(r["seqs"], r["rows_each"], r["rows"]) for r in rows] == [(3, 2, 6), (1, 5, 5), (3, 2, 6)]
    assert all(r["first_s"] > 0 and r["median_s"] > 0 for r in rows)
    out = tmp_path / "s.json"
    assert sc.main([str(tiny_target), "--shapes", "2x2,1x3", "--reps", "1", "-t", "1", "--depth", "10",
                    "--json", str(out)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "rows: first" in ln]
    assert len(lines) == 2 and "after" not in lines[0]
    data = json.loads(out.read_text())
    assert [s["rows"] for s in data["shapes"]] == [4, 3] and data["shapes"][0]["median_s"] is None


def test_a_bad_shape_is_one_line_and_exit_2(tiny_target, capsys):
    assert sc.main([str(tiny_target), "--shapes", "3by2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shape_costs: ") and len(err.strip().splitlines()) == 1
