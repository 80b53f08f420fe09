"""`mars batch`: output safety (nothing lost or changed that mars-local did not
write), hostile input, per-record validation, exit codes.

Contract for every refusal: one `error:` line on stderr, a non-zero exit code,
no traceback, and every user file left byte for byte as it was.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mars_local.batch import scan_output
from mars_local.core.stats import SpecStats

from helpers import MARS, invoke, mars, no_traceback, one_error_line

FAKE = "fake.gguf"  # with the fake_engine fixture: no model is loaded

EXIT_SKIPPED = 3  # records were skipped, the rest was done


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def ids_in(path: Path) -> list:
    return [json.loads(x)["id"] for x in path.read_text().splitlines()]


def rec(id, text="t") -> str:
    """One record as mars batch writes it (without its newline)."""
    return json.dumps({"mars_batch": 1, "id": id, "text": text, "stats": {}})


@pytest.fixture()
def two(tmp_path) -> Path:
    return write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hello"}, {"id": 2, "prompt": "world"}])


# -------------------------------------------------- the everyday behaviour
def test_batch_prompts_messages_settings_and_malformed_lines(tiny_target, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "hello"},
        {"id": "two", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        "not json",
        {"id": 4},
        {"id": 5, "prompt": "the a", "temperature": 0.7, "seed": 3},
    ])
    out = tmp_path / "out.jsonl"
    r = invoke("batch", inp, "-o", out, "-m", tiny_target, "-n", 6)
    no_traceback(r)
    assert r.exit_code == EXIT_SKIPPED, r.output  # the rest was done, two lines were skipped
    assert "line 3" in r.stderr and "line 4" in r.stderr and "2 record(s) skipped" in r.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    by_id = {x["id"]: x for x in rows}  # (the default --parallel writes records as they finish)
    assert len(rows) == 3 and set(by_id) == {1, "two", 5}
    assert by_id["two"]["stats"]["n_generated"] <= 3
    assert all(set(x) == {"mars_batch", "id", "text", "stats"} and x["mars_batch"] == 1 for x in rows)
    one = tmp_path / "one.jsonl"  # one at a time: in input order, the same records
    assert invoke("batch", inp, "-o", one, "-m", tiny_target, "-n", 6, "--parallel", 1).exit_code == EXIT_SKIPPED
    assert ids_in(one) == [1, "two", 5]
    # rerun: nothing new to generate, nothing duplicated (the bad lines are still reported)
    again = invoke("batch", inp, "-o", out, "-m", tiny_target, "-n", 6)
    assert again.exit_code == EXIT_SKIPPED and len(out.read_text().splitlines()) == 3
    # --strict makes a malformed line fatal, before anything is generated
    o2 = tmp_path / "o2.jsonl"
    assert "line 3" in one_error_line(invoke("batch", inp, "-o", o2, "-m", tiny_target, "--strict"))
    assert not o2.exists()


def test_batch_stdin_to_stdout(fake_engine):
    fake_engine.reply = "re: {prompt}"
    r = invoke("batch", "-", "-o", "-", "-m", FAKE, "-n", 40,
               input='{"id": "a", "prompt": "hello"}\n{"id": "b", "messages": [{"role": "user", "content": "hi"}]}\n')
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["id"], x["text"]) for x in rows] == [("a", "re: hello"), ("b", "re: <user>hi")]
    assert all(set(x["stats"]) == set(SpecStats().to_dict()) for x in rows)


def test_record_settings_override_the_flags(fake_engine, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "a"},
        {"id": 2, "prompt": "b", "max_tokens": 2, "temperature": 0.5, "seed": 7, "verify": "strict", "theta": 0.5,
         "draft_max": 3, "max_relaxed": 1},
    ])
    r = invoke("batch", inp, "-o", tmp_path / "out.jsonl", "-m", FAKE, "-n", 9, "--theta", "0.8", "--top-k", 5)
    assert r.exit_code == 0, r.output
    (_, a), (_, b) = fake_engine.calls
    assert (a.max_tokens, a.theta, a.verify, a.sampling.top_k, a.sampling.seed) == (9, 0.8, "mars", 5, -1)
    assert (b.max_tokens, b.theta, b.verify, b.draft_max, b.max_relaxed) == (2, 0.5, "strict", 3, 1)
    assert (b.sampling.temperature, b.sampling.seed, b.sampling.top_k) == (0.5, 7, 5)


def test_a_record_the_engine_refuses_is_skipped_or_fatal_with_strict(fake_engine, tmp_path):
    fake_engine.fail_on = "poison"
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "a"}, {"id": 2, "prompt": "poison"},
                                              {"id": 3, "prompt": "c"}])
    out = tmp_path / "out.jsonl"
    r = invoke("batch", inp, "-o", out, "-m", FAKE)
    assert r.exit_code == EXIT_SKIPPED, r.output
    assert "warning: skipped line 2: the fake engine refuses" in r.stderr and ids_in(out) == [1, 3]
    assert "1 record(s) skipped (see above); 2 written" in r.stderr
    out.unlink()
    line = one_error_line(invoke("batch", inp, "-o", out, "-m", FAKE, "--strict"))
    assert line.startswith("error: line 2: the fake engine refuses") and ids_in(out) == [1]


def test_all_records_already_done_is_success(fake_engine, two, tmp_path):
    out = tmp_path / "out.jsonl"
    assert invoke("batch", two, "-o", out, "-m", FAKE, "-n", 3).exit_code == 0
    before = out.read_bytes()
    r = invoke("batch", two, "-o", out, "-m", FAKE, "-n", 3)
    no_traceback(r)
    assert r.exit_code == 0 and "nothing to do" in r.stderr and "2 record(s)" in r.stderr
    assert out.read_bytes() == before


def test_output_to_a_device_is_written_without_fsync(fake_engine, two):
    r = invoke("batch", two, "-o", os.devnull, "-m", FAKE, "-n", 2)
    no_traceback(r)
    assert r.exit_code == 0, r.output


def test_input_not_found(fake_engine, tmp_path):
    assert "not found" in one_error_line(invoke("batch", tmp_path / "nope.jsonl", "-o", tmp_path / "o",
                                                "-m", FAKE))


# ------------------------------------------------- 1. an output that is not ours
NOT_OURS = {
    "notes": b"my notes\nsecond line\n",
    "notes-one-unterminated-line": b"remember the milk",
    "json-without-text": b'{"id": 1}\n{"id": 2}\n',
    "json-array": b"[1, 2, 3]\n",
    "jsonl-input-like": b'{"id": 1, "prompt": "hello"}\n',
    "ours-then-notes": (rec(1) + "\nmy notes\n").encode(),
    "user-id-and-text": b'{"id":"zz","text":"x"}\n',
    "user-id-and-text-after-ours": (rec(1) + '\n{"id":"zz","text":"x"}\n').encode(),
    "torn-without-mark": b'{"id": 1, "te',
    "binary": b"\x00\x01\x02GGUF\xff\xfe\n\x00",
    "not-utf8": b'{"id": 1, "text": "caf\xe9"}\n',
}


@pytest.mark.parametrize("content", NOT_OURS.values(), ids=NOT_OURS.keys())
def test_refuses_an_output_that_is_not_mars_jsonl(fake_engine, two, tmp_path, content):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(content)
    line = one_error_line(invoke("batch", two, "-o", notes, "-m", FAKE, "-n", 3))
    assert "notes.txt" in line
    assert notes.read_bytes() == content  # not truncated, not appended to


# ------------------------------------------- 2. the last record of our output
def test_last_record_without_newline_is_kept(fake_engine, two, tmp_path):
    out = tmp_path / "out.jsonl"
    first = rec(1, "kept as written")
    out.write_text(first)  # complete record, no trailing newline (e.g. edited by hand)
    r = invoke("batch", two, "-o", out, "-m", FAKE, "-n", 3)
    no_traceback(r)
    assert r.exit_code == 0, r.output
    lines = out.read_text().splitlines()
    assert lines[0] == first  # not deleted, not regenerated
    assert ids_in(out) == [1, 2]
    assert out.read_text().endswith("\n")


def test_torn_last_line_is_cut_with_a_note(fake_engine, two, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(rec(1, "a") + "\n" + rec(2, "b")[:40])
    r = invoke("batch", two, "-o", out, "-m", FAKE, "-n", 3)
    no_traceback(r)
    assert r.exit_code == 0, r.output
    assert "incomplete last line" in r.stderr
    assert ids_in(out) == [1, 2]
    assert out.read_text().startswith(rec(1, "a") + '\n{"mars_batch": 1, "id": 2, "text": ')


def done_ids(path):
    state = scan_output(path)
    state.apply()  # what a run does before it appends
    return state.ids


def test_done_ids_cuts_a_torn_line_and_completes_a_record(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(rec(1, "a") + "\n" + rec(2, "b")[:40])
    assert done_ids(out) == {"1"}
    assert out.read_text() == rec(1, "a") + "\n"
    out.write_text(rec(1, "a"))
    assert done_ids(out) == {"1"}
    assert out.read_text() == rec(1, "a") + "\n"


@pytest.mark.parametrize("content", [
    (rec(1) + "\ngarbage\n" + rec(2) + "\n").encode(),  # bad middle line
    (rec(1) + "\ngarbage\n").encode(),  # a complete (terminated) bad last line is not torn
    (rec(1) + "\n" + rec(2)[:40] + "\n").encode(),
], ids=["middle", "terminated-last", "terminated-unparsable-last"])
def test_a_bad_line_that_is_not_a_torn_last_line_is_refused(fake_engine, two, tmp_path, content):
    out = tmp_path / "out.jsonl"
    out.write_bytes(content)
    line = one_error_line(invoke("batch", two, "-o", out, "-m", FAKE, "-n", 3))
    assert "line 2" in line
    assert out.read_bytes() == content


# ------------------------------------------------- 3. output = input
@pytest.mark.parametrize("how", ["same-path", "dot-slash", "symlink", "hardlink"])
def test_output_naming_the_input_is_refused(fake_engine, two, tmp_path, monkeypatch, how):
    monkeypatch.chdir(tmp_path)
    before = two.read_bytes()
    if how == "same-path":
        out = str(two)
    elif how == "dot-slash":
        out = "./" + two.name
    elif how == "symlink":
        out = "link.jsonl"
        os.symlink(two, out)
    else:
        out = "hard.jsonl"
        os.link(two, out)
    line = one_error_line(invoke("batch", two.name, "-o", out, "-m", FAKE, "-n", 3))
    assert "input" in line
    assert two.read_bytes() == before


def test_output_naming_redirected_stdin_is_refused(tiny_target, two):
    before = two.read_bytes()
    with open(two, "rb") as fh:
        r = mars("batch", "-", "-o", two, "-m", tiny_target, stdin=fh, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "input" in r.stderr
    assert two.read_bytes() == before


# ------------------------------------------------- 4. empty and binary input
@pytest.mark.parametrize("content,what", [
    (b"", "empty"),
    (b"\n  \n\n", "no records"),
    (b'{"id": 1, "prompt": "a"}\n\x00\x00\x00\x01\x02', "binary"),
    (b'{"id": 1, "prompt": "caf\xe9"}\n', "UTF-8"),
], ids=["empty", "blank-lines", "nul-bytes", "latin-1"])
def test_empty_or_binary_input_file(fake_engine, tmp_path, content, what):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(content)
    out = tmp_path / "out.jsonl"
    line = one_error_line(invoke("batch", inp, "-o", out, "-m", FAKE))
    assert what in line and "in.jsonl" in line
    assert not out.exists()


@pytest.mark.parametrize("content,what", [
    (b"", "empty"),
    (b"\x00\x01binary\x00", "binary"),
    (b'{"id": 1, "prompt": "caf\xe9"}\n', "UTF-8"),
], ids=["empty", "nul-bytes", "latin-1"])
def test_empty_or_binary_stdin(fake_engine, content, what):
    line = one_error_line(invoke("batch", "-", "-o", "-", "-m", FAKE, input=content))
    assert what in line and "standard input" in line


# ------------------------------------------------- 5. duplicate ids
def test_duplicate_id_is_named_with_both_lines_and_nothing_is_generated(fake_engine, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, "", {"id": "a", "prompt": "z"},
    ])
    out = tmp_path / "out.jsonl"
    line = one_error_line(invoke("batch", inp, "-o", out, "-m", FAKE, "-n", 3))
    assert '"a"' in line and "lines 1 and 4" in line
    assert not out.exists()


def test_duplicate_id_is_refused_even_when_already_done(fake_engine, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 7, "prompt": "x"}, {"id": 8, "prompt": "y"},
                                              {"id": 7, "prompt": "z"}])
    out = tmp_path / "out.jsonl"
    out.write_text(rec(7) + "\n")
    line = one_error_line(invoke("batch", inp, "-o", out, "-m", FAKE, "-n", 3))
    assert "7" in line and "lines 1 and 3" in line
    assert out.read_text() == rec(7) + "\n"


@pytest.mark.parametrize("flag, value", [("--parallel", "999"), ("-np", "-2")])
def test_a_bad_parallel_names_the_flag_as_typed_and_writes_nothing(fake_engine, tmp_path, flag, value):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "x"}])
    out = tmp_path / "out.jsonl"
    line = one_error_line(invoke("batch", inp, "-o", out, "-m", FAKE, flag, value))
    assert line == f"error: {flag} must be in 0..256, got {value}"
    assert not out.exists()


# ------------------------------------------------- 6. per-record validation
BAD_RECORDS = [
    ({"temperature": "hot"}, "'temperature' must be a finite number >= 0, got \"hot\""),
    ({"temperature": -1}, "'temperature'"),
    ('NaN', "'temperature'"),
    ({"max_tokens": 0}, "'max_tokens'"),
    ({"max_tokens": -3}, "'max_tokens'"),
    ({"max_tokens": True}, "'max_tokens'"),
    ({"max_tokens": 2.5}, "'max_tokens'"),
    ({"max_tokens": "5"}, "'max_tokens'"),
    ({"max_tokens": 513}, "context"),
    ({"seed": "x"}, "'seed'"),
    ({"seed": 1.5}, "'seed'"),
    ({"seed": False}, "'seed'"),
    ({"top_k": -1}, "'top_k'"),
    ({"top_k": "a"}, "'top_k'"),
    ({"top_p": 1.5}, "'top_p'"),
    ({"top_p": "x"}, "'top_p'"),
    ({"min_p": -0.1}, "'min_p'"),
    ({"theta": 0}, "'theta'"),
    ({"theta": 2}, "'theta'"),
    ({"draft_max": 64}, "'draft_max'"),
    ({"draft_max": -1}, "'draft_max'"),
    ({"max_relaxed": -1}, "'max_relaxed'"),
    ({"max_relaxed": "a"}, "'max_relaxed'"),
    ({"verify": "loose"}, "'verify'"),
    ({"verify": 1}, "'verify'"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user"}]}, "content"),
    ({"messages": "hi"}, "'messages'"),
    ({"prompt": 5}, "'prompt'"),
    ({"id": True}, "'id'"),
    ({"id": 1.5e400}, "'id'"),
    ({"id": 1.5}, "'id' must be a string or a whole number, got 1.5"),
    ({"id": [1]}, "'id'"),
]


def _bad_line(i, change):
    if change == "NaN":
        return f'{{"id": "bad{i}", "prompt": "hello", "temperature": NaN}}'
    rec = {"id": f"bad{i}", "prompt": "hello", **change}
    if "messages" in change:
        del rec["prompt"]
    text = json.dumps(rec)
    return text.replace("Infinity", "1.5e400") if "id" in change else text


def test_bad_fields_are_named_skipped_and_exit_3(fake_engine, tmp_path):
    rows = [{"id": "ok1", "prompt": "hello", "max_tokens": 2, "max_relaxed": None}]
    rows += [_bad_line(i, change) for i, (change, _) in enumerate(BAD_RECORDS)]
    rows += [{"id": "ok2", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
              "max_tokens": 2, "seed": 4, "temperature": 0.5, "top_k": 0, "top_p": 1, "min_p": 0,
              "theta": 1, "draft_max": 0, "verify": "strict"}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    r = invoke("batch", inp, "-o", out, "-m", FAKE, "-n", 3, "-c", 512)
    no_traceback(r)
    assert r.exit_code == EXIT_SKIPPED, r.output
    assert ids_in(out) == ["ok1", "ok2"]  # the rest was finished
    warnings = [x for x in r.stderr.splitlines() if x.startswith("warning: skipped")]
    assert len(warnings) == len(BAD_RECORDS), r.stderr
    for i, ((_, expect), w) in enumerate(zip(BAD_RECORDS, warnings)):
        line_no = i + 2
        assert w.startswith(f"warning: skipped line {line_no}: "), w
        assert f"line {line_no}: line" not in w, w  # never "line 5: line 5:"
        assert expect in w, (expect, w)
        for leak in ("not supported between", "ufunc", "instances of", "Traceback", "TypeError"):
            assert leak not in w, w
    assert f"{len(BAD_RECORDS)} record(s) skipped" in r.stderr


def test_bad_field_with_strict_stops_before_generating(fake_engine, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "a"}, {"id": 2, "prompt": "b", "top_k": "x"}])
    out = tmp_path / "out.jsonl"
    line = one_error_line(invoke("batch", inp, "-o", out, "-m", FAKE, "--strict"))
    assert line.startswith("error: line 2: 'top_k'") and "line 2: line" not in line
    assert not out.exists()


def test_skipped_exit_code_through_the_real_entry_point(tiny_target, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "a", "max_tokens": 2},
                                              {"id": 2, "prompt": "b", "seed": "x"}])
    out = tmp_path / "out.jsonl"
    r = mars("batch", inp, "-o", out, "-m", tiny_target, text=True)
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr and "line 2: 'seed'" in r.stderr
    assert ids_in(out) == [1]


def test_help_documents_the_duplicate_policy_and_exit_codes():
    r = invoke("batch", "--help")
    text = " ".join(r.stdout.split())
    assert "duplicate" in text.lower() and "3" in text and "exit" in text.lower()


# ------------------------------------------------- 7. output path checked before the model loads
def test_output_path_is_checked_before_the_model_loads(fake_engine, two, tmp_path):
    """The output error comes before any model is opened."""
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-file").write_text("x")
    cases = {
        tmp_path / "missing" / "out.jsonl": "does not exist",
        tmp_path / "a-dir": "directory",
        tmp_path / "a-file" / "out.jsonl": "not a directory",
    }
    for out, expect in cases.items():
        line = one_error_line(invoke("batch", two, "-o", out, "-m", FAKE))
        assert expect in line, line
    assert (tmp_path / "a-file").read_text() == "x"
    assert fake_engine.opened == []


def test_unwritable_output_is_checked_before_the_model_loads_as_any_user(fake_engine, two, tmp_path, monkeypatch):
    """Whether the output is writable is asked of os.access (faked here, so the test
    also runs as root, who can write anywhere)."""
    existing = tmp_path / "out.jsonl"
    existing.write_text(rec(9) + "\n")
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    for out in (tmp_path / "new.jsonl", existing):
        line = one_error_line(invoke("batch", two, "-o", out, "-m", FAKE))
        assert "not writable" in line, line
    assert existing.read_text() == rec(9) + "\n"
    assert fake_engine.opened == []


# ------------------------------------------------- crash safety
@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["1", "4"])
def test_batch_killed_mid_run_resumes_without_loss_or_duplicates(tiny_target, tmp_path, parallel):
    n = 40
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"w{i} hello"} for i in range(n)])
    out = tmp_path / "out.jsonl"
    cmd = [*MARS, "batch", str(inp), "-o", str(out), "-m", str(tiny_target), "-n", "32", "--parallel", parallel]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and (not out.exists() or len(out.read_bytes().splitlines()) < 5):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = len(out.read_bytes().splitlines())
    assert 5 <= partial < n  # it really was interrupted
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(n))  # every id exactly once


# ------------------------------------------------- one run per output: the lock
def mars_batch(*args) -> list[str]:
    return [*MARS, "batch", *map(str, args)]


def hold_lock(path: Path):
    """Lock ``path`` the way mars batch does (an exclusive flock on the output file itself)."""
    fcntl = pytest.importorskip("fcntl")
    fh = open(path, "a")
    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fh


def test_a_second_run_on_a_locked_output_is_refused_naming_the_holder(tiny_target, two, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(rec(1) + "\n")
    with hold_lock(out):
        r = mars("batch", two, "-o", out, "-m", tiny_target, "-n", 2, text=True)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "out.jsonl" in lines[0], r.stderr
    if sys.platform.startswith("linux"):  # the holder's PID comes from /proc/locks
        assert f"PID {os.getpid()}" in lines[0], lines[0]
    assert out.read_text() == rec(1) + "\n"


@pytest.mark.parametrize("how", ["symlink", "hardlink", "new-file"])
def test_the_lock_covers_every_name_of_the_output(fake_engine, two, tmp_path, monkeypatch, how):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out.jsonl"
    if how != "new-file":
        out.write_text(rec(1) + "\n")
    before = out.read_bytes() if out.exists() else b""
    with hold_lock(out):
        name = "out.jsonl"
        if how == "symlink":
            os.symlink(out, name := "link.jsonl")
        elif how == "hardlink":
            os.link(out, name := "hard.jsonl")
        line = one_error_line(invoke("batch", two, "-o", name, "-m", FAKE, "-n", 2))
    assert name in line and "lock" in line, line
    assert out.read_bytes() == before and fake_engine.opened == []
    # the lock ends with its holder (closed, or killed: the kernel releases it): nothing stale blocks
    assert invoke("batch", two, "-o", name, "-m", FAKE, "-n", 2).exit_code == 0
    assert sorted(ids_in(out)) == [1, 2] and not list(tmp_path.glob("*.lock"))


def test_a_run_that_writes_nothing_leaves_no_output_behind(fake_engine, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "a"}])
    fake_engine.fail_on = "a"
    out = tmp_path / "out.jsonl"
    assert invoke("batch", inp, "-o", out, "-m", FAKE).exit_code == EXIT_SKIPPED
    assert not out.exists()


# ------------------------------------------------- our own records: the mark, duplicates
def test_an_output_from_before_the_mark_is_refused_with_a_way_forward(fake_engine, two, tmp_path):
    out = tmp_path / "out.jsonl"
    old = b'{"id": 1, "text": "a", "stats": {"n_generated": 1}}\n'
    out.write_bytes(old)
    line = one_error_line(invoke("batch", two, "-o", out, "-m", FAKE, "-n", 2))
    assert "out.jsonl" in line and "older mars-local" in line and '"mars_batch"' in line
    assert "rename" in line or "delete" in line
    assert out.read_bytes() == old and fake_engine.opened == []


def test_an_id_already_twice_in_the_output_is_named_and_not_written_again(fake_engine, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, {"id": 7, "prompt": "y"},
                                              {"id": "b", "prompt": "z"}])
    out = tmp_path / "out.jsonl"
    before = "".join(x + "\n" for x in (rec("a", "first"), rec(7), rec("a", "second"), rec("7")))
    out.write_text(before)
    r = invoke("batch", inp, "-o", out, "-m", FAKE, "-n", 2)
    no_traceback(r)
    assert r.exit_code == 0, r.output
    warn = [x for x in r.stderr.splitlines() if x.startswith("warning:")]
    assert len(warn) == 1 and '"a"' in warn[0] and "7" in warn[0] and "first" in warn[0], r.stderr
    assert out.read_text().startswith(before) and ids_in(out) == ["a", 7, "a", "7", "b"]
    assert [c[0] for c in fake_engine.calls] == ["z"]


# ------------------------------------------------- ids: one rule for duplicates and resume
@pytest.mark.parametrize("a,b", [(1, 1.0), (7, "7"), (1000, 1e3)])
def test_ids_that_mean_the_same_are_duplicates(fake_engine, tmp_path, a, b):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": a, "prompt": "x"}, {"id": b, "prompt": "y"}])
    out = tmp_path / "out.jsonl"
    line = one_error_line(invoke("batch", inp, "-o", out, "-m", FAKE, "-n", 2))
    assert "duplicate id" in line and "lines 1 and 2" in line
    assert not out.exists()


def test_resume_matches_ids_by_value_and_writes_them_as_given(fake_engine, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "7", "prompt": "x"}, {"id": 2.0, "prompt": "y"},
                                              {"id": "07", "prompt": "z"}])
    out = tmp_path / "out.jsonl"
    out.write_text(rec(7) + "\n")
    r = invoke("batch", inp, "-o", out, "-m", FAKE, "-n", 2)
    assert r.exit_code == 0, r.output
    assert [c[0] for c in fake_engine.calls] == ["y", "z"]  # "7" is done; "07" is another id
    assert ids_in(out) == [7, 2.0, "07"]
    assert '"id": 2.0,' in out.read_text()  # written as the input gave it
    again = invoke("batch", inp, "-o", out, "-m", FAKE, "-n", 2)
    assert again.exit_code == 0 and "nothing to do" in again.stderr


# ------------------------------------------------- OS errors on the output
@pytest.mark.parametrize("path,why", [("/dev/full", "No space left on device"),
                                      ("/proc/self/mem", "Input/output error")])
def test_an_os_error_on_the_output_is_one_line_naming_it(fake_engine, two, path, why):
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist here")
    line = one_error_line(invoke("batch", two, "-o", path, "-m", FAKE, "-n", 2))
    assert path in line and why in line, line


# ------------------------------------------------- progress and Ctrl-C
def test_the_progress_bar_goes_to_stderr(fake_engine, two, tmp_path, monkeypatch):
    monkeypatch.setattr("rich.console.Console.is_terminal", property(lambda self: True))  # as on a terminal
    r = invoke("batch", two, "-o", tmp_path / "out.jsonl", "-m", FAKE, "-n", 2)
    assert r.exit_code == 0, r.output
    assert r.stdout == "" and "2/2" in r.stderr


def test_ctrl_c_says_how_far_it_got_and_exits_130(fake_engine, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": p} for i, p in
                                              enumerate(["a", "b", "a long prompt", "d"], start=1)])
    out = tmp_path / "out.jsonl"
    fake_engine.reply, fake_engine.interrupt_after = "{prompt}", 2  # Ctrl-C in the 3rd chunk: only the long one
    r = invoke("batch", inp, "-o", out, "-m", FAKE, "-n", 20)
    no_traceback(r)
    assert r.exit_code == 130, r.output
    assert r.stderr.strip().splitlines()[-1].startswith("interrupted: 2/4 records written to"), r.stderr
    assert "rerun" in r.stderr and ids_in(out) == [1, 2]
    fake_engine.interrupt_after = None
    assert invoke("batch", inp, "-o", out, "-m", FAKE, "-n", 20).exit_code == 0
    assert ids_in(out) == [1, 2, 3, 4]


@pytest.mark.slow
def test_sigint_mid_run_and_a_concurrent_run_through_the_real_entry_point(tiny_target, tmp_path):
    n = 40
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"w{i} hello"} for i in range(n)])
    out = tmp_path / "out.jsonl"
    cmd = mars_batch(inp, "-o", out, "-m", tiny_target)
    proc = subprocess.Popen([*cmd, "-n", "400", "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and (not out.exists() or out.read_bytes().count(b"\n") < 1):
            time.sleep(0.01)
        proc.send_signal(signal.SIGSTOP)  # held still, lock and all, while a second run tries the output
        second = subprocess.run([*cmd, "-n", "8"], capture_output=True, text=True)
        proc.send_signal(signal.SIGINT)  # Ctrl-C, delivered as it goes on
    finally:
        proc.send_signal(signal.SIGCONT)
    stdout, stderr = proc.communicate(timeout=60)
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    assert len(second.stderr.strip().splitlines()) == 1 and "locked" in second.stderr, second.stderr
    if sys.platform.startswith("linux"):
        assert f"PID {proc.pid}" in second.stderr, second.stderr
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    assert stdout == ""
    data = out.read_bytes()
    written = data.count(b"\n")
    assert 1 <= written < n and data.endswith(b"\n")  # really interrupted, the last record whole
    assert f"interrupted: {written}/{n} records written to {out}" in stderr and "rerun" in stderr, stderr
    assert all(json.loads(x)["mars_batch"] == 1 for x in data.splitlines())
    done = subprocess.run([*cmd, "-n", "8"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(ids_in(out)) == sorted(f"r{i}" for i in range(n))  # every id exactly once


@pytest.mark.slow
def test_parallel_batch_writes_what_the_one_at_a_time_loop_writes(tiny_target, tiny_draft, tmp_path):
    """--parallel 4 (records decoded together, written as they finish): the same record per id
    as the one-at-a-time loop under strict greedy decoding, chat records and per-record settings included."""
    recs = [{"id": i, "prompt": f"record {i}: " + "abc " * (i % 4)} for i in range(9)]
    recs += [{"id": 20, "prompt": "short", "max_tokens": 3}, {"id": 21, "prompt": "stop here", "stop": ["e"]}]
    inp = write_jsonl(tmp_path / "in.jsonl", recs)
    texts = {}
    for p in ("1", "4"):
        out = tmp_path / f"out{p}.jsonl"
        r = mars("batch", inp, "-o", out, "-m", tiny_target, "-md", tiny_draft, "-n", "24", "--temp", "0",
                 "--verify", "strict", "--parallel", p, text=True)
        assert r.returncode == 0, r.stderr
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert sorted(x["id"] for x in rows) == sorted(x["id"] for x in recs)
        texts[p] = {x["id"]: x["text"] for x in rows}
    assert texts["4"] == texts["1"]


def test_ctrl_c_during_a_record_lands_after_it_even_with_threads_that_take_it():
    """A record's write is never cut by Ctrl-C, nor its count: with other threads alive (as
    llama.cpp's are), a SIGINT masked in the writing thread reached one of them and Python raised
    KeyboardInterrupt in the middle of the block anyway (a line written but not counted)."""
    import threading

    from mars_local.core.interrupts import held

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)  # started before the block: SIGINT not masked in it
    other.start()
    done = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with held():
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(2000):  # bytecodes where an interrupt could land
                    time.sleep(0)
                done.append("counted")
        assert done == ["counted"]
        with held():  # no signal: nothing raised, the handler restored
            done.append("again")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        stop.set()
        other.join()
