"""The pure core imports without llama.cpp; the package exports its names lazily."""

from __future__ import annotations

import pytest

from helpers import run_python as run

# Modules that must not load llama_cpp when imported (numpy and the standard
# library only; chat_template imports jinja2 when a template is compiled).
PURE = [
    "mars_local",
    "mars_local.core.errors",
    "mars_local.core.sampling",
    "mars_local.core.verify",
    "mars_local.speculate.adaptive",
    "mars_local.core.stats",
    "mars_local.core.choices",
    "mars_local.core.config",
    "mars_local.speculate.controllers",
    "mars_local.speculate.drafters",
    "mars_local.core.tokens",
    "mars_local.core.textfile",
    "mars_local.server",
    "mars_local.llama.rpc",
    "mars_local.server.requests",
    "mars_local.server.responses",
    "mars_local.speculate.controls",
    "mars_local.speculate.grammar",
    "mars_local.speculate.learned",
    "mars_local.speculate.native",
    "mars_local.llama.gguf_file",
    "mars_local.chat.template",
    "mars_local.chat.tokens",
    "mars_local.chat.tools",
    "mars_local.chat.tool_grammar",
    "mars_local.models.hub",
    "mars_local.chat.session",
    "mars_local.batch",
    "mars_local.batch.jobs",
    "mars_local.models.registry",
]


@pytest.mark.parametrize("module", PURE)
def test_pure_module_does_not_load_llama_cpp(module):
    r = run(f"import {module}, sys; assert 'llama_cpp' not in sys.modules, sorted(sys.modules)")
    assert r.returncode == 0, r.stderr


def test_public_names_are_listed_and_pure_ones_resolve_without_llama_cpp():
    r = run(
        "import sys, mars_local as m\n"
        "assert set(m.__all__) <= set(dir(m)), set(m.__all__) - set(dir(m))\n"
        "for name in ('MarsError', 'SamplingParams', 'SpecStats', 'VerifyConfig', 'VerifyResult', 'GenerateConfig', 'Chunk', 'Generation', 'Stream'):\n"
        "    assert getattr(m, name).__name__ == name\n"
        "assert m.verify.__module__ == 'mars_local.core.verify' and callable(m.verify)\n"
        "assert m.GenerateConfig().theta == m.VerifyConfig().theta  # one default\n"
        "assert 'mars_local.speculate.engine' not in sys.modules and 'llama_cpp' not in sys.modules\n"
        "try:\n"
        "    m.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    assert r.returncode == 0, r.stderr
