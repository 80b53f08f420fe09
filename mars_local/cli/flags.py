"""Options shared by `mars run`, `mars chat` and `mars batch`, and how they become
an :class:`~mars_local.speculate.engine.Engine` and a :class:`~mars_local.speculate.engine.GenerateConfig`.

Flag names follow llama.cpp (`-m`, `-md`, `-ngl`, `-ngld`, `-c`, `-n`, `--temp`,
`-s`, `-t`, `--draft-max/--draft-min/--draft-p-min`, `--ignore-eos`,
`-r/--reverse-prompt`, `--repeat-penalty`, `--repeat-last-n`,
`--presence-penalty`, `--frequency-penalty`, `--grammar`, `-j/--json-schema`,
`--chat-template`; ollama's `--format json`), with the newer
`--spec-draft-*` spellings and mlx-lm's `--draft-model/--num-draft-tokens` as
aliases.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import typing
from dataclasses import dataclass, fields
from typing import List, Optional

import typer
from typer import echo

try:  # typer >= 0.25 vendors its own click
    from typer._click.core import ParameterSource
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - older typer on top of click
    from click import get_current_context
    from click.core import ParameterSource

from ..core.choices import DRAFTERS
from ..core.errors import MarsError
from ..core.config import GenerateConfig
from ..models.registry import ModelChoice, choose_models

MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS
ARGV: list[str] = []  # the command line as MarsGroup received it, to name a flag as the user typed it

# Option objects are plain metadata, so each command reuses them as defaults.
_D = GenerateConfig()  # the defaults of the generation settings
MODEL = typer.Option(None, "-m", "--model", help="Target GGUF: path, hf:REPO/FILE or registry name.")
MODEL_DRAFT = typer.Option(
    None, "-md", "--model-draft", "--spec-draft-model", "--draft-model", help="Draft GGUF of the same tokenizer."
)
DRAFTER = typer.Option(
    None, "--drafter", help=f"{', '.join(DRAFTERS[:-1])} or {DRAFTERS[-1]} (default: the pair's, or model with -md)."
)
NO_DRAFT = typer.Option(False, "--no-draft", help="Plain decoding (no speculation).")
VERIFY = typer.Option(_D.verify, "--verify", help="Verification rule: strict (lossless) or mars.")
THETA = typer.Option(
    None, "--theta", help=f"MARS margin threshold in (0, 1] (default: the pair's, or {_D.theta})."
)
MAX_RELAXED = typer.Option(None, "--max-relaxed", help="Cap on MARS-relaxed accepts per window (default: none).")
DRAFT_MAX = typer.Option(
    None, "--draft-max", "--spec-draft-n-max", "--draft", "--draft-n", "--num-draft-tokens",
    help=f"Maximum draft length k (default: the pair's, or {_D.draft_max}).",
)
DRAFT_MIN = typer.Option(_D.draft_min, "--draft-min", "--spec-draft-n-min", "--draft-n-min", help="Drop shorter drafts.")
DRAFT_P_MIN = typer.Option(
    _D.draft_p_min, "--draft-p-min", "--spec-draft-p-min", help="Stop drafting below this draft top-token probability."
)
DRAFT_SAMPLING = typer.Option(_D.draft_sampling, "--draft-sampling", help="greedy or sample (draft model only).")
ADAPTIVE = typer.Option(
    _D.adaptive, "--adaptive/--no-adaptive",
    help="Choose the draft length per round from measured costs and acceptance (k = 0 included); "
    "--no-adaptive drafts --draft-max tokens every round.",
)
N_PREDICT = typer.Option(
    _D.max_tokens, "-n", "--n-predict", "--predict",
    help="Maximum tokens to generate; -1 = until an end-of-generation token or a full context.",
)
TEMP = typer.Option(_D.sampling.temperature, "--temp", "--temperature", help="Temperature; 0 = greedy.")
TOP_K = typer.Option(_D.sampling.top_k, "--top-k", help="Top-k truncation (0 = off).")
TOP_P = typer.Option(_D.sampling.top_p, "--top-p", help="Top-p truncation (1 = off).")
MIN_P = typer.Option(_D.sampling.min_p, "--min-p", help="Min-p truncation (0 = off).")
SEED = typer.Option(-1, "-s", "--seed", help="Random seed; -1 = random.")
CTX_SIZE = typer.Option(
    4096, "-c", "--ctx-size",
    help="Context size in tokens; 0 = the model's training context (a larger one than that is allowed, with a warning).",
)
NGL = typer.Option(
    None, "-ngl", "--gpu-layers", "--n-gpu-layers", help="Target GPU layers: N >= 0, auto, or all (= -1)."
)
NGLD = typer.Option(
    None, "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl", help="Draft GPU layers."
)
THREADS = typer.Option(None, "-t", "--threads", help=f"CPU threads, 1..{MAX_THREADS} (default: physical cores).")
IGNORE_EOS = typer.Option(
    _D.ignore_eos, "--ignore-eos", help="Never stop at an end-of-generation token (it is masked out)."
)
STOP = typer.Option(
    None, "-r", "--reverse-prompt", "--stop", metavar="STRING",
    help="Stop before this text (repeatable); it is not printed.",
)
REPEAT_PENALTY = typer.Option(
    _D.repeat_penalty, "--repeat-penalty", help="Penalize repeated tokens (1.0 = off), as llama.cpp."
)
REPEAT_LAST_N = typer.Option(
    _D.repeat_last_n, "--repeat-last-n", help="Tokens the penalties look back over (0 = off, -1 = the whole context)."
)
PRESENCE_PENALTY = typer.Option(_D.presence_penalty, "--presence-penalty", help="Presence penalty (0.0 = off).")
FREQUENCY_PENALTY = typer.Option(_D.frequency_penalty, "--frequency-penalty", help="Frequency penalty (0.0 = off).")
GRAMMAR = typer.Option(
    None, "--grammar", "--grammar-file", metavar="FILE", help="Constrain the output to a GBNF grammar file."
)
JSON_SCHEMA = typer.Option(
    None, "--json-schema", "-j", metavar="FILE|JSON",
    help="Constrain the output to JSON matching this JSON Schema (inline JSON or a file).",
)
FORMAT = typer.Option(
    None, "--format", metavar="json", help="json: constrain the output to any JSON value (as ollama)."
)
CHAT_TEMPLATE = typer.Option(
    None, "--chat-template", "--chat-template-file", metavar="NAME|FILE",
    help="Chat template: a llama.cpp built-in name (chatml, gemma, llama3, ...), a Jinja file, or Jinja text "
    "(default: the model's own).",
)
FAST_KERNELS = typer.Option(
    False, "--fast-kernels",
    help="Allow llama.cpp's repacked weight kernels for the target (~10% faster on K-quants on CPU); "
    "strict greedy output may then differ from plain decoding at near-ties.",
)


RPC = typer.Option(
    None, "--rpc", help="llama.cpp RPC servers HOST:PORT[,HOST:PORT...] that take the target's layers (trusted networks only)."
)
RPC_DRAFT = typer.Option(False, "--rpc-draft", help="Put the draft model on the RPC servers too (default: local).")
TENSOR_SPLIT = typer.Option(
    None, "--tensor-split", "-ts", help="Layer proportions per device, e.g. 3,1 (default: by free memory)."
)


def gpu_layers(value: Optional[str], flag: str) -> Optional[int]:
    """-ngl/-ngld: a number, 'all' (-1) or 'auto' (None: all when a GPU backend exists)."""
    if value is None or value == "auto":
        return None
    if value == "all":
        return -1
    try:
        n = int(value)
    except ValueError:
        raise MarsError(f"{flag} must be a number, 'auto' or 'all', got {value!r}") from None
    if n < -1:
        raise MarsError(f"{flag} must be a number of layers >= 0, 'auto' or 'all' (= -1), got {n}")
    return n


def flag_as_typed(name: str) -> str:
    """The spelling of a shared option the user typed (`--num-draft-tokens`, `-c`),
    or its first spelling; an error message then names the flag the user knows."""
    return typed_flag(_OPTION_INFO[name].param_decls)


def typed_flag(decls) -> str:
    """Which of an option's spellings ``decls`` the user typed (the last one given), or the first."""
    for tok in reversed(ARGV):
        if tok == "--":
            continue
        head = tok.split("=", 1)[0] if tok.startswith("--") else tok
        if head in decls:
            return head
    return decls[0]


