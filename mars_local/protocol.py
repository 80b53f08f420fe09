"""What the command line and the chat and batch modules need of an engine.

:class:`mars_local.speculate.engine.Engine` is the implementation; ``tests/fake_engine.py``
is a scripted one (as simonw/llm's ``MockModel``), so that the CLI's parsing,
rendering and errors are tested without loading a GGUF.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable


class StreamLike(Protocol):
    """What ``stream()`` returns: an iterator of chunks (``.tokens``, ``.text``,
    ``.kinds``) with ``close()`` and ``stats`` (a SpecStats, final once the
    stream is exhausted or closed)."""

    stats: Any

    def __iter__(self) -> Iterator[Any]: ...

    def __next__(self) -> Any: ...

    def close(self) -> None: ...


@runtime_checkable
class EngineLike(Protocol):
    """The Engine surface the CLI, :mod:`mars_local.chat.session` and :mod:`mars_local.batch.jobs` use."""

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

    def stream(self, prompt: str | Sequence[int], config: Any = None) -> StreamLike: ...

    def generate(self, prompt: str | Sequence[int], config: Any = None) -> Any:
        """A Generation (``.text``, ``.tokens``, ``.kinds``, ``.stats``, ``.to_dict()``)."""
        ...

    def close(self) -> None: ...
