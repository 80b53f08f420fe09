#!/usr/bin/env python3
"""An EAGLE-3 head for the cost-realistic stand-in target (``make_standin.py``'s padded SmolLM2).

No real EAGLE-3 head (Llama 3.1 8B, Qwen3) can be downloaded or run here, so speed figures need a
head for the stand-in: a one-layer ``eagle3`` GGUF reading three of the stand-in's layer inputs
(low, middle, and the input of its last block, which the inert padding makes SmolLM2's final
hidden row h_P), sharing its embeddings and output matrix, and predicting as the target would
where a linear map can:

* ``fc`` passes the third feature through, so g_P = h_P (and a chained draft step, fed the
  decoder's own output row, gets the same kind of vector);
* the decoder's attention looks only at its own row (q = k = a large multiple of the normed
  token embedding: the softmax is one-hot on the row) and its values are a linear map L of
  [rmsnorm(e_{t_{P+1}}), rmsnorm(g_P)], fitted by ridge regression so that the output row
  L x + g_P approximates h_{P+1} over SmolLM2's own greedy continuations of prompts unrelated to
  the benchmark's (this repository's README); the FFN writes nothing.

Like the MTP stand-in (``make_mtp_standin.py``) this is a linear predictor of the next hidden
row, so it is accepted far less often than a trained EAGLE-3 head: a test of the mechanics and
of the cost of drafting with a head, not of a trained head's acceptance.

    .venv/bin/python benchmarks/make_eagle3_standin.py              # head for the 240-block stand-in
    .venv/bin/python benchmarks/make_eagle3_standin.py --blocks 31  # one inert block (fast to test)

Files go into the git-ignored cache (``.cache/standin/``); needs the ``gguf`` package.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_mtp_standin import _rms, corpus_sequences, f16_base, fit_args, ridge_fit  # noqa: E402
from make_standin import finish, pad_model  # noqa: E402

GAIN = 10.0  # q = k = GAIN x normed embedding: a row's score with itself beats any other by > 50


def collect(model: Path, layer: int, n_prompts: int, n_tokens: int, threads: int, log=print):
    """(tokens, final hidden rows) of SmolLM2's greedy continuations of the corpus prompts, on a
    padded ``model`` whose block ``layer`` is inert (its input is SmolLM2's final hidden row: a
    llama graph hands out layer inputs for every row, and no last hidden row at all)."""
    from mars_local.llama.context import Context
    from mars_local.llama.eagle3 import _layer_inputs
    from mars_local.llama.runtime import Model

    seqs = corpus_sequences(model, n_prompts, n_tokens, threads, log)
    m = Model(model, 0, exact_kernels=True)
    ctx = Context(m, n_ctx=1024, n_threads=threads)
    ctx.capture_hidden(m.n_embd, _layer_inputs(ctx._ctx, (layer,), layer + 1, m.n_embd))
    out = []
    try:
        for toks in seqs:
            ctx.truncate(0)
            ctx.eval(toks, n_out=0)
            out.append((toks, ctx.hidden[: len(toks)].copy()))
    finally:
        ctx.close()
        m.close()
    return out


def fit(seqs, embd: np.ndarray, ridge: float, log=print) -> np.ndarray:
    """L (n_embd, 2 n_embd): h_{P+1} - h_P ~ L [rms(e_{t_{P+1}}), rms(h_P)]."""
    xs, ys = [], []
    for toks, h in seqs:
        e = embd[np.asarray(toks[1:])].astype(np.float32)
        xs.append(np.concatenate([_rms(e), _rms(h[:-1])], axis=1))
        ys.append(h[1:] - h[:-1])
    return ridge_fit(np.concatenate(xs), np.concatenate(ys), ridge, "the head", log)


def write_head(base: Path, dst: Path, layers: tuple[int, int, int], lin: np.ndarray) -> Path:
    """The eagle3 GGUF: SmolLM2's tokenizer and sizes, fc selecting the third feature, the fitted
    values ``lin``, self-focused attention, no FFN, no own embeddings or output."""
    import gguf

    r = gguf.GGUFReader(str(base))
    f = r.fields
    n = int(f["llama.embedding_length"].contents())
    n_head = int(f["llama.attention.head_count"].contents())
    n_ff = int(f["llama.feed_forward_length"].contents())
    tensors = {t.name: t for t in r.tensors}
    tmp = dst.with_name(dst.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "eagle3")
    for name, field in f.items():
        if name.startswith("tokenizer."):
            from make_standin import _copy_field

            _copy_field(w, field)
    w.add_name("SmolLM2 stand-in EAGLE-3 head (linear, fitted)")
    w.add_context_length(int(f["llama.context_length"].contents()))
    w.add_embedding_length(n)
    w.add_block_count(1)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(int(f["llama.rope.dimension_count"].contents()))
    w.add_rope_freq_base(float(f["llama.rope.freq_base"].contents()))
    w.add_layer_norm_rms_eps(float(f["llama.attention.layer_norm_rms_epsilon"].contents()))
    w.add_array("eagle3.target_layers", [int(i) for i in layers])
    w.add_uint32("eagle3.target_hidden_size", n)
    eye, zero = np.eye(n, dtype=np.float32), np.zeros((n, n), np.float32)
    fc = np.zeros((n, 3 * n), np.float32)
    fc[:, 2 * n:] = eye
    f16 = np.float16
    w.add_tensor("fc.weight", fc.astype(f16))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(n, np.float32))
    w.add_tensor("blk.0.attn_norm_2.weight", np.ones(n, np.float32))
    qk = np.concatenate([GAIN * eye, zero], axis=1).astype(f16)
    w.add_tensor("blk.0.attn_q.weight", qk)
    w.add_tensor("blk.0.attn_k.weight", qk)
    w.add_tensor("blk.0.attn_v.weight", lin.astype(f16))
    w.add_tensor("blk.0.attn_output.weight", eye.astype(f16))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(n, np.float32))
    for name, shape in (("ffn_gate", (n_ff, n)), ("ffn_up", (n_ff, n)), ("ffn_down", (n, n_ff))):
        w.add_tensor(f"blk.0.{name}.weight", np.zeros(shape, f16))
    w.add_tensor("output_norm.weight", np.asarray(tensors["output_norm.weight"].data))
    return finish(w, tmp, dst)


def main(argv=None) -> int:
    a = fit_args(__doc__, "the stand-in's blocks (SmolLM2's 30 + inert ones)").parse_args(argv)
    if a.blocks < 31:
        print("error: --blocks must be at least 31 (SmolLM2's 30 and an inert one, whose input is the "
              "final hidden row the head reads)", file=sys.stderr)
        return 2
    base = f16_base(a.cache)
    probe = pad_model(base, a.cache / "smollm2-eagle3-probe.gguf", 31)  # block 30 inert: its input is h
    print(f"fitting the head on SmolLM2's own text ({a.prompts} prompts x {a.tokens} tokens)")
    import gguf

    embd = np.asarray(next(t for t in gguf.GGUFReader(str(base)).tensors if t.name == "token_embd.weight").data)
    lin = fit(collect(probe, 30, a.prompts, a.tokens, a.threads), embd, a.ridge)
    probe.unlink()
    layers = (2, 15, a.blocks - 1)  # the last block's input: SmolLM2's final hidden row (inert padding)
    out = write_head(base, a.cache / f"smollm2-eagle3-head-pad{a.blocks}.gguf", layers, lin)
    print(f"{out} ({out.stat().st_size / 1e6:.1f} MB), target layers {list(layers)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
