"""`mars chat`, `models`, `pull`, `doctor` and the everyday `run` flags."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from mars_local import Engine
from mars_local.cli import app
from mars_local.cli_chat import ChatSession
from mars_local.engine import GenerateConfig
from mars_local.hub import split_parts

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def invoke(*args, input=None, env=None):
    return runner.invoke(app, [str(a) for a in args], input=input, env=env)


def mars(*args, env=None, **kw):
    """The real entry point in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "mars_local", *map(str, args)], capture_output=True, text=True,
                          env=full_env, **kw)


def one_error_line(r, code=2):
    assert r.exit_code == code, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    return lines[0]


# ------------------------------------------------------------------- run
def test_run_chat_and_system_use_the_template(tiny_target):
    plain = invoke("run", "hello", "-m", tiny_target, "-n", 6, "--json")
    chat = invoke("run", "hello", "-m", tiny_target, "-n", 6, "--json", "--chat")
    system = invoke("run", "hello", "-m", tiny_target, "-n", 6, "--json", "--system", "be brief")
    n = [json.loads(r.stdout)["stats"]["n_prompt"] for r in (plain, chat, system)]
    assert n[0] < n[1] < n[2]


def test_show_acceptance_colours_tokens(tiny_target, tiny_draft):
    r = invoke("run", "hello world", "-m", tiny_target, "-md", tiny_draft, "-n", 24, "--show-acceptance",
               "--no-adaptive", "--draft-max", 4, env={"FORCE_COLOR": "1", "TERM": "xterm-256color"})
    assert r.exit_code == 0, r.output
    assert "\x1b[32m" in r.stdout  # green: accepted draft tokens


def test_chat_without_template_is_refused(tiny_dir):
    from tinymodels import make_tiny_llama

    path = make_tiny_llama(tiny_dir / "no-template.gguf", chat_template=None)
    assert "chat template" in one_error_line(invoke("run", "hi", "-m", path, "--chat"))


# ------------------------------------------------------------------ chat
@pytest.fixture()
def session(tiny_target, tiny_draft):
    eng = Engine(tiny_target, tiny_draft, n_ctx=512)
    yield ChatSession(eng, GenerateConfig.make(max_tokens=12, verify="mars"), system="be nice")
    eng.close()


def test_chat_reuses_the_kv_cache_across_turns(session):
    from dataclasses import replace

    # strict: the answers (and so what the next turn can reuse) do not depend on the draft lengths chosen
    session.config = replace(session.config, verify="strict")
    session.ask("hello world", lambda c: None)
    first = session.last_stats
    session.ask("the a the a", lambda c: None)
    second = session.last_stats
    # turn 2 re-renders the whole conversation but evaluates little more than the new message
    new_tokens = second.n_prompt - first.n_prompt
    assert second.n_prompt_evaluated < new_tokens
    assert second.n_prompt_evaluated < second.n_prompt / 2


def test_chat_slash_commands(session):
    assert "/reset" in session.command("/help")
    assert session.command("/verify strict") == "(verification: strict)" and session.config.verify == "strict"
    assert session.command("/theta 0.8") == "(theta = 0.8)" and session.config.theta == 0.8
    assert session.command("/theta 7").startswith("usage")
    assert session.command("/stats") == "(no answer yet)"
    session.ask("hello", lambda c: None)
    assert "tokens/s" in session.command("/stats")
    assert session.command("/system short") .startswith("(system prompt set") and session.messages == []
    assert session.command("/reset") == "(conversation reset)"
    assert session.command("/bogus").startswith("unknown command")
    assert session.command("/quit") is None


