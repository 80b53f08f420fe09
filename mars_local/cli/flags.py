"""The options shared by `mars run`, `mars chat`, `mars batch` and `mars serve`, and how they become
an :class:`~mars_local.speculate.engine.Engine` and a :class:`~mars_local.core.config.GenerateConfig`.

Every default and range comes from the table of :mod:`mars_local.core.defaults`, and every
range is checked there: a setting's :class:`MarsError` names its field, which
:func:`flag_errors` turns into the flag as the user typed it (:func:`flag_of`).

Flag names follow llama.cpp (`-m`, `-md`, `-ngl`, `-ngld`, `-c`, `-n`, `--temp`,
`-s`, `-t`, `--draft-max/--draft-min/--draft-p-min`, `--ignore-eos`,
`-r/--reverse-prompt`, `--repeat-penalty`, `--repeat-last-n`,
`--presence-penalty`, `--frequency-penalty`, `--grammar`, `-j/--json-schema`,
`--chat-template`; ollama's `--format json`), with the newer
`--spec-draft-*` spellings and mlx-lm's `--draft-model/--num-draft-tokens` as
aliases.  Files the flags name are read by :mod:`.inputs`; statistics and chunks are
shown by :mod:`.render`.
"""

from __future__ import annotations

import functools
import inspect
import os
import typing
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import List, Optional

import typer

from .inputs import chat_template_option, check_template, grammar_option, open_engine
from .typed import typed_flag, valid_utf8, warn
from ..core.choices import DRAFT_SAMPLINGS, DRAFTERS, one_of
from ..core.config import GenerateConfig
from ..core.defaults import DEFAULTS, SETTINGS, check
from ..core.errors import MarsError
from ..models.registry import ModelChoice, choose_models

D, S = DEFAULTS, SETTINGS


def _note(key: str) -> str:
    return SETTINGS[key].note


def _span(key: str) -> str:
    """A whole-number range as help texts show it: "1..512"."""
    return SETTINGS[key].range_text().removeprefix("in ")


