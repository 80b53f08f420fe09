"""An EAGLE-3 head drafting for its target: a separate one-layer GGUF (architecture ``eagle3``).

EAGLE-3 (Li et al., 2025) drafts from the target's own features.  At every position P the
target's inputs to three of its layers (``eagle3.target_layers``; an id equal to the target's
layer count means its last hidden row) are concatenated and projected by the head's ``fc`` — one
``llama_encode`` of the head's context — into g_P.  The head's decoder layer then reads, at its
position P, the token t_{P+1} beside g_P and predicts t_{P+2}; further draft positions read the
decoder's own output row instead of a g (llama.cpp's ``draft-eagle3``, common/speculative.cpp).
Token embeddings and the output matrix are the target's unless the head has its own
(``ctx_other``); a ``d2t`` table maps a smaller draft vocabulary into the target's, the other
logits being -inf.

That is the MTP layer's shape one position over (an MTP row for position p reads t_p and
h_{p-1}; llama/mtp.py), so :class:`Eagle3Context` is an :class:`~mars_local.llama.mtp.MtpContext`
whose target keeps g rows instead of hidden rows (``capture_hidden`` with :meth:`Eagle3Context.encode`
as the reader: the target's rows are encoded right after each target decode, rejected draft rows
included, as llama.cpp does) and whose row for sequence position p sits at llama position p - 1
(``pos_shift``: t_0 has no row).  Which rows the target fed, rollback, prefix reuse, lockstep
drafting for many sequences and the drafter's decisions are the MTP head's.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from ..core.errors import MarsError
from .backend import C
from .gguf_file import check_gguf_file, gguf_metadata
from .mtp import MTP_ARCHS, MtpContext
from .streams import MultiContext

__all__ = ["Eagle3Context", "open_eagle3", "check_eagle3_head", "EAGLE3_TARGET_ARCHS"]

# target architectures whose graphs expose their layer inputs (llama.cpp's t_layer_inp), the
# features an EAGLE-3 head reads; capturing them on any other aborts the process.  A head reading
# the last hidden row (layer id = n_layer) needs it for every row, which only the graphs with MTP
# layers give (the others keep the last layer's output rows only)
EAGLE3_TARGET_ARCHS = frozenset({
    "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan_vl", "lfm2", "llama", "mimo2", "minimax-01",
    "minimax-m2", "muse-glimmer", "nanbeige", "nemotron_h", "qwen3", "qwen35", "qwen35moe", "qwen3moe",
    "qwen3next", "qwen4exp",
})


def _trunk_layers(meta: dict) -> int:
    arch = meta.get("general.architecture", "")
    n = meta.get(f"{arch}.block_count", 0)
    return int(n) - int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0) if isinstance(n, int) else 0


def check_eagle3_head(head: str | Path, target: str | Path) -> tuple[int, ...]:
    """The target layers the EAGLE-3 head at ``head`` reads, or one MarsError line saying why it
    cannot draft for ``target`` (both read from their GGUF headers, before llama.cpp loads
    anything: a head that does not fit its target would abort the process, not fail)."""
    check_gguf_file(Path(head))
    check_gguf_file(Path(target))
    h, t = gguf_metadata(Path(head), tensors=True), gguf_metadata(Path(target))
    name, tname = Path(head).name, Path(target).name
    arch = h.get("general.architecture", "")
    if arch != "eagle3":
        raise MarsError(f"{name} is not an EAGLE-3 head (its architecture is {arch or 'unknown'}); "
                        "--drafter eagle3 needs one (-md HEAD.gguf), e.g. converted with llama.cpp's "
                        "convert_hf_to_gguf.py --target-model-dir", field="drafter")
    layers = h.get("eagle3.target_layers")
    if not isinstance(layers, tuple) or len(layers) != 3:
        raise MarsError(f"{name}: an EAGLE-3 head names exactly 3 target layers (eagle3.target_layers)",
                        field="drafter")
    t_arch = t.get("general.architecture", "")
    t_embd = t.get(f"{t_arch}.embedding_length")
    n_layer = _trunk_layers(t)
    if h.get("eagle3.target_hidden_size") != t_embd:
        raise MarsError(f"{name} was made for a target of width {h.get('eagle3.target_hidden_size')}, "
                        f"{tname} has {t_embd}: use the head made for this model", field="drafter")
    if any(not 0 <= i <= n_layer for i in layers):
        raise MarsError(f"{name} reads target layers {list(layers)}, {tname} has {n_layer}: "
                        "use the head made for this model", field="drafter")
    if t_arch not in EAGLE3_TARGET_ARCHS and any(i < n_layer for i in layers):
        raise MarsError(f"llama.cpp cannot give an EAGLE-3 head the layer inputs of {t_arch or 'unknown'} models "
                        f"(it can for {', '.join(sorted(EAGLE3_TARGET_ARCHS))})", field="drafter")
    if n_layer in layers and t_arch not in MTP_ARCHS:
        raise MarsError(f"{name} reads {tname}'s last hidden row (layer {n_layer}), which llama.cpp gives for "
                        f"every row only for models with MTP layers, not {t_arch or 'unknown'} models", field="drafter")
    own = {"token_embd.weight", "output.weight"} & h.get("tensors", set())
    if len(own) < 2 and h.get("eagle3.embedding_length") != t_embd:
        raise MarsError(f"{name} has width {h.get('eagle3.embedding_length')} and shares {tname}'s "
                        f"embeddings of width {t_embd}: the head does not fit this model", field="drafter")
    return tuple(int(i) for i in layers)


def _ext(names: tuple[str, ...], argtypes, restype):
    """A llama-ext.h function of the pinned release (C++, exported under a mangled name)."""
    from llama_cpp import llama_cpp

    for name in names:
        fn = getattr(llama_cpp._lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, restype
            return fn
    raise MarsError(f"this llama.cpp build lacks {names[0]}: EAGLE-3 heads need llama-cpp-python 0.3.36")


def _layer_inputs(ctx, layers: tuple[int, ...], n_layer: int, n_embd: int):
    """Make target context ``ctx`` keep the inputs of ``layers`` (n_layer: its last hidden row) for
    every batch row; the function giving the last decode's n rows, concatenated: (n, 3 n_embd)."""
    from llama_cpp import llama_cpp_ext

    set_inp = _ext(("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
                    "?llama_set_embeddings_layer_inp@@YAXPEAUllama_context@@I_N@Z"),
                   [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None)
    get_inp = _ext(("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
                    "?llama_get_embeddings_layer_inp@@YAPEAMPEAUllama_context@@I@Z"),
                   [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float))
    getters = []
    for lid in layers:
        if lid < n_layer:
            set_inp(ctx, lid, True)
            getters.append(lambda lid=lid: get_inp(ctx, lid))
        else:  # the last hidden row: what an MTP layer reads
            llama_cpp_ext.llama_set_embeddings_nextn(ctx, True, False)
            getters.append(lambda: llama_cpp_ext.llama_get_embeddings_nextn(ctx))

    def read(n: int) -> np.ndarray:
        return np.concatenate([np.ctypeslib.as_array(g(), shape=(n, n_embd)) for g in getters], axis=1)

    return read


def open_eagle3(target, head) -> "Eagle3Context":
    """The EAGLE-3 head ``head`` (a loaded :class:`~mars_local.llama.runtime.Model`, checked with
    :func:`check_eagle3_head`) drafting for ``target`` (a lone Context or a MultiContext), the
    target set to keep the encoded features of every row it evaluates."""
    layers = tuple(int(i) for i in gguf_metadata(Path(head.path))["eagle3.target_layers"])
    seqs = target.seqs if isinstance(target, MultiContext) else [target]
    ctx = Eagle3Context(head, seqs, target._ctx, target.n_ctx, head.n_embd, target.n_batch, target.n_threads,
                        width_in=len(layers) * target.model.n_embd)
    features = _layer_inputs(target._ctx, layers, int(C.llama_model_n_layer(target.model._model)),
                             target.model.n_embd)
    target.capture_hidden(head.n_embd, lambda n: ctx.encode(features(n)))
    return ctx


class Eagle3Context(MtpContext):
    """One sequence per target sequence in the head's context (``other``: the target's
    llama_context, whose embeddings and output matrix the head may share)."""

    pos_shift = 1  # the row of t_p sits at llama position p - 1 (beside g_{p-1}); t_0 has none
    all_rows_out = True  # the eagle3 graph computes every row's logits and hands out the first ones

    def __init__(self, head, targets, other, n_ctx_seq: int, n_embd: int, n_batch: int, n_threads: int,
                 width_in: int):
        def configure(cp):
            cp.ctx_other = other

        self.n_embd = n_embd
        MultiContext.__init__(self, head, len(targets), n_ctx_seq, n_batch, n_threads, unified=True,
                              configure=configure, n_embd_in=n_embd)
        from llama_cpp import llama_cpp_ext

        llama_cpp_ext.llama_set_embeddings_nextn(self._ctx, True, True)  # encoder output; decoder pre-norm rows
        self._own_hidden = llama_cpp_ext.llama_get_embeddings_nextn_ith
        self._g = llama_cpp_ext.llama_get_embeddings_nextn
        for view, t in zip(self.seqs, targets):
            view.target = t
        self._enc = C.llama_batch_init(self.n_batch, width_in, 1)  # rows of features, no tokens
        b = self._enc
        for i in range(self.n_batch):
            b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = 1, 0, 1
        self._enc_in = np.ctypeslib.as_array(b.embd, shape=(self.n_batch, width_in))
        self._enc_pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))

    def encode(self, features: np.ndarray) -> np.ndarray:
        """g rows of the target's feature rows (n, 3 target widths): the head's fc, in chunks of
        n_batch rows (an encoder batch must fit one micro-batch)."""
        out = np.empty((len(features), self.n_embd), np.float32)
        for i in range(0, len(features), self.n_batch):
            n = min(self.n_batch, len(features) - i)
            self._enc_in[:n] = features[i:i + n]
            # the encoder reads no positions, but llama.cpp checks them: they continue sequence 0
            self._enc_pos[:n] = np.arange(n) + int(C.llama_memory_seq_pos_max(self.mem, 0)) + 1
            self._enc.n_tokens = n
            rc = C.llama_encode(self._ctx, self._enc)
            if rc != 0:
                raise RuntimeError(f"llama_encode (EAGLE-3 features) failed with code {rc}")
            out[i:i + n] = np.ctypeslib.as_array(self._g(self._ctx), shape=(n, self.n_embd))
        return out

    def close(self) -> None:
        if getattr(self, "_enc", None) is not None:
            C.llama_batch_free(self._enc)
            self._enc = None
        super().close()
