"""Generation controls at the command line (issue 13): -p/-f, -n -1, --ignore-eos,
stop strings, penalties, grammars, --chat-template and --logprobs reach the
GenerateConfig and the Engine with the right values in `mars run`, `mars chat`
and `mars batch`; every bad value is one line on stderr and exit 2, before any
model loads.  Most tests use the FakeEngine (no GGUF); the end-to-end ones at
the bottom use the tiny models.
"""

from __future__ import annotations

import json

import pytest

from mars_local.core.config import GenerateConfig

from fake_engine import FakeEngine
from helpers import invoke, one_error_line

FAKE = "fake.gguf"
D = GenerateConfig()  # the defaults


def ok(r):
    assert r.exit_code == 0, r.output
    return r


def run_cfg(fake, *args) -> GenerateConfig:
    """The GenerateConfig `mars run hi -m fake.gguf ARGS` generated with."""
    ok(invoke("run", "hi", "-m", FAKE, *args))
    assert len(fake.calls) == 1
    return fake.configs[0]


# ------------------------------------------------------------ defaults, each flag
def test_without_flags_the_controls_are_generate_configs_defaults(fake_engine):
    cfg = run_cfg(fake_engine)
    assert (cfg.ignore_eos, cfg.stop, cfg.grammar, cfg.logprobs) == (False, (), None, 0)
    assert (cfg.repeat_penalty, cfg.repeat_last_n, cfg.presence_penalty, cfg.frequency_penalty) == (1.0, 64, 0.0, 0.0)
    assert cfg.max_tokens == D.max_tokens
    assert "chat_template" not in fake_engine.opened[0]  # an Engine without the parameter still works


def test_penalties_ignore_eos_and_stop_strings_reach_the_config(fake_engine):
    cfg = run_cfg(fake_engine, "--ignore-eos", "--repeat-penalty", "1.3", "--repeat-last-n", "-1",
                  "--presence-penalty", "0.5", "--frequency-penalty", "-0.25",
                  "-r", "A", "--reverse-prompt", "B", "--stop", "C\nD")
    assert cfg.ignore_eos is True
    assert cfg.repeat_penalty == 1.3 and cfg.repeat_last_n == -1
    assert cfg.presence_penalty == 0.5 and cfg.frequency_penalty == -0.25
    assert cfg.stop == ("A", "B", "C\nD")


def test_repeat_last_n_zero_turns_penalties_off(fake_engine):
    cfg = run_cfg(fake_engine, "--repeat-penalty", "1.5", "--repeat-last-n", "0")
    assert cfg.repeat_last_n == 0 and not cfg.penalized


def test_n_minus_one_generates_until_end_of_generation(fake_engine):
    fake_engine.reply = "x" * 300  # longer than the default -n 256
    obj = json.loads(ok(invoke("run", "hi", "-m", FAKE, "-n", "-1", "--json")).stdout)
    assert fake_engine.configs[0].max_tokens == -1
    assert obj["text"] == "x" * 300 and obj["stats"]["stop_reason"] == "eog"


def test_ignore_eos_with_n_minus_one_runs_to_the_full_context(fake_engine):
    fake_engine.reply = "ab"
    r = ok(invoke("run", "hi", "-m", FAKE, "-c", 256, "-n", "-1", "--ignore-eos", "--json"))
    obj = json.loads(r.stdout)
    assert obj["stats"]["stop_reason"] == "context" and len(obj["tokens"]) == 256 - 2
    assert "the context (256 tokens) is full" in r.stderr


