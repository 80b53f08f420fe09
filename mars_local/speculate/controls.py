"""Controls that depend on the text so far, honoured inside verify windows.

A verify window scores positions 0..k of [last, d_0 .. d_{k-1}] in one
forward; row i continues the committed tokens plus drafts d_0 .. d_{i-1}.  A
control that looks at the history (penalties, a grammar) must therefore see,
at row i, exactly that history, and whatever it learns from d_i must be
forgotten when d_i is rejected.  :class:`Controls` holds the committed state of
one generation; :meth:`Controls.window` opens a cursor that walks a window (or
a draft being made) row by row and is dropped afterwards: rollback is not
advancing the committed state.

Per row, in this order (llama.cpp's sampler chain puts the grammar and the
penalties before top-k/top-p/min-p/temperature; the verification rule and
the sampling pipeline then see the processed row):

1. grammar: tokens the grammar forbids next → -inf (llama.cpp's grammar
   sampler, :class:`mars_local.speculate.grammar.GrammarState`);
2. ``ignore_eos``: end-of-generation tokens → -inf (unless the grammar
   allows nothing else: a finished document must be able to end);
3. penalties (llama.cpp's definitions, float32): for each token seen c > 0
   times among the last ``repeat_last_n`` tokens of the history (prompt
   included, as llama-cli; -1: all of it), z ← z·r if z ≤ 0 else z/r, then
   z ← z − c·frequency − presence.

Because the target's row i and the draft model's row at the same position
get the same processing over their own history, strict verification stays
lossless (greedy: the argmax of the processed row; sampling: rejection
sampling between the processed p and q).  MARS compares the top-2 of the
processed row, so under a grammar its runner-up is always an allowed token:
MARS never relaxes into a forbidden token, and a forbidden draft token has
logit -inf, which no rule accepts.

Pure numpy apart from the grammar object, which the engine passes in.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..core.config import GenerateConfig
from ..core.errors import MarsError

__all__ = ["Controls", "Window", "StopScanner", "apply_penalties", "GRAMMAR_DEAD_END"]

# the target's row after the grammar's mask has no token left: the grammar cannot be continued
GRAMMAR_DEAD_END = ("the grammar allows no token after the output so far (none of the model's tokens continues "
                    "any of its rules: check the grammar, e.g. a character class that matches nothing)")


def apply_penalties(row: np.ndarray, history: Sequence[int], cfg: GenerateConfig) -> None:
    """llama.cpp's repeat/presence/frequency penalties over the tail of ``history``, in place (float32)."""
    if not cfg.penalized or not len(history):
        return
    n = cfg.repeat_last_n
    tail = history if n < 0 else history[-n:]
    ids, counts = np.unique(np.asarray(tail, dtype=np.int64), return_counts=True)
    ids_ok = ids < len(row)
    ids, counts = ids[ids_ok], counts[ids_ok].astype(np.float32)
    z = row[ids].astype(np.float32)
    r = np.float32(cfg.repeat_penalty)
    z = np.where(z <= 0, z * r, z / r).astype(np.float32)
    z -= counts * np.float32(cfg.frequency_penalty) + np.float32(cfg.presence_penalty)
    row[ids] = z


def rows_read(cfg: GenerateConfig) -> int:
    """How many of a processed row's best tokens the loop reads (0: all of it): greedy strict
    the argmax, greedy MARS the top 2, top-k sampling k.  Log probabilities and --ignore-eos
    (which must know whether anything but EOG is allowed) read whole rows."""
    if cfg.logprobs or cfg.ignore_eos:
        return 0
    s = cfg.sampling
    if s.greedy:
        return 2 if cfg.verify == "mars" else 1
    return max(s.top_k, 2) if s.top_k > 0 else 0


