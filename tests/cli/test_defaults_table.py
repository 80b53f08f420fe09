"""Every default the CLI, the server, the benchmark and the runtime use is the table's
(mars_local.core.defaults): changing a default is changing one line there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import typer.main

import mars_local
from mars_local.cli import flags
from mars_local.cli.main import app
from mars_local.core.defaults import SETTINGS

# Options whose default is a per-command entry of the table; the shared ones map by flags.SETTING_OF.
OWN = {
    ("run", "n_predict"): "max_tokens", ("batch", "n_predict"): "max_tokens",
    ("chat", "n_predict"): "max_tokens_chat", ("serve", "n_predict"): "max_tokens_serve",
    ("bench", "n_predict"): "max_tokens_bench", ("bench", "seed"): "seed_bench", ("bench", "draft_max"): None,
    ("run", "logprobs"): "logprobs", ("serve", "queue"): "queue_size", ("serve", "parallel"): "parallel_serve",
}
NONE_IS_DEFAULT = {"theta", "draft_max", "stop"}  # None: the pair's (the help shows the table's), or no stop string


def test_every_option_default_is_the_tables():
    group = typer.main.get_command(app)
    checked = set()
    for name, command in group.commands.items():
        for param in command.params:
            key = OWN.get((name, param.name), flags.SETTING_OF.get(param.name))
            if key is None or (param.default is None and key in NONE_IS_DEFAULT):
                continue
            assert param.default == SETTINGS[key].default, (name, param.name, param.default, key)
            checked.add((name, key))
    for key in ("max_tokens", "max_tokens_chat", "max_tokens_serve", "max_tokens_bench", "seed_bench", "queue_size",
                "temperature", "top_k", "top_p", "min_p", "seed", "n_ctx", "repeat_penalty", "logprobs"):
        assert any(k == key for _, k in checked), key  # the test saw the option that takes it


# What each user of a default sees, reported by a fresh interpreter.
SCRIPT = textwrap.dedent("""
    import inspect, json
    from typer.testing import CliRunner
    from mars_local import GenerateConfig, SamplingParams, VerifyConfig
    from mars_local.bench.config import BenchSettings
    from mars_local.cli.main import app
    from mars_local.llama.context import Context, context_params
    from mars_local.server.app import ServerSettings
    from mars_local.speculate.drafters import NgramDrafter
    from mars_local.speculate.engine import Engine

    cfg, bench = GenerateConfig(), BenchSettings(target="t.gguf")
    default = lambda f, name: inspect.signature(f).parameters[name].default
    helps = {cmd: CliRunner().invoke(app, [cmd, "--help"], terminal_width=400).stdout
             for cmd in ("run", "chat", "serve", "bench")}
    print(json.dumps({
        "config": [cfg.max_tokens, cfg.theta, cfg.draft_max, cfg.sampling.temperature, cfg.sampling.top_k,
                   cfg.sampling.seed, cfg.repeat_last_n],
        "verify": VerifyConfig().theta, "sampling": SamplingParams().top_k,
        "bench": [bench.max_tokens, bench.seed, bench.n_ctx, bench.ngram_max, list(bench.thetas)],
        "server": ServerSettings.__dataclass_fields__["queue_size"].default,
        "engine": [default(Engine, "n_ctx"), default(Engine, "n_batch"), default(Engine, "ngram_max")],
        "context": [default(Context, "n_ctx"), default(Context, "n_batch"), default(context_params, "n_batch")],
        "ngram": default(NgramDrafter, "max_ngram"),
        "help": {cmd: " ".join(text.split()) for cmd, text in helps.items()},
    }))
""")


def _change_line(lines: list[str], key: str, value) -> int:
    """Set the default of ``key`` on its one line of the table (its first argument); the line's index."""
    [i] = [i for i, line in enumerate(lines) if line.startswith(f'    "{key}": Setting(')]
    head, rest = lines[i].split("Setting(", 1)
    end = rest.index(")") + 1 if rest.startswith("(") else min(j for j in (rest.find(","), rest.find(")")) if j >= 0)
    lines[i] = f"{head}Setting({value!r}{rest[end:]}"
    return i


def test_changing_one_line_of_the_table_changes_every_default(tmp_path):
    """A copy of the package with one line of core/defaults.py changed per default: every
    dataclass, option, help text, server, bench and runtime default follows."""
    changes = {"max_tokens": 77, "max_tokens_chat": 78, "max_tokens_serve": 79, "max_tokens_bench": 80,
               "theta": 0.8, "draft_max": 5, "temperature": 0.5, "top_k": 11, "seed": 7, "repeat_last_n": 33,
               "seed_bench": 3, "thetas_bench": (0.7, 0.8), "n_ctx": 1234, "n_batch": 99, "ngram_max": 5,
               "queue_size": 9}
    src = Path(mars_local.__file__).parent
    shutil.copytree(src, tmp_path / "mars_local", ignore=shutil.ignore_patterns("__pycache__"))
    table = tmp_path / "mars_local" / "core" / "defaults.py"
    before = table.read_text(encoding="utf-8").splitlines()
    after = list(before)
    changed = {_change_line(after, key, value) for key, value in changes.items()}
    table.write_text("\n".join(after) + "\n", encoding="utf-8")
    assert sum(a != b for a, b in zip(before, after)) == len(changed) == len(changes)  # one line per default
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["config"] == [77, 0.8, 5, 0.5, 11, 7, 33]
    assert got["verify"] == 0.8 and got["sampling"] == 11
    assert got["bench"] == [80, 3, 1234, 5, [0.7, 0.8]]
    assert got["server"] == 9 and got["ngram"] == 5
    assert got["engine"] == [1234, 99, 5] and got["context"] == [1234, 99, 99]
    h = got["help"]
    assert "[default: 77]" in h["run"] and "[default: 78]" in h["chat"] and "[default: 79]" in h["serve"]
    assert "[default: 80]" in h["bench"] and "default: 0.7,0.8" in h["bench"]
    assert "MARS margin threshold in (0, 1] (default: the pair's, or 0.8)" in h["run"]
    assert "the pair's, or 5)" in h["run"] and "[default: 1234]" in h["run"] and "[default: 9]" in h["serve"]
    for cmd in ("run", "chat", "serve"):
        assert "[default: 0.5]" in h[cmd] and "[default: 11]" in h[cmd] and "[default: 7]" in h[cmd], cmd
