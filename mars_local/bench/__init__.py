"""`mars bench`: speed and quality of plain, strict and MARS decoding on one prompt set.

Every configuration runs on the same prompts, the same models and the same
sampling settings:

* ``plain``   -- no speculation (the same decode loop with k = 0): the baseline.
* ``strict``  -- lossless speculative decoding, with a fixed draft length k
  (``draft_max``) and with the adaptive draft length.
* ``mars``    -- MARS verification at each θ, fixed and adaptive k.
* peers       -- llama-cpp-python's ``LlamaPromptLookupDecoding`` and, when a
  directory of llama.cpp binaries is given, ``llama-speculative-simple`` and
  ``llama-completion`` (run as subprocesses; their printed stats are parsed).

Runs are interleaved prompt by prompt (every configuration of a prompt runs
before the next prompt, in an order rotated from prompt to prompt), so a slow
spell on a shared machine hits every configuration alike and the target's KV
cache keeps the prompt between configurations.  The target is loaded once per
drafter and once more by the llama-cpp-python peer (``peers=False`` /
``--no-peers`` leaves it out); each runs with llama.cpp's default threads
unless ``n_threads`` is given.  A warm-up generation precedes the timed ones.

Metrics, per category and over all prompts (category ``"all"``):

tokens_per_second     generated tokens / decode seconds, summed over prompts
                      (prompt evaluation excluded, as llama.cpp's "decoded").
speedup_vs_plain      tokens_per_second / plain's tokens_per_second.
acceptance_rate       accepted drafts / drafted tokens (null without drafts).
mean_accepted_length  generated tokens / target forwards (τ; 1.0 for plain, a
                      hair less when a generation ends at an end-of-generation
                      token, whose forward produced no kept token).
relaxed_share         accepted drafts that only MARS accepted / accepted drafts.
time_*_s              decode time spent in target forwards, drafting and the
                      verification rule (their sum is at most time_decode_s).
token_agreement       tokens equal to plain's output before the first
                      divergence, divided by the longer of the two outputs;
                      summed over prompts before dividing (1.0 = identical).
task_score            the prompts' own task metric, mean over the prompts
                      that have one, each in [0, 1]: ROUGE-L F1
                      (``rouge-score``, stemmed) for summarization, chrF/100
                      (``sacrebleu``) for translation, 1/0 for math (the number
                      after the last "Answer:" equals the reference) and for
                      rag (the reference appears in the output, ignoring case).
quality_recovery      task_score of the method / task_score of plain (the
                      paper's "quality recovery"); null when the category has
                      no metric or plain scores 0.  For "all" the sums of the
                      per-prompt scores are divided.
nll_ratio             mean negative log-likelihood per generated token of the
                      method's outputs / that of plain's outputs, both scored
                      by the target itself at T = 1 (> 1: the method wrote
                      text the target finds less likely).

A peer reports what it can: llama-cpp-python gives text and tokens but no
acceptance counts; llama.cpp's binaries give speed and acceptance but their
text is not parsed, so agreement, quality and NLL are null for them.

Use :func:`run_bench` from Python, or ``mars bench`` (``mars_local.cli_bench``).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..errors import MarsError

__all__ = [
    "BenchPrompt",
    "BenchSettings",
    "BenchResult",
    "RunConfig",
    "Sample",
    "DEFAULT_PROMPTS_DIR",
    "DEFAULT_THETAS",
    "METRICS",
    "load_prompts",
    "quick_subset",
    "plan_runs",
    "run_bench",
    "summarize",
    "task_score",
    "extract_answer",
    "score_exact",
    "score_contains",
    "score_rouge_l",
    "score_chrf",
    "common_prefix_len",
    "TargetScorer",
    "LlamaCppPythonPeer",
    "LlamaCppBinaryPeer",
    "parse_llama_cpp_stats",
    "find_llama_cpp_binaries",
    "render_tables",
    "write_json",
    "write_plot",
]

DEFAULT_PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
DEFAULT_THETAS = (0.85, 0.9, 0.95)
METRICS = ("exact", "exact_contains", "rougeL", "chrf")
PEER_LCP = "llama-cpp-python-prompt-lookup"
PEER_SPEC = "llama.cpp-speculative-simple"
PEER_COMPLETION = "llama.cpp-completion"
LLAMA_CPP_BINARIES = ("llama-speculative-simple", "llama-completion")


# =================================================================== prompts
@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: chat ``messages`` or a raw ``text`` prompt."""

    id: str
    category: str
    messages: tuple | None = None
    text: str | None = None
    reference: str | None = None
    metric: str | None = None

    @property
    def scored(self) -> bool:
        return self.metric is not None and self.reference is not None


