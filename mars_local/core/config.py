"""What one generation takes and gives: its settings, its chunks, its result.

Pure (no llama.cpp): :class:`GenerateConfig` validates on construction;
:class:`Stream` is what :meth:`mars_local.speculate.engine.Engine.stream` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from .choices import DraftSampling, VerifyMethod
from .defaults import DEFAULTS, SETTINGS, Setting, check
from .errors import MarsError
from .sampling import SamplingParams
from .stats import SpecStats
from .verify import VerifyConfig

__all__ = ["GenerateConfig", "Chunk", "Generation", "Stream", "TokenLogprob", "MAX_DRAFT",
           "SETTINGS", "DEFAULTS", "Setting", "check"]

MAX_DRAFT = SETTINGS["draft_max"].hi  # patches/0003: batches of up to 64 rows use the kernels of a 1-row decode


@dataclass(frozen=True)
class GenerateConfig:
    """Everything that shapes one generation (validated on construction).

    Defaults and ranges: the table of :mod:`mars_local.core.defaults`; a value it refuses is a
    MarsError whose ``field`` names the field."""

    max_tokens: int = DEFAULTS.max_tokens  # -1: until an end-of-generation token or a full context
    verify: VerifyMethod = DEFAULTS.verify
    theta: float = DEFAULTS.theta
    draft_max: int = DEFAULTS.draft_max
    draft_min: int = DEFAULTS.draft_min
    draft_p_min: float = DEFAULTS.draft_p_min
    draft_sampling: DraftSampling = DEFAULTS.draft_sampling
    adaptive: bool = DEFAULTS.adaptive
    max_relaxed: int | None = DEFAULTS.max_relaxed
    require_positive_top1: bool = DEFAULTS.require_positive_top1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Controls honoured inside verify windows (row i sees the committed text plus drafts 0..i-1):
    ignore_eos: bool = DEFAULTS.ignore_eos  # end-of-generation tokens masked in the target's rows and the draft's
    stop: tuple[str, ...] = DEFAULTS.stop  # stop strings: the output ends just before the first one
    repeat_penalty: float = DEFAULTS.repeat_penalty  # llama.cpp's penalties, over the last repeat_last_n tokens
    repeat_last_n: int = DEFAULTS.repeat_last_n  # 0: off, -1: the whole context
    presence_penalty: float = DEFAULTS.presence_penalty
    frequency_penalty: float = DEFAULTS.frequency_penalty
    grammar: str | None = DEFAULTS.grammar  # GBNF text (see mars_local.speculate.grammar for JSON and JSON schemas)
    # A lazy grammar: none of the output is constrained until one of these words appears in it; the
    # grammar then applies from that word on (it must accept the word).  (): from the first token.
    grammar_triggers: tuple[str, ...] = DEFAULTS.grammar_triggers
    # Control tokens whose text is one of these appear in the output text (a tool call's markers, e.g.
    # Mistral's [TOOL_CALLS]); every other control token stays out of it.
    visible_special: tuple[str, ...] = DEFAULTS.visible_special
    logprobs: int = DEFAULTS.logprobs  # the target's top-N log probabilities at each emitted token (0: none)

    def __post_init__(self) -> None:
        for name in _CHECKED:  # one rule per field, in the table
            check(name, getattr(self, name))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "grammar_triggers", tuple(self.grammar_triggers))
        object.__setattr__(self, "visible_special", tuple(self.visible_special))
        if self.grammar is not None and not self.grammar.strip():
            raise MarsError("the grammar is empty", field="grammar")
        if self.grammar_triggers and self.grammar is None:
            raise MarsError("grammar triggers need a grammar", field="grammar_triggers")
        if self.draft_min > self.draft_max:
            raise MarsError(f"draft-min must be in [0, draft-max={self.draft_max}], got {self.draft_min}",
                            field="draft_min", subject="draft-min")
        self.verify_config()  # validates verify, theta and max_relaxed (VerifyConfig's fields)

    def verify_config(self, eog_ids: tuple[int, ...] = ()) -> VerifyConfig:
        """The verification rule these settings ask for (``eog_ids``: the target's end-of-generation tokens)."""
        return VerifyConfig(self.verify, self.theta, self.require_positive_top1, self.max_relaxed, tuple(eog_ids))

    @property
    def unlimited(self) -> bool:
        return self.max_tokens == -1

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

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


_CHECKED = ("max_tokens", "draft_max", "draft_min", "draft_p_min", "draft_sampling", "stop", "repeat_penalty",
            "repeat_last_n", "presence_penalty", "frequency_penalty", "logprobs", "grammar_triggers",
            "visible_special")


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log probability of an emitted token and its top-N alternatives.

    From the target row that produced the token (penalties and grammar applied,
    before temperature and truncation): no extra forward is run.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log probability), most likely first

    def to_dict(self, piece=None) -> dict:
        """JSON form; ``piece(token_id) -> str`` adds the text of each token."""
        d: dict = {"token": self.token, "logprob": self.logprob}
        top = [{"token": t, "logprob": lp} for t, lp in self.top]
        if piece is not None:
            d["text"] = piece(self.token)
            for e in top:
                e["text"] = piece(e["token"])
        d["top"] = top
        return d


