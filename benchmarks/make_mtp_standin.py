#!/usr/bin/env python3
"""A cost-realistic stand-in for a model with a multi-token-prediction (MTP) layer.

No real MTP checkpoint (MiMo, GLM-4.5, DeepSeek-V3) can be downloaded or run on the development
machine, and the tiny random mimo2 models of the tests cost nothing, so speed figures need a
stand-in with a large trunk, a cheap MTP layer, and an MTP head that agrees with the trunk often:

* the trunk is SmolLM2-135M-Instruct (the F16 requantization of the bundled model) written as a
  ``mimo2`` model (the one dense architecture whose nextn layer llama.cpp runs): q/k weights
  un-permuted for mimo2's NEOX rope, tied embeddings written out as ``output``, one layer marked
  "sliding" with a window wider than any context (mimo2 requires one; it attends to everything),
  padded with inert blocks as ``make_standin.py`` does (per-token cost of a model ~9x the draft's);
* the MTP layer is one block that writes nothing (``attn_output``, ``ffn_down`` zero) after an
  ``eh_proj`` fitted by ridge regression: over the hidden rows SmolLM2 produces on a corpus of its
  own greedy continuations of prompts unrelated to the benchmark's (this repository's README), it
  maps [rmsnorm(embedding of t_p), rmsnorm(h_{p-1})] to rmsnorm(h_p), so the MTP head (the shared
  output norm and head) predicts t_{p+1} as the trunk would, where a linear map can.

    .venv/bin/python benchmarks/make_mtp_standin.py              # 240 blocks + 1 MTP layer, F16
    .venv/bin/python benchmarks/make_mtp_standin.py --blocks 30  # no padding (fast to test)

Files go into the git-ignored cache (``.cache/standin/``); needs the ``gguf`` package.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_standin import CACHE, INERT, ROOT, _copy_field, build, finish  # noqa: E402

ARCH = "mimo2"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's q/k row permutation for llama's NORM rope (mimo2 uses NEOX)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_mimo2(src: Path, dst: Path, n_blocks: int, eh_proj: np.ndarray | None) -> Path:
    """SmolLM2 (llama arch, F16) as a mimo2 model of ``n_blocks`` trunk blocks (inert past the 30
    real ones) plus one nextn layer whose eh_proj is ``eh_proj`` ([I | 0] when None)."""
    import gguf

    r = gguf.GGUFReader(str(src))
    f = {k: v for k, v in r.fields.items()}
    n_embd = int(f["llama.embedding_length"].contents())
    n_head = int(f["llama.attention.head_count"].contents())
    n_head_kv = int(f["llama.attention.head_count_kv"].contents())
    n_ff = int(f["llama.feed_forward_length"].contents())
    n_orig = int(f["llama.block_count"].contents())
    tensors = {t.name: t for t in r.tensors}
    tmp = dst.with_name(dst.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), ARCH)
    for name, field in f.items():
        if name.startswith("GGUF.") or name.startswith("llama.") or name == "general.architecture":
            continue
        _copy_field(w, field)
    n_all = n_blocks + 1
    w.add_context_length(int(f["llama.context_length"].contents()))
    w.add_embedding_length(n_embd)
    w.add_block_count(n_all)
    w.add_nextn_predict_layers(1)
    w.add_feed_forward_length(n_ff)
    w.add_expert_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(int(f["llama.rope.dimension_count"].contents()))
    w.add_rope_freq_base(float(f["llama.rope.freq_base"].contents()))
    # the "sliding" layer's own rope base (llama.cpp's default for it is 10000): the model's
    w.add_key_value(f"{ARCH}.rope.freq_base_swa", float(f["llama.rope.freq_base"].contents()),
                    gguf.GGUFValueType.FLOAT32)
    w.add_layer_norm_rms_eps(float(f["llama.attention.layer_norm_rms_epsilon"].contents()))
    w.add_sliding_window(1 << 24)  # wider than any context: the "sliding" layer attends to all
    w.add_sliding_window_pattern([b == 0 for b in range(n_all)])

    def add(name, data):
        w.add_tensor(name, np.ascontiguousarray(data))

    embd = tensors["token_embd.weight"].data
    add("token_embd.weight", embd)
    zeros: dict[tuple, np.ndarray] = {}

    def zero(shape, dtype=np.float16):
        return zeros.setdefault((shape, dtype), np.zeros(shape, dtype))

    for i in range(n_blocks):
        b = i % n_orig
        t = {k.split(".", 2)[2]: v.data for k, v in tensors.items() if k.startswith(f"blk.{b}.")}
        inert = i >= n_orig
        add(f"blk.{i}.attn_norm.weight", t["attn_norm.weight"])
        add(f"blk.{i}.attn_q.weight", _unpermute(t["attn_q.weight"], n_head))
        add(f"blk.{i}.attn_k.weight", _unpermute(t["attn_k.weight"], n_head_kv))
        add(f"blk.{i}.attn_v.weight", t["attn_v.weight"])
        for rest in ("attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"):
            add(f"blk.{i}.{rest}", zero(t[rest].shape, t[rest].dtype) if inert and rest in INERT else t[rest])
    m = n_blocks  # the nextn layer: a block that writes nothing, after the fitted eh_proj
    hd = n_embd // n_head
    add(f"blk.{m}.attn_norm.weight", np.ones(n_embd, np.float32))
    add(f"blk.{m}.attn_qkv.weight", zero(((n_head + 2 * n_head_kv) * hd, n_embd)))
    add(f"blk.{m}.attn_output.weight", zero((n_embd, n_head * hd)))
    add(f"blk.{m}.ffn_norm.weight", np.ones(n_embd, np.float32))
    add(f"blk.{m}.ffn_gate.weight", zero((n_ff, n_embd)))
    add(f"blk.{m}.ffn_up.weight", zero((n_ff, n_embd)))
    add(f"blk.{m}.ffn_down.weight", zero((n_embd, n_ff)))
    if eh_proj is None:
        eh_proj = np.concatenate([np.eye(n_embd), np.zeros((n_embd, n_embd))], axis=1)
    add(f"blk.{m}.nextn.eh_proj.weight", eh_proj.astype(np.float16))
    add(f"blk.{m}.nextn.enorm.weight", np.ones(n_embd, np.float32))
    add(f"blk.{m}.nextn.hnorm.weight", np.ones(n_embd, np.float32))
    add("output_norm.weight", tensors["output_norm.weight"].data)
    add("output.weight", embd)  # SmolLM2 ties its head to the embeddings; mimo2 wants it written
    return finish(w, tmp, dst)


def _rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5)


def corpus_prompts(n: int) -> list[str]:
    """Prompts unrelated to the benchmark's: sentences of this repository's README."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    text = re.sub(r"`[^`]*`|\*\*|[#*|>\[\]()]", " ", text)
    sents = [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if 60 < len(s.strip()) < 300]
    step = max(1, len(sents) // n)
    return sents[::step][:n]


def corpus_sequences(model: Path, n_prompts: int, n_tokens: int, threads: int, log=print) -> list[list[int]]:
    """The tokens of ``model``'s greedy continuations of the corpus prompts (chat template)."""
    from mars_local import Engine

    with Engine(model, n_ctx=1024, n_threads=threads, learned=False) as eng:
        seqs = []
        for i, p in enumerate(corpus_prompts(n_prompts)):
            toks = eng.chat_prompt([{"role": "user", "content": p}])
            seqs.append(toks + eng.generate(toks, max_tokens=n_tokens, temperature=0).tokens)
            if i % 10 == 9:
                log(f"  corpus: {i + 1} continuations")
    return seqs


def ridge_fit(x: np.ndarray, y: np.ndarray, ridge: float, what: str, log=print) -> np.ndarray:
    """W (out, in) with y ~ x @ W.T, by ridge regression (``ridge`` x the number of rows)."""
    log(f"  fitting {what} on {len(x)} positions (ridge {ridge})")
    a = x.T @ x + ridge * len(x) * np.eye(x.shape[1])
    return np.linalg.solve(a, x.T @ y).T.astype(np.float32)


def fit_args(doc: str, blocks_help: str) -> argparse.ArgumentParser:
    """The options the stand-ins' fits share (the padded size, the corpus, the ridge); ``doc``:
    the script's docstring, whose first paragraph describes it."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=240, help=blocks_help)
    ap.add_argument("--prompts", type=int, default=48, help="corpus prompts for the fit")
    ap.add_argument("-n", "--tokens", type=int, default=96, help="greedy tokens per corpus prompt")
    ap.add_argument("--ridge", type=float, default=1e-3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=CACHE)
    return ap


def f16_base(cache: Path) -> Path:
    """SmolLM2-135M-Instruct in F16 (make_standin.py's requantization), made if missing."""
    cache.mkdir(parents=True, exist_ok=True)
    base = cache / "SmolLM2-135M-Instruct.F16.gguf"
    if not base.exists():
        build(blocks=30, kquant=False, cache=cache)
    return base


def fit_eh_proj(model: Path, n_prompts: int, n_tokens: int, ridge: float, threads: int, log=print) -> np.ndarray:
    """Ridge regression of rmsnorm(h_p) on [rmsnorm(e_{t_p}), rmsnorm(h_{p-1})] over SmolLM2's own
    greedy continuations of the corpus prompts (chat template), read through an unpadded mimo2 file."""
    from mars_local.llama.context import Context
    from mars_local.llama.runtime import Model

    seqs = corpus_sequences(model, n_prompts, n_tokens, threads, log)  # the trunk's greedy text
    m = Model(model, 0, exact_kernels=True, load_mtp=True)
    ctx = Context(m, n_ctx=1024, n_threads=threads)
    ctx.capture_hidden(m.n_embd)
    import gguf

    embd = next(t for t in gguf.GGUFReader(str(model)).tensors if t.name == "token_embd.weight").data
    xs, ys = [], []
    try:
        for toks in seqs:
            ctx.truncate(0)
            ctx.eval(toks, n_out=1)
            h = ctx.hidden[: len(toks)]
            e = embd[np.asarray(toks[1:])].astype(np.float32)
            xs.append(np.concatenate([_rms(e), _rms(h[:-1])], axis=1))  # row for p = 1..: (t_p, h_{p-1})
            ys.append(_rms(h[1:]))  # -> h_p
    finally:
        ctx.close()
        m.close()
    return ridge_fit(np.concatenate(xs), np.concatenate(ys), ridge, "eh_proj", log)  # eh_proj rows: W @ [e; h]


def main(argv=None) -> int:
    a = fit_args(__doc__, "trunk blocks (SmolLM2-135M has 30; the rest inert)").parse_args(argv)
    if a.blocks < 30:
        print("error: --blocks must be at least 30 (the model's own blocks)", file=sys.stderr)
        return 2
    base = f16_base(a.cache)
    probe = write_mimo2(base, a.cache / "smollm2-mtp-probe.gguf", 30, None)
    print(f"fitting the MTP layer on SmolLM2's own text ({a.prompts} prompts x {a.tokens} tokens)")
    eh = fit_eh_proj(probe, a.prompts, a.tokens, a.ridge, a.threads)
    out = write_mimo2(base, a.cache / f"smollm2-mtp-pad{a.blocks}-F16.gguf", a.blocks, eh)
    probe.unlink()
    print(f"{out} ({out.stat().st_size / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
