"""benchmarks/round_profile.py: a batched round's time split into decodes and the Python around them."""

from __future__ import annotations

import json

import pytest
from helpers import benchmark_script


def test_the_parts_of_a_round_add_up_to_its_wall_time(tiny_target, tiny_draft, tmp_path, capsys):
    """(--fixed-k: every round drafts; the tiny draft costs what the tiny target does, so the
    draft-length controller would rightly keep these rounds plain.)"""
    out = tmp_path / "r.json"
    rc = benchmark_script("round_profile").main([str(tiny_target), "-md", str(tiny_draft), "--parallel", "1,3",
                                                 "-n", "10", "-t", "1", "--fixed-k", "2", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["parallel"] for r in rows] == [1, 3]
    for r in rows:
        ms = r["ms_per_round"]
        assert r["tokens"] == 10 * r["parallel"] and r["rounds"] >= 1
        assert r["tokens_per_round"] == pytest.approx(r["tokens"] / r["rounds"])
        assert sum(ms.values()) == pytest.approx(r["wall_ms_per_round"], rel=1e-6)
        assert ms["windows"] > 0 and ms["prefill"] > 0 and ms["draft"] > 0 and ms["rest"] >= 0
        assert r["drafting_rounds"] > 0 and max(int(k) for k in r["k_rounds"]) == 2
    table = capsys.readouterr().out
    assert "| 3 |" in table and "rest (Python)" in table


def test_plain_rounds_have_no_draft_time(tiny_target, tmp_path):
    out = tmp_path / "r.json"
    assert benchmark_script("round_profile").main([str(tiny_target), "--parallel", "2", "-n", "6", "-t", "1",
                                                   "--serve-prompts", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["ms_per_round"]["draft"] == 0 and row["ms_per_round"]["windows"] > 0
    assert row["tokens"] == 12 and row["rounds"] >= 5  # a plain round adds one token a sequence (the first: the prompt's)


def test_bad_arguments_are_one_line_and_exit_2(tiny_target, tmp_path, capsys):
    mod = benchmark_script("round_profile")
    assert mod.main([str(tiny_target), "--parallel", "0"]) == 2
    assert mod.main([str(tiny_target), "--parallel", "16", "--fixed-k", "4"]) == 2  # 80 rows a round
    assert mod.main([str(tiny_target), "-md", str(tmp_path / "missing.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
