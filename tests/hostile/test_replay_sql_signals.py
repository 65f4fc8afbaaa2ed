"""Issue 36 #10: SIGINT during an in-process `replay --sql` query exits 130 with `dcptool:
interrupted`, as CLI.md "Signals" says, not 1 with DuckDB's "Query interrupted" (DuckDB's
Python client answers any signal whose handler raised with its own RuntimeError)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support import capgen

QUERY = "SELECT count(*) AS n FROM range(100000000000)"   # minutes of work: it runs when the signal comes
BUSY_TICKS = 50       # CPU time (clock ticks) past the start of --sql's own work: the query runs
DEADLINE = 120.0      # seconds for any step; the test ends its process whatever happens


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])   # utime + stime


def _wait_for(pred, proc, what: str):
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"replay ended before {what}: {proc.returncode} {proc.stderr.read()}")
        value = pred()
        if value:
            return value
        time.sleep(0.02)   # polling an observable state, not ordering by time
    pytest.fail(f"no {what} within {DEADLINE}s")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum, code, line", [(signal.SIGINT, 130, "dcptool: interrupted"),
                                                (signal.SIGTERM, 143, "dcptool: stopped by SIGTERM")])
def test_a_stop_signal_during_an_in_process_query_is_its_exit_code(tmp_path, signum, code, line):
    caps = tmp_path / "caps"
    capgen.write_captures(capgen.generate("dcp", 7, n_events=60), str(caps), seed=7)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-m", "dcptool.cli", "replay", str(caps), "--sql", QUERY],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=str(tmp_path))
    try:
        # readiness: --sql's private DuckDB directory exists (replay/local/sql.py run_query makes
        # it just before its connection), then the process spends CPU time that only the query
        # can take (the few statements between cost milliseconds)
        _wait_for(lambda: any(n.startswith("dcptool-sql-") for n in os.listdir(tmp)), proc, "--sql's directory")
        start = _cpu_ticks(proc.pid)
        _wait_for(lambda: _cpu_ticks(proc.pid) >= start + BUSY_TICKS, proc, "query running")
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert err.strip().splitlines() == [line], err
    assert proc.returncode == code and out == ""
