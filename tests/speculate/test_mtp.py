"""Drafting with the target's own multi-token-prediction (nextn) layers (--drafter mtp): tiny mimo2
models written by the tests (tests/tinymodels.py), with 1 and 2 nextn layers."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import invoke, one_error_line
from mars_local import Engine, MarsError
from mars_local.llama.mtp import check_mtp_model, mtp_layers
from head_checks import (PROMPTS, every_draft_is_a_fresh_heads, exact_across_chunks_reuse_and_turns,
                         many_sequences_stay_exact, mars_relaxes_only_the_runner_up, plain, record_drafts,
                         sampling_has_the_plain_law, scheduler_first_drafts, strict_equals_plain)



@pytest.fixture(scope="session")
def mimo2(tiny_dir):
    from tinymodels import make_tiny_mimo2

    return {n: make_tiny_mimo2(tiny_dir / f"mimo2-nextn{n}.gguf", n_nextn=n, seed=5) for n in (1, 2)}


@pytest.fixture(scope="module", params=[1, 2], ids=["1-nextn", "2-nextn"])
def eng(request, mimo2):
    with Engine(mimo2[request.param], drafter="mtp", n_ctx=512, n_threads=2, learned=False) as e:
        yield e


# ------------------------------------------------------------------ what a file can draft with
def test_the_nextn_layers_are_read_from_the_header(mimo2, tiny_target):
    assert mtp_layers(mimo2[1]) == ("mimo2", 1) and mtp_layers(mimo2[2]) == ("mimo2", 2)
    assert check_mtp_model(mimo2[2]) == 2
    assert mtp_layers(tiny_target) == ("llama", 0)


def test_a_model_without_nextn_layers_is_one_clear_error(tiny_target):
    with pytest.raises(MarsError, match="no multi-token-prediction"):
        Engine(tiny_target, drafter="mtp")  # refused before llama.cpp loads it (an MTP context would abort)
    r = invoke("run", "-m", tiny_target, "--drafter", "mtp", "-n", "4", "hello")
    assert "no multi-token-prediction (nextn) layers" in one_error_line(r)


@pytest.mark.parametrize("arch, needle", [("qwen3next", "recurrent layers"), ("llama", "cannot run the nextn layers")])
def test_architectures_whose_nextn_layers_cannot_draft_are_refused(tmp_path, arch, needle):
    import gguf

    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(MarsError, match=needle):
        check_mtp_model(path)


# ------------------------------------------------------------------ lossless
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, None])
def test_strict_greedy_equals_plain_greedy(eng, k):
    strict_equals_plain(eng, k)


def test_exact_across_prompt_chunks_prefix_reuse_turns_and_a_limit_mid_window(mimo2):
    with Engine(mimo2[1], drafter="mtp", n_ctx=512, n_batch=16, n_threads=2, learned=False) as e, \
            Engine(mimo2[1], n_ctx=512, n_batch=16, n_threads=2, learned=False) as ref:
        exact_across_chunks_reuse_and_turns(e, ref)


def test_mars_relaxes_only_the_runner_up_where_the_target_is_undecided(mimo2):
    with Engine(mimo2[1], drafter="mtp", n_ctx=512, n_threads=2, learned=False) as e:
        mars_relaxes_only_the_runner_up(e)


@pytest.mark.slow
def test_sampling_with_mtp_drafts_has_the_plain_distribution(mimo2):
    with Engine(mimo2[1], drafter="mtp", n_ctx=512, n_threads=2, learned=False) as e:
        sampling_has_the_plain_law(e)


# ------------------------------------------------------------------ where users meet it
def test_mars_run_drafts_with_mtp(mimo2):
    import json

    args = ("run", "-m", mimo2[1], "-n", "24", "--temp", "0", "--verify", "strict", "--json", "hello world")
    r = invoke(*args, "--drafter", "mtp")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    ref = json.loads(invoke(*args, "--no-draft").stdout)
    assert got["stats"]["n_drafted"] > 0 and got["tokens"] == ref["tokens"]


@pytest.mark.parametrize("n_parallel, n_prompts", [(3, 5), (8, 8)])
def test_many_sequences_draft_with_mtp_and_stay_exact(mimo2, n_parallel, n_prompts):
    with Engine(mimo2[2], drafter="mtp", n_ctx=512, n_threads=2, learned=False) as e:
        many_sequences_stay_exact(e, n_parallel, n_prompts)


def test_every_draft_is_the_one_a_fresh_mtp_context_makes_for_its_tokens(mimo2, monkeypatch):
    from mars_local.llama.mtp import open_mtp
    from contextlib import closing

    from mars_local.llama.runtime import Model

    with Engine(mimo2[1], drafter="mtp", n_ctx=512, n_batch=16, n_threads=2, learned=False) as e, \
            closing(Model(mimo2[1], 0, exact_kernels=True, load_mtp=True)) as m:
        every_draft_is_a_fresh_heads(e, m, open_mtp, monkeypatch)


def test_the_mtp_layer_is_fed_the_target_hidden_row_of_the_position_before(tiny_dir, monkeypatch):
    """An MTP layer that reads only its hidden input (eh_proj = [0 | I], a near-identity block)
    predicts what the trunk predicted one position earlier: fed h_{p-1} at p, its first draft
    after a greedy token must be that token again (fed the wrong row, it would not be)."""
    from tinymodels import make_tiny_mimo2

    path = make_tiny_mimo2(tiny_dir / "mimo2-reads-hidden.gguf", seed=5, mtp_reads="hidden", mtp_scale=0.001)
    drafts = record_drafts(monkeypatch)
    with Engine(path, drafter="mtp", n_ctx=512, n_batch=16, n_threads=2, learned=False) as e:
        for prompt in PROMPTS:
            e.generate(prompt * 2, max_tokens=30, temperature=0, verify="strict", draft_max=3, adaptive=False,
                       ignore_eos=True)
    seen = [(tokens[-1], d[0] if d else None) for tokens, d in drafts]
    assert len(seen) > 20
    assert sum(last == d0 for last, d0 in seen) >= 0.9 * len(seen), seen


def test_the_scheduler_feeds_each_sequence_its_own_hidden_rows(tiny_dir, monkeypatch):
    """As the lone feed test, for sequences drafting in lockstep: with the MTP layer that repeats
    the trunk's previous prediction, each sequence's first draft is its own last token."""
    from tinymodels import make_tiny_mimo2

    path = make_tiny_mimo2(tiny_dir / "mimo2-reads-hidden.gguf", seed=5, mtp_reads="hidden", mtp_scale=0.001)
    with Engine(path, drafter="mtp", n_ctx=512, n_batch=16, n_threads=2, learned=False) as e:
        drafted = scheduler_first_drafts(e, monkeypatch)
    assert len(drafted) > 20
    assert sum(last == d0 for last, d0 in drafted) >= 0.9 * len(drafted), drafted
