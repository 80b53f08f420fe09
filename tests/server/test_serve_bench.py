"""benchmarks/serve_bench.py end to end on the tiny models (mars serve only; llama-server skipped)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import benchmark_script

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
    sb = benchmark_script("serve_bench")
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
    sb = benchmark_script("serve_bench")
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
