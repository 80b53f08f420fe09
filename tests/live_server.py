"""A live `mars serve` process for tests: started on a free loopback port, stopped after.

``LiveServer.start(args)`` runs ``mars serve --port 0 ARGS`` (the free port is
read from its ready line), collects its stderr lines in a thread (so the pipe
never fills) and stops it on exit.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

from helpers import MARS_SCRIPT

READY = re.compile(r"mars serve: .* on (http://[^\s]+/v1)")


class LiveServer:
    def __init__(self, proc: subprocess.Popen, url: str, lines: list[str]):
        self.proc, self.url, self.lines = proc, url, lines  # url ends in /v1
        self.base = url[: -len("/v1")]

    @classmethod
    def start(cls, *args: str, timeout: float = 60.0, env: dict | None = None) -> "LiveServer":
        cmd = [*MARS_SCRIPT, "serve", "--port", "0", "-t", "2", *map(str, args)]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, **(env or {})})
        lines: list[str] = []
        ready = threading.Event()
        found: list[str] = []

        def read() -> None:
            for line in proc.stderr:
                lines.append(line.rstrip("\n"))
                m = READY.search(line)
                if m and not found:
                    found.append(m.group(1))
                    ready.set()
            ready.set()  # the process ended

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or not found:
            proc.kill()
            raise AssertionError(f"mars serve did not start: {' | '.join(lines[-5:])}")
        return cls(proc, found[0], lines)

    def wait_for_line(self, pattern: str, timeout: float = 10.0) -> str:
        """The first stderr line matching ``pattern`` (regex), waiting for it."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if rx.search(line):
                    return line
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} in: {' | '.join(self.lines[-8:])}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "LiveServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
