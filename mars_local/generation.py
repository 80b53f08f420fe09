"""What one generation takes and gives: its settings, its chunks, its result.

Pure (no llama.cpp): :class:`GenerateConfig` validates on construction;
:class:`Stream` is what :meth:`mars_local.engine.Engine.stream` returns.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from .adaptive import AdaptiveK
from .choices import DRAFT_SAMPLINGS, DraftSampling, VerifyMethod
from .drafters import Drafter
from .errors import MarsError
from .sampling import SamplingParams
from .stats import SpecStats
from .verify import VerifyConfig

__all__ = ["GenerateConfig", "Chunk", "Generation", "Stream", "MAX_DRAFT"]

MAX_DRAFT = 63  # patches/0003: batches of up to 64 rows use the kernels of a 1-row decode


@dataclass(frozen=True)
class GenerateConfig:
    """Everything that shapes one generation (validated on construction)."""

    max_tokens: int = 256
    verify: VerifyMethod = "mars"
    theta: float = VerifyConfig.theta
    draft_max: int = 8
    draft_min: int = 0
    draft_p_min: float = 0.0
    draft_sampling: DraftSampling = "greedy"
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
        if self.draft_sampling not in DRAFT_SAMPLINGS:
            raise MarsError(f"draft sampling must be {' or '.join(DRAFT_SAMPLINGS)}, got {self.draft_sampling!r}")
        self.verify_config()  # validates the verification fields (their one home: VerifyConfig)

    def verify_config(self, eog_ids: tuple[int, ...] = ()) -> VerifyConfig:
        """The verification rule these settings ask for (``eog_ids``: the target's end-of-generation tokens)."""
        return VerifyConfig(self.verify, self.theta, self.require_positive_top1, self.max_relaxed, tuple(eog_ids))

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


class Stream(Iterator[Chunk]):
    """The chunks of one generation (what :meth:`Engine.stream` returns).

    ``stats`` is this generation's :class:`SpecStats`: filled in as the chunks
    come, final once the stream is exhausted or closed (``close()``, a ``with``
    block, or the stream being collected), stop_reason included.
    """

    def __init__(self, chunks: Iterator[Chunk], stats: SpecStats):
        self._chunks = chunks
        self.stats = stats

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def close(self) -> None:
        """Stop the generation here: stop_reason "interrupted" unless it had ended
        (a stream closed before its first chunk never started: its stats stay empty)."""
        self._chunks.close()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class _Run:
    """The state of one generation, shared by the steps of the loop."""

    tokens: list[int]  # every committed token: prompt + generated (tokens[-1] is not in the target's cache)
    cfg: GenerateConfig
    vcfg: VerifyConfig
    seed: int
    drafter: Drafter
    stats: SpecStats
    ctrl: AdaptiveK | None
    generated: int = 0
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
