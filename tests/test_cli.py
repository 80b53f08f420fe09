"""`mars run`: the JSON contract and every bad-input path (one line, exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from mars_local.cli import app

runner = CliRunner()


def invoke(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def test_run_json_contract(tiny_target, tiny_draft):
    r = invoke("run", "hello world", "-m", tiny_target, "-md", tiny_draft, "-n", 12, "--json", "--verify", "strict")
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1  # one JSON object and nothing else on stdout
    obj = json.loads(lines[0])
    assert set(obj) == {"text", "tokens", "stats"}
    assert isinstance(obj["text"], str) and len(obj["tokens"]) == obj["stats"]["n_generated"] <= 12
    for key in (
        "n_generated", "n_rounds", "n_drafted", "n_accepted", "n_relaxed", "acceptance_rate",
        "mean_accepted_length", "per_position_acceptance", "time_target_s", "time_draft_s",
        "time_verify_s", "time_total_s", "tokens_per_second",
    ):
        assert key in obj["stats"], key


def test_run_strict_json_equals_no_draft(tiny_target, tiny_draft):
    a = invoke("run", "the a the", "-m", tiny_target, "--no-draft", "-n", 24, "--json")
    b = invoke("run", "the a the", "-m", tiny_target, "-md", tiny_draft, "--verify", "strict", "-n", 24, "--json")
    c = invoke("run", "the a the", "-m", tiny_target, "--drafter", "ngram", "--verify", "strict", "-n", 24,
               "--draft-max", 3, "--json")
    toks = [json.loads(r.stdout)["tokens"] for r in (a, b, c)]
    assert toks[0] == toks[1] == toks[2]


def test_run_streams_text_and_prints_stats(tiny_target):
    r = invoke("run", "hello", "-m", tiny_target, "-n", 8, "--stats")
    assert r.exit_code == 0
    assert "eval rate:" in r.stderr and "mean accepted length:" in r.stderr


def test_run_reads_the_prompt_from_stdin(tiny_target):
    a = invoke("run", "-", "-m", tiny_target, "-n", 6, "--json", input="hello world")
    b = invoke("run", "hello world", "-m", tiny_target, "-n", 6, "--json")
    assert a.exit_code == 0 and json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"]


def test_llama_cpp_flag_aliases(tiny_target, tiny_draft):
    r = invoke(
        "run", "hello", "--model", tiny_target, "--model-draft", tiny_draft, "--spec-draft-n-max", 2,
        "--spec-draft-n-min", 1, "--spec-draft-p-min", 0.0, "-ngl", 0, "-ngld", "auto", "-t", 1, "-c", 256,
        "-s", 3, "--temp", 0.5, "--top-k", 10, "--top-p", 0.9, "--min-p", 0.01, "-n", 8, "--json",
    )
    assert r.exit_code == 0, r.output
    assert max(json.loads(r.stdout)["stats"]["k_per_round"]) <= 2


@pytest.fixture(scope="module")
def bad_cases(tiny_target, tiny_draft, tiny_other_vocab, not_gguf, truncated_gguf, tmp_path_factory):
    missing = tmp_path_factory.mktemp("bad") / "missing.gguf"
    t, d = str(tiny_target), str(tiny_draft)
    return {
        "missing file": (["run", "hi", "-m", missing], "not found"),
        "not a GGUF": (["run", "hi", "-m", not_gguf], "not a GGUF"),
        "truncated GGUF": (["run", "hi", "-m", truncated_gguf], "cannot load"),
        "vocab mismatch": (["run", "hi", "-m", t, "-md", tiny_other_vocab], "tokenizer"),
        "prompt too long": (["run", "hello " * 400, "-m", t, "-c", 64], "context"),
        "theta too big": (["run", "hi", "-m", t, "-md", d, "--theta", "1.5"], "theta"),
        "theta zero": (["run", "hi", "-m", t, "--theta", "0"], "theta"),
        "theta not a number": (["run", "hi", "-m", t, "--theta", "abc"], "--theta"),
        "negative k": (["run", "hi", "-m", t, "--draft-max", "-2"], "draft-max"),
        "negative temperature": (["run", "hi", "-m", t, "--temp", "-1"], "temperature"),
        "zero tokens": (["run", "hi", "-m", t, "-n", "0"], "tokens"),
        "bad verify": (["run", "hi", "-m", t, "--verify", "loose"], "verify"),
        "bad drafter": (["run", "hi", "-m", t, "--drafter", "magic"], "drafter"),
        "draft without model": (["run", "hi", "-m", t, "--drafter", "model"], "draft model"),
        "contradiction": (["run", "hi", "-m", t, "--no-draft", "-md", d], "contradicts"),
        "unknown option": (["run", "hi", "--bogus"], "bogus"),
        "bad gpu layers": (["run", "hi", "-m", t, "-ngl", "many"], "-ngl"),
        "empty prompt": (["run", "   ", "-m", t], "empty"),
        "unknown registry name": (["run", "hi", "-m", "no-such-model"], "not found"),
    }


CASES = [
    "missing file", "not a GGUF", "truncated GGUF", "vocab mismatch", "prompt too long", "theta too big",
    "theta zero", "theta not a number", "negative k", "negative temperature", "zero tokens", "bad verify",
    "bad drafter", "draft without model", "contradiction", "unknown option", "bad gpu layers", "empty prompt",
    "unknown registry name",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_2(bad_cases, case):
    args, needle = bad_cases[case]
    r = invoke(*args)
    assert r.exit_code == 2, (r.exit_code, r.output)
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), r.stderr
    assert needle.lower() in err[0].lower()
    assert "Traceback" not in r.output
    assert r.stdout == ""


def test_real_entry_point_has_no_traceback(not_gguf):
    """The installed console script path (python -m mars_local) behaves the same."""
    p = subprocess.run(
        [sys.executable, "-m", "mars_local", "run", "hi", "-m", str(not_gguf)], capture_output=True, text=True
    )
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error:")
    assert p.stdout == ""
