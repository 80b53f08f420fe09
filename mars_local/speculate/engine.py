"""The speculative decoding loop: draft, verify in one batched target decode, roll back.

One round (``Engine._loop``), with ``tokens`` every committed token and
``last = tokens[-1]``:

1. choose a draft ``d_0 .. d_{k-1}`` (the drafter proposes, the adaptive
   controller picks k);
2. target forward of the window ``[last, d_0 .. d_{k-1}]``: k+1 output rows;
3. verify: the rule accepts a prefix of m drafts and adds one target token;
4. commit: the target cache is cut back to the accepted prefix, the drafter
   rolls its own cache back;
5. emit the new tokens as a :class:`Chunk` (cut at an end-of-generation token).

The KV caches at each point are stated where the loop reaches it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from . import native
from .adaptive import AdaptiveK
from ..core.choices import HEAD_DRAFTERS, DrafterKind
from .controllers import Controllers, calibrate, learned_keys
from .controls import Controls, StopScanner
from .drafters import EMPTY_DRAFT, Draft, Drafter, HeadDrafter, ModelDrafter, NgramDrafter, drafter_kind
from ..core.defaults import DEFAULTS
from ..core.errors import MarsError
from ..core.config import MAX_DRAFT, Chunk, GenerateConfig, Generation, Stream
from .run import Run as _Run, catch_up_excess
from .target_access import TargetAccess
from .grammar import GrammarState
from .learned import LearnedStore, default_store
from .repack import load_exact_target
from ..llama.rpc import placement
from ..llama.abort import DecodeAborted
from ..llama.context import Context
from ..llama.eagle3 import check_eagle3_head, open_eagle3
from ..llama.mtp import MtpContext, check_mtp_model, open_mtp
from ..llama.runtime import Model, build_fingerprint, check_vocab_compatible
from ..core.sampling import position_uniforms
from ..core.stats import SpecStats
from ..core.tokens import common_prefix_len
from ..core.verify import VerifyResult, verify

__all__ = ["Engine", "GenerateConfig", "Generation", "Chunk", "Stream"]


def _checked_template(chat_template: str | None) -> str | None:
    """A built-in template's name or Jinja text (mars_local.chat.builtin), checked; None: the model's."""
    if chat_template is not None:
        from ..chat.builtin import check_chat_template

        check_chat_template(chat_template)
    return chat_template


class Engine(TargetAccess):
    """A loaded target (and optional draft) model, ready to generate many times.

    The Engine owns every llama.cpp context it uses (target and draft); what
    callers need from them is a method here (:meth:`logits`, :meth:`score_nll`,
    :meth:`piece`, :attr:`has_chat_template`, ...).

    >>> eng = Engine("target.gguf", draft="draft.gguf")          # doctest: +SKIP
    >>> out = eng.generate("Hello", max_tokens=32, verify="mars")  # doctest: +SKIP
    >>> out.text, out.stats.mean_accepted_length                  # doctest: +SKIP
    """

    def __init__(
        self,
        target: str | Path,
        draft: str | Path | None = None,
        *,
        drafter: DrafterKind | None = None,
        n_ctx: int = DEFAULTS.n_ctx,
        n_batch: int = DEFAULTS.n_batch,
        n_gpu_layers: int | None = None,
        n_gpu_layers_draft: int | None = None,
        n_threads: int | None = None,
        ngram_max: int = DEFAULTS.ngram_max,
        ngram_min: int = DEFAULTS.ngram_min,
        flash_attn: bool | None = None,
        kv_type: str = "f16",
        exact_kernels: bool = True,
        learned: bool | LearnedStore = True,
        chat_template: str | None = None,
        rpc: Sequence[str] | str | None = None,
        rpc_draft: bool = False,
        tensor_split: Sequence[float] | None = None,
        controller: Callable[[GenerateConfig, int], AdaptiveK | None] | None = None,
        drafter_factory: Callable[[GenerateConfig, int, Controls], Drafter] | None = None,
    ):
        """``controller(config, k_max)`` and ``drafter_factory(config, seed, controls)`` replace how a
        generation gets its draft-length controller and its drafter (seams for tests and experiments:
        the default is the learned adaptive controller, and the drafter of ``drafter``)."""
        self._chat_template_arg = _checked_template(chat_template)  # before any model loads
        self.drafter_kind = drafter = drafter_kind(drafter, draft)
        # rpc: llama.cpp RPC servers (HOST:PORT) that take the target's layers; the draft stays local
        target_devs, draft_devs = placement(rpc, rpc_draft)
        if drafter == "mtp":  # before loading: a model without nextn layers would abort in llama.cpp
            check_mtp_model(target)
        elif drafter == "eagle3":  # before loading: a head that does not fit its target would abort too
            check_eagle3_head(draft, target)
        store = (learned if isinstance(learned, LearnedStore) else default_store()) if learned else None
        target_kw = dict(devices=target_devs, tensor_split=tensor_split, load_mtp=drafter == "mtp")
        if exact_kernels:  # repacked weights only where this machine measured them exact (speculate.repack)
            self.target = load_exact_target(target, n_gpu_layers, store, n_threads=n_threads, **target_kw)
        else:
            self.target = Model(target, n_gpu_layers, exact_kernels=False, **target_kw)
        ctx_opts = dict(n_batch=n_batch, n_threads=n_threads, flash_attn=flash_attn, kv_type=kv_type)
        self._ctx = Context(self.target, n_ctx=n_ctx, **ctx_opts)
        if drafter != "none" and self.target.rollback_depth == 0:
            raise MarsError(
                f"the target is a recurrent/hybrid model ({self.target.arch}) whose state llama.cpp cannot roll "
                "back; speculative decoding is not supported for it (use --no-draft)"
            )
        self.draft_model: Model | None = None
        self._draft_ctx: Context | None = None
        if drafter == "model":
            self._load_draft(draft, n_gpu_layers_draft, draft_devs, ctx_opts)
        # a head reading the target's own rows drafts (the target's MTP layers, llama/mtp.py, or an
        # EAGLE-3 head, llama/eagle3.py): its context, and that context's one sequence
        self._head_ctx: MtpContext | None = None
        if drafter == "mtp":
            self._head_ctx = open_mtp(self._ctx)
        elif drafter == "eagle3":
            self.draft_model = Model(draft, n_gpu_layers_draft, devices=draft_devs)
            check_vocab_compatible(self.target, self.draft_model)
            self._head_ctx = open_eagle3(self._ctx, self.draft_model)
        self._head = self._head_ctx.seq(0) if self._head_ctx is not None else None
        self._chat_formatter = None
        self._busy: object | None = None  # the running stream's token (one generation at a time)
        self._last_stats: SpecStats | None = None
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        NgramDrafter(ngram_max, ngram_min)  # validates the sizes
        device = f"t{self._ctx.n_threads}|{kv_type}|fa{flash_attn}" + (f"|rpc={rpc}" if rpc else "")
        self.controllers = self._open_controllers(store, target, draft, device, n_gpu_layers, n_gpu_layers_draft)
        self._controller_factory, self._drafter_factory = controller, drafter_factory

    def _open_controllers(self, store, target, draft, device: str, n_gpu_layers, n_gpu_layers_draft) -> Controllers:
        """What the adaptive controllers learn is kept between processes (mars_local.speculate.learned),
        keyed by what it depends on: the models, the drafter, the build and the device settings."""
        keys = learned_keys(
            target, draft, self.drafter_kind, (self.ngram_max, self.ngram_min), build=build_fingerprint(),
            device=device, n_gpu_layers=n_gpu_layers, n_gpu_layers_draft=n_gpu_layers_draft,
        )
        return Controllers(store, keys, gpu=self.target.offloaded)

    def _load_draft(self, draft, n_gpu_layers_draft, devices, ctx_opts: dict) -> None:
        self.draft_model = Model(draft, n_gpu_layers_draft, devices=devices)
        if self.draft_model.recurrent:
            raise MarsError("the draft is a recurrent/hybrid model whose cache cannot be rolled back")
        check_vocab_compatible(self.target, self.draft_model)
        self._draft_ctx = Context(self.draft_model, n_ctx=self._ctx.n_ctx, **ctx_opts)

    # ---------------------------------------------------------- generation
    def stream(self, prompt: str | Sequence[int], config: GenerateConfig | None = None, **options) -> Stream:
        """Generate, yielding one :class:`Chunk` per verify round.

        Returns a :class:`Stream`: iterate it for the chunks; its ``stats``
        are final once it is exhausted or closed (stop_reason "eog", "length",
        "context" (the context is full), "interrupted" (closed early, or
        KeyboardInterrupt) or "error").  ``generate`` returns them directly.

        One Engine runs one generation at a time (both caches are its state):
        a stream started while another one is unfinished is refused with a
        MarsError; exhaust or ``close()`` the first one (leaving a ``for`` loop
        early releases it too, once the stream is collected).

        A draft is never longer than ``n_batch - 1`` tokens, so a verify window
        fits one batch: ``draft_max`` larger than that is capped.
        """
        self._check_idle()
        cfg = config if config is not None else GenerateConfig.make(**options)
        if config is not None and options:
            cfg = replace(cfg, **options)
        tokens = self._prompt_tokens(prompt)
        vcfg = cfg.verify_config(self.target.eog_ids)
        seed = cfg.sampling.base_seed()
        ctrl = self._controller(cfg)
        stats = SpecStats(n_prompt=len(tokens), adaptive=ctrl is not None)
        grammar = (GrammarState(self.target, cfg.grammar, triggers=cfg.grammar_triggers)
                   if cfg.grammar is not None else None)
        controls = Controls(cfg, self.target.eog_ids, grammar)
        run = _Run(tokens, cfg, vcfg, seed, self._make_drafter(cfg, seed, controls), stats, ctrl,
                   controls=controls, stops=StopScanner(cfg.stop))
        return Stream(self._run(run), stats, cfg, cancel=run.stop.set)

    @property
    def last_stats(self) -> SpecStats | None:
        """The statistics of the latest generation: the only way to read those of a
        :meth:`generate` that raised (Ctrl-C in ``on_chunk``); a stream has its own ``stats``."""
        return self._last_stats

    def _check_idle(self) -> None:
        if self._busy is not None:
            raise MarsError(
                "another generation is still running on this Engine; exhaust or close() its stream first"
            )

    def _make_drafter(self, cfg: GenerateConfig, seed: int, controls: Controls) -> Drafter:
        if cfg.draft_max == 0:  # speculation off for this generation: nothing drafts (nor reads the prompt)
            return Drafter()
        if self._drafter_factory is not None:
            return self._drafter_factory(cfg, seed, controls)
        if self.drafter_kind == "model":
            return ModelDrafter(
                self._draft_ctx, cfg.draft_sampling, cfg.sampling, seed, cfg.draft_p_min, cfg.draft_min,
                controls=controls if controls.active else None,
            )
        if self.drafter_kind == "ngram":
            return NgramDrafter(self.ngram_max, self.ngram_min)
        if self.drafter_kind in HEAD_DRAFTERS:
            return HeadDrafter(
                self._head, cfg.draft_sampling, cfg.sampling, seed, cfg.draft_p_min, cfg.draft_min,
                controls=controls if controls.active else None,
            )
        return Drafter()

    @property
    def max_draft(self) -> int:
        """The most draft tokens a round can verify here, whatever ``draft_max`` asks: a verify
        window within one batch and the target's exact bound (16 rows with layers on a GPU,
        unless loaded with ``exact_kernels=False``), and what a recurrent target can roll back."""
        return self._k_limit

    @property
    def _k_limit(self) -> int:
        """The longest draft whose verify window (k + 1 rows) fits one batch and the target's
        exact bound (Model.invariant_rows: 16 rows on a GPU), and whose rejection a recurrent
        target's state can roll back (llama/recurrent.py)."""
        return min(MAX_DRAFT, self._ctx.n_batch - 1, self.target.invariant_rows - 1,
                   self.target.rollback_depth or MAX_DRAFT)

    def _controller(self, cfg: GenerateConfig) -> AdaptiveK | None:
        """The draft-length controller for ``cfg`` (None: k stays at draft_max)."""
        k_max = min(cfg.draft_max, self._k_limit)
        if self.drafter_kind == "none" or k_max <= 0:
            return None
        if self._controller_factory is not None:
            return self._controller_factory(cfg, k_max)
        return self.controllers.for_config(cfg, k_max)

    def _run(self, run: _Run) -> Iterator[Chunk]:
        """The loop, with the Engine held and the stats finalized on every way out."""
        self._check_idle()  # another stream may have started since this one was created
        busy = self._busy = object()
        self._last_stats = stats = run.stats
        t_start = time.perf_counter()
        contexts = [c for c in (self._ctx, self._draft_ctx, self._head_ctx) if c is not None]
        for c in contexts:  # a prompt's chunk in progress stops at Stream.cancel (llama/abort.py)
            c.abort_check = run.stop.is_set
        try:
            yield from self._loop(run, t_start)
        except DecodeAborted:  # (cancelled inside a prompt's chunk: the cache holds the chunks before it)
            stats.stop_reason = stats.stop_reason or "interrupted"
        except (GeneratorExit, KeyboardInterrupt):
            if not stats.stop_reason:
                stats.stop_reason = "interrupted"
            raise
        except BaseException:
            if not stats.stop_reason:
                stats.stop_reason = "error"
            raise
        finally:
            for c in contexts:
                c.abort_check = None
            run.controls.close()
            stats.time_total_s = time.perf_counter() - t_start
            if self._busy is busy:
                self._busy = None
            if run.ctrl is not None:
                self.controllers.save()

    def _loop(self, run: _Run, t_start: float) -> Iterator[Chunk]:
        clock, stats, tokens = time.perf_counter, run.stats, run.tokens
        use_native = native.available()  # the patched libllama's kernel; same results as numpy
        verify_window = native.verify if use_native else verify
        stats.verify_backend = "native" if use_native else "numpy"
        first = self._prefill(run, t_start)
        if first is not None:
            # the prompt's last row was evaluated (riding in its last chunk, or alone): the first
            # token is known now, before the drafter has even seen the prompt (time to first token)
            chunk = self._first_token(run, verify_window, first)
            if chunk is not None:
                yield chunk
        if not stats.stop_reason:  # (the first token may have ended the generation)
            self._begin_drafting(run)
        # Invariant at the top of every round: the target cache holds exactly
        # tokens[:-1]; the draft cache (a draft model's) holds a prefix of
        # tokens[:-1] (the drafter evaluates the rest when it next proposes).
        # A stop reason set by a round ends the loop.
        while not stats.stop_reason and (k_cap := run.draft_cap(self._ctx, self._k_limit)) is not None:
            t0 = clock()
            draft, shadow, drafted = run.choose_draft(k_cap)
            # draft cache: tokens + d_0 .. d_{k-2} at most (the last draft is never evaluated)
            t1 = clock()
            base = self._ctx.n_past  # == len(tokens) - 1
            logits = self._target_forward(tokens[-1], draft)
            # target cache: tokens + d_0 .. d_{k-1} (base + 1 + k positions)
            t2 = clock()
            if run.controls.active:  # row i as if d_0 .. d_{i-1} were committed
                run.controls.process_window(tokens, logits, draft.tokens)
            run.logits = logits
            res = self._verify(run, verify_window, logits, draft)
            t3 = clock()
            self._commit(run, base, res)
            # target cache: tokens[:-1] again (the accepted drafts kept, the
            # rejected ones dropped; the new last token is the target's);
            # draft cache: the longest prefix it shares with tokens[:-1]
            t4 = clock()
            t_draft = (t1 - t0) + (t4 - t3)
            stats.time_draft_s += t_draft
            stats.time_target_s += t2 - t1
            stats.time_verify_s += t3 - t2
            if run.ctrl is not None:
                # a draft model that drafted this round first caught up on the tokens decoded
                # plainly since it last did: beyond the (at most) two rows a drafting round's
                # first evaluation carries, that is not a cost of the tokens drafted now
                catch_up = catch_up_excess(*run.drafter.catch_up) if drafted else 0.0
                run.ctrl.observe(len(draft), res.n_accepted, t2 - t1, t_draft - catch_up, draft.keys,
                                 drafted=drafted)
                if shadow is not None:
                    run.ctrl.observe_shadow(shadow.tokens[0] == res.tokens[0], shadow.keys[0])
            chunk = run.emit(self._ctx, self.target, len(draft), res)
            if chunk is not None:
                yield chunk
        tail = run.tail()
        if tail is not None:
            yield tail

    def _prefill(self, run: _Run, t_start: float) -> np.ndarray | None:
        """Bring the target cache to the prompt, reusing what it shares with it, and return the
        last token's logits row (the first token's distribution): that token rides in the last
        chunk where that is free (llama.context.last_rides), else it is evaluated alone.  None
        only where the context has no room for it (the cache then holds the prompt minus it)."""
        stats = run.stats
        kept = common_prefix_len(self._ctx.tokens, run.tokens[:-1])
        try:
            stats.n_prompt_evaluated, first = self._ctx.prefill(run.tokens)
        except BaseException:  # (Ctrl-C, Stream.cancel): --stats shows the prompt's part done so far;
            # time_prompt_target_s stays 0: the prompt never ended (what the server's cached_tokens reads)
            stats.n_prompt_evaluated = max(0, len(self._ctx.tokens) - kept)
            stats.time_prompt_s = time.perf_counter() - t_start
            raise
        if first is None and len(run.tokens) <= self._ctx.n_ctx:
            # the last token had no chunk to ride in (the prompt all cached, or its last chunk too
            # wide for lone rows): evaluated alone, a lone row as plain decoding's first round is,
            # so the first token still comes before the drafter reads the prompt and before any
            # window (a cached prompt on the F16 stand-in: 70 ms to the first token, not the
            # 220-300 of a draft and a window; a long one: not after the draft model's prefill)
            first = self._ctx.eval([run.tokens[-1]], n_out=1)[0].copy()
        stats.time_prompt_target_s = stats.time_prompt_s = time.perf_counter() - t_start
        return first

    def _first_token(self, run: _Run, verify_window, logits: np.ndarray) -> Chunk | None:
        """The token after the prompt, from the prompt's last row: a round without a draft
        that costs no forward of its own (the target cache then holds tokens[:-1] again)."""
        logits = logits[None, :]
        if run.controls.active:
            run.controls.process_window(run.tokens, logits, [])
        run.logits = logits
        res = self._verify(run, verify_window, logits, EMPTY_DRAFT)
        run.tokens.extend(res.tokens)
        return run.emit(self._ctx, self.target, None, res)

    def _begin_drafting(self, run: _Run) -> None:
        """Bring the drafter to the prompt and time a few verify windows if the controller needs it."""
        stats, tokens = run.stats, run.tokens
        t0 = time.perf_counter()
        run.drafter.begin(tokens)
        stats.time_prompt_s += time.perf_counter() - t0
        if run.ctrl is not None:
            stats.time_calibrate_s = calibrate(run.ctrl, self._ctx, tokens[-1])  # the cache is left unchanged

    def _target_forward(self, last: int, draft: Draft) -> np.ndarray:
        """One batched target decode of the window [last, d_0 .. d_{k-1}]: k+1 rows of logits."""
        return self._ctx.eval([last] + draft.tokens, n_out=len(draft) + 1)

    def _verify(self, run: _Run, verify_window, logits: np.ndarray, draft: Draft) -> VerifyResult:
        """Apply the rule: m accepted drafts plus one target token (correction or bonus)."""
        params = run.cfg.sampling
        u = None if params.greedy else position_uniforms(run.seed, len(run.tokens), len(draft) + 1)
        return verify_window(
            logits, np.asarray(draft.tokens, dtype=np.int64), run.vcfg, params,
            draft_probs=draft.probs, uniforms=u,
        )

    def _commit(self, run: _Run, base: int, res: VerifyResult) -> None:
        """Keep [last, d_0 .. d_{m-1}] in the target cache, commit the new tokens,
        and let the drafter roll its own cache back."""
        self._ctx.truncate(base + 1 + res.n_accepted)
        run.tokens.extend(res.tokens)
        run.drafter.observe(run.tokens, res.n_accepted)

    def generate(
        self,
        prompt: str | Sequence[int],
        config: GenerateConfig | None = None,
        on_chunk: Callable[[Chunk], None] | None = None,
        **options,
    ) -> Generation:
        """Generate a completion; ``options`` are :class:`GenerateConfig` fields
        plus the sampling fields (temperature, top_k, top_p, min_p, seed)."""
        text, toks, kinds, logprobs = [], [], [], []
        with self.stream(prompt, config, **options) as stream:
            # closed on every way out: an exception in on_chunk (Ctrl-C)
            # finalizes the stats and frees the engine now
            for chunk in stream:
                text.append(chunk.text)
                toks.extend(chunk.tokens)
                kinds.extend(chunk.kinds)
                logprobs.extend(chunk.logprobs or [])
                if on_chunk is not None:
                    on_chunk(chunk)
        lp = logprobs if stream.config.logprobs else None
        return Generation("".join(text), toks, kinds, stream.stats, lp)

    def reset(self) -> None:
        """Forget the cached prompt prefix: the next generation evaluates its whole prompt."""
        self._check_idle()
        for ctx in (self._ctx, self._draft_ctx, self._head):
            if ctx is not None:
                ctx.truncate(0)

    def close(self) -> None:
        for obj in (self._head_ctx, self._draft_ctx, self._ctx, self.draft_model, self.target):
            if obj is not None:
                obj.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
