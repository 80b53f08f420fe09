"""Serving throughput and latency: `mars serve` against llama-server, with N concurrent clients.

    mars bench -m TARGET.gguf -md DRAFT.gguf --clients 1,2,4,8,16 [--requests 2] [-n 64] [-t 2] \\
        [-c 4096] [--repeat R] [--llama-cpp-bin DIR] [--json OUT.json]
    .venv/bin/python benchmarks/serve_bench.py -m TARGET.gguf -md DRAFT.gguf \\
        [--clients 1,4] [--requests 2] [-n 64] [-t 2] [-c 4096] [--verify strict] [--repeat R] \\
        [--llama-bin .cache/llama-bin | --no-peers] [--prompts FILE] [--json OUT.json]

``mars bench --clients`` is this sweep with mars bench's spelling of the options
(its models, prompts, -n, -t, -c, --repeat, --draft-max, -ngl, --llama-cpp-bin and
--json); ``benchmarks/serve_bench.py`` is the same code with every option below.

What it measures.  For each configuration and each client count N, N client
threads (one httpx client each) start together and each sends --requests
requests one after the other: POST /v1/chat/completions, streamed with
``stream_options.include_usage``, temperature 0, ``max_tokens`` -n and
``ignore_eos`` (so every server generates exactly -n tokens per request).
Client i's j-th request uses prompt (i + j) mod P of the prompt list.  Per row:

  req/s      requests / wall time of the whole run (first send to last byte)
  tok/s      sum of completion tokens / the same wall time
  TTFT       time from sending a request to its first streamed chunk with
             non-empty text (mean and median over the run's requests)
  tau        mean over requests of usage.speculative.mean_accepted_length
             (tokens per target forward), where the server reports it
  accept     accepted / drafted draft tokens, summed over the run, where the
             server reports them (mars: usage.speculative; llama-server:
             timings.draft_n / draft_n_accepted)

Configurations:

  mars spec           one `mars serve -m T -md D` process, requests with
                      "speculative": {"enabled": true}
  mars plain          the same command, requests with "speculative": {"enabled": false}
                      (the per-request switch), in a process of its own
  llama-server plain  `llama-server -m T -np N`
  llama-server spec   `llama-server -m T -md D -np N` (draft-simple, --spec-draft-n-max K)

`mars serve` runs with --parallel N by default (--parallel match: one server per
client count N, its N sequences decoded together), or one server with --parallel
P for every N; llama-server is started with -np N (N slots, one per client,
decoded together in one batch), so each row has its own process.  -c is the
context of one sequence: mars serve gets it as is (each sequence holds -c
tokens), llama-server gets N x -c (it splits -c among its slots).  Every server
gets one short warm-up request per configuration (not counted) before its timed
run, and is stopped (SIGINT, then kill) at the end, on errors and on Ctrl-C too.

Noise (--repeat R, with --parallel match): the whole sweep R times, interleaved:
round 1 runs every configuration at the first N, then at the next N, ...; then
round 2 the same.  So the four rows compared at one N are measured minutes apart,
not a whole sweep apart, and each ratio is taken within a round.  After the rows
comes a table of medians over the rounds: tokens/s per configuration, and the
ratios mars best / llama-server best, mars plain / llama-server plain, mars spec
/ mars plain and TTFT (mars' lowest mean / llama-server's lowest) as median
(min-max) of the rounds' ratios.  One round on a busy 2-core machine moves a
figure by 10-20 %; state a ratio only where its range allows it.

Completion tokens come from ``usage.completion_tokens`` of the final chunk;
for a llama-server without it, from ``timings.predicted_n``, else by counting
streamed chunks with text (the row's ``tokens_from`` says which).

llama-server comes from --llama-bin (default .cache/llama-bin, built by
benchmarks/build_llama_tools.sh); without it the llama-server rows are skipped
with a note.  Errors (a missing file, a server that does not start) are one
line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

from ..core.errors import MarsError
from ..core.interrupts import held

DEFAULT_DRAFT_MAX = 8  # mars' default draft length (GenerateConfig.draft_max); llama-server gets it too
MARS_READY = re.compile(r"mars serve: .* on (http://\S+)/v1")

PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a short poem about a lighthouse keeper.",
    "List five tips for writing clean Python code.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Translate to French: 'The train leaves at seven in the morning.'",
    "What is the difference between a list and a tuple in Python?",
    "Give a recipe for a simple tomato soup.",
    "Describe how a binary search works, step by step.",
]

CONFIGS = ("mars spec", "mars plain", "llama-server plain", "llama-server spec")


class BenchError(MarsError):
    """A problem reported as one line on stderr (exit code 2)."""


class OneLineParser(argparse.ArgumentParser):
    raising = False  # BenchError instead of a line on stderr and SystemExit (mars bench reports it)

    def error(self, message: str) -> None:  # one line, no usage block
        if self.raising:
            raise BenchError(message)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


# ---------------------------------------------------------------- servers
class Server:
    """A server process whose output (stdout and stderr) is read by a thread into
    its last lines, so the pipe never fills."""

    def __init__(self, name: str, cmd: list[str], servers: list["Server"], env: dict[str, str] | None = None):
        """Start it and add it to ``servers`` (the ones stopped at the end), Ctrl-C (and SIGTERM)
        held back meanwhile: interrupted between its fork and this list, it would outlive the bench.
        (Held by Python's handlers, not a signal mask, which the server would inherit: it could then
        not be stopped with SIGINT, and :meth:`stop` would wait 10 s and kill it, losing what it learned
        since it last saved.)"""
        self.name, self.cmd = name, cmd
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self.url: str | None = None  # base URL, without /v1
        self._ready_url = threading.Event()
        with held(signal.SIGINT, signal.SIGTERM):
            try:
                self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True, errors="replace",
                                             start_new_session=True,  # Ctrl-C reaches us, not it: we stop it
                                             env={**os.environ, **env} if env else None)
            except OSError as exc:
                raise BenchError(f"cannot start {name}: {exc}") from None
            servers.append(self)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            m = MARS_READY.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready_url.set()
        self._ready_url.set()  # the process ended

    def tail(self, n: int = 3) -> str:
        last = [ln.strip() for ln in self.lines if ln.strip()][-n:]
        return " | ".join(last) if last else "no output"

    def _failed(self, why: str) -> BenchError:
        return BenchError(f"{self.name} {why}: {self.tail()}")

    def wait_ready_line(self, timeout: float) -> None:
        """mars serve: its ready line carries the URL (it was started with --port 0)."""
        if not self._ready_url.wait(timeout):
            raise self._failed(f"did not print its ready line within {timeout:.0f} s")
        if self.url is None:
            time.sleep(0.2)  # let the reader take the last lines
            raise self._failed(f"exited with {self.proc.wait()} before it was ready")

    def wait_health(self, url: str, timeout: float) -> None:
        """llama-server: GET /health answers 200 once the model is loaded (503 while loading)."""
        import httpx

        self.url = url
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                time.sleep(0.2)
                raise self._failed(f"exited with {self.proc.returncode} before it was ready")
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise self._failed(f"was not healthy within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGINT)
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            except OSError:
                pass


def stop_all(servers: list[Server]) -> None:
    for s in servers:
        s.stop()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_installed() -> None:
    """A one-line MarsError when the sweep's client, httpx, is missing (mars serve's own
    libraries are checked by :func:`mars_local.server.check_installed`)."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise MarsError("the serving sweep needs httpx: pip install 'mars-local[server]'") from None