def _prompt_from_line(obj, where: str, default_category: str) -> BenchPrompt:
    if not isinstance(obj, dict):
        raise MarsError(f"{where}: expected a JSON object")
    pid = obj.get("id", obj.get("question_id"))
    if isinstance(pid, bool) or not isinstance(pid, (str, int)) or str(pid).strip() == "":
        raise MarsError(f"{where}: missing 'id'")
    pid = str(pid)
    category = obj.get("category", default_category)
    if not isinstance(category, str) or not category.strip():
        raise MarsError(f"{where}: 'category' must be a non-empty string")
    messages, text = obj.get("messages"), obj.get("prompt")
    turns = obj.get("turns")  # MT-Bench / Spec-Bench question files: the first turn
    if messages is None and text is None and isinstance(turns, list) and turns and isinstance(turns[0], str):
        messages = [{"role": "user", "content": turns[0]}]
    if (messages is None) == (text is None):
        raise MarsError(f"{where}: give exactly one of 'messages' (a chat) or 'prompt' (a string)")
    if messages is not None:
        ok = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
        if not ok:
            raise MarsError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} strings")
        messages = tuple({"role": m["role"], "content": m["content"]} for m in messages)
    elif not isinstance(text, str) or not text.strip():
        raise MarsError(f"{where}: 'prompt' must be a non-empty string")
    metric = obj.get("metric")
    if metric is not None and metric not in METRICS:
        raise MarsError(f"{where}: unknown metric {metric!r}; expected one of {', '.join(METRICS)} or null")
    ref = obj.get("reference")
    if isinstance(ref, bool) or not (ref is None or isinstance(ref, (str, int, float))):
        raise MarsError(f"{where}: 'reference' must be a string, a number or null")
    return BenchPrompt(pid, category.strip(), messages, text, None if ref is None else str(ref), metric)


def load_prompts(paths: Sequence[str | os.PathLike] | None = None, categories: Sequence[str] | None = None) -> list[BenchPrompt]:
    """Read JSONL prompt files (default: the built-in set, one file per category).

    Each line: ``{"id", "category"?, "messages" | "prompt", "reference"?, "metric"?}``
    (see mars_local/bench/prompts/README.md).  A line without a category gets the
    file's stem.  ``categories`` keeps only those categories, in that order.
    Any problem is a :class:`MarsError` naming the file and line.
    """
    if not paths:
        if not DEFAULT_PROMPTS_DIR.is_dir():
            raise MarsError(f"the built-in prompt set ({DEFAULT_PROMPTS_DIR}) is not installed; pass --prompts FILE.jsonl")
        paths = sorted(DEFAULT_PROMPTS_DIR.glob("*.jsonl"))
    prompts: list[BenchPrompt] = []
    for path in map(Path, paths):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise MarsError(f"cannot read prompts file {path}: {why}") from None
        seen: set[str] = set()
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise MarsError(f"{where}: not valid JSON ({exc.msg})") from None
            p = _prompt_from_line(obj, where, path.stem)
            if p.id in seen:
                raise MarsError(f"{where}: duplicate id {p.id!r}")
            seen.add(p.id)
            prompts.append(p)
    if not prompts:
        raise MarsError("the prompts file(s) hold no prompts")
    if categories:
        have = list(dict.fromkeys(p.category for p in prompts))
        for c in categories:
            if c not in have:
                raise MarsError(f"unknown category {c!r}; the prompts have: {', '.join(have)}")
        order = {c: i for i, c in enumerate(dict.fromkeys(categories))}
        prompts = sorted((p for p in prompts if p.category in order), key=lambda p: order[p.category])
    return prompts


def quick_subset(prompts: Sequence[BenchPrompt], per_category: int = 1) -> list[BenchPrompt]:
    """The first ``per_category`` prompts of each category."""
    taken: dict[str, int] = {}
    out = []
    for p in prompts:
        if taken.get(p.category, 0) < per_category:
            taken[p.category] = taken.get(p.category, 0) + 1
            out.append(p)
    return out


# =================================================================== metrics
_NUMBER = re.compile(r"[-−]?\d[\d,]*(?:\.\d+)?")


def _number(s: str) -> float | None:
    m = _NUMBER.search(s)
    if not m:
        return None
    try:
        return float(m.group().replace(",", "").replace("−", "-"))
    except ValueError:
        return None


def extract_answer(text: str) -> float | None:
    """The number after the last "Answer:" (case-insensitive), or None."""
    idx = text.lower().rfind("answer:")
    if idx < 0:
        return None
    return _number(text[idx + len("answer:") :])


def score_exact(output: str, reference: str) -> float:
    """1.0 when the number after the last "Answer:" equals the reference number."""
    got, want = extract_answer(output), _number(reference)
    return float(got is not None and want is not None and math.isclose(got, want, rel_tol=0, abs_tol=1e-9))


def score_contains(output: str, reference: str) -> float:
    """1.0 when the reference appears in the output, ignoring case."""
    return float(reference.strip().casefold() in output.casefold())


_rouge = None


def score_rouge_l(output: str, reference: str) -> float:
    """ROUGE-L F1 (rouge-score, Porter stemmer), in [0, 1]."""
    global _rouge
    if _rouge is None:
        from rouge_score import rouge_scorer

        _rouge = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return float(_rouge.score(reference, output)["rougeL"].fmeasure)


_chrf = None


def score_chrf(output: str, reference: str) -> float:
    """Sentence chrF (sacrebleu's defaults: character 6-grams, β = 2) / 100, in [0, 1]."""
    global _chrf
    if _chrf is None:
        from sacrebleu.metrics import CHRF

        _chrf = CHRF()
    return float(_chrf.sentence_score(output.strip(), [reference]).score) / 100.0


