#!/usr/bin/env python3
"""Memory over many requests: the resident set size of one `mars serve --parallel N` process while
concurrent clients send 1,000 requests (issue 23: memory stays bounded).

    .venv/bin/python benchmarks/rss_bench.py -m MODEL.gguf [-md DRAFT.gguf] [--requests 1000] \\
        [--clients 8] [--parallel 8] [-n 16] [-t 2] [-c 1024]

Clients send streamed chat requests (temperature 0.8, a different prompt each, some with a stop string,
every tenth one dropped mid-stream); the server's RSS (/proc/PID/status VmRSS) is read after every
10 % of the requests.  Prints one line per sample and the growth from the first sample (after 10 %
of the requests, so the model, the caches and the allocator's pools are in it) to the last.
Linux only (/proc).  Errors are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", required=True)
    ap.add_argument("-md", default=None)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-c", type=int, default=1024)
    a = ap.parse_args()
    exe = Path(sys.executable).with_name("mars")
    cmd = [str(exe), "serve", "-m", a.m, "--port", "0", "-t", str(a.t), "-c", str(a.c),
           "--parallel", str(a.parallel), "--quiet", "--queue", str(4 * a.clients)]
    if a.md:
        cmd += ["-md", a.md]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = None
    deadline = time.time() + 300
    while url is None and time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(r"on (http://\S+)/v1", line)
        url = m.group(1) if m else None
    if url is None:
        print("rss_bench: error: mars serve did not start", file=sys.stderr)
        proc.kill()
        return 2
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    lock = threading.Lock()
    done = [0]
    samples: list[tuple[int, int]] = []
    step = max(1, a.requests // 10)

    def one(i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"Request {i}: write about the number {i * 7919 % 1000}."}],
                "max_tokens": a.n, "temperature": 0.8, "seed": i, "stream": True}
        if i % 3 == 0:
            body["stop"] = ["\n\n"]
        with httpx.Client(timeout=300) as c, c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            for n, _ in enumerate(r.iter_lines()):
                if i % 10 == 0 and n == 3:
                    break  # a client that goes away mid-stream
        with lock:
            done[0] += 1
            if done[0] % step == 0:
                samples.append((done[0], rss_kib(proc.pid)))
                print(f"{done[0]:5d} requests: RSS {samples[-1][1] / 1024:.1f} MiB", flush=True)

    t0 = time.time()
    try:
        with ThreadPoolExecutor(a.clients) as pool:
            list(pool.map(one, range(a.requests)))
    finally:
        proc.terminate()
        proc.wait(30)
    first, last = samples[0][1], samples[-1][1]
    print(f"{a.requests} requests in {time.time() - t0:.0f} s; RSS {first / 1024:.1f} MiB after {samples[0][0]} "
          f"-> {last / 1024:.1f} MiB after {samples[-1][0]} ({(last - first) / 1024:+.1f} MiB)")
    print("command: " + " ".join([sys.executable] + sys.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
