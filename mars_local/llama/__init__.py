"""The one owner of llama.cpp state: models, contexts, the backend and its devices.

Owns :class:`Model` (:mod:`.runtime`), :class:`Context` (:mod:`.context`) and many sequences
in one context (:mod:`.streams`), the backend's start and log (:mod:`.backend`), devices and
RPC servers (:mod:`.rpc`), GGUF header checks (:mod:`.gguf_file`), llama.cpp's built-in chat
templates (:mod:`.templates`), vocabulary facts for chat tokenizing (:mod:`.vocab`) and the
batch-invariance check of the kernels (:mod:`.invariance`).  Nothing outside this package
calls llama-cpp-python's low-level API, except :mod:`mars_local.speculate.grammar` (llama.cpp's
grammar sampler: a per-generation state the engine clones along each draft) and
:mod:`mars_local.speculate.native` (the patched build's verify kernel).
May import: :mod:`mars_local.core`.
"""
