"""benchmarks/serve_bench.py end to end on the tiny models (mars serve only; llama-server skipped)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test runs the benchmark script, which starts `mars serve` processes

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "serve_bench.py"


def bench(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    # the session fixture's MARS_STATE_DIR (a temporary folder) is inherited by the servers
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL)


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


def test_missing_llama_server_is_a_note(tiny_target, tiny_draft, tmp_path):
    p = bench("-m", tiny_target, "-md", tiny_draft, "--llama-bin", tmp_path, "--clients", "1", "--requests", "1",
              "-n", "4", "--json", tmp_path / "rows.json")
    assert p.returncode == 0, p.stderr
    assert "no llama-server in" in p.stderr and "Traceback" not in p.stderr
    doc = json.loads((tmp_path / "rows.json").read_text())
    assert {r["config"] for r in doc["rows"]} == {"mars spec", "mars plain"}


def test_missing_model_is_one_line(tiny_draft, tmp_path):
    p = bench("-m", tmp_path / "nope.gguf", "-md", tiny_draft, "--no-peers", "--clients", "1")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "nope.gguf" in lines[0] and "Traceback" not in p.stderr
    assert p.stdout == ""


def test_server_that_fails_to_start_is_one_line(not_gguf, tiny_draft):
    p = bench("-m", not_gguf, "-md", tiny_draft, "--no-peers", "--clients", "1")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("serve_bench: error: mars serve") and "Traceback" not in p.stderr


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
