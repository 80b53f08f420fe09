"""What callers need from an Engine's target outside a generation: its sizes, tokens, chat
template, and teacher-forced logits and scores (the Engine's base class: the Engine owns the
model and the contexts; these read them, one generation at a time)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from ..core.errors import MarsError

__all__ = ["TargetAccess"]


class TargetAccess:
    """Needs ``target`` (a llama.runtime.Model), ``_ctx`` (its Context), ``_chat_template_arg``,
    ``_chat_formatter`` and ``_check_idle()`` from the Engine."""

    # ------------------------------------------------------------ the models
    @property
    def n_ctx(self) -> int:
        """The context size in use (llama.cpp rounds a requested size up to a multiple of 256)."""
        return self._ctx.n_ctx

    @property
    def n_threads(self) -> int:
        """The CPU threads the target decodes with (-t, or the physical cores)."""
        return self._ctx.n_threads

    @property
    def n_ctx_requested(self) -> int:
        """The context size asked for (n_ctx=0 asks for the training context)."""
        return self._ctx.n_ctx_requested

    @property
    def n_ctx_train(self) -> int:
        """The target's training context; a larger n_ctx works but may degrade output."""
        return self.target.n_ctx_train

    @property
    def eog_ids(self) -> tuple[int, ...]:
        """The target's end-of-generation token ids."""
        return self.target.eog_ids

    @property
    def has_chat_template(self) -> bool:
        """Whether :meth:`chat_prompt` has a template: the Engine's chat_template, or the GGUF's own."""
        return self._chat_template_arg is not None or bool(self.target.chat_template())

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True, *,
                 max_tokens: int | None = None, cancelled: Callable[[], bool] | None = None) -> list[int]:
        """Token ids of ``text``.  With ``max_tokens``, a text of more tokens raises
        :class:`~mars_local.chat.tokens.PromptTooLong` as soon as that is known, in time
        linear in the text (``cancelled``, asked along the way, raises
        :class:`~mars_local.chat.tokens.TokenizingCancelled`); the ids are the same."""
        if max_tokens is None and cancelled is None:
            return self.target.tokenize(text, add_special=add_special, parse_special=parse_special)
        from ..chat.tokens import tokenize_text

        return tokenize_text(self.target, text, add_special=add_special, parse_special=parse_special,
                             max_tokens=max_tokens, cancelled=cancelled)

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        return self.target.detokenize(tokens, special=special)

    def piece(self, token: int, special: bool = False) -> bytes:
        """The UTF-8 bytes of one token (a piece of a character, possibly)."""
        return self.target.piece(token, special=special)

    def chat_prompt(self, messages: Sequence[dict], *, max_tokens: int | None = None,
                    cancelled: Callable[[], bool] | None = None, tools: Sequence[dict] | None = None,
                    tool_choice=None) -> list[int]:
        """Token ids of ``messages`` rendered with the target's own chat template.

        The GGUF ``tokenizer.chat_template`` is rendered in a bounded Jinja2
        sandbox with llama-cpp-python's semantics (the generation prompt for
        the assistant's turn appended); control tokens are parsed in the
        template's markup only, never in message text (see
        :mod:`mars_local.chat.template`).  Every failure is one MarsError.
        ``max_tokens`` and ``cancelled`` bound the work as in :meth:`tokenize`.
        ``tools`` (OpenAI function definitions) and ``tool_choice`` go to the template's
        variables of those names; tool text holding control-token text is refused (it would
        be template markup, where control tokens are parsed).
        """
        from ..chat.session import check_messages
        from ..chat.tokens import tokenize_chat

        check_messages(list(messages), roles=None)  # the template decides which roles it knows
        template = self._chat_template()
        if tools:
            template = self._with_tools(template, tools, tool_choice, messages)
        return tokenize_chat(template, self.target, list(messages), max_tokens=max_tokens, cancelled=cancelled)

    def _with_tools(self, template, tools, tool_choice, messages):
        import json

        from ..chat.template import WithTools
        from ..chat.tokens import special_text

        calls = [m.get("tool_calls") for m in messages if m.get("tool_calls")]
        found = special_text(self.target, json.dumps([list(tools), calls], ensure_ascii=False))
        if found:
            raise MarsError(f"the tools (or the tool calls of the messages) contain the control token {found!r}; "
                            "remove it", field="tools")
        return WithTools(template, tools, tool_choice)

    def tool_prompt(self, messages: Sequence[dict], tools, choice, config, *, parallel: bool = True, **bounds):
        """(prompt tokens, config, call syntax or None) of a chat whose answer may call ``tools``
        (chat.tools.Tool) as ``choice`` (chat.tools.ToolChoice) allows: rendered with them, a
        forced call (``required`` or a named function; ``parallel``: one or more) constraining
        ``config`` with its grammar; with "auto" the same grammar is lazy (``grammar_triggers``): the
        answer is free text until it opens a call, then the call is constrained, unless ``config``
        has a grammar of its own (which then applies alone); ``choice`` "none" renders no tools
        and parses nothing.  ``bounds`` go to :meth:`chat_prompt`.  MarsError (field "tools") when
        the template has no call syntax mars-local can parse, or a forced call meets another grammar."""
        from dataclasses import replace

        from ..chat.tool_grammar import call_markers, tool_triggers, tools_gbnf
        from ..chat.tools import SUPPORTED_FORMATS, template_choice, template_tools
        from .grammar_check import check_grammar_text

        if not tools or choice.mode == "none":
            return self.chat_prompt(messages, **bounds), config, None
        fmt = self.tool_format()
        if fmt not in SUPPORTED_FORMATS:
            raise MarsError("the model's chat template has no tool-call syntax mars-local can parse (it knows "
                            f"{', '.join(SUPPORTED_FORMATS)}: Qwen2.5/3 and Hermes, Llama 3.1+, Mistral); give one "
                            "with --chat-template FILE", field="tools")
        if choice.mode in ("required", "function") and config.grammar is not None:
            raise MarsError("a tool choice that forces a call has its own grammar: leave out "
                            "--grammar/--json-schema/--format (grammar/json_schema/format)", field="tools")
        config = replace(config, visible_special=call_markers(fmt))  # the parser must see them
        if config.grammar is None:  # the calls' grammar; with "auto", waiting for a call to open
            grammar = tools_gbnf(fmt, tools, choice, parallel)
            check_grammar_text(grammar)  # bounded work, as for any grammar
            lazy = tool_triggers(fmt) if choice.mode == "auto" else ()
            config = replace(config, grammar=grammar, grammar_triggers=lazy)
        prompt = self.chat_prompt(messages, tools=template_tools(tools, choice), tool_choice=template_choice(choice),
                                  **bounds)
        return prompt, config, fmt

    def tool_format(self) -> str | None:
        """The tool-call syntax of the chat template: one of mars_local.chat.tools.SUPPORTED_FORMATS,
        "unknown" (it renders tools in a syntax mars-local cannot parse), or None (it renders no
        tools, or there is no chat template)."""
        from ..chat.template import ChatTemplate
        from ..chat.tools import tool_format

        try:
            template = self._chat_template()
        except MarsError:
            return None
        return tool_format(template.source) if isinstance(template, ChatTemplate) else None

    def _chat_template(self):
        """The Engine's chat_template (a llama.cpp built-in's name or Jinja
        text), else the GGUF's own; MarsError when there is none."""
        from ..chat.builtin import make_chat_template

        if self._chat_formatter is None:
            self._chat_formatter = make_chat_template(self.target, Path(self.target.path).name,
                                                      self._chat_template_arg)
        return self._chat_formatter

    def _token_ids(self, tokens: Sequence[int]) -> list[int]:
        toks = [int(t) for t in tokens]
        bad = [t for t in toks if not 0 <= t < self.target.n_vocab]
        if bad:
            raise MarsError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.target.n_vocab - 1})")
        return toks

    def _prompt_tokens(self, prompt: str | Sequence[int]) -> list[int]:
        toks = self.tokenize(prompt) if isinstance(prompt, str) else self._token_ids(prompt)
        if not toks:
            raise MarsError("the prompt is empty")
        if len(toks) >= self.n_ctx:
            asked = f" (asked for {self.n_ctx_requested})" if self.n_ctx_requested != self.n_ctx else ""
            raise MarsError(
                f"the prompt is {len(toks)} tokens but the context holds {self.n_ctx}{asked}; "
                "use a larger -c or a shorter prompt"
            )
        return toks

    # ------------------------------------------------------ teacher forcing
    def _forward(self, tokens: Sequence[int], n_rows: int) -> Iterator[tuple[int, np.ndarray]]:
        """Evaluate ``tokens`` in the target; yield (i, rows) for the last
        ``n_rows`` positions, a batch at a time (views, valid until the next
        one).  The cache holds ``tokens[:-n_rows]`` afterwards (a prefix the
        next call or generation reuses)."""
        self._check_idle()
        toks = self._token_ids(tokens)
        if not 1 <= n_rows <= len(toks):
            raise ValueError(f"n_rows must be in 1..{len(toks)}, got {n_rows}")
        ctx, keep = self._ctx, len(toks) - n_rows
        ctx.sync(toks[:keep])
        try:
            for i in range(0, n_rows, ctx.n_batch):
                chunk = toks[keep + i : keep + i + ctx.n_batch]
                yield i, ctx.eval(chunk, n_out=len(chunk))
        finally:
            ctx.truncate(keep)

    def logits(self, tokens: Sequence[int], n_rows: int = 1) -> np.ndarray:
        """The target's logits (an (n_rows, n_vocab) float32 copy) for the last
        ``n_rows`` positions of ``tokens``: row i predicts the token after
        ``tokens[len(tokens) - n_rows + i]``.  Not during a generation."""
        out = np.empty((n_rows, self.target.n_vocab), dtype=np.float32)
        for i, z in self._forward(tokens, n_rows):
            out[i : i + len(z)] = z
        return out

    def score_nll(self, prompt: Sequence[int], continuation: Sequence[int]) -> np.ndarray:
        """Per-token negative log-likelihood (nats, at T = 1) of ``continuation``
        following ``prompt`` under the target, in batches of rows; the prompt
        stays cached (minus its last token) for the next call or generation."""
        prompt, cont = self._token_ids(prompt), self._token_ids(continuation)
        if not cont:
            return np.zeros(0)
        if not prompt:
            raise MarsError("the prompt is empty")
        out = np.empty(len(cont))
        for i, z in self._forward(prompt + cont[:-1], len(cont)):
            z = np.asarray(z, dtype=np.float64)
            zmax = z.max(axis=1)
            lse = zmax + np.log(np.exp(z - zmax[:, None]).sum(axis=1))
            out[i : i + len(z)] = lse - z[np.arange(len(z)), cont[i : i + len(z)]]
        return out

