"""What a bench runs and what it records: the settings, the plan of configurations,
one generation's :class:`Sample` and the :class:`BenchResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..core.choices import BENCH_DRAFTERS, choice, drafter_for
from ..core.defaults import DEFAULTS, check
from ..core.errors import MarsError
from .prompts import BenchPrompt

DEFAULT_THETAS = DEFAULTS.thetas_bench
PEER_LCP = "llama-cpp-python-prompt-lookup"
PEER_SPEC = "llama.cpp-speculative-simple"
PEER_COMPLETION = "llama.cpp-completion"


@dataclass(frozen=True)
class RunConfig:
    """One method configuration: a row of the result per category."""

    method: str  # "plain" | "strict" | "mars" | a peer's name
    drafter: str  # "none" | "ngram" | "model" (peers: the drafter they use)
    theta: float | None = None
    k: int | str = 0  # draft length, or "adaptive"
    grammar: str | None = None  # "json": constrained by the JSON grammar (--format-json rows)

    @property
    def label(self) -> str:
        suffix = f" +{self.grammar}" if self.grammar else ""
        if self.method == "plain":
            return "plain" + suffix
        parts = [self.method]
        if self.method in ("strict", "mars") or self.method == PEER_SPEC:
            parts.append(self.drafter)
        if self.theta is not None:
            parts.append(f"θ={self.theta:g}")
        parts.append(f"k={self.k}")
        return " ".join(parts) + suffix

    @property
    def is_peer(self) -> bool:
        return self.method not in ("plain", "strict", "mars")


@dataclass
class BenchSettings:
    """What to run.  ``drafters`` are our drafters ("ngram", "model", "mtp", "eagle3")."""

    target: Path
    draft: Path | None = None
    drafters: tuple[str, ...] = ("ngram",)
    thetas: tuple[float, ...] = DEFAULT_THETAS
    draft_max: int = DEFAULTS.draft_max
    adaptive_modes: tuple[bool, ...] = (False, True)
    fixed_ks: tuple[int, ...] | None = None  # draft lengths of the fixed runs (default: draft_max)
    repeats: int = 1  # generations per (configuration, prompt); the fastest one is kept
    max_tokens: int = DEFAULTS.max_tokens_bench
    temperature: float = DEFAULTS.temperature
    top_k: int = DEFAULTS.top_k
    top_p: float = DEFAULTS.top_p
    min_p: float = DEFAULTS.min_p
    seed: int = DEFAULTS.seed_bench  # sampling runs compare configurations on the same draws
    n_ctx: int = DEFAULTS.n_ctx
    n_gpu_layers: int | None = None
    n_gpu_layers_draft: int | None = None
    n_threads: int | None = None
    rpc: tuple[str, ...] = ()  # llama.cpp RPC servers for the target's layers
    rpc_draft: bool = False
    tensor_split: tuple[float, ...] | None = None
    ngram_max: int = DEFAULTS.ngram_max
    peers: bool = True
    llama_cpp_bin: Path | None = None
    peer_ks: tuple[int, ...] | None = None  # llama-speculative-simple's draft lengths (default: draft_max)
    warmup: bool = True
    format_json: bool = False  # also plain and one MARS configuration per drafter under the JSON grammar
    label: str = ""
    notes: list[str] = field(default_factory=list)

    def validate(self) -> None:
        """Every setting by its rule (the table's, core.defaults: a MarsError naming the field), then
        what only a benchmark needs."""
        if not self.drafters:
            raise MarsError("no drafter to benchmark")
        for d in self.drafters:
            choice(d, BENCH_DRAFTERS, "drafter")
        if "model" in self.drafters:
            drafter_for("model", self.draft is not None)
        if not self.thetas:
            raise MarsError("give at least one θ")
        for t in self.thetas:
            check("theta", t)
        check("draft_max", self.draft_max)
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
        check("max_tokens_bench", self.max_tokens)
        check("n_threads", self.n_threads)
        check("n_ctx", self.n_ctx)
        self.sampling()  # validates temperature, top-k/p, min-p
        if self.temperature > 0 and self.seed < 0:
            raise MarsError("a sampling benchmark needs a fixed seed (-s N with N >= 0)")

    def ks(self) -> tuple[int, ...]:
        """Draft lengths of the fixed-k runs."""
        return tuple(dict.fromkeys(self.fixed_ks)) if self.fixed_ks is not None else (self.draft_max,)

    def sampling(self):
        from ..core.sampling import SamplingParams

        # Greedy runs pass no seed: the engine fixes k for seeded MARS runs.
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            seed=self.seed if self.temperature > 0 else None,
        )


def json_theta(s: BenchSettings) -> float:
    """The θ of the --format-json rows: the default θ when it is benchmarked, else the first."""
    return float(DEFAULTS.theta if DEFAULTS.theta in s.thetas else s.thetas[0])


def json_k(s: BenchSettings) -> int | str:
    """The draft length of the --format-json rows: adaptive when adaptive MARS runs, else the largest fixed k."""
    if True in s.adaptive_modes and s.temperature == 0:
        return "adaptive"
    return max(s.ks())


def plan_runs(s: BenchSettings) -> list[RunConfig]:
    """Every configuration, plain first.

    With sampling (T > 0) the engine keeps k fixed for seeded MARS runs (their
    output would otherwise depend on timing), so adaptive MARS is left out.
    ``format_json`` adds plain decoding and, per drafter, MARS at one θ and k
    (:func:`json_theta`, :func:`json_k`) constrained by the JSON grammar: the
    grammar's cost beside the same configurations without it.
    """
    runs = [RunConfig("plain", "none", None, 0)]
    if s.format_json:
        runs.append(RunConfig("plain", "none", None, 0, "json"))
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
        if s.format_json:
            runs.append(RunConfig("mars", d, json_theta(s), json_k(s), "json"))
    if s.peers:
        runs.append(RunConfig(PEER_LCP, "ngram", None, s.draft_max))
    if s.llama_cpp_bin is not None:
        for d in s.drafters:
            for k in dict.fromkeys(s.peer_ks or (s.draft_max,)):
                runs.append(RunConfig(PEER_SPEC, d, None, k))
        runs.append(RunConfig(PEER_COMPLETION, "none", None, 0))
    return runs


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
                **({"format_json": True} if s.format_json else {}),
            },
        }
