"""The one owner of llama.cpp state: models, contexts, the backend and its devices.

Owns :class:`Model` and :class:`Context` (:mod:`.runtime`), RPC servers (:mod:`.rpc`), GGUF
header checks (:mod:`.gguf_file`) and the batch-invariance check of the kernels
(:mod:`.invariance`).  Nothing outside this package calls llama-cpp-python's low-level API,
except :mod:`mars_local.speculate.grammar`, which owns llama.cpp's grammar sampler.
May import: :mod:`mars_local.core`.
"""