def test_chat_slides_history_when_the_context_fills(tiny_target):
    with Engine(tiny_target, n_ctx=256) as eng:
        s = ChatSession(eng, GenerateConfig.make(max_tokens=8), reserve=16)
        for i in range(12):
            s.ask(f"w{i} " * 6, lambda c: None)
        assert len(eng.chat_prompt(s.messages)) <= eng.n_ctx
        assert s.messages[-2]["content"].startswith("w11")
        # a message that can never fit is refused and loses nothing
        before = list(s.messages)
        with pytest.raises(Exception, match="context"):
            s.ask("hello " * 400, lambda c: None)
        assert s.messages == before


@pytest.mark.slow
def test_chat_in_a_real_terminal(smollm2):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-m", "mars_local", "chat", "-n", "400", "-c", "2048"],
                          encoding="utf-8", timeout=60, dimensions=(40, 120))
    child.expect(">>> ")
    child.sendline("Say hello in one short sentence.")
    child.expect(">>> ")
    first = child.before
    assert len(first.strip()) > 0
    child.sendline("/stats")
    child.expect("tokens/s.*evaluated\\)")
    child.expect(">>> ")
    child.sendline("Write a long story about a dragon.")
    child.expect("dragon\\.\r\n")  # our line, echoed by the terminal
    child.expect(r"\S\S")  # the answer is streaming (up to 400 tokens: seconds)
    child.sendintr()  # Ctrl-C stops the answer, not the chat
    child.expect("\\(stopped\\)")
    child.expect(">>> ")
    child.sendline("/verify strict")
    child.expect("verification: strict")
    child.expect(">>> ")
    child.sendeof()  # Ctrl-D leaves
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


# ------------------------------------------------------- models, pull, doctor
def test_registry_schema():
    data = yaml.safe_load((ROOT / "models.yaml").read_text())
    assert data["default"] in data["models"]
    real = {name: m for name, m in data["models"].items() if "repo" in m["target"]}
    assert len(real) >= 5
    for name, m in data["models"].items():
        for role in ("target", "draft"):
            spec = m.get(role)
            if spec is None:
                continue
            assert spec["file"].endswith(".gguf"), name
            assert ("repo" in spec) != ("package" in spec), name
            if "repo" in spec:
                assert spec["repo"].count("/") == 1, name
        assert 0 < m["theta"] <= 1 and m["draft_max"] >= 1 and m["drafter"] in ("model", "ngram", "none")
        if m["drafter"] == "model":
            assert "draft" in m
    families = " ".join(real).lower()
    for fam in ("qwen2.5-7b", "llama3.1-8b", "qwen3-8b", "gemma3-12b", "coder"):
        assert fam in families


def test_models_json_and_user_registry(tmp_path, tiny_target):
    user = tmp_path / "cfg"
    user.mkdir()
    (user / "models.yaml").write_text(yaml.safe_dump({"models": {"mine": {
        "target": {"repo": "me/tiny-GGUF", "file": "tiny.gguf"}, "drafter": "ngram", "theta": 0.8, "draft_max": 3}}}))
    r = invoke("models", "--json", env={"MARS_CONFIG_DIR": str(user)})
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    names = {m["name"]: m for m in obj["models"]}
    assert "smollm2-135m" in names and names["smollm2-135m"]["target"]["present"]
    assert names["mine"]["theta"] == 0.8 and not names["mine"]["target"]["present"]
    assert len(obj["sources"]) == 2
    table = invoke("models", env={"MARS_CONFIG_DIR": str(user)})
    assert table.exit_code == 0 and "mine" in table.stdout
    (user / "models.yaml").write_text("models: [unclosed")
    assert "registry" in one_error_line(invoke("models", env={"MARS_CONFIG_DIR": str(user)}))


def test_split_gguf_parts():
    assert split_parts("m-00002-of-00003.gguf") == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf",
                                                    "m-00003-of-00003.gguf"]
    assert split_parts("m.gguf") == ["m.gguf"]


def fake_hf_cache(root: Path, repo: str, files: dict[str, Path]) -> Path:
    """The standard HF cache layout (models--owner--name/snapshots/REV/FILE + refs/main)."""
    base = root / ("models--" + repo.replace("/", "--"))
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = base / "snapshots" / rev
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(rev)
    for name, src in files.items():
        shutil.copy(src, snap / name)
    return snap


