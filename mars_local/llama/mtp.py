"""A target's own multi-token-prediction (MTP, "nextn") layers, run as a draft context.

Models such as MiMo, GLM-4.5, DeepSeek-V3 and Qwen3.5 ship one or more nextn layers after their
trunk.  llama.cpp runs them in a second context of the same model (``ctx_type = MTP``, whose
``ctx_other`` is the target's context), one row per position p taking the token t_p and the
target's hidden state h_{p-1} (the trunk's last hidden row at p-1, before the output norm) and
predicting t_{p+1} (``../shared/notes/mtp-eagle3.md``).

:func:`open_mtp` gives a target (a lone :class:`~mars_local.llama.context.Context` or the
sequences of a :class:`~mars_local.llama.streams.MultiContext`) an :class:`MtpContext`: a
MultiContext over the MTP context, one sequence per target sequence in a unified cache, whose
views (:class:`MtpView`) have the Context interface, so the decisions of
:class:`~mars_local.speculate.drafters.ModelDrafter` (draft sampling, p_min, controls,
confidence keys) and the scheduler's lockstep drafting run on it unchanged.  What a row of
sequence s at position p is fed:

* p <= the target sequence's ``n_past`` (a token the target has evaluated): h_{p-1} from its
  captured hidden rows (``capture_hidden``); zeros for p = 0;
* a later position (a draft token): the MTP layer's own output hidden row of p-1 (chained
  drafting, as llama.cpp's ``draft-mtp``).

Rows fed by the MTP layer's own hidden state are drafts: :attr:`MtpView.n_exact` counts the
leading positions fed by the target's, and a view never keeps more than those past a truncate,
so the next round evaluates accepted drafts again with the target's hidden rows (in the decode
that drafts its first token).  Memory: the target keeps n_ctx x n_embd float32 hidden rows per
sequence.  With several nextn layers the first one drafts every position (the chained use
llama.cpp makes of a single head); the others are not run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..core.errors import MarsError
from .backend import C
from .context import Context
from .gguf_file import check_gguf_file, gguf_metadata
from .recurrent import supports_rollback
from .streams import MultiContext, SeqView

__all__ = ["MtpContext", "MtpView", "open_mtp", "mtp_layers", "check_mtp_model", "MTP_ARCHS", "RECURRENT_MTP_ARCHS"]

# architectures whose nextn layers llama.cpp (the pinned release) runs in an MTP context
MTP_ARCHS = frozenset({
    "bailingmoe3", "cohere2moe", "deepseek2", "deepseek32", "deepseek4", "glm-dsa", "glm4moe", "glm5-next",
    "hy-v3", "mimo2", "nemotron_h_moe", "qwen35", "qwen35moe", "qwen3next", "step35",
})
# of those, hybrid models with recurrent layers: rolling their state back needs n_rs_seq snapshots,
# which llama.cpp keeps for some of them (llama/recurrent.py; not qwen3next)
RECURRENT_MTP_ARCHS = frozenset({"qwen35", "qwen35moe", "qwen3next", "nemotron_h_moe"})


def mtp_layers(path: str | Path) -> tuple[str, int]:
    """(architecture, number of nextn layers) from the GGUF header, before loading (pure Python)."""
    meta = gguf_metadata(Path(path))
    arch = str(meta.get("general.architecture", ""))
    n = meta.get(f"{arch}.nextn_predict_layers", 0)
    return arch, int(n) if isinstance(n, int) else 0


def check_mtp_model(path: str | Path) -> int:
    """The number of nextn layers of the model at ``path``, or one MarsError line saying why
    ``--drafter mtp`` cannot draft with it (checked before llama.cpp loads anything: an MTP
    context on a model loaded without its nextn layers aborts the process)."""
    check_gguf_file(Path(path))  # missing, not GGUF, truncated: said before what the header lacks
    arch, n = mtp_layers(path)
    name = Path(path).name
    if n <= 0:
        raise MarsError(
            f"{name} has no multi-token-prediction (nextn) layers, so --drafter mtp cannot draft with it; "
            "use a model that ships them (e.g. MiMo, GLM-4.5, Qwen3.5 MTP GGUFs), a draft model "
            "(-md DRAFT.gguf) or --drafter ngram", field="drafter")
    if arch in RECURRENT_MTP_ARCHS and not supports_rollback(arch):
        raise MarsError(
            f"{name} ({arch}) has recurrent layers whose state llama.cpp cannot roll back after a rejected "
            "draft, so --drafter mtp (and any speculation) cannot run on it; use --no-draft", field="drafter")
    if arch not in MTP_ARCHS:
        raise MarsError(f"{name}: llama.cpp cannot run the nextn layers of {arch or 'unknown'} models "
                        f"(it can for {', '.join(sorted(m for m in MTP_ARCHS if m not in RECURRENT_MTP_ARCHS or supports_rollback(m)))})",
                        field="drafter")
    return n


def open_mtp(target: Context | MultiContext) -> "MtpContext":
    """The MTP context of ``target`` (its model loaded with ``load_mtp``), the target set to
    keep the hidden rows it reads."""
    model, n_embd = target.model, target.model.n_embd
    target.capture_hidden(n_embd)
    seqs = target.seqs if isinstance(target, MultiContext) else [target]
    return MtpContext(model, seqs, target._ctx, target.n_ctx, n_embd, target.n_batch, target.n_threads)


class MtpContext(MultiContext):
    """One sequence per target sequence (``targets``: Contexts or SeqViews with ``n_past`` and
    ``hidden``), in the MTP context of the target's llama_context ``other``."""

    def __init__(self, model, targets, other, n_ctx_seq: int, n_embd: int, n_batch: int, n_threads: int):
        def configure(cp):
            cp.ctx_type = C.LLAMA_CONTEXT_TYPE_MTP
            cp.ctx_other = other

        self.n_embd = n_embd
        super().__init__(model, len(targets), n_ctx_seq, n_batch, n_threads, unified=True,
                         configure=configure, n_embd_in=n_embd)
        from llama_cpp import llama_cpp_ext  # the llama-ext.h bindings of the pinned release

        llama_cpp_ext.llama_set_embeddings_nextn(self._ctx, True, True)  # its own hidden rows, for output rows
        self._own_hidden = llama_cpp_ext.llama_get_embeddings_nextn_ith
        for view, t in zip(self.seqs, targets):
            view.target = t

    def _view(self, i: int) -> "MtpView":
        return MtpView(self, i)

    def _fill_embeddings(self, view: "MtpView", start: int, out: np.ndarray) -> None:
        for j in range(len(out)):
            out[j] = view.input_row(start + j)

    def _decoded(self, layout, n_rows: int) -> None:
        i = 0
        for s, p0, n, n_out in layout:
            v = self.seqs[s]
            if v.n_exact == len(v.tokens):  # no draft row below: the rows the target fed extend it
                v.n_exact = p0 + sum(1 for p in range(p0, p0 + n) if p <= v.target.n_past)
            if n_out:  # the last row's own hidden state feeds the next draft position
                ptr = self._own_hidden(self._ctx, i + n - 1)  # by batch row, as llama_get_logits_ith
                v.own = (p0 + n - 1, np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy())
            i += n

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        n = min(n, self.seqs[src].n_exact)
        if n > 0:
            super().copy_prefix(src, dst, n)
            self.seqs[dst].n_exact, self.seqs[dst].own = n, None


class MtpView(SeqView):
    """One sequence of an :class:`MtpContext` (the Context interface)."""

    def __init__(self, owner: MtpContext, seq_id: int):
        super().__init__(owner, seq_id)
        self.target = None  # the target sequence whose hidden rows feed this one
        self.n_exact = 0  # leading positions fed by the target's hidden rows (not drafts)
        self.own: tuple[int, np.ndarray] | None = None  # (position, the MTP layer's hidden row there)

    def input_row(self, p: int) -> np.ndarray:
        """h_{p-1}: the target's hidden row, or for a draft position the MTP layer's own."""
        if p == 0:
            return np.zeros(self.owner.n_embd, np.float32)
        if p <= self.target.n_past:
            return self.target.hidden[p - 1]
        if self.own is None or self.own[0] != p - 1:
            raise RuntimeError(f"MTP: no hidden row for position {p - 1} (a draft evaluated out of order)")
        return self.own[1]

    def truncate(self, n_keep: int) -> None:
        """Drop positions >= n_keep, and every row a draft fed (past :attr:`n_exact`)."""
        super().truncate(min(n_keep, self.n_exact))
        self.n_exact = min(self.n_exact, self.n_past)
        if self.own is not None and self.own[0] >= self.n_past:
            self.own = None
