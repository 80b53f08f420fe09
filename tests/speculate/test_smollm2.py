"""End-to-end on the bundled SmolLM2-135M (real weights, real tokenizer)."""

from __future__ import annotations

import pytest

from mars_local import Engine

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a list of fruits: apple, banana, cherry. Here is the same list again: apple,",
    "Translate to French: The cat sits on the mat.\nFrench:",
]
N = 48


@pytest.fixture(scope="module")
def q41(smollm2):
    with Engine(smollm2, n_ctx=512) as eng:
        yield eng


@pytest.fixture(scope="module")
def f16_pair(smollm2_f16, smollm2):
    """F16 target, the original Q4_1 as draft: same vocabulary, different numerics."""
    with Engine(smollm2_f16, smollm2, n_ctx=512) as eng:
        yield eng


@pytest.fixture(scope="module")
def f16_plain(smollm2_f16):
    with Engine(smollm2_f16, n_ctx=512) as eng:
        yield eng


def test_ngram_strict_greedy_equals_plain(q41, smollm2):
    with Engine(smollm2, drafter="ngram", n_ctx=512) as ng:
        drafted = 0
        for prompt in PROMPTS:
            ref = q41.generate(prompt, max_tokens=N)
            out = ng.generate(prompt, max_tokens=N, verify="strict", draft_max=6, adaptive=False)
            assert out.tokens == ref.tokens, prompt
            drafted += out.stats.n_accepted
        assert drafted > 0


def test_draft_model_strict_greedy_equals_plain(f16_pair, f16_plain):
    accepted = 0
    for prompt in PROMPTS:
        ref = f16_plain.generate(prompt, max_tokens=N)
        out = f16_pair.generate(prompt, max_tokens=N, verify="strict", draft_max=6, adaptive=False)
        assert out.tokens == ref.tokens, prompt
        accepted += out.stats.n_accepted
    assert accepted > N  # the Q4_1 draft agrees most of the time


def test_k_quant_target_strict_greedy_equals_plain(smollm2_q4km, smollm2):
    """Q4_K_M weights are repacked for faster CPU kernels unless exact_kernels
    (the default) keeps the batch-invariant ones; the lossless guarantee holds."""
    with Engine(smollm2_q4km, n_ctx=512) as plain, Engine(smollm2_q4km, smollm2, n_ctx=512) as pair:
        for prompt in PROMPTS + ["Once upon a time, in a small village,", "The quick brown fox"]:
            ref = plain.generate(prompt, max_tokens=N)
            out = pair.generate(prompt, max_tokens=N, verify="strict", draft_max=6, adaptive=False)
            assert out.tokens == ref.tokens, prompt


def test_mars_accepted_length_above_strict(f16_pair):
    strict = mars = 0.0
    relaxed = 0
    for prompt in PROMPTS:
        s = f16_pair.generate(prompt, max_tokens=N, verify="strict", draft_max=8, adaptive=False).stats
        m = f16_pair.generate(prompt, max_tokens=N, verify="mars", theta=0.9, draft_max=8, adaptive=False).stats
        strict += s.mean_accepted_length
        mars += m.mean_accepted_length
        relaxed += m.n_relaxed
        assert m.acceptance_rate >= s.acceptance_rate - 0.02
    assert relaxed > 0
    assert mars >= strict


def test_chat_prompt_and_stop_on_end_of_turn(q41):
    """The instruct model, prompted in its chat format, ends its turn by itself."""
    prompt = q41.chat_prompt([{"role": "user", "content": "Say hello."}])
    assert q41.detokenize(prompt, special=True).startswith("<|im_start|>system")  # the template's default system turn
    out = q41.generate(prompt, max_tokens=128)
    assert out.stats.stop_reason == "eog"
    assert out.text.strip() and "<|im_end|>" not in out.text


def _requantized(name: str, kind: str):
    """A module fixture ``name``: SmolLM2's F16 requantized to ``kind`` (a LLAMA_FTYPE_MOSTLY_ suffix)."""
    @pytest.fixture(scope="module", name=name)
    def fixture(smollm2_f16):
        from conftest import requantize

        return requantize(smollm2_f16, f"SmolLM2-135M-Instruct.{kind}.gguf", f"LLAMA_FTYPE_MOSTLY_{kind}")

    return fixture