# Option objects are plain metadata, so each command reuses them as defaults.
MODEL = typer.Option(None, "-m", "--model", help="Target GGUF: path, hf:REPO/FILE or registry name.")
MODEL_DRAFT = typer.Option(
    None, "-md", "--model-draft", "--spec-draft-model", "--draft-model", help="Draft GGUF of the same tokenizer."
)
DRAFTER = typer.Option(
    D.drafter, "--drafter", help=f"{', '.join(DRAFTERS[:-1])} or {DRAFTERS[-1]} (default: the pair's, or model with -md)."
)
NO_DRAFT = typer.Option(False, "--no-draft", help="Plain decoding (no speculation).")
VERIFY = typer.Option(D.verify, "--verify", help="Verification rule: strict (lossless) or mars.")
THETA = typer.Option(
    None, "--theta", help=f"MARS margin threshold {S['theta'].range_text()} (default: the pair's, or {D.theta})."
)
MAX_RELAXED = typer.Option(None, "--max-relaxed", help="Cap on MARS-relaxed accepts per window (default: none).")
DRAFT_MAX = typer.Option(
    None, "--draft-max", "--spec-draft-n-max", "--draft", "--draft-n", "--num-draft-tokens",
    help=f"Maximum draft length k, {S['draft_max'].range_text()} (default: the pair's, or {D.draft_max}).",
)
DRAFT_MIN = typer.Option(D.draft_min, "--draft-min", "--spec-draft-n-min", "--draft-n-min", help="Drop shorter drafts.")
DRAFT_P_MIN = typer.Option(
    D.draft_p_min, "--draft-p-min", "--spec-draft-p-min", help="Stop drafting below this draft top-token probability."
)
DRAFT_SAMPLING = typer.Option(
    D.draft_sampling, "--draft-sampling", help=f"{one_of(DRAFT_SAMPLINGS)} (draft model only)."
)
ADAPTIVE = typer.Option(
    D.adaptive, "--adaptive/--no-adaptive",
    help="Choose the draft length per round from measured costs and acceptance (k = 0 included); "
    "--no-adaptive drafts --draft-max tokens every round.",
)
N_PREDICT = typer.Option(
    D.max_tokens, "-n", "--n-predict", "--predict",
    help="Maximum tokens to generate; -1 = until an end-of-generation token or a full context.",
)
LOGPROBS = typer.Option(
    D.logprobs, "--logprobs", metavar="N",
    help="With --json: each generated token's log probability and the target's top N "
    f"({_span('logprobs')}) alternatives.",
)
TEMP = typer.Option(D.temperature, "--temp", "--temperature", help=f"Temperature; {_note('temperature')}.")
TOP_K = typer.Option(D.top_k, "--top-k", help=f"Top-k truncation ({_note('top_k')}).")
TOP_P = typer.Option(D.top_p, "--top-p", help=f"Top-p truncation ({_note('top_p')}).")
MIN_P = typer.Option(D.min_p, "--min-p", help=f"Min-p truncation ({_note('min_p')}).")
SEED = typer.Option(D.seed, "-s", "--seed", help=f"Random seed; {_note('seed')}.")
CTX_SIZE = typer.Option(
    D.n_ctx, "-c", "--ctx-size",
    help="Context size in tokens; 0 = the model's training context (a larger one than that is allowed, with a warning).",
)
NGL = typer.Option(
    None, "-ngl", "--gpu-layers", "--n-gpu-layers", help="Target GPU layers: N >= 0, auto, or all (= -1)."
)
NGLD = typer.Option(
    None, "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl", help="Draft GPU layers."
)
THREADS = typer.Option(
    D.n_threads, "-t", "--threads", help=f"CPU threads, {_span('n_threads')} (default: physical cores)."
)
IGNORE_EOS = typer.Option(
    D.ignore_eos, "--ignore-eos", help="Never stop at an end-of-generation token (it is masked out)."
)
STOP = typer.Option(
    None, "-r", "--reverse-prompt", "--stop", metavar="STRING",
    help="Stop before this text (repeatable); it is not printed.",
)
REPEAT_PENALTY = typer.Option(
    D.repeat_penalty, "--repeat-penalty", help=f"Penalize repeated tokens ({_note('repeat_penalty')}), as llama.cpp."
)
REPEAT_LAST_N = typer.Option(
    D.repeat_last_n, "--repeat-last-n", help=f"Tokens the penalties look back over ({_note('repeat_last_n')})."
)
PRESENCE_PENALTY = typer.Option(
    D.presence_penalty, "--presence-penalty", help=f"Presence penalty ({_note('presence_penalty')})."
)
FREQUENCY_PENALTY = typer.Option(
    D.frequency_penalty, "--frequency-penalty", help=f"Frequency penalty ({_note('frequency_penalty')})."
)
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
    help="Allow llama.cpp's repacked weight kernels for the target (~10% faster on K-quants on CPU) and, "
    "on a GPU, batched forwards of more than 16 rows; strict greedy output may then differ from plain "
    "decoding at near-ties.",
)
RPC = typer.Option(
    None, "--rpc", help="llama.cpp RPC servers HOST:PORT[,HOST:PORT...] that take the target's layers (trusted networks only)."
)
RPC_DRAFT = typer.Option(False, "--rpc-draft", help="Put the draft model on the RPC servers too (default: local).")
TENSOR_SPLIT = typer.Option(
    None, "--tensor-split", "-ts", help="Layer proportions per device, e.g. 3,1 (default: by free memory)."
)