def test_pull_downloads_every_part_with_the_hub_client(monkeypatch, tmp_path):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, filename, force_download=False, **kw):
        calls.append((repo_id, filename))
        p = tmp_path / filename
        p.write_bytes(b"GGUF")
        return str(p)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    r = invoke("pull", "hf:me/big-GGUF/big-00001-of-00002.gguf")
    assert r.exit_code == 0, r.output
    assert calls == [("me/big-GGUF", "big-00001-of-00002.gguf"), ("me/big-GGUF", "big-00002-of-00002.gguf")]
    calls.clear()
    r = invoke("pull", "qwen3-8b")
    assert r.exit_code == 0, r.output
    assert calls == [("Qwen/Qwen3-8B-GGUF", "Qwen3-8B-Q4_K_M.gguf"), ("Qwen/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q8_0.gguf")]
    assert "unknown model" in one_error_line(invoke("pull", "no-such-pair"))


def test_cached_hub_models_work_offline(tiny_target, tiny_draft, tmp_path):
    cache = tmp_path / "hf"
    fake_hf_cache(cache, "me/tiny-GGUF", {"tiny.gguf": tiny_target, "draft.gguf": tiny_draft})
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    r = mars("run", "hello", "-m", "hf:me/tiny-GGUF/tiny.gguf", "-md", "hf:me/tiny-GGUF/draft.gguf", "-n", 4,
             "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["n_generated"] >= 1
    pulled = mars("pull", "hf:me/tiny-GGUF/tiny.gguf", env=env)  # cached: no network needed
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.strip().endswith("tiny.gguf")
    missing = mars("pull", "hf:me/tiny-GGUF/other.gguf", env=env)
    assert missing.returncode == 2 and "offline" in missing.stderr and "Traceback" not in missing.stderr
    gone = mars("run", "hi", "-m", "hf:me/tiny-GGUF/other.gguf", env=env)
    assert gone.returncode == 2 and "mars pull" in gone.stderr


def test_doctor_json():
    r = invoke("doctor", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["backend"] in ("cpu", "cuda", "metal", "vulkan", "hip", "sycl", "musa", "opencl")
    assert isinstance(rep["gpu_offload"], bool) and isinstance(rep["native_hot_path"], bool)
    assert rep["llama_cpp_python"] == "0.3.36"
    assert rep["models"]["smollm2-135m"] is True
    text = invoke("doctor")
    assert text.exit_code == 0 and "backend:" in text.stdout


def test_learned_state_persists_shows_in_doctor_and_resets(tiny_target, tiny_draft, tmp_path):
    """A second process starts from what the first learned (no re-timing of
    verify windows); doctor lists it; --reset-learned forgets it."""
    env = {"MARS_STATE_DIR": str(tmp_path / "state")}
    args = ("run", "hello world", "-m", tiny_target, "-md", tiny_draft, "-n", "24", "--json", "--verify", "strict")
    first = mars(*args, env=env)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["stats"]["time_calibrate_s"] > 0
    assert (tmp_path / "state" / "learned.json").exists()
    second = mars(*args, env=env)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["stats"]["time_calibrate_s"] == 0  # started informed
    doc = mars("doctor", "--json", env=env)
    entries = json.loads(doc.stdout)["learned"]["entries"]
    kinds = {k.split("|")[0] for k in entries}
    assert {"costs", "draft", "accept"} <= kinds
    assert any(v.startswith("verify-window costs") for v in entries.values())
    reset = mars("doctor", "--reset-learned", env=env)
    assert reset.returncode == 0 and "forgot" in reset.stdout
    assert not (tmp_path / "state" / "learned.json").exists()
    third = mars(*args, env=env)
    assert json.loads(third.stdout)["stats"]["time_calibrate_s"] > 0
