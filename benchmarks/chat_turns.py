#!/usr/bin/env python3
"""A chat's turns through `mars serve`: time to first token as the conversation grows.

One client sends a conversation turn after turn (a long system prompt, then each question with
every earlier answer), streamed, greedy, and prints per turn the prompt's tokens, how many came
from the KV cache (``usage.prompt_tokens_details.cached_tokens``) and the time to the first token.
Run it with ``--parallel 1`` (one at a time: the engine keeps any common prefix) and ``--parallel 8``
(batched sequences keep only rows computed exactly as a fresh run would: ``llama.streams.exact_reuse``)
to see what a chat pays at each setting (BENCHMARKS.md, run 36).

    .venv/bin/python benchmarks/chat_turns.py -m TARGET.gguf -md DRAFT.gguf --parallel 8 -t 2
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = ("You are a careful assistant for a team of engineers who build local inference tools. "
          "Answer briefly, cite the relevant part of the question, and never invent facts. ") * 8
QUESTIONS = ["What is speculative decoding?", "Why does a draft model need the same tokenizer?",
             "What limits the speed on a CPU?", "And on a GPU?", "Summarize our conversation."]


def start(a: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [str(ROOT / ".venv" / "bin" / "mars"), "serve", "-m", a.model, "--port", "0", "-t", str(a.threads),
           "-c", str(a.ctx_size), "--parallel", str(a.parallel), "-q"]
    cmd += ["-md", a.model_draft] if a.model_draft else []
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in proc.stderr:
        m = re.search(r" on (http://\S+/v1)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1)
    raise SystemExit(f"mars serve did not start (exit {proc.wait()})")


def turn(url: str, messages: list[dict], max_tokens: int) -> tuple[str, dict, float]:
    t0, first, text, usage = time.perf_counter(), None, "", {}
    with httpx.stream("POST", f"{url}/chat/completions", timeout=600, json={
            "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("choices") and obj["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t0 if first is None else first
                text += obj["choices"][0]["delta"]["content"]
            usage = obj.get("usage") or usage
    return text, usage, first if first is not None else time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True, help="Target GGUF.")
    p.add_argument("-md", "--model-draft", help="Draft GGUF (default: mars serve's drafter).")
    p.add_argument("--parallel", type=int, default=1, help="mars serve's --parallel (default 1).")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-c", "--ctx-size", type=int, default=2048)
    p.add_argument("-n", "--max-tokens", type=int, default=48, help="Tokens of each answer (default 48).")
    p.add_argument("--turns", type=int, default=len(QUESTIONS), help=f"Turns (at most {len(QUESTIONS)}).")
    p.add_argument("--json", help="Write the turns here.")
    a = p.parse_args()
    proc, url = start(a)
    rows, messages = [], [{"role": "system", "content": SYSTEM}]
    try:
        for q in QUESTIONS[: max(1, a.turns)]:
            messages.append({"role": "user", "content": q})
            text, usage, ttft = turn(url, messages, a.max_tokens)
            messages.append({"role": "assistant", "content": text})
            rows.append({"prompt_tokens": usage.get("prompt_tokens"),
                         "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                         "ttft_ms": round(1000 * ttft)})
            print(f"--parallel {a.parallel}: turn {len(rows)}: prompt {rows[-1]['prompt_tokens']}, "
                  f"cached {rows[-1]['cached_tokens']}, time to first token {rows[-1]['ttft_ms']} ms", flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    if a.json:
        Path(a.json).write_text(json.dumps({"parallel": a.parallel, "model": a.model, "turns": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
