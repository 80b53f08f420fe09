"""Native verification: ``llama_mars_verify`` from our patched libllama.

``patches/0001-mars-verify-kernel.patch`` adds one C function to libllama that
verifies a whole draft window on the target's float32 logits block (the
``llama_get_logits`` buffer, zero-copy) with exactly the rules of
:mod:`mars_local.core.verify` and the sampling pipeline of
:mod:`mars_local.core.sampling`: same accepted length, same tokens, same relaxed
flags, bit for bit (the reference's exp and sums are defined so that C can
reproduce them; see the sampling module's docstring).

* :func:`available` says whether the loaded libllama has the kernel (a plain,
  unpatched llama-cpp-python does not: then everything uses numpy).
* :func:`verify` has the contract of :func:`mars_local.core.verify.verify`.  Inputs
  the kernel does not take (logits that are not float32, malformed shapes,
  draft ids outside the vocabulary) go to the numpy reference, so results and
  errors are the reference's in every case.  A row with a NaN logit, or with
  no logit above -inf, that the rule reaches is refused with the reference's
  MarsError: the kernel returns -3 / -4 and the row's window position.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from ..core.errors import MarsError
from ..core.sampling import SamplingParams
from ..core.verify import VerifyConfig, VerifyResult
from ..core.verify import verify as verify_numpy

__all__ = ["SYMBOL", "available", "verify"]

SYMBOL = "llama_mars_verify"

_INT32_MAX = 2**31 - 1
_state: tuple | None = None  # (function, params struct type) once loaded; () when absent


def _load() -> tuple:
    global _state
    if _state is None:
        _state = ()
        try:
            from llama_cpp import llama_cpp as C
        except Exception:  # no llama-cpp-python at all: numpy only
            return _state
        lib = getattr(C, "_lib", None)
        params_t = getattr(C, "llama_mars_verify_params", None)
        if lib is not None and params_t is not None and hasattr(lib, SYMBOL):
            # Our own prototype of the same symbol, with void pointers: numpy
            # arrays pass their address without building ctypes pointer objects.
            fn = lib[SYMBOL]
            vp = ctypes.c_void_p
            fn.argtypes = [vp, vp, vp, vp, ctypes.POINTER(params_t), vp, vp]
            fn.restype = ctypes.c_int32
            _state = (fn, params_t)
    return _state


def available() -> bool:
    """True when the loaded libllama exports the verification kernel."""
    return bool(_load())


_CHAR = ctypes.c_char


def _addr(a: np.ndarray | None) -> int | None:
    """Address of a C-contiguous array's data (None for None)."""
    if a is None:
        return None
    try:  # fast path for writable buffers
        return ctypes.addressof(_CHAR.from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.ctypes.data


class _Workspace(threading.local):
    """Per-thread argument buffers (grown on demand) and the parameter structs of recent
    (cfg, params, vocab) triples, reused while the caller's objects stay the same (the engine
    passes the same ones every round; a batch of N sequences passes N such triples in turn)."""

    MAX_PARAMS = 256  # structs kept (one per live sequence's settings); cleared beyond it

    def __init__(self) -> None:
        self.cap = -1
        self.structs: dict[tuple, tuple] = {}

    def grow(self, k: int) -> None:
        n = max(k, 16)
        self.draft = (ctypes.c_int32 * n)()
        self.out = (ctypes.c_int32 * (n + 1))()
        self.relaxed = (ctypes.c_uint8 * n)()
        self.cap = n

    def params(self, params_t, cfg: VerifyConfig, sp: SamplingParams, n_vocab: int):
        key = (id(cfg), id(sp), n_vocab)
        hit = self.structs.get(key)
        if hit is not None and hit[0] is cfg and hit[1] is sp:
            return hit[3]
        eog = np.ascontiguousarray(cfg.eog_ids, dtype=np.int32)
        top_k = int(sp.top_k)
        p = params_t(
            eog.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)) if len(eog) else None,
            float(cfg.theta),
            float(sp.temperature),
            float(sp.top_p),
            float(sp.min_p),
            n_vocab,
            0,  # n_draft, set per call
            1 if cfg.method == "mars" else 0,
            1 if cfg.require_positive_top1 else 0,
            -1 if cfg.max_relaxed is None else min(int(cfg.max_relaxed), _INT32_MAX),
            top_k if 0 < top_k < n_vocab else 0,
            len(eog),
        )
        if len(self.structs) >= self.MAX_PARAMS:
            self.structs.clear()
        # cfg and sp kept alive with their struct (so their ids are not reused); eog while it points to it
        self.structs[key] = (cfg, sp, eog, p)
        return p


_work = _Workspace()


def verify(logits, draft, cfg: VerifyConfig, params: SamplingParams,
           rng=None, draft_probs=None, uniforms=None) -> VerifyResult:
    """:func:`mars_local.core.verify.verify` computed by the native kernel (same arguments, same types)."""
    state = _state if _state is not None else _load()
    if not state or type(logits) is not np.ndarray or logits.dtype != np.float32 or logits.ndim != 2:
        return verify_numpy(logits, draft, cfg, params, rng, draft_probs, uniforms)
    d = np.asarray(draft, dtype=np.int64)
    ids = d.tolist() if d.ndim == 1 else None
    n_rows, n_vocab = logits.shape
    k = len(ids) if ids is not None else -1
    if n_rows != k + 1 or not 0 < n_vocab <= _INT32_MAX or (k and (min(ids) < 0 or max(ids) >= n_vocab)):
        # malformed, or draft ids outside the vocabulary: the reference decides
        return verify_numpy(logits, draft, cfg, params, rng, draft_probs, uniforms)
    if not logits.flags.c_contiguous:
        logits = np.ascontiguousarray(logits)

    u = q = None
    if params.temperature != 0.0:
        if uniforms is None:
            if rng is None:
                raise ValueError("sampling verification needs uniforms or an rng")
            uniforms = rng.random((k + 1, 2))
        u = np.ascontiguousarray(uniforms, dtype=np.float64)
        if draft_probs is not None and k:
            q = np.ascontiguousarray(draft_probs, dtype=np.float64)
        if u.shape != (k + 1, 2) or (q is not None and q.shape != (k, n_vocab)):
            return verify_numpy(logits, draft, cfg, params, None, draft_probs, uniforms)

    fn, params_t = state
    w = _work
    if k > w.cap:
        w.grow(k)
    if k:
        w.draft[:k] = ids
    p = w.params(params_t, cfg, params, n_vocab)
    p.n_draft = k
    m = fn(_addr(logits), w.draft, _addr(q), _addr(u), ctypes.byref(p), w.out, w.relaxed)
    if m < 0:
        if m in (-3, -4):  # row out[0] has no distribution; the reference's message
            i = w.out[0]
            if m == -3:
                raise MarsError(f"the target produced NaN logits at draft position {i}")
            raise MarsError(f"the target produced no finite logit at draft position {i} (all -inf)")
        raise RuntimeError(f"{SYMBOL} rejected its arguments (code {m})")
    return VerifyResult(m, w.out[: m + 1], np.frombuffer(w.relaxed, dtype=np.bool_, count=m).copy())
