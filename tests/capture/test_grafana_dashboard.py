"""docs/grafana-dashboard.json (issue 39): every panel's query returns data when run against a
real Prometheus scraping a capture's --metrics (the queries are tested, not Grafana). Two short
captures run side by side, a DCP one (the built-in producer with live updates) and a Synapse
one (`serve synapse`), scraped every second by a Prometheus of the test's own (temp config and
data dir, a free loopback port, stopped at the end). Grafana's variables are given what
Grafana would: `$job` the "All" value, `$__rate_interval` a window of several scrapes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time

from dcptool.protocol.dcp.server import producer as P
from tests.support.paths import DCPTOOL
from tests.support.processes import stop_process
from tests.support.prometheus import Prometheus
from tests.support.synapse_serve import ServeSynapse
from tests.support.threaded_server import ThreadedServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(ROOT, "docs", "grafana-dashboard.json")
VARIABLES = {"$__rate_interval": "10s", "$job": ".*"}
BOUND = 90.0     # seconds for every query to have data (scrapes every second; a loaded machine)


def _panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.extend(p.get("panels", []) if p["type"] == "row" else [p])
    return out


def _queries(dash: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL with the variables given) of every panel's targets."""
    out = []
    for p in _panels(dash):
        for t in p["targets"]:
            expr = t["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            out.append((p["title"], expr))
    return out


def test_the_dashboard_is_well_formed():
    dash = json.load(open(DASHBOARD, encoding="utf-8"))
    panels = _panels(dash)
    assert panels and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "job"} <= names
    for p in panels:
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        for t in p["targets"]:      # every variable a query uses is one Grafana or the dashboard defines
            for var in re.findall(r"\$\{?(\w+)", t["expr"]):
                assert var in names or var.startswith("__"), (p["title"], var)
    # every metric --metrics serves is on some panel (docs/CLI.md "What is served")
    exprs = " ".join(e for _, e in _queries(dash))
    for metric in ("dcptool_received_frames_total", "dcptool_received_bytes_total", "dcptool_reconnects_total",
                   "dcptool_segments_written_total", "dcptool_writer_queue_depth", "dcptool_dcp_vbucket_seqno",
                   "dcptool_dcp_vbucket_high_seqno", "dcptool_dcp_vbucket_lag_items", "dcptool_rollbacks_total",
                   "dcptool_unserved_vbuckets", "dcptool_synapse_stream_position", "dcptool_synapse_gaps_total"):
        assert metric in exprs, metric


def _metrics_address(proc: subprocess.Popen) -> str:
    """HOST:PORT of the `metrics: URL` line of a run's stderr (read on a thread, bounded)."""
    found: list[str] = []
    done = threading.Event()

    def read():
        for line in proc.stderr:
            if line.startswith("metrics: ") and not found:
                found.append(line.split()[1].split("/")[2])
                done.set()
        done.set()
    threading.Thread(target=read, daemon=True).start()
    assert done.wait(60) and found, "no metrics line"
    return found[0]


def _capture(source: str, out) -> subprocess.Popen:
    return subprocess.Popen([DCPTOOL, "capture", source, "-o", str(out), "--quiet", "--metrics", "127.0.0.1:0",
                             *(["--to", "forever", "--lag-interval", "1s"] if source.startswith("couchbase") else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    finally:
        stop_process(proc)


def test_every_panel_query_returns_data_from_a_real_prometheus(tmp_path):
    dash = json.load(open(DASHBOARD, encoding="utf-8"))
    queries = _queries(dash)
    model = P.server_from_options(vbuckets=16, items=1000, seed=4)
    with ThreadedServer(model, rate=200) as srv, ServeSynapse("--items", "0", "--rate", "100") as syn:
        runs = [_capture(f"couchbase://{srv.host}:{srv.port}/default", tmp_path / "dcp"),
                _capture(f"synapse://{syn.address}", tmp_path / "syn")]
        prom = None
        try:
            prom = Prometheus([_metrics_address(p) for p in runs], tmp_path).start()
            deadline = time.monotonic() + BOUND
            empty = list(queries)
            while empty and time.monotonic() < deadline:
                empty = [(title, q) for title, q in empty if not prom.api("query", query=q)["result"]]
                if empty:
                    time.sleep(0.5)
            assert not empty, f"queries without data after {BOUND:g} s: {empty}"
            assert all(p.poll() is None for p in runs), "a capture ended early"
        finally:
            if prom is not None:
                prom.stop()
            for p in runs:
                _stop(p)
