"""Hostile input at the command line and in grammars (issue 21): a grammar that is not
UTF-8, values too long to be file names, unbounded inputs (/dev/zero, an endless pipe),
grammars too costly to constrain with, and flags whose errors were wrong or missing.

The contract: one clear line on stderr, exit code 2, no traceback, nothing read past a limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading

import pytest

from mars_local import Engine, MarsError
from mars_local.speculate.grammar import (
    MAX_GRAMMAR_BYTES, GrammarState, check_grammar_text, grammar_from_json_schema, json_grammar,
)

from helpers import MARS, invoke, mars, one_error_line as one_error

LONG = "a" * 300  # longer than a file name may be (255 bytes on Linux)
SURROGATE_GBNF = 'root ::= "\udcff"'  # what argv gives for root ::= "<byte 0xff>"


@pytest.fixture(scope="module")
def env(empty_config):
    return empty_config


@pytest.fixture(scope="module")
def eng(tiny_target):
    with Engine(tiny_target, drafter="ngram", n_ctx=512) as e:
        yield e


def many(n: int) -> list[str]:
    return [f"w{i:05d}" for i in range(n)]


# ------------------------------------------------------------ 3. a grammar that is not UTF-8
def test_a_grammar_with_a_lone_surrogate_is_a_marserror(eng):
    with pytest.raises(MarsError, match="U\\+DCFF") as ei:
        check_grammar_text(SURROGATE_GBNF)
    assert "\n" not in str(ei.value)
    with pytest.raises(MarsError, match="U\\+DCFF"):
        GrammarState(eng.target, SURROGATE_GBNF)
    # the engine's path, which the server's requests and batch records take (MarsError: 400, a skipped record)
    with pytest.raises(MarsError, match="UTF-8"):
        eng.generate("hello", max_tokens=2, grammar=SURROGATE_GBNF)
    assert eng.generate("hello", max_tokens=2, grammar='root ::= "a"').text  # the engine is still usable


def test_a_grammar_with_a_nul_is_refused(eng):
    # llama.cpp would read it as a C string and drop everything after the NUL
    with pytest.raises(MarsError, match="NUL"):
        GrammarState(eng.target, 'root ::= "a" | "b\x00c"')


def test_cli_grammar_with_bytes_that_are_not_utf8_is_replaced_with_one_warning(tiny_target, env):
    p = mars("run", "hi", "-m", tiny_target, "-t", 1, "-n", 2, "--json", "--grammar", b'root ::= "\xff"', env=env)
    err = p.stderr.decode()
    assert p.returncode == 0 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning:") and "--grammar" in lines[0], lines
    assert json.loads(p.stdout)["text"] == "\ufffd"


@pytest.mark.slow
def test_a_batch_record_whose_grammar_is_not_utf8_is_skipped_and_the_rest_generated(tiny_target, env, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": 1, "prompt": "hi", "grammar": "root ::= \\"\\udcff\\""}\n{"id": 2, "prompt": "hi"}\n')
    for _ in range(2):  # and again: the bad record is skipped again, never a crash
        p = mars("batch", inp, "-o", out, "-m", tiny_target, "-t", 1, "-n", 2, env=env)
        err = p.stderr.decode()
        assert p.returncode == 3 and "Traceback" not in err, err
        assert "line 1" in err and "U+DCFF" in err
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [2]


# ------------------------------------------------------------ llama.cpp's own output
def test_an_invalid_grammar_is_one_line_without_llama_cpp_output(tiny_target, env):
    p = mars("run", "hi", "-m", tiny_target, "-t", 1, "-n", 2, "--grammar", 'root ::= "a', env=env)
    assert one_error(p) == "error: invalid GBNF grammar: unexpected end of input"
    p = mars("run", "hi", "-m", tiny_target, "-t", 1, "-n", 2, "--grammar", "root ::= nothing-here", env=env)
    assert "nothing-here" in one_error(p)
    # llama.cpp's reason where its log line does not say "error" (the message said nothing more)
    for grammar, why in [('foo ::= "a"', "grammar does not contain a 'root' symbol"),
                         ('root ::= root "a" | "b"', "left recursion detected")]:
        p = mars("run", "hi", "-m", tiny_target, "-t", 1, "-n", 2, "--grammar", grammar, env=env)
        assert one_error(p).startswith("error: invalid GBNF grammar: ") and why in one_error(p)


def test_serve_refuses_to_start_with_an_invalid_grammar(tiny_target, env):
    pytest.importorskip("uvicorn")
    p = mars("serve", "-m", tiny_target, "-t", 1, "--port", 0, "--grammar", 'root ::= ("a"', env=env, timeout=120)
    assert "invalid GBNF grammar" in one_error(p)


# ------------------------------------------------------------ 2. grammars too costly
def test_a_grammar_with_too_many_open_alternatives_is_refused():
    from mars_local.speculate.grammar_check import MAX_GRAMMAR_ALTERNATIVES

    over = "root ::= " + " | ".join(f'"{w}"' for w in many(MAX_GRAMMAR_ALTERNATIVES + 1))
    with pytest.raises(MarsError) as ei:
        check_grammar_text(over)
    msg = str(ei.value)
    assert "too complex" in msg and str(MAX_GRAMMAR_ALTERNATIVES + 1) in msg and str(MAX_GRAMMAR_ALTERNATIVES) in msg
    check_grammar_text("root ::= " + " | ".join(f'"{w}"' for w in many(MAX_GRAMMAR_ALTERNATIVES)))
    # a JSON schema's enum and anyOf are the same alternatives
    with pytest.raises(MarsError, match="too complex"):
        grammar_from_json_schema({"enum": many(MAX_GRAMMAR_ALTERNATIVES + 1)})
    branches = [{"type": "object", "properties": {w: {"type": "integer"}}, "required": [w]}
                for w in many(MAX_GRAMMAR_ALTERNATIVES + 1)]
    with pytest.raises(MarsError, match="too complex"):
        grammar_from_json_schema({"anyOf": branches})
    # open at once, through nested rules and optional items
    nested = "root ::= a | b\na ::= " + " | ".join(f'"{w}"' for w in many(MAX_GRAMMAR_ALTERNATIVES // 2 + 1)) \
        + "\nb ::= " + " | ".join(f'"x{w}"' for w in many(MAX_GRAMMAR_ALTERNATIVES // 2 + 1))
    with pytest.raises(MarsError, match="too complex"):
        check_grammar_text(nested)
    optional = "root ::= " + " ".join(f'"{w}"?' for w in many(MAX_GRAMMAR_ALTERNATIVES + 1)) + ' "z"'
    with pytest.raises(MarsError, match="too complex"):
        check_grammar_text(optional)


def test_wildcard_led_alternatives_weigh_more():
    """A token is walked through the wildcards of every open alternative before it is refused."""
    from mars_local.speculate.grammar_check import MAX_GRAMMAR_ALTERNATIVES, grammar_cost

    plain = grammar_cost('root ::= "a" | "b"').alternatives
    dots = grammar_cost('root ::= . . . "a" | . . . "b"').alternatives
    assert dots == 4 * plain
    n = MAX_GRAMMAR_ALTERNATIVES // 4 + 1
    with pytest.raises(MarsError, match="too complex"):
        check_grammar_text("root ::= " + " | ".join(f'. . . "{w}"' for w in many(n)))


def test_many_rules_in_sequence_are_not_complex():
    """What costs is alternatives open at once, not the grammar's size or its count of '|'."""
    from mars_local.speculate.grammar_check import MAX_GRAMMAR_ALTERNATIVES, grammar_cost

    n = 4 * MAX_GRAMMAR_ALTERNATIVES
    seq = "root ::= " + " ".join(f"r{i}" for i in range(n)) + "\n" + "\n".join(f'r{i} ::= "a" | "b"' for i in range(n))
    assert grammar_cost(seq).alternatives == 2
    check_grammar_text(seq)
    chain = "root ::= r0\n" + "\n".join(f'r{i} ::= "x" r{i + 1}' for i in range(n)) + f'\nr{n} ::= "y"'
    assert grammar_cost(chain).alternatives == 1
    check_grammar_text(chain)
    check_grammar_text(json_grammar())