def check_n_predict(n: int, option=None) -> None:
    """-n: a number of tokens >= 1, or -1 (until end of generation or a full context)."""
    if n < 1 and n != -1:
        flag = typed_flag((option or N_PREDICT).param_decls)
        raise MarsError(f"{flag}: the number of tokens to generate must be >= 1, or -1 (until an "
                        f"end-of-generation token or a full context), got {n}")


KIND_STYLE = {"draft": "green", "relaxed": "bold yellow", "target": ""}


def chunk_printer(show_acceptance: bool, eng):
    """Stream chunks to stdout, coloured by how each token was produced if asked
    (green = accepted draft, yellow = accepted only by MARS, plain = target)."""
    if not show_acceptance:
        def plain(chunk):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()

        return plain
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False, soft_wrap=True)

    def coloured(chunk):
        pieces = [eng.piece(tok).decode("utf-8", "replace") for tok in chunk.tokens]
        line = Text()
        if "".join(pieces) != chunk.text:
            # text held back (a character split across tokens) or cut at a stop string:
            # the chunk's text is what is shown, uncoloured
            line.append(chunk.text)
        else:
            for piece, kind in zip(pieces, chunk.kinds):
                line.append(piece, style=KIND_STYLE.get(kind, ""))
        console.print(line, end="")

    return coloured


