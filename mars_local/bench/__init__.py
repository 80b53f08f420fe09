"""`mars bench`: speed and quality of plain, strict and MARS decoding on one prompt set.

Every configuration runs on the same prompts, the same models and the same
sampling settings:

* ``plain``   -- no speculation (the same decode loop with k = 0): the baseline.
* ``strict``  -- lossless speculative decoding, with a fixed draft length k
  (``draft_max``) and with the adaptive draft length.
* ``mars``    -- MARS verification at each θ, fixed and adaptive k.
* peers       -- llama-cpp-python's ``LlamaPromptLookupDecoding`` and, when a
  directory of llama.cpp binaries is given, ``llama-speculative-simple`` and
  ``llama-completion`` (run as subprocesses; their printed stats are parsed).

Runs are interleaved prompt by prompt (every configuration of a prompt runs
before the next prompt, in an order rotated from prompt to prompt), so a slow
spell on a shared machine hits every configuration alike and the target's KV
cache keeps the prompt between configurations.  The target is loaded once per
drafter and once more by the llama-cpp-python peer (``peers=False`` /
``--no-peers`` leaves it out); each runs with llama.cpp's default threads
unless ``n_threads`` is given.  A warm-up generation precedes the timed ones.

Metrics, per category and over all prompts (category ``"all"``):

tokens_per_second     generated tokens / decode seconds, summed over prompts
                      (prompt evaluation excluded, as llama.cpp's "decoded").
speedup_vs_plain      tokens_per_second / plain's tokens_per_second.
acceptance_rate       accepted drafts / drafted tokens (null without drafts).
mean_accepted_length  1 + accepted drafts / target forwards (τ: the tokens each
                      forward commits; 1.0 for plain, never below 1; a peer
                      tool that reports no accepted count: generated tokens /
                      forwards).
relaxed_share         accepted drafts that only MARS accepted / accepted drafts.
time_*_s              decode time spent in target forwards, drafting and the
                      verification rule (their sum is at most time_decode_s).
token_agreement       tokens equal to plain's output before the first
                      divergence, divided by the longer of the two outputs;
                      summed over prompts before dividing (1.0 = identical).
task_score            the prompts' own task metric, mean over the prompts
                      that have one, each in [0, 1]: ROUGE-L F1
                      (``rouge-score``, stemmed) for summarization, chrF/100
                      (``sacrebleu``) for translation, 1/0 for math (the number
                      after the last "Answer:" equals the reference) and for
                      rag (the reference appears in the output, ignoring case).
quality_recovery      task_score of the method / task_score of plain (the
                      paper's "quality recovery"); null when the category has
                      no metric or plain scores 0.  For "all" the sums of the
                      per-prompt scores are divided.
nll_ratio             mean negative log-likelihood per generated token of the
                      method's outputs / that of plain's outputs, both scored
                      by the target itself at T = 1 (> 1: the method wrote
                      text the target finds less likely).

A peer reports what it can: llama-cpp-python gives text and tokens but no
acceptance counts; llama.cpp's binaries give speed and acceptance but their
text is not parsed, so agreement, quality and NLL are null for them.


Modules: ``prompts`` (the prompt-file schema and the built-in set, package
data), ``metrics`` (task metrics), ``scoring`` (the target's NLL), ``config``
(settings, the plan of configurations, samples and the result), ``peers``
(llama-cpp-python and llama.cpp's binaries), ``runner`` (:func:`run_bench`),
``report`` (the summary rows, tables, JSON and the plot).  ROUGE-L, chrF and
the plot need the ``bench`` extra (``pip install mars-local[bench]``).  May import
anything of mars_local but :mod:`mars_local.cli`.
"""

from .config import (
    DEFAULT_THETAS,
    PEER_COMPLETION,
    PEER_LCP,
    PEER_SPEC,
    BenchResult,
    BenchSettings,
    RunConfig,
    Sample,
    plan_runs,
)
from .metrics import (
    METRICS,
    unavailable_metrics,
    unscored_note,
    extract_answer,
    score_chrf,
    score_contains,
    score_exact,
    score_rouge_l,
    task_score,
)
from .peers import LlamaCppBinaryPeer, LlamaCppPythonPeer, find_llama_cpp_binaries, parse_llama_cpp_stats
from .prompts import DEFAULT_PROMPTS_DIR, BenchPrompt, load_prompts, quick_subset
from .report import (
    check_plot,
    check_writable,
    render_tables,
    row_label,
    rows_by_configuration,
    summarize,
    time_split,
    write_json,
    write_plot,
)
from .runner import run_bench
from .scoring import TargetScorer

__all__ = [
    "BenchPrompt",
    "BenchSettings",
    "BenchResult",
    "RunConfig",
    "Sample",
    "DEFAULT_PROMPTS_DIR",
    "DEFAULT_THETAS",
    "METRICS",
    "PEER_LCP",
    "PEER_SPEC",
    "PEER_COMPLETION",
    "load_prompts",
    "quick_subset",
    "plan_runs",
    "run_bench",
    "summarize",
    "task_score",
    "extract_answer",
    "score_exact",
    "score_contains",
    "score_rouge_l",
    "score_chrf",
    "unavailable_metrics",
    "unscored_note",
    "TargetScorer",
    "LlamaCppPythonPeer",
    "LlamaCppBinaryPeer",
    "parse_llama_cpp_stats",
    "find_llama_cpp_binaries",
    "render_tables",
    "row_label",
    "rows_by_configuration",
    "time_split",
    "write_json",
    "write_plot",
    "check_plot",
    "check_writable",
]
