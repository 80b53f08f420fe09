#!/usr/bin/env python3
"""Serving throughput and latency: `mars serve` against llama-server, with N concurrent clients.

The sweep lives in ``mars_local.bench.serving`` (``mars bench --clients`` runs it too); its
docstring says what is measured and how.  This script gives it every option, with llama.cpp's
tools taken from .cache/llama-bin (benchmarks/build_llama_tools.sh) by default:

    .venv/bin/python benchmarks/serve_bench.py -m TARGET.gguf -md DRAFT.gguf --clients 1,2,4,8,16 \\
        [--requests 2] [-n 64] [-t 2] [-c 4096] [--verify strict] [--repeat R] \\
        [--llama-bin .cache/llama-bin | --no-peers] [--prompts FILE] [--json OUT.json]
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mars_local.bench import serving  # noqa: E402

if __name__ == "__main__":
    serving.exit_now(serving.main(default_llama_bin=ROOT / ".cache" / "llama-bin"))
