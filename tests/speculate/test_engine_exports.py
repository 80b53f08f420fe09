"""The package's engine names resolve on first use, and llama.cpp's backend starts with the first model."""

from __future__ import annotations

from helpers import run_python as run


def test_engine_names_load_on_first_use_and_the_backend_on_the_first_model(tiny_target):
    r = run(
        "import sys, mars_local as m\n"
        "from mars_local import *\n"  # every name in __all__ resolves
        "assert Engine is m.Engine and Engine.__module__ == 'mars_local.speculate.engine'\n"
        "assert verify is m.verify and callable(verify)\n"  # the function, not the submodule
        "from mars_local.llama import runtime\n"
        "from mars_local.llama import backend\n"
        "assert not backend._backend_started\n"
        f"runtime.Model({str(tiny_target)!r}, 0).close()\n"
        "assert backend._backend_started\n"
    )
    assert r.returncode == 0, r.stderr
