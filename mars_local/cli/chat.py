"""`mars chat`: multi-turn chat in the terminal with the model's own chat template.

The conversation is :class:`mars_local.chat.session.ChatSession`; this module reads
messages (:func:`mars_local.chat.session.read_message`: a \"\"\" block or a pasted
block of lines is one message), runs slash commands and renders the
session's events.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional

import typer
from typer import echo

from . import flags as opt
from .render import chunk_printer
from .typed import valid_utf8
from ..chat.session import ChatSession, ContextDropped, Interrupted, Text, TurnDone, read_message
from ..core.defaults import DEFAULTS
from ..core.errors import MarsError


@opt.generation_options
def chat(
    n_predict: int = typer.Option(
        DEFAULTS.max_tokens_chat, "-n", "--n-predict", "--predict",
        help="Maximum tokens per answer (-1: until the end of the answer or a full context).",
    ),
    system: Optional[str] = typer.Option(None, "--system", "-sys", help="System prompt."),
    show_acceptance: bool = typer.Option(False, "--show-acceptance", "--color-draft", help="Colour tokens by origin."),
    gen: opt.GenOptions = None,
) -> None:
    """Chat with a model in the terminal (/help for commands, Ctrl-D to leave)."""
    if system is not None:
        system = valid_utf8(system, "--system")
    opt.check_flag("max_tokens", n_predict)
    choice = gen.choice()
    cfg = gen.config(choice, n_predict)
    eng = gen.engine(choice)
    if not eng.has_chat_template:
        eng.close()
        raise MarsError(f"{choice.label} has no chat template; give one with --chat-template NAME|FILE "
                        "or use `mars run` instead")
    # -n -1: answers may fill the context; keep the default room for one free
    session = ChatSession(eng, cfg, system, reserve=n_predict if n_predict > 0 else DEFAULTS.max_tokens_chat)
    show = chunk_printer(show_acceptance, eng)
    render = _renderer(show, eng.n_ctx)
    echo(f"mars chat with {choice.label} (drafter: {choice.drafter}, verify: {cfg.verify}); /help for commands")
    try:
        _converse(session, render)
    finally:
        eng.close()


def _converse(session: ChatSession, render) -> None:
    """Read messages until Ctrl-D or /quit: each a slash command or a turn, rendered as it comes."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # pragma: no cover - Windows
        pass
    # Typed or piped bytes that are not UTF-8 reach us as lone surrogates (then
    # replaced with U+FFFD, with a warning) instead of a UnicodeDecodeError.
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        try:
            reconfigure(errors="surrogateescape")
        except (ValueError, OSError):  # pragma: no cover
            pass
    waiting = _input_waiting()
    read_line = input if waiting is not _never else _PipedLines(sys.stdin)
    while True:
        try:
            if read_line is not input:
                read_line.new_message()
            msg = read_message(read_line, waiting)
        except EOFError:
            echo("")
            break
        except KeyboardInterrupt:  # also drops a half-typed """ block
            echo("")
            continue
        line = valid_utf8(msg.text, "this message")
        if not line.strip():
            continue
        if msg.command:
            reply = session.command(line)
            if reply is None:
                break
            echo(reply)
            continue
        turn = session.ask(line)
        try:
            for event in turn:
                render(event)
        except MarsError as exc:
            echo(f"error: {exc}", err=True)
        except KeyboardInterrupt:  # while rendering, or before the answer started
            turn.close()  # the session keeps what was said
            echo("\n(stopped)", err=True)


def _never() -> bool:
    return False


class _PipedLines:
    """``input(prompt)`` for input that is not a terminal, bounded: a message (its lines
    since :meth:`new_message`) over MAX_PROMPT_BYTES characters, or a NUL byte (binary
    input such as /dev/zero), ends the chat with one line instead of reading on."""

    def __init__(self, stream):
        self.stream, self.used = stream, 0

    def new_message(self) -> None:
        self.used = 0

    def __call__(self, prompt: str = "") -> str:
        from ..core.textfile import MAX_PROMPT_BYTES, format_size

        if prompt:
            sys.stdout.write(prompt)
            sys.stdout.flush()
        if self.stream is None:
            raise EOFError
        parts = []
        while True:
            part = self.stream.readline(min(1 << 20, MAX_PROMPT_BYTES + 1 - self.used))
            if "\x00" in part:
                raise MarsError("standard input is binary, not text (a NUL byte)")
            self.used += len(part)
            if self.used > MAX_PROMPT_BYTES:
                raise MarsError(f"a message on standard input is larger than {format_size(MAX_PROMPT_BYTES)}, "
                                "the limit for a prompt")
            parts.append(part)
            if not part or part.endswith("\n"):
                break
        line = "".join(parts)
        if not line:
            raise EOFError
        return line.removesuffix("\n")


def _input_waiting() -> Callable[[], bool]:
    """Whether a typed line has already arrived, unread (several lines pasted
    at once): asked of the terminal on POSIX; never (``_never``), for piped input
    (each line its own message) or where select cannot tell."""
    try:
        import select

        fd = sys.stdin.fileno()
        if os.name != "posix" or not os.isatty(fd):
            return _never
    except (ImportError, AttributeError, ValueError, OSError):
        return _never

    def waiting() -> bool:
        try:
            return bool(select.select([fd], [], [], 0)[0])
        except (OSError, ValueError):
            return False

    return waiting


def _renderer(show, n_ctx: int):
    """Show one ChatSession event: the answer on stdout, notes on stderr."""

    def render(event) -> None:
        if isinstance(event, Text):
            show(event.chunk)
        elif isinstance(event, ContextDropped):
            echo(f"(context full: dropped the {event.turns} oldest turn(s))", err=True)
        elif isinstance(event, Interrupted):
            echo("\n(stopped)", err=True)
        elif isinstance(event, TurnDone):
            if not event.interrupted:
                sys.stdout.write("\n")
                sys.stdout.flush()
            if event.cut_by_context:
                echo(f"note: the answer stopped at the end of the context ({n_ctx} tokens); "
                     "/reset or a larger -c makes room", err=True)

    return render
