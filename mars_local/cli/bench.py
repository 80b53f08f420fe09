"""`mars bench`: plain vs strict vs MARS (and peers) on one prompt set.

The work is in :mod:`mars_local.bench`; models are resolved by
:func:`mars_local.models.registry.choose_models`; this module only parses options and
prints.  :mod:`mars_local.cli.main` registers the command.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import List, Optional

import typer

from . import flags as opt
from .typed import ARGV
from ..core.choices import BENCH_DRAFTERS, choice
from ..core.defaults import DEFAULTS, check
from ..core.errors import MarsError
from ..llama.rpc import parse_endpoints, parse_tensor_split
from ..models.registry import bench_drafters, choose_models


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
            check("theta", t)  # the range of θ
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


# `mars bench`'s own options (the shared ones are mars_local.cli.flags')
PAIR = typer.Option(None, "--pair", help="A models.yaml entry (see `mars models`).")
DRAFTER = typer.Option(
    None, "--drafter", help="Benchmark only this drafter: ngram, model, mtp or eagle3 (with -md HEAD.gguf) (default: the pair's, plus -md's)."
)
PROMPTS = typer.Option(
    None, "--prompts", metavar="FILE.jsonl",
    help="JSONL prompt file (repeatable); default: the built-in set (mars_local/bench/prompts).",
)
CATEGORIES = typer.Option(None, "--categories", help="Comma-separated categories to keep.")
N_PREDICT = typer.Option(DEFAULTS.max_tokens_bench, "-n", "--n-predict", help="Tokens to generate per prompt.")
THETAS = typer.Option(
    None, "--thetas", "--theta",
    help=f"Comma-separated MARS thresholds (default: {','.join(map(str, DEFAULTS.thetas_bench))}; --quick: the pair's).",
)
DRAFT_MAX = typer.Option(
    None, "--draft-max", "--spec-draft-n-max", "--draft", "--draft-n", "--num-draft-tokens",
    help="Draft length k of fixed runs, the cap of adaptive runs (default: the pair's).",
)
FIXED_K = typer.Option(
    None, "--fixed-k", metavar="K1,K2,...",
    help="Draft lengths of the fixed-k runs (default: --draft-max), e.g. 1,2,4 to find the best fixed k.",
)
REPEAT = typer.Option(1, "--repeat", help="Rounds of every configuration on every prompt, interleaved; the fastest "
                      "generation counts, and with 2+ the ratio to llama.cpp is the median of the rounds' (range shown).")
SEED = typer.Option(DEFAULTS.seed_bench, "-s", "--seed", help="Seed of sampling runs (--temp > 0).")
QUICK = typer.Option(False, "--quick", help="Smoke run: 1 prompt per category, 16 tokens, one θ.")
PER_CATEGORY = typer.Option(
    None, "--per-category", metavar="N", help="Use only the first N prompts of each category."
)
PEER_K = typer.Option(
    None, "--peer-k", metavar="K1,K2,...",
    help="Draft lengths of llama.cpp's llama-speculative-simple runs (default: --draft-max); its best is the reference.",
)
PEERS = typer.Option(True, "--peers/--no-peers", help="Also run llama-cpp-python's prompt-lookup decoding.")
LLAMA_CPP_BIN = typer.Option(
    None, "--llama-cpp-bin", help="Folder with llama.cpp's llama-speculative-simple and llama-completion."
)
FORMAT_JSON = typer.Option(
    False, "--format-json",
    help=f"Also run plain decoding and one MARS configuration per drafter (θ {DEFAULTS.theta} or the first θ, "
    "adaptive k) constrained by the JSON grammar (as --format json): the grammar's cost in tokens/s and τ.",
)
JSON_PATH = typer.Option(None, "--json", help="Write the results as JSON to this file.")
PLOT_PATH = typer.Option(None, "--plot", help="Write a PNG of speedup and quality vs θ.")
CLIENTS = typer.Option(
    None, "--clients", metavar="N1,N2,...",
    help="A serving sweep instead: `mars serve` with N concurrent streaming clients at each N (--parallel N), "
    "speculative (strict) and plain, and llama-server at -np N from --llama-cpp-bin; tokens/s, time to first "
    "token, τ. E.g. 1,2,4,8,16.",
)
REQUESTS = typer.Option(2, "--requests", help="With --clients: requests each client sends in turn.")
_OWN = {"max_tokens_bench": N_PREDICT, "draft_max": DRAFT_MAX, "seed": SEED, "drafter": DRAFTER}


def bench(
    pair: Optional[str] = PAIR,
    model: Optional[str] = opt.MODEL,
    model_draft: Optional[str] = opt.MODEL_DRAFT,
    drafter: Optional[str] = DRAFTER,
    prompts: Optional[List[Path]] = PROMPTS,
    categories: Optional[str] = CATEGORIES,
    n_predict: int = N_PREDICT,
    thetas: Optional[str] = THETAS,
    draft_max: Optional[int] = DRAFT_MAX,
    fixed_k: Optional[str] = FIXED_K,
    repeat: int = REPEAT,
    temp: float = opt.TEMP,
    seed: int = SEED,
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
    quick: bool = QUICK,
    per_category: Optional[int] = PER_CATEGORY,
    peer_k: Optional[str] = PEER_K,
    peers: bool = PEERS,
    llama_cpp_bin: Optional[Path] = LLAMA_CPP_BIN,
    format_json: bool = FORMAT_JSON,
    json_path: Optional[Path] = JSON_PATH,
    plot_path: Optional[Path] = PLOT_PATH,
    clients: Optional[str] = CLIENTS,
    requests: int = REQUESTS,
) -> None:
    """Benchmark plain, strict and MARS decoding (speed and quality) on a prompt set; with --clients,
    serving throughput at each number of concurrent clients, against llama-server."""
    flags = dict(locals())  # every option by name, for the steps below
    if clients is not None:
        with opt.flag_errors(**_OWN):
            sweep, command = _plan_sweep(flags)
        _run_sweep(sweep, command)
        return
    with opt.flag_errors(**_OWN):
        settings, prompt_list = _plan(flags)
    _check_outputs(settings, json_path, plot_path)
    result, unscored = _run(settings, prompt_list)
    _report(result, settings, prompt_list, unscored, json_path, plot_path)


def _plan(f: dict):
    """The validated BenchSettings and prompts of the command's flags ``f`` (nothing is loaded)."""
    from .. import bench as B

    theta_list = parse_thetas(f["thetas"]) if f["thetas"] is not None else None
    prompt_list = _chosen_prompts(f)
    if f["drafter"] is not None:
        choice(f["drafter"], BENCH_DRAFTERS, "drafter")
    models = choose_models(f["model"], f["model_draft"], f["drafter"], pair=f["pair"])
    recommended = opt.make_config(models)  # the pair's θ and k, or the defaults
    n_predict = f["n_predict"]
    if f["quick"]:
        prompt_list = B.quick_subset(prompt_list, 1)
        n_predict = min(n_predict, 16)
        theta_list = (theta_list or (recommended.theta,))[:1]
    settings = B.BenchSettings(
        target=models.target, draft=models.draft, drafters=bench_drafters(models, f["drafter"]),
        thetas=theta_list or B.DEFAULT_THETAS,
        draft_max=f["draft_max"] if f["draft_max"] is not None else recommended.draft_max, max_tokens=n_predict,
        fixed_ks=parse_ks(f["fixed_k"]) if f["fixed_k"] is not None else None, repeats=f["repeat"],
        temperature=f["temp"], top_k=f["top_k"], top_p=f["top_p"], min_p=f["min_p"], seed=f["seed"],
        n_ctx=f["ctx_size"], n_gpu_layers=opt.gpu_layers(f["ngl"], opt.flag_as_typed("ngl")),
        n_gpu_layers_draft=opt.gpu_layers(f["ngld"], opt.flag_as_typed("ngld")), n_threads=f["threads"], peers=f["peers"],
        llama_cpp_bin=f["llama_cpp_bin"], label=models.label if models.pair is not None else Path(models.label).name,
        peer_ks=parse_ks(f["peer_k"], "--peer-k") if f["peer_k"] is not None else None,
        format_json=f["format_json"], rpc=parse_endpoints(f["rpc"]) if f["rpc"] is not None else (),
        rpc_draft=f["rpc_draft"], tensor_split=parse_tensor_split(f["tensor_split"]),
    )
    settings.validate()
    return settings, prompt_list