_SCORERS = {"exact": score_exact, "exact_contains": score_contains, "rougeL": score_rouge_l, "chrf": score_chrf}


def task_score(metric: str | None, output: str, reference: str | None) -> float | None:
    """A prompt's task metric in [0, 1], or None when it has none."""
    if metric is None or reference is None:
        return None
    try:
        fn = _SCORERS[metric]
    except KeyError:
        raise MarsError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}") from None
    return fn(output, reference)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading positions where ``a`` and ``b`` hold the same token."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class TargetScorer:
    """Negative log-likelihood of generated tokens under the target at T = 1.

    Scores in ``context`` (a target :class:`~mars_local.runtime.Context`, e.g.
    ``Engine.ctx``: the prompt is then usually cached already) or in a context
    of its own on ``model``.  The context keeps the prompt, minus its last
    token, between outputs of the same prompt.
    """

    def __init__(self, model=None, n_ctx: int = 4096, n_batch: int = 512, n_threads: int | None = None,
                 context=None):
        from ..runtime import Context

        if (model is None) == (context is None):
            raise ValueError("give a model or a context")
        self._own = context is None
        self.ctx = context if context is not None else Context(model, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads)

    def nll(self, prompt: Sequence[int], generated: Sequence[int]) -> np.ndarray:
        """Per-token NLL (nats) of ``generated`` following ``prompt``."""
        generated = [int(t) for t in generated]
        if not generated:
            return np.zeros(0)
        prompt = [int(t) for t in prompt]
        ctx = self.ctx
        ctx.sync(prompt[:-1])
        seq = [prompt[-1]] + generated[:-1]  # row i predicts generated[i]
        out = np.empty(len(generated))
        try:
            for i in range(0, len(seq), ctx.n_batch):
                chunk = seq[i : i + ctx.n_batch]
                z = np.asarray(ctx.eval(chunk, n_out=len(chunk)), dtype=np.float64)
                zmax = z.max(axis=1)
                lse = zmax + np.log(np.exp(z - zmax[:, None]).sum(axis=1))
                tgt = generated[i : i + len(chunk)]
                out[i : i + len(chunk)] = lse - z[np.arange(len(chunk)), tgt]
        finally:
            ctx.truncate(len(prompt) - 1)
        return out

    def close(self) -> None:
        if self._own:
            self.ctx.close()


# ============================================================ configurations
@dataclass(frozen=True)
class RunConfig:
    """One method configuration: a row of the result per category."""

    method: str  # "plain" | "strict" | "mars" | a peer's name
    drafter: str  # "none" | "ngram" | "model" (peers: the drafter they use)
    theta: float | None = None
    k: int | str = 0  # draft length, or "adaptive"

    @property
    def label(self) -> str:
        if self.method == "plain":
            return "plain"
        parts = [self.method]
        if self.method in ("strict", "mars") or self.method == PEER_SPEC:
            parts.append(self.drafter)
        if self.theta is not None:
            parts.append(f"θ={self.theta:g}")
        parts.append(f"k={self.k}")
        return " ".join(parts)

    @property
    def is_peer(self) -> bool:
        return self.method not in ("plain", "strict", "mars")


@dataclass
class BenchSettings:
    """What to run.  ``drafters`` are our drafters ("ngram", "model")."""

    target: Path
    draft: Path | None = None
    drafters: tuple[str, ...] = ("ngram",)
    thetas: tuple[float, ...] = DEFAULT_THETAS
    draft_max: int = 8
    adaptive_modes: tuple[bool, ...] = (False, True)
    fixed_ks: tuple[int, ...] | None = None  # draft lengths of the fixed runs (default: draft_max)
    repeats: int = 1  # generations per (configuration, prompt); the fastest one is kept
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = 0
    n_ctx: int = 4096
    n_gpu_layers: int | None = None
    n_gpu_layers_draft: int | None = None
    n_threads: int | None = None
    ngram_max: int = 3
    peers: bool = True
    llama_cpp_bin: Path | None = None
    peer_ks: tuple[int, ...] | None = None  # llama-speculative-simple's draft lengths (default: draft_max)
    warmup: bool = True
    label: str = ""
    notes: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if not self.drafters:
            raise MarsError("no drafter to benchmark")
        for d in self.drafters:
            if d not in ("ngram", "model"):
                raise MarsError(f"--drafter must be ngram or model, got {d!r}")
        if "model" in self.drafters and self.draft is None:
            raise MarsError("the model drafter needs a draft model (-md DRAFT.gguf)")
        if not self.thetas:
            raise MarsError("give at least one θ")
        for t in self.thetas:
            if not (isinstance(t, (int, float)) and math.isfinite(t) and 0.0 < t <= 1.0):
                raise MarsError(f"theta must be in (0, 1], got {t}")
        if self.draft_max < 1:
            raise MarsError(f"--draft-max must be >= 1 for a benchmark of speculative decoding, got {self.draft_max}")
        for k in self.ks():
            if not 1 <= k <= self.draft_max:
                raise MarsError(f"a fixed draft length must be in 1..--draft-max ({self.draft_max}), got {k}")
        for k in self.peer_ks or ():
            if not 1 <= k <= 64:
                raise MarsError(f"a draft length of llama.cpp's speculative decoding must be in 1..64, got {k}")
        if self.repeats < 1:
            raise MarsError(f"--repeat must be >= 1, got {self.repeats}")
        if self.max_tokens < 1:
            raise MarsError(f"the number of tokens to generate must be >= 1, got {self.max_tokens}")
        if self.n_threads is not None and self.n_threads < 1:
            raise MarsError(f"--threads must be >= 1, got {self.n_threads}")
        self.sampling()  # validates temperature, top-k/p, min-p

    def ks(self) -> tuple[int, ...]:
        """Draft lengths of the fixed-k runs."""
        return tuple(dict.fromkeys(self.fixed_ks)) if self.fixed_ks is not None else (self.draft_max,)

    def sampling(self):
        from ..sampling import SamplingParams

        # Greedy runs pass no seed: the engine fixes k for seeded MARS runs.
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            seed=self.seed if self.temperature > 0 else None,
        )


