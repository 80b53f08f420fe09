"""`mars chat`, `models`, `pull`, `doctor` and the everyday `run` flags."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from mars_local import Engine, GenerateConfig, MarsError
from mars_local.chat.session import ChatSession, ContextDropped, Interrupted, Text, TurnDone
from mars_local.models.hub import split_parts

from fake_engine import FakeEngine
from helpers import invoke, mars as _mars, one_error_line


def mars(*args, **kw):  # text output here
    return _mars(*args, text=True, **kw)


ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------- run
def test_run_chat_and_system_use_the_template(fake_engine):
    for extra in ([], ["--chat"], ["--system", "be brief"]):
        assert invoke("run", "hello", "-m", "fake.gguf", "--json", *extra).exit_code == 0
    assert [c[0] for c in fake_engine.calls] == ["hello", "<user>hello", "<system>be brief<user>hello"]


def test_show_acceptance_colours_tokens(fake_engine):
    fake_engine.reply, fake_engine.chunk = "dr", 1  # kinds: draft, relaxed, target, ...
    r = invoke("run", "hi", "-m", "fake.gguf", "--show-acceptance", env={"FORCE_COLOR": "1", "TERM": "xterm-256color"})
    assert r.exit_code == 0, r.output
    assert "\x1b[32md" in r.stdout and "\x1b[1;33mr" in r.stdout  # green: draft; bold yellow: relaxed by MARS
    plain = invoke("run", "hi", "-m", "fake.gguf", env={"FORCE_COLOR": "1", "TERM": "xterm-256color"})
    assert plain.stdout == "dr\n"


def test_chat_without_template_is_refused(tiny_dir, fake_engine):
    fake_engine.has_chat_template = False
    line = one_error_line(invoke("chat", "-m", "fake.gguf", input="hi\n"))
    assert "fake.gguf has no chat template" in line and fake_engine.closed


def test_run_chat_without_template_is_refused(tiny_dir):
    from tinymodels import make_tiny_llama

    path = make_tiny_llama(tiny_dir / "no-template.gguf", chat_template=None)
    assert "chat template" in one_error_line(invoke("run", "hi", "-m", path, "--chat"))


# ------------------------------------------------------------------ chat
def test_chat_reuses_the_kv_cache_across_turns(tiny_target, tiny_draft):
    with Engine(tiny_target, tiny_draft, n_ctx=512) as eng:
        # strict: the answers (and so what the next turn can reuse) do not depend on the draft lengths chosen
        session = ChatSession(eng, GenerateConfig.make(max_tokens=12, verify="strict"), system="be nice")
        list(session.ask("hello world"))
        first = session.last_stats
        list(session.ask("the a the a"))
        second = session.last_stats
    # turn 2 re-renders the whole conversation but evaluates little more than the new message
    new_tokens = second.n_prompt - first.n_prompt
    assert second.n_prompt_evaluated < new_tokens
    assert second.n_prompt_evaluated < second.n_prompt / 2


def fake_session(**fields) -> ChatSession:
    eng = FakeEngine(**{"n_ctx_asked": 512, **fields})
    return ChatSession(eng, GenerateConfig.make(max_tokens=12, verify="mars"), system="be nice")


def test_chat_turn_events_and_history():
    s = fake_session(reply="hi there", chunk=3)
    events = list(s.ask("hello"))
    assert [type(e) for e in events] == [Text, Text, Text, TurnDone]
    assert "".join(e.text for e in events[:-1]) == "hi there"
    done = events[-1]
    assert done.answer == "hi there" and done.stats is s.last_stats and done.stats.n_generated == 8
    assert not done.interrupted and not done.cut_by_context
    assert s.engine.calls[0][0] == "<system>be nice<user>hello"
    list(s.ask("again"))
    assert s.engine.calls[1][0] == "<system>be nice<user>hello<assistant>hi there<user>again"


def test_chat_ctrl_c_keeps_the_partial_answer():
    s = fake_session(reply="abcdefgh", chunk=2, interrupt_after=2)  # Ctrl-C during the third chunk
    events = list(s.ask("hello"))
    assert [type(e) for e in events] == [Text, Text, Interrupted, TurnDone]
    assert events[-1].interrupted and events[-1].answer == "abcd" and events[-1].stats.stop_reason == "interrupted"
    assert s.messages[-1] == {"role": "assistant", "content": "abcd"}
    # the consumer stopping (Ctrl-C while it renders) keeps what was said too
    s = fake_session(reply="abcdefgh", chunk=2)
    turn = s.ask("hello")
    next(turn), next(turn)
    turn.close()
    assert s.messages[-1] == {"role": "assistant", "content": "abcd"}
    assert s.last_stats.stop_reason == "interrupted"


def test_chat_says_when_the_context_cut_the_answer():
    s = fake_session(reply="x" * 1000, n_ctx_asked=256)
    s.config = GenerateConfig.make(max_tokens=1000)
    done = list(s.ask("hello"))[-1]
    assert done.cut_by_context and len(done.answer) == 256 - len(s.engine.calls[0][0]) - 1  # the room left
    s = fake_session(reply="x" * 1000)  # stopped by -n, not by the context
    assert not list(s.ask("hello"))[-1].cut_by_context


def test_chat_slash_commands():
    session = fake_session()
    assert "/reset" in session.command("/help")
    assert session.command("/verify strict") == "(verification: strict)" and session.config.verify == "strict"
    assert session.command("/verify loose").startswith("usage")
    assert session.command("/theta 0.8") == "(theta = 0.8)" and session.config.theta == 0.8
    assert session.command("/theta 7").startswith("usage") and session.config.theta == 0.8
    assert session.command("/stats") == "(no answer yet)"
    list(session.ask("hello"))
    assert session.command("/stats").startswith("11 tokens, ")
    assert session.command("/system short").startswith("(system prompt set") and session.messages == []
    assert session.system == "short"
    list(session.ask("hello"))
    assert session.command("/reset") == "(conversation reset)" and session.messages == []
    assert session.command("/bogus").startswith("unknown command")
    assert session.command("/quit") is None


def test_chat_slides_history_when_the_context_fills():
    s = fake_session(reply="ok", n_ctx_asked=256)
    s.reserve = 16
    dropped = 0
    for i in range(12):
        events = list(s.ask(f"w{i} " * 6))
        dropped += sum(e.turns for e in events if isinstance(e, ContextDropped))
    assert dropped > 0 and len(s.messages) == 2 * (12 - dropped)
    assert max(len(c[0]) for c in s.engine.calls) <= 256 - 16  # every prompt left room for the answer
    assert s.messages[-2]["content"].startswith("w11")
    # a turn closed before its answer started leaves no unanswered message behind
    turn = s.ask("x " * 60)
    assert isinstance(next(turn), ContextDropped)
    turn.close()
    assert s.messages[-1]["role"] == "assistant"
    # a message that can never fit is refused and loses nothing
    before = list(s.messages)
    with pytest.raises(MarsError, match="context"):
        list(s.ask("hello " * 400))
    assert s.messages == before


def test_chat_command_renders_turns_and_notes(fake_engine):
    fake_engine.reply = "answer"
    r = invoke("chat", "-m", "fake.gguf", "--system", "sys", input="hello\n/stats\n/theta 2\n\nbye\n")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0].startswith("mars chat with fake.gguf (drafter: none, verify: mars)")
    assert r.stdout.count(">>> answer\n") == 2 and "6 tokens, " in r.stdout and "usage: /theta" in r.stdout
    assert [c[0] for c in fake_engine.calls][-1] == "<system>sys<user>hello<assistant>answer<user>bye"
    # an answer cut by the context: a note; Ctrl-C: "(stopped)" and the chat goes on
    fake_engine.calls.clear()
    fake_engine.reply = "y" * 600
    r = invoke("chat", "-m", "fake.gguf", "-c", "256", "-n", "1000", input="a b c\n")
    assert r.exit_code == 0 and "note: the answer stopped at the end of the context (256 tokens)" in r.stderr
    fake_engine.interrupt_after = 1
    r = invoke("chat", "-m", "fake.gguf", input="one\ntwo\n")
    assert r.exit_code == 0 and r.stderr.count("(stopped)") == 2 and len(fake_engine.calls) == 3
    r = invoke("chat", "-m", "fake.gguf", "-c", "256", input="hello " * 100 + "\n")
    assert r.exit_code == 0 and "error: this message is" in r.stderr


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
        assert 0 < m.get("theta", 0.9) <= 1 and m["draft_max"] >= 1 and m["drafter"] in ("model", "ngram", "none")
        if m["drafter"] == "model":
            assert "draft" in m
    families = " ".join(real).lower()
    for fam in ("qwen2.5-7b", "llama3.1-8b", "qwen3-8b", "gemma3-12b", "coder"):
        assert fam in families


def test_models_json_and_user_registry(tmp_path, tiny_target):
    user = tmp_path / "cfg"
    user.mkdir()
    (user / "models.yaml").write_text(yaml.safe_dump({"models": {"mine": {
        "target": {"repo": "me/tiny-GGUF", "file": "tiny.gguf"}, "drafter": "ngram", "theta": 0.8, "draft_max": 3},
        "own-mtp": {"target": {"repo": "me/mtp-GGUF", "file": "mtp.gguf"}, "drafter": "mtp"}}}))
    r = invoke("models", "--json", env={"MARS_CONFIG_DIR": str(user)})
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    names = {m["name"]: m for m in obj["models"]}
    assert "smollm2-135m" in names and names["smollm2-135m"]["target"]["present"]
    assert names["mine"]["theta"] == 0.8 and not names["mine"]["target"]["present"]
    assert names["own-mtp"]["drafter"] == "mtp"  # a pair that drafts with its target's own MTP layers
    # MTP layers read from the header of a downloaded target (None until then)
    assert names["smollm2-135m"]["mtp_layers"] == 0 and names["mine"]["mtp_layers"] is None
    assert len(obj["sources"]) == 2
    table = invoke("models", env={"MARS_CONFIG_DIR": str(user)})
    assert table.exit_code == 0 and "mine" in table.stdout
    # piped, every file name whole on its row (they were cut to "Qwen2.…" at 80 columns)
    rows = {line.split()[0]: line for line in table.stdout.splitlines() if line.strip()}
    assert "Qwen2.5-7B-Instruct-Q4_K_M.gguf" in rows["qwen2.5-7b"] and "…" not in table.stdout
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


@pytest.mark.parametrize("resolves", [True, False])
def test_pull_asks_only_the_cache_when_the_hubs_name_does_not_resolve(monkeypatch, tmp_path, resolves):
    # (no name resolution: huggingface_hub would retry each request for ~25 s, printing every retry)
    import socket

    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def getaddrinfo(host, *a, **kw):
        if not resolves:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.1", 443))]

    seen = []

    def fake_download(repo_id, filename, force_download=False, local_files_only=False, **kw):
        seen.append(local_files_only)
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        p = tmp_path / filename
        p.write_bytes(b"GGUF")
        return str(p)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for var in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    r = invoke("pull", "hf:me/x-GGUF/x.gguf")
    assert seen == [not resolves]
    if resolves:
        assert r.exit_code == 0, r.output
    else:
        assert "cannot be reached (offline?)" in one_error_line(r)
        # behind a proxy the proxy resolves the Hub's name, not this machine: the Hub is asked
        seen.clear()
        monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
        r = invoke("pull", "hf:me/x-GGUF/x.gguf")
        assert seen == [False] and r.exit_code == 0, r.output


@pytest.mark.slow
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
    assert rep["mtp_layers"]["smollm2-135m"] == 0  # read from the downloaded file's header
    from mars_local.llama.kernels import kernel_paths

    assert rep["exact_kernels"] == kernel_paths(rep["system_info"], rep["backend"]) and rep["exact_kernels"]
    text = invoke("doctor")
    assert text.exit_code == 0 and "backend:" in text.stdout and "MTP drafting:" in text.stdout
    assert "exact kernels:" in text.stdout
    assert all(f"  {types}: " in text.stdout for types in rep["exact_kernels"])


def test_doctor_marks_learned_entries_of_another_build(tmp_path):
    """Window costs and repack verdicts are per llama.cpp build (every reinstall is a new one): doctor
    lists this build's entries first and marks the others as unused, naming how many there are."""
    from mars_local.llama.runtime import build_fingerprint

    this, other = build_fingerprint(), "0123456789ab"
    assert this != other
    entries = {f"costs|target.gguf@aaaaaaaaaaaa|{b}|t2|f16|faNone|nglNone": {"time": {"1": [ms / 1e3, 1.0]}}
               for b, ms in ((other, 52.5), (this, 41.0))}
    entries["accept|target.gguf@aaaaaaaaaaaa|draft.gguf@bbbbbbbbbbbb|strict/None/True"] = {"counts": []}
    (tmp_path / "learned.json").write_text(json.dumps({"version": 1, "entries": entries}))
    env = {"MARS_STATE_DIR": str(tmp_path)}
    rep = json.loads(invoke("doctor", "--json", env=env).stdout)["learned"]
    assert rep["build"] == this and rep["other_builds"] == [f"costs|target.gguf@aaaaaaaaaaaa|{other}|t2|f16|faNone|nglNone"]
    lines = invoke("doctor", env=env).stdout.splitlines()
    assert any("3 entries" in ln and "1 of them from other llama.cpp builds" in ln for ln in lines)
    costs = [ln for ln in lines if ln.startswith("  costs")]
    assert "1 row 41.0 ms" in costs[0] and "another llama.cpp build" not in costs[0]  # this build's first
    assert "1 row 52.5 ms" in costs[1] and costs[1].endswith("(another llama.cpp build: not used by this one)")
    assert all(other not in ln and this not in ln for ln in costs)  # names, not hashes


