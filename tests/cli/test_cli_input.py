"""Hostile input at the command line (issue 11): bytes that are not UTF-8, a broken
user registry, impossible flags, a full context, a closed pipe and Ctrl-C.

The contract: one clear line on stderr, a non-zero exit code, no traceback.
Most tests run the real entry point in a subprocess, with real bytes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tinymodels import make_tiny_llama


from helpers import MARS, invoke, mars, stderr_lines as err_lines


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """A tiny model with an 8192-token training context (long generations, slowly with
    a 63-token draft and no adaptation: time to close a pipe or press Ctrl-C)."""
    return make_tiny_llama(tmp_path_factory.mktemp("long") / "long.gguf", seed=0, n_ctx=8192)


def slow_run(long_model, tiny_draft, *extra):
    return ["run", "the world zz", "-m", long_model, "-md", tiny_draft, "--verify", "strict", "--no-adaptive",
            "--draft-max", "63", "-c", "8192", "-n", "8000", "-t", "1", *extra]


# ------------------------------------------------------- 1. bytes that are not UTF-8
def test_stdin_that_is_not_utf8_is_replaced_with_one_warning(fake_engine):
    r = invoke("run", "-", "-m", "fake.gguf", "--json", input=b"caf\xe9 the a")
    assert r.exit_code == 0, r.output
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning:") and "UTF-8" in err[0], err
    assert fake_engine.calls[0][0] == "caf\ufffd the a"


def test_an_argument_with_a_lone_surrogate_is_replaced_with_one_warning(fake_engine):
    # $'caf\xe9' reaches Python as 'caf\udce9'
    r = invoke("run", "caf\udce9 the a", "-m", "fake.gguf", "--json")
    assert r.exit_code == 0, r.output
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning:") and "UTF-8" in err[0], err
    # the system prompt too (and it goes through the chat template)
    r = invoke("run", "hi", "--system", "be \udcff brief", "-m", "fake.gguf", "--json")
    assert r.exit_code == 0 and "--system is not valid UTF-8" in r.stderr
    assert [c[0] for c in fake_engine.calls] == ["caf\ufffd the a", "<system>be \ufffd brief<user>hi"]


@pytest.mark.slow
def test_invalid_utf8_through_the_real_entry_point(tiny_target, empty_config):
    p = mars("run", b"caf\xe9 the a", "-m", tiny_target, "-t", 1, "-n", 4, "--json", env=empty_config)
    assert p.returncode == 0, p.stderr
    err = err_lines(p)
    assert len(err) == 1 and err[0].startswith("warning:") and "UTF-8" in err[0], err
    same = mars("run", "caf\ufffd the a", "-m", tiny_target, "-t", 1, "-n", 4, "--json", env=empty_config)
    assert json.loads(p.stdout)["tokens"] == json.loads(same.stdout)["tokens"]


def test_chat_input_that_is_not_utf8_is_replaced_with_one_warning(tiny_target, empty_config):
    p = mars("chat", "-m", tiny_target, "-t", 1, "-n", 4, input=b"caf\xe9 the a\n/quit\n", env=empty_config)
    assert p.returncode == 0, p.stderr
    assert any(e.startswith("warning:") and "UTF-8" in e for e in err_lines(p))


# ------------------------------------------------------- 2. a broken user models.yaml
BROKEN = {
    "bad yaml": (b"default: smollm2-135m\nmodels:\n  mine: [unclosed\n", ["line"]),
    "theta not a number": (
        b"models:\n  mine:\n    target: {repo: me/x-GGUF, file: x.gguf}\n    drafter: ngram\n    theta: high\n",
        ["mine", "theta", "high"],
    ),
    "binary file": (bytes(range(256)) * 4, ["utf-8"]),
    "nul byte": (b"models:\n  mine:\n    description: a\x00b\n", ["line 3"]),
    "not a mapping": (b"- a\n- b\n", ["mapping"]),
    "bad default": (b"default: nothing-here\n", ["default", "nothing-here"]),
    # a mistyped key is refused, not ignored (the override it meant would silently not apply)
    "mistyped top-level key": (b"model:\n  smollm2-135m:\n    target: {repo: me/x-GGUF, file: x.gguf}\n",
                               ["line 1", "unknown key 'model'"]),
    "mistyped entry field": (b"models:\n  mine:\n    target: {repo: me/x-GGUF, file: x.gguf}\n    draft_mx: 4\n",
                             ["line 4", "mine", "unknown field 'draft_mx'", "draft_max"]),
    "mistyped file field": (b"models:\n  mine:\n    target: {repo: me/x-GGUF, file: x.gguf, revsion: main}\n",
                            ["line 3", "unknown field 'revsion' in target"]),
}


@pytest.fixture(params=sorted(BROKEN))
def broken_registry(request, tmp_path):
    data, needles = BROKEN[request.param]
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "models.yaml").write_bytes(data)
    return {"MARS_CONFIG_DIR": str(cfg)}, cfg / "models.yaml", needles


def test_a_broken_registry_is_one_line_naming_the_file(broken_registry):
    env, path, needles = broken_registry
    r = invoke("models", env=env)
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert str(path) in lines[0]
    for needle in needles:
        assert needle.lower() in lines[0].lower(), (needle, lines[0])


def test_a_broken_registry_does_not_stop_a_run_of_a_file(broken_registry, fake_engine):
    env, path, _ = broken_registry
    r = invoke("run", "hello", "-m", "fake.gguf", "--json", env=env)
    assert r.exit_code == 0, (r.output, r.exception)
    assert str(fake_engine.opened[0]["target"]) == "fake.gguf"
    # a registry name does need it: the error names the file
    r = invoke("run", "hello", "-m", "smollm2-135m", "-n", 2, env=env)
    assert r.exit_code == 2 and str(path) in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


def test_doctor_reports_a_broken_registry_and_goes_on(broken_registry):
    env, path, _ = broken_registry
    r = invoke("doctor", env=env)
    assert r.exit_code == 1, (r.output, r.exception)
    assert "backend:" in r.stdout and "learned state:" in r.stdout  # the other checks still ran
    assert str(path) in r.stdout and "FAILED" in r.stdout
    j = invoke("doctor", "--json", env=env)
    assert j.exit_code == 1, (j.output, j.exception)
    rep = json.loads(j.stdout)
    assert str(path) in rep["registry"]["problem"] and rep["backend"]


def test_doctor_reports_a_sound_registry(empty_config):
    rep = json.loads(invoke("doctor", "--json", env=empty_config).stdout)
    assert rep["registry"]["problem"] is None and rep["models"]["smollm2-135m"] is True


def test_doctor_names_a_cuda_builds_graph_cache_setting(empty_config, monkeypatch):
    import mars_local.llama.runtime as runtime

    real = runtime.backend_info
    monkeypatch.setattr(runtime, "backend_info", lambda: {**real(), "backend": "cuda", "gpu_offload": True})
    r = invoke("doctor", env={**empty_config, "MARS_CUDA_GRAPH_KEY_PER_SHAPE": "8"})
    assert "CUDA graphs:" in r.stdout and "has run 8 times" in r.stdout, r.output
    rep = json.loads(invoke("doctor", "--json", env=empty_config).stdout)
    assert rep["cuda_graphs"].startswith("stock's")
    monkeypatch.setattr(runtime, "backend_info", real)  # a CPU build: no such line
    assert "CUDA graphs:" not in invoke("doctor", env=empty_config).stdout


# ------------------------------------------------------- 3. impossible flags
FLAG_CASES = {
    "negative context": (["-c", "-1"], "-c"),
    "negative context (long spelling)": (["--ctx-size", "-5"], "--ctx-size"),
    "absurd context": (["-c", str(2**40)], "-c"),
    "threads zero": (["-t", "0"], "-t"),
    "threads above ggml's maximum": (["-t", "999"], "-t"),
    "gpu layers below -1": (["-ngl", "-5"], "-ngl"),
    "draft gpu layers below -1": (["-ngld", "-2"], "-ngld"),
    "draft-max too large": (["--draft-max", "1000"], "--draft-max"),
    "draft-max alias": (["--num-draft-tokens", "64"], "--num-draft-tokens"),
}


@pytest.mark.parametrize("case", sorted(FLAG_CASES))
def test_impossible_flags_are_refused_before_any_model_loads(case, tmp_path, empty_config):
    flags, needle = FLAG_CASES[case]
    missing = tmp_path / "missing.gguf"  # the flag error must come first
    r = invoke("run", "hi", "-m", missing, *flags, env=empty_config)
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert needle in lines[0].split(":")[1] or needle in lines[0], lines[0]
    assert "not found" not in lines[0]


def test_threads_above_the_core_count_warn(fake_engine, empty_config):
    n = (os.cpu_count() or 1) + 1
    r = invoke("run", "hello", "-m", "fake.gguf", "-t", n, "--json", env=empty_config)
    assert r.exit_code == 0, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning:") and f"-t {n}" in lines[0], r.stderr
    assert fake_engine.opened[0]["n_threads"] == n


def test_a_context_beyond_training_warns_once(fake_engine, empty_config):
    r = invoke("run", "hello", "-m", "fake.gguf", "-c", 4096, "--json", env=empty_config)
    assert r.exit_code == 0, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning:"), r.stderr
    assert "-c 4096" in lines[0] and "training context (1024)" in lines[0]
    # not when the user asked for nothing (the default), nor within the training context
    for extra in ([], ["-c", "1024"], ["-c", "0"]):
        r = invoke("run", "hello", "-m", "fake.gguf", "--json", *extra, env=empty_config)
        assert r.exit_code == 0 and r.stderr == "", (extra, r.stderr)


def test_ctx_zero_means_the_training_context_and_stats_show_the_size(fake_engine, empty_config):
    r = invoke("run", "hello", "-m", "fake.gguf", "-c", 0, "--stats", env=empty_config)
    assert r.exit_code == 0, r.output
    assert "context size:         1024 tokens (-c 0: the model's training context)" in r.stderr, r.stderr
    r = invoke("run", "hello", "-m", "fake.gguf", "--ctx-size", 64, "--stats", env=empty_config)
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("context size:"))
    assert line.endswith("256 tokens (--ctx-size 64)"), line  # the size used, and what was asked for


def test_ctx_sizes_of_a_real_model(tiny_target, empty_config):
    r = invoke("run", "hello", "-m", tiny_target, "-t", 1, "-n", 2, "-c", 0, "--stats", env=empty_config)
    assert r.exit_code == 0 and "context size:         1024 tokens" in r.stderr, r.output


# ------------------------------------------------------- 4. a full context
def test_run_says_when_the_context_filled(fake_engine, empty_config):
    fake_engine.reply = "x" * 1000
    r = invoke("run", "a b c", "-m", "fake.gguf", "-c", 256, "-n", 1000, env=empty_config)
    assert r.exit_code == 0, r.output
    assert r.stderr == "note: stopped: the context (256 tokens) is full; a larger -c makes room\n", r.stderr
    # and not when the generation ended otherwise
    r = invoke("run", "a b c", "-m", "fake.gguf", "-c", 1024, "-n", 10, env=empty_config)
    assert r.exit_code == 0 and r.stderr == "", r.stderr


def test_a_real_model_stops_at_a_full_context(tiny_target, empty_config):
    r = invoke("run", "a b c", "-m", tiny_target, "-t", 1, "-c", 64, "-n", 1000, "--json", env=empty_config)
    assert r.exit_code == 0 and json.loads(r.stdout)["stats"]["stop_reason"] == "context", r.output
    assert "context" in r.stderr and "full" in r.stderr


# ------------------------------------------------------- 5. a closed pipe
def test_a_closed_pipe_exits_0_quietly(long_model, tiny_draft, empty_config):
    proc = subprocess.Popen(MARS + [str(a) for a in slow_run(long_model, tiny_draft)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **empty_config})
    head = proc.stdout.read(20)  # `| head -c 20`
    proc.stdout.close()
    rc = proc.wait(timeout=120)
    err = proc.stderr.read().decode()
    assert len(head) == 20
    assert rc == 0, (rc, err)
    assert err == "", err


@pytest.mark.parametrize("args", [["models"], ["run", "a b c", "-n", "2", "-t", "1"],
                                  ["run", "a b c", "-n", "2", "-t", "1", "--json"]])
def test_a_closed_standard_output_is_one_line_not_a_traceback_or_a_silent_success(args, tiny_target, empty_config):
    if args[0] == "run":
        args = args + ["-m", str(tiny_target)]
    # `mars ... >&-`: the process starts with file descriptor 1 closed (Python's sys.stdout is None)
    p = subprocess.run(MARS + args, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120,
                       env={**os.environ, **empty_config}, preexec_fn=lambda: os.close(1))
    lines = err_lines(p)
    assert p.returncode != 0 and lines == ["error: standard output is closed (redirect it to a file or /dev/null)"], (
        p.returncode, p.stderr)


# ------------------------------------------------------- 6. Ctrl-C
def test_ctrl_c_ends_the_line_prints_partial_stats_and_exits_130(long_model, tiny_draft, empty_config):
    proc = subprocess.Popen(MARS + [str(a) for a in slow_run(long_model, tiny_draft, "--stats")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **empty_config})
    first = proc.stdout.read(1)  # the answer is streaming
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    out, err = (first + out).decode("utf-8", "replace"), err.decode()
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err, err
    assert out.endswith("\n")  # the cursor is back at the start of a line
    assert "eval count:" in err and "stop reason:          interrupted" in err, err
    n = int(err.split("eval count:")[1].split()[0])
    assert 0 < n < 8000


# ------------------------------------------------------- 7. chat
def test_chat_at_end_of_input_leaves_cleanly(tiny_target, empty_config):
    p = mars("chat", "-m", tiny_target, "-t", 1, "-n", 4, input=b"hello\n", env=empty_config)
    assert p.returncode == 0, p.stderr
    err_lines(p)


def test_chat_ctrl_c_stops_the_answer_not_the_chat(long_model, tiny_draft, empty_config):
    cmd = ["chat", "-m", long_model, "-md", tiny_draft, "--verify", "strict", "--no-adaptive", "--draft-max", "63",
           "-c", "8192", "-n", "8000", "-t", "1"]
    proc = subprocess.Popen(MARS + [str(a) for a in cmd], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **empty_config})
    proc.stdin.write(b"a b c\n")
    proc.stdin.close()  # after this answer: end of input, the chat ends
    proc.stdin = None
    seen = b""
    while b">>> " not in seen or not seen.split(b">>> ", 1)[1]:  # the answer is streaming
        more = proc.stdout.read1(4096)
        assert more, seen
        seen += more
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 0, (proc.returncode, err)
    assert "(stopped)" in err and "Traceback" not in err, err
    assert (seen + out).count(b">>> ") == 2  # asked again after the interrupted answer
