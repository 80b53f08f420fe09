"""Statistics of one generation (one dataclass, as vLLM's spec-decode metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters and timings of a generation.

    n_generated          tokens produced (accepted drafts + target tokens); the
                         first comes from the prompt's own forward, in no round:
                         its last token rides in its last chunk
                         (llama.context.last_rides) or, where it cannot (the
                         prompt all cached, or a last chunk too wide), is
                         evaluated alone (a lone Engine; a Scheduler's sequence
                         takes it in its first round instead).
    n_prompt             prompt tokens; n_prompt_evaluated of them were run
                         through the target (the rest came from its KV cache).
    n_rounds             target forwards in the decode loop (one per verify
                         window; plain decoding is one per token, but for the
                         first when first_from_prompt).
    first_from_prompt    the first token was sampled from the prompt's own
                         forward (no round, no wait for a draft): see n_generated.
    n_drafted            draft tokens proposed and verified.
    n_accepted           draft tokens accepted, relaxed ones included.
    n_relaxed            draft tokens accepted only because of MARS.
    acceptance_rate      n_accepted / n_drafted (0 when nothing was drafted).
    mean_accepted_length 1 + n_accepted / n_rounds: the tokens each target
                         forward commits (its accepted drafts plus the
                         bonus/correction token), τ; 1.0 for plain decoding,
                         never below 1 (0.0 only when no round ran).  Not
                         n_generated / n_rounds: a round whose token is an
                         end of generation or completes a stop string
                         commits a token that is not shown.
    per_position_drafted / per_position_accepted
                         counts per draft position 0..k-1; their ratio is the
                         per-position acceptance.
    k_per_round          the draft length used in each round (chosen per round
                         when adaptive is on).
    time_target_s        target forwards (verify windows; prompt excluded).
    time_prompt_s        prompt evaluation (target and draft).
    time_prompt_target_s the target's share of it (compare with llama.cpp's
                         "prompt eval time").
    time_calibrate_s     timing the target's verify windows once, when the
                         adaptive controller had no measured costs yet (then
                         kept in the learned-state cache; usually 0).
    time_draft_s         drafting (draft-model forwards or n-gram lookups).
    time_verify_s        the verification rule itself.
    time_total_s         wall time of the whole generation.
    time_decode_s        time_total_s - time_prompt_s - time_calibrate_s.
    tokens_per_second    n_generated / time_decode_s.
    verify_share         time_verify_s / time_decode_s.
    stop_reason          "eog", "stop" (a stop string), "length" (max tokens), "context" (full), "interrupted" (the stream
                         was closed early, or Ctrl-C) or "error" (an exception ended it).
    """

    n_generated: int = 0
    n_prompt: int = 0
    n_prompt_evaluated: int = 0
    n_rounds: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    n_relaxed: int = 0
    per_position_drafted: list[int] = field(default_factory=list)
    per_position_accepted: list[int] = field(default_factory=list)
    k_per_round: list[int] = field(default_factory=list)
    time_target_s: float = 0.0
    time_prompt_s: float = 0.0
    time_prompt_target_s: float = 0.0
    time_calibrate_s: float = 0.0
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    time_total_s: float = 0.0
    stop_reason: str = ""
    verify_backend: str = "numpy"
    adaptive: bool = False
    first_from_prompt: bool = False

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.n_accepted / self.n_rounds if self.n_rounds else 0.0

    @property
    def relaxed_share(self) -> float:
        """Share of accepted drafts that needed MARS."""
        return self.n_relaxed / self.n_accepted if self.n_accepted else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.per_position_accepted, self.per_position_drafted)]

    @property
    def time_decode_s(self) -> float:
        return max(self.time_total_s - self.time_prompt_s - self.time_calibrate_s, 0.0)

    @property
    def verify_share(self) -> float:
        """Share of the decode wall time spent in the verification rule."""
        t = self.time_decode_s
        return self.time_verify_s / t if t > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        t = self.time_decode_s
        return self.n_generated / t if t > 0 else 0.0

    def record_first(self, n_new: int) -> None:
        """The token sampled from the prompt's last row: produced, but by no round."""
        self.n_generated += n_new
        self.first_from_prompt = True

    def record_round(self, k: int, n_accepted: int, n_relaxed: int, n_new: int) -> None:
        self.n_rounds += 1
        self.n_drafted += k
        self.n_accepted += n_accepted
        self.n_relaxed += n_relaxed
        self.n_generated += n_new
        self.k_per_round.append(k)
        grow = k - len(self.per_position_drafted)
        if grow > 0:
            self.per_position_drafted.extend([0] * grow)
            self.per_position_accepted.extend([0] * grow)
        for i in range(k):
            self.per_position_drafted[i] += 1
        for i in range(n_accepted):
            self.per_position_accepted[i] += 1

    def to_dict(self) -> dict:
        return {
            "n_generated": self.n_generated,
            "n_prompt": self.n_prompt,
            "n_prompt_evaluated": self.n_prompt_evaluated,
            "n_rounds": self.n_rounds,
            "n_drafted": self.n_drafted,
            "n_accepted": self.n_accepted,
            "n_relaxed": self.n_relaxed,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "relaxed_share": self.relaxed_share,
            "per_position_acceptance": self.per_position_acceptance,
            "per_position_drafted": list(self.per_position_drafted),
            "per_position_accepted": list(self.per_position_accepted),
            "k_per_round": list(self.k_per_round),
            "time_target_s": self.time_target_s,
            "time_prompt_s": self.time_prompt_s,
            "time_prompt_target_s": self.time_prompt_target_s,
            "time_calibrate_s": self.time_calibrate_s,
            "time_decode_s": self.time_decode_s,
            "time_draft_s": self.time_draft_s,
            "time_verify_s": self.time_verify_s,
            "time_total_s": self.time_total_s,
            "tokens_per_second": self.tokens_per_second,
            "verify_share": self.verify_share,
            "stop_reason": self.stop_reason,
            "verify_backend": self.verify_backend,
            "adaptive": self.adaptive,
            "first_from_prompt": self.first_from_prompt,
        }