def token_logprobs(rows, tokens: list[int], n_top: int) -> list[TokenLogprob]:
    """Log probabilities of ``tokens[i]`` under row i of ``rows`` (log-softmax in float64), with the top ``n_top``.
    Alternatives of probability 0 (a grammar forbids them: logit -inf) are left out, so a row may
    list fewer than ``n_top``: -inf has no JSON form, and they were never candidates."""
    out = []
    for i, t in enumerate(tokens):
        z = np.asarray(rows[i], dtype=np.float64)
        m = z.max()
        lse = m + np.log(np.exp(z - m).sum())
        top = np.argpartition(-z, n_top - 1)[:n_top] if n_top < len(z) else np.arange(len(z))
        top = sorted((j for j in top.tolist() if z[j] > -np.inf), key=lambda j: (-z[j], j))
        out.append(TokenLogprob(int(t), float(z[t] - lse), tuple((int(j), float(z[j] - lse)) for j in top)))
    return out


@dataclass
class Chunk:
    """Tokens committed by one round, with how each was produced.

    kinds: "draft" (accepted draft token), "relaxed" (accepted only because of
    MARS) or "target" (the target's correction or bonus token).  ``text`` may
    lag ``tokens``: an incomplete UTF-8 sequence, or text that could be the
    start of a stop string, is held back until it is decided.
    ``logprobs``: one entry per token when ``GenerateConfig.logprobs`` > 0.
    """

    tokens: list[int]
    text: str
    kinds: list[str]
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Generation:
    text: str
    tokens: list[int]
    kinds: list[str]
    stats: SpecStats
    logprobs: list[TokenLogprob] | None = None

    def to_dict(self, piece=None) -> dict:
        d = {"text": self.text, "tokens": list(self.tokens), "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            d["logprobs"] = [lp.to_dict(piece) for lp in self.logprobs]
        return d


class Stream(Iterator[Chunk]):
    """The chunks of one generation (what :meth:`Engine.stream` returns).

    ``config`` is the :class:`GenerateConfig` it runs with; ``stats`` is this
    generation's :class:`SpecStats`: filled in as the chunks
    come, final once the stream is exhausted or closed (``close()``, a ``with``
    block, or the stream being collected), stop_reason included.
    """

    def __init__(self, chunks: Iterator[Chunk], stats: SpecStats, config: GenerateConfig | None = None,
                 cancel: Callable[[], None] | None = None):
        self._chunks = chunks
        self.stats = stats
        self.config = config if config is not None else GenerateConfig()
        self._cancel = cancel

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def close(self) -> None:
        """Stop the generation here: stop_reason "interrupted" unless it had ended
        (a stream closed before its first chunk never started: its stats stay empty)."""
        self._chunks.close()

    def cancel(self) -> None:
        """Ask the generation to stop, from any thread (e.g. a server's event loop while another
        thread iterates): a prompt's chunk being evaluated stops within milliseconds and the
        stream then ends with stop_reason "interrupted" instead of its next chunk; a verify
        round in progress finishes first.  (A Stream made without ``cancel`` ignores it.)"""
        if self._cancel is not None:
            self._cancel()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


