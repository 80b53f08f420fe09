"""Thin ownership layer over llama.cpp's C API (llama-cpp-python's ctypes module): models.

One :class:`Model` per GGUF file (its vocabulary, metadata, tokenizing and pieces), the
draft/target tokenizer check, what this build and machine offer (backend, GPU offload,
threads, a busy-CPU note).  Contexts, with their KV mirror and logits views, are
:mod:`.context`'s.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from ..core.defaults import SETTINGS
from ..core.errors import MarsError
from ..core.interrupts import wait_through
from .backend import C, LLAMA_CPP_PYTHON_VERSION, init_backend
from .backend import last_llama_error as _last_llama_error
from .backend import recent_log as _recent_log
from .gguf_file import check_gguf_file
from .recurrent import ROLLBACK_DEPTH, supports_rollback

__all__ = ["Model", "check_vocab_compatible", "backend_info", "build_fingerprint", "invariant_rows",
           "GPU_INVARIANT_ROWS", "MAX_INVARIANT_ROWS"]

# rows one decode may carry with every row computed as in a 1-row decode (patches/0002, 0003): a
# verify window's bound, and the bound under which a prompt's last token rides in its last chunk
MAX_INVARIANT_ROWS = SETTINGS["draft_max"].hi + 1

# Rows one forward of offloaded layers may carry with every row computed as in a 1-row forward,
# measured on CUDA (an H200, BENCHMARKS.md "On a GPU"): lone windows of 2-17 rows were bit-identical
# to single rows for F16, Q4_K_M and Q4_1 weights, 33-row ones were not; strict greedy with 4
# sequences of 4 rows (16 in one forward) equalled plain greedy on 8 of 8 prompts, with 8 sequences
# of 4 rows (32) on 6 of 8.  Above it llama.cpp's GPU matrix kernels change (cuBLAS, tile sizes).
# Checked on an H100 with the bound in force (BENCHMARKS.md "third visit"): 8 sequences of 4-row
# windows, decoded as 16-row forwards, equalled plain greedy on 8 of 8 prompts; as one 32-row
# forward (--fast-kernels) on 7 of 8.
GPU_INVARIANT_ROWS = 16


def invariant_rows(offloaded: bool, exact_kernels: bool) -> int:
    """How many rows one forward of a model may carry, each computed as a lone row would be
    (pure): on the CPU our patched kernels' bound (patches/0002, 0003: 64); with layers on a
    GPU, exact decoding keeps its forwards within GPU_INVARIANT_ROWS (a batch of more rows is
    decoded in several forwards), fast kernels (``exact_kernels`` off) do not."""
    return GPU_INVARIANT_ROWS if offloaded and exact_kernels else MAX_INVARIANT_ROWS


def gpu_offload_supported() -> bool:
    """Whether this machine has a GPU llama.cpp can offload to (RPC servers' devices do not count:
    llama_supports_gpu_offload() is true in every build with the RPC backend)."""
    init_backend()
    if not C.llama_supports_gpu_offload():
        return False
    from .rpc import local_gpu_devices

    return bool(local_gpu_devices())


def backend_info() -> dict:
    """Which backend this llama.cpp build uses."""
    init_backend()
    info = C.llama_print_system_info().decode("utf-8", errors="replace")
    backend = "cpu"
    for name in ("CUDA", "METAL", "VULKAN", "HIP", "SYCL", "MUSA", "OPENCL"):
        if name in info.upper().replace(" ", ""):
            backend = name.lower()
            break
    return {
        "backend": backend,
        "gpu_offload": gpu_offload_supported(),
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        "system_info": info.strip(),
    }


_build_fp: str | None = None


def build_fingerprint() -> str:
    """Identifies this llama.cpp build (version, CPU features, library file): what a
    forward's speed depends on besides the model, threads and offload."""
    global _build_fp
    if _build_fp is None:
        import hashlib

        init_backend()
        parts = [LLAMA_CPP_PYTHON_VERSION, C.llama_print_system_info().decode("utf-8", "replace")]
        lib = getattr(getattr(C, "_lib", None), "_name", None)
        try:
            st = os.stat(lib)
            parts.append(f"{lib}|{st.st_size}|{st.st_mtime_ns}")
        except (OSError, TypeError):
            pass
        _build_fp = hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]
    return _build_fp


