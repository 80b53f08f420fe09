"""The prompt-file schema and the built-in prompt set.

The built-in set is the JSONL files beside this module (one per category; the
line format is in README.md here), shipped as package data and read through
:mod:`importlib.resources`, so it is there in an installed wheel too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ...core.errors import MarsError
from ..metrics import METRICS

DEFAULT_PROMPTS_DIR = resources.files(__name__)


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: chat ``messages`` or a raw ``text`` prompt."""

    id: str
    category: str
    messages: tuple | None = None
    text: str | None = None
    reference: str | None = None
    metric: str | None = None

    @property
    def scored(self) -> bool:
        return self.metric is not None and self.reference is not None


def _prompt_from_line(obj, where: str, default_category: str) -> BenchPrompt:
    if not isinstance(obj, dict):
        raise MarsError(f"{where}: expected a JSON object")
    pid = obj.get("id", obj.get("question_id"))
    if isinstance(pid, bool) or not isinstance(pid, (str, int)) or str(pid).strip() == "":
        raise MarsError(f"{where}: missing 'id'")
    pid = str(pid)
    category = obj.get("category", default_category)
    if not isinstance(category, str) or not category.strip():
        raise MarsError(f"{where}: 'category' must be a non-empty string")
    messages, text = obj.get("messages"), obj.get("prompt")
    turns = obj.get("turns")  # MT-Bench / Spec-Bench question files: the first turn
    if messages is None and text is None and isinstance(turns, list) and turns and isinstance(turns[0], str):
        messages = [{"role": "user", "content": turns[0]}]
    if (messages is None) == (text is None):
        raise MarsError(f"{where}: give exactly one of 'messages' (a chat) or 'prompt' (a string)")
    if messages is not None:
        ok = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
        if not ok:
            raise MarsError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} strings")
        messages = tuple({"role": m["role"], "content": m["content"]} for m in messages)
    elif not isinstance(text, str) or not text.strip():
        raise MarsError(f"{where}: 'prompt' must be a non-empty string")
    metric = obj.get("metric")
    if metric is not None and metric not in METRICS:
        raise MarsError(f"{where}: unknown metric {metric!r}; expected one of {', '.join(METRICS)} or null")
    ref = obj.get("reference")
    if isinstance(ref, bool) or not (ref is None or isinstance(ref, (str, int, float))):
        raise MarsError(f"{where}: 'reference' must be a string, a number or null")
    return BenchPrompt(pid, category.strip(), messages, text, None if ref is None else str(ref), metric)


def load_prompts(paths: Sequence[str | os.PathLike] | None = None, categories: Sequence[str] | None = None) -> list[BenchPrompt]:
    """Read JSONL prompt files (default: the built-in set, one file per category).

    Each line: ``{"id", "category"?, "messages" | "prompt", "reference"?, "metric"?}``
    (see README.md beside this module).  A line without a category gets the
    file's stem.  ``categories`` keeps only those categories, in that order.
    Any problem is a :class:`MarsError` naming the file and line.
    """
    if not paths:
        paths = sorted((f for f in DEFAULT_PROMPTS_DIR.iterdir() if f.name.endswith(".jsonl")), key=lambda f: f.name)
        if not paths:
            raise MarsError(f"the built-in prompt set ({DEFAULT_PROMPTS_DIR}) is not installed; pass --prompts FILE.jsonl")
    prompts: list[BenchPrompt] = []
    for path in paths:
        if isinstance(path, (str, os.PathLike)):
            path = Path(path)  # else a Traversable of the built-in set
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise MarsError(f"cannot read prompts file {path}: {why}") from None
        seen: set[str] = set()
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise MarsError(f"{where}: not valid JSON ({exc.msg})") from None
            p = _prompt_from_line(obj, where, Path(path.name).stem)
            if p.id in seen:
                raise MarsError(f"{where}: duplicate id {p.id!r}")
            seen.add(p.id)
            prompts.append(p)
    if not prompts:
        raise MarsError("the prompts file(s) hold no prompts")
    if categories:
        have = list(dict.fromkeys(p.category for p in prompts))
        for c in categories:
            if c not in have:
                raise MarsError(f"unknown category {c!r}; the prompts have: {', '.join(have)}")
        order = {c: i for i, c in enumerate(dict.fromkeys(categories))}
        prompts = sorted((p for p in prompts if p.category in order), key=lambda p: order[p.category])
    return prompts


def quick_subset(prompts: Sequence[BenchPrompt], per_category: int = 1) -> list[BenchPrompt]:
    """The first ``per_category`` prompts of each category."""
    taken: dict[str, int] = {}
    out = []
    for p in prompts:
        if taken.get(p.category, 0) < per_category:
            taken[p.category] = taken.get(p.category, 0) + 1
            out.append(p)
    return out
