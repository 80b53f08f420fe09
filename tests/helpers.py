"""What many test modules use: the CLI in-process (``invoke``), the real entry point in a
subprocess (``mars``), a fresh interpreter (``run_python``), the checks of a refused command
(``one_error_line``, ``stderr_lines``, ``no_traceback``) and the server app over the scripted
FakeEngine (``server_client``, ``api_error``).  ``tests/`` is on sys.path (conftest.py lives
there), so ``from helpers import invoke, mars`` works from every test folder.  Nothing here
imports llama_cpp at import time (the pure tests use this module too; ``x86_avx2_build`` does
when called)."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARS = [sys.executable, "-m", "mars_local"]  # the package's __main__
MARS_SCRIPT = [str(Path(sys.executable).with_name("mars"))]  # the installed console script


@cache
def _runner():
    from typer.testing import CliRunner  # not at the top: the pure venv has no typer

    return CliRunner()


def invoke(*args, input=None, env=None):
    """`mars ARGS` in this process (typer's CliRunner; stdout and stderr kept apart)."""
    from mars_local.cli.main import app

    return _runner().invoke(app, [str(a) for a in args], input=input, env=env)


def mars(*args, input=None, stdin=None, env=None, timeout=120, memory=None, text=False,
         script=False) -> subprocess.CompletedProcess:
    """The real entry point in a subprocess; bytes arguments and input go through as they are.
    ``stdin``: a file (or subprocess.DEVNULL) instead of ``input``; ``memory``: an address-space
    limit in bytes; ``text``: str output instead of bytes; ``script``: through the installed
    ``mars`` console script instead of ``python -m mars_local``."""
    argv = [a if isinstance(a, bytes) else str(a) for a in args]

    def limit():
        if memory is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run((MARS_SCRIPT if script else MARS) + argv, input=input, stdin=stdin, capture_output=True,
                          timeout=timeout, text=text, env={**os.environ, **(env or {})},
                          preexec_fn=limit if memory is not None else None)


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -c CODE`` in a fresh interpreter (what a module import loads, from nothing)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------ a refused command
def no_traceback(r) -> None:
    """An in-process CLI result ended by an exit, not an exception, and printed no traceback."""
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output


def stderr_lines(r) -> list[str]:
    """The stderr lines of a CLI result, in-process or subprocess (bytes or text), with no traceback."""
    err = r.stderr.decode("utf-8", "replace") if isinstance(r.stderr, bytes) else r.stderr
    assert "Traceback" not in err, err
    return err.strip().splitlines()


def one_error_line(r, code: int = 2) -> str:
    """The single ``error: ...`` line of a refused command (exit ``code``), in-process or subprocess."""
    if hasattr(r, "exit_code"):  # typer's Result
        no_traceback(r)
        rc = r.exit_code
    else:  # subprocess.CompletedProcess
        rc = r.returncode
    lines = stderr_lines(r)
    assert rc == code and len(lines) == 1 and lines[0].startswith("error:"), (rc, r.stderr)
    return lines[0]


# ------------------------------------------------------------------ the server app in-process
def server_client(engine=None, base_url: str = "http://127.0.0.1:8080", **settings):
    """A TestClient on ``create_app`` over ``engine`` (default: a FakeEngine answering "hello world"
    two characters a chunk); ``settings`` go to ServerSettings (model id "fake", no request log).
    The engine is at ``client.engine``."""
    from fastapi.testclient import TestClient

    from fake_engine import FakeEngine
    from mars_local.core.config import GenerateConfig
    from mars_local.server.app import ServerSettings, create_app

    eng = engine or FakeEngine(reply="hello world", chunk=2)
    s = ServerSettings(GenerateConfig.make(max_tokens=-1), "fake", **{"log": False, **settings})
    c = TestClient(create_app(eng, s), raise_server_exceptions=False, base_url=base_url)
    c.engine = eng
    return c


def api_error(r, status: int, code: str | None = None, param: str | None = None) -> dict:
    """The OpenAI-shaped error body of response ``r`` (``status``; ``code``/``param`` when given)."""
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    assert code is None or e["code"] == code
    assert param is None or e["param"] == param
    return e


def benchmark_script(name: str):
    """A script of benchmarks/ imported as a module (``name`` without .py), for its functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def x86_avx2_build() -> bool:
    """Whether the installed llama.cpp is an x86 build with AVX2 (AVX-512 builds report it too):
    the builds that compile the x86 kernels of patches/0004-0006."""
    import platform

    from mars_local.llama.kernels import cpu_features
    from mars_local.llama.runtime import backend_info

    return platform.machine().lower() in {"x86_64", "amd64"} and "AVX2" in cpu_features(backend_info()["system_info"])
