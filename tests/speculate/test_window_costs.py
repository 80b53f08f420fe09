"""benchmarks/window_costs.py: forward costs per window size, repeated and in turn."""

from __future__ import annotations

from helpers import benchmark_script

wc = benchmark_script("window_costs")


def test_sizes_in_turn_are_timed_besides_sizes_repeated(tiny_target):
    r = wc.forward_costs(str(tiny_target), [1, 3, 5], reps=2, threads=1, prompt_len=40, interleave=True)
    assert set(r["forward_s"]) == set(r["interleaved_s"]) == {1, 3, 5}
    assert all(t > 0 for t in [*r["forward_s"].values(), *r["interleaved_s"].values()])
    assert "interleaved_s" not in wc.forward_costs(str(tiny_target), [1, 2], reps=1, threads=1, prompt_len=40)


def test_the_table_shows_the_in_turn_column_only_when_asked(tiny_target, capsys):
    assert wc.main([str(tiny_target), "--windows", "1,4", "--reps", "2", "-t", "1", "--prompt-len", "40",
                    "--interleave"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("w=")]
    assert len(lines) == 2 and all("in turn:" in ln for ln in lines)
    assert wc.main([str(tiny_target), "--windows", "1,4", "--reps", "1", "-t", "1", "--prompt-len", "40"]) == 0
    assert "in turn" not in capsys.readouterr().out