# options of the per-prompt bench that a serving sweep has no use for: given with --clients, an error
_NOT_IN_SWEEP = {"thetas": "--thetas", "fixed_k": "--fixed-k", "peer_k": "--peer-k", "format_json": "--format-json",
                 "plot_path": "--plot", "rpc": "--rpc", "rpc_draft": "--rpc-draft", "tensor_split": "--tensor-split",
                 "ngld": "-ngld"}


def _plan_sweep(f: dict):
    """The serving sweep's settings (:func:`mars_local.bench.serving.parse_args`) from the
    command's flags ``f``, and the command line it reports; nothing is started."""
    from .. import bench as B
    from ..bench import serving

    given = [flag for name, flag in _NOT_IN_SWEEP.items() if f[name] not in (None, False)]
    if f["temp"] != 0:
        given.append("--temp")
    if given:
        raise MarsError(f"--clients runs a greedy serving sweep: {', '.join(given)} "
                        f"{'does' if len(given) == 1 else 'do'} not apply to it")
    from ..server import check_installed

    check_installed()  # the sweep starts mars serve
    serving.check_installed()
    models = choose_models(f["model"], f["model_draft"], f["drafter"], pair=f["pair"])
    drafter = f["drafter"] or (models.drafter if models.drafter != "none" else "ngram")
    n_predict, requests = f["n_predict"], f["requests"]
    if f["quick"]:
        n_predict, requests = min(n_predict, 16), 1
    if f["threads"] is None:
        from ..llama.runtime import default_threads

        threads = default_threads()  # mars serve's own default, given to llama-server too
    else:
        threads = f["threads"]
    argv = ["-m", str(models.target), *(["-md", str(models.draft)] if models.draft is not None else []),
            "--drafter", drafter, "--clients", f["clients"], "--requests", str(requests), "-n", str(n_predict),
            "-t", str(threads), "-c", str(f["ctx_size"]), "--repeat", str(f["repeat"])]
    draft_max = f["draft_max"] if f["draft_max"] is not None else opt.make_config(models).draft_max  # the pair's
    argv += ["--draft-max", str(draft_max)]
    if f["ngl"] is not None:
        argv += ["-ngl", f["ngl"]]
    argv += ["--llama-bin", str(f["llama_cpp_bin"])] if f["llama_cpp_bin"] is not None else ["--no-peers"]
    if f["json_path"] is not None:
        B.check_writable(f["json_path"], "--json")
        argv += ["--json", str(f["json_path"])]
    sweep = serving.parse_args(argv, prog="mars bench", raising=True)
    if f["prompts"] or f["categories"] or f["per_category"] is not None:
        sweep.prompt_list = _sweep_prompts(f)
    return sweep, shlex.join(["mars", *ARGV])


