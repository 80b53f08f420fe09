"""A model's own chat template, rendered in a bounded sandbox.

Rendering follows llama-cpp-python's ``Jinja2ChatFormatter`` (the semantics of
Hugging Face chat templates): an immutable sandbox with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a pass-through
``{% generation %}`` tag, a ``tojson`` filter that keeps non-ASCII text, and the
variables ``messages``, ``bos_token``, ``eos_token``, ``add_generation_prompt``
(True), ``raise_exception``, ``strftime_now``, ``tools``, ``tool_choice``,
``functions`` and ``function_call``.

A GGUF file is untrusted input, so rendering is bounded (:mod:`.sandbox`, which
imports Jinja2 when a template is first compiled, holds the limits):

* ``*`` / ``**`` / ``+`` / ``%`` on strings and lists, the string methods and
  filters that pad, replace or join, and ``str.format`` widths are refused when
  the result would exceed ``SIZE_LIMIT`` characters (or items) plus four
  times the size of the messages; ``range`` is capped at ``MAX_RANGE``;
* the output is generated chunk by chunk and refused past the same size;
* ``~`` concatenation, printed values and the arguments of calls and
  filters are measured (nested lists included) against the same limit;
* rendering is refused after ``TIME_LIMIT`` seconds, checked on every
  intercepted operator, call, filter, output chunk and every 1024 iterations
  of each ``{% for %}`` loop and ``range`` (so an empty loop body cannot spin);
  recursion ends at Python's recursion limit.

Every failure (syntax error, ``raise_exception``, a limit) is a
:class:`MarsError` naming the model file, and the template line where Jinja
knows it.

Tokenizing the rendered prompt so that message text cannot become control
tokens is :mod:`mars_local.chat.tokens`'s job
(:func:`~mars_local.chat.tokens.tokenize_chat`).
"""

from __future__ import annotations

import math
import time
from datetime import datetime
from typing import Sequence

from ..core.errors import MarsError

__all__ = ["ChatTemplate", "WithTools"]


class _TemplateRaised(Exception):
    """raise_exception() was called by the template."""


def _template_line(tb) -> int | None:
    """The template line of the innermost frame of rendered template code."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _strftime_now(f: str) -> str:
    return datetime.now().strftime(f)


class ChatTemplate:
    """A compiled chat template of one model (``name`` is used in messages)."""

    def __init__(self, source: str, name: str, *, bos_token: str = "", eos_token: str = ""):
        import jinja2

        from .sandbox import build_env

        self.source, self.name = source, name
        self.bos_token, self.eos_token = bos_token, eos_token
        self._env = build_env()
        try:
            self._template = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            where = f" at line {exc.lineno}" if exc.lineno else ""
            raise MarsError(f"the chat template of {name} has a syntax error{where}: {_one_line(exc.message)}") from None
        except Exception as exc:
            raise MarsError(f"the chat template of {name} cannot be compiled: {_one_line(str(exc))}") from None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True, *,
               tools: Sequence[dict] | None = None, tool_choice=None) -> str:
        """The prompt text; a MarsError naming the model on any failure or limit.  ``tools``:
        OpenAI function definitions for the template's ``tools`` variable (as Hugging Face's
        ``apply_chat_template(tools=...)`` passes them)."""
        from .sandbox import SIZE_LIMIT, SIZE_PER_INPUT, TIME_LIMIT, RenderLimit

        def raise_exception(message):
            raise _TemplateRaised(str(message))

        env = self._env
        n_in = sum(len(str(m.get("content") or "")) + len(str(m.get("role") or "")) for m in messages)
        if tools:
            import json

            n_in += len(json.dumps(list(tools)))
        env.limit = SIZE_LIMIT + SIZE_PER_INPUT * n_in
        env.deadline = time.monotonic() + TIME_LIMIT
        parts: list[str] = []
        total = 0
        try:
            for chunk in self._template.generate(
                messages=[dict(m) for m in messages],
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                raise_exception=raise_exception,
                add_generation_prompt=add_generation_prompt,
                functions=None,
                function_call=None,
                tools=list(tools) if tools else None,
                tool_choice=tool_choice,
                strftime_now=_strftime_now,
            ):
                total += len(chunk)
                if total > env.limit:
                    raise RenderLimit(f"the rendered prompt would exceed {env.limit:,} characters")
                env._tick()
                parts.append(chunk)
        except RenderLimit as exc:
            raise MarsError(f"the chat template of {self.name} was refused: {exc}") from None
        except _TemplateRaised as exc:
            raise MarsError(f"the chat template of {self.name} refused the messages: {_one_line(str(exc))}") from None
        except Exception as exc:  # TemplateError, TypeError, RecursionError, SecurityError, ...
            line = _template_line(exc.__traceback__)
            where = f" at line {line}" if line else ""
            why = _one_line(str(exc)) or type(exc).__name__
            raise MarsError(f"the chat template of {self.name} failed{where}: {why}") from None
        finally:
            env.deadline = math.inf
        return "".join(parts)


class WithTools:
    """``template`` rendering with ``tools`` and ``tool_choice`` in its variables (what
    :func:`~mars_local.chat.tokens.tokenize_chat` renders when a request carries tools)."""

    def __init__(self, template: ChatTemplate, tools: Sequence[dict], tool_choice=None):
        if not isinstance(template, ChatTemplate):
            raise MarsError(f"the chat template {getattr(template, 'name', '')!r} is one of llama.cpp's built-ins, "
                            "which cannot render tools; use the model's own Jinja template (or --chat-template FILE)")
        self.template, self.tools, self.tool_choice = template, list(tools), tool_choice
        self.name, self.source = template.name, template.source
        self.prepend_bos = False

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages, add_generation_prompt, tools=self.tools, tool_choice=self.tool_choice)


def _one_line(s: str) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= 300 else s[:297] + "..."
