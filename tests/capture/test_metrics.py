"""`--metrics HOST:PORT` (capture/metrics.py): the text format (types, `_total`, labels),
counters that only grow, the address checks (a port in use is exit 2 with one line, before
anything connects), and a real Prometheus scraping a running capture."""

from __future__ import annotations

import re
import socket
import subprocess
import threading

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dcptool.capture.metrics import Collector, LiveMetrics, MetricsServer, parse_listen
from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.errors import LateUsageError
from tests.support.cli_util import error_line, run
from tests.support.paths import DCPTOOL
from tests.support.processes import interrupt_then_stop
from tests.support.prometheus import Prometheus
from tests.support.threaded_server import ThreadedServer


def _families(live: LiveMetrics) -> dict:
    from prometheus_client import CollectorRegistry
    reg = CollectorRegistry(auto_describe=False)
    reg.register(Collector(live))
    return {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}


def _samples(fam) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples}


def _dcp_live() -> LiveMetrics:
    live = LiveMetrics("dcp")
    ops = np.array([0x57, 0x57, 0x56, 0x48], dtype=np.uint8)   # mutation x2, snapshot marker, get_all_vb_seqnos
    live.count_batch(ops, np.array([100, 120, 44, 104]))
    live.seqnos = lambda: {0: 10, 3: 7}
    live.high_seqnos.update({0: 12, 3: 7})
    live.lags.update({0: 2, 3: 0})
    live.rollbacks = 1
    live.segments = lambda: 4
    live.queue_depth = lambda: 3
    live.unserved = lambda: 2
    return live


def test_text_format_types_names_and_labels():
    fams = _families(_dcp_live())
    counters = {n for n, f in fams.items() if f.type == "counter"}
    gauges = {n for n, f in fams.items() if f.type == "gauge"}
    assert counters == {"dcptool_received_frames", "dcptool_received_bytes", "dcptool_reconnects",
                        "dcptool_segments_written", "dcptool_rollbacks"}
    assert gauges == {"dcptool_writer_queue_depth", "dcptool_dcp_vbucket_seqno", "dcptool_dcp_vbucket_high_seqno",
                      "dcptool_dcp_vbucket_lag_items", "dcptool_unserved_vbuckets"}
    # every counter sample ends in _total; no gauge sample does
    for n in counters:
        assert all(s.name == n + "_total" for s in fams[n].samples), n
    frames = _samples(fams["dcptool_received_frames"])
    assert frames == {("dcptool_received_frames_total", (("op", "mutation"),)): 2.0,
                      ("dcptool_received_frames_total", (("op", "snapshot_marker"),)): 1.0,
                      ("dcptool_received_frames_total", (("op", "get_all_vb_seqnos"),)): 1.0}
    assert _samples(fams["dcptool_received_bytes"])[("dcptool_received_bytes_total", (("op", "mutation"),))] == 220
    assert _samples(fams["dcptool_dcp_vbucket_lag_items"]) == {
        ("dcptool_dcp_vbucket_lag_items", (("vbucket", "0"),)): 2.0,
        ("dcptool_dcp_vbucket_lag_items", (("vbucket", "3"),)): 0.0}
    assert _samples(fams["dcptool_dcp_vbucket_seqno"])[("dcptool_dcp_vbucket_seqno", (("vbucket", "0"),))] == 10
    assert fams["dcptool_segments_written"].samples[0].value == 4
    assert fams["dcptool_writer_queue_depth"].samples[0].value == 3
    assert fams["dcptool_unserved_vbuckets"].samples[0].value == 2


def test_counters_only_grow_and_synapse_families():
    live = _dcp_live()
    before = _samples(_families(live)["dcptool_received_frames"])
    live.count_batch(np.array([0x57], dtype=np.uint8), np.array([90]))
    after = _samples(_families(live)["dcptool_received_frames"])
    assert all(after[k] >= v for k, v in before.items()) and after != before
    syn = LiveMetrics("synapse")
    syn.count_lines("RDATA", 3, 300)
    syn.positions = lambda: {("events", "master"): 42}
    syn.gaps = 1
    fams = _families(syn)
    assert fams["dcptool_synapse_gaps"].type == "counter"
    assert _samples(fams["dcptool_synapse_stream_position"]) == {
        ("dcptool_synapse_stream_position", (("instance", "master"), ("stream", "events"))): 42.0}
    assert _samples(fams["dcptool_received_frames"]) == {("dcptool_received_frames_total", (("op", "rdata"),)): 3.0}
    assert "dcptool_dcp_vbucket_lag_items" not in fams


@pytest.mark.parametrize("text", ["9100", "host", "127.0.0.1:x", "127.0.0.1:70000", ":9100"])
def test_bad_listen_addresses(text):
    with pytest.raises(LateUsageError):
        parse_listen(text)


def test_binds_where_told_only():
    srv = MetricsServer("127.0.0.1:0", LiveMetrics("dcp"))
    try:
        assert srv.httpd.server_address[0] == "127.0.0.1" and srv.url.startswith("http://127.0.0.1:")
    finally:
        srv.close()


@pytest.mark.parametrize("command,source", [("capture", "couchbase"), ("stream", "synapse")])
def test_port_in_use_is_exit_2(tmp_path, command, source):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        url = ("couchbase://127.0.0.1:1/default" if source == "couchbase" else "synapse://127.0.0.1:1")
        args = [command, url, "--metrics", f"127.0.0.1:{port}"] + (["-o", str(tmp_path / "c")]
                                                                     if command == "capture" else [])
        res = run(*args, timeout=60)
    assert res.returncode == 2, res.stderr
    assert re.search(rf"--metrics 127\.0\.0\.1:{port}: .*address already in use", error_line(res))
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").iterdir())


def _metrics_url(proc: subprocess.Popen) -> str:
    """The `metrics: URL` line of a capture's stderr (read on a thread, bounded)."""
    found: list[str] = []
    done = threading.Event()

    def read():
        for line in proc.stderr:
            if line.startswith("metrics: "):
                found.append(line.split()[1])
                done.set()
        done.set()
    threading.Thread(target=read, daemon=True).start()
    assert done.wait(60) and found, "no metrics line"
    return found[0]


def test_real_prometheus_scrapes_the_lag(tmp_path):
    model = P.server_from_options(vbuckets=8, items=500, seed=3)
    with ThreadedServer(model, rate=200) as srv:
        proc = subprocess.Popen([DCPTOOL, "capture", f"couchbase://{srv.host}:{srv.port}/default", "--to", "forever",
                                 "-o", str(tmp_path / "caps"), "--quiet", "--metrics", "127.0.0.1:0",
                                 "--lag-interval", "1s"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        prom = None
        try:
            url = _metrics_url(proc)
            prom = Prometheus(url.split("/")[2], tmp_path).start()
            lag = prom.wait_for("dcptool_dcp_vbucket_lag_items")
            assert {r["metric"]["vbucket"] for r in lag} == {str(vb) for vb in range(8)}
            assert all(r["metric"]["job"] == "dcptool" for r in lag)
            meta = prom.api("metadata")
            kinds = {name: entries[0]["type"] for name, entries in meta.items()}
            assert "counter" in {kinds.get("dcptool_received_frames"), kinds.get("dcptool_received_frames_total")}
            assert kinds.get("dcptool_dcp_vbucket_lag_items") == "gauge"
            frames = prom.wait_for('dcptool_received_frames_total{op="mutation"}')
            assert float(frames[0]["value"][1]) > 0
        finally:
            if prom is not None:
                prom.stop()
            interrupt_then_stop(proc)
    assert proc.returncode == 130