smollm2_q8 = _requantized("smollm2_q8", "Q8_0")
smollm2_q40 = _requantized("smollm2_q40", "Q4_0")
smollm2_q50 = _requantized("smollm2_q50", "Q5_0")
smollm2_iq4nl = _requantized("smollm2_iq4nl", "IQ4_NL")
smollm2_bf16 = _requantized("smollm2_bf16", "BF16")
smollm2_q5km = _requantized("smollm2_q5km", "Q5_K_M")
smollm2_q6k = _requantized("smollm2_q6k", "Q6_K")  # Q6_K where rows are 256-multiples (ffn_down), else a fallback


@pytest.mark.parametrize("which", ["smollm2", "smollm2_f16", "smollm2_bf16", "smollm2_q8", "smollm2_q40",
                                   "smollm2_q50", "smollm2_iq4nl", "smollm2_q4km", "smollm2_q5km", "smollm2_q6k"])
def test_verify_windows_are_batch_invariant(which, request):
    """The kernel-level condition for lossless speculation: a row computed in a
    window of w rows (up to 17, across llama.cpp's 8-row switch to its tiled
    K-quant kernel) is bit-identical to the same row computed alone.  F16/BF16
    and Q8_0/Q4_0/Q5_0/IQ4_NL go through llamafile's tinyBLAS at every size (one row in
    another tile shape than a window's: patches/0002); Q4_K_M mixes Q5_0/Q8_0
    (tinyBLAS) with Q4_K/Q6_K (vec_dot up to 64 rows; Q4_K and Q6_K windows in groups of up to
    eight rows per weight row on x86, patches/0004 and 0006: windows of 2, 3, 4, 7 and 8 rows are one group, 9 and
    17 end in a lone row, which takes the dot kernel); Q5_K rows in the tiled kernel's order on x86 with
    FMA, 9+ rows through that kernel (patches/0008)."""
    from mars_local.llama.invariance import batch_invariance

    res = batch_invariance(request.getfixturevalue(which), windows=(2, 3, 4, 7, 8, 9, 17), n=34, n_threads=2)
    assert {w: d for w, (d, _) in res.items()} == {w: 0 for w in res}, res


def test_repacked_q4_k_windows_are_batch_invariant_on_x86(smollm2_q4km):
    """patches/0005: with llama.cpp's repacked weights (what the load-time probe then picks for a
    Q4_K target), a row in a window of 4+ rows (the repacked gemm) is bit-identical to the row
    alone (the gemv); stock's two summed in different orders.  tests/llama/test_c_kernels.py
    checks the kernels themselves."""
    from helpers import x86_avx2_build

    from mars_local.llama.invariance import batch_invariance

    if not x86_avx2_build():
        pytest.skip("patches/0005 changes the x86 AVX2/AVX-512 repacked kernels only")
    res = batch_invariance(smollm2_q4km, windows=(2, 4, 5, 8, 9, 17), n=34, exact_kernels=False, n_threads=2)
    assert {w: d for w, (d, _) in res.items()} == {w: 0 for w in res}, res


def test_k_quant_long_windows_strict_equals_plain(smollm2_q4km, smollm2):
    """Windows of 8+ rows (k >= 7) on a K-quant target: stock llama.cpp switches
    to another kernel there; strict output still equals plain output."""
    with Engine(smollm2_q4km, n_ctx=512) as plain, Engine(smollm2_q4km, smollm2, n_ctx=512) as pair:
        for prompt in PROMPTS:
            ref = plain.generate(prompt, max_tokens=N)
            out = pair.generate(prompt, max_tokens=N, verify="strict", draft_max=12, adaptive=False)
            assert out.tokens == ref.tokens, prompt
            assert max(out.stats.k_per_round) == 12


