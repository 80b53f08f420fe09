"""benchmarks/strict_vs_plain.py: strict greedy speculation against plain greedy, token for token."""

from __future__ import annotations

import json

from helpers import benchmark_script


def _script():
    return benchmark_script("strict_vs_plain")


def test_first_difference_table():
    fd = _script().first_difference
    assert fd([1, 2, 3], [1, 2, 3]) is None
    assert fd([1, 2, 3], [1, 5, 3]) == 1
    assert fd([1, 2], [1, 2, 3]) == 2  # a shorter output differs where it stops
    assert fd([], []) is None


def test_strict_equals_plain_alone_and_batched_on_this_build(tiny_target, tiny_draft, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = _script().main([str(tiny_target), str(tiny_draft), "-n", "12", "--prompts", "3", "--draft-max", "3",
                         "--parallel", "3", "-t", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, capsys.readouterr().out
    assert [(s["draft_max"], s["parallel"]) for s in report["settings"]] == [(3, 1), (3, 3)]
    for s in report["settings"]:
        assert s["equal"] == s["prompts"] == 3 and s["first_difference"] == [None] * 3
        assert s["drafted"] > 0  # fixed k: it did speculate


def test_bad_arguments_are_one_line_and_exit_2(tiny_target, tmp_path, capsys):
    mod = _script()
    assert mod.main([str(tiny_target), str(tmp_path / "missing.gguf")]) == 2
    assert mod.main([str(tiny_target), str(tiny_target), "--draft-max", "four"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
