"""A scripted engine for CLI tests (as simonw/llm's MockModel): no GGUF, no llama.cpp.

It has the Engine's surface that the CLI and the server use.  Tokens are bytes: a
text prompt is its UTF-8 bytes, a chat prompt is ``<role>content`` per message
(so its length is known), and the answer is ``reply`` (with ``{prompt}``
replaced by the prompt text), ``chunk`` tokens per chunk, their kinds cycling
through ``kinds``.  It records every call (``calls``: prompt text and
GenerateConfig; ``configs``: the configs alone), stops like the real engine
("eog" at the end of the reply, "length" at max_tokens (-1: no limit),
"context" when the context is full, "stop" before the first stop string, whose
text is not shown), repeats the reply with ``ignore_eos``, gives made-up
log probabilities (token t: -t/1000, its top alternatives t, t+1, ...) with
``logprobs``, and can be told to raise Ctrl-C after some chunks or a
MarsError for some prompts.  The fixture records the Engine's keyword
arguments in ``opened`` (``chat_template`` among them).

The ``fake_engine`` fixture below puts it where the CLI opens its Engine
(conftest.py lists this module in ``pytest_plugins``: every test may ask for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from mars_local import Chunk, Generation
from mars_local.core.config import TokenLogprob
from mars_local.chat.session import check_messages
from mars_local.chat.tokens import PromptTooLong, TokenizingCancelled
from mars_local.core.errors import MarsError
from mars_local.core.stats import SpecStats
from mars_local.speculate.target_access import TargetAccess


class FakeStream:
    """Chunks with the stats beside them, as Engine.stream's result."""

    def __init__(self, chunks, stats: SpecStats):
        self._chunks, self.stats = chunks, stats

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()

    def cancel(self) -> None:  # (nothing in progress to stop between two chunks here)
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class FakeEngine:
    reply: str = "fake answer"
    chunk: int = 3  # tokens per chunk
    kinds: tuple[str, ...] = ("draft", "relaxed", "target")
    n_ctx_asked: int = 4096  # -c (0 = the training context)
    n_ctx_train: int = 1024
    has_chat_template: bool = True
    n_threads: int = 0  # 0: no busy-CPU note (a test sets it)
    max_draft: int = 63  # the most draft tokens a round verifies (Engine.max_draft)
    eog_ids: tuple[int, ...] = (0,)  # byte 0 ends a generation, as an end-of-generation token would
    interrupt_after: int | None = None  # raise KeyboardInterrupt after this many chunks
    fail_on: str | None = None  # a prompt containing this text is refused with a MarsError
    calls: list = field(default_factory=list)  # (prompt, config) of every stream
    tool_syntax: str | None = None  # the chat template's tool-call syntax (tool_format())
    tools_seen: list = field(default_factory=list)  # (tools, tool_choice) of every chat prompt
    closed: bool = False

    # ---------------------------------------------------------- context sizes
    @property
    def n_ctx_requested(self) -> int:
        return self.n_ctx_asked or self.n_ctx_train

    @property
    def n_ctx(self) -> int:
        """Rounded up to a multiple of 256, as llama.cpp does."""
        return -(-self.n_ctx_requested // 256) * 256

    # ---------------------------------------------------------- tokens
    def piece(self, token: int, special: bool = False) -> bytes:
        return bytes([token])

    def tokenize(self, text: str, *, max_tokens: int | None = None, cancelled=None) -> list[int]:
        """Bytes; with ``max_tokens``, a longer text is PromptTooLong and ``cancelled()`` is asked
        first (as the real engine does between fragments)."""
        if cancelled is not None and cancelled():
            raise TokenizingCancelled()
        toks = list(text.encode("utf-8"))
        if max_tokens is not None and len(toks) > max_tokens:
            raise PromptTooLong(len(toks), max_tokens, exact=True)
        return toks

    def detokenize(self, tokens) -> str:
        return bytes(tokens).decode("utf-8", "replace")

    def chat_prompt(self, messages, *, max_tokens: int | None = None, cancelled=None, tools=None,
                    tool_choice=None) -> list[int]:
        if not self.has_chat_template:
            raise MarsError("fake.gguf has no chat template; prompt it without chat formatting")
        check_messages(list(messages))
        self.tools_seen.append((tools, tool_choice))
        return self.tokenize("".join(f"<{m['role']}>{m['content']}" for m in messages), max_tokens=max_tokens,
                             cancelled=cancelled)

    def tool_format(self) -> str | None:
        return self.tool_syntax

    tool_prompt = TargetAccess.tool_prompt  # the Engine's own, over this fake's chat_prompt and tool_format

    @property
    def configs(self) -> list:
        """The GenerateConfig of every stream, in order."""
        return [c for _, c in self.calls]

    @staticmethod
    def logprob(token: int, n_top: int) -> TokenLogprob:
        return TokenLogprob(token, -token / 1000, tuple((token + j, -(token + j) / 1000) for j in range(n_top)))

    # ---------------------------------------------------------- generation
    def stream(self, prompt, config) -> FakeStream:
        toks = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        text = self.detokenize(toks)
        if self.fail_on is not None and self.fail_on in text:
            raise MarsError(f"the fake engine refuses prompts with {self.fail_on!r}")
        if len(toks) >= self.n_ctx:
            raise MarsError(f"the prompt is {len(toks)} tokens but the context holds {self.n_ctx}")
        self.calls.append((text, config))
        stats = SpecStats(n_prompt=len(toks), n_prompt_evaluated=len(toks), adaptive=config.adaptive)
        answer = list(self.reply.replace("{prompt}", text).encode("utf-8"))
        return FakeStream(self._chunks(toks, answer, config, stats), stats)

    def _chunks(self, toks, answer, config, stats):
        room = self.n_ctx - len(toks)
        limit = room if config.max_tokens == -1 else min(config.max_tokens, room)
        if config.ignore_eos and answer:  # no end of generation: the reply again and again
            answer = (answer * (limit // len(answer) + 1))[:limit]
        n = min(len(answer), limit)
        stop = ("eog" if n == len(answer) and not config.ignore_eos
                else "length" if n == config.max_tokens else "context")
        shown = n  # tokens whose text is shown
        hits = [(bytes(answer[:n]).find(s.encode("utf-8")), s) for s in config.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:  # the tokens up to the one that completes the first stop string; its text is not shown
            i, s = min(hits, key=lambda h: h[0] + len(h[1].encode("utf-8")))
            n, shown, stop = i + len(s.encode("utf-8")), i, "stop"
        sent = 0
        try:
            for i in range(0, n, self.chunk):
                if self.interrupt_after is not None and i // self.chunk == self.interrupt_after:
                    raise KeyboardInterrupt
                new = answer[i:min(i + self.chunk, n)]
                kinds = [self.kinds[(i + j) % len(self.kinds)] for j in range(len(new))]
                stats.record_round(len(new) - 1, len(new) - 1, kinds.count("relaxed"), len(new))
                stats.time_total_s += 0.001 * len(new)
                sent += len(new)
                if sent == n:
                    stats.stop_reason = stop
                text = self.detokenize(answer[i:min(i + self.chunk, shown)]) if i < shown else ""
                lps = [self.logprob(t, config.logprobs) for t in new] if config.logprobs else None
                yield Chunk(new, text, kinds, lps)
        except (GeneratorExit, KeyboardInterrupt):
            stats.stop_reason = stats.stop_reason or "interrupted"
            raise

    def generate(self, prompt, config) -> Generation:
        text, toks, kinds, lps = [], [], [], []
        with self.stream(prompt, config) as s:
            for c in s:
                text.append(c.text)
                toks += c.tokens
                kinds += c.kinds
                lps += c.logprobs or []
        return Generation("".join(text), toks, kinds, s.stats, lps if config.logprobs else None)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_engine(monkeypatch) -> FakeEngine:
    """The FakeEngine every `mars` command opens in this test (set its fields
    before invoking); ``opened`` holds the arguments the CLI built the engine with."""
    import mars_local.speculate.batch_cost
    import mars_local.speculate.engine

    eng = FakeEngine()
    eng.opened = []

    def open_fake(target, draft=None, **kw):
        eng.opened.append({"target": target, "draft": draft, **kw})
        eng.n_ctx_asked = kw.get("n_ctx", 4096)
        return eng

    monkeypatch.setattr(mars_local.speculate.engine, "Engine", open_fake)
    # it decodes one sequence at a time (no Scheduler over it): the default --parallel (auto) is 1
    # for it; the batched paths are tested on real tiny models
    monkeypatch.setattr(mars_local.speculate.batch_cost, "auto_parallel", lambda engine, *a, **kw: 1)
    return eng