def test_an_exponential_grammar_is_refused():
    # each level doubles the parse stacks llama.cpp opens at once: 2**40
    text = "root ::= x0\n" + "".join(f'x{i} ::= x{i + 1} "a" | x{i + 1} "b"\n' for i in range(40)) + 'x40 ::= "c"\n'
    with pytest.raises(MarsError, match="too complex"):
        check_grammar_text(text)


def test_repetitions_that_expand_past_the_limit_are_refused():
    """x{m,n} is n copies of x: a short text can ask llama.cpp for billions of elements."""
    from mars_local.speculate.grammar_check import MAX_GRAMMAR_ELEMENTS

    size = MAX_GRAMMAR_ELEMENTS // 1000 + 1
    with pytest.raises(MarsError, match="too large") as ei:
        check_grammar_text(f'root ::= "{"a" * size}"{{1000}}')
    assert str(MAX_GRAMMAR_ELEMENTS) in str(ei.value)
    check_grammar_text(f'root ::= "{"a" * (size - 2)}"{{1000}}')
    with pytest.raises(MarsError, match="too large"):
        check_grammar_text(f'root ::= "{"a" * size}"{{0,1000}}')


def test_a_costly_grammar_is_refused_before_the_model_loads(tmp_path, env):
    from mars_local.speculate.grammar_check import MAX_GRAMMAR_ALTERNATIVES

    over = "root ::= " + " | ".join(f'"{w}"' for w in many(MAX_GRAMMAR_ALTERNATIVES + 1))
    g = tmp_path / "big.gbnf"
    g.write_text(over)
    for flags in (["--grammar", over], ["--grammar", g],
                  ["-j", json.dumps({"enum": many(MAX_GRAMMAR_ALTERNATIVES + 1)})]):
        r = invoke("run", "hi", "-m", tmp_path / "missing.gguf", *flags, env=env)
        assert "too complex" in one_error(r), flags


