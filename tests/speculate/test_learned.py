"""The learned-state cache: what the adaptive controller learned survives the process."""

from __future__ import annotations

import json

import pytest

from mars_local.speculate.adaptive import AdaptiveK
from mars_local.speculate.learned import LearnedStore, file_fingerprint


def test_store_round_trip_and_atomic_file(tmp_path):
    st = LearnedStore(tmp_path / "sub" / "learned.json")
    assert st.get("x") is None
    st.put("x", {"time": {"1": [0.5, 2.0]}})
    assert st.save()
    again = LearnedStore(tmp_path / "sub" / "learned.json")
    assert again.get("x") == {"time": {"1": [0.5, 2.0]}}
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["learned.json"]  # no temp file left behind
    assert again.clear() == 1 and not (tmp_path / "sub" / "learned.json").exists()


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 99, "entries": {}}), "[]"])
def test_a_damaged_store_is_ignored_and_replaced(tmp_path, content):
    p = tmp_path / "learned.json"
    p.write_text(content)
    st = LearnedStore(p)
    assert st.get("x") is None and st.problem
    st.put("x", {"a": 1})
    assert st.save()
    assert LearnedStore(p).get("x") == {"a": 1}


def test_an_unwritable_store_does_not_fail(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    st = LearnedStore(blocker / "learned.json")  # its folder would be a file
    st.put("x", {"a": 1})
    assert st.save() is False


def test_fingerprint_changes_with_the_file(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF" + b"0" * 10)
    a = file_fingerprint(p)
    p.write_bytes(b"GGUF" + b"0" * 11)
    assert file_fingerprint(p) != a and a.startswith("m.gguf@")


def test_controller_state_exports_and_imports_with_capped_weight():
    a = AdaptiveK(k_max=8)
    for _ in range(3):
        a.observe(0, 0, 0.010, 0.0)
        a.observe(4, 4, 0.014, 0.004)
    for _ in range(200):
        a.observe_shadow(True, key="p8")
    b = AdaptiveK(k_max=8)
    b.import_state(json.loads(json.dumps(a.export_state())))
    assert b.target_cost(1) == pytest.approx(a.target_cost(1))
    assert b.target_cost(5) == pytest.approx(a.target_cost(5))
    assert b.draft_cost == pytest.approx(a.draft_cost)
    assert b.acceptance("p8") == pytest.approx(a.acceptance("p8"), abs=0.05)
    assert sum(b._counts["p8"]) <= 20.0 + 1e-9  # new observations soon outweigh the old
    for _ in range(60):
        b.observe_shadow(False, key="p8")
    assert b.acceptance("p8") < 0.5


def test_import_ignores_malformed_state():
    c = AdaptiveK(k_max=4)
    c.import_state({"time": {"x": [1, 2]}, "draft": "nope", "counts": [[None, 1, 1]]})
    assert c.target_cost(1) is None and c._counts == {}


def test_store_keeps_the_most_recently_used_entries(tmp_path, monkeypatch):
    import mars_local.speculate.learned as L

    monkeypatch.setattr(L, "MAX_ENTRIES", 3)
    st = LearnedStore(tmp_path / "learned.json")
    for i in range(5):
        st.put(f"k{i}", {"i": i})
    st.put("k1", {"i": 1})  # used again: now the most recent
    assert st.save()
    assert list(LearnedStore(tmp_path / "learned.json").entries()) == ["k3", "k4", "k1"]


def test_clear_that_cannot_delete_is_one_error_and_keeps_the_entries(tmp_path):
    from mars_local.core.errors import MarsError

    p = tmp_path / "learned.json"
    p.mkdir()  # a folder where the file should be: unlink fails
    st = LearnedStore(p)
    st._data = {"k": {"a": 1}}
    with pytest.raises(MarsError, match="cannot delete"):
        st.clear()
    assert st.entries() == {"k": {"a": 1}}