@pytest.mark.parametrize("value", ["0", "-2", "-100"])
@pytest.mark.parametrize("cmd", ["run", "batch"])
def test_n_below_one_other_than_minus_one_is_one_line(fake_engine, tmp_path, cmd, value):
    args = ["run", "hi"] if cmd == "run" else ["batch", tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl"]
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    line = one_error_line(invoke(*args, "-m", FAKE, "--n-predict", value))
    assert "--n-predict: the number of tokens to generate must be >= 1, or -1" in line and f"got {value}" in line
    assert not fake_engine.opened


# ------------------------------------------------------------ stop strings at work
def test_a_stop_string_ends_the_output_before_it(fake_engine):
    fake_engine.reply = "one two three"
    r = ok(invoke("run", "hi", "-m", FAKE, "--stop", " two"))
    assert r.stdout == "one\n"
    obj = json.loads(ok(invoke("run", "hi", "-m", FAKE, "-r", "three", "-r", "o t", "--json")).stdout)
    assert obj["text"] == "one tw" and obj["stats"]["stop_reason"] == "stop"  # "o t" of "two three" comes first


def test_a_stop_string_with_show_acceptance_shows_only_the_text(fake_engine):
    fake_engine.reply = "one two three"
    fake_engine.chunk = 5  # the stop string ends inside a chunk
    r = ok(invoke("run", "hi", "-m", FAKE, "--stop", "two", "--show-acceptance"))
    assert r.stdout == "one \n"


# ------------------------------------------------------------ bad values: one line, exit 2
BAD = [
    (["--repeat-penalty", "0"], "--repeat-penalty must be > 0"),
    (["--repeat-penalty", "-1"], "--repeat-penalty must be > 0"),
    (["--repeat-penalty", "nan"], "--repeat-penalty must be > 0"),
    (["--repeat-penalty", "inf"], "--repeat-penalty must be > 0"),
    (["--repeat-penalty", "high"], "Invalid value for '--repeat-penalty'"),
    (["--repeat-last-n", "-2"], "--repeat-last-n must be >= -1"),
    (["--repeat-last-n", "1.5"], "Invalid value for '--repeat-last-n'"),
    (["--presence-penalty", "nan"], "--presence-penalty must be a finite number"),
    (["--frequency-penalty", "-inf"], "--frequency-penalty must be a finite number"),
    (["--stop", ""], "--stop needs a non-empty string"),
    (["-r", ""], "-r needs a non-empty string"),
    (["--format", "xml"], "--format must be json"),
    (["--format", "json", "--json-schema", "{}"], "--json-schema and --format cannot be combined"),
    (["--grammar", "nothing.gbnf"], "grammar file not found: nothing.gbnf"),
    (["--grammar", ""], "--grammar is empty"),
    (["--grammar", "root ::= \"a\"", "--format", "json"], "--grammar and --format cannot be combined"),
    (["--json-schema", "{not json"], "the JSON schema is not valid JSON"),
    (["--json-schema", "no-such-schema.json"], "JSON schema file not found: no-such-schema.json"),
    (["--json-schema", ""], "--json-schema is empty"),
    (["--chat-template", "templates/missing.jinja"], "chat template file not found: templates/missing.jinja"),
    (["--chat-template", "missing.jinja"], "chat template file not found: missing.jinja"),
    (["--chat-template", " "], "--chat-template is empty"),
    (["--logprobs", "3"], "--logprobs needs --json"),
    (["--logprobs", "21", "--json"], "--logprobs must be in 0..20, got 21"),
    (["--logprobs", "-1", "--json"], "--logprobs must be in 0..20, got -1"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_control_values_are_one_line_and_load_nothing(fake_engine, args, needle):
    line = one_error_line(invoke("run", "hi", "-m", FAKE, *args))
    assert needle in line, line
    assert not fake_engine.opened and not fake_engine.calls


@pytest.mark.parametrize("cmd", ["chat", "batch"])
def test_bad_control_values_in_chat_and_batch_too(fake_engine, tmp_path, cmd):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    args = ["chat"] if cmd == "chat" else ["batch", tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl"]
    for bad, needle in [(["--repeat-penalty", "0"], "--repeat-penalty must be > 0"),
                        (["--format", "yaml"], "--format must be json"),
                        (["--chat-template", "x/y.jinja"], "chat template file not found")]:
        assert needle in one_error_line(invoke(*args, "-m", FAKE, *bad, input="hi\n"))
    assert not fake_engine.opened and not (tmp_path / "out.jsonl").exists()


# ------------------------------------------------------------ grammars
def test_grammar_file_and_inline_gbnf(fake_engine, tmp_path):
    g = tmp_path / "yes.gbnf"
    g.write_text('root ::= "yes" | "no"\n', encoding="utf-8")
    assert run_cfg(fake_engine, "--grammar", g).grammar == 'root ::= "yes" | "no"\n'
    fake_engine.calls.clear()
    assert run_cfg(fake_engine, "--grammar", 'root ::= "a"+').grammar == 'root ::= "a"+'


def test_format_json_and_json_schema_become_gbnf(fake_engine, tmp_path):
    from mars_local.speculate.grammar import grammar_from_json_schema, json_grammar

    assert run_cfg(fake_engine, "--format", "json").grammar == json_grammar()
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    want = grammar_from_json_schema(schema)
    assert want != json_grammar()
    fake_engine.calls.clear()
    assert run_cfg(fake_engine, "--json-schema", schema).grammar == want
    f = tmp_path / "schema.json"
    f.write_text(schema, encoding="utf-8")
    fake_engine.calls.clear()
    assert run_cfg(fake_engine, "-j", f).grammar == want


def test_a_grammar_file_that_is_not_utf8_is_one_line(fake_engine, tmp_path):
    g = tmp_path / "bad.gbnf"
    g.write_bytes(b'root ::= "caf\xe9"\n')
    assert "not UTF-8" in one_error_line(invoke("run", "hi", "-m", FAKE, "--grammar", g))


# ------------------------------------------------------------ chat templates
def test_chat_template_name_file_and_jinja_text_reach_the_engine(fake_engine, tmp_path):
    ok(invoke("run", "hi", "-m", FAKE, "--chat-template", "chatml"))
    assert fake_engine.opened[-1]["chat_template"] == "chatml"
    t = tmp_path / "my.jinja"
    t.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}", encoding="utf-8")
    ok(invoke("run", "hi", "-m", FAKE, "--chat-template", t, "--chat"))
    assert fake_engine.opened[-1]["chat_template"] == t.read_text()
    jinja = "{{ messages[0]['content'] }}"
    ok(invoke("run", "hi", "-m", FAKE, "--chat-template", jinja))
    assert fake_engine.opened[-1]["chat_template"] == jinja


@pytest.mark.parametrize("data,needle", [
    (b"{{ 'caf\xe9' }}", "is not UTF-8 text (byte 0xe9 on line 1)"),
    (b"", "is empty"),
    (b"{{ a }}\x00", "is binary"),
])
def test_a_bad_chat_template_file_is_one_line(fake_engine, tmp_path, data, needle):
    t = tmp_path / "t.jinja"
    t.write_bytes(data)
    assert needle in one_error_line(invoke("run", "hi", "-m", FAKE, "--chat-template", t))
    assert not fake_engine.opened


def test_a_chat_template_directory_is_one_line(fake_engine, tmp_path):
    assert "is a directory" in one_error_line(invoke("run", "hi", "-m", FAKE, "--chat-template", tmp_path))


# ------------------------------------------------------------ -p, -f
def test_dash_p_is_the_prompt(fake_engine):
    ok(invoke("run", "-p", "from -p", "-m", FAKE))
    ok(invoke("run", "-m", FAKE, "--prompt", "from --prompt"))
    assert [c[0] for c in fake_engine.calls] == ["from -p", "from --prompt"]


@pytest.mark.parametrize("args,needle", [
    (["positional", "-p", "opt"], "PROMPT and -p were both given"),
    (["positional", "--prompt", "opt"], "PROMPT and --prompt were both given"),
    (["-p", "opt", "-f", "x.txt"], "-p and -f were both given"),
    (["positional", "--file", "x.txt"], "PROMPT and --file were both given"),
])
def test_two_prompts_are_one_line(fake_engine, args, needle):
    line = one_error_line(invoke("run", *args, "-m", FAKE))
    assert "give the prompt once" in line and needle in line, line
    assert not fake_engine.opened


def test_dash_f_reads_the_prompt_from_a_file(fake_engine, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("line one\nline two ü\n", encoding="utf-8")
    ok(invoke("run", "-f", f, "-m", FAKE))
    assert fake_engine.calls[0][0] == "line one\nline two ü\n"


def test_dash_f_with_bytes_that_are_not_utf8_warns_once(fake_engine, tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes(b"caf\xe9 au lait")
    r = ok(invoke("run", "--file", f, "-m", FAKE, "--json"))
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning:") and "not valid UTF-8" in err[0], err
    assert fake_engine.calls[0][0] == "caf\ufffd au lait"


@pytest.mark.parametrize("make,needle", [
    (lambda d: d / "missing.txt", "prompt file not found"),
    (lambda d: d, "is a directory"),
    (lambda d: (d / "empty.txt").write_text("  \n") and d / "empty.txt", "is empty"),
])
def test_a_bad_prompt_file_is_one_line(fake_engine, tmp_path, make, needle):
    assert needle in one_error_line(invoke("run", "-f", make(tmp_path), "-m", FAKE))
    assert not fake_engine.calls


# ------------------------------------------------------------ --logprobs
def test_logprobs_are_in_the_json_object_with_each_tokens_text(fake_engine):
    fake_engine.reply = "ab"
    obj = json.loads(ok(invoke("run", "hi", "-m", FAKE, "--json", "--logprobs", "2")).stdout)
    assert fake_engine.configs[0].logprobs == 2
    a, b = ord("a"), ord("b")
    assert obj["logprobs"] == [
        {"token": a, "logprob": -a / 1000, "text": "a",
         "top": [{"token": a, "logprob": -a / 1000, "text": "a"}, {"token": b, "logprob": -b / 1000, "text": "b"}]},
        {"token": b, "logprob": -b / 1000, "text": "b",
         "top": [{"token": b, "logprob": -b / 1000, "text": "b"},
                 {"token": b + 1, "logprob": -(b + 1) / 1000, "text": "c"}]},
    ]


def test_without_logprobs_the_json_object_has_none(fake_engine):
    obj = json.loads(ok(invoke("run", "hi", "-m", FAKE, "--json")).stdout)
    assert sorted(obj) == ["stats", "text", "tokens"] and fake_engine.configs[0].logprobs == 0


# ------------------------------------------------------------ mars chat
def test_chat_honours_the_controls_and_the_template(fake_engine, tmp_path):
    g = tmp_path / "g.gbnf"
    g.write_text('root ::= "x"+', encoding="utf-8")
    fake_engine.reply = "one two three"
    r = ok(invoke("chat", "-m", FAKE, "--stop", " two", "--ignore-eos", "--repeat-penalty", "1.2",
                  "--repeat-last-n", "32", "--presence-penalty", "0.1", "--frequency-penalty", "0.2",
                  "--grammar", g, "--chat-template", "gemma", input="hello\n/quit\n"))
    cfg = fake_engine.configs[0]
    assert cfg.stop == (" two",) and cfg.ignore_eos
    assert (cfg.repeat_penalty, cfg.repeat_last_n, cfg.presence_penalty, cfg.frequency_penalty) == (1.2, 32, 0.1, 0.2)
    assert cfg.grammar == 'root ::= "x"+'
    assert fake_engine.opened[0]["chat_template"] == "gemma"
    assert "one\n" in r.stdout and "two" not in r.stdout


# ------------------------------------------------------------ mars batch
def test_batch_flags_are_every_records_default_and_fields_override(fake_engine, tmp_path):
    from mars_local.speculate.grammar import grammar_from_json_schema, json_grammar

    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in [
        {"id": 1, "prompt": "plain"},
        {"id": 2, "prompt": "fields", "stop": ["X", "Y"], "ignore_eos": True, "repeat_penalty": 1.5,
         "repeat_last_n": -1, "presence_penalty": 0.3, "frequency_penalty": -0.3, "max_tokens": -1},
        {"id": 3, "prompt": "schema", "json_schema": schema, "stop": "Z"},
        {"id": 4, "prompt": "schema text", "json_schema": json.dumps(schema)},
        {"id": 5, "prompt": "format", "format": "json"},
        {"id": 6, "prompt": "gbnf", "grammar": 'root ::= "q"'},
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    ok(invoke("batch", inp, "-o", out, "-m", FAKE, "-r", "STOP", "--repeat-penalty", "1.1",
              "--grammar", 'root ::= "d"', "--chat-template", "chatml"))
    cfgs = {text: cfg for text, cfg in fake_engine.calls}
    assert fake_engine.opened[0]["chat_template"] == "chatml"
    d = cfgs["plain"]
    assert d.stop == ("STOP",) and d.repeat_penalty == 1.1 and d.grammar == 'root ::= "d"' and not d.ignore_eos
    f = cfgs["fields"]
    assert f.stop == ("X", "Y") and f.ignore_eos and f.repeat_penalty == 1.5 and f.repeat_last_n == -1
    assert (f.presence_penalty, f.frequency_penalty, f.max_tokens) == (0.3, -0.3, -1)
    assert f.grammar == 'root ::= "d"'  # the flag's grammar where the record names none
    assert cfgs["schema"].grammar == grammar_from_json_schema(schema) == cfgs["schema text"].grammar
    assert cfgs["schema"].stop == ("Z",)
    assert cfgs["format"].grammar == json_grammar()
    assert cfgs["gbnf"].grammar == 'root ::= "q"'


def test_batch_logprobs_field_adds_logprobs_to_that_record_only(fake_engine, tmp_path):
    fake_engine.reply = "ok"
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "a", "logprobs": 1}\n{"id": 2, "prompt": "b"}\n')
    out = tmp_path / "out.jsonl"
    ok(invoke("batch", inp, "-o", out, "-m", FAKE))
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    o, k = ord("o"), ord("k")
    assert rows[0]["logprobs"] == [
        {"token": o, "logprob": -o / 1000, "text": "o", "top": [{"token": o, "logprob": -o / 1000, "text": "o"}]},
        {"token": k, "logprob": -k / 1000, "text": "k", "top": [{"token": k, "logprob": -k / 1000, "text": "k"}]},
    ]
    assert sorted(rows[1]) == ["id", "mars_batch", "stats", "text"]
    assert list(rows[0])[:4] == ["mars_batch", "id", "text", "stats"]  # the output still starts with mark and id


BAD_FIELDS = [
    ({"stop": [1]}, "'stop' must be a non-empty string or a list of non-empty strings, got [1]"),
    ({"stop": ""}, "'stop' must be a non-empty string"),
    ({"stop": ["a", ""]}, "'stop' must be"),
    ({"ignore_eos": "yes"}, "'ignore_eos' must be true or false"),
    ({"ignore_eos": 1}, "'ignore_eos' must be true or false"),
    ({"repeat_penalty": 0}, "'repeat_penalty' must be a number > 0"),
    ({"repeat_penalty": "1"}, "'repeat_penalty' must be a number > 0"),
    ({"repeat_last_n": -2}, "'repeat_last_n' must be a whole number >= -1"),
    ({"repeat_last_n": 1.5}, "'repeat_last_n' must be a whole number >= -1"),
    ({"presence_penalty": None}, "'presence_penalty' must be a finite number"),
    ({"frequency_penalty": True}, "'frequency_penalty' must be a finite number"),
    ({"grammar": ""}, "'grammar' must be GBNF grammar text"),
    ({"grammar": 5}, "'grammar' must be GBNF grammar text"),
    ({"json_schema": [1]}, "'json_schema' must be a JSON Schema"),
    ({"json_schema": "not json"}, "'json_schema' must be a JSON Schema (an object, or a string holding one), "
                                  "got \"not json\" (the JSON schema is not valid JSON"),
    ({"json_schema": "[1]"}, "a JSON schema must be a JSON object"),
    ({"format": "xml"}, "'format' must be \"json\", got \"xml\""),
    ({"format": "json", "grammar": "root ::= \"a\""}, "give at most one of 'grammar', 'json_schema', 'format'"),
    ({"logprobs": 21}, "'logprobs' must be a whole number from 0 to 20"),
    ({"logprobs": True}, "'logprobs' must be a whole number from 0 to 20"),
    ({"max_tokens": 0}, "'max_tokens' must be a whole number from 1"),
    ({"max_tokens": -2}, "or -1"),
]


@pytest.mark.parametrize("fields,needle", BAD_FIELDS, ids=[json.dumps(f) for f, _ in BAD_FIELDS])
def test_batch_bad_control_fields_are_named_and_skipped(fake_engine, tmp_path, fields, needle):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt": "good"}) + "\n" + json.dumps({"id": 2, "prompt": "bad", **fields})
                   + "\n")
    out = tmp_path / "out.jsonl"
    r = invoke("batch", inp, "-o", out, "-m", FAKE)
    assert r.exit_code == 3, r.output
    assert "Traceback" not in r.output
    warn = [x for x in r.stderr.splitlines() if x.startswith("warning: skipped line 2:")]
    assert len(warn) == 1 and needle in warn[0], r.stderr
    assert [c[0] for c in fake_engine.calls] == ["good"]
    r = invoke("batch", inp, "-o", tmp_path / "strict.jsonl", "-m", FAKE, "--strict")
    assert needle in one_error_line(r)


def test_batch_max_tokens_minus_one_is_allowed(fake_engine, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "a", "max_tokens": -1}\n')
    ok(invoke("batch", inp, "-o", tmp_path / "out.jsonl", "-m", FAKE, "-n", 3))
    assert fake_engine.configs[0].max_tokens == -1


def test_batch_n_minus_one_is_every_records_default(fake_engine, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b", "max_tokens": 5}\n')
    ok(invoke("batch", inp, "-o", tmp_path / "out.jsonl", "-m", FAKE, "-n", -1))
    assert [c.max_tokens for c in fake_engine.configs] == [-1, 5]


# ------------------------------------------------------------ end to end on the tiny models
def run_json(*args) -> dict:
    r = invoke("run", *args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.fixture
def tiny(tiny_target, tiny_draft):
    """`mars run` arguments for the tiny pair: greedy, strict, one thread."""
    return ["-m", tiny_target, "-md", tiny_draft, "-t", 1, "-c", 512, "--verify", "strict"]


def test_e2e_a_finite_grammar_ends_with_one_of_its_strings(tiny):
    for verify in ("strict", "mars"):
        obj = run_json("the a", *tiny, "--verify", verify, "-n", 16, "--grammar", 'root ::= "yes" | "no" | "maybe"')
        assert obj["text"] in ("yes", "no", "maybe") and obj["stats"]["stop_reason"] == "eog", obj["text"]


def test_e2e_format_json_is_json(tiny_target):
    obj = run_json("the a", "-m", tiny_target, "-t", 1, "-n", -1, "-c", 512, "--format", "json")
    if obj["stats"]["stop_reason"] == "eog":  # the grammar was complete: the text is one JSON object
        assert isinstance(json.loads(obj["text"]), dict)
    else:  # a full context: an unfinished object
        assert obj["stats"]["stop_reason"] == "context" and obj["text"].lstrip().startswith("{")


def test_e2e_a_stop_string_cuts_the_greedy_output(tiny):
    full = run_json("the a", *tiny, "-n", 24, "--ignore-eos")
    text = full["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop and stop.strip(), text
    cut = run_json("the a", *tiny, "-n", 24, "--ignore-eos", "--stop", stop)
    assert cut["text"] == text[:text.index(stop)]
    # the generation ended there: fewer tokens than without the stop string, and the reason says so
    assert len(cut["tokens"]) < len(full["tokens"]) and cut["stats"]["stop_reason"] == "stop", cut["stats"]


def test_e2e_ignore_eos_generates_exactly_n(tiny):
    obj = run_json("the a", *tiny, "-n", 40, "--ignore-eos")
    assert obj["stats"]["n_generated"] == 40 and obj["stats"]["stop_reason"] == "length"


def test_e2e_a_huge_repeat_penalty_never_repeats_a_token(tiny):
    plain = run_json("the a", *tiny, "-n", 40, "--ignore-eos")
    assert len(set(plain["tokens"])) < len(plain["tokens"])  # the tiny model repeats itself unpenalized
    for flags in (["--repeat-penalty", "1000"], ["--presence-penalty", "1000"], ["--frequency-penalty", "1000"]):
        obj = run_json("the a", *tiny, "-n", 40, "--ignore-eos", "--repeat-last-n", "-1", *flags)
        assert len(set(obj["tokens"])) == len(obj["tokens"]) == 40, flags


def test_e2e_logprobs_of_greedy_tokens(tiny):
    obj = run_json("the a", *tiny, "-n", 12, "--logprobs", 3)
    lps = obj["logprobs"]
    assert [x["token"] for x in lps] == obj["tokens"]
    for x in lps:
        assert len(x["top"]) == 3 and x["top"][0]["token"] == x["token"]  # greedy: the argmax
        assert x["logprob"] == x["top"][0]["logprob"] <= 0
        assert [t["logprob"] for t in x["top"]] == sorted((t["logprob"] for t in x["top"]), reverse=True)
        assert isinstance(x["text"], str)


def test_e2e_n_minus_one_runs_to_eog_or_the_context(tiny):
    obj = run_json("the a", *tiny, "-n", -1)
    assert obj["stats"]["stop_reason"] in ("eog", "context")
    if obj["stats"]["stop_reason"] == "context":
        assert obj["stats"]["n_prompt"] + obj["stats"]["n_generated"] >= 511


def test_e2e_batch_records_with_controls(tiny, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in [
        {"id": 1, "prompt": "the a", "grammar": 'root ::= "yes" | "no"', "max_tokens": 8},
        {"id": 2, "prompt": "the a", "logprobs": 2, "max_tokens": 5, "ignore_eos": True},
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    r = invoke("batch", inp, "-o", out, *tiny)
    assert r.exit_code == 0, r.output
    rows = {x["id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert rows[1]["text"] in ("yes", "no") and "logprobs" not in rows[1]
    assert rows[2]["stats"]["n_generated"] == 5 and len(rows[2]["logprobs"]) == 5


def test_an_unknown_chat_template_name_is_one_line_before_anything_loads(fake_engine):
    line = one_error_line(invoke("run", "hi", "-m", FAKE, "--chat-template", "no-such-template"))
    assert "unknown chat template 'no-such-template'" in line and "chatml" in line
    assert not fake_engine.opened


def test_a_chat_template_file_with_a_jinja_error_names_the_file(fake_engine, tmp_path):
    t = tmp_path / "broken.jinja"
    t.write_text("{% for m in messages %}{{ m['content'] }}", encoding="utf-8")  # no endfor
    line = one_error_line(invoke("run", "hi", "-m", FAKE, "--chat-template", t))
    assert line.startswith(f"error: --chat-template {t}:"), line
    assert not fake_engine.opened


def test_e2e_chat_template_builtin_names_and_a_jinja_file(tiny, tmp_path):
    chatml = run_json("hi", *tiny, "-n", 2, "--chat", "--chat-template", "chatml")
    gemma = run_json("hi", *tiny, "-n", 2, "--chat", "--chat-template", "gemma")
    assert chatml["stats"]["n_prompt"] != gemma["stats"]["n_prompt"]
    short = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    t = tmp_path / "mine.jinja"
    t.write_text(short.replace("<<", "<<<<").replace(">>", ">>>>"), encoding="utf-8")
    from_file = run_json("hi", *tiny, "-n", 2, "--chat", "--chat-template", t)
    inline = run_json("hi", *tiny, "-n", 2, "--chat", "--chat-template", t.read_text())
    assert from_file["tokens"] == inline["tokens"]
    assert from_file["stats"]["n_prompt"] == inline["stats"]["n_prompt"]
    shorter = run_json("hi", *tiny, "-n", 2, "--chat", "--chat-template", short)
    assert from_file["stats"]["n_prompt"] - shorter["stats"]["n_prompt"] == 4  # one token per '<' and '>'


def test_the_cli_warns_once_when_the_cpu_is_busy(fake_engine, monkeypatch):
    """`mars run` asks with the engine's thread count and prints the note as one warning line."""
    import mars_local.llama.runtime
    from mars_local.llama.runtime import busy_note

    asked = []
    monkeypatch.setattr(mars_local.llama.runtime, "read_busy_note",
                        lambda threads: asked.append(threads) or busy_note(threads, 2, 2.0, 3))
    fake_engine.n_threads = 2
    fake_engine.reply = "ok"
    r = invoke("run", "hi", "-m", FAKE)
    assert r.exit_code == 0, r.output
    lines = [x for x in r.stderr.splitlines() if "CPU is busy" in x]
    assert asked == [2] and len(lines) == 1 and lines[0].startswith("warning:") and "try -t 1" in lines[0], r.stderr


def test_a_draft_max_beyond_what_the_target_verifies_is_one_warning(fake_engine):
    """A GPU target verifies at most 15 draft tokens a round (16-row windows): --draft-max 32 runs
    and says so in one warning line; a --draft-max within the bound, or none given, says nothing."""
    fake_engine.max_draft = 15
    r = ok(invoke("run", "hi", "-m", FAKE, "--draft-max", "32"))
    lines = [x for x in r.stderr.splitlines() if "draft tokens a round" in x]
    assert len(lines) == 1 and lines[0].startswith("warning: --draft-max 32") and "at most 15" in lines[0], r.stderr
    for args in (("--draft-max", "15"), ()):
        r = ok(invoke("run", "hi", "-m", FAKE, *args))
        assert "draft tokens a round" not in r.stderr
