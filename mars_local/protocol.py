"""What the command line and the chat and batch modules need of an engine.

:class:`mars_local.engine.Engine` is the implementation; ``tests/fake_engine.py``
is a scripted one (as simonw/llm's ``MockModel``), so that the CLI's parsing,
rendering and errors are tested without loading a GGUF.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EngineLike(Protocol):
    """The Engine surface the CLI, :mod:`mars_local.chat` and :mod:`mars_local.batch` use."""

    @property
    def n_ctx(self) -> int: ...

    @property
    def n_ctx_requested(self) -> int: ...

    @property
    def n_ctx_train(self) -> int: ...

    @property
    def has_chat_template(self) -> bool: ...

    def chat_prompt(self, messages: Sequence[dict]) -> list[int]: ...

    def piece(self, token: int) -> bytes: ...

    def stream(self, prompt: str | Sequence[int], config: Any = None) -> Iterator[Any]:
        """Chunks (``.tokens``, ``.text``, ``.kinds``); the iterator has ``close()``."""
        ...

    def generate(self, prompt: str | Sequence[int], config: Any = None) -> Any:
        """A Generation (``.text``, ``.tokens``, ``.kinds``, ``.stats``, ``.to_dict()``)."""
        ...

    def close(self) -> None: ...


def stream_stats(engine, stream):
    """The statistics of a stream (final once it is exhausted or closed)."""
    stats = getattr(stream, "stats", None)
    return stats if stats is not None else getattr(engine, "last_stats", None)
