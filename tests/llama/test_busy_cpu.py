"""The warning about a CPU that other processes keep busy (issue 21, item 8)."""

from __future__ import annotations

import pytest

from mars_local.llama.runtime import busy_note, read_busy_note


@pytest.fixture(autouse=True)
def note_on(monkeypatch):
    monkeypatch.delenv("MARS_BUSY_NOTE", raising=False)  # conftest turns it off for the other tests


@pytest.mark.parametrize("threads, cores, load, running, warn, suggest", [
    (2, 2, 2.0, 3, True, "-t 1"),     # another process on both cores (the ~100x slowdown measured)
    (2, 2, 1.1, 2, True, "-t 1"),     # one core busy elsewhere
    (2, 2, 0.1, 1, False, None),      # idle
    (2, 2, 2.0, 1, False, None),      # the load average still shows a job that has ended
    (2, 2, 0.2, 4, False, None),      # a burst of short tasks right now, not a busy machine
    (8, 16, 4.0, 5, False, None),     # enough free cores for the default threads
    (16, 16, 4.0, 5, True, "-t 12"),  # all cores asked for while 4 are busy
    (1, 2, 1.0, 2, False, None),      # one thread fits beside one busy core
    (1, 2, 3.3, 4, True, "stop the other work"),  # -t 1 already: no "-t 1" advice (it was given)
    (2, 2, 3.0, 4, True, "-t 1"),     # both cores busy elsewhere: one thread still shares less
])
def test_busy_note(threads, cores, load, running, warn, suggest):
    note = busy_note(threads, cores, load, running)
    assert (note is not None) == warn, note
    if warn:
        assert suggest in note and f"load {load:.1f} on {cores} cores" in note
        assert f"-t {threads}" not in note  # never the setting it runs with


def test_read_busy_note_parses_proc_loadavg(tmp_path):
    f = tmp_path / "loadavg"
    f.write_text("9.50 3.00 1.00 40/700 12345\n")
    note = read_busy_note(512, str(f))  # more threads than any core count, 39 other runnable tasks
    assert note is not None and "load 9.5" in note
    f.write_text("0.00 0.00 0.00 1/700 12345\n")
    assert read_busy_note(512, str(f)) is None
    f.write_text("garbage\n")
    assert read_busy_note(512, str(f)) is None
    assert read_busy_note(2, str(tmp_path / "missing")) is None


def test_mars_busy_note_0_turns_it_off(tmp_path, monkeypatch):
    f = tmp_path / "loadavg"
    f.write_text("9.50 3.00 1.00 40/700 12345\n")
    assert read_busy_note(512, str(f)) is not None
    monkeypatch.setenv("MARS_BUSY_NOTE", "0")
    assert read_busy_note(512, str(f)) is None


def test_this_process_spinning_threads_are_not_other_work():
    """Four threads of this process spinning: the machine's own count must not make them 'others'."""
    import hashlib
    import threading
    import time

    from mars_local.llama.runtime import _own_running_threads

    stop = threading.Event()
    data = bytes(8 << 20)

    def spin():  # hashing releases the GIL: the threads run at once, as llama.cpp's do
        while not stop.is_set():
            hashlib.sha256(data).digest()

    threads = [threading.Thread(target=spin) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.05)
        assert max(_own_running_threads() for _ in range(20)) >= 2
    finally:
        stop.set()
        for t in threads:
            t.join()