def warn(msg: str) -> None:
    echo(f"warning: {msg}", err=True)


def check_threads(threads: Optional[int]) -> None:
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise MarsError(f"{flag_as_typed('threads')} must be in 1..{MAX_THREADS} (ggml's limit), got {threads}")


def check_ctx_size(ctx_size: int) -> None:
    from ..llama import runtime

    max_ctx = getattr(runtime, "MAX_CTX", 1 << 30)  # llama.cpp's positions are 32-bit
    if ctx_size < 0:
        raise MarsError(f"{flag_as_typed('ctx_size')} must be >= 0 (0 = the model's training context), got {ctx_size}")
    if ctx_size > max_ctx:
        raise MarsError(f"{flag_as_typed('ctx_size')} {ctx_size} is too large (at most {max_ctx} tokens)")


def valid_utf8(text: str, what: str) -> str:
    """``text`` as valid Unicode: an argument holding bytes that are not UTF-8
    (Python passes them as lone surrogates, 'caf\\udce9') has each bad byte
    replaced with U+FFFD, with one warning line (llama.cpp's tokenizer does the
    same replacement, silently)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # surrogates that did not come from undecodable bytes
        raw = text.encode("utf-8", "surrogatepass")
    warn(f"{what} is not valid UTF-8; each invalid byte was replaced with U+FFFD")
    return raw.decode("utf-8", "replace")


def decode_utf8(raw: bytes, what: str) -> str:
    """Bytes read from standard input as text, invalid UTF-8 replaced as in :func:`valid_utf8`."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        warn(f"{what} is not valid UTF-8 (first bad byte at offset {exc.start}); "
             "each invalid byte was replaced with U+FFFD")
        return raw.decode("utf-8", "replace")


def context_sizes(eng, ctx_size: int) -> tuple[int, int, int]:
    """(used, requested, training) context sizes of a built engine (-c 0 = training)."""
    train = getattr(eng, "n_ctx_train", None) or getattr(getattr(eng, "target", None), "n_ctx_train", 0) or 0
    requested = getattr(eng, "n_ctx_requested", None)
    if not requested:
        requested = ctx_size if ctx_size > 0 else train
    return int(eng.n_ctx), int(requested), int(train)


