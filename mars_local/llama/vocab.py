"""Facts about a model's vocabulary that tokenizing a chat safely needs (llama.cpp's token
attributes and tokenizer type), for :mod:`mars_local.chat.tokens`."""

from __future__ import annotations

from .backend import C

__all__ = ["special_tokens", "user_defined_tokens", "splits_raw_text", "adds_eos"]


def _tokens_with(model, want: int) -> list[tuple[str, int, bool, bool]]:
    """(text, id, lstrip, rstrip) of every token with one of the attributes ``want`` and a text."""
    out = []
    for t in range(model.n_vocab):
        attr = int(C.llama_vocab_get_attr(model.vocab, t))
        if attr & want:
            text = model.token_text(t).decode("utf-8", errors="replace")
            if text:
                out.append((text, t, bool(attr & C.LLAMA_TOKEN_ATTR_LSTRIP), bool(attr & C.LLAMA_TOKEN_ATTR_RSTRIP)))
    return out


def special_tokens(model) -> list[tuple[str, int, bool, bool]]:
    """(text, id, lstrip, rstrip) of every token that llama.cpp's tokenizer
    parses as special only when asked to (control and unknown tokens)."""
    return _tokens_with(model, C.LLAMA_TOKEN_ATTR_CONTROL | C.LLAMA_TOKEN_ATTR_UNKNOWN)


def user_defined_tokens(model) -> list[tuple[str, int, bool, bool]]:
    """(text, id, lstrip, rstrip) of every user-defined token (also parsed as special only when asked)."""
    return _tokens_with(model, C.LLAMA_TOKEN_ATTR_USER_DEFINED)


def splits_raw_text(model) -> bool:
    """Whether the tokenizer is SentencePiece or BPE, which tokenize the fragments of raw text between
    special tokens independently and keep every byte (WordPiece and Unigram normalize text)."""
    return int(C.llama_vocab_type(model.vocab)) in (C.LLAMA_VOCAB_TYPE_SPM, C.LLAMA_VOCAB_TYPE_BPE)


def adds_eos(model) -> bool:
    """Whether the tokenizer appends the EOS token when asked to add special tokens."""
    return bool(C.llama_vocab_get_add_eos(model.vocab))
