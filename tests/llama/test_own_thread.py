"""Computing on a thread of its own (llama.runtime.on_own_thread): the repack probe at load must leave
no OpenMP pool on the loading thread, or a server that generates on another thread runs every round
with libgomp's short spins (BENCHMARKS.md run 34: ~1.8x slower rounds on 2 cores)."""

from __future__ import annotations

import json
import threading

import pytest

from helpers import run_python
from mars_local.llama.runtime import on_own_thread


def test_the_result_and_the_exception_come_back_from_another_thread():
    here = threading.get_ident()
    assert on_own_thread(lambda a, b: (a + b, threading.get_ident() != here), 2, 3) == (5, True)

    def fail():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        on_own_thread(fail)


def test_a_probe_leaves_no_compute_threads_behind(tiny_target):
    """The threads of the process before and after model_invariance on this thread (2 compute
    threads): equal.  Computing on this thread itself keeps a pool worker alive (the control)."""
    code = f"""
import json, os, time
from mars_local.llama.invariance import model_invariance, _model_invariance
from mars_local.llama.runtime import Model
n = lambda: len(os.listdir("/proc/self/task"))
m = Model({str(tiny_target)!r}, 0, exact_kernels=True)
before = n()
rows = model_invariance(m, (2, 3), 6, 2)
for _ in range(200):  # the ended thread's pool workers are told to exit, not waited for: give them 2 s
    if n() <= before:
        break
    time.sleep(0.01)
after_probe = n()
_model_invariance(m, (2,), 4, 2, "Hello there")  # on this thread: what the probe did before
gomp = "libgomp" in open("/proc/self/maps").read()
print(json.dumps([before, after_probe, n(), {{str(k): v[0] for k, v in rows.items()}}, gomp]))
m.close()
"""
    r = run_python(code, timeout=120)
    assert r.returncode == 0, r.stderr
    before, after_probe, after_here, rows, gomp = json.loads(r.stdout.strip().splitlines()[-1])
    assert rows == {"2": 0, "3": 0}  # the probe still measures (exact kernels: no row differs)
    assert after_probe == before
    if gomp:  # ggml built with OpenMP (Linux, gcc: `make install`'s build)
        assert after_here > before, "the control: a forward on this thread leaves libgomp's pool worker"


def test_ctrl_c_meanwhile_waits_for_the_computation_then_is_raised():
    """A Ctrl-C while the thread computes is raised only once ``fn`` has ended: its caller frees
    the model ``fn`` uses (the repack probe's, on `mars serve`'s first start).  Waiting in
    Thread.join was not enough: on Python 3.11 a KeyboardInterrupt there marks a running thread
    as ended (its lock released from the outside), and a Ctrl-C during the probe crashed the
    server (a segmentation fault: the model freed under the probe's forward)."""
    import signal
    import time

    ended = []

    def compute():
        time.sleep(0.2)  # the caller is waiting by now
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.5)
        ended.append(True)
        return 1

    assert threading.current_thread() is threading.main_thread()
    with pytest.raises(KeyboardInterrupt):
        on_own_thread(compute)
    assert ended == [True]



@pytest.mark.parametrize("when", ["before", "after", "late"])
def test_a_ctrl_c_inside_thread_start_neither_hangs_nor_frees_what_fn_uses(monkeypatch, when):
    """Ctrl-C inside Thread.start: "before" the thread was started (it never will be), "after"
    (it runs), or "late" (started but slower to begin than the caller waits).  The caller must
    not wait forever for a thread that never runs, must not return while ``fn`` runs, and a
    thread that begins after the caller gave up must not call ``fn`` (its model may be freed)."""
    import time

    from mars_local.llama import runtime

    monkeypatch.setattr(runtime, "START_GRACE_S", 0.2, raising=False)
    calls, ended = [], []
    real_start = threading.Thread.start

    class Interrupted(threading.Thread):
        def start(self):
            if when == "after":
                real_start(self)
            elif when == "late":
                threading.Timer(0.6, real_start, (self,)).start()
            raise KeyboardInterrupt

    def compute():
        calls.append(time.monotonic())
        time.sleep(0.3)
        ended.append(time.monotonic())
        return 1

    monkeypatch.setattr(threading, "Thread", Interrupted)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        on_own_thread(compute)
    raised = time.monotonic()
    monkeypatch.undo()
    time.sleep(0.8)  # the "late" thread has begun by now
    if when == "after":
        assert len(calls) == 1 and ended and ended[0] <= raised
    else:
        assert calls == [] and raised - t0 < 1.0


@pytest.mark.parametrize("handler", ["mars", "python"])
def test_a_ctrl_c_that_lands_in_llama_cpps_log_callback_is_not_lost(tiny_target, handler):
    """llama.cpp logs hundreds of lines while a model loads, each through a Python callback, and
    ctypes prints and drops what a callback raises: with Python's own SIGINT handler a Ctrl-C
    landing there is lost (`mars serve` went on to start: the control).  The CLI's handler
    (core/interrupts.py) sends it again, raised once the main thread runs Python outside it."""
    code = f"""
import signal, time
from mars_local.core import interrupts
from mars_local.llama import backend
from mars_local.llama.runtime import Model

if {handler!r} == "mars":
    interrupts.install()
    assert signal.getsignal(signal.SIGINT) is interrupts.handle_sigint

class CtrlC:  # the first line llama.cpp logs "receives" a Ctrl-C
    sent = False

    def append(self, line):
        if not CtrlC.sent:
            CtrlC.sent = True
            signal.raise_signal(signal.SIGINT)

backend.recent_log = CtrlC()
try:
    Model({str(tiny_target)!r}, 0, exact_kernels=True)
    time.sleep(2)  # (Python runs again: a Ctrl-C not lost lands by now)
    print("loaded", CtrlC.sent)
except KeyboardInterrupt:
    print("interrupted", CtrlC.sent)
"""
    r = run_python(code, timeout=120)
    want = "interrupted True" if handler == "mars" else "loaded True"
    assert r.stdout.strip().splitlines()[-1:] == [want], (r.stdout, r.stderr[-2000:])