T = TypeVar("T")


START_GRACE_S = 2.0  # how long a thread that Thread.start may have started gets to begin


def on_own_thread(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` computed on a new thread that ends with it; its result, or its exception.

    ggml's CPU backend is built with OpenMP, and libgomp keeps a pool of worker threads for each
    thread that has computed, for the life of that thread.  Once the pools' threads outnumber the
    cores, libgomp spins for a fraction of its usual time before a waiting thread sleeps, and ggml
    waits at a barrier after every operation of a forward.  So one forward on the thread that loads
    the models, where another thread generates (``mars serve``: the repack probe at load), left that
    server's rounds ~1.8x slower on 2 cores for its whole life (K-quant stand-in, BENCHMARKS.md run
    34).  A thread that ends takes its pool with it.  Ctrl-C meanwhile waits for ``fn`` to end (its
    model must not be freed under it), then is raised (:func:`~mars_local.core.interrupts.wait_through`)."""
    box: dict = {}
    ended, began = threading.Event(), threading.Event()
    gate = threading.Lock()  # fn begins, or the caller gives it up: one of the two, never both

    def run() -> None:
        try:
            with gate:
                if box.get("abandoned"):
                    return
                began.set()
            box["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
        finally:
            ended.set()

    try:
        threading.Thread(target=run, name="mars-compute", daemon=True).start()
    except KeyboardInterrupt as early:
        # Ctrl-C inside Thread.start: the thread may or may not have been started.  One that
        # was begins at once; one that was not never will, and must not be waited for.
        wait_through(began, START_GRACE_S)
        with gate:
            if not began.is_set():
                box["abandoned"] = True
                raise early from None
        wait_through(ended)
        raise early from None
    interrupted = wait_through(ended)  # let fn finish with what it uses, then stop
    if interrupted is not None:
        raise interrupted
    if "error" in box:
        raise box["error"]
    return box["value"]


def default_threads() -> int:
    """Physical-core estimate: all CPUs on small machines, half where SMT is likely."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        n = os.cpu_count() or 1
    return n if n <= 4 else max(4, n // 2)


def busy_note(threads: int, cores: int, load: float, running: int) -> str | None:
    """A warning when other processes already keep CPU cores busy (pure).

    llama.cpp's threads wait for each other at every operation, so one thread
    that shares its core with another busy process holds all of them back:
    with both cores of a 2-core machine busy elsewhere, decoding fell ~100x.
    ``load``: the 1-minute load average; ``running``: runnable tasks now, this
    process included (/proc/loadavg's 4th field).  Both must show at least one
    busy core besides ours (the load average lags by a minute, the
    instantaneous count is noisy)."""
    others = min(load, float(running - 1))
    if cores < 1 or threads < 1 or others < 1.0 or threads + others <= cores + 0.5:
        return None
    free = max(1, cores - int(others + 0.5))
    if free >= threads:  # (fewer threads would not help: -t 1 already shares a core)
        return (f"the CPU is busy (load {load:.1f} on {cores} cores): {threads} thread(s) sharing cores with other "
                "processes can be many times slower; stop the other work for full speed")
    return (f"the CPU is busy (load {load:.1f} on {cores} cores): {threads} threads that share cores with "
            f"other processes can be many times slower; try -t {free}, or stop the other work")


def read_busy_note(threads: int, loadavg_path: str = "/proc/loadavg") -> str | None:
    """:func:`busy_note` for this machine now (None where /proc/loadavg cannot be read, or with
    ``MARS_BUSY_NOTE=0`` in the environment).  Runnable threads of this process (llama.cpp's
    thread pool spins for a while after a decode) are not counted as other work."""
    if os.environ.get("MARS_BUSY_NOTE") == "0":
        return None
    try:
        with open(loadavg_path, encoding="ascii") as f:
            fields = f.read(256).split()
        load, running = float(fields[0]), int(fields[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        cores = os.cpu_count() or 1
    own = _own_running_threads() if loadavg_path == "/proc/loadavg" else 1
    return busy_note(threads, cores, load, running - max(own - 1, 0))


def _own_running_threads() -> int:
    """This process's threads in state R (running or runnable), at least 1."""
    n = 0
    try:
        for task in os.scandir("/proc/self/task"):
            try:
                with open(f"{task.path}/stat", encoding="ascii", errors="replace") as f:
                    n += f.read(512).rsplit(")", 1)[1].split()[0] == "R"
            except (OSError, IndexError):
                continue
    except OSError:
        return 1
    return max(n, 1)


class FreeOnce:
    """A native free that runs at most once, whoever calls it first (:meth:`Model.owns`)."""

    __slots__ = ("_free",)

    def __init__(self, free: Callable[[], None]):
        self._free = free

    @property
    def pending(self) -> bool:
        return self._free is not None

    def __call__(self) -> None:
        free, self._free = self._free, None
        if free is not None:
            free()


class Model:
    """A loaded GGUF model (weights only; contexts are separate).

    exact_kernels=True turns off llama.cpp's runtime weight repacking (the
    "extra buffer types"): repacked K-quant/Q4_0 weights use a 4-row gemm for
    batches and a gemv for single rows, whose results differ in the last bits,
    so a verify window could flip a near-tie that plain decoding resolves the
    other way.  Off, the CPU kernels are batch-invariant (our build also turns
    off llamafile's sgemm for the same reason).  It costs ~10 % on K-quants on
    CPU; the draft model, whose numerics never change the output, keeps it.
    """

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int | None = None, exact_kernels: bool = False,
                 devices: Sequence[int] | None = None, tensor_split: Sequence[float] | None = None,
                 load_mtp: bool = False):
        """``devices``: the ggml devices to offload to (handles; None: llama.cpp's choice, every GPU and
        registered RPC server; []: none, the CPU only); ``tensor_split``: layer proportions per device;
        ``load_mtp``: load the multi-token-prediction (nextn) layers too (check the file has them
        first: llama/mtp.py)."""
        p = Path(path).expanduser()
        check_gguf_file(p)
        init_backend()
        params = C.llama_model_default_params()
        can_offload = bool(devices) if devices is not None else gpu_offload_supported()
        if n_gpu_layers is None:  # all layers where a GPU backend (or a given device) exists, else none
            n_gpu_layers = -1 if can_offload else 0
        params.n_gpu_layers = int(n_gpu_layers) if n_gpu_layers >= 0 else 0x7FFFFFFF
        if devices is not None:  # a NULL-terminated array of ggml_backend_dev_t, alive while loading
            self._devices = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
            params.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        if tensor_split is not None:
            n = int(C.llama_max_devices())
            if len(tensor_split) > n:
                raise MarsError(f"--tensor-split has {len(tensor_split)} values; llama.cpp takes at most {n}")
            self._split = (ctypes.c_float * n)(*tensor_split)
            params.tensor_split = ctypes.cast(self._split, ctypes.POINTER(ctypes.c_float))
        if exact_kernels:
            params.use_extra_bufts = False
        params.load_mtp = bool(load_mtp)
        _recent_log.clear()
        self._owned: list[FreeOnce] = []  # what contexts made from it must free before it (owns())
        self._model = C.llama_model_load_from_file(str(p).encode(), params)
        if not self._model:
            reason = _last_llama_error()
            raise MarsError(f"cannot load GGUF model {p}" + (f": {reason}" if reason else " (corrupt or truncated?)"))
        self.path = str(p)
        self.offloaded = can_offload and n_gpu_layers != 0
        self.exact_kernels = bool(exact_kernels)  # loaded without llama.cpp's weight repacking
        # exact kernels on the CPU of a build that has a GPU: llama.cpp would send a CPU layer's
        # forwards of 32+ rows to the GPU ("op offload"), whose kernels sum otherwise (context.py)
        self.cpu_exact_on_gpu_build = bool(exact_kernels) and not self.offloaded and gpu_offload_supported()
        # the most rows one forward may carry exactly (verify windows, batched rounds, riding prompts)
        self.invariant_rows = invariant_rows(self.offloaded, bool(exact_kernels))
        self.vocab = C.llama_model_get_vocab(self._model)
        self.n_vocab = int(C.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(C.llama_model_n_ctx_train(self._model))
        self.n_embd = int(C.llama_model_n_embd(self._model))
        self.recurrent = bool(C.llama_model_is_recurrent(self._model) or C.llama_model_is_hybrid(self._model))
        self.arch = self.meta("general.architecture") or ""
        # a recurrent state llama.cpp can roll back a few tokens (llama/recurrent.py); 0: no rollback
        # at all (a recurrent model of another arch), None: a model without recurrent layers
        self.rollback_depth = None if not self.recurrent else (ROLLBACK_DEPTH if supports_rollback(self.arch) else 0)
        self.add_bos = bool(C.llama_vocab_get_add_bos(self.vocab))
        self.bos = int(C.llama_vocab_bos(self.vocab))
        self.eos = int(C.llama_vocab_eos(self.vocab))
        self.eog_ids = tuple(t for t in range(self.n_vocab) if C.llama_vocab_is_eog(self.vocab, t))
        self._eog = frozenset(self.eog_ids)
        self._piece_buf = ctypes.create_string_buffer(256)

    # -- metadata
    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = C.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            C.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def chat_template(self) -> str | None:
        tmpl = C.llama_model_chat_template(self._model, None)
        return tmpl.decode("utf-8", errors="replace") if tmpl else None

    # -- tokens
    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def token_text(self, token: int) -> bytes:
        return C.llama_vocab_get_text(self.vocab, token) or b""

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``.  Text that is not valid Unicode (a lone
        surrogate, which is what Python makes of undecodable bytes in argv) is
        refused with a MarsError: decoding bytes is the caller's business."""
        if not self._model:
            raise MarsError("this model was closed")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            ch = text[exc.start]
            raise MarsError(
                f"the text cannot be encoded as UTF-8: it has a lone surrogate U+{ord(ch):04X} at character "
                f"{exc.start} (undecodable input bytes?); decode the input as UTF-8 first"
            ) from None
        cap = len(data) + 16
        buf = (C.llama_token * cap)()
        n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (C.llama_token * cap)()
            n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise MarsError("the prompt could not be tokenized")
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (may be a partial UTF-8 sequence)."""
        if not self._model:
            raise MarsError("this model was closed")
        buf = self._piece_buf
        n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens, special: bool = False) -> str:
        return b"".join(self.piece(t, special) for t in tokens).decode("utf-8", errors="replace")

    def owns(self, free: Callable[[], None]) -> "FreeOnce":
        """``free`` (a native object made from this model: a context and its batch) wrapped to run
        once, by the caller's close or, if the model is closed first, then and before the model
        is freed.  The garbage collector finalizes the objects of a reference cycle (an engine
        never closed) in any order, and a llama_context freed after its model is a use after
        free."""
        once = FreeOnce(free)
        self._owned = [o for o in self._owned if o.pending] + [once]
        return once

    def close(self) -> None:
        if getattr(self, "_model", None):
            for once in self._owned:
                once()
            self._owned = []
            C.llama_model_free(self._model)
            self._model = None

    def __del__(self):  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass


# llama.cpp's speculative-decoding vocabulary check (common/speculative.cpp)
VOCAB_SIZE_MAX_DIFF = 128  # vocabulary sizes may differ by this many (padding)
VOCAB_CHECK_START_ID = 5  # token texts are compared from this id on


def check_vocab_compatible(target: Model, draft: Model) -> None:
    """Refuse a draft whose tokenizer differs (llama.cpp's five rules)."""
    def fail(why: str) -> None:
        raise MarsError(
            f"draft model {Path(draft.path).name} does not share the target's tokenizer ({why}); "
            "pick a draft from the same model family, or use --drafter ngram"
        )

    if C.llama_vocab_type(target.vocab) != C.llama_vocab_type(draft.vocab):
        fail("different tokenizer types")
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos != draft.bos):
        fail("different BOS token")
    if bool(C.llama_vocab_get_add_eos(target.vocab)) != bool(C.llama_vocab_get_add_eos(draft.vocab)) or (
        C.llama_vocab_get_add_eos(target.vocab) and target.eos != draft.eos
    ):
        fail("different EOS token")
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_SIZE_MAX_DIFF:
        fail(f"vocabulary sizes {target.n_vocab} and {draft.n_vocab}")
    for t in range(VOCAB_CHECK_START_ID, min(target.n_vocab, draft.n_vocab)):
        if target.token_text(t) != draft.token_text(t):
            fail(f"token {t} differs")
