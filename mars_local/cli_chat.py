"""`mars chat`: multi-turn chat in the terminal with the model's own chat template.

Each turn renders the whole conversation with the GGUF chat template and hands
the tokens to the engine, which keeps the target's and the draft's KV caches
and evaluates only what differs from the previous turn (the new user message,
usually).  When the conversation outgrows the context, the oldest turns are
dropped (the system prompt stays).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Optional

import typer
from typer import echo

from . import cli_common as opt
from .cli import KIND_STYLE, app
from .errors import MarsError

HELP = """commands:
  /help            this help
  /reset           forget the conversation (keeps the system prompt)
  /stats           statistics of the last answer
  /verify MODE     strict or mars
  /theta X         MARS threshold in (0, 1]
  /system TEXT     set the system prompt (and reset)
  /quit            leave (Ctrl-D works too; Ctrl-C stops an answer)"""


class ChatSession:
    """The conversation state and the slash commands, independent of the terminal."""

    def __init__(self, engine, config, system: Optional[str] = None, reserve: int = 256):
        self.engine = engine
        self.config = config
        self.system = system
        self.messages: list[dict] = []
        self.last_stats = None
        self.reserve = reserve  # tokens kept free for the answer
        self.interrupted = False
        self.cut_by_context = False

    def _all_messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def prompt_tokens(self) -> tuple[list[int], int]:
        """The rendered conversation, dropping the oldest turns until it fits."""
        dropped = 0
        limit = self.engine.n_ctx - min(self.reserve, self.engine.n_ctx // 4)
        while True:
            toks = self.engine.chat_prompt(self._all_messages())
            if len(toks) <= limit:
                return toks, dropped
            if len(self.messages) <= 1:
                raise MarsError(
                    f"this message is {len(toks)} tokens, more than the context ({self.engine.n_ctx}) allows; "
                    "send a shorter one or restart with a larger -c"
                )
            # drop the oldest user turn and its answer
            del self.messages[0]
            if self.messages and self.messages[0]["role"] == "assistant":
                del self.messages[0]
            dropped += 1

    def ask(self, text: str, on_chunk) -> str:
        """One turn: stream the answer through on_chunk; Ctrl-C keeps what was said.

        Afterwards ``interrupted`` says whether Ctrl-C stopped it and
        ``cut_by_context`` whether the end of the context did.
        """
        before = list(self.messages)
        self.interrupted = self.cut_by_context = False
        self.messages.append({"role": "user", "content": text})
        try:
            toks, dropped = self.prompt_tokens()
        except (MarsError, KeyboardInterrupt):
            self.messages = before  # nothing of the conversation is lost
            raise
        if dropped:
            echo(f"(context full: dropped the {dropped} oldest turn(s))", err=True)
        room = self.engine.n_ctx - len(toks) - 1
        cfg = replace(self.config, max_tokens=max(1, min(self.config.max_tokens, room)))
        parts: list[str] = []
        stream = self.engine.stream(toks, cfg)
        try:
            for chunk in stream:
                parts.append(chunk.text)
                on_chunk(chunk)
        except KeyboardInterrupt:
            self.interrupted = True
            echo("\n(stopped)", err=True)
        finally:
            stream.close()
        self.last_stats = s = self.engine.last_stats
        if s is not None and not self.interrupted:
            # the answer was cut by the context, not by -n: say so (the engine stops
            # with "length" when the cap above, not -n, was the limit)
            capped = cfg.max_tokens < self.config.max_tokens and s.n_generated >= cfg.max_tokens
            self.cut_by_context = s.stop_reason == "context" or (s.stop_reason == "length" and capped)
        answer = "".join(parts)
        self.messages.append({"role": "assistant", "content": answer})
        return answer

    def command(self, line: str) -> Optional[str]:
        """Run a slash command; returns text to show, or None to leave."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit", "/bye"):
            return None
        if name == "/help":
            return HELP
        if name == "/reset":
            self.messages.clear()
            return "(conversation reset)"
        if name == "/stats":
            if self.last_stats is None:
                return "(no answer yet)"
            s = self.last_stats
            return (
                f"{s.n_generated} tokens, {s.tokens_per_second:.1f} tokens/s, acceptance {s.acceptance_rate:.1%}, "
                f"mean accepted length {s.mean_accepted_length:.2f}, relaxed {s.n_relaxed}, "
                f"prompt {s.n_prompt} tokens ({s.n_prompt_evaluated} evaluated)"
            )
        if name == "/verify":
            if arg not in ("strict", "mars"):
                return "usage: /verify strict|mars"
            self.config = replace(self.config, verify=arg)
            return f"(verification: {arg})"
        if name == "/theta":
            try:
                value = float(arg)
                self.config = replace(self.config, theta=value)
            except (ValueError, MarsError):
                return "usage: /theta X with X in (0, 1]"
            return f"(theta = {value})"
        if name == "/system":
            self.system = arg or None
            self.messages.clear()
            return "(system prompt set; conversation reset)" if arg else "(system prompt cleared)"
        return f"unknown command {name}; /help lists them"


@app.command()
@opt.generation_options
def chat(
    n_predict: int = typer.Option(512, "-n", "--n-predict", "--predict", help="Maximum tokens per answer."),
    system: Optional[str] = typer.Option(None, "--system", "-sys", help="System prompt."),
    show_acceptance: bool = typer.Option(False, "--show-acceptance", "--color-draft", help="Colour tokens by origin."),
    gen: opt.GenOptions = None,
) -> None:
    """Chat with a model in the terminal (/help for commands, Ctrl-D to leave)."""
    if system is not None:
        system = opt.valid_utf8(system, "--system")
    choice = gen.choice()
    cfg = gen.config(choice, n_predict)
    eng = gen.engine(choice)
    if not eng.target.chat_template():
        eng.close()
        raise MarsError(f"{choice.label} has no chat template; use `mars run` instead")
    session = ChatSession(eng, cfg, system, reserve=n_predict)
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False, soft_wrap=True)

    def show(chunk):
        if show_acceptance:
            line = Text()
            for tok, kind in zip(chunk.tokens, chunk.kinds):
                line.append(eng.target.piece(tok).decode("utf-8", "replace"), style=KIND_STYLE.get(kind, ""))
            console.print(line, end="")
        else:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()

    echo(f"mars chat with {choice.label} (drafter: {choice.drafter}, verify: {cfg.verify}); /help for commands")
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
    try:
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                echo("")
                break
            except KeyboardInterrupt:
                echo("")
                continue
            line = opt.valid_utf8(line, "this message")
            if not line.strip():
                continue
            if line.startswith("/"):
                reply = session.command(line)
                if reply is None:
                    break
                echo(reply)
                continue
            try:
                session.ask(line, show)
            except MarsError as exc:
                echo(f"error: {exc}", err=True)
                continue
            except KeyboardInterrupt:  # before the answer started (rendering the prompt)
                echo("\n(stopped)", err=True)
                continue
            if not session.interrupted:
                sys.stdout.write("\n")
                sys.stdout.flush()
            if session.cut_by_context:
                echo(f"note: the answer stopped at the end of the context ({eng.n_ctx} tokens); "
                     "/reset or a larger -c makes room", err=True)
    finally:
        eng.close()
