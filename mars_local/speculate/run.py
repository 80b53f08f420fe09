"""The state of one generation while the loop runs it, and the steps of a round that only
concern that generation: shared by the Engine's loop and the Scheduler's rounds (``ctx``: the
target's cells of this generation, a Context or a SeqView)."""

from __future__ import annotations

import codecs
import threading
from dataclasses import dataclass, field

from ..core.config import Chunk, GenerateConfig, token_logprobs
from ..core.stats import SpecStats
from ..core.verify import VerifyConfig
from .adaptive import AdaptiveK
from .drafters import EMPTY_DRAFT, Draft, Drafter

__all__ = ["Run", "catch_up_excess", "visible_tokens"]


def visible_tokens(target, words) -> frozenset:
    """The tokens that are one of ``words`` when special text is parsed (a control token's text)."""
    out = set()
    for w in words:
        toks = target.tokenize(w, add_special=False, parse_special=True)
        if len(toks) == 1:
            out.add(toks[0])
    return frozenset(out)


# Rows of a draft model's first evaluation in a round that follows a drafting round: the
# last verified draft (never evaluated by the drafter) and the target's token after it
STEADY_CATCH_UP = 2


def catch_up_excess(rows: int, seconds: float) -> float:
    """The share of a draft model's first evaluation of ``rows`` rows (``seconds``) beyond
    what a round that follows a drafting round evaluates: its catch-up on tokens decoded
    plainly since it last drafted (pro rata: batched rows cost alike)."""
    return seconds * (rows - STEADY_CATCH_UP) / rows if rows > STEADY_CATCH_UP else 0.0


