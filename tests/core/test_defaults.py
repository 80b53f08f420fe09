"""The one table of defaults and ranges (mars_local.core.defaults): the dataclasses read it, and
every broken rule is a MarsError naming its field (pure: no llama.cpp)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from mars_local import GenerateConfig, MarsError, SamplingParams, VerifyConfig
from mars_local.core.choices import drafter_for
from mars_local.core.defaults import DEFAULTS, SETTINGS, check


def test_the_dataclasses_defaults_are_the_tables():
    cfg, s, v = GenerateConfig(), SamplingParams(), VerifyConfig()
    for f in dataclasses.fields(GenerateConfig):
        if f.name in SETTINGS:
            assert getattr(cfg, f.name) == SETTINGS[f.name].default, f.name
    for f in dataclasses.fields(SamplingParams):
        assert getattr(s, f.name) == SETTINGS[f.name].default, f.name
    assert (v.method, v.theta, v.max_relaxed) == (DEFAULTS.verify, DEFAULTS.theta, DEFAULTS.max_relaxed)


def test_every_default_obeys_its_own_rule():
    for key, setting in SETTINGS.items():
        assert setting.rule(setting.default) is None, key


def test_defaults_reads_the_table_when_asked(monkeypatch):
    monkeypatch.setitem(SETTINGS, "max_tokens_chat", dataclasses.replace(SETTINGS["max_tokens_chat"], default=7))
    assert DEFAULTS.max_tokens_chat == 7
    with pytest.raises(AttributeError, match="no setting"):
        DEFAULTS.no_such_setting


BAD = [  # (GenerateConfig.make keywords, the field named, words of the message)
    (dict(max_tokens=0), "max_tokens", "the number of tokens to generate must be >= 1, or -1 for no limit"),
    (dict(max_tokens=-2), "max_tokens", "got -2"),
    (dict(stop=("",)), "stop", "stop needs a non-empty string"),
    (dict(stop="END"), "stop", "stop must be a sequence of non-empty strings"),
    (dict(repeat_penalty=0.0), "repeat_penalty", "repeat-penalty must be > 0 (1.0 = off)"),
    (dict(repeat_penalty=math.nan), "repeat_penalty", "repeat-penalty must be > 0"),
    (dict(repeat_last_n=-2), "repeat_last_n", "repeat-last-n must be >= -1"),
    (dict(presence_penalty=math.inf), "presence_penalty", "presence-penalty must be a finite number"),
    (dict(logprobs=21), "logprobs", "logprobs must be in 0..20, got 21"),
    (dict(draft_max=64), "draft_max", "draft-max must be in 0..63"),
    (dict(draft_min=9), "draft_min", "draft-min must be in [0, draft-max=8], got 9"),
    (dict(draft_p_min=1.5), "draft_p_min", "draft-p-min must be in [0, 1]"),
    (dict(draft_sampling="maybe"), "draft_sampling", "draft-sampling must be greedy or sample"),
    (dict(theta=0.0), "theta", "theta must be in (0, 1], got 0.0"),
    (dict(verify="loose"), "verify", "verify must be strict or mars"),
    (dict(max_relaxed=-1), "max_relaxed", "max-relaxed must be >= 0"),
    (dict(temperature=-1.0), "temperature", "temperature must be a finite number >= 0"),
    (dict(top_k=-1), "top_k", "top-k must be >= 0"),
    (dict(top_p=0.0), "top_p", "top-p must be in (0, 1]"),
    (dict(min_p=1.0), "min_p", "min-p must be in [0, 1)"),
    (dict(seed=1.5), "seed", "seed must be a whole number"),
    (dict(grammar=" "), "grammar", "the grammar is empty"),
]


@pytest.mark.parametrize("kw, field, words", BAD, ids=[next(iter(kw)) + "=" + repr(next(iter(kw.values()))) for kw, _, _ in BAD])
def test_a_broken_rule_names_its_field(kw, field, words):
    with pytest.raises(MarsError) as e:
        GenerateConfig.make(**kw)
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_a_front_end_renames_the_subject():
    with pytest.raises(MarsError) as e:
        GenerateConfig(repeat_penalty=0.0)
    assert str(e.value.naming("--repeat-penalty")) == "--repeat-penalty must be > 0 (1.0 = off), got 0.0"
    with pytest.raises(MarsError) as e:
        GenerateConfig(max_tokens=0)
    assert str(e.value.naming("-n")).startswith("-n: the number of tokens to generate must be >= 1")
    renamed = e.value.naming("'max_tokens'")
    assert renamed.field == "max_tokens" and renamed.subject == "'max_tokens'"


def test_limits_and_ranges_in_words():
    with pytest.raises(MarsError, match=r"the context size 2,000,000,000 is too large \(at most 1,073,741,824"):
        check("n_ctx", 2_000_000_000)
    with pytest.raises(MarsError, match=r"n-threads must be in 1..512 \(ggml's limit\), got 0"):
        check("n_threads", 0)
    assert check("n_threads", None) is None and check("seed", None) is None and check("seed", -1) == -1
    with pytest.raises(MarsError, match="verify must be strict or mars, got None"):
        check("verify", None)


def test_the_drafter_rule_is_one_function():
    assert drafter_for(None, True) == "model" and drafter_for(None, False) == "none"
    assert drafter_for("ngram", False) == "ngram" and drafter_for("eagle3", True) == "eagle3"
    for drafter, has_draft, words in (("model", False, "needs a draft model"), ("ngram", True, "draft model was given"),
                                      ("eagle3", False, "needs the target's EAGLE-3 head"),
                                      ("mtp", True, "draft model was given"),
                                      ("magic", False, "drafter must be one of model, ngram, mtp, eagle3, none, got 'magic'")):
        with pytest.raises(MarsError, match=words) as e:
            drafter_for(drafter, has_draft)
        assert e.value.field == "drafter"


def test_the_core_imports_nothing_outside_core():
    """core/ is the bottom layer: at run time its modules import numpy, the standard library and
    each other (names for type checkers only, under ``if TYPE_CHECKING:``, are not imports then)."""
    import ast
    from pathlib import Path

    import mars_local.core as core

    def runtime_imports(tree):
        for node in ast.iter_child_nodes(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            else:
                yield from runtime_imports(node)

    for path in Path(core.__file__).parent.glob("*.py"):
        for node in runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            level = getattr(node, "level", 0)
            assert level in (0, 1), f"{path.name} imports {'.' * level}{names[0]} (outside core)"
            assert level == 1 or not any(n.startswith("mars_local") for n in names), (path.name, names)
