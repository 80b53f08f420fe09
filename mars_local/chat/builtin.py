"""Chat templates chosen by the caller: llama.cpp's built-ins by name, or Jinja text.

``Engine(chat_template=...)`` (``--chat-template NAME|FILE``) takes either

* the name of one of llama.cpp's built-in templates (``chatml``, ``gemma``,
  ``llama3``, ``mistral-v7``, ``phi3``, ...; :func:`builtin_names` lists the
  ones this build knows), rendered by llama.cpp itself
  (``llama_chat_apply_template``): :class:`BuiltinChatTemplate`; or
* Jinja source text (it contains ``{{`` or ``{%``), rendered like a GGUF's own
  template by :class:`mars_local.chat.template.ChatTemplate` (the bounded
  sandbox, with ``bos_token`` and ``eos_token`` of the model).

llama.cpp's built-ins leave the BOS token to the tokenizer (its own callers
tokenize the rendered prompt with ``add_special``), so a built-in's prompt gets
the model's BOS token in front when the vocabulary asks for one and the render
does not already begin with it (``prepend_bos``; see
:func:`mars_local.chat.tokens.tokenize_chat`).  A Jinja template places
``bos_token`` itself, as a GGUF's own template does.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from ..core.errors import MarsError

__all__ = ["BuiltinChatTemplate", "builtin_names", "is_jinja", "check_chat_template", "make_chat_template"]


@lru_cache(maxsize=1)
def builtin_names() -> tuple[str, ...]:
    """The names of llama.cpp's built-in chat templates, sorted."""
    from ..llama.templates import builtin_template_names

    return builtin_template_names()


def is_jinja(value: str) -> bool:
    """Whether a chat_template value is Jinja source (rather than a built-in's name)."""
    return "{{" in value or "{%" in value


def check_chat_template(value: str) -> None:
    """Refuse a chat_template value that is neither a built-in's name nor Jinja
    that compiles (one MarsError line listing the built-in names)."""
    if not isinstance(value, str):
        raise MarsError(f"chat_template must be a built-in template's name or Jinja text, got {type(value).__name__}")
    if is_jinja(value):
        from .template import ChatTemplate

        ChatTemplate(value, "the given chat_template")  # a syntax error is one MarsError now
        return
    names = builtin_names()
    if value.strip() not in names:
        shown = value if len(value) <= 40 else value[:37] + "..."
        raise MarsError(
            f"unknown chat template {shown!r}: give Jinja template text, or one of llama.cpp's built-in "
            f"templates: {', '.join(names)}"
        )


class BuiltinChatTemplate:
    """One of llama.cpp's built-in chat templates, rendered by llama.cpp.

    ``name`` labels it in messages; ``source`` is the built-in's name (what the
    engine compares to know its template is current)."""

    prepend_bos = True  # llama.cpp's renders leave the BOS token to the tokenizer

    def __init__(self, builtin: str, name: str | None = None):
        builtin = builtin.strip()
        if is_jinja(builtin):
            raise MarsError("BuiltinChatTemplate takes a built-in template's name, not Jinja text")
        check_chat_template(builtin)
        self.source = builtin
        self.name = name or f"llama.cpp's built-in template {builtin!r}"
        self._tmpl = builtin.encode("utf-8")

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text as llama.cpp renders it (the assistant's turn opened
        when ``add_generation_prompt``); a MarsError naming the template when
        llama.cpp refuses the messages."""
        from ..llama.templates import apply_builtin_template

        pairs: list[tuple[bytes, bytes]] = []
        for i, m in enumerate(messages):
            role, content = str(m.get("role", "")), str(m.get("content") or "")
            pairs.append((self._utf8(i, "role", role), self._utf8(i, "content", content)))
        text = apply_builtin_template(self._tmpl, pairs, bool(add_generation_prompt))
        if text is None:
            raise MarsError(f"{self.name} cannot render these messages (llama.cpp refused them)")
        return text

    def _utf8(self, i: int, what: str, text: str) -> bytes:
        """Message ``i``'s ``what`` as the C string llama.cpp reads; MarsError when it cannot be one."""
        if "\0" in text:
            raise MarsError(f"message {i + 1}: the {what} contains a NUL character, which {self.name} cannot render")
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise MarsError(
                f"message {i + 1}: the {what} cannot be encoded as UTF-8 (a lone surrogate at character "
                f"{exc.start}); decode the input as UTF-8 first"
            ) from None


def make_chat_template(model, name: str, override: str | None):
    """The template of ``model`` (its file called ``name`` in messages): the
    built-in or Jinja text ``override`` when given, else the GGUF's own.
    MarsError when there is none."""
    from .template import ChatTemplate

    if override is not None and not is_jinja(override):
        return BuiltinChatTemplate(override, f"{name} (built-in chat template {override.strip()!r})")
    source = override if override is not None else model.chat_template()
    if not source:
        raise MarsError(
            f"{name} has no chat template; prompt it without chat formatting, or give one "
            "(chat_template / --chat-template NAME|FILE)"
        )

    def text(tok: int) -> str:
        return model.piece(tok, special=True).decode("utf-8", "replace") if tok >= 0 else ""

    label = name if override is None else f"{name} (the given chat template)"
    return ChatTemplate(source, label, eos_token=text(model.eos), bos_token=text(model.bos))