def mars_command(a: argparse.Namespace, max_clients: int, parallel: int = 1) -> list[str]:
    exe = Path(sys.executable).with_name("mars")
    base = [str(exe)] if exe.is_file() else [sys.executable, "-m", "mars_local"]
    cmd = base + ["serve", "-m", a.model, *(["-md", a.draft] if a.draft else []), "--host", "127.0.0.1",
                  "--port", "0", "-t", str(a.threads), "-c", str(a.ctx_size), "--verify", a.verify, "--temp", "0",
                  "--queue", str(max(64, 2 * max_clients)), "--parallel", str(parallel), "--quiet"]
    if a.drafter:
        cmd += ["--drafter", a.drafter]
    if a.ngl is not None:
        cmd += ["-ngl", a.ngl, "-ngld", a.ngl]
    if a.fast_kernels:
        cmd += ["--fast-kernels"]
    return cmd


class LlamaServer:
    """llama-server's binary and its flags, spelled as its --help says."""

    def __init__(self, bin_dir: Path):
        self.binary = bin_dir / "llama-server"
        if not (self.binary.is_file() and os.access(self.binary, os.X_OK)):
            raise FileNotFoundError(self.binary)
        try:
            p = subprocess.run([str(self.binary), "--help"], capture_output=True, text=True, errors="replace",
                               timeout=60, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BenchError(f"cannot run {self.binary} --help: {exc}") from None
        self.help = (p.stdout or "") + (p.stderr or "")

    def has(self, flag: str) -> bool:
        return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", self.help) is not None

    def command(self, a: argparse.Namespace, spec: bool, n_clients: int, port: int) -> list[str]:
        # -c is per sequence here (as in mars serve); llama-server splits its -c among its slots
        cmd = [str(self.binary), "-m", a.model, "--host", "127.0.0.1", "--port", str(port),
               "-t", str(a.threads), "-c", str(a.ctx_size * n_clients), "-np", str(n_clients)]
        if a.ngl is not None:
            cmd += ["-ngl", a.ngl]
        if self.has("--no-webui"):
            cmd.append("--no-webui")
        if spec:
            cmd += ["-md", a.draft]
            if self.has("--spec-type"):
                cmd += ["--spec-type", "draft-simple"]
            # current llama.cpp: --spec-draft-n-max (its --draft-max is a removed flag that errors)
            cmd += ["--spec-draft-n-max" if self.has("--spec-draft-n-max") else "--draft-max",
                    str(a.draft_max or DEFAULT_DRAFT_MAX)]
            if a.ngl is not None:
                cmd += ["-ngld", a.ngl]
        return cmd


# --------------------------------------------------------------- requests
def request_body(a: argparse.Namespace, config: str, prompt: str | list[dict], max_tokens: int) -> dict:
    """One streamed, greedy chat request of exactly ``max_tokens`` tokens; ``prompt`` is the user's
    turn or a whole list of messages."""
    body = {
        "messages": prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    if config == "mars spec":
        body["speculative"] = {"enabled": True, **({"draft_max": a.draft_max} if a.draft_max else {})}
    elif config == "mars plain":
        body["speculative"] = {"enabled": False}
    return body


def stream_one(client, url: str, body: dict) -> dict:
    """Send one streamed chat request; its TTFT, token count (and where from) and speculative stats."""
    import httpx

    try:
        return _stream_one(client, url, body)
    except httpx.HTTPError as exc:
        raise BenchError(f"request to {url} failed: {type(exc).__name__}: {exc}") from None
    except ValueError as exc:  # a chunk that is not JSON
        raise BenchError(f"bad stream from {url}: {exc}") from None


def _stream_one(client, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    ttft = None
    usage = timings = None
    text_chunks = 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            try:
                msg = r.json()["error"]["message"]
            except Exception:
                msg = r.text.strip()[:200]
            raise BenchError(f"HTTP {r.status_code} from {url}: {msg}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise BenchError(f"error from {url} mid-stream: {chunk['error']}")
            for ch in chunk.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    text_chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
            if isinstance(chunk.get("usage"), dict):
                usage = chunk["usage"]
            if isinstance(chunk.get("timings"), dict):
                timings = chunk["timings"]
    out = {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "tau": None, "drafted": None, "accepted": None}
    if usage and isinstance(usage.get("completion_tokens"), int):
        out["tokens"], out["tokens_from"] = usage["completion_tokens"], "usage"
    elif timings and isinstance(timings.get("predicted_n"), int):
        out["tokens"], out["tokens_from"] = timings["predicted_n"], "timings.predicted_n"
    else:
        out["tokens"], out["tokens_from"] = text_chunks, "chunks"
    spec = (usage or {}).get("speculative")
    if isinstance(spec, dict):  # mars serve
        out.update(tau=spec.get("mean_accepted_length"), drafted=spec.get("drafted"), accepted=spec.get("accepted"))
    elif timings and "draft_n" in timings:  # llama-server (only when it drafted)
        out.update(drafted=timings["draft_n"], accepted=timings.get("draft_n_accepted"))
    return out


def run_config(a: argparse.Namespace, config: str, url: str, n_clients: int, prompts: list[str],
               stop: threading.Event) -> dict:
    """N client threads, each sending --requests requests in turn; one row."""
    import httpx

    barrier = threading.Barrier(n_clients + 1)
    timeout = httpx.Timeout(a.timeout, connect=30.0)

    def client(i: int) -> list[dict]:
        results = []
        with httpx.Client(timeout=timeout) as c:
            barrier.wait(60)
            for j in range(a.requests):
                if stop.is_set():
                    break
                body = request_body(a, config, prompts[(i + j) % len(prompts)], a.max_tokens)
                results.append(stream_one(c, url, body))
        return results

    pool = ThreadPoolExecutor(max_workers=n_clients, thread_name_prefix="client")
    try:
        futures = [pool.submit(client, i) for i in range(n_clients)]
        try:
            barrier.wait(60)
        except threading.BrokenBarrierError:
            for f in futures:
                if f.done() and f.exception() is not None:
                    raise f.exception() from None
            raise BenchError(f"{config}: the {n_clients} client threads did not start") from None
        t0 = time.perf_counter()
        pending = set(futures)
        while pending:  # a timeout keeps Ctrl-C responsive
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    stop.set()
                    raise f.exception()
        wall = time.perf_counter() - t0
    except BaseException:
        stop.set()
        barrier.abort()
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    res = [r for f in futures for r in f.result()]
    tokens = sum(r["tokens"] for r in res)
    ttfts = [r["ttft_s"] * 1000 for r in res if r["ttft_s"] is not None]
    taus = [r["tau"] for r in res if r["tau"] is not None]
    drafted = sum(r["drafted"] or 0 for r in res)
    accepted = sum(r["accepted"] or 0 for r in res)
    reported = any(r["drafted"] is not None for r in res)
    return {
        "config": config,
        "clients": n_clients,
        "requests": len(res),
        "max_tokens": a.max_tokens,
        "completion_tokens": tokens,
        "tokens_from": ",".join(sorted({r["tokens_from"] for r in res})),
        "wall_s": wall,
        "requests_per_s": len(res) / wall,
        "tokens_per_s": tokens / wall,
        "ttft_mean_ms": statistics.fmean(ttfts) if ttfts else None,
        "ttft_median_ms": statistics.median(ttfts) if ttfts else None,
        "tau": statistics.fmean(taus) if taus else None,
        "drafted": drafted if reported else None,
        "accepted": accepted if reported else None,
        "acceptance_rate": (accepted / drafted if drafted else None) if reported else None,
    }


def warm_up(a: argparse.Namespace, config: str, url: str, prompts: list[str]) -> None:
    import httpx

    with httpx.Client(timeout=httpx.Timeout(a.timeout, connect=30.0)) as c:
        stream_one(c, url, request_body(a, config, prompts[0], min(4, a.max_tokens)))


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None, prog: str = "serve_bench.py",
               default_llama_bin: str | os.PathLike | None = None, raising: bool = False) -> argparse.Namespace:
    """The sweep's settings from its command line.  An error is one line on stderr and
    SystemExit(2), or with ``raising`` a :class:`BenchError`; so are errors of the run then."""
    p = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.raising = raising
    p.add_argument("-m", "--model", required=True, help="Target GGUF file.")
    p.add_argument("-md", "--model-draft", dest="draft", default=None,
                   help="Draft GGUF file (same tokenizer); without it mars serve drafts as its --drafter says "
                        "and llama-server's speculative rows are skipped.")
    p.add_argument("--drafter", default=None, help="mars serve's --drafter (default: its own).")
    p.add_argument("--clients", default="1,4", help="Concurrent clients, a comma list: each config runs at each N "
                                                      "(default 1,4).")
    p.add_argument("--requests", type=int, default=2, help="Requests per client (default 2).")
    p.add_argument("-n", "--max-tokens", type=int, default=64, help="max_tokens of each request (default 64).")
    p.add_argument("-t", "--threads", type=int, default=2, help="Threads, passed to both servers (default 2).")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="Context of one sequence: mars serve's -c, "
                                                                     "llama-server's -c / -np (default 4096).")
    p.add_argument("--parallel", default="match",
                   help="mars serve's --parallel: 'match' (default: one server per client count N, started "
                        "with --parallel N, as llama-server gets -np N) or a number for one server for every N.")
    p.add_argument("--repeat", type=int, default=1,
                   help="Rounds of the whole sweep, interleaved per N, with a table of medians (default 1).")
    p.add_argument("--verify", choices=("strict", "mars"), default="strict",
                   help="mars serve's --verify (default strict).")
    p.add_argument("--draft-max", type=int, default=None,
                   help=f"Draft length: llama-server's --spec-draft-n-max (default {DEFAULT_DRAFT_MAX}, mars' default) "
                        "and, when given, the mars requests' speculative.draft_max.")
    p.add_argument("-ngl", dest="ngl", default=None,
                   help="GPU layers for target and draft, passed to both servers (default: their own).")
    p.add_argument("--prompts", default=None,
                   help="A file of prompts: a JSON array of strings, or one prompt per line "
                        f"(default: {len(PROMPTS)} built-in instruction prompts).")
    p.add_argument("--llama-bin", default=None if default_llama_bin is None else str(default_llama_bin),
                   help="Folder with llama-server" + (f" (default {default_llama_bin}, from "
                        "benchmarks/build_llama_tools.sh)." if default_llama_bin is not None else "."))
    p.add_argument("--no-peers", action="store_true", help="Skip llama-server.")
    p.add_argument("--peer-env", action="append", default=[], metavar="NAME=VALUE",
                   help="An environment variable for llama-server only, repeatable (e.g. "
                        "MARS_CUDA_GRAPH_KEY_PER_SHAPE=0: stock's CUDA graph cache for llama-server "
                        "built from the patched tree, while mars serve runs with patches/0015's)")
    p.add_argument("--fast-kernels", action="store_true",
                   help="mars serve --fast-kernels (on a GPU: batched forwards of any size instead of 16 rows at most).")
    p.add_argument("--json", default=None, metavar="OUT", help="Write all rows (and the settings) to this file.")
    p.add_argument("--timeout", type=float, default=600.0, help="Seconds one request may take (default 600).")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="Seconds a server may take to load and be ready (default 300).")
    a = p.parse_args(argv)
    a.prog = prog.removesuffix(".py")
    a.error_prefix = "error: " if raising else f"{a.prog}: error: "  # mars' own prefix, or the script's
    a.prompt_list = None  # prompts given as a list by the caller (mars bench) instead of --prompts
    if a.llama_bin is None:
        a.no_peers = True
    try:
        a.clients_list = [int(x) for x in a.clients.split(",") if x.strip()]
    except ValueError:
        p.error(f"--clients must be a comma list of integers, got {a.clients!r}")
    if not a.clients_list or min(a.clients_list) < 1:
        p.error(f"--clients must be integers >= 1, got {a.clients!r}")
    a.clients_list = list(dict.fromkeys(a.clients_list))
    if a.parallel != "match" and not (a.parallel.isdigit() and int(a.parallel) >= 1):
        p.error(f"--parallel must be 'match' or an integer >= 1, got {a.parallel!r}")
    if a.repeat < 1:
        p.error(f"--repeat must be >= 1, got {a.repeat}")
    if a.repeat > 1 and a.parallel != "match":
        p.error("--repeat needs --parallel match (rounds of fresh servers per N)")
    for name, v, lo in (("--requests", a.requests, 1), ("-n/--max-tokens", a.max_tokens, 1),
                        ("-t/--threads", a.threads, 1), ("-c", a.ctx_size, 0), ("--draft-max", a.draft_max, 1)):
        if v is not None and v < lo:
            p.error(f"{name} must be >= {lo}, got {v}")
    return a


def load_prompts(path: str | None) -> list[str]:
    if path is None:
        return list(PROMPTS)
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchError(f"--prompts: cannot read {path}: {exc}") from None
    if p.suffix == ".json":
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BenchError(f"--prompts: {path} is not valid JSON: {exc}") from None
        if not isinstance(prompts, list) or not all(isinstance(x, str) for x in prompts):
            raise BenchError(f"--prompts: {path} must hold a JSON array of strings")
    else:
        prompts = [ln.strip() for ln in text.splitlines()]
    prompts = [x for x in prompts if x.strip()]
    if not prompts:
        raise BenchError(f"--prompts: {path} holds no prompts")
    return prompts


def fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    rounds = len({r.get("round", 1) for r in rows}) > 1
    out = [("| round " if rounds else "") + "| config | clients | requests | req/s | tok/s | TTFT mean ms | "
           "TTFT median ms | τ | accept |", ("|---:" if rounds else "") + "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append((f"| {r.get('round', 1)} " if rounds else "") +
                   f"| {r['config']} | {r['clients']} | {r['requests']} | {r['requests_per_s']:.2f} | "
                   f"{r['tokens_per_s']:.1f} | {fmt(r['ttft_mean_ms'], '.0f')} | {fmt(r['ttft_median_ms'], '.0f')} | "
                   f"{fmt(r['tau'], '.2f')} | {fmt(r['acceptance_rate'], '.0%')} |")
    return "\n".join(out)


def run(a: argparse.Namespace, servers: list[Server], stop: threading.Event, rows: list[dict]) -> dict:
    """Every configuration at every N; each row is appended to ``rows`` as it is measured (an
    interrupted sweep keeps the rows it has)."""
    for flag, path in (("-m", a.model), ("-md", a.draft)):
        if path is not None and not Path(path).is_file():
            raise BenchError(f"{flag}: no such file: {path}")
    prompts = a.prompt_list if a.prompt_list else load_prompts(a.prompts)
    notes: list[str] = []
    peer_env = {}
    for item in a.peer_env:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise BenchError(f"--peer-env: expected NAME=VALUE, got {item!r}")
        peer_env[name] = value
    if peer_env:
        notes.append("llama-server's environment adds " + " ".join(a.peer_env))
    llama = None
    if not a.no_peers:
        try:
            llama = LlamaServer(Path(a.llama_bin))
        except FileNotFoundError:
            note = (f"no llama-server in {a.llama_bin} (build it with benchmarks/build_llama_tools.sh): "
                    "llama-server rows skipped")
            print(f"{a.prog}: note: {note}", file=sys.stderr)
            notes.append(note)
    commands: dict[str, str] = {}
    llama_configs = ("llama-server plain", "llama-server spec") if a.draft else ("llama-server plain",)
    if llama is not None and not a.draft:
        notes.append("no draft model (-md): llama-server's speculative rows skipped")

    def measured(row: dict) -> None:
        rows.append(row)
        log(f"  {row['tokens_per_s']:.1f} tok/s, TTFT mean {fmt(row['ttft_mean_ms'], '.0f')} ms")

    def log(msg: str) -> None:
        print(f"{a.prog}: {msg}", file=sys.stderr, flush=True)

    def mars_row(config: str, parallel: int, ns: list[int], rnd: int) -> None:
        srv = Server(f"mars serve (--parallel {parallel})", mars_command(a, max(ns), parallel), servers)
        commands[f"mars serve, --parallel {parallel}"] = shlex.join(srv.cmd)
        srv.wait_ready_line(a.startup_timeout)
        warm_up(a, config, srv.url, prompts)
        for n in ns:
            log(f"{config}, {n} client(s), --parallel {parallel}" + (f", round {rnd}" if a.repeat > 1 else ""))
            measured(dict(run_config(a, config, srv.url, n, prompts, stop), round=rnd))
        srv.stop()

    def llama_row(config: str, n: int, rnd: int) -> None:
        port = free_port()
        cmd = llama.command(a, config == "llama-server spec", n, port)
        srv = Server(f"llama-server ({config.split()[1]}, -np {n})", cmd, servers, env=peer_env)
        commands[f"{config}, -np {n}"] = shlex.join(cmd)
        srv.wait_health(f"http://127.0.0.1:{port}", a.startup_timeout)
        warm_up(a, config, srv.url, prompts)
        log(f"{config}, {n} client(s)" + (f", round {rnd}" if a.repeat > 1 else ""))
        measured(dict(run_config(a, config, srv.url, n, prompts, stop), round=rnd))
        srv.stop()

    # --parallel match: one fresh process per (config, N), mars with --parallel N as llama-server
    # gets -np N (a process that ran the other config would hold these prompts in its prefix
    # caches); the four configurations of one N back to back, round after round
    if a.parallel == "match":
        for rnd in range(1, a.repeat + 1):
            for n in a.clients_list:
                for config in ("mars spec", "mars plain"):
                    mars_row(config, n, [n], rnd)
                if llama is not None:
                    for config in llama_configs:
                        llama_row(config, n, rnd)
    else:  # --parallel P: one mars process per config for every N
        for config in ("mars spec", "mars plain"):
            mars_row(config, int(a.parallel), a.clients_list, 1)
        if llama is not None:
            for config in llama_configs:
                for n in a.clients_list:
                    llama_row(config, n, 1)
    if llama is not None:
        notes.append("llama-server runs with -np N = the number of clients (N slots decoded together: its normal "
                     "way of serving concurrent clients) and -c = N x this -c (it splits -c among its slots; "
                     "mars serve gives each sequence -c)")
        froms = sorted({r["tokens_from"] for r in rows if r["config"].startswith("llama-server")})
        notes.append(f"llama-server completion tokens from: {', '.join(froms)}")
    order = {c: i for i, c in enumerate(CONFIGS)}
    rows.sort(key=lambda r: (r["round"], r["clients"], order[r["config"]]))
    return {"rows": rows, "notes": notes, "servers": commands, "summary": summarize(rows)}


def _ratio(num: dict, den: dict, key: str = "tokens_per_s") -> float | None:
    return num[key] / den[key] if num and den and num.get(key) and den.get(key) else None


def _best(rows: list[dict]) -> dict | None:
    """The row of most tokens/s."""
    return max(rows, key=lambda r: r["tokens_per_s"], default=None)


def _fastest(rows: list[dict]) -> dict | None:
    """The row of the lowest mean TTFT."""
    return min((r for r in rows if r["ttft_mean_ms"]), key=lambda r: r["ttft_mean_ms"], default=None)


def summarize(rows: list[dict]) -> list[dict]:
    """Per N, over the rounds: each configuration's median tokens/s, and the ratios taken within
    each round (mars best / llama-server best, plain / plain, mars spec / mars plain, TTFT)
    as median, min and max."""
    out = []
    for n in sorted({r["clients"] for r in rows}):
        by_round = collections.defaultdict(dict)
        for r in rows:
            if r["clients"] == n:
                by_round[r["round"]][r["config"]] = r
        ratios = collections.defaultdict(list)
        for got in by_round.values():
            mars = [got[c] for c in ("mars spec", "mars plain") if c in got]
            peer = [got[c] for c in ("llama-server plain", "llama-server spec") if c in got]
            for name, v in (("best_vs_llama_best", _ratio(_best(mars), _best(peer))),
                            ("plain_vs_llama_plain", _ratio(got.get("mars plain"), got.get("llama-server plain"))),
                            ("spec_vs_plain", _ratio(got.get("mars spec"), got.get("mars plain"))),
                            ("ttft_vs_llama", _ratio(_fastest(mars), _fastest(peer), "ttft_mean_ms"))):
                if v is not None:
                    ratios[name].append(v)
        entry = {"clients": n, "rounds": len(by_round), "tokens_per_s": {}}
        for c in CONFIGS:
            vals = [got[c]["tokens_per_s"] for got in by_round.values() if c in got]
            if vals:
                entry["tokens_per_s"][c] = statistics.median(vals)
        for name, vals in ratios.items():
            entry[name] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        out.append(entry)
    return out


def summary_table(summary: list[dict]) -> str:
    def cell(e: dict, name: str) -> str:
        v = e.get(name)
        if v is None:
            return "—"
        return f"{v['median']:.2f}× ({v['min']:.2f}–{v['max']:.2f})" if v["min"] != v["max"] else f"{v['median']:.2f}×"

    out = ["| N | rounds | " + " | ".join(f"{c} tok/s" for c in CONFIGS) + " | mars best / llama best | "
           "mars plain / llama plain | mars spec / mars plain | TTFT mars / llama |",
           "|---:|---:|" + "---:|" * len(CONFIGS) + "---:|---:|---:|---:|"]
    for e in summary:
        tps = " | ".join(fmt(e["tokens_per_s"].get(c), ".1f") for c in CONFIGS)
        out.append(f"| {e['clients']} | {e['rounds']} | {tps} | {cell(e, 'best_vs_llama_best')} | "
                   f"{cell(e, 'plain_vs_llama_plain')} | {cell(e, 'spec_vs_plain')} | {cell(e, 'ttft_vs_llama')} |")
    return "\n".join(out)


def write_json(a: argparse.Namespace, command: str, result: dict) -> bool:
    settings = {k: v for k, v in vars(a).items() if k not in ("clients", "prog", "prompt_list", "error_prefix")}
    settings["clients"] = settings.pop("clients_list")
    doc = {"command": command, "settings": settings, **result}
    try:
        Path(a.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        print(f"{a.error_prefix}cannot write {a.json}: {exc}", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None, prog: str = "serve_bench.py",
         default_llama_bin: str | os.PathLike | None = None) -> int:
    """benchmarks/serve_bench.py: parse ``argv`` (default: sys.argv) and run; the exit code."""
    a = parse_args(argv, prog, default_llama_bin)
    command = shlex.join([sys.executable] + sys.argv if argv is None else [prog] + argv)
    return execute(a, command)


def execute(a: argparse.Namespace, command: str) -> int:
    """Run the sweep of settings ``a`` (from :func:`parse_args`); print the tables on stdout
    (progress and notes on stderr) and write --json; the exit code: 0, 2 (an error, one line)
    or 130 (interrupted: the rows measured so far are printed and written)."""
    servers: list[Server] = []
    stop = threading.Event()

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    rows: list[dict] = []
    try:
        result = run(a, servers, stop, rows)
    except BenchError as exc:
        print(f"{a.error_prefix}{exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{a.prog}: interrupted ({len(rows)} row(s) measured)", file=sys.stderr)
        if rows:
            print(table(rows))
            if a.json:
                write_json(a, command, {"rows": rows, "notes": ["interrupted: a partial sweep"], "servers": {},
                                        "summary": summarize(rows)})
        return 130
    finally:
        stop.set()
        stop_all(servers)
    rows = result["rows"]
    print(table(rows))
    print()
    if a.repeat > 1:
        print(f"medians over {a.repeat} rounds (ratios taken within each round: median (min–max)):")
        print(summary_table(result["summary"]))
        print()
    print(f"command: {command}")
    for name, cmd in result["servers"].items():
        print(f"{name}: {cmd}")
    for note in result["notes"]:
        print(f"note: {note}")
    print("note: τ = tokens per target forward (usage.speculative.mean_accepted_length, mean over requests), "
          "where the server reports it; accept = accepted / drafted draft tokens")
    if a.json and not write_json(a, command, result):
        return 2
    return 0


def exit_now(code: int) -> None:
    """Exit with ``code``.  A row cut short leaves client threads in their requests (until the
    stopped servers' sockets close them), which the interpreter would wait for: an interrupted
    sweep (130) ends at once."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 130:
        os._exit(code)
    sys.exit(code)