def _chosen_prompts(f: dict) -> list:
    """The bench prompts that --prompts, --categories and --per-category choose."""
    from .. import bench as B

    prompt_list = B.load_prompts(f["prompts"], _split(f["categories"]) or None)
    if f["per_category"] is not None:
        if f["per_category"] < 1:
            raise MarsError(f"--per-category must be >= 1, got {f['per_category']}")
        prompt_list = B.quick_subset(prompt_list, f["per_category"])
    return prompt_list


def _sweep_prompts(f: dict) -> list:
    """The chosen bench prompts (:func:`_chosen_prompts`) as the sweep's requests: a chat
    prompt's messages, a raw prompt as the user's turn."""
    prompt_list = _chosen_prompts(f)
    if not prompt_list:
        raise MarsError("no prompts left for the sweep")
    return [list(map(dict, p.messages)) if p.messages else p.text for p in prompt_list]


def _run_sweep(sweep, command: str) -> None:
    from ..bench import serving

    code = serving.execute(sweep, command)
    if code:
        serving.exit_now(code)


def _check_outputs(settings, json_path: Optional[Path], plot_path: Optional[Path]) -> None:
    """What the run needs besides the models, checked before any model is loaded."""
    from .. import bench as B

    if settings.llama_cpp_bin is not None:
        B.find_llama_cpp_binaries(settings.llama_cpp_bin)
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        if path is not None:
            B.check_writable(path, flag)  # before the run, not after it
    if plot_path is not None:
        B.check_plot()  # the bench extra


def _run(settings, prompt_list):
    """Run the benchmark with progress on stderr (a bar on a terminal, else a line every ~10 %);
    (the result, the warning about unscored prompts shown before it)."""
    from rich.console import Console

    from .. import bench as B

    err = Console(stderr=True)
    unscored = B.unscored_note(B.unavailable_metrics(p.metric for p in prompt_list if p.scored))
    if unscored:
        err.print(f"warning: {unscored}", highlight=False, markup=False, soft_wrap=True)
    n_runs, s = len(B.plan_runs(settings)), settings
    err.print(
        f"mars bench: {s.label}, drafters {', '.join(s.drafters)}, {len(prompt_list)} prompts × {n_runs} "
        f"configurations, {s.max_tokens} tokens, "
        f"{'greedy' if s.temperature == 0 else f'T={s.temperature:g} seed {s.seed}'}",
        highlight=False, soft_wrap=True,
    )
    bar, progress = _progress(err, n_runs * len(prompt_list))
    try:
        return B.run_bench(prompt_list, settings, progress), unscored
    finally:
        if bar is not None:
            bar.stop()


def _progress(err, total: int):
    """(a started rich progress bar or None, the progress callback of run_bench)."""
    if sys.stderr is not None and sys.stderr.isatty():
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                       TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=True)
        task = bar.add_task("benchmarking", total=total)

        def on_bar(done, total, what):
            bar.update(task, completed=done, description=f"{what:<28.28}")

        bar.start()
        return bar, on_bar
    step = max(1, total // 10)  # a log, not a terminal: a line every ~10 %

    def on_line(done, total, what):
        if done % step == 0 or done == total:
            err.print(f"  {done}/{total} generations", highlight=False, soft_wrap=True)

    return None, on_line


def _report(result, settings, prompt_list, unscored, json_path: Optional[Path], plot_path: Optional[Path]) -> None:
    """The tables on stdout, notes on stderr, and the --json / --plot files."""
    from rich.console import Console

    from .. import bench as B

    err = Console(stderr=True)
    out = Console(width=None if sys.stdout.isatty() else 160)
    title = (f"mars bench — {settings.label}: {len(prompt_list)} prompts, {settings.max_tokens} tokens "
             f"({result.wall_s:.0f} s)")
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