class Controls:
    """The history-dependent controls of one generation (None-free: check :attr:`active`)."""

    def __init__(self, cfg: GenerateConfig, eog_ids: Sequence[int], grammar=None):
        self.cfg = cfg
        self.eog = np.asarray(sorted(eog_ids), dtype=np.int64)
        self.grammar = grammar  # the committed state (a GrammarState), or None
        self.active = grammar is not None or cfg.ignore_eos or cfg.penalized
        self.need = rows_read(cfg)

    def window(self, history: Sequence[int]) -> "Window":
        """A cursor at the end of ``history`` (the committed tokens)."""
        return Window(self, list(history), self.grammar.clone() if self.grammar is not None else None)

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance the committed state by generated tokens (none of them an end-of-generation token)."""
        if self.grammar is not None:
            for t in tokens:
                self.grammar.accept(t)

    def process_window(self, history: Sequence[int], logits: np.ndarray, draft: Sequence[int]) -> None:
        """Process the rows of a verify window in place: row i as if d_0 .. d_{i-1} were committed.

        Stops after the first draft token the grammar forbids: the rule rejects
        it (its logit is -inf), so the rows after it are never read.
        """
        w = self.window(history)
        try:
            for i in range(len(logits)):
                w.apply(logits[i])
                if self.grammar is not None and logits[i].max() == -np.inf:  # (NaN: the verify rule says so)
                    raise MarsError(GRAMMAR_DEAD_END, field="grammar")  # (the request's grammar)
                if i == len(draft) or not w.push(int(draft[i]), logits[i]):
                    break
        finally:
            w.close()

    def close(self) -> None:
        if self.grammar is not None:
            self.grammar.close()


class Window:
    """One walk from the committed state along proposed tokens (see :class:`Controls`)."""

    def __init__(self, controls: Controls, history: list[int], grammar):
        self.c, self.history, self.grammar = controls, history, grammar

    def apply(self, row: np.ndarray, need: int | None = None) -> None:
        """Process the row for the next position, in place (penalties and the grammar
        mask commute: a penalty leaves -inf at -inf).  ``need``: how many of the row's
        best tokens the caller reads (default :func:`rows_read`; 0: the whole row)."""
        c = self.c
        apply_penalties(row, self.history, c.cfg)
        if self.grammar is not None:
            self.grammar.mask(row, c.need if need is None else need)
        if c.cfg.ignore_eos and c.eog.size:
            eog = c.eog[c.eog < len(row)]
            if self.grammar is None or _finite_outside(row, eog):
                row[eog] = -np.inf

    def push(self, token: int, row: np.ndarray) -> bool:
        """Advance by ``token`` (the row it was chosen from, as processed); False if the
        token is forbidden there (then the walk must stop: nothing after it is valid).
        A row processed for its best few tokens (``need``) may leave a forbidden token
        below them finite: the grammar's own check refuses it here."""
        if token >= len(row) or not np.isfinite(row[token]):
            return False
        if self.grammar is not None:
            if token in self.c.eog:
                return False  # a finished document: nothing follows
            if not self.grammar.try_accept(token):
                return False
        self.history.append(token)
        return True

    def close(self) -> None:
        if self.grammar is not None:
            self.grammar.close()
            self.grammar = None


def _finite_outside(row: np.ndarray, ids: np.ndarray) -> bool:
    """Whether some logit other than those of ``ids`` is above -inf."""
    saved = row[ids].copy()
    row[ids] = -np.inf
    ok = bool(np.isfinite(row.max()))
    row[ids] = saved
    return ok


class StopScanner:
    """Finds stop strings in streamed text, whatever the token and window boundaries.

    :meth:`feed` takes the next piece of text and returns what may be shown
    now: text that cannot be the start of a stop string.  The longest tail
    that is a prefix of some stop string is held back until later text
    decides it; once a stop string completes, everything before it is
    returned and :attr:`stopped` is set (the stop string and what follows are
    never returned).  :meth:`flush` releases the held-back tail at the end.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped or not text:
            return ""
        if not self.stops:
            return text
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return buf[: min(hits)]
        hold = self._held_tail(buf)
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _held_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for n in range(min(len(buf), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
