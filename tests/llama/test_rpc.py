"""llama.cpp's RPC backend on loopback: a target split across two rpc-server processes and the
local CPU; lost, absent and wrong servers.  Every RPC run is a subprocess (a lost server aborts
the process that uses it, by design one clear line and exit 2)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from mars_local.core.errors import MarsError
from mars_local.llama.rpc import parse_endpoints, parse_tensor_split, probe

from helpers import MARS_SCRIPT, mars as _mars

ROOT = Path(__file__).resolve().parents[2]
RPC_BIN = Path(os.environ.get("MARS_RPC_SERVER", ROOT / ".cache" / "rpc-server" / "current" / "ggml-rpc-server"))
PROMPT = "The three primary colours are"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RpcServer:
    def __init__(self):
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([str(RPC_BIN), "-H", "127.0.0.1", "-p", str(self.port), "-t", "1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                probe(self.endpoint, timeout=2)
                return
            except MarsError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise AssertionError(f"rpc-server on {self.endpoint} did not start")
                time.sleep(0.1)

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def rpc_servers():
    if not RPC_BIN.exists():
        pytest.skip(f"rpc-server is not built ({RPC_BIN}): `make rpc-server` builds it (make test does)")
    servers = [RpcServer(), RpcServer()]
    yield servers
    for s in servers:
        s.stop()


def mars(*args, timeout: float = 180) -> subprocess.CompletedProcess:
    """The installed console script, text output, nothing on standard input."""
    return _mars(*args, timeout=timeout, text=True, stdin=subprocess.DEVNULL, script=True)


def run_json(*args: str) -> dict:
    out = mars("run", "--json", "--temp", "0", "-n", "24", "-t", "2", *args, PROMPT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# ------------------------------------------------------------------ pure parts
@pytest.mark.parametrize("value, expect", [
    ("127.0.0.1:50052", ("127.0.0.1:50052",)),
    ("a:1,b:2", ("a:1", "b:2")),
    (["a:1", "a:1,b:2"], ("a:1", "b:2")),
    (" host.lan:1 ", ("host.lan:1",)),
])
def test_endpoints(value, expect):
    assert parse_endpoints(value) == expect


@pytest.mark.parametrize("value", ["host", "host:", ":50052", "host:0", "host:70000", "host:port", ",", ""])
def test_bad_endpoints(value):
    with pytest.raises(MarsError, match="HOST:PORT"):
        parse_endpoints(value)


@pytest.mark.parametrize("value", ["[::1]:50052", "::1:50052", "fe80::1:50052"])
def test_ipv6_endpoints_are_refused_with_the_reason(value):
    with pytest.raises(MarsError, match="IPv4 only"):
        parse_endpoints(value)


def test_tensor_split():
    assert parse_tensor_split("3,1") == (3.0, 1.0) and parse_tensor_split(None) is None
    for bad in ("a,b", "0,0", "-1,2", "inf"):
        with pytest.raises(MarsError, match="--tensor-split"):
            parse_tensor_split(bad)


# ------------------------------------------------------------------ refusals
def test_nothing_listening_is_one_line():
    port = free_port()
    t0 = time.monotonic()
    out = mars("run", "--rpc", f"127.0.0.1:{port}", "-n", "4", "x")
    err = out.stderr.strip()
    assert out.returncode == 2 and f"RPC server 127.0.0.1:{port}" in err and "refused" in err.lower()
    assert "\n" not in err and "Traceback" not in err and time.monotonic() - t0 < 30


@pytest.mark.slow
@pytest.mark.parametrize("reply", [None, b"HTTP/1.1 400 Bad Request\r\n\r\n"])
def test_a_listener_that_is_not_an_rpc_server_is_one_line(reply):
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)
    port = lsock.getsockname()[1]
    conns = []

    def serve():
        while True:
            try:
                c, _ = lsock.accept()
            except OSError:
                return
            conns.append(c)
            if reply is not None:  # answer like a web server, then hang up
                c.recv(64)
                c.sendall(reply)
                c.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        t0 = time.monotonic()
        out = mars("doctor", "--rpc", f"127.0.0.1:{port}", timeout=60)
        err = out.stderr.strip()
        assert out.returncode == 2 and f"RPC server 127.0.0.1:{port}" in err, err
        assert ("not an llama.cpp rpc-server" in err) if reply else ("did not answer" in err)
        assert "\n" not in err and "Traceback" not in err and time.monotonic() - t0 < 30
    finally:
        lsock.close()
        for c in conns:
            c.close()


def test_bad_rpc_flags_before_any_model_loads():
    for args, words in [(["--rpc", "nohost"], "HOST:PORT"), (["--tensor-split", "a"], "--tensor-split")]:
        out = mars("run", *args, "-m", "/nonexistent.gguf", "x")
        assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr


# ------------------------------------------------------------------ split runs
@pytest.mark.slow
def test_doctor_lists_the_servers_with_their_memory(rpc_servers):
    out = mars("doctor", "--json", "--rpc", ",".join(s.endpoint for s in rpc_servers))
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)["rpc"]
    assert [r["endpoint"] for r in rep] == [s.endpoint for s in rpc_servers]
    for r in rep:
        assert r["protocol"].startswith("7.") and r["devices"]
        d = r["devices"][0]
        assert d["name"].startswith("RPC") and d["description"] == r["endpoint"] and 0 < d["free"] <= d["total"]
    text = mars("doctor", "--rpc", rpc_servers[0].endpoint)
    assert text.returncode == 0 and f"RPC server {rpc_servers[0].endpoint}: ok" in text.stdout and "MiB free" in text.stdout


@pytest.mark.slow
def test_split_target_equals_local_plain_and_strict_equals_plain(smollm2, rpc_servers):
    rpc = ",".join(s.endpoint for s in rpc_servers)
    local = run_json("-m", smollm2, "--no-draft")
    split = run_json("-m", smollm2, "--no-draft", "--rpc", rpc, "-ngl", "20")  # 20 of 31 layers remote, the rest here
    assert split["tokens"] == local["tokens"] and len(local["tokens"]) == 24
    spec = run_json("-m", smollm2, "-md", smollm2, "--drafter", "model", "--verify", "strict", "--no-adaptive", "--rpc", rpc,
                    "-ngl", "20", "--tensor-split", "1,1")
    assert spec["tokens"] == local["tokens"]
    assert spec["stats"]["n_drafted"] > 0


@pytest.mark.slow
def test_the_layers_really_go_to_the_servers_and_the_draft_stays_local(smollm2, tmp_path, rpc_servers):
    from live_server import LiveServer

    before = [s.rss_kib() for s in rpc_servers]
    rpc = ",".join(s.endpoint for s in rpc_servers)
    with LiveServer.start("-m", smollm2, "--rpc", rpc, "--no-draft"):
        grown = [s.rss_kib() - b for s, b in zip(rpc_servers, before)]
    # the Q4_1 model is ~85 MB: each server holds a share of its layers (by free memory)
    assert sum(grown) > 40_000 and all(g > 5_000 for g in grown), grown
    before = [s.rss_kib() for s in rpc_servers]
    with LiveServer.start("-m", smollm2, "-md", smollm2, "--drafter", "model", "--rpc", rpc_servers[0].endpoint,
                          "-ngl", "0"):  # no target layer remote: only the draft could go there, and must not
        grown = rpc_servers[0].rss_kib() - before[0]
    assert grown < 20_000, grown


@pytest.mark.slow
def test_a_server_killed_mid_generation_is_one_line_and_batch_keeps_its_records(smollm2, tmp_path):
    if not RPC_BIN.exists():
        pytest.skip(f"rpc-server is not built ({RPC_BIN})")
    victim = RpcServer()
    try:
        inp = tmp_path / "in.jsonl"
        inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Write about the number {i}.",
                                           "max_tokens": 24 if i < 2 else 4000, "ignore_eos": i >= 2}) + "\n"
                               for i in range(4)))
        outp = tmp_path / "out.jsonl"
        proc = subprocess.Popen([*MARS_SCRIPT, "batch", str(inp), "-o", str(outp), "-m", str(smollm2), "--no-draft",
                                 "--rpc", victim.endpoint, "-t", "2", "--temp", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not outp.exists() or outp.read_text().count("\n") < 2):
            time.sleep(0.1)
        assert outp.exists() and outp.read_text().count("\n") >= 2, "the first two records never finished"
        time.sleep(0.5)  # the third (long) record is generating now
        victim.proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        lines = [x for x in err.strip().splitlines() if x.strip()]
        assert proc.returncode == 2 and "Traceback" not in err
        assert "lost the RPC server(s) " + victim.endpoint in lines[-1], err
        records = [json.loads(x) for x in outp.read_text().splitlines()]
        assert [r["id"] for r in records][:2] == ["r0", "r1"] and all(r["text"] for r in records[:2])
    finally:
        victim.stop()


@pytest.mark.slow
def test_doctor_lists_the_reachable_servers_and_one_line_per_unreachable_one(rpc_servers):
    dead = f"127.0.0.1:{free_port()}"
    out = mars("doctor", "--rpc", f"{rpc_servers[0].endpoint},{dead}")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"RPC server {rpc_servers[0].endpoint}: ok" in out.stdout and "MiB free" in out.stdout
    assert f"RPC server {dead}: FAILED" in out.stdout
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and f"RPC server {dead}" in err[0] and "refused" in err[0].lower()