def test_windows_at_a_long_context_are_batch_invariant(smollm2):
    """Past 512 cached positions llama.cpp's CPU flash attention splits a
    single query row's keys across threads (another summation order than a
    window's rows); patches/0003 turns that off."""
    from mars_local.llama.invariance import batch_invariance

    prompt = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(80))
    res = batch_invariance(smollm2, windows=(2, 9), n=18, n_threads=2, prompt=prompt)
    assert {w: d for w, (d, _) in res.items()} == {2: 0, 9: 0}, res


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "smollm2_f16", "smollm2_q4km"])
def test_the_last_token_riding_in_the_prompt_chunk_is_computed_as_alone(which, request):
    """The first token comes from the prompt's last row when that row rode in the prompt's last chunk
    (llama.context.last_rides): its logits, and the cache it leaves, must be a lone run's bit for bit
    (prefill of the rest, then a 1-row decode), at prompt lengths on both sides of the bound."""
    import numpy as np

    from mars_local.llama.context import Context
    from mars_local.llama.runtime import Model

    m = Model(request.getfixturevalue(which), 0, exact_kernels=True)
    text = "The history of the printing press begins in the workshops of many towns and cities. " * 8
    toks = m.tokenize(text)
    try:
        for n in (6, 40, 63, 64, 65, 90):
            a, b = Context(m, n_ctx=256, n_threads=2), Context(m, n_ctx=256, n_threads=2)
            try:
                _, row = a.prefill(toks[:n])
                assert (row is not None) == (n <= 64), n
                b.sync(toks[: n - 1])
                lone = b.eval([toks[n - 1]], 1)[0].copy()
                if row is None:  # no ride: the cache holds the prompt without its last token
                    assert a.n_past == n - 1
                    row = a.eval([toks[n - 1]], 1)[0].copy()
                assert np.array_equal(row, lone), n
                nxt = int(lone.argmax())  # the next row reads every cell the prompt left
                assert np.array_equal(a.eval([nxt], 1)[0], b.eval([nxt], 1)[0]), n
            finally:
                a.close()
                b.close()
    finally:
        m.close()


# ------------------------------------------------------------------ repacked weights, where measured exact
@pytest.mark.parametrize("which", ["smollm2_q40", "smollm2_q4km"])
def test_an_exact_target_is_repacked_only_where_this_machine_measured_it_invariant(which, request, smollm2,
                                                                                  tmp_path, monkeypatch):
    """speculate.repack: the first load measures the repacked kernels on this CPU and build (windows
    of 2, 5, 9 rows against single rows), keeps the verdict, and loads repacked only if no row differed;
    strict greedy still equals plain greedy; the second load reuses the verdict without measuring."""
    from mars_local.llama.invariance import batch_invariance
    from mars_local.speculate import repack
    from mars_local.speculate.learned import LearnedStore

    path = request.getfixturevalue(which)
    measured = batch_invariance(path, windows=repack.PROBE_WINDOWS, n=repack.PROBE_TOKENS, exact_kernels=False)
    invariant = all(d == 0 for d, _ in measured.values())
    store = LearnedStore(tmp_path / "learned.json")
    with Engine(path, smollm2, n_ctx=512, learned=store) as pair:
        verdict = store.get(repack.repack_key(path))
        assert verdict["invariant"] is invariant, (verdict, measured)
        assert verdict["windows"] == {str(w): d for w, (d, _) in measured.items()}
        monkeypatch.setattr(repack, "model_invariance", lambda *a, **k: pytest.fail("measured twice"))
        with Engine(path, n_ctx=512, learned=LearnedStore(tmp_path / "learned.json")) as plain:
            for prompt in PROMPTS[:2]:
                ref = plain.generate(prompt, max_tokens=N)  # one row per step, the same kernels
                out = pair.generate(prompt, max_tokens=N, verify="strict", draft_max=8, adaptive=False)
                assert out.tokens == ref.tokens, prompt


def test_float_targets_and_engines_without_learned_state_are_not_measured(smollm2_f16, smollm2_q40, tmp_path,
                                                                          monkeypatch):
    from mars_local.speculate import repack
    from mars_local.speculate.learned import LearnedStore

    monkeypatch.setattr(repack, "model_invariance", lambda *a, **k: pytest.fail("measured"))
    store = LearnedStore(tmp_path / "learned.json")
    with Engine(smollm2_f16, n_ctx=256, learned=store):
        pass
    with Engine(smollm2_q40, n_ctx=256, learned=False):
        pass
    assert store.get(repack.repack_key(smollm2_f16)) is None
