"""A target's own multi-token-prediction (MTP, "nextn") layers, run as a draft context.

Models such as MiMo, GLM-4.5, DeepSeek-V3 and Qwen3.5 ship one or more nextn layers after their
trunk.  llama.cpp runs them in a second context of the same model (``ctx_type = MTP``, whose
``ctx_other`` is the target's context), one row per position p taking the token t_p and the
target's hidden state h_{p-1} (the trunk's last hidden row at p-1, before the output norm) and
predicting t_{p+1} (``../shared/notes/mtp-eagle3.md``).

:class:`MtpContext` gives that context the interface of
:class:`~mars_local.llama.context.Context` (``tokens``, ``n_past``, ``n_ctx``, ``eval``,
``truncate``, ``sync``), so :class:`~mars_local.speculate.drafters.ModelDrafter`'s decisions
(draft sampling, p_min, controls, confidence keys) run on it unchanged.  What it feeds each row:

* position p <= the target's ``n_past`` (a token the target has evaluated): h_{p-1} from the
  target's captured hidden rows (:meth:`Context.capture_hidden`); zeros for p = 0;
* a later position (a draft token): the MTP layer's own output hidden row of p-1 (chained
  drafting, as llama.cpp's ``draft-mtp``).

Rows fed by the MTP layer's own hidden state are drafts: :attr:`MtpContext.n_exact` counts the
leading positions fed by the target's, and a rollback keeps at most those, so the next round
re-evaluates accepted drafts with the target's hidden rows (in the decode that drafts its first
token).  With several nextn layers the first one drafts every position (the chained use
llama.cpp makes of a single head); the others are not run.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from ..core.errors import MarsError
from ..core.tokens import common_prefix_len
from .backend import C
from .context import Context, OwnsContext, context_params, create_context
from .gguf_file import gguf_metadata

__all__ = ["MtpContext", "mtp_layers", "check_mtp_model", "MTP_ARCHS", "RECURRENT_MTP_ARCHS"]

# architectures whose nextn layers llama.cpp (the pinned release) runs in an MTP context
MTP_ARCHS = frozenset({
    "bailingmoe3", "cohere2moe", "deepseek2", "deepseek32", "deepseek4", "glm-dsa", "glm4moe", "glm5-next",
    "hy-v3", "mimo2", "nemotron_h_moe", "qwen35", "qwen35moe", "qwen3next", "step35",
})
# of those, hybrid models with recurrent layers: rolling their state back needs n_rs_seq snapshots
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
    arch, n = mtp_layers(path)
    name = Path(path).name
    if n <= 0:
        raise MarsError(
            f"{name} has no multi-token-prediction (nextn) layers, so --drafter mtp cannot draft with it; "
            "use a model that ships them (e.g. MiMo, GLM-4.5, Qwen3.5 MTP GGUFs), a draft model "
            "(-md DRAFT.gguf) or --drafter ngram", field="drafter")
    if arch in RECURRENT_MTP_ARCHS:
        raise MarsError(
            f"{name} ({arch}) has recurrent layers: rolling their state back after a rejected draft is "
            "not supported yet, so --drafter mtp (and any speculation) cannot run on it; use --no-draft",
            field="drafter")
    if arch not in MTP_ARCHS:
        raise MarsError(f"{name}: llama.cpp cannot run the nextn layers of {arch or 'unknown'} models "
                        f"(it can for {', '.join(sorted(MTP_ARCHS - RECURRENT_MTP_ARCHS))})", field="drafter")
    return n


def _ext():
    from llama_cpp import llama_cpp_ext  # the llama-ext.h bindings (experimental, exported by the pinned release)

    return llama_cpp_ext


class MtpContext(OwnsContext):
    """The MTP context of ``target`` (a Context whose model was loaded with its nextn layers)."""

    def __init__(self, target: Context):
        model = target.model
        cp, info = context_params(model, target.n_ctx, target.n_batch, target.n_threads)
        cp.ctx_type = C.LLAMA_CONTEXT_TYPE_MTP
        cp.ctx_other = target._ctx
        self.target = target
        self.model = model
        self._ctx = create_context(model, cp, info)
        self.n_ctx = int(C.llama_n_ctx(self._ctx))
        self.n_batch = info.n_batch
        self.n_embd = int(C.llama_model_n_embd(model._model))
        self.mem = C.llama_get_memory(self._ctx)
        ext = _ext()
        ext.llama_set_embeddings_nextn(self._ctx, True, True)  # its own hidden rows, for output rows
        self._get_hidden = ext.llama_get_embeddings_nextn_ith
        target.capture_hidden(self.n_embd)
        b = self._batch = C.llama_batch_init(self.n_batch, self.n_embd, 1)
        self._tok_buf = (C.llama_token * self.n_batch)()
        b.token = self._tok_buf  # rows carry a token and an embedding
        for i in range(self.n_batch):
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
        self._tok = np.ctypeslib.as_array(self._tok_buf, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        self._out = np.ctypeslib.as_array(ctypes.cast(b.logits, ctypes.POINTER(ctypes.c_int8)), shape=(self.n_batch,))
        self._emb = np.ctypeslib.as_array(b.embd, shape=(self.n_batch, self.n_embd))
        self.n_vocab = model.n_vocab
        self.tokens: list[int] = []
        self.n_exact = 0  # leading positions fed by the target's hidden rows (not drafts)
        self._own: tuple[int, np.ndarray] | None = None  # (position, the MTP layer's hidden row there)

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self._batch.token = ctypes.POINTER(C.llama_token)()  # ours: llama_batch_free must not free it
        super().close()

    def _input_row(self, p: int) -> np.ndarray:
        """h_{p-1}: the target's hidden row, or for a draft position the MTP layer's own."""
        if p == 0:
            return np.zeros(self.n_embd, np.float32)
        if p <= self.target.n_past:
            return self.target.hidden[p - 1]
        if self._own is None or self._own[0] != p - 1:
            raise RuntimeError(f"MTP: no hidden row for position {p - 1} (a draft evaluated out of order)")
        return self._own[1]

    def _decode(self, tokens: list[int], n_out: int) -> None:
        if not self._ctx:
            raise MarsError("this context was closed (Engine.close() during a generation?)")
        n, start = len(tokens), len(self.tokens)
        for i in range(n):
            self._emb[i] = self._input_row(start + i)
        self._tok[:n] = tokens
        self._pos[:n] = np.arange(start, start + n)
        self._out[:n] = 0
        self._out[n - n_out:n] = 1
        self._batch.n_tokens = n
        rc = C.llama_decode(self._ctx, self._batch)
        if rc != 0:
            C.llama_memory_seq_rm(self.mem, 0, start, -1)
            if rc == 1:
                raise MarsError(f"the context is full ({self.n_ctx} tokens); use a larger -c")
            raise RuntimeError(f"llama_decode (MTP) failed with code {rc}")
        if self.n_exact == start:  # still no draft row below: the rows fed by the target extend it
            self.n_exact = start + sum(1 for i in range(n) if start + i <= self.target.n_past)
        self.tokens.extend(int(t) for t in tokens)
        ptr = self._get_hidden(self._ctx, n - 1)  # by batch row, as llama_get_logits_ith
        self._own = (start + n - 1, np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy())

    def eval(self, tokens, n_out: int = 1) -> np.ndarray | None:
        """Append ``tokens`` (chunked by n_batch); the logits of the last n_out rows (n_out >= 1)."""
        tokens = list(tokens)
        if not tokens:
            return None
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise MarsError(f"the context is full ({self.n_ctx} tokens); use a larger -c")
        n_out = max(1, n_out)
        i = 0
        while len(tokens) - i > self.n_batch:
            self._decode(tokens[i:i + self.n_batch], 1)
            i += self.n_batch
        rest = tokens[i:]
        n = min(n_out, len(rest))
        self._decode(rest, n)
        ptr = C.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(ptr, shape=(n, self.n_vocab))

    def truncate(self, n_keep: int) -> None:
        """Drop every cached position >= n_keep."""
        if n_keep >= len(self.tokens):
            return
        if not self._ctx:
            raise MarsError("this context was closed")
        C.llama_memory_seq_rm(self.mem, 0, n_keep, -1)
        del self.tokens[n_keep:]
        self.n_exact = min(self.n_exact, n_keep)
        if self._own is not None and self._own[0] >= n_keep:
            self._own = None

    def sync(self, tokens) -> int:
        """Hold exactly ``tokens`` (reusing the common prefix of rows fed by the target)."""
        keep = min(common_prefix_len(self.tokens, tokens), self.n_exact)
        self.truncate(keep)
        rest = list(tokens[keep:])
        if rest:
            self.eval(rest, n_out=1)
        return len(rest)
