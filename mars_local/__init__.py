"""mars-local: speculative decoding on llama.cpp, verified strictly or with MARS.

Python API (see README.md, "Python API")::

    from mars_local import Engine

    with Engine("target.gguf", draft="draft.gguf") as eng:      # load once
        out = eng.generate("Hello", max_tokens=64, verify="mars", theta=0.9)
        print(out.text, out.stats.mean_accepted_length)
        for chunk in eng.stream("Another prompt", temperature=0.7, seed=1):
            print(chunk.text, end="")

The verification rules are pure functions in :mod:`mars_local.verify`.
"""

from .engine import Chunk, Engine, GenerateConfig, Generation
from .errors import MarsError
from .sampling import SamplingParams
from .stats import SpecStats
from .verify import VerifyConfig, VerifyResult, verify

__version__ = "0.1.0"

__all__ = [
    "Chunk",
    "Engine",
    "GenerateConfig",
    "Generation",
    "MarsError",
    "SamplingParams",
    "SpecStats",
    "VerifyConfig",
    "VerifyResult",
    "verify",
    "__version__",
]
