"""Shared fixtures: tiny random GGUF models, engines on them, the bundled SmolLM2, an empty user
config, and (from fake_engine.py) ``fake_engine``, the scripted engine the CLI opens.  Shared
functions (``invoke``, ``mars``, ...) are in helpers.py; tests are marked ``slow`` where they load
the bundled model, start servers or spawn many processes (``make test-fast`` leaves them out)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from tinymodels import make_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = ROOT / ".cache" / "test-models"
# `make test-pure` sets this: the pure modules' tests, in a venv without llama-cpp-python.
PURE_RUN = os.environ.get("MARS_PURE_TESTS") == "1"
# The busy-CPU warning depends on what else runs on the machine (a test run itself): off in tests,
# subprocesses included; tests/llama/test_busy_cpu.py and the CLI test of it turn it back on.
os.environ["MARS_BUSY_NOTE"] = "0"

# A suite started from a background job of a non-interactive shell (`make test &`, `nohup`, some CI
# runners) inherits SIGINT ignored, and Python then leaves it so: the tests of what Ctrl-C does would
# fail for the shell's reason, not the code's. Give this process Python's own handler, and through it
# (a handler becomes the default across exec) every process the tests start.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The `fake_engine` fixture, for every test module (no import needed).
pytest_plugins = ["fake_engine"]

# scripts/run_suite.sh (`make test`) names the test that was running when a run failed, a native
# crash included (which ends the process before pytest can report anything).
_TRACE = os.environ.get("MARS_TEST_TRACE")


def pytest_runtest_logstart(nodeid, location):
    if _TRACE:
        with open(_TRACE, "w") as f:
            f.write(nodeid + "\n")


if PURE_RUN:

    @pytest.fixture(autouse=True)
    def no_llama_cpp_in_a_pure_run():
        """A test after which llama_cpp is loaded fails (a pure module, a test
        file or a fixture imported it), even where it is installed."""
        yield
        assert "llama_cpp" not in sys.modules, "llama_cpp was imported during a pure-module test run (make test-pure)"


@pytest.fixture(scope="session", autouse=True)
def learned_state_dir(tmp_path_factory):
    """The adaptive controller's learned-state cache goes to a temporary folder,
    never the user's ~/.cache (subprocesses inherit it)."""
    old = os.environ.get("MARS_STATE_DIR")
    path = tmp_path_factory.mktemp("state")
    os.environ["MARS_STATE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("MARS_STATE_DIR", None)
    else:
        os.environ["MARS_STATE_DIR"] = old


@pytest.fixture(scope="module")
def empty_config(tmp_path_factory) -> dict:
    """The environment of a user config dir without models.yaml (the user's own never leaks into a test)."""
    return {"MARS_CONFIG_DIR": str(tmp_path_factory.mktemp("cfg-empty"))}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_target(tiny_dir) -> Path:
    return make_tiny_llama(tiny_dir / "target.gguf", seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_dir) -> Path:
    """Same weights with noise on the LM head: agrees with the target part of the time."""
    return make_tiny_llama(tiny_dir / "draft.gguf", seed=0, out_noise=0.3)


@pytest.fixture(scope="session")
def tiny_flat_target(tiny_dir) -> Path:
    """Small LM-head scale: flat distributions, many undecided positions."""
    return make_tiny_llama(tiny_dir / "flat-target.gguf", seed=3, out_scale=0.15)


@pytest.fixture(scope="session")
def tiny_flat_draft(tiny_dir) -> Path:
    return make_tiny_llama(tiny_dir / "flat-draft.gguf", seed=3, out_scale=0.15, out_noise=0.05)


@pytest.fixture(scope="session")
def tiny_other_vocab(tiny_dir) -> Path:
    return make_tiny_llama(tiny_dir / "other-vocab.gguf", seed=1, token_suffix="x")


# Engines on the tiny models, one per test module: plain decoding, a draft model, n-gram lookup.
@pytest.fixture(scope="module")
def plain(tiny_target):
    from mars_local import Engine

    with Engine(tiny_target) as eng:
        yield eng


@pytest.fixture(scope="module")
def spec(tiny_target, tiny_draft):
    from mars_local import Engine

    with Engine(tiny_target, tiny_draft) as eng:
        yield eng


@pytest.fixture(scope="module")
def ngram(tiny_target):
    from mars_local import Engine

    with Engine(tiny_target, drafter="ngram") as eng:
        yield eng


@pytest.fixture(scope="session")
def not_gguf(tiny_dir) -> Path:
    p = tiny_dir / "notes.gguf"
    p.write_text("this is not a model\n")
    return p


@pytest.fixture(scope="session")
def truncated_gguf(tiny_dir, tiny_target) -> Path:
    data = tiny_target.read_bytes()
    p = tiny_dir / "truncated.gguf"
    p.write_bytes(data[: len(data) // 2])
    return p


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The bundled offline model (installed by `make install`)."""
    from mars_local.models.registry import load_registry, model_path

    reg = load_registry()
    return model_path(reg.get("smollm2-135m"), "target")


def requantize(src: Path, name: str, ftype: str) -> Path:
    """A same-vocabulary variant made with llama_model_quantize, cached under
    .cache/test-models (git-ignored) so reruns skip the work."""
    import llama_cpp

    from mars_local.llama import runtime  # importing it silences llama.cpp's log

    runtime.init_backend()

    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    out = MODEL_CACHE / name
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, ftype)
        params.allow_requantize = True
        params.nthread = 2
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
        assert rc == 0, f"llama_model_quantize failed with {rc}"
        shutil.move(tmp, out)
    return out


@pytest.fixture(scope="session")
def smollm2_f16(smollm2) -> Path:
    """SmolLM2 requantized to F16 (same vocabulary, different numerics)."""
    return requantize(smollm2, "SmolLM2-135M-Instruct.F16.gguf", "LLAMA_FTYPE_MOSTLY_F16")


@pytest.fixture(scope="session")
def smollm2_q4km(smollm2_f16) -> Path:
    """A K-quant target: the weight layout real pairs ship (uses repacked kernels)."""
    return requantize(smollm2_f16, "SmolLM2-135M-Instruct.Q4_K_M.gguf", "LLAMA_FTYPE_MOSTLY_Q4_K_M")
