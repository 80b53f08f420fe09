"""benchmarks/spec_bound.py: the best a speculative batched round can do against a plain one."""

from __future__ import annotations

import json

import pytest
from helpers import benchmark_script

sb = benchmark_script("spec_bound")


def test_rows_cost_nothing_more_and_drafts_are_free_then_every_draft_pays():
    # a forward of any number of rows costs one row's time (a GPU's regime), drafts are free: the
    # best round drafts as much as the 64-row bound allows and commits 1 + a + ... + a^k per sequence
    flat = {1: 10.0, 64: 10.0}
    free = {1: 0.0, 16: 0.0}
    rate, rows, plain = sb.best_round(4, 0.5, flat, free)
    assert rows == 64 and plain == pytest.approx(4 / 10.0)
    assert rate / plain == pytest.approx(sb.expected_tokens(0.5, 15))


def test_drafts_that_are_never_accepted_never_pay():
    linear = {1: 10.0, 64: 640.0}
    cheap = {1: 1.0, 16: 16.0}
    for n in (1, 4, 16):
        rate, rows, plain = sb.best_round(n, 0.0, linear, cheap)
        assert rate < plain  # each extra row costs and commits nothing


def test_an_uneven_number_of_drafts_is_spread_over_the_sequences():
    # 3 sequences, 5 rows: 2 drafts, one each for two sequences (not two for one)
    assert sb.expected_tokens(0.9, 1) * 2 + 1 > sb.expected_tokens(0.9, 2) + 2
    target = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0, 6: 100.0}
    draft = {1: 0.0, 3: 0.0}
    rate, rows, _ = sb.best_round(3, 0.9, target, draft, max_rows=6)
    assert rows == 5 and rate == pytest.approx(sb.expected_tokens(0.9, 1) * 2 + 1)


def test_interpolation_between_and_beyond_the_measured_sizes():
    costs = {1: 10.0, 4: 40.0, 8: 48.0}
    assert sb.interp(costs, 2) == pytest.approx(20.0) and sb.interp(costs, 6) == pytest.approx(44.0)
    assert sb.interp(costs, 16) == pytest.approx(96.0)


def test_the_script_measures_both_models_and_writes_its_table(tiny_target, tiny_draft, tmp_path, capsys):
    out = tmp_path / "b.json"
    assert sb.main([str(tiny_target), "-md", str(tiny_draft), "-t", "1", "--clients", "1,2", "--alphas", "0.5",
                    "--rounds", "1", "--reps", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["n"], r["alpha"]) for r in data["bound"]] == [(1, 0.5), (2, 0.5)]
    assert set(map(int, data["rounds"][0]["draft_ms"])) == {1, 2}
    assert len(data["rounds"][0]["target_ms"]) == len(sb.TARGET_ROWS)
    assert "spec / plain" in capsys.readouterr().out


@pytest.mark.parametrize("invariant", [True, False])
def test_the_target_is_loaded_as_mars_loads_it(smollm2, tiny_draft, tmp_path, monkeypatch, invariant):
    # repacked or not as the learned store's verdict for this (file, build) says, as mars serve loads it
    from mars_local.speculate.learned import default_store
    from mars_local.speculate.repack import repack_key

    monkeypatch.setenv("MARS_STATE_DIR", str(tmp_path / "state"))
    store = default_store()
    store.put(repack_key(smollm2), {"invariant": invariant})
    store.save()
    out = tmp_path / "b.json"
    assert sb.main([str(smollm2), "-md", str(tiny_draft), "-t", "1", "--clients", "1", "--alphas", "0.5",
                    "--rounds", "1", "--reps", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rounds"][0]["target_repacked"] is invariant
