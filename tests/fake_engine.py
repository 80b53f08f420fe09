"""A scripted engine for CLI tests (as simonw/llm's MockModel): no GGUF, no llama.cpp.

It implements :class:`mars_local.protocol.EngineLike`.  Tokens are bytes: a
text prompt is its UTF-8 bytes, a chat prompt is ``<role>content`` per message
(so its length is known), and the answer is ``reply`` (with ``{prompt}``
replaced by the prompt text), ``chunk`` tokens per chunk, their kinds cycling
through ``kinds``.  It records every call, stops like the real engine
("eog" at the end of the reply, "length" at max_tokens, "context" when the
context is full) and can be told to raise Ctrl-C after some chunks or a
MarsError for some prompts.

The ``fake_engine`` fixture below puts it where the CLI opens its Engine
(import the fixture into a test module to use it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from mars_local import Chunk, Generation
from mars_local.chat import check_messages
from mars_local.errors import MarsError
from mars_local.stats import SpecStats


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
    interrupt_after: int | None = None  # raise KeyboardInterrupt after this many chunks
    fail_on: str | None = None  # a prompt containing this text is refused with a MarsError
    calls: list = field(default_factory=list)  # (prompt, config) of every stream
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

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, tokens) -> str:
        return bytes(tokens).decode("utf-8", "replace")

    def chat_prompt(self, messages) -> list[int]:
        if not self.has_chat_template:
            raise MarsError("fake.gguf has no chat template; prompt it without chat formatting")
        check_messages(list(messages))
        return self.tokenize("".join(f"<{m['role']}>{m['content']}" for m in messages))

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
        n = min(len(answer), config.max_tokens, room)
        stop = "eog" if n == len(answer) else "length" if n == config.max_tokens else "context"
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
                yield Chunk(new, self.detokenize(new), kinds)
        except (GeneratorExit, KeyboardInterrupt):
            stats.stop_reason = stats.stop_reason or "interrupted"
            raise

    def generate(self, prompt, config) -> Generation:
        text, toks, kinds = [], [], []
        with self.stream(prompt, config) as s:
            for c in s:
                text.append(c.text)
                toks += c.tokens
                kinds += c.kinds
        return Generation("".join(text), toks, kinds, s.stats)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_engine(monkeypatch) -> FakeEngine:
    """The FakeEngine every `mars` command opens in this test (set its fields
    before invoking); ``opened`` holds the arguments the CLI built the engine with."""
    import mars_local.engine

    eng = FakeEngine()
    eng.opened = []

    def open_fake(target, draft=None, **kw):
        eng.opened.append({"target": target, "draft": draft, **kw})
        eng.n_ctx_asked = kw.get("n_ctx", 4096)
        return eng

    monkeypatch.setattr(mars_local.engine, "Engine", open_fake)
    return eng
