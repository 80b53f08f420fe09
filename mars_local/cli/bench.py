"""`mars bench`: plain vs strict vs MARS (and peers) on one prompt set.

The work is in :mod:`mars_local.bench`; models are resolved by
:func:`mars_local.models.registry.choose_models`; this module only parses options and
prints.  :mod:`mars_local.cli.main` registers the command.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from . import flags as opt
from ..core.choices import DRAFTERS
from ..core.errors import MarsError
from ..core.config import GenerateConfig
from ..llama.rpc import parse_endpoints, parse_tensor_split
from ..models.registry import bench_drafters, choose_models

BENCH_DRAFTERS = tuple(sorted(set(DRAFTERS) - {"none"}, reverse=True))  # ngram, model (plain always runs)


def _split(value: Optional[str]) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def parse_thetas(value: str) -> tuple[float, ...]:
    """'0.85,0.9,0.95' -> (0.85, 0.9, 0.95); every θ in (0, 1]."""
    out = []
    for part in _split(value):
        try:
            t = float(part)
        except ValueError:
            raise MarsError(f"--thetas: {part!r} is not a number") from None
        try:
            GenerateConfig.make(theta=t)  # the range of θ
        except MarsError as exc:
            raise MarsError(f"--thetas: {exc}") from None
        out.append(t)
    if not out:
        raise MarsError("--thetas needs at least one θ, e.g. 0.85,0.9,0.95")
    return tuple(dict.fromkeys(out))


def parse_ks(value: str, flag: str = "--fixed-k") -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4): draft lengths of the fixed-k runs."""
    out = []
    for part in _split(value):
        try:
            out.append(int(part))
        except ValueError:
            raise MarsError(f"{flag}: {part!r} is not a whole number") from None
    if not out:
        raise MarsError(f"{flag} needs at least one draft length, e.g. 1,2,4")
    return tuple(dict.fromkeys(out))


