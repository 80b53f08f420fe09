"""The `mars` command line: a thin layer over :mod:`mars_local`'s Python API."""

from __future__ import annotations

import errno
import io
import json
import os
import sys
from typing import Optional

import typer
from typer import echo
from typer.core import TyperGroup

# typer >= 0.26 vendors click: its usage and command errors derive from typer.TyperException;
# an older typer raises click's own, named by click's public API
if issubclass(typer.BadParameter, getattr(typer, "TyperException", ())):
    CommandLineError = typer.TyperException
else:  # pragma: no cover - older typer on top of click
    from click import ClickException as CommandLineError

from . import batch as cli_batch, bench as cli_bench, chat as cli_chat, models as cli_models, serve as cli_serve
from . import flags as opt
from .inputs import read_text_file
from .render import chunk_printer, context_full_note, format_stats
from .typed import ARGV, decode_utf8, typed_flag, valid_utf8
from ..core.errors import MarsError
from ..core.textfile import MAX_PROMPT_BYTES, decode_text, read_stream

# a write that failed with one of these and no file name: standard output (a full disk, /dev/full)
_OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG})


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def _quiet_stdout() -> None:
    """After a broken pipe (`mars run ... | head`): point stdout at /dev/null so the
    interpreter's final flush of what is still buffered cannot fail (the recipe in
    Python's signal module documentation)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file (tests)
        pass


class _ClosedStdout(io.TextIOBase):
    """Standard output when the process was started with it closed (``mars run ... >&-``):
    Python sets ``sys.stdout`` to None, and a write would end in a traceback, or nothing at all
    be written while the command reports success.  Writing raises OSError instead, which
    ends the command with one line (what does not write, e.g. a server's log on stderr, runs on)."""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        raise OSError(errno.EBADF, "standard output is closed (redirect it to a file or /dev/null)")

    def flush(self) -> None:
        pass


class MarsGroup(TyperGroup):
    """Every user error ends as one line on stderr and exit code 2, never a traceback.

    A reader that stops reading (`| head`) ends the command quietly with exit 0.
    """

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # before click turns it into exit 1
            _quiet_stdout()
            return 0

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        code = 0
        if sys.stdout is None:
            sys.stdout = _ClosedStdout()
        ARGV[:] = [str(a) for a in (sys.argv[1:] if args is None else args)]
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except MarsError as exc:
            echo(f"error: {_one_line(exc)}", err=True)
            code = 2
        except CommandLineError as exc:  # a usage error (exit 2, with the command's help hint) or another
            ctx = getattr(exc, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            echo(f"error: {_one_line(exc.format_message())}{hint}", err=True)
            code = exc.exit_code or 1
        except typer.Abort:
            echo("aborted", err=True)
            code = 130
        except BrokenPipeError:
            _quiet_stdout()
            code = 0
        except MemoryError:  # a limit (ulimit -v) reached: one line, not a traceback
            echo("error: out of memory (the input or the model is too large for the memory this process may use)",
                 err=True)
            code = 2
        except OSError as exc:  # an error (2), as README's exit codes say: 1 is a failed doctor check
            where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
            if not where and exc.errno in _OUTPUT_ERRNOS:  # (a write without a file name: the output)
                echo(f"error: cannot write standard output: {exc.strerror or exc}", err=True)
            else:
                echo(f"error: {exc.strerror or exc}{where}", err=True)
            code = 2
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    name="mars",
    cls=MarsGroup,
    help="Local GGUF inference with speculative decoding verified by MARS.",
    no_args_is_help=False,  # `mars` alone prints the help (_root), exit 0
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        echo(f"mars-local {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
) -> None:
    """Local GGUF inference with speculative decoding verified by MARS."""
    if ctx.invoked_subcommand is None:
        echo(ctx.get_help())
        raise typer.Exit()


# ------------------------------------------------------------------ run
def read_prompt(prompt: Optional[str], what: str = "PROMPT") -> str:
    """PROMPT, or standard input when PROMPT is '-' or absent and stdin is not a tty.

    Bytes that are not UTF-8 (on stdin, or in PROMPT as Python's lone surrogates)
    are replaced with U+FFFD, with one warning line.
    """
    if prompt is None or prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise MarsError("no prompt given (pass PROMPT, -p TEXT, -f FILE, or '-' with text on standard input)")
        raw = read_stream(getattr(sys.stdin, "buffer", None) or sys.stdin, MAX_PROMPT_BYTES, "standard input",
                          "a prompt")
        if b"\x00" in raw:
            decode_text(raw, "standard input")  # binary: refused, naming the line
        prompt = decode_utf8(raw, "standard input")
    else:
        prompt = valid_utf8(prompt, what)
    if not prompt.strip():
        raise MarsError("the prompt is empty")
    return prompt


PROMPT_OPTION = typer.Option(None, "-p", "--prompt", metavar="TEXT", help="The prompt (as llama.cpp's -p).")
FILE_OPTION = typer.Option(None, "-f", "--file", metavar="FILE", help="Read the prompt from a UTF-8 text file.")


def check_prompt_sources(positional: Optional[str], prompt_opt: Optional[str], file: Optional[str]) -> None:
    """At most one of PROMPT, -p/--prompt and -f/--file."""
    given = [n for n, v in (("PROMPT", positional), (typed_flag(PROMPT_OPTION.param_decls), prompt_opt),
                            (typed_flag(FILE_OPTION.param_decls), file)) if v is not None]
    if len(given) > 1:
        raise MarsError(f"give the prompt once: {' and '.join(given)} were both given")


def prompt_source(positional: Optional[str], prompt_opt: Optional[str], file: Optional[str]) -> str:
    """The prompt text from exactly one of PROMPT, -p/--prompt and -f/--file (or standard input)."""
    check_prompt_sources(positional, prompt_opt, file)
    if file is not None:
        if file == "-":
            return read_prompt(None)
        text = read_text_file(file, "prompt")
        if not text.strip():
            raise MarsError(f"the prompt file {file} is empty")
        return text
    if prompt_opt is not None:
        return read_prompt(prompt_opt, typed_flag(PROMPT_OPTION.param_decls)) if prompt_opt != "-" else \
            read_prompt(None)
    return read_prompt(positional)


def check_logprobs(n: int, as_json: bool) -> None:
    opt.check_flag("logprobs", n)
    if n and not as_json:
        raise MarsError("--logprobs needs --json (the log probabilities are written into the JSON object)")


@opt.generation_options
def run(
    prompt: Optional[str] = typer.Argument(None, help="The prompt; '-' or omitted reads standard input."),
    prompt_opt: Optional[str] = PROMPT_OPTION,
    file: Optional[str] = FILE_OPTION,
    n_predict: int = opt.N_PREDICT,
    chat: bool = typer.Option(False, "--chat", help="Wrap PROMPT in the model's chat template as a user turn."),
    system: Optional[str] = typer.Option(None, "--system", "-sys", help="System prompt (implies --chat)."),
    show_acceptance: bool = typer.Option(
        False, "--show-acceptance", "--color-draft",
        help="Colour each token: green = accepted draft, yellow = accepted only by MARS, plain = target.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object {text, tokens, stats} and nothing else."),
    logprobs: int = opt.LOGPROBS,
    stats: bool = typer.Option(False, "--stats", "-v", help="Print a timing and acceptance summary to stderr."),
    tools_file: Optional[str] = typer.Option(
        None, "--tools", help="A JSON file of OpenAI tools (an array, or {\"tools\": [...]}): the model may "
        "call them (implies --chat); prints {content, tool_calls} as JSON."),
    tool_choice: str = typer.Option("auto", "--tool-choice", help="auto, none, required, or a tool's name (a forced call)."),
    gen: opt.GenOptions = None,
) -> None:
    """Generate a completion for PROMPT (streamed as it is verified).

    Ctrl-C ends the line, prints the partial statistics with --stats and exits 130;
    a closed pipe (`| head`) ends quietly with exit 0.
    """
    opt.check_flag("max_tokens", n_predict)
    check_logprobs(logprobs, as_json)
    check_prompt_sources(prompt, prompt_opt, file)
    choice = gen.choice()  # flags are checked before standard input is read or a model loads
    cfg = gen.config(choice, n_predict, **({"logprobs": logprobs} if logprobs else {}))
    tools = _read_tools(tools_file, tool_choice, cfg) if tools_file is not None else None
    text = prompt_source(prompt, prompt_opt, file)
    if system is not None:
        system = valid_utf8(system, "--system")
    eng = gen.engine(choice)
    try:
        if tools is not None:
            return _run_tools(eng, text, system, cfg, tools, as_json, stats, choice, gen)
        prompt_in = _chat_prompt(eng, text, system) if chat or system is not None else text
        summary = (lambda s: format_stats(s, choice, gen.context_line(eng))) if stats else None
        stream = eng.stream(prompt_in, cfg)
        try:
            parts, tokens, lps = _consume(stream, None if as_json else chunk_printer(show_acceptance, eng))
        except KeyboardInterrupt:
            _interrupted(stream, as_json, summary)
        _print_result(eng, "".join(parts), tokens, lps, stream.stats, as_json, logprobs)
        if stream.stats.stop_reason == "context":
            echo(context_full_note(eng), err=True)
        if summary is not None:
            echo(summary(stream.stats), err=True)
    finally:
        eng.close()


def _read_tools(path: str, choice_text: str, cfg):
    """--tools FILE and --tool-choice: (tools, choice), checked before a model loads."""
    from ..chat.tools import parse_tool_choice, parse_tools

    raw = read_text_file(path, "--tools", replace=False, limit=1 << 20)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise MarsError(f"--tools {path}: not valid JSON ({exc})") from None
    tools = parse_tools(data.get("tools") if isinstance(data, dict) else data)
    if not tools:
        raise MarsError(f"--tools {path}: no tools in the file")
    named = choice_text not in ("auto", "none", "required")
    tc = parse_tool_choice({"type": "function", "function": {"name": choice_text}} if named else choice_text, tools)
    if tc.mode in ("required", "function") and cfg.grammar is not None:  # (checked before a model loads)
        raise MarsError("--tool-choice required (or a tool's name) forces a call with its own grammar: "
                        "leave out --grammar/--json-schema/--format")
    return tools, tc


def _run_tools(eng, text: str, system: Optional[str], cfg, tools, as_json: bool, stats: bool, choice, gen) -> None:
    """PROMPT as a user turn with tools: the answer's calls parsed (chat.tools), printed as JSON."""
    from ..chat.tools import openai_calls, parse_tool_calls, was_cut

    tools, tc = tools
    prompt_in, cfg, fmt = eng.tool_prompt(_messages(text, system), tools, tc, cfg)
    stream = eng.stream(prompt_in, cfg)
    try:
        parts, tokens, _ = _consume(stream, None)
    except KeyboardInterrupt:
        _interrupted(stream, True, None)
    whole = "".join(parts)
    content, calls = (parse_tool_calls(fmt, whole, cut=was_cut(stream.stats.stop_reason)) if fmt is not None
                      else (whole, []))
    obj = {"content": content or None, "tool_calls": openai_calls(calls)}
    if as_json:
        obj = {"text": whole, "tokens": tokens, **obj, "stats": stream.stats.to_dict()}
    echo(json.dumps(obj, ensure_ascii=False))
    if stats:
        echo(format_stats(stream.stats, choice, gen.context_line(eng)), err=True)


def _messages(text: str, system: Optional[str]) -> list[dict]:
    """PROMPT as a user turn, after the system prompt."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def _chat_prompt(eng, text: str, system: Optional[str]):
    """PROMPT as a user turn (after the system prompt) in the model's chat template."""
    return eng.chat_prompt(_messages(text, system))


def _consume(stream, show) -> tuple[list[str], list[int], list]:
    """The stream's texts, tokens and log probabilities, each chunk shown as it comes (``show``)."""
    parts, tokens, lps = [], [], []
    try:
        for chunk in stream:
            parts.append(chunk.text)
            tokens.extend(chunk.tokens)
            lps.extend(chunk.logprobs or ())
            if show is not None:
                show(chunk)
    finally:  # any way out (Ctrl-C, a closed pipe): the statistics are final
        stream.close()
    return parts, tokens, lps


def _interrupted(stream, as_json: bool, summary) -> None:
    """Ctrl-C: end the line, show the partial statistics (``summary``, if asked) and exit 130."""
    if not as_json:
        sys.stdout.write("\n")  # the cursor back at the start of a line
        sys.stdout.flush()
    s = stream.stats
    if s is not None and not s.stop_reason:
        s.stop_reason = "interrupted"
    if summary is not None and s is not None:
        echo(summary(s), err=True)
    raise typer.Exit(130) from None


def _print_result(eng, text: str, tokens: list[int], lps: list, s, as_json: bool, logprobs: int) -> None:
    """The end of the output: the JSON object (--json), or the line's end after the streamed text."""
    if not as_json:
        sys.stdout.write("\n")
        sys.stdout.flush()
        return
    obj = {"text": text, "tokens": tokens, "stats": s.to_dict()}
    if logprobs:
        obj["logprobs"] = [lp.to_dict(lambda t: eng.piece(t).decode("utf-8", "replace")) for lp in lps]
    echo(json.dumps(obj, ensure_ascii=False))


# ------------------------------------------------------------ commands
app.command()(run)
app.command()(cli_chat.chat)
app.command(epilog=cli_batch.EPILOG)(cli_batch.batch)
app.command()(cli_models.models)
app.command()(cli_models.pull)
app.command()(cli_models.doctor)
app.command()(cli_bench.bench)
app.command()(cli_serve.serve)


def main() -> None:
    """Console entry point (`mars`)."""
    from ..core.interrupts import install

    install()  # a Ctrl-C while llama.cpp logs (a model loading) is not lost
    app()
