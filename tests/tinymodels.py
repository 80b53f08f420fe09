"""Tiny random llama-architecture GGUF models for fast tests (written with `gguf`)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _add_vocab(w, n_vocab: int, token_suffix: str, eos_id: int, chat_template: str | None,
               extra_control: tuple[str, ...] = ()) -> None:
    """A byte-fallback llama vocabulary of n_vocab tokens (control, bytes, ASCII, a few words, fillers;
    ``extra_control``: more control tokens, after <|im_end|>)."""
    T = gguf.TokenType
    toks, types = ["<unk>", "<s>", "</s>"], [T.UNKNOWN, T.CONTROL, T.CONTROL]
    toks += [f"<0x{b:02X}>" for b in range(256)]
    types += [T.BYTE] * 256
    for t in ("<|im_start|>", "<|im_end|>", *extra_control):
        toks.append(t)
        types.append(T.CONTROL)
    for t in ["\u2581"] + [chr(c) for c in range(33, 127)]:
        toks.append(t)
        types.append(T.NORMAL)
    for t in ["\u2581the", "\u2581a", "\u2581hello", "\u2581world"]:
        toks.append(t + token_suffix)
        types.append(T.NORMAL)
    i = 0
    while len(toks) < n_vocab:
        toks.append(f"\u2581w{i}{token_suffix}")
        types.append(T.NORMAL)
        i += 1
    scores = [0.0] * 259 + [-1.0 * k for k in range(len(toks) - 259)]
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(1)
    w.add_eos_token_id(eos_id)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)


def _writer(path: Path, arch: str, *, n_ctx: int, n_embd: int, n_blocks: int, n_ff: int, n_head: int,
            n_head_kv: int) -> "gguf.GGUFWriter":
    """A GGUF writer for ``arch`` with the sizes every tiny model states (F32 weights, rope over a
    whole head, base 10000, rms eps 1e-5); the caller adds the rest and :func:`_write` s it."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-test-{arch}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_blocks)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    return w


