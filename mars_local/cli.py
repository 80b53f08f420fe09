"""The `mars` command line: a thin layer over :mod:`mars_local`'s Python API."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer
from typer import echo
from typer.core import TyperGroup

try:  # typer >= 0.25 vendors its own click
    from typer._click import exceptions as cx
except ImportError:  # pragma: no cover - older typer on top of click
    from click import exceptions as cx

from .errors import MarsError


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


class MarsGroup(TyperGroup):
    """Every user error ends as one line on stderr and exit code 2, never a traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        code = 0
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except cx.NoArgsIsHelpError as exc:
            echo(exc.ctx.get_help() if exc.ctx else str(exc))
        except MarsError as exc:
            echo(f"error: {_one_line(exc)}", err=True)
            code = 2
        except cx.UsageError as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
            echo(f"error: {_one_line(exc.format_message())}{hint}", err=True)
            code = 2
        except cx.ClickException as exc:
            echo(f"error: {_one_line(exc.format_message())}", err=True)
            code = exc.exit_code or 1
        except typer.Abort:
            echo("aborted", err=True)
            code = 130
        except BrokenPipeError:
            code = 0
        except OSError as exc:
            where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
            echo(f"error: {exc.strerror or exc}{where}", err=True)
            code = 1
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    name="mars",
    cls=MarsGroup,
    help="Local GGUF inference with speculative decoding verified by MARS.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        from . import __version__

        echo(f"mars-local {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
) -> None:
    """Local GGUF inference with speculative decoding verified by MARS."""


# --------------------------------------------------------------- options
@dataclass
class ModelChoice:
    target: Path
    draft: Optional[Path]
    drafter: str
    theta: float
    draft_max: int
    label: str


def choose_models(
    model: Optional[str], model_draft: Optional[str], drafter: Optional[str], no_draft: bool
) -> ModelChoice:
    """Resolve -m/-md/--drafter/--no-draft against the registry defaults."""
    from .registry import load_registry, model_path, resolve_model

    if no_draft and (model_draft is not None or drafter not in (None, "none")):
        raise MarsError("--no-draft contradicts -md/--model-draft and --drafter")
    if model_draft is not None and drafter not in (None, "model"):
        raise MarsError(f"-md/--model-draft contradicts --drafter {drafter}")
    reg = load_registry()
    theta, draft_max, draft = 0.9, 8, None
    if model is None or model in reg.pairs:
        pair = reg.get(model or reg.default)
        target = model_path(pair, "target")
        theta, draft_max, label = pair.theta, pair.draft_max, pair.name
        if not no_draft and model_draft is None and drafter in (None, pair.drafter):
            drafter = pair.drafter
            if drafter == "model":
                draft = model_path(pair, "draft")
    else:
        target, label = resolve_model(model, reg), model
    if model_draft is not None:
        draft, drafter = resolve_model(model_draft, reg), "model"
    if no_draft:
        drafter = "none"
    drafter = drafter or ("model" if draft is not None else "none")
    if drafter == "model" and draft is None:
        raise MarsError("--drafter model needs a draft model (-md DRAFT.gguf)")
    return ModelChoice(target, draft if drafter == "model" else None, drafter, theta, draft_max, label)


def _gpu_layers(value: Optional[str], flag: str) -> Optional[int]:
    if value is None or value in ("auto", "all"):
        return None if value in (None, "auto") else -1
    try:
        n = int(value)
    except ValueError:
        raise MarsError(f"{flag} must be a number, 'auto' or 'all', got {value!r}") from None
    return n