def context_full_note(eng) -> str:
    return f"note: stopped: the context ({eng.n_ctx} tokens) is full; a larger -c makes room"


def make_config(choice: ModelChoice, **options):
    """A validated GenerateConfig: the options given (None = not given) over the
    pair's recommendation (θ, k) over GenerateConfig's defaults."""
    return GenerateConfig.make(**{**choice.overrides, **{k: v for k, v in options.items() if v is not None}})


def format_stats(s, choice: ModelChoice, context: Optional[str] = None) -> str:
    """An ollama-style summary with the speculation counters (``context``: see
    :meth:`GenOptions.context_line`)."""
    share = f", {s.relaxed_share:.0%} of accepts relaxed" if s.n_accepted else ""
    lines = [
        f"model:                {choice.label} (drafter: {choice.drafter})",
        *([f"context size:         {context}"] if context else []),
        f"prompt eval count:    {s.n_prompt} token(s) ({s.n_prompt_evaluated} evaluated, rest reused from cache)",
        f"prompt eval duration: {s.time_prompt_s * 1000:.1f} ms",
        f"eval count:           {s.n_generated} token(s)",
        f"eval duration:        {s.time_decode_s * 1000:.1f} ms"
        + (f" (+ {s.time_calibrate_s * 1000:.0f} ms timing verify windows once)" if s.time_calibrate_s else ""),
        f"eval rate:            {s.tokens_per_second:.2f} tokens/s",
        f"target forwards:      {s.n_rounds}",
        f"drafted / accepted:   {s.n_drafted} / {s.n_accepted} "
        f"(acceptance {s.acceptance_rate:.1%}, relaxed {s.n_relaxed}{share})",
        f"mean accepted length: {s.mean_accepted_length:.2f} tokens per target forward",
        "time split:           target {:.1f} ms, draft {:.1f} ms, verify {:.1f} ms ({}, {:.1%} of decode)".format(
            s.time_target_s * 1000, s.time_draft_s * 1000, s.time_verify_s * 1000, s.verify_backend, s.verify_share
        ),
        f"draft length:         {'adaptive' if s.adaptive else 'fixed'}"
        + (f", mean k {sum(s.k_per_round) / len(s.k_per_round):.2f}" if s.k_per_round else ""),
        f"stop reason:          {s.stop_reason or 'interrupted'}",
    ]
    return "\n".join(lines)


