"""The summary of a run and its output: tables, JSON and the plot.

:func:`summarize` turns per-prompt samples into the rows (the metrics are
defined in the package docstring); the rows are what ``--json`` writes and
``benchmarks/report.py`` reads.  The plot needs matplotlib (the ``bench``
extra), imported on first use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..core.errors import MarsError
from .config import PEER_SPEC, BenchResult, RunConfig, Sample
from ..core.tokens import common_prefix_len
from .prompts import BenchPrompt

PLOT_HINT = "install mars-local[bench] for --plot"


def _tau(accepted, rounds, n_gen):
    """τ as SpecStats defines it (1 + accepted drafts per round); a peer tool that
    reports no accepted count: generated tokens per round."""
    if accepted is not None and rounds:
        return 1.0 + accepted / rounds
    return _ratio(n_gen, rounds)


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def _aggregate(idx: Sequence[int], smp: Sequence[Sample], plain: Sequence[Sample], prompts) -> dict:
    sel = [smp[i] for i in idx]
    n_gen = sum(x.n_generated for x in sel)
    t_dec = sum(x.time_decode_s for x in sel)
    tps = n_gen / t_dec if t_dec > 0 else 0.0

    def total(attr):
        vals = [getattr(x, attr) for x in sel]
        return None if any(v is None for v in vals) else sum(vals)

    drafted, accepted, relaxed, rounds = total("n_drafted"), total("n_accepted"), total("n_relaxed"), total("n_rounds")
    agree = None
    if all(smp[i].tokens is not None and plain[i].tokens is not None for i in idx):
        num = sum(common_prefix_len(smp[i].tokens, plain[i].tokens) for i in idx)
        den = sum(max(len(smp[i].tokens), len(plain[i].tokens)) for i in idx)
        agree = num / den if den else 1.0
    scored = [i for i in idx if prompts[i].scored]
    score = score_plain = None
    if scored and all(smp[i].score is not None for i in scored):
        score = sum(smp[i].score for i in scored) / len(scored)
        score_plain = sum(plain[i].score for i in scored) / len(scored)
    nll = nll_plain = None
    if all(smp[i].nll_sum is not None and plain[i].nll_sum is not None for i in idx):
        n_m = sum(len(smp[i].tokens) for i in idx)
        n_p = sum(len(plain[i].tokens) for i in idx)
        nll = sum(smp[i].nll_sum for i in idx) / n_m if n_m else None
        nll_plain = sum(plain[i].nll_sum for i in idx) / n_p if n_p else None
    return {
        "tokens_per_second": tps,
        "acceptance_rate": _ratio(accepted, drafted) if drafted else None,
        "mean_accepted_length": _tau(accepted, rounds, n_gen),
        "relaxed_share": (relaxed / accepted if accepted else 0.0) if relaxed is not None and drafted else None,
        "token_agreement": agree,
        "task_score": score,
        "quality_recovery": _ratio(score, score_plain) if score_plain else None,
        "nll_ratio": _ratio(nll, nll_plain) if nll_plain else None,
        "n_prompts": len(sel),
        "n_generated": n_gen,
        "time_decode_s": t_dec,
        "time_target_s": total("time_target_s"),
        "time_draft_s": total("time_draft_s"),
        "time_verify_s": total("time_verify_s"),
        "prefill_tokens_per_second": _prefill_rate(sel),
    }


def _prefill_rate(sel: Sequence[Sample]) -> float | None:
    """The target's prompt processing speed over the samples that evaluated a whole
    prompt (8+ tokens; prefix reuse leaves some with little to evaluate)."""
    full = [x for x in sel if x.n_prefill is not None and x.n_prefill >= 8 and x.time_prefill_s]
    t = sum(x.time_prefill_s for x in full)
    return sum(x.n_prefill for x in full) / t if full and t > 0 else None


def summarize(prompts: Sequence[BenchPrompt], runs: Sequence[RunConfig], samples: dict,
              rounds: dict | None = None) -> list[dict]:
    """One row per (configuration, category) plus one per configuration with category "all".

    ``samples[run][i]`` is the :class:`Sample` of ``run`` on ``prompts[i]`` (the fastest of
    its repeats); ``runs[0]`` must be plain decoding (the reference for speedup, agreement,
    quality recovery and NLL ratio).  ``rounds[run][j][i]``: every repeat's sample (repeat j
    ran every configuration on prompt i interleaved, in a rotated order): the "all" rows then
    get the rate of each round and, against llama.cpp's best speculative row of the same
    round, the ratio per round (:func:`_spread`).
    """
    if not runs or runs[0].method != "plain":
        raise ValueError("the first run must be plain decoding")
    plain = samples[runs[0]]
    cats = list(dict.fromkeys(p.category for p in prompts))
    groups = [(c, [i for i, p in enumerate(prompts) if p.category == c]) for c in cats]
    groups.append(("all", list(range(len(prompts)))))
    base = {c: _aggregate(idx, plain, plain, prompts)["tokens_per_second"] for c, idx in groups}
    rows = []
    for r in runs:
        for c, idx in groups:
            agg = _aggregate(idx, samples[r], plain, prompts)
            row = {
                "category": c,
                "method": r.method,
                "drafter": r.drafter,
                "theta": r.theta,
                "k": r.k,
                **({"grammar": r.grammar} if r.grammar else {}),  # --format-json rows only
                "tokens_per_second": agg.pop("tokens_per_second"),
            }
            row["speedup_vs_plain"] = _ratio(row["tokens_per_second"], base[c])
            row.update(agg)
            rows.append(row)
    # Adaptive rows: tokens/s relative to the best fixed k in hindsight (plain = k 0 included),
    # among the rows under the same grammar (a +json row: plain +json).
    for row in rows:
        row["vs_best_fixed"] = None
        if row["k"] == "adaptive":
            fixed = [o["tokens_per_second"] for o in rows if o["category"] == row["category"]
                     and o.get("grammar") == row.get("grammar") and (
                o["method"] == "plain" or (o["method"] == row["method"] and o["drafter"] == row["drafter"]
                                           and o["theta"] == row["theta"] and isinstance(o["k"], int)))]
            row["vs_best_fixed"] = _ratio(row["tokens_per_second"], max(fixed))
    # Every row relative to llama.cpp's best speculative row (over its draft lengths) of the category.
    for row in rows:
        spec = [o["tokens_per_second"] for o in rows if o["category"] == row["category"] and o["method"] == PEER_SPEC]
        row["vs_llama_spec"] = _ratio(row["tokens_per_second"], max(spec)) if spec else None
    if rounds:
        _spread([r for r in rows if r["category"] == "all"], runs, rounds)
    return rows


def _round_rate(smp: Sequence[Sample]) -> float:
    t = sum(x.time_decode_s for x in smp)
    return sum(x.n_generated for x in smp) / t if t > 0 else 0.0


def _spread(rows: list[dict], runs: Sequence[RunConfig], rounds: dict) -> None:
    """Per round j (every configuration on every prompt, interleaved), each configuration's rate
    and its ratio to llama.cpp's best speculative rate of that round; their median and range.  A
    ratio whose rounds fall on both sides of 1.0 is not separable from llama.cpp at this noise
    (``vs_llama_spec_separable`` False): a single figure there would be luck."""
    rates = {r: [_round_rate(js) for js in rounds[r]] for r in runs}
    n = len(next(iter(rates.values())))
    spec = [r for r in runs if r.method == PEER_SPEC]
    best = [max(rates[r][j] for r in spec) for j in range(n)] if spec else None
    for row, r in zip(rows, runs):
        row["tokens_per_second_rounds"] = rates[r]
        row["tokens_per_second_median"] = float(np.median(rates[r]))
        if best is not None:
            ratios = [rates[r][j] / best[j] if best[j] > 0 else 0.0 for j in range(n)]
            row["vs_llama_spec_rounds"] = ratios
            row["vs_llama_spec_median"] = float(np.median(ratios))
            row["vs_llama_spec_separable"] = min(ratios) > 1.0 or max(ratios) < 1.0


# ==================================================================== output
def _fmt(v, spec: str, none: str = "–") -> str:
    return none if v is None else format(v, spec)


def row_label(row: dict) -> str:
    return RunConfig(row["method"], row["drafter"], row["theta"], row["k"], row.get("grammar")).label


def rows_by_configuration(rows: Sequence[dict]) -> dict[str, dict[str, dict]]:
    """{configuration label: {category: row}}, in the order of ``rows``."""
    by: dict[str, dict[str, dict]] = {}
    for r in rows:
        by.setdefault(row_label(r), {})[r["category"]] = r
    return by


def time_split(r: dict) -> str:
    """'target/draft/verify/other' shares of a row's decode time (other: the loop itself)."""
    d = r.get("time_decode_s") or 0.0
    if r.get("time_target_s") is None or d <= 0:
        return "–"
    parts = [r["time_target_s"], r["time_draft_s"], r["time_verify_s"]]
    parts.append(max(d - sum(parts), 0.0))
    return "/".join(f"{x / d:.0%}" for x in parts)


