"""Reading what the flags name (--file, --chat-template, --grammar/--json-schema/--format)
and opening the Engine the model flags describe.

Each returns what the API takes (text, an Engine) or raises a one-line MarsError before a
model loads.  Imports :mod:`.typed` only of the CLI (:mod:`.flags` imports this module).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

from .typed import decode_utf8, typed_flag, valid_utf8
from ..core.errors import MarsError
from ..core.textfile import MAX_PROMPT_BYTES, MAX_TEMPLATE_BYTES, decode_text, is_file_path, read_bytes

if TYPE_CHECKING:
    from ..models.registry import ModelChoice


def read_text_file(path: str, what: str, replace: bool = True, limit: int = MAX_PROMPT_BYTES) -> str:
    """A UTF-8 text file given on the command line (invalid bytes replaced with one
    warning, as standard input; ``replace=False``: refused); MarsError (one line)
    when it cannot be read or is over ``limit`` bytes."""
    raw = read_bytes(path, f"{what} file", limit)
    if not replace or b"\x00" in raw:
        return decode_text(raw, f"{what} file {path}")
    return decode_utf8(raw, f"{what} file {path}")


_TEMPLATE_SUFFIXES = (".jinja", ".jinja2", ".j2", ".tmpl", ".txt")


def chat_template_option(value: Optional[str]) -> Optional[str]:
    """--chat-template: Jinja text as given, an existing file's text, or a built-in
    template name (the Engine checks names); a value that looks like a path but
    is no file is an error here."""
    if value is None:
        return None
    if not value.strip():
        raise MarsError("--chat-template is empty; give a template name (e.g. chatml) or a Jinja file")
    if "{%" not in value and "{{" not in value and is_file_path(value):
        text = read_text_file(value, "chat template", replace=False, limit=MAX_TEMPLATE_BYTES)
        if not text.strip():
            raise MarsError(f"chat template file {value} is empty")
        return text
    value = valid_utf8(value, "--chat-template")
    if "{%" in value or "{{" in value:
        return value  # Jinja source text
    if os.sep in value or "/" in value or value.lower().endswith(_TEMPLATE_SUFFIXES):
        raise MarsError(f"chat template file not found: {value}")
    return value


def check_template(template: str, given: str) -> None:
    """A built-in template's name or Jinja that compiles (the Engine checks again), before
    standard input is read or a model loads; a file's Jinja errors name the file."""
    from ..chat.builtin import check_chat_template

    try:
        check_chat_template(template)
    except MarsError as exc:
        if template is given:
            raise
        raise MarsError(f"--chat-template {given}: {exc}") from None


def grammar_option(grammar: Optional[str], json_schema: Optional[str], fmt: Optional[str]) -> Optional[str]:
    """GBNF text for --grammar FILE (or GBNF text itself, as llama.cpp's --grammar),
    --json-schema FILE|JSON or --format json; at most one of them.  Inline text that is
    not UTF-8 has its bad bytes replaced (one warning, as every text argument); the
    grammar's size and complexity are checked here, before any model loads."""
    from ..speculate.grammar import is_inline_json, load_grammar_option
    from ..speculate.grammar_check import check_grammar_text

    if grammar is not None and "::=" in grammar and not is_file_path(grammar):
        others = [n for n, v in (("--json-schema", json_schema), ("--format", fmt)) if v is not None]
        if others:
            raise MarsError(f"--grammar and {' and '.join(others)} cannot be combined; give one")
        text = valid_utf8(grammar, "--grammar")  # inline GBNF, as llama.cpp's --grammar takes it
        check_grammar_text(text)
        return text
    if grammar is not None and not grammar.strip():
        raise MarsError("--grammar is empty; give a GBNF file")
    if json_schema is not None and not json_schema.strip():
        raise MarsError("--json-schema is empty; give a JSON Schema (inline JSON or a file)")
    if json_schema is not None and is_inline_json(json_schema):
        json_schema = valid_utf8(json_schema, typed_flag(("--json-schema", "-j")))
    text = load_grammar_option(grammar, json_schema, fmt)
    if text is not None and not text.strip():
        raise MarsError(f"the grammar file {grammar} is empty")
    if text is not None:
        check_grammar_text(text)
    return text


def open_engine(
    choice: "ModelChoice",
    n_ctx: int,
    n_gpu_layers: Optional[int],
    n_gpu_layers_draft: Optional[int],
    threads: Optional[int],
    fast_kernels: bool,
    chat_template: Optional[str] = None,
    rpc: Optional[str] = None,
    rpc_draft: bool = False,
    tensor_split: Optional[str] = None,
):
    """The Engine of checked flag values (:meth:`mars_local.cli.flags.GenOptions.check`)."""
    from ..speculate.engine import Engine  # looked up when called: tests put a fake engine there
    from ..llama.rpc import parse_endpoints, parse_tensor_split

    extra = {"chat_template": chat_template} if chat_template is not None else {}
    if rpc is not None:
        extra.update(rpc=parse_endpoints(rpc), rpc_draft=rpc_draft)
    if tensor_split is not None:
        extra["tensor_split"] = parse_tensor_split(tensor_split)
    return Engine(
        choice.target,
        choice.draft,
        drafter=choice.drafter,
        n_ctx=n_ctx,
        n_gpu_layers=n_gpu_layers,
        n_gpu_layers_draft=n_gpu_layers_draft,
        n_threads=threads,
        exact_kernels=not fast_kernels,
        **extra,
    )