def _write(w, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def make_tiny_llama(
    path: Path,
    *,
    n_vocab: int = 384,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_layer: int = 2,
    n_ff: int = 128,
    n_ctx: int = 1024,
    seed: int = 0,
    out_noise: float = 0.0,
    out_scale: float = 1.0,
    chat_template: str | None = CHATML,
    eos_id: int = 2,
    token_suffix: str = "",
    block_scale: float = 0.3,
    extra_control: tuple[str, ...] = (),
    like: Path | None = None,
) -> Path:
    """Write a random model; the same seed with out_noise > 0 makes a 'draft'
    that agrees with the seed's model part of the time.  token_suffix changes
    token texts (to build a vocabulary-mismatched pair).  A small block_scale makes the
    model close to a bigram model of its embeddings; ``like``: a tiny model of another
    architecture whose token embeddings and output matrix this one takes (with a small
    block_scale, a draft agreeing with it where both are close to that bigram model)."""
    rng = np.random.default_rng(seed)
    hd = n_embd // n_head
    w = _writer(path, "llama", n_ctx=n_ctx, n_embd=n_embd, n_blocks=n_layer, n_ff=n_ff, n_head=n_head,
                n_head_kv=n_head_kv)
    w.add_vocab_size(n_vocab)
    _add_vocab(w, n_vocab, token_suffix, eos_id, chat_template, extra_control)

    def r(*shape, scale=0.02):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    shared = {}
    if like is not None:
        shared = {t.name: np.array(t.data, np.float32).reshape(n_vocab, n_embd)
                  for t in gguf.GGUFReader(str(like)).tensors if t.name in ("token_embd.weight", "output.weight")}
    w.add_tensor("token_embd.weight", shared.get("token_embd.weight", r(n_vocab, n_embd, scale=1.0)))
    for b in range(n_layer):
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{b}.attn_q.weight", r(n_head * hd, n_embd, scale=block_scale))
        w.add_tensor(f"blk.{b}.attn_k.weight", r(n_head_kv * hd, n_embd, scale=block_scale))
        w.add_tensor(f"blk.{b}.attn_v.weight", r(n_head_kv * hd, n_embd, scale=block_scale))
        w.add_tensor(f"blk.{b}.attn_output.weight", r(n_embd, n_head * hd, scale=block_scale))
        w.add_tensor(f"blk.{b}.ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{b}.ffn_gate.weight", r(n_ff, n_embd, scale=block_scale))
        w.add_tensor(f"blk.{b}.ffn_up.weight", r(n_ff, n_embd, scale=block_scale))
        w.add_tensor(f"blk.{b}.ffn_down.weight", r(n_embd, n_ff, scale=block_scale))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    out_w = shared.get("output.weight", r(n_vocab, n_embd, scale=out_scale))
    if out_noise:
        noise = np.random.default_rng(seed + 1000).standard_normal(out_w.shape) * out_noise
        out_w = (out_w + noise).astype(np.float32)
    w.add_tensor("output.weight", out_w)
    return _write(w, path)


def make_tiny_mimo2(
    path: Path,
    *,
    n_nextn: int = 1,
    n_vocab: int = 384,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_layer: int = 2,
    n_ff: int = 128,
    n_ctx: int = 1024,
    seed: int = 0,
    trunk_scale: float = 0.06,
    mtp_noise: float = 0.005,
    mtp_reads: str = "token",
    mtp_scale: float | None = None,
    chat_template: str | None = CHATML,
) -> Path:
    """A dense mimo2 model with ``n_nextn`` multi-token-prediction (nextn) layers after its
    ``n_layer`` trunk layers (``../shared/notes/mtp-eagle3.md``).  Small trunk weights make the
    trunk close to a bigram model of its embeddings; the MTP block's eh_proj is [I | noise] with
    small block weights, so the MTP head's prediction from (token, hidden) agrees with the trunk's
    part of the time (``mtp_noise`` lowers the agreement).  ``mtp_reads="hidden"``: eh_proj is
    [0 | I] instead, so (with a small ``mtp_scale`` for the MTP block) the MTP head at position p
    repeats the trunk's prediction at p-1, read from the hidden row it is fed: a test of the feed."""
    rng = np.random.default_rng(seed)
    hd = n_embd // n_head
    n_all = n_layer + n_nextn
    w = _writer(path, "mimo2", n_ctx=n_ctx, n_embd=n_embd, n_blocks=n_all, n_ff=n_ff, n_head=n_head,
                n_head_kv=n_head_kv)
    w.add_nextn_predict_layers(n_nextn)
    w.add_expert_feed_forward_length(n_ff)
    w.add_sliding_window(4 * n_ctx)  # wider than any context: every layer attends to all
    w.add_sliding_window_pattern([b == 0 for b in range(n_all)])  # one "sliding" trunk layer is required
    w.add_vocab_size(n_vocab)
    _add_vocab(w, n_vocab, "", 2, chat_template)

    def r(*shape, scale=0.02):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def block(b: int, scale: float) -> None:
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{b}.attn_qkv.weight", r((n_head + 2 * n_head_kv) * hd, n_embd, scale=scale))
        w.add_tensor(f"blk.{b}.attn_output.weight", r(n_embd, n_head * hd, scale=scale))
        w.add_tensor(f"blk.{b}.ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{b}.ffn_gate.weight", r(n_ff, n_embd, scale=scale))
        w.add_tensor(f"blk.{b}.ffn_up.weight", r(n_ff, n_embd, scale=scale))
        w.add_tensor(f"blk.{b}.ffn_down.weight", r(n_embd, n_ff, scale=scale))

    w.add_tensor("token_embd.weight", r(n_vocab, n_embd, scale=1.0))
    for b in range(n_layer):
        block(b, trunk_scale)
    for b in range(n_layer, n_all):
        block(b, trunk_scale if mtp_scale is None else mtp_scale)
        if mtp_reads == "hidden":
            eh = np.concatenate([np.zeros((n_embd, n_embd), np.float32), np.eye(n_embd, dtype=np.float32)], axis=1)
        else:
            eh = np.concatenate([np.eye(n_embd, dtype=np.float32), r(n_embd, n_embd, scale=mtp_noise)], axis=1)
        w.add_tensor(f"blk.{b}.nextn.eh_proj.weight", eh)
        w.add_tensor(f"blk.{b}.nextn.enorm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{b}.nextn.hnorm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", r(n_vocab, n_embd, scale=1.0))
    return _write(w, path)


def make_tiny_eagle3(
    path: Path,
    *,
    target_layers: tuple[int, int, int] = (0, 1, 2),
    reads: str = "token",
    n_vocab: int = 384,
    n_draft_vocab: int | None = None,
    n_embd: int = 64,
    target_embd: int = 64,
    n_head: int = 4,
    n_ff: int = 128,
    n_ctx: int = 1024,
    seed: int = 0,
    attn_gain: float = 3.0,
    token_suffix: str = "",
) -> Path:
    """An EAGLE-3 head (architecture ``eagle3``, one decoder layer; ``../shared/notes/mtp-eagle3.md``)
    for a tiny llama target of width ``target_embd``, sharing its embeddings and output matrix.

    ``reads="token"``: the decoder attends (sharply, q = k = ``attn_gain`` x the normed token
    embedding) to its own row's token and passes that embedding on, the fused features only
    adding a little: for a target close to a bigram model (``make_tiny_llama(block_scale=0.05)``)
    the head predicts what the target will, part of the time.  ``reads="feature0"`` /
    ``"feature2"``: no attention, no FFN, fc passes the first / third feature block through, so
    the head's logits are the target's output matrix on that feature row (the feed's test: with
    feature 2 the target's last hidden row, the first draft repeats the target's prediction at
    the row's position).  ``n_draft_vocab``: a smaller draft vocabulary (its own output matrix,
    the target's ids of its tokens in ``d2t``: every other third token)."""
    rng = np.random.default_rng(seed)
    w = _writer(path, "eagle3", n_ctx=n_ctx, n_embd=n_embd, n_blocks=1, n_ff=n_ff, n_head=n_head, n_head_kv=n_head)
    w.add_array("eagle3.target_layers", [int(i) for i in target_layers])  # int32 (the gguf wheel lacks a helper)
    w.add_uint32("eagle3.target_hidden_size", target_embd)
    _add_vocab(w, n_vocab, token_suffix, 2, None)

    def r(*shape, scale=0.02):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    eye = np.eye(n_embd, dtype=np.float32)
    zero = np.zeros((n_embd, n_embd), np.float32)
    if reads == "token":
        fc = r(n_embd, 3 * target_embd, scale=0.01)
        qk = np.concatenate([attn_gain * eye, zero], axis=1)  # (n_embd, 2 n_embd): the token's half
        v, wo, ffn = np.concatenate([eye, zero], axis=1), 4.0 * eye, 0.02
    else:
        block = {"feature0": 0, "feature2": 2}[reads]
        fc = np.zeros((n_embd, 3 * target_embd), np.float32)
        fc[:, block * target_embd:(block + 1) * target_embd] = np.eye(n_embd, target_embd, dtype=np.float32)
        qk = v = np.zeros((n_embd, 2 * n_embd), np.float32)
        wo, ffn = zero, 0.0
    w.add_tensor("fc.weight", fc)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("blk.0.attn_norm_2.weight", np.ones(n_embd, np.float32))
    w.add_tensor("blk.0.attn_q.weight", qk)
    w.add_tensor("blk.0.attn_k.weight", qk)
    w.add_tensor("blk.0.attn_v.weight", v)
    w.add_tensor("blk.0.attn_output.weight", wo)
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", r(n_ff, n_embd, scale=ffn))
    w.add_tensor("blk.0.ffn_up.weight", r(n_ff, n_embd, scale=ffn))
    w.add_tensor("blk.0.ffn_down.weight", r(n_embd, n_ff, scale=ffn))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    if n_draft_vocab:
        ids = np.arange(0, 3 * n_draft_vocab, 3, dtype=np.int64)[:n_draft_vocab]
        w.add_tensor("d2t", ids)
        w.add_tensor("output.weight", r(n_draft_vocab, n_embd, scale=1.0))
    return _write(w, path)


def make_tiny_qwen35(
    path: Path,
    *,
    n_nextn: int = 0,
    n_vocab: int = 384,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_layer: int = 4,
    full_attention_interval: int = 2,
    n_ff: int = 128,
    n_ctx: int = 1024,
    seed: int = 0,
    trunk_scale: float = 0.06,
    mtp_noise: float = 0.005,
    chat_template: str | None = CHATML,
) -> Path:
    """A hybrid qwen35 model: of its ``n_layer`` trunk layers every ``full_attention_interval``-th is
    a gated full-attention layer, the others gated delta-net (recurrent) layers whose state lives in
    llama.cpp's recurrent memory (src/models/qwen35.cpp), then ``n_nextn`` MTP (nextn) blocks.  Small
    block weights keep the trunk close to a bigram model of its embeddings (as make_tiny_mimo2), so an
    MTP block with eh_proj = [I | noise] agrees with it part of the time."""
    rng = np.random.default_rng(seed)
    hd = n_embd // n_head  # attention head size; also the delta net's key/value head size
    n_k_heads, n_v_heads = 2, 4
    key_dim, value_dim = hd * n_k_heads, hd * n_v_heads
    d_conv, n_all = 4, n_layer + n_nextn
    w = _writer(path, "qwen35", n_ctx=n_ctx, n_embd=n_embd, n_blocks=n_all, n_ff=n_ff, n_head=n_head,
                n_head_kv=n_head_kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_sections([hd // 2 - hd // 4, hd // 4, 0, 0])  # imrope: sums to n_rot / 2
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(value_dim)
    w.add_ssm_state_size(hd)
    w.add_ssm_time_step_rank(n_v_heads)
    w.add_ssm_group_count(n_k_heads)
    w.add_uint32("qwen35.full_attention_interval", full_attention_interval)
    if n_nextn:
        w.add_nextn_predict_layers(n_nextn)
    w.add_vocab_size(n_vocab)
    _add_vocab(w, n_vocab, "", 2, chat_template)

    def r(*shape, scale=0.02):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def common(b: int, s: float) -> None:
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{b}.post_attention_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{b}.ffn_gate.weight", r(n_ff, n_embd, scale=s))
        w.add_tensor(f"blk.{b}.ffn_up.weight", r(n_ff, n_embd, scale=s))
        w.add_tensor(f"blk.{b}.ffn_down.weight", r(n_embd, n_ff, scale=s))

    def attention(b: int, s: float) -> None:
        w.add_tensor(f"blk.{b}.attn_q.weight", r(2 * n_head * hd, n_embd, scale=s))  # query and gate
        w.add_tensor(f"blk.{b}.attn_k.weight", r(n_head_kv * hd, n_embd, scale=s))
        w.add_tensor(f"blk.{b}.attn_v.weight", r(n_head_kv * hd, n_embd, scale=s))
        w.add_tensor(f"blk.{b}.attn_output.weight", r(n_embd, n_head * hd, scale=s))
        w.add_tensor(f"blk.{b}.attn_q_norm.weight", np.ones(hd, np.float32))
        w.add_tensor(f"blk.{b}.attn_k_norm.weight", np.ones(hd, np.float32))

    def delta_net(b: int, s: float) -> None:
        w.add_tensor(f"blk.{b}.attn_qkv.weight", r(2 * key_dim + value_dim, n_embd, scale=s))
        w.add_tensor(f"blk.{b}.attn_gate.weight", r(value_dim, n_embd, scale=s))
        w.add_tensor(f"blk.{b}.ssm_conv1d.weight", r(2 * key_dim + value_dim, d_conv, scale=0.5))
        w.add_tensor(f"blk.{b}.ssm_dt.bias", r(n_v_heads, scale=0.5))
        w.add_tensor(f"blk.{b}.ssm_a", -np.exp(r(n_v_heads, scale=0.5)))  # negative: a decaying state
        w.add_tensor(f"blk.{b}.ssm_beta.weight", r(n_v_heads, n_embd, scale=s))
        w.add_tensor(f"blk.{b}.ssm_alpha.weight", r(n_v_heads, n_embd, scale=s))
        w.add_tensor(f"blk.{b}.ssm_norm.weight", np.ones(hd, np.float32))
        w.add_tensor(f"blk.{b}.ssm_out.weight", r(n_embd, value_dim, scale=s))

    w.add_tensor("token_embd.weight", r(n_vocab, n_embd, scale=1.0))
    for b in range(n_layer):
        common(b, trunk_scale)
        (attention if (b + 1) % full_attention_interval == 0 else delta_net)(b, trunk_scale)
    for b in range(n_layer, n_all):
        common(b, trunk_scale)
        attention(b, trunk_scale)
        eh = np.concatenate([np.eye(n_embd, dtype=np.float32), r(n_embd, n_embd, scale=mtp_noise)], axis=1)
        w.add_tensor(f"blk.{b}.nextn.eh_proj.weight", eh)
        w.add_tensor(f"blk.{b}.nextn.enorm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{b}.nextn.hnorm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{b}.nextn.shared_head_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", r(n_vocab, n_embd, scale=1.0))
    return _write(w, path)
