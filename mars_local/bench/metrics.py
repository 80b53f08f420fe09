"""Task metrics: each scores a method's output against a prompt's reference, in [0, 1].

``exact`` and ``exact_contains`` are plain Python.  ROUGE-L (``rouge-score``) and
chrF (``sacrebleu``) come with the ``bench`` extra and are imported on first
use; without them a scorer raises a one-line :class:`MarsError` that says what
to install, and a benchmark times those prompts but leaves them unscored
(:func:`unavailable_metrics`).
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

from ..core.errors import MarsError

METRICS = ("exact", "exact_contains", "rougeL", "chrf")
BENCH_EXTRA_HINT = "install mars-local[bench] for ROUGE-L/chrF"


_NUMBER = re.compile(r"[-−]?\d[\d,]*(?:\.\d+)?")


def _number(s: str) -> float | None:
    m = _NUMBER.search(s)
    if not m:
        return None
    try:
        return float(m.group().replace(",", "").replace("−", "-"))
    except ValueError:
        return None


def extract_answer(text: str) -> float | None:
    """The number after the last "Answer:" (case-insensitive), or None."""
    idx = text.lower().rfind("answer:")
    if idx < 0:
        return None
    return _number(text[idx + len("answer:") :])


def score_exact(output: str, reference: str) -> float:
    """1.0 when the number after the last "Answer:" equals the reference number."""
    got, want = extract_answer(output), _number(reference)
    return float(got is not None and want is not None and math.isclose(got, want, rel_tol=0, abs_tol=1e-9))


def score_contains(output: str, reference: str) -> float:
    """1.0 when the reference appears in the output, ignoring case."""
    return float(reference.strip().casefold() in output.casefold())


@lru_cache(maxsize=None)
def _rouge():
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        raise MarsError(f"the rougeL metric needs rouge-score; {BENCH_EXTRA_HINT}") from None
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def score_rouge_l(output: str, reference: str) -> float:
    """ROUGE-L F1 (rouge-score, Porter stemmer), in [0, 1]."""
    return float(_rouge().score(reference, output)["rougeL"].fmeasure)


@lru_cache(maxsize=None)
def _chrf():
    try:
        from sacrebleu.metrics import CHRF
    except ImportError:
        raise MarsError(f"the chrf metric needs sacrebleu; {BENCH_EXTRA_HINT}") from None
    return CHRF()


def score_chrf(output: str, reference: str) -> float:
    """Sentence chrF (sacrebleu's defaults: character 6-grams, β = 2) / 100, in [0, 1]."""
    return float(_chrf().sentence_score(output.strip(), [reference]).score) / 100.0


_SCORERS = {"exact": score_exact, "exact_contains": score_contains, "rougeL": score_rouge_l, "chrf": score_chrf}


def task_score(metric: str | None, output: str, reference: str | None) -> float | None:
    """A prompt's task metric in [0, 1], or None when it has none."""
    if metric is None or reference is None:
        return None
    try:
        fn = _SCORERS[metric]
    except KeyError:
        raise MarsError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}") from None
    return fn(output, reference)


def unavailable_metrics(metrics) -> dict[str, str]:
    """Those of ``metrics`` whose library is missing, each with its one-line hint.

    Loads the libraries now, so a benchmark knows before any model is loaded.
    """
    loaders = {"rougeL": _rouge, "chrf": _chrf}
    missing = {}
    for m in dict.fromkeys(metrics):
        if m in loaders:
            try:
                loaders[m]()
            except MarsError as exc:
                missing[m] = str(exc)
    return missing


def unscored_note(missing: dict[str, str]) -> str | None:
    """The warning a benchmark prints when some prompts cannot be scored."""
    if not missing:
        return None
    return f"{', '.join(missing)} prompts are timed but not scored: {BENCH_EXTRA_HINT}"