# The setting of the table (core.defaults) behind each GenOptions flag that has a rule there.
SETTING_OF = {
    "drafter": "drafter", "verify": "verify", "theta": "theta", "max_relaxed": "max_relaxed",
    "draft_max": "draft_max", "draft_min": "draft_min", "draft_p_min": "draft_p_min",
    "draft_sampling": "draft_sampling", "temp": "temperature", "top_k": "top_k", "top_p": "top_p",
    "min_p": "min_p", "seed": "seed", "ctx_size": "n_ctx", "threads": "n_threads", "stop": "stop",
    "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# ... and the flags of the settings that commands take as their own options
_OWN_FLAGS = {"max_tokens": N_PREDICT, "logprobs": LOGPROBS}


def flag_of(field: Optional[str], own: Optional[dict] = None) -> Optional[str]:
    """The flag, as the user typed it, that sets ``field`` (a setting of the table or a
    GenerateConfig field); ``own``: a command's own options by field.  None: no flag sets it."""
    if field is None:
        return None
    by_setting = {v: k for k, v in SETTING_OF.items()}
    option = (own or {}).get(field) or _OWN_FLAGS.get(field) or _OPTION_INFO.get(by_setting.get(field, ""))
    return typed_flag(option.param_decls) if option is not None else None


@contextmanager
def flag_errors(**own):
    """A setting's MarsError raised inside becomes one naming the flag as the user typed it
    (``own``: field=option of the command's own flags, e.g. ``queue_size=QUEUE``)."""
    try:
        yield
    except MarsError as exc:
        flag = flag_of(exc.field, own)
        if flag is None:
            raise
        raise exc.naming(flag) from None


def check_flag(field: str, value, **own):
    """``value`` of a flag checked by the table's rule for ``field``, the error naming the flag."""
    with flag_errors(**own):
        return check(field, value)


def flag_as_typed(name: str) -> str:
    """The spelling of a shared option the user typed (`--num-draft-tokens`, `-c`),
    or its first spelling; an error message then names the flag the user knows."""
    return typed_flag(_OPTION_INFO[name].param_decls)


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


def make_config(choice: ModelChoice, **options):
    """A validated GenerateConfig: the options given (None = not given) over the
    pair's recommendation (θ, k) over the table's defaults; an error names the flag."""
    with flag_errors():
        return GenerateConfig.make(**{**choice.overrides, **{k: v for k, v in options.items() if v is not None}})


def context_sizes(eng, ctx_size: int) -> tuple[int, int, int]:
    """(used, requested, training) context sizes of a built engine (-c 0 = training)."""
    train = getattr(eng, "n_ctx_train", None) or getattr(getattr(eng, "target", None), "n_ctx_train", 0) or 0
    requested = getattr(eng, "n_ctx_requested", None)
    if not requested:
        requested = ctx_size if ctx_size > 0 else train
    return int(eng.n_ctx), int(requested), int(train)


@dataclass
class GenOptions:
    """The model and generation flags shared by run, chat, batch and serve (defaults and
    ranges: the table of core.defaults)."""

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
        """Refuse impossible flags before anything is loaded (one line naming the flag as typed):
        each flag by its setting's rule in the table, then what only the CLI knows."""
        with flag_errors():
            for name, setting in SETTING_OF.items():
                value = getattr(self, name)
                if value is not None:
                    check(setting, tuple(value) if name == "stop" else value)
        self.n_gpu_layers()
        if self.rpc_draft and self.rpc is None:
            raise MarsError(f"{flag_as_typed('rpc_draft')} needs --rpc HOST:PORT (the servers to put the draft on)")
        self.template()  # read a template file now, before any model loads
        from ..llama.rpc import parse_endpoints, parse_tensor_split

        parse_endpoints(self.rpc)
        parse_tensor_split(self.tensor_split)

    def n_gpu_layers(self) -> tuple[Optional[int], Optional[int]]:
        """-ngl and -ngld as numbers (None: auto)."""
        return gpu_layers(self.ngl, flag_as_typed("ngl")), gpu_layers(self.ngld, flag_as_typed("ngld"))

    def stops(self) -> Optional[tuple]:
        """The stop strings (None when none were given), made valid Unicode."""
        if not self.stop:
            return None
        return tuple(valid_utf8(s, flag_as_typed("stop")) for s in self.stop)

    def template(self) -> Optional[str]:
        """--chat-template resolved (read once): Jinja text, or a name, or None."""
        if not hasattr(self, "_template"):
            self._template = chat_template_option(self.chat_template)
            if self._template is not None:
                check_template(self._template, self.chat_template)
        return self._template

    def grammar_text(self) -> Optional[str]:
        """The GBNF of --grammar/--json-schema/--format (read and converted once), or None."""
        if not hasattr(self, "_grammar"):
            self._grammar = grammar_option(self.grammar, self.json_schema, self.format)
        return self._grammar

    def choice(self) -> ModelChoice:
        self.check()
        with flag_errors():
            return choose_models(self.model, self.model_draft, self.drafter, self.no_draft)

    def config(self, choice: ModelChoice, max_tokens: int, **more):
        """The GenerateConfig of these flags (``more``: a command's own fields, e.g. logprobs)."""
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
        eng = open_engine(choice, self.ctx_size, *self.n_gpu_layers(), self.threads, self.fast_kernels,
                          self.template(), self.rpc, self.rpc_draft, self.tensor_split)
        try:
            self._check_grammar(eng)
        except BaseException:
            eng.close()
            raise
        self._warn(eng)
        return eng

    def _warn(self, eng) -> None:
        from ..llama.runtime import read_busy_note

        cores = os.cpu_count()
        if self.threads is not None and cores and self.threads > cores:
            warn(f"{flag_as_typed('threads')} {self.threads} is more than the {cores} CPU cores here; "
                 "it will likely be slower than -t " + str(cores))
        busy = read_busy_note(getattr(eng, "n_threads", 0))
        if busy:
            warn(busy)
        most = getattr(eng, "max_draft", None)
        if "draft_max" in self.explicit and most is not None and (self.draft_max or 0) > most:
            target = getattr(eng, "target", None)
            why = (f"; with layers on a GPU strict decoding keeps a verify window within "
                   f"{target.invariant_rows} rows, which --fast-kernels lifts"
                   if getattr(target, "offloaded", False) and getattr(target, "invariant_rows", None) == most + 1
                   else "")
            warn(f"{flag_as_typed('draft_max')} {self.draft_max}: this target verifies at most {most} draft "
                 f"tokens a round here{why}")
        used, requested, train = context_sizes(eng, self.ctx_size)
        if "ctx_size" in self.explicit and self.ctx_size > 0:
            c = f"{flag_as_typed('ctx_size')} {self.ctx_size}"
            if train and requested > train:
                warn(f"{c} is larger than the model's training context ({train})"
                     + (f"; using {used}" if used < requested else "; output may degrade past it"))
            elif used < requested:
                warn(f"{c}: the context holds only {used} tokens")

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
_CTX = "mars_cli_context"  # the parameter typer fills with the command's typer.Context


def generation_options(fn):
    """Give a command every GenOptions flag; it receives them as ``gen: GenOptions``.

    Typer reads a command's parameters from its signature, so the wrapper
    advertises the command's own parameters followed by the shared ones (and a
    typer.Context, to know which flags the command line gave).
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
    shared.append(inspect.Parameter(_CTX, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=typer.Context))

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ctx = kwargs.pop(_CTX, None)
        gen = GenOptions(**{f.name: kwargs.pop(f.name) for f in fields(GenOptions)})
        if ctx is not None:
            sources = {f.name: ctx.get_parameter_source(f.name) for f in fields(GenOptions)}
            gen.explicit = frozenset(n for n, src in sources.items() if src is not None and src.name == "COMMANDLINE")
        return fn(*args, gen=gen, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + shared)
    wrapper.__annotations__ = {**hints, **{p.name: p.annotation for p in shared}}
    del wrapper.__wrapped__
    return wrapper
