"""mars-local: speculative decoding on llama.cpp, verified strictly or with MARS.

Python API (see README.md, "Python API")::

    from mars_local import Engine

    with Engine("target.gguf", draft="draft.gguf") as eng:      # load once
        out = eng.generate("Hello", max_tokens=64, verify="mars", theta=0.9)
        print(out.text, out.stats.mean_accepted_length)
        for chunk in eng.stream("Another prompt", temperature=0.7, seed=1):
            print(chunk.text, end="")

The verification rules are pure functions in :mod:`mars_local.core.verify`.

The engine's names are imported on first use (PEP 562), so ``import
mars_local.core.verify`` (or sampling, adaptive, stats, drafters, learned, errors)
does not load llama.cpp: the engine and llama-cpp-python load when
:class:`Engine` is first named, and llama.cpp's backend starts with the first
model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Pure modules (numpy only), imported now: ``mars_local.verify`` is the function
# (the rules' module is ``mars_local.core.verify``).
from .core.errors import MarsError
from .core.sampling import SamplingParams
from .core.verify import VerifyConfig, VerifyResult, verify

__version__ = "0.1.0"

# lazily exported name -> the submodule that defines it
_LAZY = {
    "Chunk": "core.config",
    "Engine": "speculate.engine",
    "GenerateConfig": "core.config",
    "Generation": "core.config",
    "Scheduler": "speculate.batched",
    "SpecStats": "core.stats",
    "Stream": "core.config",
}

__all__ = [
    "Chunk",
    "Engine",
    "GenerateConfig",
    "Generation",
    "MarsError",
    "SamplingParams",
    "Scheduler",
    "SpecStats",
    "Stream",
    "VerifyConfig",
    "VerifyResult",
    "verify",
    "__version__",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from .speculate.engine import Engine
    from .core.config import Chunk, GenerateConfig, Generation, Stream
    from .core.stats import SpecStats
    from .speculate.batched import Scheduler


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
