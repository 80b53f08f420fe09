"""A multi-turn conversation over an engine, independent of any terminal.

Each turn renders the whole conversation with the model's chat template and
hands the tokens to the engine, which keeps the target's and the draft's KV
caches and evaluates only what differs from the previous turn (usually the new
user message).  When the conversation outgrows the context, the oldest turns
are dropped (the system prompt stays).

:meth:`ChatSession.ask` yields events and never prints; ``mars chat``
(:mod:`mars_local.cli.chat`) renders them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

from ..core.choices import VERIFY_METHODS
from ..core.errors import MarsError

ROLES = ("system", "user", "assistant", "tool")

HELP = """commands:
  /help            this help
  /reset           forget the conversation (keeps the system prompt)
  /stats           statistics of the last answer
  /verify MODE     strict or mars
  /theta X         MARS threshold in (0, 1]
  /system TEXT     set the system prompt (and reset)
  /quit            leave (Ctrl-D works too; Ctrl-C stops an answer)
a line starting with \"\"\" opens a multi-line message, a line ending with \"\"\" ends it;
lines pasted together are one message"""


BLOCK = '"""'  # a line starting with it opens a multi-line message; one ending with it closes it


@dataclass(frozen=True)
class Message:
    """What the user typed: ``text``, and whether it is a slash command (one
    typed line starting with ``/``, not part of a block or a paste)."""

    text: str
    command: bool = False


def read_message(read_line: Callable[[str], str], waiting: Callable[[], bool] = lambda: False,
                 prompt: str = ">>> ", more: str = "... ") -> Message:
    """The next message from ``read_line(prompt)`` (which raises EOFError at
    the end of input, as ``input`` does; ``more`` is the prompt of further lines).

    * A line starting with ``\"\"\"`` opens a multi-line message that runs to
      the line ending with ``\"\"\"`` (``\"\"\"one line\"\"\"`` is one line);
      the quotes are dropped, and so is a quote line left empty.
    * Lines that ``waiting()`` says have already arrived (a paste) join the
      message of the line before them, as do the lines of a read that
      returned several at once (a bracketed paste).
    * The end of input ends the message being read (an open block too); with
      nothing read, EOFError propagates.  Ctrl-C (KeyboardInterrupt) propagates
      and drops the message being assembled.
    """
    pending: list[str] = []
    lines: list[str] = []
    reads = 0
    in_block = block_seen = False
    try:
        while True:
            if not pending:
                got = read_line(prompt if reads == 0 else more).split("\n")
                reads += 1
                if len(got) > 1 and got[-1] == "":
                    got.pop()  # a paste ending with a newline
                pending.extend(got)
            line = pending.pop(0)
            if in_block:
                if line.endswith(BLOCK):
                    line, in_block = line[: -len(BLOCK)], False
                    if line:
                        lines.append(line)
                else:
                    lines.append(line)
            elif line.startswith(BLOCK):
                line, block_seen = line[len(BLOCK):], True
                if len(line) >= len(BLOCK) and line.endswith(BLOCK):
                    line = line[: -len(BLOCK)]  # \"\"\"one line\"\"\"
                else:
                    in_block = True
                if line:
                    lines.append(line)
            else:
                lines.append(line)
            if not (in_block or pending or waiting()):
                break
    except EOFError:
        if reads == 0:
            raise
    command = reads == 1 and len(lines) == 1 and not block_seen and lines[0].startswith("/")
    return Message("\n".join(lines), command)


def short_json(value) -> str:
    """A value as JSON, kept short (for messages about bad input)."""
    try:
        s = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        s = repr(value)
    return s if len(s) <= 40 else s[:37] + "..."


