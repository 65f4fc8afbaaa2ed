"""One definition of lag (docs/CLI.md "Lag", issue 39 finding 5): per vbucket, the high seqno a
lag poll's answer names minus the seqno the vbucket's stream stood at when that answer was
read (frames in wire order), never below 0. The five places that show it must agree on one
capture: the capture's summary (`largest_lag_items`), `inspect` (`largest_lag`), the replay
`lag` table, the report's lag chart and the `dcptool_dcp_vbucket_lag_items` gauge.

The capture is stopped mid-backfill (--max-messages with a small flow-control buffer), so the
polls are answered while the streams are behind: the lag is not 0 everywhere, and a poll
answered inside a snapshot shows whether the live side counts every change (not only the
snapshot boundaries)."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dcptool.capture import parse_source
from dcptool.capture.dcp_capture import DcpCapture
from dcptool.capture.metrics import Collector
from dcptool.capture.options import CaptureSettings, LiveOptions
from dcptool.capture.run import StopSignals
from dcptool.protocol.dcp.server import producer as P
from dcptool.replay.check import report_data as D
from dcptool.replay.check.summary import summarize
from dcptool.replay.local import engine as local
from dcptool.replay.store import reader
from tests.support.cli_util import run
from tests.support.threaded_server import ThreadedServer

VBUCKETS, ITEMS = 8, 4000


def _gauges(live) -> dict[str, dict[int, float]]:
    """What a scrape of the run's --metrics endpoint serves, read from its collector."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(Collector(live))
    out: dict[str, dict[int, float]] = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            if "vbucket" in s.labels:
                out.setdefault(s.name, {})[int(s.labels["vbucket"])] = s.value
    return out


def _capture(out: str, rate: float = 300, **options) -> tuple[str, dict, dict]:
    """An in-process capture (its DcpWatch is at hand) of a bucket getting `rate` updates a
    second: (directory, summary fields, gauges)."""
    model = P.server_from_options(vbuckets=VBUCKETS, items=ITEMS, seed=11)
    with ThreadedServer(model, rate=rate) as srv:
        opts = LiveOptions(source=parse_source(f"couchbase://{srv.host}:{srv.port}/default"), user=None,
                           name="lag-agrees", to="forever", buffer_size=16 * 1024, metrics="127.0.0.1:0",
                           lag_interval=0.05, **options)
        run = DcpCapture(opts, CaptureSettings(output=out))
        with StopSignals() as signals:
            result = run.run(signals)
    assert result.error is None, result.error
    return out, result.fields, _gauges(run.watch.live)


@pytest.fixture(scope="module")
def stopped_capture(tmp_path_factory):
    return _capture(str(tmp_path_factory.mktemp("lagagree") / "caps"), max_messages=1500)


def _last_per_vbucket(rows: list[dict]) -> dict[int, dict]:
    last = {}
    for r in sorted(rows, key=lambda r: r["frame_no"]):
        last[r["vbucket"]] = r
    return last


def test_summary_inspect_table_report_and_gauge_agree(stopped_capture):
    out, fields, gauges = stopped_capture
    files = reader.find_captures([out])
    rows = local.replay_local(files).table("lag").to_pylist()
    assert len({r["frame_no"] for r in rows}) >= 2, "at least the first poll and the last one"
    # the table's largest: the first of the largest (earliest, then lowest vbucket)
    best = max(rows, key=lambda r: (r["lag_items"], -int(r["ts"].value), -r["vbucket"]))
    assert best["lag_items"] > 0, "stopped mid-backfill: behind the server"
    # 1. the capture's summary
    assert (fields["largest_lag_items"], fields["largest_lag_vbucket"]) == (best["lag_items"], best["vbucket"])
    # 2. inspect
    largest = summarize([out])["largest_lag"]
    assert (largest["lag_items"], largest["vbucket"]) == (best["lag_items"], best["vbucket"])
    # 3. the gauge: each vbucket's last poll, high seqno and lag alike
    last = _last_per_vbucket(rows)
    assert sorted(last) == list(range(VBUCKETS))
    assert gauges["dcptool_dcp_vbucket_lag_items"] == {vb: float(r["lag_items"]) for vb, r in last.items()}
    assert gauges["dcptool_dcp_vbucket_high_seqno"] == {vb: float(r["high_seqno"]) for vb, r in last.items()}
    # 4. the report: per node and time bin, the highest lag_items of the table's rows in the bin
    d = D.collect(files)
    assert d.lag is not None and len(d.lag) == 1
    (x, v), = d.lag.values()
    ts = np.array([int(r["ts"].value) for r in rows], np.int64)
    bins = np.clip((ts - d.t0_ns) // d.width_ns, 0, len(d.bins) - 1)
    want: dict[int, int] = {}
    for b, r in zip(bins.tolist(), rows):
        want[b] = max(want.get(b, -1), r["lag_items"])
    assert dict(zip(((x - d.t0_ns) // d.width_ns).tolist(), v.tolist())) == want
    assert int(v.max()) == best["lag_items"]


def test_from_now_has_no_lag_before_a_streams_first_change(tmp_path):
    """`--from now` asks each stream from the latest (flag 0x40) with start seqno 0: where it
    starts is not known before its first change, so a poll before that has no lag for the
    vbucket (it used to be its whole high seqno), in the table and live alike. A quiet bucket:
    no change comes, so no lag at all; a busy one: the five agree."""
    out, fields, gauges = _capture(str(tmp_path / "quiet"), rate=0, from_="now", duration=1.0)
    files = reader.find_captures([out])
    polls = [r for r in local.replay_local(files).table("frames").to_pylist()
             if r["op"] == "get_all_vb_seqnos" and r["direction"] == "in"]
    assert len(polls) >= 2, "the set-up answer and at least one poll"
    assert local.replay_local(files).table("lag").num_rows == 0
    assert "largest_lag_items" not in fields and not gauges.get("dcptool_dcp_vbucket_lag_items")
    assert summarize([out])["largest_lag"] is None
    shown = run("inspect", out, "--format", "table")
    assert shown.returncode == 0 and "largest lag: none recorded" in shown.stdout, shown.stderr
    out, fields, gauges = _capture(str(tmp_path / "busy"), from_="now", duration=1.0)
    rows = local.replay_local(reader.find_captures([out])).table("lag").to_pylist()
    assert rows and all(r["seqno"] > 0 for r in rows)
    last = _last_per_vbucket(rows)
    assert gauges.get("dcptool_dcp_vbucket_lag_items", {}) == {vb: float(r["lag_items"]) for vb, r in last.items()}
    best = max(rows, key=lambda r: (r["lag_items"], -int(r["ts"].value), -r["vbucket"]))
    assert fields["largest_lag_items"] == best["lag_items"]
    # among vbuckets tied at the largest lag (all 0 on a busy host that keeps up) either may be named
    assert fields["largest_lag_vbucket"] in {r["vbucket"] for r in rows if r["lag_items"] == best["lag_items"]}