def plan_runs(s: BenchSettings) -> list[RunConfig]:
    """Every configuration, plain first.

    With sampling (T > 0) the engine keeps k fixed for seeded MARS runs (their
    output would otherwise depend on timing), so adaptive MARS is left out.
    """
    runs = [RunConfig("plain", "none", None, 0)]
    ks: list[int | str] = []
    for adaptive in dict.fromkeys(s.adaptive_modes):
        ks += ["adaptive"] if adaptive else list(s.ks())
    for d in s.drafters:
        for k in ks:
            runs.append(RunConfig("strict", d, None, k))
        for th in s.thetas:
            for k in ks:
                if k == "adaptive" and s.temperature > 0:
                    continue
                runs.append(RunConfig("mars", d, float(th), k))
    if s.peers:
        runs.append(RunConfig(PEER_LCP, "ngram", None, s.draft_max))
    if s.llama_cpp_bin is not None:
        for d in s.drafters:
            for k in dict.fromkeys(s.peer_ks or (s.draft_max,)):
                runs.append(RunConfig(PEER_SPEC, d, None, k))
        runs.append(RunConfig(PEER_COMPLETION, "none", None, 0))
    return runs


# ==================================================================== samples
@dataclass
class Sample:
    """One generation of one configuration on one prompt."""

    text: str | None
    tokens: list[int] | None
    n_generated: int
    time_decode_s: float
    time_target_s: float | None = None
    time_draft_s: float | None = None
    time_verify_s: float | None = None
    n_rounds: int | None = None
    n_drafted: int | None = None
    n_accepted: int | None = None
    n_relaxed: int | None = None
    score: float | None = None
    nll_sum: float | None = None
    n_prefill: int | None = None  # prompt tokens the target evaluated (its own prefill, draft excluded)
    time_prefill_s: float | None = None


def _engine_sample(out) -> Sample:
    s = out.stats
    return Sample(
        text=out.text, tokens=list(out.tokens), n_generated=s.n_generated,
        time_decode_s=s.time_decode_s, n_prefill=s.n_prompt_evaluated, time_prefill_s=s.time_prompt_target_s,
        time_target_s=s.time_target_s, time_draft_s=s.time_draft_s, time_verify_s=s.time_verify_s,
        n_rounds=s.n_rounds, n_drafted=s.n_drafted, n_accepted=s.n_accepted, n_relaxed=s.n_relaxed,
    )


# ====================================================================== peers
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

        from ..runtime import default_threads, gpu_offload_supported

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
            if self.drafter == "model":
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


# ================================================================ the bench run
@dataclass
class BenchResult:
    """Runs, their per-prompt samples and the summary rows."""

    settings: BenchSettings
    prompts: list[BenchPrompt]
    runs: list[RunConfig]
    samples: dict[RunConfig, list[Sample]]
    rows: list[dict]
    wall_s: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        s = self.settings
        return {
            "runs": self.rows,
            "meta": {
                "model": s.label or Path(s.target).name,
                "target": str(s.target),
                "draft": str(s.draft) if s.draft else None,
                "drafters": list(s.drafters),
                "thetas": list(s.thetas),
                "draft_max": s.draft_max,
                "fixed_ks": list(s.ks()),
                "repeats": s.repeats,
                "max_tokens": s.max_tokens,
                "temperature": s.temperature,
                "seed": s.seed if s.temperature > 0 else None,
                "n_prompts": len(self.prompts),
                "categories": list(dict.fromkeys(p.category for p in self.prompts)),
                "wall_s": round(self.wall_s, 2),
                "notes": self.notes,
            },
        }


def _prompt_tokens(eng, p: BenchPrompt) -> list[int]:
    try:
        return eng.chat_prompt(list(p.messages)) if p.messages is not None else eng.tokenize(p.text)
    except MarsError as exc:
        raise MarsError(f"prompt {p.id}: {exc}") from None


def _prompt_text(model, tokens: Sequence[int]) -> str:
    toks = list(tokens)
    if toks and model.add_bos and toks[0] == model.bos:
        toks = toks[1:]  # the binaries add BOS themselves
    return model.detokenize(toks, special=True)


