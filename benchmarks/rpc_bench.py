#!/usr/bin/env python3
"""Plain vs speculative decoding with the target on an RPC server behind a growing network delay.

Every target forward over llama.cpp's RPC backend pays network round trips; a verify
window of k+1 rows pays them once for up to k+1 tokens, so speculation's gain should
grow with the latency.  This script starts one ``ggml-rpc-server`` on loopback
(``scripts/build_rpc_server.sh`` builds it), puts a delay proxy of its own in front
of it (asyncio; each chunk is forwarded ``delay/2`` ms later in each direction, so a
round trip gains ``delay`` ms, without a bandwidth cap), and for each delay runs
``mars run --rpc PROXY`` with all target layers remote, plain (``--no-draft``) and
speculative (strict, the draft model local), reading tokens/s from ``--json``.

    .venv/bin/python benchmarks/rpc_bench.py -m TARGET.gguf -md DRAFT.gguf --delays 0,1,5 -t 2

(default models: the bundled SmolLM2 in F16 as the target, its Q4_1 as the draft).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RPC_BIN = ROOT / ".cache" / "rpc-server" / "current" / "ggml-rpc-server"
MARS = str(Path(sys.executable).with_name("mars"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DelayProxy:
    """127.0.0.1:port → upstream, each chunk delivered ``one_way`` seconds after it was read."""

    def __init__(self, upstream: tuple[str, int], one_way: float):
        self.upstream, self.one_way, self.port = upstream, one_way, free_port()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def pipe(reader, writer):
            q: asyncio.Queue = asyncio.Queue()

            async def pump():
                while True:
                    due, data = await q.get()
                    if data is None:
                        break
                    wait = due - self.loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    writer.write(data)
                    await writer.drain()
                writer.close()

            task = asyncio.create_task(pump())
            while data := await reader.read(1 << 16):
                q.put_nowait((self.loop.time() + self.one_way, data))
            q.put_nowait((0, None))
            await task

        async def handle(reader, writer):
            up_r, up_w = await asyncio.open_connection(*self.upstream)
            for sock in (writer.get_extra_info("socket"), up_w.get_extra_info("socket")):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer), return_exceptions=True)

        async def main():
            server = await asyncio.start_server(handle, "127.0.0.1", self.port)
            ready.set()
            async with server:
                await server.serve_forever()

        try:
            self.loop.run_until_complete(main())
        except RuntimeError:
            pass


def run(args, rpc: str, extra: list[str], prompt: str) -> dict:
    cmd = [MARS, "run", "--json", "--chat", "--ignore-eos", "--temp", "0", "-n", str(args.n_predict), "-t", str(args.threads), "-m", args.model,
           "--rpc", rpc, "-ngl", "all", *extra, prompt]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise SystemExit(f"rpc_bench: error: {' '.join(cmd)}: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout)["stats"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="target GGUF (default: the bundled SmolLM2 requantized to F16)")
    ap.add_argument("-md", "--model-draft", help="draft GGUF, kept local (default: the bundled SmolLM2 Q4_1)")
    ap.add_argument("--delays", default="0,1,5", help="round-trip delays in ms (default 0,1,5)")
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads of mars and of the rpc-server")
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--rpc-server", default=str(RPC_BIN))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    if args.model is None or args.model_draft is None:
        from mars_local.models.registry import load_registry, model_path

        bundled = model_path(load_registry().get("smollm2-135m"), "target")
        args.model_draft = args.model_draft or str(bundled)
        if args.model is None:
            f16 = ROOT / ".cache" / "test-models" / "SmolLM2-135M-Instruct.F16.gguf"
            args.model = str(f16 if f16.exists() else bundled)
    if not Path(args.rpc_server).exists():
        print(f"rpc_bench: error: {args.rpc_server} not found (scripts/build_rpc_server.sh builds it)", file=sys.stderr)
        return 2
    delays = [float(x) for x in args.delays.split(",")]
    port = free_port()
    server = subprocess.Popen([args.rpc_server, "-H", "127.0.0.1", "-p", str(port), "-t", str(args.threads)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    prompt = "Write a short story about a robot who learns to paint, in five sentences."
    try:
        time.sleep(1.0)
        for d in delays:
            proxy = DelayProxy(("127.0.0.1", port), d / 2000.0)
            rpc = f"127.0.0.1:{proxy.port}"
            plain = run(args, rpc, ["--no-draft"], prompt)
            spec = run(args, rpc, ["-md", args.model_draft, "--drafter", "model", "--verify", "strict",
                                   "--draft-max", str(args.draft_max)], prompt)
            rows.append({"delay_ms": d, "plain_tok_s": plain["tokens_per_second"],
                         "spec_tok_s": spec["tokens_per_second"], "tau": spec["mean_accepted_length"],
                         "speedup": spec["tokens_per_second"] / max(plain["tokens_per_second"], 1e-9)})
            r = rows[-1]
            print(f"delay {d:g} ms: plain {r['plain_tok_s']:.2f} tok/s, speculative {r['spec_tok_s']:.2f} tok/s "
                  f"(tau {r['tau']:.2f}), {r['speedup']:.2f}x", flush=True)
    finally:
        server.kill()
        server.wait()
    print("\n| round-trip delay | plain tok/s | speculative tok/s | τ | speculative / plain |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['delay_ms']:g} ms | {r['plain_tok_s']:.2f} | {r['spec_tok_s']:.2f} | {r['tau']:.2f} | "
              f"{r['speedup']:.2f}× |")
    print(f"\ncommand: {' '.join([os.path.relpath(sys.argv[0]), *sys.argv[1:]])}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model": args.model, "draft": args.model_draft, "rows": rows},
                                                  indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