def _vs_llama(r: dict) -> str:
    """The ratio to llama.cpp's best speculative row: with rounds, their median and range, marked
    "~" where the rounds fall on both sides of 1.0 (not separable at this noise)."""
    rounds = r.get("vs_llama_spec_rounds")
    if not rounds:
        return _fmt(r.get("vs_llama_spec"), ".2f")
    mark = "" if r["vs_llama_spec_separable"] else " ~"
    return f"{r['vs_llama_spec_median']:.2f} ({min(rounds):.2f}–{max(rounds):.2f}){mark}"


def render_tables(result_or_rows, title: str = ""):
    """Rich renderables: the overall table and a per-category speedup/quality table."""
    from rich.table import Table

    rows = result_or_rows.rows if isinstance(result_or_rows, BenchResult) else result_or_rows
    overall = [r for r in rows if r["category"] == "all"]
    t = Table(title=title or "mars bench (all prompts)", title_justify="left", header_style="bold")
    for col, just in [
        ("method", "left"), ("drafter", "left"), ("θ", "right"), ("k", "right"), ("tok/s", "right"),
        ("speedup", "right"), ("accept", "right"), ("τ", "right"), ("relaxed", "right"), ("agree", "right"),
        ("quality", "right"), ("NLL ratio", "right"), ("vs best k", "right"), ("vs llama.cpp spec", "right"),
        ("target/draft/verify/other", "right"), ("prefill tok/s", "right"),
    ]:
        t.add_column(col, justify=just, no_wrap=True)
    for r in overall:
        split = time_split(r)
        t.add_row(
            r["method"] + (f" +{r['grammar']}" if r.get("grammar") else ""), r["drafter"], _fmt(r["theta"], "g"),
            str(r["k"]), f"{r['tokens_per_second']:.1f}",
            _fmt(r["speedup_vs_plain"], ".2f") + ("×" if r["speedup_vs_plain"] is not None else ""),
            _fmt(r["acceptance_rate"], ".0%"), _fmt(r["mean_accepted_length"], ".2f"), _fmt(r["relaxed_share"], ".0%"),
            _fmt(r["token_agreement"], ".0%"), _fmt(r["quality_recovery"], ".3f"), _fmt(r["nll_ratio"], ".3f"),
            _fmt(r.get("vs_best_fixed"), ".2f"), _vs_llama(r), split,
            _fmt(r.get("prefill_tokens_per_second"), ".1f"),
        )
    cats = [c for c in dict.fromkeys(r["category"] for r in rows) if c != "all"]
    per = Table(title="speedup × / quality recovery, per category", title_justify="left", header_style="bold")
    per.add_column("configuration", no_wrap=True)
    for c in cats:
        per.add_column(c, justify="right", no_wrap=True)
    for label, cells in rows_by_configuration(rows).items():
        vals = []
        for c in cats:
            r = cells.get(c)
            if r is None:
                vals.append("")
                continue
            sp = _fmt(r["speedup_vs_plain"], ".2f")
            q = r["quality_recovery"]
            vals.append(sp if q is None else f"{sp} / {q:.2f}")
        per.add_row(label, *vals)
    return [t, per]


