"""SIGINT, SIGTERM and SIGHUP end `stream` and `capture` cleanly (streams closed, segments
finished, summary printed) for DCP and Synapse, also when the parent left SIGINT ignored
(a script's `cmd &`); exit 130 for SIGINT, 128 + signum after the clean finish for the
others. The servers stop on SIGINT/SIGTERM with exit 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from dcptool.protocol.dcp.server import producer as P
from tests.support.paths import DCPTOOL
from tests.support.synapse_serve import ServeSynapse
from tests.support.threaded_server import ThreadedServer

pytestmark = pytest.mark.integration


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start(args, ignore_sigint=False):
    return subprocess.Popen([DCPTOOL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_ignore_sigint if ignore_sigint else None)


def wait_for_segment(proc, out, timeout=30.0):
    """Until the capture has an in-progress segment (it is streaming)."""
    deadline = time.monotonic() + timeout
    while not (out.exists() and any(n.endswith(".arrows") for n in os.listdir(out))):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)


def finish(proc, sig):
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out.decode(), err.decode()


def only_finished_segments(out):
    names = os.listdir(out)
    assert names and all(n.endswith(".parquet") for n in names), names
    import pyarrow.parquet as pq
    return sum(pq.ParquetFile(os.path.join(out, n)).metadata.num_rows for n in names)


@pytest.mark.parametrize("sig, code, stopped", [
    (signal.SIGINT, 130, "interrupted"),     # SIGINT inherited as ignored, still ours
    (signal.SIGTERM, 143, "signal"),
    (signal.SIGHUP, 129, "signal"),
])
def test_dcp_capture_finishes_cleanly_on_signals(tmp_path, sig, code, stopped):
    model = P.server_from_options(vbuckets=4, items=300, seed=21)
    out = tmp_path / "c"
    with ThreadedServer(model, rate=300) as srv:
        p = start(["capture", f"couchbase://{srv.host}:{srv.port}/default", "-o", str(out), "--to",
                   "forever", "--quiet", "--json"], ignore_sigint=True)
        wait_for_segment(p, out)
        rc, stdout, err = finish(p, sig)
    assert rc == code, err
    summary = json.loads(stdout)
    assert summary["stopped"] == stopped and summary["signal"] == signal.Signals(sig).name
    assert only_finished_segments(out) == summary["rows"] > 300
    assert err.strip().splitlines()[-1] == ("dcptool: interrupted" if sig == signal.SIGINT
                                            else f"dcptool: stopped by {signal.Signals(sig).name}")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_synapse_capture_finishes_cleanly_on_signals(tmp_path, sig, code):
    srv = ServeSynapse("--items", "0", "--rate", "200")
    out = tmp_path / "s"
    try:
        p = start(["capture", f"synapse://{srv.address}", "-o", str(out), "--quiet", "--json"],
                  ignore_sigint=True)
        wait_for_segment(p, out)
        rc, stdout, err = finish(p, sig)
    finally:
        srv.stop()
    assert rc == code, err
    summary = json.loads(stdout)
    assert summary["stopped"] == ("interrupted" if sig == signal.SIGINT else "signal")
    assert only_finished_segments(out) == summary["rows"] == summary["lines"]


def test_dcp_stream_sigterm_prints_the_summary_and_exits_143():
    model = P.server_from_options(vbuckets=4, items=100, seed=22)
    with ThreadedServer(model, rate=300) as srv:
        p = start(["stream", f"couchbase://{srv.host}:{srv.port}/default", "--to", "forever"],
                  ignore_sigint=True)
        deadline = time.monotonic() + 30
        while b'"mutation"' not in p.stdout.readline():
            assert time.monotonic() < deadline and p.poll() is None
        rc, rest, err = finish(p, signal.SIGTERM)
    assert rc == 143, err
    assert '"close_stream"' in rest    # streams closed before exiting
    line = next(x for x in err.splitlines() if x.startswith("summary: "))
    assert "stopped=signal" in line and "signal=SIGTERM" in line


@pytest.mark.parametrize("which", ["dcp", "synapse"])
def test_servers_stop_with_exit_0(which):
    for sig in (signal.SIGINT, signal.SIGTERM):
        p = start(["serve", which, "--port", "0", "--items", "10"], ignore_sigint=True)
        try:
            line = p.stdout.readline()
            assert json.loads(line)["listening"]
            rc, _, err = finish(p, sig)
        finally:
            if p.poll() is None:
                p.kill()
        assert rc == 0, (sig, err)
