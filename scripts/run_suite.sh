#!/usr/bin/env bash
# Runs a test command (`make test`'s pytest runs) and, if it fails, ends its output with what the
# tail of a CI log must show to find the fault: the test that was running (conftest.py writes each
# test's id to $MARS_TEST_TRACE as it starts) and a native crash's first lines (a GGML assertion,
# the faulthandler dump's innermost frames), which a crash otherwise leaves far above the tail,
# under a dump of every thread's pytest frames.
set -u
mkdir -p .cache
log=.cache/last-suite.log
trace=$PWD/.cache/last-test
rm -f "$trace"
MARS_TEST_TRACE=$trace "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then  # (a CI page shows a log's last ~20 lines: these, the most telling last)
    echo "=== the suite failed (exit $rc)"
    awk '/Fatal Python error/ {on = 1} on && !/site-packages\/(_pytest|pluggy)|^Extension modules|^ *$/ {print; if (++n == 10) exit}' "$log"
    grep -m 3 -E "GGML_ASSERT|GGML_ABORT|terminate called|double free|corrupted" "$log"
    if [ -s "$trace" ]; then echo "=== the last test started: $(cat "$trace")"; fi
fi
exit "$rc"
