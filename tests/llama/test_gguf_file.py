"""The GGUF checks made before llama.cpp opens a file (pure: no llama.cpp)."""

from __future__ import annotations

import pytest

from mars_local.core.errors import MarsError
from mars_local.llama.gguf_file import check_gguf_file


def test_a_whole_model_passes(tiny_target):
    check_gguf_file(tiny_target)


def test_missing_directory_and_not_gguf_are_named(tmp_path, not_gguf):
    with pytest.raises(MarsError, match="model file not found"):
        check_gguf_file(tmp_path / "missing.gguf")
    with pytest.raises(MarsError, match="is not a file"):
        check_gguf_file(tmp_path)
    with pytest.raises(MarsError, match="not a GGUF model file"):
        check_gguf_file(not_gguf)


@pytest.mark.parametrize(
    "keep, why",
    [(0.5, "declares tensor data up to byte"), (100, "ends inside its GGUF header"), (20, "ends inside its GGUF header")],
)
def test_a_truncated_file_is_refused_with_its_sizes(tiny_target, tmp_path, keep, why):
    data = tiny_target.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(MarsError, match=f"truncated or corrupt: .*{why}"):
        check_gguf_file(cut)


def test_a_fifo_as_the_model_is_refused_not_waited_on(tmp_path):
    """A named pipe where the model should be: opening it waits for a writer forever, and the
    header read before the load (the repack check's metadata) did exactly that.  Both the
    metadata read and the check refuse it at once (a second's timeout guards the test)."""
    import os
    import threading

    from mars_local.llama.gguf_file import gguf_metadata

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    got: list = []

    def read() -> None:
        got.append(gguf_metadata(fifo))
        try:
            check_gguf_file(fifo)
        except MarsError as exc:
            got.append(str(exc))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # (unblock it: a writer opens the pipe)
        with open(fifo, "wb"):
            pass
    assert got == [{}, f"model path is not a file: {fifo}"]