@dataclass
class GenOptions:
    """The model and generation flags shared by run, chat and batch (defaults: the
    options above, built from GenerateConfig's)."""

    model: Optional[str]
    model_draft: Optional[str]
    drafter: Optional[str]
    no_draft: bool
    verify: str
    theta: Optional[float]
    max_relaxed: Optional[int]
    draft_max: Optional[int]
    draft_min: int
    draft_p_min: float
    draft_sampling: str
    adaptive: bool
    temp: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    ctx_size: int
    ngl: Optional[str]
    ngld: Optional[str]
    threads: Optional[int]
    fast_kernels: bool
    ignore_eos: bool
    stop: Optional[List[str]]
    repeat_penalty: float
    repeat_last_n: int
    presence_penalty: float
    frequency_penalty: float
    grammar: Optional[str]
    json_schema: Optional[str]
    format: Optional[str]
    chat_template: Optional[str]
    rpc: Optional[str]
    rpc_draft: bool
    tensor_split: Optional[str]

    explicit = frozenset()  # the options given on the command line (set by generation_options)

    def check(self) -> None:
        """Refuse impossible flags before anything is loaded (one line naming the flag as typed)."""
        from ..core.config import MAX_DRAFT

        check_ctx_size(self.ctx_size)
        check_threads(self.threads)
        gpu_layers(self.ngl, flag_as_typed("ngl"))
        gpu_layers(self.ngld, flag_as_typed("ngld"))
        if self.draft_max is not None and not 0 <= self.draft_max <= MAX_DRAFT:
            raise MarsError(f"{flag_as_typed('draft_max')} must be in 0..{MAX_DRAFT}, got {self.draft_max}")
        self.check_controls()
        if self.rpc_draft and self.rpc is None:
            raise MarsError(f"{flag_as_typed('rpc_draft')} needs --rpc HOST:PORT (the servers to put the draft on)")
        self.template()  # read a template file now, before any model loads
        from ..llama.rpc import parse_endpoints, parse_tensor_split

        parse_endpoints(self.rpc)
        parse_tensor_split(self.tensor_split)

    def check_controls(self) -> None:
        """The output controls' ranges, naming the flag as typed (GenerateConfig has the same rules)."""
        import math

        if not (math.isfinite(self.temp) and self.temp >= 0):
            raise MarsError(f"{flag_as_typed('temp')} must be a finite number >= 0 (0 = greedy), got {self.temp}")
        for s in self.stop or ():
            if not s:
                raise MarsError(f"{flag_as_typed('stop')} needs a non-empty string")
        if not (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0):
            raise MarsError(f"{flag_as_typed('repeat_penalty')} must be > 0 (1.0 = off), got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise MarsError(
                f"{flag_as_typed('repeat_last_n')} must be >= -1 (-1 = the whole context, 0 = off), "
                f"got {self.repeat_last_n}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v):
                raise MarsError(f"{flag_as_typed(name)} must be a finite number (0.0 = off), got {v}")

    def stops(self) -> Optional[tuple]:
        """The stop strings (None when none were given), made valid Unicode."""
        if not self.stop:
            return None
        return tuple(valid_utf8(s, flag_as_typed("stop")) for s in self.stop)

    def template(self) -> Optional[str]:
        """--chat-template resolved (read once): Jinja text, or a name, or None."""
        if not hasattr(self, "_template"):
            from .inputs import chat_template_option, check_template

            self._template = chat_template_option(self.chat_template)
            if self._template is not None:
                check_template(self._template, self.chat_template)
        return self._template

    def grammar_text(self) -> Optional[str]:
        """The GBNF of --grammar/--json-schema/--format (read and converted once), or None."""
        if not hasattr(self, "_grammar"):
            from .inputs import grammar_option

            self._grammar = grammar_option(self.grammar, self.json_schema, self.format)
        return self._grammar

    def choice(self) -> ModelChoice:
        self.check()
        return choose_models(self.model, self.model_draft, self.drafter, self.no_draft)

    def config(self, choice: ModelChoice, max_tokens: int, **more):
        """The GenerateConfig of these flags (``more``: a command's own fields, e.g. logprobs)."""
        self.check_controls()
        return make_config(
            choice, theta=self.theta, draft_max=self.draft_max, max_tokens=max_tokens, verify=self.verify,
            max_relaxed=self.max_relaxed, draft_min=self.draft_min, draft_p_min=self.draft_p_min,
            draft_sampling=self.draft_sampling, adaptive=self.adaptive, temperature=self.temp, top_k=self.top_k,
            top_p=self.top_p, min_p=self.min_p, seed=self.seed, ignore_eos=self.ignore_eos, stop=self.stops(),
            repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            grammar=self.grammar_text(), **more,
        )

    def engine(self, choice: ModelChoice):
        """The Engine, then one warning line per questionable setting (as llama.cpp does)."""
        from .inputs import open_engine
        from ..llama.runtime import read_busy_note

        eng = open_engine(choice, self.ctx_size, self.ngl, self.ngld, self.threads, self.fast_kernels,
                          self.template(), self.rpc, self.rpc_draft, self.tensor_split)
        try:
            self._check_grammar(eng)
        except BaseException:
            eng.close()
            raise
        cores = os.cpu_count()
        if self.threads is not None and cores and self.threads > cores:
            warn(f"{flag_as_typed('threads')} {self.threads} is more than the {cores} CPU cores here; "
                 "it will likely be slower than -t " + str(cores))
        busy = read_busy_note(getattr(eng, "n_threads", 0))
        if busy:
            warn(busy)
        used, requested, train = context_sizes(eng, self.ctx_size)
        if "ctx_size" in self.explicit and self.ctx_size > 0:
            c = f"{flag_as_typed('ctx_size')} {self.ctx_size}"
            if train and requested > train:
                warn(f"{c} is larger than the model's training context ({train})"
                     + (f"; using {used}" if used < requested else "; output may degrade past it"))
            elif used < requested:
                warn(f"{c}: the context holds only {used} tokens")
        return eng

    def _check_grammar(self, eng) -> None:
        """Compile the grammar flag's GBNF once against the model's vocabulary, so that an invalid
        grammar is one error now rather than one per generation (a server's every request, a
        batch's every record)."""
        text = self.grammar_text()
        target = getattr(eng, "target", None)
        if text is None or getattr(target, "vocab", None) is None:
            return
        from ..speculate.grammar import GrammarState

        GrammarState(target, text).close()

    def context_line(self, eng) -> str:
        """The context size used, and what was asked for when it differs."""
        used, requested, train = context_sizes(eng, self.ctx_size)
        c = flag_as_typed("ctx_size")
        if self.ctx_size == 0:
            return f"{used} tokens ({c} 0: the model's training context)"
        if used != requested:
            return f"{used} tokens ({c} {self.ctx_size})"
        return f"{used} tokens"


_OPTION_INFO = {
    "model": MODEL, "model_draft": MODEL_DRAFT, "drafter": DRAFTER, "no_draft": NO_DRAFT, "verify": VERIFY,
    "theta": THETA, "max_relaxed": MAX_RELAXED, "draft_max": DRAFT_MAX, "draft_min": DRAFT_MIN,
    "draft_p_min": DRAFT_P_MIN, "draft_sampling": DRAFT_SAMPLING, "adaptive": ADAPTIVE, "temp": TEMP,
    "top_k": TOP_K, "top_p": TOP_P, "min_p": MIN_P, "seed": SEED, "ctx_size": CTX_SIZE, "ngl": NGL, "ngld": NGLD,
    "threads": THREADS, "fast_kernels": FAST_KERNELS, "ignore_eos": IGNORE_EOS, "stop": STOP,
    "repeat_penalty": REPEAT_PENALTY, "repeat_last_n": REPEAT_LAST_N, "presence_penalty": PRESENCE_PENALTY,
    "frequency_penalty": FREQUENCY_PENALTY, "grammar": GRAMMAR, "json_schema": JSON_SCHEMA, "format": FORMAT,
    "chat_template": CHAT_TEMPLATE, "rpc": RPC, "rpc_draft": RPC_DRAFT, "tensor_split": TENSOR_SPLIT,
}


def generation_options(fn):
    """Give a command every GenOptions flag; it receives them as ``gen: GenOptions``.

    Typer reads a command's parameters from its signature, so the wrapper
    advertises the command's own parameters followed by the shared ones.
    """
    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.name != "gen"]
    hints = {k: v for k, v in typing.get_type_hints(fn).items() if k not in ("gen", "return")}
    shared_hints = typing.get_type_hints(GenOptions)
    shared = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_OPTION_INFO[f.name],
                          annotation=shared_hints[f.name])
        for f in fields(GenOptions)
    ]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        gen = GenOptions(**{f.name: kwargs.pop(f.name) for f in fields(GenOptions)})
        ctx = get_current_context(silent=True)
        if ctx is not None:
            gen.explicit = frozenset(
                f.name for f in fields(GenOptions) if ctx.get_parameter_source(f.name) == ParameterSource.COMMANDLINE
            )
        return fn(*args, gen=gen, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + shared)
    wrapper.__annotations__ = {**hints, **{p.name: p.annotation for p in shared}}
    del wrapper.__wrapped__
    return wrapper
