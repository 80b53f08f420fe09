"""The speculative decoding loop: draft, verify in one batched target decode, roll back.

Invariant at the top of every round: the target's KV cache holds every
committed token except the last one (``last``), which is the first row of the
next verify window ``[last, d_0 .. d_{k-1}]``.  The window asks for k+1 output
rows; the verification rule accepts a prefix of m drafts and adds one target
token; the target cache is cut back to ``base + 1 + m`` and the drafter rolls
its own cache back to the longest prefix it shares with the committed tokens.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from . import native
from .adaptive import AdaptiveK
from .drafters import EMPTY_DRAFT, Draft, Drafter, ModelDrafter, NgramDrafter
from .errors import MarsError
from .learned import LearnedStore, default_store, file_fingerprint
from .runtime import Context, Model, build_fingerprint, check_vocab_compatible
from .sampling import SamplingParams, position_uniforms
from .stats import SpecStats
from .verify import VerifyConfig, verify

__all__ = ["Engine", "GenerateConfig", "Generation", "Chunk"]

DRAFTERS = ("model", "ngram", "none")
MAX_DRAFT = 63  # patches/0003: batches of up to 64 rows use the kernels of a 1-row decode


@dataclass(frozen=True)
class GenerateConfig:
    """Everything that shapes one generation (validated on construction)."""

    max_tokens: int = 256
    verify: str = "mars"
    theta: float = 0.9
    draft_max: int = 8
    draft_min: int = 0
    draft_p_min: float = 0.0
    draft_sampling: str = "greedy"
    adaptive: bool = True
    max_relaxed: int | None = None
    require_positive_top1: bool = True
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise MarsError(f"the number of tokens to generate must be >= 1, got {self.max_tokens}")
        if not 0 <= self.draft_max <= MAX_DRAFT:
            raise MarsError(
                f"draft-max must be in 0..{MAX_DRAFT} (verify windows of up to {MAX_DRAFT + 1} rows are "
                f"computed exactly like single tokens), got {self.draft_max}"
            )
        if self.draft_min < 0 or self.draft_min > max(self.draft_max, 0):
            raise MarsError(f"draft-min must be in [0, draft-max={self.draft_max}], got {self.draft_min}")
        if not (0.0 <= self.draft_p_min <= 1.0):
            raise MarsError(f"draft-p-min must be in [0, 1], got {self.draft_p_min}")
        if self.draft_sampling not in ("greedy", "sample"):
            raise MarsError(f"draft sampling must be greedy or sample, got {self.draft_sampling!r}")
        VerifyConfig(self.verify, self.theta, self.require_positive_top1, self.max_relaxed)  # validates

    @classmethod
    def make(cls, **kw) -> "GenerateConfig":
        """Build from flat keyword arguments (sampling fields included)."""
        s_fields = {f for f in SamplingParams.__dataclass_fields__}
        s_kw = {k: kw.pop(k) for k in list(kw) if k in s_fields}
        unknown = set(kw) - set(cls.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
        base = kw.pop("sampling", None) or SamplingParams()
        return cls(sampling=replace(base, **s_kw), **kw)


@dataclass
class Chunk:
    """Tokens committed by one round, with how each was produced.

    kinds: "draft" (accepted draft token), "relaxed" (accepted only because of
    MARS) or "target" (the target's correction or bonus token).
    """

    tokens: list[int]
    text: str
    kinds: list[str]


@dataclass
class Generation:
    text: str
    tokens: list[int]
    kinds: list[str]
    stats: SpecStats

    def to_dict(self) -> dict:
        return {"text": self.text, "tokens": list(self.tokens), "stats": self.stats.to_dict()}


class Engine:
    """A loaded target (and optional draft) model, ready to generate many times.

    >>> eng = Engine("target.gguf", draft="draft.gguf")          # doctest: +SKIP
    >>> out = eng.generate("Hello", max_tokens=32, verify="mars")  # doctest: +SKIP
    >>> out.text, out.stats.mean_accepted_length                  # doctest: +SKIP
    """

    def __init__(
        self,
        target: str | Path,
        draft: str | Path | None = None,
        *,
        drafter: str | None = None,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_gpu_layers: int | None = None,
        n_gpu_layers_draft: int | None = None,
        n_threads: int | None = None,
        ngram_max: int = 3,
        ngram_min: int = 1,
        flash_attn: bool | None = None,
        kv_type: str = "f16",
        exact_kernels: bool = True,
        learned: bool | LearnedStore = True,
    ):
        if drafter is None:
            drafter = "model" if draft else "none"
        if drafter not in DRAFTERS:
            raise MarsError(f"drafter must be one of {', '.join(DRAFTERS)}, got {drafter!r}")
        if drafter == "model" and not draft:
            raise MarsError("the model drafter needs a draft model (-md DRAFT.gguf)")
        if drafter != "model" and draft:
            raise MarsError(f"a draft model was given but the drafter is {drafter!r}")
        self.drafter_kind = drafter
        self.target = Model(target, n_gpu_layers, exact_kernels=exact_kernels)
        ctx_opts = dict(n_batch=n_batch, n_threads=n_threads, flash_attn=flash_attn, kv_type=kv_type)
        self.ctx = Context(self.target, n_ctx=n_ctx, **ctx_opts)
        if drafter != "none" and self.target.recurrent:
            raise MarsError(
                "the target is a recurrent/hybrid model whose cache cannot be rolled back; "
                "speculative decoding is not supported for it (use --no-draft)"
            )
        self.draft_model: Model | None = None
        self.draft_ctx: Context | None = None
        if drafter == "model":
            self.draft_model = Model(draft, n_gpu_layers_draft)
            if self.draft_model.recurrent:
                raise MarsError("the draft is a recurrent/hybrid model whose cache cannot be rolled back")
            check_vocab_compatible(self.target, self.draft_model)
            self.draft_ctx = Context(self.draft_model, n_ctx=self.ctx.n_ctx, **ctx_opts)
        self._chat_formatter = None
        self._busy: object | None = None  # the running stream's token (one generation at a time)
        self.last_stats: SpecStats | None = None
        self._adaptive: dict[tuple, AdaptiveK] = {}  # one per acceptance regime
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        NgramDrafter(ngram_max, ngram_min)  # validates the sizes
        # What the adaptive controller learns is kept between processes
        # (mars_local.learned), keyed by what it depends on.
        self._store = (learned if isinstance(learned, LearnedStore) else default_store()) if learned else None
        build = build_fingerprint()
        device = f"t{self.ctx.n_threads}|{kv_type}|fa{flash_attn}"
        self._learned_keys = {
            "costs": f"costs|{file_fingerprint(target)}|{build}|{device}|ngl{n_gpu_layers}",
            # the draft's speed depends on the target too (they share caches and memory bandwidth)
            "draft": f"draft|{file_fingerprint(draft)}|{file_fingerprint(target)}|{build}|{device}"
                     f"|ngl{n_gpu_layers_draft}" if draft else None,
            "drafter": file_fingerprint(draft) if draft else f"{drafter}{ngram_max}-{ngram_min}",
            "target": file_fingerprint(target),
        }

    # ------------------------------------------------------------ helpers
    @property
    def n_ctx(self) -> int:
        """The context size in use (llama.cpp rounds a requested size up to a multiple of 256)."""
        return self.ctx.n_ctx

    @property
    def n_ctx_requested(self) -> int:
        """The context size asked for (n_ctx=0 asks for the training context)."""
        return self.ctx.n_ctx_requested

    @property
    def n_ctx_train(self) -> int:
        """The target's training context; a larger n_ctx works but may degrade output."""
        return self.target.n_ctx_train

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.target.tokenize(text, add_special=add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.target.detokenize(tokens)

    def chat_prompt(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of ``messages`` rendered with the target's own chat template.

        The GGUF ``tokenizer.chat_template`` is rendered in a bounded Jinja2
        sandbox with llama-cpp-python's semantics (the generation prompt for
        the assistant's turn appended); control tokens are parsed in the
        template's markup only, never in message text (see
        :mod:`mars_local.chat_template`).  Every failure is one MarsError.
        """
        from .chat_template import tokenize_chat

        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise MarsError("each chat message needs a string 'role' and a string 'content'")
        return tokenize_chat(self._chat_template(), self.target, list(messages))

    def _chat_template(self):
        from .chat_template import ChatTemplate

        source = self.target.chat_template()
        name = Path(self.target.path).name
        if not source:
            raise MarsError(f"{name} has no chat template; prompt it without chat formatting")
        if self._chat_formatter is None or self._chat_formatter.source != source:
            t = self.target
            self._chat_formatter = ChatTemplate(
                source, name,
                eos_token=t.piece(t.eos, special=True).decode("utf-8", "replace") if t.eos >= 0 else "",
                bos_token=t.piece(t.bos, special=True).decode("utf-8", "replace") if t.bos >= 0 else "",
            )
        return self._chat_formatter

    def _make_drafter(self, cfg: GenerateConfig, seed: int) -> Drafter:
        if self.drafter_kind == "model":
            return ModelDrafter(
                self.draft_ctx, cfg.draft_sampling, cfg.sampling, seed, cfg.draft_p_min, cfg.draft_min
            )
        if self.drafter_kind == "ngram":
            return NgramDrafter(self.ngram_max, self.ngram_min)
        return Drafter()

    def _prompt_tokens(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            toks = self.tokenize(prompt)
        else:
            toks = [int(t) for t in prompt]
            bad = [t for t in toks if not 0 <= t < self.target.n_vocab]
            if bad:
                raise MarsError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.target.n_vocab - 1})")
        if not toks:
            raise MarsError("the prompt is empty")
        if len(toks) >= self.n_ctx:
            asked = f" (asked for {self.n_ctx_requested})" if self.n_ctx_requested != self.n_ctx else ""
            raise MarsError(
                f"the prompt is {len(toks)} tokens but the context holds {self.n_ctx}{asked}; "
                "use a larger -c or a shorter prompt"
            )
        return toks

    # ---------------------------------------------------------- generation
    def stream(
        self, prompt: str | Sequence[int], config: GenerateConfig | None = None, **options
    ) -> Iterator[Chunk]:
        """Generate, yielding one :class:`Chunk` per verify round.

        The statistics are in ``self.last_stats`` from the first chunk on and
        final once the iterator ends: exhausted, closed, collected, or stopped
        by an exception (``generate`` returns them directly).  stop_reason is
        "eog", "length", "context" (the context is full), "interrupted" (the
        stream was closed early or hit KeyboardInterrupt) or "error".

        One Engine runs one generation at a time (both caches are its state):
        a stream started while another one is unfinished is refused with a
        MarsError; exhaust or ``close()`` the first one (leaving a ``for`` loop
        early releases it too, once the generator is collected).

        A draft is never longer than ``n_batch - 1`` tokens, so a verify window
        fits one batch: ``draft_max`` larger than that is capped.
        """
        self._check_idle()
        cfg = config if config is not None else GenerateConfig.make(**options)
        if config is not None and options:
            cfg = replace(cfg, **options)
        tokens = self._prompt_tokens(prompt)
        vcfg = VerifyConfig(cfg.verify, cfg.theta, cfg.require_positive_top1, cfg.max_relaxed, self.target.eog_ids)
        seed = cfg.sampling.base_seed()
        drafter = self._make_drafter(cfg, seed)
        ctrl = self._controller(cfg)
        stats = SpecStats(n_prompt=len(tokens), adaptive=ctrl is not None)
        return self._run(tokens, cfg, vcfg, seed, drafter, stats, ctrl)

    def _check_idle(self) -> None:
        if self._busy is not None:
            raise MarsError(
                "another generation is still running on this Engine; exhaust or close() its stream first"
            )

    @property
    def _k_limit(self) -> int:
        """The longest draft whose verify window (k + 1 rows) fits one batch."""
        return min(MAX_DRAFT, self.ctx.n_batch - 1)

    def _controller(self, cfg: GenerateConfig) -> AdaptiveK | None:
        """The draft-length controller; its cost model outlives a generation.

        Draft lengths follow measured timings, so they differ from run to run.
        Strict output never depends on them (greedy is exact, sampling is
        sample-and-compare on position-keyed draws), but MARS output and
        sampled drafts do: a run with an explicit seed asks to be reproducible,
        so there k stays fixed at draft_max.
        """
        k_max = min(cfg.draft_max, self._k_limit)
        if not cfg.adaptive or self.drafter_kind == "none" or k_max == 0:
            return None
        depends_on_k = cfg.verify == "mars" or (cfg.draft_sampling == "sample" and not cfg.sampling.greedy)
        if cfg.sampling.seeded and depends_on_k:
            return None
        # Acceptance depends on the rule (and θ, and sampling); window costs
        # only on the target, so controllers of different rules share them.
        regime = (cfg.verify, cfg.theta if cfg.verify == "mars" else None, cfg.sampling.greedy)
        ctrl = self._adaptive.get(regime)
        if ctrl is None:
            first = next(iter(self._adaptive.values()), None)
            ctrl = AdaptiveK(k_max=k_max, gpu=self.target.offloaded)
            if first is not None:
                ctrl.share_costs(first)
            elif self._store is not None:
                for part in ("costs", "draft"):
                    key = self._learned_keys[part]
                    if key and (state := self._store.get(key)):
                        ctrl.import_state(state)
            if self._store is not None:
                ctrl.import_state(self._store.get(self._accept_key(regime)) or {})
            self._adaptive[regime] = ctrl
        ctrl.k_max = k_max
        return ctrl

    def _accept_key(self, regime: tuple) -> str:
        k = self._learned_keys
        return f"accept|{k['target']}|{k['drafter']}|{'/'.join(str(x) for x in regime)}"

    def _save_learned(self) -> None:
        if self._store is None or not self._adaptive:
            return
        for regime, ctrl in self._adaptive.items():
            st = ctrl.export_state()
            self._store.put(self._accept_key(regime), {"counts": st["counts"]})
        # window and draft timings are shared by every regime's controller (share_costs)
        self._store.put(self._learned_keys["costs"], {"time": st["time"]})
        if self._learned_keys["draft"]:
            self._store.put(self._learned_keys["draft"], {"draft": st["draft"]})
        self._store.save()

    def _calibrate(self, ctrl: AdaptiveK, last: int) -> float:
        """Time verify windows of a few sizes once (on top of the prompt, then
        rolled back) when the controller has no measured window costs: a
        controller that starts from priors spends a short answer finding them.
        Returns the seconds spent."""
        if not ctrl.needs_calibration():
            return 0.0
        tgt = self.ctx
        clock = time.perf_counter
        t_start = clock()
        base = tgt.n_past
        sizes = [w for w in (1, 2, 3, 5, 9, 17) if w <= ctrl.k_max + 1] + [ctrl.k_max + 1]
        for w in sorted(set(sizes)):
            if base + w >= tgt.n_ctx:
                break
            for _ in range(2):  # the first forward of a new size builds its graph and is not timed
                t0 = clock()
                tgt.eval([last] * w, n_out=w)
                ctrl.observe_forward(w, clock() - t0)
                tgt.truncate(base)
        return clock() - t_start

    def _run(self, tokens, cfg, vcfg, seed, drafter, stats, ctrl) -> Iterator[Chunk]:
        self._check_idle()  # another stream may have started since this one was created
        busy = self._busy = object()
        self.last_stats = stats
        clock = time.perf_counter
        t_start = clock()
        try:
            yield from self._loop(tokens, cfg, vcfg, seed, drafter, stats, ctrl, clock, t_start)
        except (GeneratorExit, KeyboardInterrupt):
            if not stats.stop_reason:
                stats.stop_reason = "interrupted"
            raise
        except BaseException:
            if not stats.stop_reason:
                stats.stop_reason = "error"
            raise
        finally:
            stats.time_total_s = clock() - t_start
            if self._busy is busy:
                self._busy = None
            if ctrl is not None:
                self._save_learned()

    def _loop(self, tokens, cfg, vcfg, seed, drafter, stats, ctrl, clock, t_start) -> Iterator[Chunk]:
        tgt = self.ctx
        stats.n_prompt_evaluated = tgt.sync(tokens[:-1])
        stats.time_prompt_target_s = clock() - t_start
        drafter.begin(tokens)
        stats.time_prompt_s = clock() - t_start
        if ctrl is not None:
            stats.time_calibrate_s = self._calibrate(ctrl, tokens[-1])

        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        piece = self.target.piece
        is_eog = self.target.is_eog
        params = cfg.sampling
        cheap = isinstance(drafter, NgramDrafter)
        use_native = native.available()  # the patched libllama's kernel; same results as numpy
        verify_window = native.verify if use_native else verify
        stats.verify_backend = "native" if use_native else "numpy"
        generated = 0
        while True:
            remaining = cfg.max_tokens - generated
            if remaining <= 0:
                stats.stop_reason = "length"
                break
            room = tgt.n_ctx - tgt.n_past - 1  # rows that fit after `last`
            if room < 0:
                stats.stop_reason = "context"
                break
            k_cap = min(cfg.draft_max, self._k_limit, remaining - 1, room)

            t0 = clock()
            shadow, drafted = None, None
            if ctrl is None:
                draft = drafter.propose(tokens, k_cap) if k_cap > 0 else EMPTY_DRAFT
            elif cheap:
                # An n-gram lookup is free: propose first, then let the
                # controller cut the draft knowing its match lengths.
                full = drafter.propose(tokens, k_cap) if k_cap > 0 else EMPTY_DRAFT
                k = ctrl.choose(k_cap, full.keys or [])
                draft = Draft(full.tokens[:k], keys=full.keys[:k]) if k else EMPTY_DRAFT
                if not k and full.tokens:
                    shadow = full  # its first token is compared with the target's, for free
            elif ctrl.choose(k_cap) > 0:
                # A draft model drafts token by token until the controller,
                # seeing each token's confidence, says more would not pay;
                # trailing drafts not worth their verify rows are cut.
                full = drafter.propose(tokens, k_cap, extend=lambda keys: ctrl.extend(keys, k_cap))
                drafted = len(full)
                m = min(ctrl.trim(full.keys), drafted) if full.keys else drafted
                draft = full if m == drafted else Draft(
                    full.tokens[:m], full.probs[:m] if full.probs is not None else None, full.keys[:m]
                )
            else:
                draft = EMPTY_DRAFT
            if len(draft) < cfg.draft_min:
                draft = EMPTY_DRAFT
            t1 = clock()
            base = tgt.n_past
            logits = tgt.eval([tokens[-1]] + draft.tokens, n_out=len(draft) + 1)
            t2 = clock()
            u = None if params.greedy else position_uniforms(seed, len(tokens), len(draft) + 1)
            d = np.asarray(draft.tokens, dtype=np.int64)
            res = verify_window(logits, d, vcfg, params, None, draft.probs, u)
            t3 = clock()
            tgt.truncate(base + 1 + res.n_accepted)
            new = res.tokens
            tokens.extend(new)
            drafter.observe(tokens, res.n_accepted)
            t4 = clock()
            stats.time_draft_s += (t1 - t0) + (t4 - t3)
            stats.time_target_s += t2 - t1
            stats.time_verify_s += t3 - t2
            if ctrl is not None:
                ctrl.observe(len(draft), res.n_accepted, t2 - t1, (t1 - t0) + (t4 - t3), draft.keys,
                             drafted=0 if cheap else (drafted or 0))
                if shadow is not None:
                    ctrl.observe_shadow(shadow.tokens[0] == new[0], shadow.keys[0])

            kinds = ["relaxed" if r else "draft" for r in res.relaxed] + ["target"]
            stop = None
            for i, t in enumerate(new):
                if is_eog(t):
                    new, kinds, stop = new[:i], kinds[:i], "eog"
                    break
            stats.record_round(len(draft), res.n_accepted, res.n_relaxed, len(new))
            generated += len(new)
            text = decoder.decode(b"".join(piece(t) for t in new))
            # the reason is known before the yield: a consumer may stop at the last chunk
            if stop:
                stats.stop_reason = stop
            elif generated >= cfg.max_tokens:
                stats.stop_reason = "length"
            elif tgt.n_ctx - tgt.n_past - 1 < 0:
                stats.stop_reason = "context"
            if new or text:
                yield Chunk(list(new), text, kinds)
            if stop:
                break
        tail = decoder.decode(b"", final=True)
        if tail:
            yield Chunk([], tail, [])

    def generate(
        self,
        prompt: str | Sequence[int],
        config: GenerateConfig | None = None,
        on_chunk: Callable[[Chunk], None] | None = None,
        **options,
    ) -> Generation:
        """Generate a completion; ``options`` are :class:`GenerateConfig` fields
        plus the sampling fields (temperature, top_k, top_p, min_p, seed)."""
        text, toks, kinds = [], [], []
        it = self.stream(prompt, config, **options)
        try:
            for chunk in it:
                text.append(chunk.text)
                toks.extend(chunk.tokens)
                kinds.extend(chunk.kinds)
                if on_chunk is not None:
                    on_chunk(chunk)
        finally:
            it.close()  # an exception in on_chunk (Ctrl-C) finalizes the stats and frees the engine now
        return Generation("".join(text), toks, kinds, self.last_stats)

    def reset(self) -> None:
        """Forget the cached prompt prefix: the next generation evaluates its whole prompt."""
        self._check_idle()
        for ctx in (self.ctx, self.draft_ctx):
            if ctx is not None:
                ctx.truncate(0)

    def close(self) -> None:
        for obj in (self.draft_ctx, self.ctx, self.draft_model, self.target):
            if obj is not None:
                obj.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
