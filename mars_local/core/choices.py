"""The allowed values of the string options, declared once.

Each is a ``Literal`` type (for annotations) and the tuple of its values (for
validation and messages).  Pure: importing it loads nothing else.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["VerifyMethod", "VERIFY_METHODS", "DrafterKind", "DRAFTERS", "DraftSampling", "DRAFT_SAMPLINGS"]

VerifyMethod = Literal["strict", "mars"]
VERIFY_METHODS: tuple[VerifyMethod, ...] = get_args(VerifyMethod)

DrafterKind = Literal["model", "ngram", "none"]
DRAFTERS: tuple[DrafterKind, ...] = get_args(DrafterKind)

DraftSampling = Literal["greedy", "sample"]
DRAFT_SAMPLINGS: tuple[DraftSampling, ...] = get_args(DraftSampling)