@dataclass
class Run:
    """The state of one generation, shared by the steps of the loop."""

    tokens: list[int]  # every committed token: prompt + generated (tokens[-1] is not in the target's cache)
    cfg: GenerateConfig
    vcfg: VerifyConfig
    seed: int
    drafter: Drafter
    stats: SpecStats
    ctrl: AdaptiveK | None
    controls: object = None  # controls.Controls: penalties, EOG masking, grammar (window-aware)
    stops: object = None  # controls.StopScanner
    logits: object = None  # the latest window's rows (processed), for logprobs
    generated: int = 0
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    shown: frozenset | None = None  # the control tokens whose text is shown (cfg.visible_special), once known
    stop: threading.Event = field(default_factory=threading.Event)  # set: cancelled (Stream.cancel, any thread)

    def pieces(self, target, tokens) -> list[bytes]:
        """The UTF-8 pieces of ``tokens``: control tokens hidden, but those cfg.visible_special names."""
        if self.shown is None:
            self.shown = visible_tokens(target, self.cfg.visible_special)
        return [target.piece(t, special=t in self.shown) for t in tokens]

    def text(self, pieces: list[bytes]) -> tuple[str, int]:
        """The text of new tokens (their UTF-8 ``pieces``) that may be shown now, and how
        many of the tokens to keep: all, or up to the one that completes a stop string."""
        if not self.stops.stops:
            return self.decoder.decode(b"".join(pieces)), len(pieces)
        out = []
        for i, piece in enumerate(pieces):
            out.append(self.stops.feed(self.decoder.decode(piece)))
            if self.stops.stopped:
                return "".join(out), i + 1
        return "".join(out), len(pieces)

    def draft_cap(self, ctx, k_limit: int) -> int | None:
        """The longest draft this round may have (at most ``k_limit``), or None, with the stop
        reason set, when the generation is done: cancelled, max_tokens reached or no room left in
        ``ctx``."""
        if self.stop.is_set():
            self.stats.stop_reason = "interrupted"
            return None
        remaining = k_limit + 1 if self.cfg.unlimited else self.cfg.max_tokens - self.generated
        if remaining <= 0:
            self.stats.stop_reason = "length"
            return None
        room = ctx.n_ctx - ctx.n_past - 1  # rows that fit after `last`
        if room < 0:
            self.stats.stop_reason = "context"
            return None
        return max(0, min(self.cfg.draft_max, k_limit, remaining - 1, room))

    def emit(self, ctx, target, k: int | None, res) -> Chunk | None:
        """The round's chunk (cut before an end-of-generation token), its statistics, and the
        stop reason when this is the last round: it is known before the chunk is yielded (a
        consumer may stop at it).  ``target``: the Model (end-of-generation ids, token pieces);
        ``k`` None: the first token, from the prompt's own forward (no round)."""
        stats, new = self.stats, res.tokens
        kinds = ["relaxed" if r else "draft" for r in res.relaxed] + ["target"]
        stop = None
        for i, t in enumerate(new):
            if target.is_eog(t):
                new, kinds, stop = new[:i], kinds[:i], "eog"
                break
        self.controls.commit(new)
        text, n = self.text(self.pieces(target, new))
        if self.stops.stopped:
            new, kinds, stop = new[:n], kinds[:n], "stop"
        if k is None:
            stats.record_first(len(new))
        else:
            stats.record_round(k, res.n_accepted, res.n_relaxed, len(new))
        self.generated += len(new)
        if stop:
            stats.stop_reason = stop
        elif not self.cfg.unlimited and self.generated >= self.cfg.max_tokens:
            stats.stop_reason = "length"
        elif ctx.n_ctx - ctx.n_past - 1 < 0:
            stats.stop_reason = "context"
        logprobs = token_logprobs(self.logits, new, self.cfg.logprobs) if self.cfg.logprobs else None
        return Chunk(list(new), text, kinds, logprobs) if new or text else None

    def tail(self) -> Chunk | None:
        """The text held back at the end (stop-string candidates, a split character)."""
        tail = self.stops.feed(self.decoder.decode(b"", final=True)) + self.stops.flush()
        return Chunk([], tail, [], [] if self.cfg.logprobs else None) if tail else None

    def choose_draft(self, k_cap: int) -> tuple[Draft, Draft | None, int]:
        """This round's draft (at most k_cap tokens); a proposal the controller
        cut to nothing, whose first token is still worth comparing ("shadow");
        and the number of tokens a costly drafter made (trimmed ones count)."""
        drafter, ctrl, tokens = self.drafter, self.ctrl, self.tokens
        shadow, drafted = None, 0
        if ctrl is None:
            draft = drafter.propose(tokens, k_cap) if k_cap > 0 else EMPTY_DRAFT
        elif drafter.cheap:
            # Proposing is free: propose first, then let the controller cut
            # the draft knowing its keys (n-gram match lengths; None: pooled).
            full = drafter.propose(tokens, k_cap) if k_cap > 0 else EMPTY_DRAFT
            keys = (full.keys or []) if drafter.gives_keys else [None] * len(full)
            k = ctrl.choose(k_cap, keys)
            draft = Draft(full.tokens[:k], keys=keys[:k]) if k else EMPTY_DRAFT
            if not k and full.tokens:
                shadow = Draft(full.tokens, keys=keys)  # its first token is compared with the target's, for free
        elif (k := ctrl.choose(k_cap)) > 0:
            # A costly drafter that gives keys (a draft model: its confidence)
            # drafts token by token until the controller, seeing each key, says
            # more would not pay; trailing drafts not worth their verify rows are cut.
            extend = (lambda keys: ctrl.extend(keys, k_cap)) if drafter.gives_keys else None
            full = drafter.propose(tokens, k_cap if extend else k, extend=extend)
            drafted = len(full)
            m = min(ctrl.trim(full.keys), drafted) if full.keys else drafted
            draft = full if m == drafted else Draft(
                full.tokens[:m], full.probs[:m] if full.probs is not None else None, full.keys[:m]
            )
        else:
            draft = EMPTY_DRAFT
        if len(draft) < self.cfg.draft_min:
            draft = EMPTY_DRAFT
        return draft, shadow, drafted