# ------------------------------------------------------------ 5. values too long to be file names
def test_inline_gbnf_longer_than_a_file_name(tiny_target, env):
    p = mars("run", "hi", "-m", tiny_target, "-t", 1, "-n", 3, "--json", "--grammar", f'root ::= "{LONG}"', env=env)
    assert p.returncode == 0 and p.stderr == b"", p.stderr
    assert json.loads(p.stdout)["text"] == "aaa"


@pytest.mark.parametrize("model", [LONG, LONG + ".gguf"])
def test_a_model_name_longer_than_a_file_name_is_one_line(model, env):
    r = invoke("run", "hi", "-m", model, env=env)
    line = one_error(r)
    assert "not found" in line or "too long" in line, line


def test_a_chat_template_longer_than_a_file_name_is_one_line(tmp_path, env):
    line = one_error(invoke("run", "hi", "-m", tmp_path / "missing.gguf", "--chat-template", LONG, env=env))
    assert "chat template" in line and "too long" not in line.lower(), line


# ------------------------------------------------------------ 6. unbounded inputs
class Endless:
    """A stream of ``byte`` that never ends, counting what was read from it."""

    def __init__(self, byte: bytes = b"y"):
        self.byte, self.taken = byte, 0

    def read(self, n: int = -1) -> bytes:
        assert n is not None and n >= 0, "an unbounded read"
        self.taken += n
        return self.byte * n


def test_a_bounded_read_stops_after_the_limit(tmp_path):
    from mars_local.core.textfile import read_bytes, read_stream

    src = Endless(b"y")
    with pytest.raises(MarsError) as ei:
        read_stream(src, 5 << 20, "standard input", "a prompt")
    assert src.taken == (5 << 20) + 1
    assert str(ei.value) == "standard input is larger than 5 MiB, the limit for a prompt"
    zeros = Endless(b"\x00")
    assert len(read_stream(zeros, 5 << 20, "x", "y")) == zeros.taken < (5 << 20)  # binary: stops at once
    f = tmp_path / "big.txt"
    f.write_bytes(b"y" * 1025)
    with pytest.raises(MarsError, match=f"prompt file {f} is larger than 1 KiB, the limit for a prompt file"):
        read_bytes(f, "prompt file", 1024)
    assert read_bytes(f, "prompt file", 1025) == b"y" * 1025


def devzero_cases(tiny_target, tmp_path):
    return {
        "-f": ["run", "-m", tiny_target, "-f", "/dev/zero"],
        "--grammar": ["run", "hi", "-m", tiny_target, "--grammar", "/dev/zero"],
        "--json-schema": ["run", "hi", "-m", tiny_target, "-j", "/dev/zero"],
        "--chat-template": ["run", "hi", "-m", tiny_target, "--chat-template", "/dev/zero"],
        "batch": ["batch", "/dev/zero", "-o", tmp_path / "out.jsonl", "-m", tiny_target],
    }


MEMORY = 3 << 30  # enough to start, far less than the machine's memory: an unbounded read fails within it


