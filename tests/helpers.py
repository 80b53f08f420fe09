"""What many test modules use: the CLI in-process (``invoke``) and the real entry point in a
subprocess (``mars``).  ``tests/`` is on sys.path (conftest.py lives there), so
``from helpers import invoke, mars`` works from every test folder."""

from __future__ import annotations

import os
import subprocess
import sys

from typer.testing import CliRunner

MARS = [sys.executable, "-m", "mars_local"]
_runner = CliRunner()


def invoke(*args, input=None, env=None):
    """`mars ARGS` in this process (typer's CliRunner; stdout and stderr kept apart)."""
    from mars_local.cli.main import app

    return _runner.invoke(app, [str(a) for a in args], input=input, env=env)


def mars(*args, input=None, env=None, timeout=120, memory=None, text=False) -> subprocess.CompletedProcess:
    """The real entry point in a subprocess; bytes arguments and input go through as they are
    (``memory``: an address-space limit in bytes; ``text``: str output instead of bytes)."""
    argv = [a if isinstance(a, bytes) else str(a) for a in args]

    def limit():
        if memory is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run(MARS + argv, input=input, capture_output=True, timeout=timeout, text=text,
                          env={**os.environ, **(env or {})}, preexec_fn=limit if memory is not None else None)
