"""The allowed values of the string options, declared once, and their checks.

Each is a ``Literal`` type (for annotations) and the tuple of its values (for
validation and messages).  :func:`choice` is the one rule of a string option and
:func:`drafter_for` the one rule of the drafter against the draft model (a
MarsError with ``field``, as every rule of :mod:`.defaults`, which reads these
tuples).  Pure: imports only :mod:`.errors`.
"""

from __future__ import annotations

from typing import Literal, get_args

from .errors import MarsError

__all__ = ["VerifyMethod", "VERIFY_METHODS", "DrafterKind", "DRAFTERS", "BENCH_DRAFTERS", "FILE_DRAFTERS", "HEAD_DRAFTERS", "DraftSampling",
           "DRAFT_SAMPLINGS", "one_of", "choice", "drafter_for"]

VerifyMethod = Literal["strict", "mars"]
VERIFY_METHODS: tuple[VerifyMethod, ...] = get_args(VerifyMethod)

DrafterKind = Literal["model", "ngram", "mtp", "eagle3", "none"]
DRAFTERS: tuple[DrafterKind, ...] = get_args(DrafterKind)
BENCH_DRAFTERS: tuple[DrafterKind, ...] = ("ngram", "model", "mtp", "eagle3")  # what `mars bench` compares (plain always runs)
# drafters that read the -md file: a draft model, or an EAGLE-3 head (which reads the target's rows too)
FILE_DRAFTERS: tuple[DrafterKind, ...] = ("model", "eagle3")
# drafters reading the target's own rows (its MTP layers, an EAGLE-3 head): llama/mtp.py, llama/eagle3.py
HEAD_DRAFTERS: tuple[DrafterKind, ...] = ("mtp", "eagle3")

DraftSampling = Literal["greedy", "sample"]
DRAFT_SAMPLINGS: tuple[DraftSampling, ...] = get_args(DraftSampling)


def one_of(values) -> str:
    """"a or b", "one of a, b, c"."""
    values = [str(v) for v in values]
    return " or ".join(values) if len(values) == 2 else f"one of {', '.join(values)}"


def choice(value, allowed: tuple, field: str):
    """``value`` when it is one of ``allowed``; else MarsError naming ``field``."""
    if value not in allowed:
        raise MarsError(f"{field} must be {one_of(allowed)}, got {value!r}", field=field, subject=field)
    return value


def drafter_for(drafter: DrafterKind | None, has_draft: bool) -> DrafterKind:
    """The drafter asked for (None: the draft model when there is one, else none), checked
    against whether a draft model is given."""
    if drafter is None:
        drafter = "model" if has_draft else "none"
    choice(drafter, DRAFTERS, "drafter")
    if drafter == "model" and not has_draft:
        raise MarsError("the model drafter needs a draft model (-md DRAFT.gguf)", field="drafter")
    if drafter == "eagle3" and not has_draft:
        raise MarsError("the eagle3 drafter needs the target's EAGLE-3 head (-md HEAD.gguf)", field="drafter")
    if drafter not in FILE_DRAFTERS and has_draft:
        raise MarsError(f"a draft model was given but the drafter is {drafter!r}", field="drafter")
    return drafter
