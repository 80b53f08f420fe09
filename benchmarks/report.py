"""Markdown tables from a `mars bench --json` file (the tables in BENCHMARKS.md).

    .venv/bin/python benchmarks/report.py benchmarks/results/bench-smollm2-t0.json

Prints the overall ("all") rows and a per-category table of speedup vs plain
(with quality recovery where the category has a metric), and, when the run
swept fixed draft lengths, adaptive vs the best fixed k in hindsight.
"""

from __future__ import annotations

import argparse
import json
import sys

from mars_local.bench import row_label, rows_by_configuration, time_split


def fmt(v, spec: str, suffix: str = "") -> str:
    return "–" if v is None else format(v, spec) + suffix


def table(cols: list[str], runs: list[dict], cells) -> list[str]:
    """A markdown table of the overall ("all") rows; ``cells(row)`` gives a row's cells."""
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(cells(r)) + " |" for r in runs if r["category"] == "all"]
    return out


def overall(runs: list[dict]) -> list[str]:
    cols = ["configuration", "tok/s", "speedup", "acceptance", "τ", "relaxed", "agreement", "quality recovery",
            "NLL ratio", "vs best fixed k"]
    return table(cols, runs, lambda r: [
        row_label(r), f"{r['tokens_per_second']:.1f}", fmt(r["speedup_vs_plain"], ".2f", "×"),
        fmt(r["acceptance_rate"], ".0%"), fmt(r["mean_accepted_length"], ".2f"), fmt(r["relaxed_share"], ".0%"),
        fmt(r["token_agreement"], ".0%"), fmt(r["quality_recovery"], ".3f"), fmt(r["nll_ratio"], ".3f"),
        fmt(r.get("vs_best_fixed"), ".2f", "×"),
    ])


def head_to_head(runs: list[dict]) -> list[str]:
    """Every configuration against llama.cpp's best speculative row, with the time split and prefill."""
    cols = ["configuration", "tok/s", "vs llama.cpp spec (best k)", "vs plain", "acceptance", "τ",
            "target/draft/verify/other", "prefill tok/s"]
    return table(cols, runs, lambda r: [
        row_label(r), f"{r['tokens_per_second']:.2f}", fmt(r.get("vs_llama_spec"), ".2f", "×"),
        fmt(r["speedup_vs_plain"], ".2f", "×"), fmt(r["acceptance_rate"], ".0%"),
        fmt(r["mean_accepted_length"], ".2f"), time_split(r), fmt(r.get("prefill_tokens_per_second"), ".1f"),
    ])


def per_category(runs: list[dict], key: str = "speedup_vs_plain", with_quality: bool = True) -> list[str]:
    cats = [c for c in dict.fromkeys(r["category"] for r in runs) if c != "all"] + ["all"]
    out = ["| configuration | " + " | ".join(cats) + " |", "|---|" + "---|" * len(cats)]
    for name, cells in rows_by_configuration(runs).items():
        vals = []
        for c in cats:
            r = cells.get(c)
            v = None if r is None else r.get(key)
            cell = fmt(v, ".2f")
            if with_quality and r is not None and r.get("quality_recovery") is not None and c != "all":
                cell += f" / {r['quality_recovery']:.2f}"
            vals.append(cell)
        if key != "vs_best_fixed" or any(v != "–" for v in vals):
            out.append(f"| {name} | " + " | ".join(vals) + " |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json_file")
    args = ap.parse_args(argv)
    try:
        with open(args.json_file, encoding="utf-8") as f:
            data = json.load(f)
        runs, meta = data["runs"], data.get("meta", {})
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: cannot read {args.json_file}: {exc}", file=sys.stderr)
        return 2
    print(f"{meta.get('model', '?')}: {meta.get('n_prompts', '?')} prompts × {meta.get('max_tokens', '?')} tokens, "
          f"T={meta.get('temperature', 0)}, repeats {meta.get('repeats', 1)}, {meta.get('wall_s', '?')} s\n")
    if any(r.get("vs_llama_spec") is not None for r in runs):
        print("\n".join(head_to_head(runs)))
        print("\nTokens/s ÷ llama.cpp's best speculative row, per category:\n")
        print("\n".join(per_category(runs, "vs_llama_spec", with_quality=False)))
        print()
    print("\n".join(overall(runs)))
    print("\nSpeedup vs plain per category (/ quality recovery where the category has a metric):\n")
    print("\n".join(per_category(runs)))
    if any(r.get("vs_best_fixed") is not None for r in runs):
        print("\nAdaptive tokens/s ÷ best fixed k in hindsight (plain = k 0 included), per category:\n")
        print("\n".join(per_category(runs, "vs_best_fixed", with_quality=False)))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # piped into head
        sys.exit(0)