# ------------------------------------------------------------------ run
@app.command()
def run(
    prompt: Optional[str] = typer.Argument(None, help="The prompt; '-' or omitted reads standard input."),
    model: Optional[str] = typer.Option(None, "-m", "--model", help="Target GGUF: path, hf:REPO/FILE or registry name."),
    model_draft: Optional[str] = typer.Option(
        None, "-md", "--model-draft", "--spec-draft-model", "--draft-model", help="Draft GGUF of the same tokenizer."
    ),
    drafter: Optional[str] = typer.Option(None, "--drafter", help="model, ngram or none."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Plain decoding (no speculation)."),
    verify: str = typer.Option("mars", "--verify", help="Verification rule: strict (lossless) or mars."),
    theta: Optional[float] = typer.Option(None, "--theta", help="MARS margin threshold in (0, 1] (default 0.9)."),
    max_relaxed: Optional[int] = typer.Option(None, "--max-relaxed", help="Cap on MARS-relaxed accepts per window."),
    draft_max: Optional[int] = typer.Option(
        None, "--draft-max", "--spec-draft-n-max", "--draft", "--draft-n", "--num-draft-tokens",
        help="Maximum draft length k.",
    ),
    draft_min: int = typer.Option(0, "--draft-min", "--spec-draft-n-min", "--draft-n-min", help="Drop shorter drafts."),
    draft_p_min: float = typer.Option(
        0.0, "--draft-p-min", "--spec-draft-p-min", help="Stop drafting below this draft top-token probability."
    ),
    draft_sampling: str = typer.Option("greedy", "--draft-sampling", help="greedy or sample (draft model only)."),
    adaptive: bool = typer.Option(
        True, "--adaptive/--no-adaptive",
        help="Choose the draft length per round from measured costs and acceptance (k = 0 included); "
        "--no-adaptive drafts --draft-max tokens every round.",
    ),
    n_predict: int = typer.Option(256, "-n", "--n-predict", "--predict", help="Tokens to generate."),
    temp: float = typer.Option(0.0, "--temp", "--temperature", help="Temperature; 0 = greedy."),
    top_k: int = typer.Option(40, "--top-k", help="Top-k truncation (0 = off)."),
    top_p: float = typer.Option(0.95, "--top-p", help="Top-p truncation (1 = off)."),
    min_p: float = typer.Option(0.05, "--min-p", help="Min-p truncation (0 = off)."),
    seed: int = typer.Option(-1, "-s", "--seed", help="Random seed; -1 = random."),
    ctx_size: int = typer.Option(4096, "-c", "--ctx-size", help="Context size in tokens."),
    ngl: Optional[str] = typer.Option(None, "-ngl", "--gpu-layers", "--n-gpu-layers", help="Target GPU layers: N, auto, all."),
    ngld: Optional[str] = typer.Option(
        None, "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl", help="Draft GPU layers."
    ),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", help="CPU threads."),
    fast_kernels: bool = typer.Option(
        False, "--fast-kernels",
        help="Allow llama.cpp's repacked weight kernels for the target (~10%% faster on K-quants on CPU); "
        "strict greedy output may then differ from plain decoding at near-ties.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object {text, tokens, stats} and nothing else."),
    stats: bool = typer.Option(False, "--stats", "--verbose", "-v", help="Print a timing and acceptance summary to stderr."),
) -> None:
    """Generate a completion for PROMPT."""
    from .engine import Engine, GenerateConfig

    if prompt is None or prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise MarsError("no prompt given (pass PROMPT, or '-' with text on standard input)")
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise MarsError("the prompt is empty")
    if threads is not None and threads < 1:
        raise MarsError(f"--threads must be >= 1, got {threads}")
    choice = choose_models(model, model_draft, drafter, no_draft)
    cfg = GenerateConfig.make(
        max_tokens=n_predict,
        verify=verify,
        theta=theta if theta is not None else choice.theta,
        max_relaxed=max_relaxed,
        draft_max=draft_max if draft_max is not None else choice.draft_max,
        draft_min=draft_min,
        draft_p_min=draft_p_min,
        draft_sampling=draft_sampling,
        adaptive=adaptive,
        temperature=temp,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=seed,
    )
    eng = Engine(
        choice.target,
        choice.draft,
        drafter=choice.drafter,
        n_ctx=ctx_size,
        n_gpu_layers=_gpu_layers(ngl, "-ngl"),
        n_gpu_layers_draft=_gpu_layers(ngld, "-ngld"),
        n_threads=threads,
        exact_kernels=not fast_kernels,
    )
    try:
        if as_json:
            out = eng.generate(prompt, cfg)
            echo(json.dumps(out.to_dict(), ensure_ascii=False))
        else:
            def show(chunk):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()

            out = eng.generate(prompt, cfg, on_chunk=show)
            sys.stdout.write("\n")
        if stats:
            print_stats(out.stats, choice)
    finally:
        eng.close()


def print_stats(s, choice: ModelChoice) -> None:
    """An ollama-style summary on stderr, with the speculation counters."""
    lines = [
        f"model:                {choice.label} (drafter: {choice.drafter})",
        f"prompt eval count:    {s.n_prompt} token(s) ({s.n_prompt_evaluated} evaluated)",
        f"prompt eval duration: {s.time_prompt_s * 1000:.1f} ms",
        f"eval count:           {s.n_generated} token(s)",
        f"eval rate:            {s.tokens_per_second:.2f} tokens/s",
        f"target forwards:      {s.n_rounds}",
        f"drafted / accepted:   {s.n_drafted} / {s.n_accepted} ({s.acceptance_rate:.1%}, relaxed {s.n_relaxed})",
        f"mean accepted length: {s.mean_accepted_length:.2f}",
        "time split:           target {:.1f} ms, draft {:.1f} ms, verify {:.1f} ms ({})".format(
            s.time_target_s * 1000, s.time_draft_s * 1000, s.time_verify_s * 1000, s.verify_backend
        ),
        f"stop reason:          {s.stop_reason}",
    ]
    echo("\n".join(lines), err=True)


def main() -> None:
    """Console entry point (`mars`)."""
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
