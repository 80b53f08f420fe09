"""OpenAI response objects from the engine's chunks and stats (pure: no llama.cpp).

Chat: ``chat.completion`` and ``chat.completion.chunk``; completions:
``text_completion`` (streamed as chunks of the same object).  Every
``usage`` carries ``speculative``: what drafting did for this request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ..core.config import TokenLogprob
from ..core.stats import SpecStats

__all__ = ["finish_reason", "usage", "chat_logprobs", "completion_logprobs", "ResponseMaker"]

_FINISH = {"eog": "stop", "stop": "stop", "length": "length", "context": "length"}


def finish_reason(stop_reason: str) -> str:
    """OpenAI's finish_reason for a SpecStats.stop_reason (a full context is "length", as llama-server)."""
    return _FINISH.get(stop_reason, "stop")


def speculative_usage(s: SpecStats) -> dict:
    return {
        "drafted": s.n_drafted,
        "accepted": s.n_accepted,
        "relaxed": s.n_relaxed,
        "rounds": s.n_rounds,
        "mean_accepted_length": s.mean_accepted_length,
        "acceptance_rate": s.acceptance_rate,
    }


def cached_tokens(s: SpecStats) -> int:
    """Prompt tokens taken from the KV cache (the prompt's last token is always run, in the first
    window); 0 where the prompt's evaluation never ended (a request cancelled or failed while
    waiting or during its prefill: what it did not evaluate was not taken from a cache either)."""
    if not s.time_prompt_target_s:  # (set as the target's prefill ends, in both engines)
        return 0
    return max(s.n_prompt - 1 - s.n_prompt_evaluated, 0)


def usage(s: SpecStats) -> dict:
    return {
        "prompt_tokens": s.n_prompt,
        "completion_tokens": s.n_generated,
        "total_tokens": s.n_prompt + s.n_generated,
        "prompt_tokens_details": {"cached_tokens": cached_tokens(s)},
        "speculative": speculative_usage(s),
    }


Piece = Callable[[int], bytes]


def _token(piece: Piece, t: int) -> tuple[str, list[int]]:
    b = piece(t)
    return b.decode("utf-8", errors="replace"), list(b)


def chat_logprobs(lps: Sequence[TokenLogprob], piece: Piece, n_top: int) -> dict:
    """Chat's ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for lp in lps:
        text, raw = _token(piece, lp.token)
        top = []
        for t, v in lp.top[:n_top]:
            tt, tb = _token(piece, t)
            top.append({"token": tt, "logprob": v, "bytes": tb})
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(lps: Sequence[TokenLogprob], piece: Piece, n_top: int, offset: int = 0) -> dict:
    """Completions' ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset (from ``offset``)."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text = _token(piece, lp.token)[0]
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({_token(piece, t)[0]: v for t, v in lp.top[:n_top]})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class ResponseMaker:
    """The objects of one response (same id and creation time throughout)."""

    def __init__(self, kind: str, model: str, request_id: str, n_top: int, logprobs: bool):
        self.kind, self.model, self.id = kind, model, request_id
        self._pieces: dict[int, bytes] = {}  # token id -> bytes, for log probabilities
        self.n_top, self.want_logprobs = n_top, logprobs
        self.created = int(time.time())
        self._offset = 0  # completions' text_offset of the next token
        self.n_calls = 0  # tool calls streamed so far

    def add_pieces(self, pieces: dict[int, bytes] | None) -> None:
        """The bytes of tokens the next log probabilities name (looked up on the engine's thread)."""
        if pieces:
            self._pieces.update(pieces)

    def piece(self, token: int) -> bytes:
        return self._pieces[token]

    def _object(self, obj: str, choices: list, **more) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **more}

    def _logprobs(self, lps: Sequence[TokenLogprob] | None) -> dict | None:
        if not self.want_logprobs:
            return None
        lps = lps or []
        if self.kind == "chat":
            return chat_logprobs(lps, self.piece, self.n_top)
        out = completion_logprobs(lps, self.piece, self.n_top, self._offset)
        self._offset += sum(len(t) for t in out["tokens"])
        return out

    # --------------------------------------------------------- whole responses
    def complete(self, text: str, logprobs: Sequence[TokenLogprob] | None, stats: SpecStats) -> dict:
        reason = finish_reason(stats.stop_reason)
        lp = self._logprobs(logprobs)
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": lp, "finish_reason": reason}
            return self._object("chat.completion", [choice], usage=usage(stats))
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}
        return self._object("text_completion", [choice], usage=usage(stats))

    def complete_tools(self, text: str, fmt: str, logprobs: Sequence[TokenLogprob] | None, stats: SpecStats) -> dict:
        """A chat answer that may hold tool calls in the template's syntax ``fmt``: the calls go
        to ``message.tool_calls`` (finish_reason "tool_calls", or "length" where the answer was
        cut short: an unfinished last call is dropped), the rest is the content."""
        from ..chat.tools import openai_calls, parse_tool_calls, was_cut

        cut = was_cut(stats.stop_reason)
        content, calls = parse_tool_calls(fmt, text, cut=cut)
        if not calls and not cut:
            return self.complete(text, logprobs, stats)
        message = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = openai_calls(calls)
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(logprobs),
                  "finish_reason": finish_reason(stats.stop_reason) if cut else "tool_calls"}
        return self._object("chat.completion", [choice], usage=usage(stats))

    def tool_chunks(self, events) -> list[dict]:
        """Stream chunks of chat.tools' parser events: content deltas, and a call's id and name
        then its arguments, as OpenAI streams ``tool_calls[i]``."""
        from ..chat.tools import ContentDelta, ToolCallStart

        out = []
        for ev in events:
            if isinstance(ev, ContentDelta):
                if ev.text:
                    out.append(self._chunk({"content": ev.text}, None, None))
            elif isinstance(ev, ToolCallStart):
                self.n_calls += 1
                call = {"index": ev.index, "id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}}
                out.append(self._chunk({"tool_calls": [call]}, None, None))
            else:
                out.append(self._chunk({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.delta}}]},
                                       None, None))
        return out

    # ---------------------------------------------------------------- streams
    def _chunk(self, delta_or_text, logprobs, reason: str | None) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "delta": delta_or_text, "logprobs": logprobs, "finish_reason": reason}
            return self._object("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": delta_or_text, "logprobs": logprobs, "finish_reason": reason}
        return self._object("text_completion", [choice])

    def first(self) -> dict | None:
        """A chat stream opens with the assistant's role (completions have no such chunk)."""
        return self._chunk({"role": "assistant", "content": ""}, None, None) if self.kind == "chat" else None

    def piece_chunk(self, text: str, logprobs: Sequence[TokenLogprob] | None) -> dict:
        delta = {"content": text} if self.kind == "chat" else text
        return self._chunk(delta, self._logprobs(logprobs), None)

    def last(self, stats: SpecStats) -> dict:
        reason = finish_reason(stats.stop_reason)
        if self.n_calls and reason != "length":  # (calls, then cut short: "length", as OpenAI)
            reason = "tool_calls"
        return self._chunk({} if self.kind == "chat" else "", None, reason)

    def usage_chunk(self, stats: SpecStats) -> dict:
        """``stream_options.include_usage``: a last chunk with no choices and the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._object(obj, [], usage=usage(stats))
