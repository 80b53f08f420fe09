"""The serving sweep (mars_local.bench.serving) end to end on the tiny models, through
benchmarks/serve_bench.py and `mars bench --clients` (mars serve only; llama-server skipped)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import invoke, mars, one_error_line
from mars_local.bench import serving

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "serve_bench.py"


def bench(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    # the session fixture's MARS_STATE_DIR (a temporary folder) is inherited by the servers
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL)


@pytest.mark.slow  # runs the benchmark script, which starts `mars serve` processes
def test_mars_rows_per_client_count(tiny_target, tiny_draft, tmp_path):
    out = tmp_path / "rows.json"
    p = bench("-m", tiny_target, "-md", tiny_draft, "--no-peers", "--clients", "1,2", "--requests", "1",
              "-n", "8", "--json", out)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    doc = json.loads(out.read_text())
    rows = {(r["config"], r["clients"]): r for r in doc["rows"]}
    assert set(rows) == {(c, n) for c in ("mars spec", "mars plain") for n in (1, 2)}
    for (config, n), r in rows.items():
        assert r["requests"] == n * 1
        assert r["completion_tokens"] == n * 1 * 8, r
        assert r["tokens_from"] == "usage"
        assert r["tokens_per_s"] > 0 and r["requests_per_s"] > 0
        assert r["tau"] is not None
        if config == "mars plain":
            assert r["tau"] == 1.0  # no drafting: one token per target forward
            assert r["drafted"] == 0
    # the Markdown table and the command line are printed
    assert "| config | clients |" in p.stdout
    assert "| mars plain | 2 |" in p.stdout
    assert "command:" in p.stdout and "--no-peers" in p.stdout


@pytest.mark.slow
def test_missing_llama_server_is_a_note(tiny_target, tiny_draft, tmp_path):
    p = bench("-m", tiny_target, "-md", tiny_draft, "--llama-bin", tmp_path, "--clients", "1", "--requests", "1",
              "-n", "4", "--json", tmp_path / "rows.json")
    assert p.returncode == 0, p.stderr
    assert "no llama-server in" in p.stderr and "Traceback" not in p.stderr
    doc = json.loads((tmp_path / "rows.json").read_text())
    assert {r["config"] for r in doc["rows"]} == {"mars spec", "mars plain"}


@pytest.mark.slow
def test_missing_model_is_one_line(tiny_draft, tmp_path):
    p = bench("-m", tmp_path / "nope.gguf", "-md", tiny_draft, "--no-peers", "--clients", "1")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "nope.gguf" in lines[0] and "Traceback" not in p.stderr
    assert p.stdout == ""


@pytest.mark.slow
def test_a_malformed_peer_env_is_one_line_before_any_server(tiny_target, tiny_draft):
    p = bench("-m", tiny_target, "-md", tiny_draft, "--peer-env", "NOEQUALS", "--clients", "1")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert lines == ["serve_bench: error: --peer-env: expected NAME=VALUE, got 'NOEQUALS'"], p.stderr
    assert p.stdout == ""


@pytest.mark.slow
def test_server_that_fails_to_start_is_one_line(not_gguf, tiny_draft):
    p = bench("-m", not_gguf, "-md", tiny_draft, "--no-peers", "--clients", "1")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("serve_bench: error: mars serve") and "Traceback" not in p.stderr


@pytest.mark.slow
def test_an_interrupted_sweep_keeps_the_rows_it_measured(tiny_target, tiny_draft, tmp_path):
    """Ctrl-C (or a timeout's SIGINT) after the first row: that row is printed and saved, exit 130."""
    import signal

    out = tmp_path / "rows.json"
    p = subprocess.Popen([sys.executable, str(SCRIPT), "-m", str(tiny_target), "-md", str(tiny_draft), "--no-peers",
                          "--clients", "1,2,4", "--requests", "1", "-n", "8", "--json", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, stdin=subprocess.DEVNULL)
    try:
        err = []
        for line in p.stderr:  # the per-row result line comes as soon as a row is measured
            err.append(line)
            if "tok/s, TTFT mean" in line:
                p.send_signal(signal.SIGINT)
                break
        stdout, rest = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    err = "".join(err) + rest
    assert p.returncode == 130, err
    assert "interrupted (" in err and "Traceback" not in err
    doc = json.loads(out.read_text())
    assert 1 <= len(doc["rows"]) < 6 and doc["rows"][0]["config"] == "mars spec"
    assert "interrupted" in doc["notes"][0]
    assert "| mars spec | 1 |" in stdout


def _row(rnd, config, n, tps, ttft):
    return {"round": rnd, "config": config, "clients": n, "tokens_per_s": tps, "ttft_mean_ms": ttft}


def test_the_summary_takes_each_ratio_within_a_round():
    """Round 2 ran 2x slower for everyone: the ratios, taken within each round, do not move;
    the best of each side is taken per round (mars spec in round 1, mars plain in round 2)."""
    sb = serving
    rows = [_row(1, "mars spec", 4, 30.0, 500), _row(1, "mars plain", 4, 20.0, 400),
            _row(1, "llama-server plain", 4, 20.0, 800), _row(1, "llama-server spec", 4, 10.0, 1000),
            _row(2, "mars spec", 4, 9.0, 1000), _row(2, "mars plain", 4, 12.0, 800),
            _row(2, "llama-server plain", 4, 10.0, 1600), _row(2, "llama-server spec", 4, 5.0, 2000)]
    (e,) = sb.summarize(rows)
    assert e["clients"] == 4 and e["rounds"] == 2
    assert e["best_vs_llama_best"] == {"median": pytest.approx(1.35), "min": pytest.approx(1.2), "max": pytest.approx(1.5)}
    assert e["plain_vs_llama_plain"]["median"] == pytest.approx(1.1)
    assert e["spec_vs_plain"] == {"median": pytest.approx(1.125), "min": pytest.approx(0.75), "max": pytest.approx(1.5)}
    assert e["ttft_vs_llama"]["median"] == pytest.approx(0.5)
    assert e["tokens_per_s"]["mars spec"] == pytest.approx(19.5)
    table = sb.summary_table([e])
    assert "| 4 | 2 |" in table and "1.35× (1.20–1.50)" in table


def test_the_summary_without_peers_has_mars_ratios_only():
    sb = serving
    (e,) = sb.summarize([_row(1, "mars spec", 2, 15.0, 300), _row(1, "mars plain", 2, 10.0, 200)])
    assert e["spec_vs_plain"]["median"] == pytest.approx(1.5)
    assert "best_vs_llama_best" not in e and "ttft_vs_llama" not in e
    assert "—" in sb.summary_table([e])


@pytest.mark.slow
def test_repeated_rounds_interleave_and_end_with_medians(tiny_target, tiny_draft, tmp_path):
    out = tmp_path / "rows.json"
    p = bench("-m", tiny_target, "-md", tiny_draft, "--no-peers", "--clients", "1,2", "--requests", "1",
              "-n", "4", "--repeat", "2", "--json", out, timeout=240)
    assert p.returncode == 0, p.stderr
    order = [ln.split("serve_bench: ")[1] for ln in p.stderr.splitlines() if "client(s)" in ln]
    assert [o.split(",")[0] + o.split(",")[1] for o in order] == [
        "mars spec 1 client(s)", "mars plain 1 client(s)", "mars spec 2 client(s)", "mars plain 2 client(s)"] * 2
    doc = json.loads(out.read_text())
    assert sorted((r["round"], r["clients"], r["config"]) for r in doc["rows"]) == sorted(
        (rnd, n, c) for rnd in (1, 2) for n in (1, 2) for c in ("mars spec", "mars plain"))
    assert [e["rounds"] for e in doc["summary"]] == [2, 2]
    assert "medians over 2 rounds" in p.stdout and "| round | config |" in p.stdout


def test_repeat_needs_fresh_servers_per_n(tiny_target, tiny_draft):
    p = bench("-m", tiny_target, "-md", tiny_draft, "--no-peers", "--parallel", "4", "--repeat", "2")
    assert p.returncode == 2 and "--repeat needs --parallel match" in p.stderr and "Traceback" not in p.stderr


# ------------------------------------------------------------------ mars bench --clients
def test_a_request_is_a_user_turn_or_the_messages_given():
    a = serving.parse_args(["-m", "t.gguf", "--no-peers"])
    one = serving.request_body(a, "mars plain", "hi", 5)
    assert one["messages"] == [{"role": "user", "content": "hi"}] and one["max_tokens"] == 5
    assert one["speculative"] == {"enabled": False} and one["stream"] and one["temperature"] == 0
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    spec = serving.request_body(a, "mars spec", turns, 5)
    assert spec["messages"] == turns and spec["speculative"] == {"enabled": True}
    assert "speculative" not in serving.request_body(a, "llama-server plain", "hi", 5)


@pytest.mark.slow
def test_mars_bench_clients_runs_the_sweep_on_the_bench_prompts(tiny_target, tiny_draft, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "chat", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]}) + "\n"
        + json.dumps({"id": "b", "category": "code", "prompt": "def add(a, b):"}) + "\n")
    out = tmp_path / "rows.json"
    r = mars("bench", "-m", tiny_target, "-md", tiny_draft, "--clients", "1,2", "--requests", "1", "-n", "6",
             "-t", "1", "--prompts", prompts, "--json", out, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    doc = json.loads(out.read_text())
    rows = {(x["config"], x["clients"]): x for x in doc["rows"]}
    assert set(rows) == {(c, n) for c in ("mars spec", "mars plain") for n in (1, 2)}
    assert all(x["completion_tokens"] == x["clients"] * 6 for x in rows.values())
    assert all(x["tau"] is not None for x in rows.values())  # mars serve's own statistics came back
    assert rows[("mars plain", 2)]["drafted"] == 0 and rows[("mars plain", 2)]["tau"] == 1.0
    assert doc["settings"]["threads"] == 1 and doc["settings"]["draft"] == str(tiny_draft)
    assert "prog" not in doc["settings"] and "prompt_list" not in doc["settings"]
    assert "| mars plain | 2 |" in r.stdout and "command: mars bench -m" in r.stdout
    assert "--verify strict" in r.stdout  # the mars serve command line is reported
    assert [ln for ln in r.stderr.splitlines() if "client(s)" in ln][0].startswith("mars bench: mars spec, 1 client")


@pytest.mark.slow
def test_mars_bench_clients_without_a_draft_model_drafts_ngrams(tiny_target, tmp_path):
    out = tmp_path / "rows.json"
    r = mars("bench", "-m", tiny_target, "--clients", "1", "--requests", "1", "-n", "4", "-t", "1",
             "--llama-cpp-bin", tmp_path, "--json", out, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "no llama-server in" in r.stderr and "Traceback" not in r.stderr
    doc = json.loads(out.read_text())
    assert {x["config"] for x in doc["rows"]} == {"mars spec", "mars plain"}
    assert doc["settings"]["draft"] is None and doc["settings"]["drafter"] == "ngram"
    assert "--drafter ngram" in r.stdout and " -md " not in r.stdout


@pytest.mark.parametrize("extra, needle", [
    (["--clients", "x"], "--clients must be a comma list"),
    (["--clients", "0"], "--clients must be integers >= 1"),
    (["--clients", "1", "--requests", "0"], "--requests must be >= 1"),
    (["--clients", "1", "--repeat", "0"], "--repeat must be >= 1"),
    (["--clients", "1", "--thetas", "0.9"], "--thetas does not apply"),
    (["--clients", "1", "--fixed-k", "2", "--plot", "x.png"], "--fixed-k, --plot do not apply"),
    (["--clients", "1", "--temp", "0.7"], "--temp does not apply"),
    (["--clients", "1", "--json", "/no/such/dir/out.json"], "no such directory"),
    (["--clients", "1", "--categories", "nope"], "nope"),
])
def test_bad_sweep_input_is_one_line_before_any_server(tiny_target, extra, needle):
    r = invoke("bench", "-m", tiny_target, *extra)
    assert needle in one_error_line(r)
    assert r.stdout == ""


def test_a_missing_model_in_the_sweep_is_one_line(tmp_path):
    r = invoke("bench", "-m", tmp_path / "nope.gguf", "--clients", "1")
    assert "nope.gguf" in one_error_line(r)


@pytest.mark.parametrize("module, needle", [("httpx", "needs httpx"), ("fastapi", "mars serve needs fastapi")])
def test_the_sweep_without_the_server_extra_is_a_one_line_hint(tiny_target, monkeypatch, module, needle):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails
    r = invoke("bench", "-m", tiny_target, "--clients", "1")
    line = one_error_line(r)
    assert needle in line and "mars-local[server]" in line


@pytest.mark.slow  # starts `mars serve`
@pytest.mark.parametrize("parallel", [1, 2])
def test_chat_turns_reports_what_each_turn_took_from_the_cache(tiny_target, tiny_draft, tmp_path, parallel):
    out = tmp_path / "turns.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chat_turns.py"), "-m", tiny_target, "-md", tiny_draft,
                        "--parallel", str(parallel), "--turns", "3", "-n", "8", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    turns = json.loads(out.read_text())["turns"]
    assert len(turns) == 3 and p.stdout.count("time to first token") == 3
    assert turns[0]["prompt_tokens"] < turns[1]["prompt_tokens"] < turns[2]["prompt_tokens"]
    assert all(t["ttft_ms"] > 0 for t in turns) and turns[0]["cached_tokens"] <= 2
    if parallel == 1:  # one at a time: the conversation so far comes from the cache
        assert all(t["cached_tokens"] >= turns[i]["prompt_tokens"] - 1 for i, t in enumerate(turns[1:]))


def test_a_server_the_bench_starts_stops_on_its_sigint_not_by_a_kill():
    """Servers are started with Ctrl-C held back (so none outlives an interrupted bench), but not by
    a signal mask they would inherit: stop() sends SIGINT, and a server that could not see it was
    killed after 10 s, losing what it had learned since it last saved."""
    servers: list[serving.Server] = []
    code = "import signal, sys, time\nprint('up', flush=True)\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n" \
           "    print('saved', flush=True)\n    sys.exit(130)\n"
    srv = serving.Server("a stand-in server", [sys.executable, "-c", code], servers)
    assert servers == [srv]
    deadline = time.monotonic() + 20
    while "up" not in srv.lines and time.monotonic() < deadline:
        time.sleep(0.05)
    srv.stop()
    assert srv.proc.returncode == 130, srv.tail()
    time.sleep(0.2)  # (the reader thread takes the last line)
    assert "saved" in srv.lines
