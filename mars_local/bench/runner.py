"""The bench run: every configuration of :func:`plan_runs` on every prompt, interleaved."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from ..core.choices import FILE_DRAFTERS
from ..core.errors import MarsError
from .config import PEER_COMPLETION, PEER_LCP, PEER_SPEC, BenchResult, BenchSettings, RunConfig, Sample, plan_runs
from .metrics import task_score, unavailable_metrics, unscored_note
from .peers import LlamaCppBinaryPeer, LlamaCppPythonPeer, find_llama_cpp_binaries
from .prompts import BenchPrompt
from .report import summarize
from .scoring import TargetScorer


def _engine_sample(out) -> Sample:
    s = out.stats
    return Sample(
        text=out.text, tokens=list(out.tokens), n_generated=s.n_generated,
        time_decode_s=s.time_decode_s, n_prefill=s.n_prompt_evaluated, time_prefill_s=s.time_prompt_target_s,
        time_target_s=s.time_target_s, time_draft_s=s.time_draft_s, time_verify_s=s.time_verify_s,
        n_rounds=s.n_rounds, n_drafted=s.n_drafted, n_accepted=s.n_accepted, n_relaxed=s.n_relaxed,
    )


def _per_token(x: Sample) -> float:
    return x.time_decode_s / x.n_generated if x.n_generated else float("inf")


def prompt_tokens(eng, p: BenchPrompt) -> list[int]:
    """The token ids of a bench prompt (its chat messages rendered with the target's template)."""
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
    s = settings
    s.validate()
    prompts = list(prompts)
    if not prompts:
        raise MarsError("no prompts to run")
    unscored = unavailable_metrics(p.metric for p in prompts if p.scored)
    notes = list(s.notes)
    if unscored and unscored_note(unscored) not in notes:
        notes.append(unscored_note(unscored))
    if s.temperature > 0 and len(s.adaptive_modes) > 1:
        notes.append("sampling run: adaptive k is left out for MARS (the engine fixes k for seeded MARS runs)")
    bins = find_llama_cpp_binaries(s.llama_cpp_bin) if s.llama_cpp_bin is not None else None
    runs = plan_runs(s)
    t_start = time.perf_counter()
    bench = _Bench(s, prompts, runs, bins, unscored)
    try:
        bench.open()
        if s.warmup:
            bench.warm_up()
        samples = bench.measure(progress)
    finally:
        bench.close()
    wall = time.perf_counter() - t_start
    notes += _strict_differs(s, runs, samples)
    rows = summarize(prompts, runs, samples, rounds=bench.rounds if s.repeats > 1 else None)
    if s.repeats > 1 and any("vs_llama_spec_rounds" in r for r in rows):
        notes.append(f"vs llama.cpp spec: the median of {s.repeats} interleaved rounds (range); ~ marks a ratio "
                     "whose rounds fall on both sides of 1.0: not separable from llama.cpp at this noise")
    return BenchResult(s, prompts, runs, samples, rows, wall, notes)


def _strict_differs(s: BenchSettings, runs: list[RunConfig], samples) -> list[str]:
    """Notes for the strict runs whose greedy output is not plain decoding's token for token."""
    notes = []
    if s.temperature == 0:  # greedy strict must reproduce plain decoding token for token
        for r in runs:
            if r.method == "strict":
                n_diff = sum(a.tokens != b.tokens for a, b in zip(samples[r], samples[runs[0]]))
                if n_diff:
                    notes.append(f"{r.label}: output differs from plain decoding on {n_diff} prompt(s) "
                                 "(numerical near-ties in the target's kernels)")
    return notes


class _Bench:
    """One bench run's engines (one per drafter; the first also runs plain), peers and
    prompt tokens, in the steps of :func:`run_bench`; :meth:`close` frees them all."""

    def __init__(self, s: BenchSettings, prompts: list[BenchPrompt], runs: list[RunConfig], bins, unscored):
        self.s, self.prompts, self.runs, self.bins, self.unscored = s, prompts, runs, bins, unscored
        self.engines: dict = {}
        self.peers: dict[RunConfig, object] = {}
        self.scorer = None
        self.grammars: dict = {None: None}

    def open(self) -> None:
        """The engines, the prompts' tokens (each must fit the context), the peers, the grammars."""
        from ..speculate.engine import Engine

        s = self.s
        for d in s.drafters:
            self.engines[d] = Engine(
                s.target, s.draft if d in FILE_DRAFTERS else None, drafter=d, n_ctx=s.n_ctx,
                n_gpu_layers=s.n_gpu_layers, n_gpu_layers_draft=s.n_gpu_layers_draft, n_threads=s.n_threads,
                ngram_max=s.ngram_max, rpc=s.rpc or None, rpc_draft=s.rpc_draft, tensor_split=s.tensor_split,
            )
        first = self.first = self.engines[s.drafters[0]]
        self.tokens = [prompt_tokens(first, p) for p in self.prompts]
        for p, t in zip(self.prompts, self.tokens):
            if len(t) >= first.n_ctx:
                raise MarsError(f"prompt {p.id} is {len(t)} tokens but the context holds {first.n_ctx}; use a larger -c")
        self._open_peers()
        self.texts = [_prompt_text(first.target, t) for t in self.tokens] if self.bins else None
        self.sampling = s.sampling()
        if any(r.grammar == "json" for r in self.runs):
            from ..speculate.grammar import json_grammar

            self.grammars["json"] = json_grammar()

    def _open_peers(self) -> None:
        s, bins = self.s, self.bins
        for r in self.runs:
            if r.method == PEER_LCP:
                self.peers[r] = LlamaCppPythonPeer(s.target, n_ctx=self.first.n_ctx, num_pred_tokens=s.draft_max,
                                                   max_ngram_size=s.ngram_max, n_gpu_layers=s.n_gpu_layers,
                                                   n_threads=s.n_threads)
            elif r.method == PEER_SPEC:
                self.peers[r] = LlamaCppBinaryPeer(bins["llama-speculative-simple"], PEER_SPEC, s, r.drafter, r.k)
            elif r.method == PEER_COMPLETION:
                self.peers[r] = LlamaCppBinaryPeer(bins["llama-completion"], PEER_COMPLETION, s)

    def config(self, r: RunConfig, max_tokens: int):
        from ..core.config import GenerateConfig

        s, grammar = self.s, self.grammars[r.grammar]
        if r.method == "plain":
            return GenerateConfig(max_tokens=max_tokens, verify="strict", draft_max=0, adaptive=False,
                                  sampling=self.sampling, grammar=grammar)
        return GenerateConfig(
            max_tokens=max_tokens, verify=r.method, theta=r.theta if r.theta is not None else GenerateConfig.theta,
            draft_max=s.draft_max if r.k == "adaptive" else r.k, adaptive=r.k == "adaptive", sampling=self.sampling,
            grammar=grammar,
        )

    def engine_for(self, r: RunConfig):
        return self.first if r.method == "plain" else self.engines[r.drafter]

    def one(self, r: RunConfig, i: int) -> Sample:
        """One generation of configuration ``r`` on prompt ``i``."""
        s = self.s
        try:
            if r.method == PEER_LCP:
                return self.peers[r].generate(self.tokens[i], s)
            if r.is_peer:
                return self.peers[r].generate(self.texts[i], s)
            return _engine_sample(self.engine_for(r).generate(self.tokens[i], self.config(r, s.max_tokens)))
        except MarsError as exc:
            raise MarsError(f"{r.label}, prompt {self.prompts[i].id}: {exc}") from None

    def warm_up(self) -> None:
        """Load weights into caches, start the adaptive cost model."""
        s = self.s
        for r in self.runs:
            if r.method == "plain" or r.k == "adaptive" or r.method == PEER_LCP:
                if r.method == PEER_LCP:
                    self.peers[r].generate(self.tokens[0], replace(s, max_tokens=min(8, s.max_tokens)))
                elif not r.is_peer:
                    self.engine_for(r).generate(self.tokens[0], self.config(r, min(8, s.max_tokens)))

    def measure(self, progress) -> dict[RunConfig, list[Sample]]:
        """Every configuration on every prompt, prompt by prompt, each prompt's samples scored
        once its generations are done."""
        # Quality is scored by the plain engine once a prompt's generations
        # are done (outside every timed region): the prompt is still in its
        # KV cache.
        self.scorer = TargetScorer(self.first)
        samples: dict[RunConfig, list[Sample | None]] = {r: [None] * len(self.prompts) for r in self.runs}
        # every repeat's sample too: the spread of a configuration's rate over the rounds
        self.rounds = {r: [[None] * len(self.prompts) for _ in range(self.s.repeats)] for r in self.runs}
        self.total, self.done = len(self.runs) * len(self.prompts) * self.s.repeats, 0
        for i, p in enumerate(self.prompts):
            self._generate(i, samples, progress)
            self._score(i, p, samples)
        return samples

    def _generate(self, i: int, samples, progress) -> None:
        runs = self.runs
        # Every engine evaluates this prompt from scratch, in one batch, and
        # its other configurations reuse that: the prompt's KV cache is then
        # computed identically for every configuration (llama.cpp's kernels
        # for large batches are not batch-invariant; only verify windows
        # need to be), so strict greedy output can be compared with plain
        # output token for token, and each full prefill is timed.
        for eng in self.engines.values():
            eng.reset()
        for rep in range(self.s.repeats):  # each repeat in another order; the fastest generation counts
            shift = (i + rep * (len(runs) // self.s.repeats or 1)) % len(runs)
            for r in runs[shift:] + runs[:shift]:
                smp = self.one(r, i)
                self.rounds[r][rep][i] = smp
                old = samples[r][i]
                if old is None or _per_token(smp) < _per_token(old):
                    samples[r][i] = smp
                self.done += 1
                if progress is not None:
                    progress(self.done, self.total, r.label)

    def _score(self, i: int, p: BenchPrompt, samples) -> None:
        """Task scores and the target's NLL of prompt ``i``'s samples (one NLL per distinct output)."""
        nll_cache: dict[tuple, float] = {}
        for r in self.runs:
            smp = samples[r][i]
            if smp.text is not None:
                smp.score = None if p.metric in self.unscored else task_score(p.metric, smp.text, p.reference)
            if smp.tokens is not None:
                key = tuple(smp.tokens)
                if key not in nll_cache:
                    nll_cache[key] = float(self.scorer.nll(self.tokens[i], smp.tokens).sum())
                smp.nll_sum = nll_cache[key]

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
        for peer in self.peers.values():
            peer.close()
        for eng in self.engines.values():
            eng.close()