def bench(
    pair: Optional[str] = typer.Option(None, "--pair", help="A models.yaml entry (see `mars models`)."),
    model: Optional[str] = opt.MODEL,
    model_draft: Optional[str] = opt.MODEL_DRAFT,
    drafter: Optional[str] = typer.Option(
        None, "--drafter", help="Benchmark only this drafter: ngram or model (default: the pair's, plus -md's)."
    ),
    prompts: Optional[List[Path]] = typer.Option(
        None, "--prompts", metavar="FILE.jsonl", help="JSONL prompt file (repeatable); default: the built-in set (mars_local/bench/prompts)."
    ),
    categories: Optional[str] = typer.Option(None, "--categories", help="Comma-separated categories to keep."),
    n_predict: int = typer.Option(64, "-n", "--n-predict", help="Tokens to generate per prompt."),
    thetas: Optional[str] = typer.Option(
        None, "--thetas", "--theta", help="Comma-separated MARS thresholds (default: 0.85,0.9,0.95; --quick: the pair's)."
    ),
    draft_max: Optional[int] = typer.Option(
        None, "--draft-max", "--spec-draft-n-max", "--draft", "--draft-n", "--num-draft-tokens",
        help="Draft length k of fixed runs, the cap of adaptive runs (default: the pair's).",
    ),
    fixed_k: Optional[str] = typer.Option(
        None, "--fixed-k", metavar="K1,K2,...",
        help="Draft lengths of the fixed-k runs (default: --draft-max), e.g. 1,2,4 to find the best fixed k.",
    ),
    repeat: int = typer.Option(1, "--repeat", help="Generations per configuration and prompt; the fastest counts."),
    temp: float = opt.TEMP,
    seed: int = typer.Option(0, "-s", "--seed", help="Seed of sampling runs (--temp > 0)."),
    top_k: int = opt.TOP_K,
    top_p: float = opt.TOP_P,
    min_p: float = opt.MIN_P,
    ctx_size: int = opt.CTX_SIZE,
    ngl: Optional[str] = opt.NGL,
    ngld: Optional[str] = opt.NGLD,
    threads: Optional[int] = opt.THREADS,
    rpc: Optional[str] = opt.RPC,
    rpc_draft: bool = opt.RPC_DRAFT,
    tensor_split: Optional[str] = opt.TENSOR_SPLIT,
    quick: bool = typer.Option(False, "--quick", help="Smoke run: 1 prompt per category, 16 tokens, one θ."),
    per_category: Optional[int] = typer.Option(
        None, "--per-category", metavar="N", help="Use only the first N prompts of each category."
    ),
    peer_k: Optional[str] = typer.Option(
        None, "--peer-k", metavar="K1,K2,...",
        help="Draft lengths of llama.cpp's llama-speculative-simple runs (default: --draft-max); its best is the reference.",
    ),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="Also run llama-cpp-python's prompt-lookup decoding."),
    llama_cpp_bin: Optional[Path] = typer.Option(
        None, "--llama-cpp-bin", help="Folder with llama.cpp's llama-speculative-simple and llama-completion."
    ),
    format_json: bool = typer.Option(
        False, "--format-json",
        help="Also run plain decoding and one MARS configuration per drafter (θ 0.9 or the first θ, adaptive k) "
        "constrained by the JSON grammar (as --format json): the grammar's cost in tokens/s and τ.",
    ),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON to this file."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of speedup and quality vs θ."),
) -> None:
    """Benchmark plain, strict and MARS decoding (speed and quality) on a prompt set."""
    from rich.console import Console

    from .. import bench as B

    theta_list = parse_thetas(thetas) if thetas is not None else None
    cats = _split(categories)
    prompt_list = B.load_prompts(prompts, cats or None)
    if drafter is not None and drafter not in BENCH_DRAFTERS:
        raise MarsError(f"--drafter must be {' or '.join(BENCH_DRAFTERS)}, got {drafter!r}")
    choice = choose_models(model, model_draft, drafter, pair=pair)
    drafters = bench_drafters(choice, drafter)
    label = choice.label if choice.pair is not None else Path(choice.label).name
    recommended = opt.make_config(choice)  # the pair's θ and k, or the defaults
    if per_category is not None:
        if per_category < 1:
            raise MarsError(f"--per-category must be >= 1, got {per_category}")
        prompt_list = B.quick_subset(prompt_list, per_category)
    if quick:
        prompt_list = B.quick_subset(prompt_list, 1)
        n_predict = min(n_predict, 16)
        theta_list = (theta_list or (recommended.theta,))[:1]
    settings = B.BenchSettings(
        target=choice.target, draft=choice.draft, drafters=drafters, thetas=theta_list or B.DEFAULT_THETAS,
        draft_max=draft_max if draft_max is not None else recommended.draft_max, max_tokens=n_predict,
        fixed_ks=parse_ks(fixed_k) if fixed_k is not None else None, repeats=repeat,
        temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, n_ctx=ctx_size,
        n_gpu_layers=opt.gpu_layers(ngl, "-ngl"), n_gpu_layers_draft=opt.gpu_layers(ngld, "-ngld"), n_threads=threads,
        peers=peers, llama_cpp_bin=llama_cpp_bin, label=label,
        peer_ks=parse_ks(peer_k, "--peer-k") if peer_k is not None else None, format_json=format_json,
        rpc=parse_endpoints(rpc) if rpc is not None else (), rpc_draft=rpc_draft,
        tensor_split=parse_tensor_split(tensor_split),
    )
    settings.validate()
    if temp > 0 and seed < 0:
        raise MarsError("a sampling benchmark needs a fixed seed (-s N with N >= 0)")
    if llama_cpp_bin is not None:
        B.find_llama_cpp_binaries(llama_cpp_bin)  # fail before any model is loaded
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        if path is not None:
            B.check_writable(path, flag)  # before the run, not after it
    if plot_path is not None:
        B.check_plot()  # the bench extra, before any model is loaded

    err = Console(stderr=True)
    unscored = B.unscored_note(B.unavailable_metrics(p.metric for p in prompt_list if p.scored))
    if unscored:
        err.print(f"warning: {unscored}", highlight=False, markup=False, soft_wrap=True)
    n_runs = len(B.plan_runs(settings))
    err.print(
        f"mars bench: {label}, drafters {', '.join(drafters)}, {len(prompt_list)} prompts × {n_runs} configurations, "
        f"{n_predict} tokens, {'greedy' if temp == 0 else f'T={temp:g} seed {seed}'}",
        highlight=False, soft_wrap=True,
    )
    bar = None
    if sys.stderr is not None and sys.stderr.isatty():
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                       TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=True)
        task = bar.add_task("benchmarking", total=n_runs * len(prompt_list))

        def progress(done, total, what):
            bar.update(task, completed=done, description=f"{what:<28.28}")

        bar.start()
    else:  # a log, not a terminal: a line every ~10 %
        step = max(1, (n_runs * len(prompt_list)) // 10)

        def progress(done, total, what):
            if done % step == 0 or done == total:
                err.print(f"  {done}/{total} generations", highlight=False, soft_wrap=True)

    try:
        result = B.run_bench(prompt_list, settings, progress)
    finally:
        if bar is not None:
            bar.stop()
    out = Console(width=None if sys.stdout.isatty() else 160)
    title = f"mars bench — {label}: {len(prompt_list)} prompts, {n_predict} tokens ({result.wall_s:.0f} s)"
    for table in B.render_tables(result, title):
        out.print(table)
    for note in result.notes:
        if note == unscored:
            continue  # warned about before the run
        err.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    if json_path is not None:
        B.write_json(result, json_path)
        err.print(f"wrote {json_path}", highlight=False, soft_wrap=True)
    if plot_path is not None:
        B.write_plot(result, plot_path)
        err.print(f"wrote {plot_path}", highlight=False, soft_wrap=True)
