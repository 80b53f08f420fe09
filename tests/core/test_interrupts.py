"""core.interrupts.held: signals wait until a block has run, and a process started inside it can
still be stopped with them (held by Python's handlers, not by a signal mask the child inherits)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mars_local.core.interrupts import held


def test_a_sigterm_inside_the_block_reaches_its_handler_after_it():
    seen: list[str] = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("handler"))
    try:
        with held(signal.SIGINT, signal.SIGTERM):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(2000):  # bytecodes where the handler could run
                time.sleep(0)
            seen.append("block")
        assert seen == ["block", "handler"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # both restored
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, old)


def test_an_ignored_signal_stays_ignored():
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # nothing raised, nothing changed
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_process_started_inside_the_block_can_be_stopped_with_the_held_signals(signum):
    """A signal mask would be inherited through exec: the child would never see SIGINT or SIGTERM
    (`mars bench --clients` waited 10 s for each server it stopped, then killed it)."""
    with held(signal.SIGINT, signal.SIGTERM):
        proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        proc.send_signal(signum)
        assert proc.wait(timeout=20) == -signum  # (ended by the signal, not still running)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