@pytest.mark.parametrize("case", ["-f", "--grammar", "--json-schema", "--chat-template", "batch"])
def test_dev_zero_is_refused_without_reading_it_all(case, tiny_target, tmp_path, env):
    p = mars(*devzero_cases(tiny_target, tmp_path)[case], env=env, memory=MEMORY, timeout=60)
    assert "/dev/zero" in one_error(p) and "binary" in p.stderr.decode()
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("command", ["run", "batch", "chat"])
def test_dev_zero_on_standard_input(command, tiny_target, tmp_path, env):
    args = {"run": ["run", "-"], "batch": ["batch", "-", "-o", tmp_path / "out.jsonl"], "chat": ["chat"]}[command]
    with open("/dev/zero", "rb") as zero:
        p = mars(*args, "-m", tiny_target, "-t", "1", stdin=zero, timeout=60, env=env, memory=MEMORY)
    assert "standard input is binary" in one_error(p)


def feed_endless(cmd, limit: int, env):
    """``cmd`` with ``yes``-like text on standard input, ``limit`` + 1 MiB of it at most."""
    proc = subprocess.Popen(MARS + [str(a) for a in cmd], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **env})
    sent = [0]

    def writer():
        block = b"y\n" * (1 << 19)
        try:
            while sent[0] <= limit + (1 << 20):
                proc.stdin.write(block)
                sent[0] += len(block)
            proc.stdin.close()
        except (BrokenPipeError, ValueError, OSError):
            pass

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.wait(timeout=120)
    t.join(timeout=10)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_an_endless_prompt_on_standard_input_is_refused_at_the_limit(tiny_target, env):
    from mars_local.core.textfile import MAX_PROMPT_BYTES, format_size

    p = feed_endless(["run", "-", "-m", tiny_target, "-t", 1, "-n", 2], MAX_PROMPT_BYTES, env)
    limit = format_size(MAX_PROMPT_BYTES)
    assert one_error(p) == f"error: standard input is larger than {limit}, the limit for a prompt"


def test_a_template_or_grammar_file_over_its_limit_is_refused(tmp_path, env):
    from mars_local.core.textfile import MAX_TEMPLATE_BYTES, format_size

    t = tmp_path / "big.jinja"
    t.write_text("{{ 'x' }}" + " " * MAX_TEMPLATE_BYTES)
    line = one_error(invoke("run", "hi", "-m", tmp_path / "missing.gguf", "--chat-template", t, env=env))
    assert str(t) in line and format_size(MAX_TEMPLATE_BYTES) in line
    g = tmp_path / "big.gbnf"
    g.write_text('root ::= "a"' + " " * MAX_GRAMMAR_BYTES)
    line = one_error(invoke("run", "hi", "-m", tmp_path / "missing.gguf", "--grammar", g, env=env))
    assert str(g) in line and format_size(MAX_GRAMMAR_BYTES) in line


# ------------------------------------------------------------ 7. flags
def test_help_shows_percent_signs_unescaped():
    r = invoke("run", "--help")
    assert r.exit_code == 0 and "%%" not in r.stdout and "10% faster" in " ".join(r.stdout.split())


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_temperature_must_be_finite(value, tmp_path, env):
    line = one_error(invoke("run", "hi", "-m", tmp_path / "missing.gguf", "--temp", value, env=env))
    assert "--temp" in line and "finite" in line


def test_inline_json_that_is_not_an_object_says_so(tmp_path, env, fake_engine):
    for value in ["[1,2]", '"a string"', "true", "3", " [ ]"]:
        line = one_error(invoke("run", "hi", "-m", tmp_path / "missing.gguf", "-j", value, env=env))
        assert "JSON object" in line and "not found" not in line, (value, line)
    s = tmp_path / "3"  # a file whose name parses as JSON: the file wins
    s.write_text('{"type": "integer"}')
    r = invoke("run", "hi", "-m", "fake.gguf", "-j", s, "--json", env=env)
    assert r.exit_code == 0, r.output
    assert fake_engine.configs[0].grammar == grammar_from_json_schema(s.read_text())


def test_rpc_draft_needs_rpc(tmp_path, env):
    line = one_error(invoke("run", "hi", "-m", tmp_path / "missing.gguf", "--rpc-draft", env=env))
    assert "--rpc-draft" in line and "--rpc" in line


@pytest.mark.parametrize("args", [("models",), ("--version",), ("run", "hi", "-n", "3", "--no-draft")])
def test_standard_output_that_cannot_be_written_is_an_error_of_its_own(tiny_target, args):
    """Standard output on a full disk (/dev/full): exit 2, an error as README's exit codes say
    (it was 1, a failed doctor check's), naming standard output (it gave only the errno's text)."""
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    if args[0] == "run":
        args = (*args, "-m", str(tiny_target))
    with open("/dev/full", "w") as full:
        r = subprocess.run([*MARS, *args], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "error: cannot write standard output: No space left on device"
    assert "Traceback" not in r.stderr