def check_messages(msgs, roles: tuple[str, ...] | None = ROLES) -> None:
    """A non-empty list of ``{"role", "content"}`` objects with a known role
    (any string when ``roles`` is None: a template may know others) and string
    content; one MarsError naming the item and the field otherwise."""
    if not isinstance(msgs, list) or not msgs:
        raise MarsError(f"'messages' must be a non-empty list of {{role, content}} objects, got {short_json(msgs)}")
    for i, m in enumerate(msgs, start=1):
        where = f"'messages' item {i}"
        if not isinstance(m, dict):
            raise MarsError(f"{where} must be an object with 'role' and 'content', got {short_json(m)}")
        if not isinstance(m.get("role"), str) or (roles is not None and m["role"] not in roles):
            got = short_json(m["role"]) if "role" in m else "nothing"
            allowed = f"one of {', '.join(roles)}" if roles is not None else "a string"
            raise MarsError(f"{where}: 'role' must be {allowed}, got {got}")
        if not isinstance(m.get("content"), str):
            got = short_json(m["content"]) if "content" in m else "nothing"
            raise MarsError(f"{where}: 'content' must be a string, got {got}")


# ------------------------------------------------------------------ events
@dataclass(frozen=True)
class ContextDropped:
    """The oldest ``turns`` user turns (with their answers) were dropped to make room."""

    turns: int


@dataclass(frozen=True)
class Text:
    """A piece of the answer: ``chunk`` is the engine's Chunk (tokens, text, kinds)."""

    chunk: Any

    @property
    def text(self) -> str:
        return self.chunk.text


@dataclass(frozen=True)
class Interrupted:
    """Ctrl-C stopped the answer; what was said so far is kept."""


@dataclass(frozen=True)
class TurnDone:
    """The end of a turn: its statistics, and whether Ctrl-C or the end of the
    context (rather than -n or the end of the answer) stopped it."""

    answer: str
    stats: Any
    interrupted: bool = False
    cut_by_context: bool = False


Event = Union[ContextDropped, Text, Interrupted, TurnDone]


class ChatSession:
    """The conversation state and the slash commands."""

    def __init__(self, engine, config, system: Optional[str] = None, reserve: int = 256):
        self.engine = engine
        self.config = config
        self.system = system
        self.messages: list[dict] = []
        self.last_stats = None
        self.reserve = reserve  # tokens kept free for the answer

    def _all_messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def prompt_tokens(self) -> tuple[list[int], int]:
        """The rendered conversation and how many old turns were dropped so that
        it fits (with ``reserve`` tokens, at most a quarter of the context, left
        for the answer); MarsError when the newest message alone does not fit."""
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

    def ask(self, text: str) -> Iterator[Event]:
        """One turn, as events: ContextDropped (maybe), Text per chunk, Interrupted
        (Ctrl-C during generation), then TurnDone.

        The answer so far is kept in the conversation however the turn ends
        (Ctrl-C, or the consumer closing this iterator); a message that cannot
        be rendered or cannot fit raises MarsError and changes nothing.
        """
        before = list(self.messages)
        self.messages.append({"role": "user", "content": text})
        try:
            toks, dropped = self.prompt_tokens()
        except BaseException:
            self.messages = before  # nothing of the conversation is lost
            raise
        if dropped:
            try:
                yield ContextDropped(dropped)
            except GeneratorExit:  # closed before the answer started: no turn
                self.messages.pop()
                raise
        room = self.engine.n_ctx - len(toks) - 1
        limit = room if self.config.unlimited else min(self.config.max_tokens, room)
        cfg = replace(self.config, max_tokens=max(1, limit))
        parts: list[str] = []
        interrupted = False
        stream = self.engine.stream(toks, cfg)
        try:
            try:
                for chunk in stream:
                    parts.append(chunk.text)
                    yield Text(chunk)
            except KeyboardInterrupt:
                interrupted = True
        finally:  # also when the consumer stops early (GeneratorExit)
            stream.close()
            self.last_stats = stream.stats
            self.messages.append({"role": "assistant", "content": "".join(parts)})
        if interrupted:
            yield Interrupted()
        s = self.last_stats
        cut = False
        if s is not None and not interrupted:
            # the answer was cut by the context, not by -n: the engine stops with
            # "length" when the cap above, not -n, was the limit
            asked = room + 1 if self.config.unlimited else self.config.max_tokens
            capped = cfg.max_tokens < asked and s.n_generated >= cfg.max_tokens
            cut = s.stop_reason == "context" or (s.stop_reason == "length" and capped)
        yield TurnDone("".join(parts), s, interrupted, cut)

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
            if arg not in VERIFY_METHODS:
                return f"usage: /verify {'|'.join(VERIFY_METHODS)}"
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