def run_bench(
    prompts: Sequence[BenchPrompt],
    settings: BenchSettings,
    progress: Callable[[int, int, str], None] | None = None,
) -> BenchResult:
    """Run every configuration of :func:`plan_runs` on every prompt; summarize.

    ``progress(done, total, label)`` is called after each generation.
    """
    from ..engine import Engine, GenerateConfig

    s = settings
    s.validate()
    prompts = list(prompts)
    if not prompts:
        raise MarsError("no prompts to run")
    notes = list(s.notes)
    if s.temperature > 0 and len(s.adaptive_modes) > 1:
        notes.append("sampling run: adaptive k is left out for MARS (the engine fixes k for seeded MARS runs)")
    bins = find_llama_cpp_binaries(s.llama_cpp_bin) if s.llama_cpp_bin is not None else None
    runs = plan_runs(s)
    t_start = time.perf_counter()
    engines: dict[str, Engine] = {}
    peers: dict[RunConfig, object] = {}
    scorer = None
    try:
        for d in s.drafters:
            engines[d] = Engine(
                s.target, s.draft if d == "model" else None, drafter=d, n_ctx=s.n_ctx,
                n_gpu_layers=s.n_gpu_layers, n_gpu_layers_draft=s.n_gpu_layers_draft, n_threads=s.n_threads,
                ngram_max=s.ngram_max,
            )
        first = engines[s.drafters[0]]
        tokens = [_prompt_tokens(first, p) for p in prompts]
        for p, t in zip(prompts, tokens):
            if len(t) >= first.n_ctx:
                raise MarsError(f"prompt {p.id} is {len(t)} tokens but the context holds {first.n_ctx}; use a larger -c")
        for r in runs:
            if r.method == PEER_LCP:
                peers[r] = LlamaCppPythonPeer(s.target, n_ctx=first.n_ctx, num_pred_tokens=s.draft_max,
                                              max_ngram_size=s.ngram_max, n_gpu_layers=s.n_gpu_layers,
                                              n_threads=s.n_threads)
            elif r.method == PEER_SPEC:
                peers[r] = LlamaCppBinaryPeer(bins["llama-speculative-simple"], PEER_SPEC, s, r.drafter, r.k)
            elif r.method == PEER_COMPLETION:
                peers[r] = LlamaCppBinaryPeer(bins["llama-completion"], PEER_COMPLETION, s)
        texts = [_prompt_text(first.target, t) for t in tokens] if bins else None
        sampling = s.sampling()

        def config(r: RunConfig, max_tokens: int) -> GenerateConfig:
            if r.method == "plain":
                return GenerateConfig(max_tokens=max_tokens, verify="strict", draft_max=0, adaptive=False, sampling=sampling)
            return GenerateConfig(
                max_tokens=max_tokens, verify=r.method, theta=r.theta if r.theta is not None else 0.9,
                draft_max=s.draft_max if r.k == "adaptive" else r.k, adaptive=r.k == "adaptive", sampling=sampling,
            )

        def engine_for(r: RunConfig) -> Engine:
            return first if r.method == "plain" else engines[r.drafter]

        def one(r: RunConfig, i: int) -> Sample:
            try:
                if r.method == PEER_LCP:
                    return peers[r].generate(tokens[i], s)
                if r.is_peer:
                    return peers[r].generate(texts[i], s)
                return _engine_sample(engine_for(r).generate(tokens[i], config(r, s.max_tokens)))
            except MarsError as exc:
                raise MarsError(f"{r.label}, prompt {prompts[i].id}: {exc}") from None

        if s.warmup:  # load weights into caches, start the adaptive cost model
            for r in runs:
                if r.method == "plain" or r.k == "adaptive" or r.method == PEER_LCP:
                    if r.method == PEER_LCP:
                        peers[r].generate(tokens[0], replace(s, max_tokens=min(8, s.max_tokens)))
                    elif not r.is_peer:
                        engine_for(r).generate(tokens[0], config(r, min(8, s.max_tokens)))

        # Quality is scored in the plain engine's own target context once a
        # prompt's generations are done (outside every timed region): the
        # prompt is still in its KV cache.
        scorer = TargetScorer(context=first.ctx)
        samples: dict[RunConfig, list[Sample | None]] = {r: [None] * len(prompts) for r in runs}
        total, done = len(runs) * len(prompts) * s.repeats, 0
        for i, p in enumerate(prompts):
            # Every engine evaluates this prompt from scratch, in one batch, and
            # its other configurations reuse that: the prompt's KV cache is then
            # computed identically for every configuration (llama.cpp's kernels
            # for large batches are not batch-invariant; only verify windows
            # need to be), so strict greedy output can be compared with plain
            # output token for token, and each full prefill is timed.
            for eng in engines.values():
                eng.reset()
            for rep in range(s.repeats):  # each repeat in another order; the fastest generation counts
                shift = (i + rep * (len(runs) // s.repeats or 1)) % len(runs)
                for r in runs[shift:] + runs[:shift]:
                    smp = one(r, i)
                    old = samples[r][i]
                    if old is None or _per_token(smp) < _per_token(old):
                        samples[r][i] = smp
                    done += 1
                    if progress is not None:
                        progress(done, total, r.label)
            nll_cache: dict[tuple, float] = {}
            for r in runs:
                smp = samples[r][i]
                if smp.text is not None:
                    smp.score = task_score(p.metric, smp.text, p.reference)
                if smp.tokens is not None:
                    key = tuple(smp.tokens)
                    if key not in nll_cache:
                        nll_cache[key] = float(scorer.nll(tokens[i], smp.tokens).sum())
                    smp.nll_sum = nll_cache[key]
    finally:
        if scorer is not None:
            scorer.close()
        for peer in peers.values():
            peer.close()
        for eng in engines.values():
            eng.close()
    wall = time.perf_counter() - t_start
    if s.temperature == 0:  # greedy strict must reproduce plain decoding token for token
        for r in runs:
            if r.method == "strict":
                n_diff = sum(a.tokens != b.tokens for a, b in zip(samples[r], samples[runs[0]]))
                if n_diff:
                    notes.append(f"{r.label}: output differs from plain decoding on {n_diff} prompt(s) "
                                 "(numerical near-ties in the target's kernels)")
    rows = summarize(prompts, runs, samples)
    return BenchResult(s, prompts, runs, samples, rows, wall, notes)


# ================================================================= aggregation
def _per_token(x: Sample) -> float:
    return x.time_decode_s / x.n_generated if x.n_generated else float("inf")


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def _aggregate(idx: Sequence[int], smp: Sequence[Sample], plain: Sequence[Sample], prompts) -> dict:
    sel = [smp[i] for i in idx]
    n_gen = sum(x.n_generated for x in sel)
    t_dec = sum(x.time_decode_s for x in sel)
    tps = n_gen / t_dec if t_dec > 0 else 0.0

    def total(attr):
        vals = [getattr(x, attr) for x in sel]
        return None if any(v is None for v in vals) else sum(vals)

    drafted, accepted, relaxed, rounds = total("n_drafted"), total("n_accepted"), total("n_relaxed"), total("n_rounds")
    agree = None
    if all(smp[i].tokens is not None and plain[i].tokens is not None for i in idx):
        num = sum(common_prefix_len(smp[i].tokens, plain[i].tokens) for i in idx)
        den = sum(max(len(smp[i].tokens), len(plain[i].tokens)) for i in idx)
        agree = num / den if den else 1.0
    scored = [i for i in idx if prompts[i].scored]
    score = score_plain = None
    if scored and all(smp[i].score is not None for i in scored):
        score = sum(smp[i].score for i in scored) / len(scored)
        score_plain = sum(plain[i].score for i in scored) / len(scored)
    nll = nll_plain = None
    if all(smp[i].nll_sum is not None and plain[i].nll_sum is not None for i in idx):
        n_m = sum(len(smp[i].tokens) for i in idx)
        n_p = sum(len(plain[i].tokens) for i in idx)
        nll = sum(smp[i].nll_sum for i in idx) / n_m if n_m else None
        nll_plain = sum(plain[i].nll_sum for i in idx) / n_p if n_p else None
    return {
        "tokens_per_second": tps,
        "acceptance_rate": _ratio(accepted, drafted) if drafted else None,
        "mean_accepted_length": _ratio(n_gen, rounds),
        "relaxed_share": (relaxed / accepted if accepted else 0.0) if relaxed is not None and drafted else None,
        "token_agreement": agree,
        "task_score": score,
        "quality_recovery": _ratio(score, score_plain) if score_plain else None,
        "nll_ratio": _ratio(nll, nll_plain) if nll_plain else None,
        "n_prompts": len(sel),
        "n_generated": n_gen,
        "time_decode_s": t_dec,
        "time_target_s": total("time_target_s"),
        "time_draft_s": total("time_draft_s"),
        "time_verify_s": total("time_verify_s"),
        "prefill_tokens_per_second": _prefill_rate(sel),
    }


def _prefill_rate(sel: Sequence[Sample]) -> float | None:
    """The target's prompt processing speed over the samples that evaluated a whole
    prompt (8+ tokens; prefix reuse leaves some with little to evaluate)."""
    full = [x for x in sel if x.n_prefill is not None and x.n_prefill >= 8 and x.time_prefill_s]
    t = sum(x.time_prefill_s for x in full)
    return sum(x.n_prefill for x in full) / t if full and t > 0 else None


def summarize(prompts: Sequence[BenchPrompt], runs: Sequence[RunConfig], samples: dict) -> list[dict]:
    """One row per (configuration, category) plus one per configuration with category "all".

    ``samples[run][i]`` is the :class:`Sample` of ``run`` on ``prompts[i]``;
    ``runs[0]`` must be plain decoding (the reference for speedup, agreement,
    quality recovery and NLL ratio).
    """
    if not runs or runs[0].method != "plain":
        raise ValueError("the first run must be plain decoding")
    plain = samples[runs[0]]
    cats = list(dict.fromkeys(p.category for p in prompts))
    groups = [(c, [i for i, p in enumerate(prompts) if p.category == c]) for c in cats]
    groups.append(("all", list(range(len(prompts)))))
    base = {c: _aggregate(idx, plain, plain, prompts)["tokens_per_second"] for c, idx in groups}
    rows = []
    for r in runs:
        for c, idx in groups:
            agg = _aggregate(idx, samples[r], plain, prompts)
            row = {
                "category": c,
                "method": r.method,
                "drafter": r.drafter,
                "theta": r.theta,
                "k": r.k,
                "tokens_per_second": agg.pop("tokens_per_second"),
            }
            row["speedup_vs_plain"] = _ratio(row["tokens_per_second"], base[c])
            row.update(agg)
            rows.append(row)
    # Adaptive rows: tokens/s relative to the best fixed k in hindsight (plain = k 0 included).
    for row in rows:
        row["vs_best_fixed"] = None
        if row["k"] == "adaptive":
            fixed = [o["tokens_per_second"] for o in rows if o["category"] == row["category"] and (
                o["method"] == "plain" or (o["method"] == row["method"] and o["drafter"] == row["drafter"]
                                           and o["theta"] == row["theta"] and isinstance(o["k"], int)))]
            row["vs_best_fixed"] = _ratio(row["tokens_per_second"], max(fixed))
    # Every row relative to llama.cpp's best speculative row (over its draft lengths) of the category.
    for row in rows:
        spec = [o["tokens_per_second"] for o in rows if o["category"] == row["category"] and o["method"] == PEER_SPEC]
        row["vs_llama_spec"] = _ratio(row["tokens_per_second"], max(spec)) if spec else None
    return rows


# ==================================================================== output
def _fmt(v, spec: str, none: str = "–") -> str:
    return none if v is None else format(v, spec)


def row_label(row: dict) -> str:
    return RunConfig(row["method"], row["drafter"], row["theta"], row["k"]).label


def rows_by_configuration(rows: Sequence[dict]) -> dict[str, dict[str, dict]]:
    """{configuration label: {category: row}}, in the order of ``rows``."""
    by: dict[str, dict[str, dict]] = {}
    for r in rows:
        by.setdefault(row_label(r), {})[r["category"]] = r
    return by


def time_split(r: dict) -> str:
    """'target/draft/verify/other' shares of a row's decode time (other: the loop itself)."""
    d = r.get("time_decode_s") or 0.0
    if r.get("time_target_s") is None or d <= 0:
        return "–"
    parts = [r["time_target_s"], r["time_draft_s"], r["time_verify_s"]]
    parts.append(max(d - sum(parts), 0.0))
    return "/".join(f"{x / d:.0%}" for x in parts)


def render_tables(result_or_rows, title: str = ""):
    """Rich renderables: the overall table and a per-category speedup/quality table."""
    from rich.table import Table

    rows = result_or_rows.rows if isinstance(result_or_rows, BenchResult) else result_or_rows
    overall = [r for r in rows if r["category"] == "all"]
    t = Table(title=title or "mars bench (all prompts)", title_justify="left", header_style="bold")
    for col, just in [
        ("method", "left"), ("drafter", "left"), ("θ", "right"), ("k", "right"), ("tok/s", "right"),
        ("speedup", "right"), ("accept", "right"), ("τ", "right"), ("relaxed", "right"), ("agree", "right"),
        ("quality", "right"), ("NLL ratio", "right"), ("vs best k", "right"), ("vs llama.cpp spec", "right"),
        ("target/draft/verify/other", "right"), ("prefill tok/s", "right"),
    ]:
        t.add_column(col, justify=just, no_wrap=True)
    for r in overall:
        split = time_split(r)
        t.add_row(
            r["method"], r["drafter"], _fmt(r["theta"], "g"), str(r["k"]), f"{r['tokens_per_second']:.1f}",
            _fmt(r["speedup_vs_plain"], ".2f") + ("×" if r["speedup_vs_plain"] is not None else ""),
            _fmt(r["acceptance_rate"], ".0%"), _fmt(r["mean_accepted_length"], ".2f"), _fmt(r["relaxed_share"], ".0%"),
            _fmt(r["token_agreement"], ".0%"), _fmt(r["quality_recovery"], ".3f"), _fmt(r["nll_ratio"], ".3f"),
            _fmt(r.get("vs_best_fixed"), ".2f"), _fmt(r.get("vs_llama_spec"), ".2f"), split,
            _fmt(r.get("prefill_tokens_per_second"), ".1f"),
        )
    cats = [c for c in dict.fromkeys(r["category"] for r in rows) if c != "all"]
    per = Table(title="speedup × / quality recovery, per category", title_justify="left", header_style="bold")
    per.add_column("configuration", no_wrap=True)
    for c in cats:
        per.add_column(c, justify="right", no_wrap=True)
    for label, cells in rows_by_configuration(rows).items():
        vals = []
        for c in cats:
            r = cells.get(c)
            if r is None:
                vals.append("")
                continue
            sp = _fmt(r["speedup_vs_plain"], ".2f")
            q = r["quality_recovery"]
            vals.append(sp if q is None else f"{sp} / {q:.2f}")
        per.add_row(label, *vals)
    return [t, per]


def write_json(result: BenchResult, path: str | os.PathLike) -> None:
    p = Path(path)
    try:
        p.write_text(json.dumps(result.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as exc:
        raise MarsError(f"cannot write {p}: {exc.strerror or exc}") from None


_COLORS = {"ngram": ("#1f77b4", "#6baed6"), "model": ("#2ca02c", "#74c476")}


def write_plot(result: BenchResult, path: str | os.PathLike) -> None:
    """Speedup and quality vs θ, one line per drafter and k mode (PNG).

    Strict verification is MARS's limit θ → 1 (no position is ever undecided),
    so each line ends at θ = 1 with the strict run.  Plain is the line at 1;
    peers are dashed horizontal lines.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    rows = [r for r in result.rows if r["category"] == "all"]
    s = result.settings
    has_quality = any(r["quality_recovery"] is not None for r in rows if r["method"] == "mars")
    panels = [("speedup_vs_plain", "Speedup vs plain decoding", "speedup (×, higher is faster)")]
    panels.append(("quality_recovery", "Quality recovery (task metric ÷ plain)", "quality recovery (1 = plain's)")
                  if has_quality else ("token_agreement", "Agreement with plain output", "token agreement"))
    panels.append(("nll_ratio", "Target NLL per token ÷ plain", "NLL ratio (1 = as likely as plain)"))
    fig = Figure(figsize=(15, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels))
    thetas = sorted({r["theta"] for r in rows if r["theta"] is not None})
    xs_all = thetas + [1.0]
    legend: dict[str, Line2D] = {}
    annotate = len(s.drafters) == 1  # with more lines the labels would collide
    fixed_k = s.draft_max if s.draft_max in s.ks() else max(s.ks())  # the fixed line drawn
    peer_styles = [":", "-.", (0, (5, 2)), (0, (1, 1))]
    for ax, (key, title, ylabel) in zip(axes, panels):
        ax.axhline(1.0, color="#555555", lw=1.2, zorder=1)
        if key == "speedup_vs_plain":  # slower than plain: a faint red band
            ax.axhspan(0, 1.0, color="#d62728", alpha=0.05, zorder=0)
        for d in s.drafters:
            for mode in ("fixed", "adaptive"):
                want_k = "adaptive" if mode == "adaptive" else fixed_k
                pts = sorted(
                    (r["theta"], r[key]) for r in rows
                    if r["method"] == "mars" and r["drafter"] == d and r["k"] == want_k and r[key] is not None
                )
                strict = [r[key] for r in rows
                          if r["method"] == "strict" and r["drafter"] == d and r["k"] == want_k and r[key] is not None]
                if not pts and not strict:
                    continue
                xs = [p[0] for p in pts] + ([1.0] if strict else [])
                ys = [p[1] for p in pts] + strict[:1]
                color = _COLORS.get(d, ("#9467bd", "#c5b0d5"))[0 if mode == "fixed" else 1]
                marker = "o" if mode == "fixed" else "s"
                label = f"{d} drafter, " + (f"k = {fixed_k} fixed" if mode == "fixed" else f"adaptive k (≤ {s.draft_max})")
                (ln,) = ax.plot(xs, ys, marker=marker, color=color, lw=3.4 if mode == "fixed" else 2.0,
                                ms=8 if mode == "fixed" else 6, zorder=3 if mode == "fixed" else 4,
                                ls="-" if mode == "fixed" else "--")
                legend.setdefault(label, ln)
                if key == "speedup_vs_plain" and annotate:
                    for x, y in zip(xs, ys):
                        ax.annotate(f"{y:.2f}×", (x, y), textcoords="offset points",
                                    xytext=(0, 9) if mode == "fixed" else (0, -15),
                                    ha="center", fontsize=8.5, color=color, fontweight="bold")
        peers_here = [r for r in rows if r["method"] not in ("plain", "strict", "mars") and r[key] is not None]
        for j, r in enumerate(peers_here):
            label = r["method"] + (f" ({r['drafter']})" if r["method"] == PEER_SPEC else "")
            ln = ax.axhline(r[key], color="#d62728" if j == 0 else "#ff7f0e", ls=peer_styles[j % 4], lw=1.6, zorder=2)
            legend.setdefault(label, ln)
        ax.set_title(title, fontsize=11, fontweight="bold")
        ax.set_xlabel("MARS θ (1.0 = strict)")
        ax.set_ylabel(ylabel)
        ax.set_xticks(xs_all)
        ax.set_xticklabels([f"{x:g}" for x in thetas] + ["strict"])
        if xs_all:
            pad = max((xs_all[-1] - xs_all[0]) * 0.08, 0.01)
            ax.set_xlim(xs_all[0] - pad, xs_all[-1] + pad)
        ax.grid(True, alpha=0.3)
        vals = [ln.get_ydata() for ln in ax.get_lines()]
        ys_all = [float(v) for arr in vals for v in np.atleast_1d(arr)]
        lo, hi = (min(ys_all), max(ys_all)) if ys_all else (0.9, 1.1)
        span = max(hi - lo, 0.1)
        ax.set_ylim(lo - 0.12 * span, hi + 0.15 * span)
    legend["plain decoding (= 1)"] = Line2D([], [], color="#555555", lw=1.2)
    fig.legend(list(legend.values()), list(legend.keys()), loc="lower center", ncol=min(len(legend), 4),
               frameon=False, fontsize=9)
    model = s.label or Path(s.target).name
    sampling = "greedy" if s.temperature == 0 else f"T = {s.temperature:g}, seed {s.seed}"
    fig.suptitle(f"mars bench — {model}: {len(result.prompts)} prompts, {s.max_tokens} tokens each, {sampling}",
                 fontsize=12)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    try:
        fig.savefig(str(path), format="png")
    except OSError as exc:
        raise MarsError(f"cannot write {path}: {exc.strerror or exc}") from None