@pytest.mark.slow
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


def test_doctor_summarises_what_batched_rounds_learned():
    """`mars doctor` says in one line what a scheduler kept: shapes timed, and drafting's rate
    against plain rounds' at each load; a malformed entry is a line too, not a traceback."""
    from mars_local.cli.models import _learned_summary

    entry = {"cost": {"time": {"8": [0.3, 1.0], "24": [0.6, 1.0]}},
             "mode": {"rates": [[8, True, 24.0, 1.0, 3, 3.0], [8, False, 32.0, 1.0, 3, 3.0],
                                [2, True, 30.0, 1.0, 3, 3.0], [2, False, 20.0, 1.0, 3, 3.0]]}}
    line = _learned_summary(entry)
    assert line == "batched rounds: 2 shapes timed; drafting / plain rate per load 2: 1.50x, 8: 0.75x"
    assert _learned_summary({"cost": {}, "mode": {"rates": [[8, True, "x", 1, 1, 1]]}}) == "batched rounds (unreadable)"
    # the warm-up's wide-chunk verdict, alone (before any round) or with the rest
    assert _learned_summary({"wide_alike": True}) == ("batched rounds: 0 shapes timed; prompt chunks of over 64 rows "
                                                      "compute rows alike (a chat's next turn keeps its conversation)")
    assert _learned_summary({**entry, "wide_alike": False}).endswith("differ by length (a longer prompt re-evaluates them)")
