"""Peers: other speculative decoders run on the same prompts and settings.

* llama-cpp-python's ``LlamaPromptLookupDecoding`` (in process; its ``generate``
  is wrapped to record the token ids ``create_completion`` does not return);
* llama.cpp's ``llama-speculative-simple`` and ``llama-completion`` binaries
  (subprocesses; the flag spelling is read from their ``--help`` and their
  printed statistics are parsed).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ..core.errors import MarsError
from .config import PEER_LCP, PEER_SPEC, BenchSettings, Sample

LLAMA_CPP_BINARIES = ("llama-speculative-simple", "llama-completion")


class LlamaCppPythonPeer:
    """llama-cpp-python's own prompt-lookup speculative decoding (``Llama`` +
    ``LlamaPromptLookupDecoding``), timed around ``create_completion``.

    Before the timed call the prompt minus its last token is evaluated (an
    untimed one-token completion), so the timed call, like ours, evaluates the
    last prompt token and decodes: prompt evaluation is excluded on both sides.
    """

    name = PEER_LCP

    def __init__(self, target: Path, *, n_ctx: int, num_pred_tokens: int, max_ngram_size: int = 3,
                 n_gpu_layers: int | None = None, n_threads: int | None = None):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from ..llama.runtime import default_threads, gpu_offload_supported

        if n_gpu_layers is None:
            n_gpu_layers = -1 if gpu_offload_supported() else 0
        try:
            self.llm = Llama(
                model_path=str(target),
                draft_model=LlamaPromptLookupDecoding(max_ngram_size=max_ngram_size, num_pred_tokens=num_pred_tokens),
                logits_all=True, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers,
                n_threads=n_threads or default_threads(), n_threads_batch=n_threads or default_threads(),
                verbose=False,
            )
        except (ValueError, RuntimeError) as exc:
            raise MarsError(f"llama-cpp-python could not load {target}: {exc}") from None
        # Record the token ids create_completion produces (it only returns text).
        self._tokens: list[int] = []
        inner = self.llm.generate

        def recording(*args, **kwargs):
            for tok in inner(*args, **kwargs):
                self._tokens.append(int(tok))
                yield tok

        self.llm.generate = recording

    def generate(self, prompt: Sequence[int], s: BenchSettings) -> Sample:
        opts = dict(temperature=s.temperature, top_k=s.top_k if s.temperature > 0 else 1, top_p=s.top_p,
                    min_p=s.min_p, repeat_penalty=1.0, seed=max(s.seed, 0))
        prompt = [int(t) for t in prompt]
        if len(prompt) > 1:
            self.llm.create_completion(prompt[:-1], max_tokens=1, **opts)
        self._tokens = []
        t0 = time.perf_counter()
        out = self.llm.create_completion(prompt, max_tokens=s.max_tokens, **opts)
        dt = time.perf_counter() - t0
        n = int(out["usage"]["completion_tokens"])
        return Sample(text=out["choices"][0]["text"], tokens=self._tokens[:n], n_generated=n, time_decode_s=dt)

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.close()


_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens\s+in\s+([\d.]+)\s*s(?:econds)?\s*,\s*speed:\s*([\d.]+)\s*t/s")
_N_DRAFTED = re.compile(r"\bn_drafted\s*=\s*(\d+)")
_N_ACCEPT = re.compile(r"\bn_accept(?:ed)?\s*=\s*(\d+)")
_ACCEPT_PCT = re.compile(r"\baccept\s*=\s*([\d.]+)\s*%")
_EVAL_TIME = re.compile(r"(?<!prompt )\beval time\s*=\s*([\d.]+)\s*ms\s*/\s*(\d+)\s*(?:runs|tokens)")
_PROMPT_EVAL = re.compile(r"\bprompt eval time\s*=\s*([\d.]+)\s*ms\s*/\s*(\d+)\s*tokens")
_ENCODED = re.compile(r"encoded\s+(\d+)\s+tokens\s+in\s+([\d.]+)\s*s(?:econds)?")


def parse_llama_cpp_stats(output: str) -> dict:
    """Stats printed by llama.cpp's tools.

    ``llama-speculative-simple``: "decoded N tokens in S seconds, speed: X t/s",
    "n_drafted = D", "n_accept = A" / "accept = P%".  ``llama-completion`` (and
    any tool ending with llama_perf_context_print): "eval time = MS ms / N runs".
    Returns n_generated, time_decode_s and, where printed, n_drafted/n_accepted.
    """
    stats: dict = {}
    m = _DECODED.findall(output)
    if m:
        n, secs, speed = m[-1]
        stats["n_generated"] = int(n)
        stats["time_decode_s"] = float(secs) if float(secs) > 0 else (int(n) / float(speed) if float(speed) > 0 else 0.0)
    else:
        ev = _EVAL_TIME.findall(output)
        if ev:
            ms, n = ev[-1]
            stats["n_generated"] = int(n)
            stats["time_decode_s"] = float(ms) / 1000.0
    enc = _ENCODED.findall(output)
    pe = _PROMPT_EVAL.findall(output)
    if enc:  # llama-speculative-simple: the target's prompt
        stats["n_prefill"], stats["time_prefill_s"] = int(enc[-1][0]), float(enc[-1][1])
    elif pe:
        stats["n_prefill"], stats["time_prefill_s"] = int(pe[-1][1]), float(pe[-1][0]) / 1000.0
    d = _N_DRAFTED.findall(output)
    a = _N_ACCEPT.findall(output)
    if d:
        stats["n_drafted"] = int(d[-1])
    if a:
        stats["n_accepted"] = int(a[-1])
    elif d and _ACCEPT_PCT.findall(output):
        stats["n_accepted"] = round(int(d[-1]) * float(_ACCEPT_PCT.findall(output)[-1]) / 100.0)
    return stats


def find_llama_cpp_binaries(bin_dir: str | os.PathLike) -> dict[str, Path]:
    """``llama-speculative-simple`` and ``llama-completion`` in ``bin_dir`` (MarsError if absent)."""
    d = Path(bin_dir).expanduser()
    if not d.is_dir():
        raise MarsError(f"--llama-cpp-bin: {d} is not a directory")
    found, missing = {}, []
    for name in LLAMA_CPP_BINARIES:
        cands = [d / name, d / f"{name}.exe"]
        hit = next((c for c in cands if c.is_file() and os.access(c, os.X_OK)), None)
        if hit is None:
            missing.append(name)
        else:
            found[name] = hit
    if missing:
        raise MarsError(
            f"--llama-cpp-bin: {', '.join(missing)} not found (or not executable) in {d}; "
            "build llama.cpp with its examples and tools and point at its bin/ folder"
        )
    return found


class LlamaCppBinaryPeer:
    """One llama.cpp binary run per prompt, with our model, prompt, -n and sampling.

    The binary's ``--help`` decides the flag spelling: current llama.cpp wants
    ``--spec-type draft-simple|ngram-simple`` and ``--spec-draft-n-max``, older
    builds ``--draft-max`` (and drafted with ``-md`` alone).
    """

    def __init__(self, binary: Path, method: str, s: BenchSettings, drafter: str = "none", k: int | None = None):
        self.binary, self.method, self.drafter = Path(binary), method, drafter
        self.k = k if k is not None else s.draft_max
        self.help = self._help()
        self.tmp = Path(tempfile.mkdtemp(prefix="mars-bench-"))
        self.args = self._args(s)

    def _help(self) -> str:
        try:
            p = subprocess.run([str(self.binary), "--help"], capture_output=True, text=True, timeout=60, errors="replace")
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MarsError(f"cannot run {self.binary}: {exc}") from None
        return (p.stdout or "") + (p.stderr or "")

    def _has(self, flag: str) -> bool:
        return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", self.help) is not None

    def _args(self, s: BenchSettings) -> list[str]:
        a = ["-m", str(s.target), "-n", str(s.max_tokens), "-c", str(s.n_ctx)]
        if s.temperature > 0:
            a += ["--temp", str(s.temperature), "--top-k", str(s.top_k), "--top-p", str(s.top_p),
                  "--min-p", str(s.min_p), "-s", str(max(s.seed, 0))]
        else:
            a += ["--temp", "0", "--top-k", "1", "-s", str(max(s.seed, 0))]
        if s.n_threads:
            a += ["-t", str(s.n_threads)]
        if s.n_gpu_layers is not None:
            a += ["-ngl", str(s.n_gpu_layers if s.n_gpu_layers >= 0 else 999)]
        if self._has("--no-escape"):
            a.append("--no-escape")
        if self.method == PEER_SPEC:
            n_max = "--spec-draft-n-max" if self._has("--spec-draft-n-max") else "--draft-max"
            a += [n_max, str(self.k)]
            if self.drafter == "mtp":  # the target's own nextn layers (llama.cpp's draft-mtp)
                if not self._has("draft-mtp"):
                    raise MarsError(f"{self.binary.name} cannot draft with MTP layers (no --spec-type draft-mtp): "
                                    "an older llama.cpp")
                a += ["--spec-type", "draft-mtp"]
            elif self.drafter == "eagle3":  # the EAGLE-3 head as llama.cpp's draft model (draft-eagle3)
                if not self._has("draft-eagle3"):
                    raise MarsError(f"{self.binary.name} cannot draft with an EAGLE-3 head (no --spec-type "
                                    "draft-eagle3): an older llama.cpp")
                a += ["-md", str(s.draft), "--spec-type", "draft-eagle3"]
            elif self.drafter == "model":
                a += ["-md", str(s.draft)]
                if s.n_gpu_layers_draft is not None:
                    a += ["-ngld", str(s.n_gpu_layers_draft if s.n_gpu_layers_draft >= 0 else 999)]
                if self._has("--spec-type"):
                    a += ["--spec-type", "draft-simple"]
            else:
                if not self._has("--spec-type"):
                    raise MarsError(
                        f"{self.binary.name} has no --spec-type (an older llama.cpp): it cannot draft by n-gram "
                        "lookup; use --drafter model with -md, or a newer llama.cpp"
                    )
                a += ["--spec-type", "ngram-simple"]
                if self._has("--spec-ngram-simple-size-n"):
                    a += ["--spec-ngram-simple-size-n", str(s.ngram_max)]
                if self._has("--spec-ngram-simple-size-m"):
                    a += ["--spec-ngram-simple-size-m", str(self.k)]
        else:
            for flag in ("-no-cnv", "--no-display-prompt"):
                if self._has(flag):
                    a.append(flag)
        return a

    def generate(self, prompt_text: str, s: BenchSettings) -> Sample:
        f = self.tmp / "prompt.txt"
        f.write_text(prompt_text + "\n", encoding="utf-8")  # llama.cpp's -f drops one trailing newline
        cmd = [str(self.binary)] + self.args + ["-f", str(f)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=1800, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MarsError(f"{self.binary.name} failed: {exc}") from None
        out = (p.stdout or "") + "\n" + (p.stderr or "")
        if p.returncode != 0:
            last = next((ln.strip() for ln in reversed(out.splitlines()) if ln.strip()), "no output")
            raise MarsError(f"{self.binary.name} exited with {p.returncode}: {last}")
        st = parse_llama_cpp_stats(out)
        if "n_generated" not in st:
            raise MarsError(f"could not find decode statistics in the output of {self.binary.name}")
        return Sample(text=None, tokens=None, n_generated=st["n_generated"], time_decode_s=st["time_decode_s"],
                      n_drafted=st.get("n_drafted"), n_accepted=st.get("n_accepted"),
                      n_prefill=st.get("n_prefill"), time_prefill_s=st.get("time_prefill_s"))

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
