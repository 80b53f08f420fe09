"""The one table of defaults and ranges: every setting's default and its rule, written once.

:data:`SETTINGS` maps a setting's name (a :class:`~mars_local.core.config.GenerateConfig` or
:class:`~mars_local.core.sampling.SamplingParams` field, or an engine / server / bench knob)
to a :class:`Setting`: its default, its range and what its special values mean.  Everything
that has a default or checks a range reads it here: the dataclasses' defaults and
``__post_init__`` checks (:func:`check`), the CLI's option defaults and help texts, the
server's request parsing and its settings, the benchmark's settings, the engine and the
llama.cpp context.  Changing a default is changing one line below.

A rule broken is a :class:`~mars_local.core.errors.MarsError` whose ``field`` is the
setting's name and whose ``subject`` is how the message names it ("repeat-penalty
must be > 0 (1.0 = off), got 0"): the CLI renames the subject to the flag as typed, the
server to the JSON parameter (:meth:`MarsError.naming`).

``DEFAULTS.name`` is ``SETTINGS[name].default``.

The seed has one meaning everywhere: a negative seed (the default, -1) draws a fresh
random seed for each generation, as llama.cpp's; N >= 0 makes a run reproducible.  The
benchmark's default is a fixed seed (``seed_bench``): it compares configurations on the
same draws.

Pure: imports only :mod:`.choices` and :mod:`.errors`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from .choices import DRAFT_SAMPLINGS, DRAFTERS, VERIFY_METHODS, one_of
from .errors import MarsError

__all__ = ["Setting", "SETTINGS", "DEFAULTS", "check"]


@dataclass(frozen=True)
class Setting:
    """A default and the rule its values follow.

    ``lo``/``hi``: bounds (inclusive unless ``open_lo``/``open_hi``); ``integer``: whole numbers
    only; ``also``: values allowed outside the bounds (-1 of max_tokens) and ``also_note`` what
    they mean; ``finite``: NaN and infinities refused (always, where there are bounds);
    ``choices``: the allowed strings; ``strings``: a sequence of non-empty strings;
    ``optional``: None is allowed (it is whenever the default is None); ``unit``: ``hi`` is a
    hard limit ("is too large (at most N tokens)") rather than part of the range; ``name``: how
    a message names the setting (default: the key with dashes); ``note``: what special values
    mean, in messages and help texts.
    """

    default: Any
    lo: float | None = None
    hi: float | None = None
    integer: bool = False
    open_lo: bool = False
    open_hi: bool = False
    also: tuple = ()
    also_note: str = ""
    finite: bool = False
    choices: tuple = ()
    strings: bool = False
    optional: bool = False
    unit: str = ""
    name: str = ""
    note: str = ""

    def range_text(self) -> str:
        """The allowed values in words: "0..20", "(0, 1]", ">= 1", "a finite number >= 0"."""
        if self.choices:
            return one_of(self.choices)
        hi = None if self.unit else self.hi
        if self.lo is not None and hi is not None:
            if self.integer:
                return f"in {_num(self.lo)}..{_num(hi)}"
            return f"in {'(' if self.open_lo else '['}{_num(self.lo)}, {_num(hi)}{')' if self.open_hi else ']'}"
        lead = "a finite number " if self.finite and not self.integer else ""
        if self.lo is not None:
            return f"{lead}{'>' if self.open_lo else '>='} {_num(self.lo)}"
        if hi is not None:
            return f"{lead}{'<' if self.open_hi else '<='} {_num(hi)}"
        return lead.strip() or ("a whole number" if self.integer else "a number")

    def rule(self, value) -> str | None:
        """Why ``value`` is refused (the message without its subject), or None when it is allowed."""
        if self.strings:
            return _strings_rule(value)
        if value is None:
            return None if self.default is None or self.optional else f"must be {self.range_text()}, got None"
        if self.choices:
            return None if value in self.choices else f"must be {self.range_text()}, got {value!r}"
        if value in self.also or not (self.integer or self.finite or self.lo is not None or self.hi is not None):
            return None  # a setting without a range (a flag, a grammar) takes what its type takes
        note = f" ({self.note})" if self.note else ""
        if self.unit and self.hi is not None and _is_number(value) and value > self.hi:
            return f"{_num(value, True)} is too large (at most {_num(self.hi, True)} {self.unit})"
        if not self._inside(value):
            also = f", or {' or '.join(_num(a) for a in self.also)}{self.also_note}" if self.also else ""
            return f"must be {self.range_text()}{also}{note}, got {value}"
        return None

    def _inside(self, v) -> bool:
        if not _is_number(v):
            return False
        if not math.isfinite(v):  # NaN and infinities are never whole numbers, and never in a range
            return not (self.integer or self.finite or self.lo is not None or self.hi is not None)
        if self.integer and v != int(v):
            return False
        if self.lo is not None and (v <= self.lo if self.open_lo else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.open_hi else v <= self.hi)

    def label(self, key: str) -> str:
        return self.name or key.replace("_", "-")


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)  # numpy's numbers too


def _num(x, commas: bool = False) -> str:
    """1.0 -> "1", 0.05 -> "0.05", 1073741824 -> "1,073,741,824" (``commas``)."""
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    return f"{x:,}" if commas and isinstance(x, int) else str(x)


def _strings_rule(value) -> str | None:
    try:
        ok = not isinstance(value, str) and all(isinstance(x, str) for x in value)
    except TypeError:  # not a sequence
        ok = False
    if not ok:
        return "must be a sequence of non-empty strings"
    return None if all(value) else "needs a non-empty string (a sequence of non-empty strings, got an empty one)"


_UNTIL_END = "until an end-of-generation token or a full context"

# One line per setting.  The keys are the API's names (GenerateConfig, SamplingParams, Engine).
SETTINGS: dict[str, Setting] = {
    # ---- how long a generation may be (-n), one default per command
    "max_tokens": Setting(256, lo=1, integer=True, also=(-1,), also_note=" for no limit", note=_UNTIL_END,
                          name="the number of tokens to generate"),  # the API's and `mars run`'s
    "max_tokens_chat": Setting(512),  # `mars chat`: per answer (the rule: max_tokens's)
    "max_tokens_serve": Setting(-1),  # `mars serve`: a request without max_tokens (the rule: max_tokens's)
    "max_tokens_bench": Setting(64, lo=1, integer=True, name="the number of tokens to generate"),  # per prompt
    # ---- verification (VerifyConfig)
    "verify": Setting("mars", choices=VERIFY_METHODS),
    "theta": Setting(0.9, lo=0.0, hi=1.0, open_lo=True),  # the MARS margin threshold (paper: 0.9)
    "thetas_bench": Setting((0.85, 0.9, 0.95)),  # `mars bench`'s θ sweep
    "max_relaxed": Setting(None, lo=0, integer=True),  # MARS-relaxed accepts per window (None: no cap)
    "require_positive_top1": Setting(True),
    # ---- drafting
    "drafter": Setting(None, choices=DRAFTERS),  # None: the draft model when there is one, else none
    "draft_max": Setting(8, lo=0, hi=63, integer=True,  # 63: patches/0003 (windows of <= 64 rows run like 1 row)
                         note="verify windows of up to 64 rows are computed exactly like single tokens"),
    "draft_min": Setting(0, lo=0, integer=True),  # and <= draft_max (GenerateConfig checks the pair)
    "draft_p_min": Setting(0.0, lo=0.0, hi=1.0),
    "draft_sampling": Setting("greedy", choices=DRAFT_SAMPLINGS),
    "adaptive": Setting(True),
    "ngram_max": Setting(3, lo=1, integer=True, name="the largest n-gram size"),  # the n-gram drafter's sizes
    "ngram_min": Setting(1, lo=1, integer=True, name="the smallest n-gram size"),
    # ---- sampling (SamplingParams; llama.cpp's defaults)
    "temperature": Setting(0.0, lo=0.0, finite=True, note="0 = greedy"),
    "top_k": Setting(40, lo=0, integer=True, note="0 = off"),
    "top_p": Setting(0.95, lo=0.0, hi=1.0, open_lo=True, note="1 = off"),
    "min_p": Setting(0.05, lo=0.0, hi=1.0, open_hi=True, note="0 = off"),
    "seed": Setting(-1, integer=True, optional=True, note="-1 = random"),  # None: random too
    "seed_bench": Setting(0, integer=True),  # `mars bench`: sampling runs compare on the same draws
    # ---- generation controls
    "ignore_eos": Setting(False),
    "stop": Setting((), strings=True),
    "repeat_penalty": Setting(1.0, lo=0.0, open_lo=True, note="1.0 = off"),
    "repeat_last_n": Setting(64, lo=-1, integer=True, note="-1 = the whole context, 0 = off"),
    "presence_penalty": Setting(0.0, finite=True, note="0.0 = off"),
    "frequency_penalty": Setting(0.0, finite=True, note="0.0 = off"),
    "grammar": Setting(None),
    "grammar_triggers": Setting((), strings=True),
    "visible_special": Setting((), strings=True),
    "logprobs": Setting(0, lo=0, hi=20, integer=True),
    # ---- the engine and llama.cpp's context
    "n_ctx": Setting(4096, lo=0, hi=1 << 30, integer=True, unit="tokens", name="the context size",
                     note="0 = the model's training context"),  # 1 << 30: llama.cpp's positions are 32-bit
    "n_batch": Setting(512, lo=1, integer=True),
    "n_threads": Setting(None, lo=1, hi=512, integer=True, note="ggml's limit"),  # None: the physical cores
    # ---- mars serve
    "queue_size": Setting(64, lo=1, integer=True, name="queue"),  # requests waiting for the engine before 503
    # sequences per round of mars batch; 0: auto (speculate.batch_cost.auto_parallel: 8, fewer where
    # their KV caches would take over half the free memory)
    "parallel": Setting(0, lo=0, hi=256, integer=True, name="parallel"),
    # mars serve's: one at a time, whose engine reuses any cached prefix of the next prompt (a chat's
    # whole conversation), where batched sequences reuse only rows a lone run computes alike
    # (llama.streams.exact_reuse) and re-evaluate a longer conversation at every turn
    "parallel_serve": Setting(1, lo=0, hi=256, integer=True, name="parallel"),
}


class _Defaults:
    """``DEFAULTS.name``: the default of ``SETTINGS[name]`` (read when asked, so a test may patch the table)."""

    def __getattr__(self, name: str):
        try:
            return SETTINGS[name].default
        except KeyError:
            raise AttributeError(f"no setting {name!r} in the table of defaults") from None


DEFAULTS = _Defaults()


def check(key: str, value):
    """``value`` when ``SETTINGS[key]`` allows it; else MarsError naming the setting (``field=key``)."""
    s = SETTINGS[key]
    why = s.rule(value)
    if why is None:
        return value
    label = s.label(key)
    raise MarsError(f"{label} {why}", field=key, subject=label)
