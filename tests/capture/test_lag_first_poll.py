"""The first lag poll goes out as soon as a connection's streams are open (issue 39 finding 5),
not one --lag-interval later: a fresh capture with --metrics has the lag gauge for every vbucket
within 3 s of its start (the moment it says where its metrics are, before it connects), with
the default --lag-interval of 10 s. The endpoint is scraped on loopback until the series are
there or the 3 s have passed."""

from __future__ import annotations

import subprocess
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from dcptool.protocol.dcp.server import producer as P
from tests.support.paths import DCPTOOL
from tests.support.processes import interrupt_then_stop
from tests.support.threaded_server import ThreadedServer

VBUCKETS = 64
WINDOW = 3.0     # the bound: a behaviour, not a speed


def _metrics_line(proc: subprocess.Popen) -> tuple[str, float]:
    """(the metrics URL, when its line arrived), read from stderr on a thread (bounded)."""
    found: list[tuple[str, float]] = []
    done = threading.Event()

    def read():
        for line in proc.stderr:
            if line.startswith("metrics: ") and not found:
                found.append((line.split()[1], time.monotonic()))
                done.set()
        done.set()
    threading.Thread(target=read, daemon=True).start()
    assert done.wait(60) and found, "no metrics line"
    return found[0]


def _lag_vbuckets(url: str) -> set[int]:
    with urllib.request.urlopen(url, timeout=2) as r:
        text = r.read().decode()
    return {int(s.labels["vbucket"]) for fam in text_string_to_metric_families(text)
            if fam.name == "dcptool_dcp_vbucket_lag_items" for s in fam.samples}


def test_fresh_capture_has_the_lag_gauge_for_every_vbucket_within_3s(tmp_path):
    model = P.server_from_options(vbuckets=VBUCKETS, items=2000, seed=9)
    with ThreadedServer(model, rate=100) as srv:
        proc = subprocess.Popen([DCPTOOL, "capture", f"couchbase://{srv.host}:{srv.port}/default", "--to", "forever",
                                 "-o", str(tmp_path / "caps"), "--quiet", "--metrics", "127.0.0.1:0"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            url, started = _metrics_line(proc)
            seen: set[int] = set()
            while time.monotonic() - started < WINDOW and seen != set(range(VBUCKETS)):
                seen = _lag_vbuckets(url)
                time.sleep(0.05)
            assert seen == set(range(VBUCKETS)), f"{len(seen)} of {VBUCKETS} vbuckets within {WINDOW:g} s"
        finally:
            interrupt_then_stop(proc)
    assert proc.returncode == 130