def check_writable(path: str | os.PathLike, flag: str) -> None:
    """A one-line MarsError now when ``path`` could not be written at the end of a run
    (a directory, a missing or read-only folder, a read-only file); creates nothing."""
    p = Path(path)
    try:
        if p.is_dir():
            raise MarsError(f"{flag} {p}: is a directory; give a file name")
        if not p.parent.is_dir():
            raise MarsError(f"{flag} {p}: no such directory {p.parent}")
        if p.exists() and not os.access(p, os.W_OK):
            raise MarsError(f"{flag} {p}: the file is not writable")
        if not p.exists() and not os.access(p.parent, os.W_OK | os.X_OK):
            raise MarsError(f"{flag} {p}: cannot create a file in {p.parent}")
    except OSError as exc:  # e.g. a name too long for the file system
        raise MarsError(f"{flag} {p}: {exc.strerror or exc}") from None


def write_json(result: BenchResult, path: str | os.PathLike) -> None:
    p = Path(path)
    try:
        p.write_text(json.dumps(result.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as exc:
        raise MarsError(f"cannot write {p}: {exc.strerror or exc}") from None


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError:
        raise MarsError(f"the plot needs matplotlib; {PLOT_HINT}") from None
    return FigureCanvasAgg, Figure, Line2D


def check_plot() -> None:
    """Load matplotlib now: a MarsError says what to install before the run, not after it."""
    _matplotlib()


_COLORS = {"ngram": ("#1f77b4", "#6baed6"), "model": ("#2ca02c", "#74c476")}


def write_plot(result: BenchResult, path: str | os.PathLike) -> None:
    """Speedup and quality vs θ, one line per drafter and k mode (PNG).

    Strict verification is MARS's limit θ → 1 (no position is ever undecided),
    so each line ends at θ = 1 with the strict run.  Plain is the line at 1;
    peers are dashed horizontal lines.
    """
    FigureCanvasAgg, Figure, Line2D = _matplotlib()
    rows = [r for r in result.rows if r["category"] == "all" and not r.get("grammar")]  # +json rows: the tables only
    s = result.settings
    has_quality = any(r["quality_recovery"] is not None for r in rows if r["method"] == "mars")
    panels = [("speedup_vs_plain", "Speedup vs plain decoding", "speedup (×, higher is faster)")]
    panels.append(("quality_recovery", "Quality recovery (task metric ÷ plain)", "quality recovery (1 = plain's)")
                  if has_quality else ("token_agreement", "Agreement with plain output", "token agreement"))
    panels.append(("nll_ratio", "Target NLL per token ÷ plain", "NLL ratio (1 = as likely as plain)"))
    fig = Figure(figsize=(15, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels))
    thetas = sorted({r["theta"] for r in rows if r["theta"] is not None})
    legend: dict = {}
    for ax, (key, title, ylabel) in zip(axes, panels):
        ax.axhline(1.0, color="#555555", lw=1.2, zorder=1)
        if key == "speedup_vs_plain":  # slower than plain: a faint red band
            ax.axhspan(0, 1.0, color="#d62728", alpha=0.05, zorder=0)
        _plot_drafter_lines(ax, key, rows, s, legend)
        _plot_peer_lines(ax, key, rows, legend)
        _style_panel(ax, title, ylabel, thetas)
    legend["plain decoding (= 1)"] = Line2D([], [], color="#555555", lw=1.2)
    fig.legend(list(legend.values()), list(legend.keys()), loc="lower center", ncol=min(len(legend), 4),
               frameon=False, fontsize=9)
    model = s.label or Path(s.target).name
    sampling = "greedy" if s.temperature == 0 else f"T = {s.temperature:g}, seed {s.seed}"
    fig.suptitle(f"mars bench — {model}: {len(result.prompts)} prompts, {s.max_tokens} tokens each, {sampling}",
                 fontsize=12)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    try:
        fig.savefig(str(path), format="png")
    except OSError as exc:
        raise MarsError(f"cannot write {path}: {exc.strerror or exc}") from None


def _plot_drafter_lines(ax, key: str, rows: list[dict], s, legend: dict) -> None:
    """One line per drafter and k mode (fixed, adaptive): MARS at each θ, then strict at θ = 1."""
    annotate = len(s.drafters) == 1  # with more lines the labels would collide
    fixed_k = s.draft_max if s.draft_max in s.ks() else max(s.ks())  # the fixed line drawn
    for d in s.drafters:
        for mode in ("fixed", "adaptive"):
            want_k = "adaptive" if mode == "adaptive" else fixed_k
            pts = sorted(
                (r["theta"], r[key]) for r in rows
                if r["method"] == "mars" and r["drafter"] == d and r["k"] == want_k and r[key] is not None
            )
            strict = [r[key] for r in rows
                      if r["method"] == "strict" and r["drafter"] == d and r["k"] == want_k and r[key] is not None]
            if not pts and not strict:
                continue
            xs = [p[0] for p in pts] + ([1.0] if strict else [])
            ys = [p[1] for p in pts] + strict[:1]
            color = _COLORS.get(d, ("#9467bd", "#c5b0d5"))[0 if mode == "fixed" else 1]
            marker = "o" if mode == "fixed" else "s"
            label = f"{d} drafter, " + (f"k = {fixed_k} fixed" if mode == "fixed" else f"adaptive k (≤ {s.draft_max})")
            (ln,) = ax.plot(xs, ys, marker=marker, color=color, lw=3.4 if mode == "fixed" else 2.0,
                            ms=8 if mode == "fixed" else 6, zorder=3 if mode == "fixed" else 4,
                            ls="-" if mode == "fixed" else "--")
            legend.setdefault(label, ln)
            if key == "speedup_vs_plain" and annotate:
                for x, y in zip(xs, ys):
                    ax.annotate(f"{y:.2f}×", (x, y), textcoords="offset points",
                                xytext=(0, 9) if mode == "fixed" else (0, -15),
                                ha="center", fontsize=8.5, color=color, fontweight="bold")


_PEER_STYLES = [":", "-.", (0, (5, 2)), (0, (1, 1))]


def _plot_peer_lines(ax, key: str, rows: list[dict], legend: dict) -> None:
    """A horizontal line per peer tool."""
    peers_here = [r for r in rows if r["method"] not in ("plain", "strict", "mars") and r[key] is not None]
    for j, r in enumerate(peers_here):
        label = r["method"] + (f" ({r['drafter']})" if r["method"] == PEER_SPEC else "")
        ln = ax.axhline(r[key], color="#d62728" if j == 0 else "#ff7f0e", ls=_PEER_STYLES[j % 4], lw=1.6, zorder=2)
        legend.setdefault(label, ln)


def _style_panel(ax, title: str, ylabel: str, thetas: list[float]) -> None:
    """Titles, the θ axis (ending at "strict"), a grid, and y limits around every line drawn."""
    xs_all = thetas + [1.0]
    ax.set_title(title, fontsize=11, fontweight="bold")
    ax.set_xlabel("MARS θ (1.0 = strict)")
    ax.set_ylabel(ylabel)
    ax.set_xticks(xs_all)
    ax.set_xticklabels([f"{x:g}" for x in thetas] + ["strict"])
    if xs_all:
        pad = max((xs_all[-1] - xs_all[0]) * 0.08, 0.01)
        ax.set_xlim(xs_all[0] - pad, xs_all[-1] + pad)
    ax.grid(True, alpha=0.3)
    vals = [ln.get_ydata() for ln in ax.get_lines()]
    ys_all = [float(v) for arr in vals for v in np.atleast_1d(arr)]
    lo, hi = (min(ys_all), max(ys_all)) if ys_all else (0.9, 1.1)
    span = max(hi - lo, 0.1)
    ax.set_ylim(lo - 0.12 * span, hi + 0.15 * span)
