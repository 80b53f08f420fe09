"""Speculative decoding over llama.cpp: the engine and what its loop is made of.

Owns :class:`Engine` and its loop (:mod:`.engine`), the drafters (:mod:`.drafters`), the
draft-length controller and what it learns (:mod:`.adaptive`, :mod:`.controllers`,
:mod:`.learned`), generation controls (penalties, end-of-generation masking: :mod:`.controls`),
grammars (:mod:`.grammar`) and the native twin of the verification rules (:mod:`.native`).
May import: :mod:`mars_local.core`, :mod:`mars_local.llama`, :mod:`mars_local.chat`.
"""
