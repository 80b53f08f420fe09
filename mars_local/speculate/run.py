"""The state of one generation while the loop runs it (the engine's and the scheduler's)."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

from ..core.config import GenerateConfig
from ..core.stats import SpecStats
from ..core.verify import VerifyConfig
from .adaptive import AdaptiveK
from .drafters import Drafter

__all__ = ["Run"]


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
