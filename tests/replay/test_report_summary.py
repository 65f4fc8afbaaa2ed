"""`dcptool report` summarises (issue 39 finding 7): a summary strip at the top (the verify verdict,
documents, mutations / deletions / expirations, rollbacks and documents undone, unserved vbuckets,
the backfill; Synapse: rows, streams x instances, caught-up rows, gaps), the backfill apart from
the live phase and the time charts on a log scale (a first-second spike does not flatten the
steady state), operations over time, empty charts as one line, Synapse per stream and instance.
Every number is checked against the replay's tables or a walk of the frames."""

from __future__ import annotations

import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dcptool.protocol.dcp.server import producer as P
from dcptool.replay.check import report as R
from dcptool.replay.check import report_data as D
from dcptool.replay.check import report_html as H
from dcptool.replay.local import engine as local
from dcptool.replay.store import reader
from tests.support import capgen
from tests.support.cli_util import capture_files
from tests.support.threaded_server import ThreadedServer

CHANGES = ("mutation", "deletion", "expiration", "commit")


@pytest.fixture(scope="module")
def live_capture(tmp_path_factory):
    """A backfill of 3,000 documents, then live updates (the built-in producer's --rate: updates,
    new documents, deletions, expirations) for 3 s; its report page."""
    base = tmp_path_factory.mktemp("live")
    model = P.server_from_options(vbuckets=8, items=3000, seed=12)
    with ThreadedServer(model, rate=400) as srv:
        files = capture_files(f"couchbase://{srv.host}:{srv.port}/default", base / "caps", "--to", "forever",
                              "--duration", "3s", "--lag-interval", "1s")
    out = str(base / "r.html")
    d = R.report([str(base / "caps")], out)
    return files, d, open(out, encoding="utf-8").read()


def _walk(files) -> tuple[dict, dict, int]:
    """(changes by op, live changes by op, backfill items), the slow way: each vbucket's last
    snapshot marker says whether a change is in a disk snapshot (the backfill)."""
    frames = local.replay_local(files).table("frames").select(["frame_no", "direction", "op", "vbucket", "snap_flags"])
    disk: dict[int, bool] = {}
    total: dict[str, int] = {}
    live: dict[str, int] = {}
    backfill = 0
    for f in sorted(frames.to_pylist(), key=lambda f: f["frame_no"]):
        if f["direction"] != "in" or f["vbucket"] is None:
            continue
        if f["op"] == "snapshot_marker":
            disk[f["vbucket"]] = bool((f["snap_flags"] or 0) & 0x02)
        elif f["op"] in CHANGES:
            total[f["op"]] = total.get(f["op"], 0) + 1
            if disk.get(f["vbucket"], False):
                backfill += 1
            else:
                live[f["op"]] = live.get(f["op"], 0) + 1
    return total, live, backfill


def test_backfill_apart_from_the_live_phase(live_capture):
    files, d, _ = live_capture
    total, live, backfill = _walk(files)
    assert backfill == d.backfill["items"] >= 3000          # every document once, in disk snapshots
    assert d.op_totals == total
    assert {op: int(v.sum()) for op, v in d.ops.items() if v.sum()} == live
    assert live.get("mutation", 0) > 0 and live.get("deletion", 0) > 0, "live updates came"
    assert int(d.backfill["per_bin"].sum()) == backfill
    # the backfill's bins end before the live phase's last bins: a phase of its own
    last_backfill_bin = int(np.flatnonzero(d.backfill["per_bin"])[-1])
    assert any(v[last_backfill_bin + 1:].sum() for v in d.ops.values())


def test_time_charts_use_a_log_scale_and_mark_the_backfill(live_capture):
    _, d, _ = live_capture
    rate, ops = R.figures(d)[:2]
    assert rate.layout.yaxis.type == "log" and rate.layout.yaxis2.type == "log"
    assert any(a.text == "backfill" for a in rate.layout.annotations)
    assert ops.layout.yaxis.type == "log" and ops.layout.title.text.startswith(R.TITLES["ops_dcp"])
    assert {t.name.split(" (")[0] for t in ops.data} == {op for op, v in d.ops.items() if v.sum()}


def _cards(page: str) -> dict[str, tuple[str, str]]:
    """label -> (value, note) of the summary strip's cards."""
    return {k: (v, n) for k, v, n in re.findall(
        r"<div class='k'>([^<]*)</div><div class='v'>([^<]*)</div><div class='n'>([^<]*)</div>", page)}


def test_summary_strip_at_the_top_with_the_tables_numbers(live_capture):
    files, d, page = live_capture
    strip_at = page.index("<div class='strip'")
    assert strip_at < page.index("class='fig'") and strip_at < page.index(H.FINDINGS_TITLE)
    cards = _cards(page)
    rep = local.replay_local(files)
    states = dict(zip(*[c.to_pylist() for c in pc.value_counts(rep.table("documents").column("state")).flatten()]))
    assert cards["documents"][0] == f"{states.get('live', 0):,}"
    assert cards["documents"][1] == f"{states.get('deleted', 0):,} deleted, {states.get('expired', 0):,} expired"
    total, _, backfill = _walk(files)
    assert cards["mutations / deletions / expirations"][0] == \
        f"{total.get('mutation', 0):,} / {total.get('deletion', 0):,} / {total.get('expiration', 0):,}"
    assert cards["rollbacks"] == ("0", "0 documents undone") and cards["unserved vbuckets"][0] == "0"
    assert cards["backfill"][0] == f"{backfill:,} items"
    assert cards["verify"][0] == "clean"
    lag = rep.table("lag")
    assert cards["largest lag"][0] == f"{pc.max(lag.column('lag_items')).as_py():,} items"


def test_rollbacks_and_documents_undone(failover_capture, tmp_path):
    _, files = failover_capture
    out = str(tmp_path / "f.html")
    R.report([os.path.dirname(files[0].path)], out, verify=False)
    cards = _cards(open(out, encoding="utf-8").read())
    rb = local.replay_local(files).table("rollbacks")
    assert rb.num_rows > 0
    assert cards["rollbacks"] == (f"{rb.num_rows:,}", f"{pc.sum(rb.column('undone')).as_py():,} documents undone")
    assert cards["verify"] == ("not run", "--no-verify")


def test_empty_charts_are_one_line(live_capture):
    _, d, page = live_capture
    # no rollback, failover or reconnect: one line, no chart of that title
    marks = R.TITLES["marks"]
    assert f"<p class='empty'><b>{marks}</b>: none</p>" in page
    assert all(not f.layout.title.text.startswith(marks) for f in R.figures(d))
    # lag: the lag chart is drawn when some poll was behind, one line when none was
    assert d.lag
    behind = D.ReportData(**{**d.__dict__, "lag": {n: (x, v + 5) for n, (x, v) in d.lag.items()}})
    assert any(f.layout.title.text == R.TITLES["lag"] for f in R.figures(behind))
    d0 = D.ReportData(**{**d.__dict__, "lag": {n: (x, np.zeros_like(v)) for n, (x, v) in d.lag.items()}})
    assert not any(f.layout.title.text == R.TITLES["lag"] for f in R.figures(d0))
    assert f"<b>{R.TITLES['lag']}</b>: 0 items at every poll: never behind" in R.page(d0, None, ["caps"])


def test_unserved_vbuckets_are_those_every_stream_request_of_was_refused(tmp_path):
    """A capture whose every stream request for vbucket 63 was answered NOT_MY_VBUCKET."""
    caps = capgen.generate("dcp", 5, 300)
    fixed = []
    for meta, t in caps:
        op = t.column("op").cast(pa.string())
        mine = pc.and_(pc.and_(pc.equal(op, "stream_req"), pc.equal(t.column("direction"), "in")),
                       pc.equal(t.column("vbucket"), 63)).fill_null(False)
        i = t.column_names.index("status")
        status = pc.if_else(mine, pa.scalar(0x07, t.schema.field("status").type), t.column("status"))
        fixed.append((meta, t.set_column(i, t.schema.field("status"), status)))
    capgen.write_captures(fixed, str(tmp_path / "caps"), seed=5)
    d = D.collect(reader.find_captures([str(tmp_path / "caps")]))
    assert d.unserved == [63]
    cards = _cards(R.page(d, None, ["caps"]))
    assert cards["unserved vbuckets"] == ("1", "63")


def test_synapse_per_stream_and_instance(tmp_path):
    out = tmp_path / "syn"
    capgen.write_captures(capgen.generate("synapse", 31, 500), str(out), seed=31)
    files = reader.find_captures([str(out)])
    d = D.collect(files)
    rep = local.replay_local(files)
    pos = rep.table("positions").to_pylist()
    page = R.page(d, None, [str(out)])
    table = page[page.index(f"<h2>{H.STREAMS_TITLE}</h2>"):]
    for r in pos:        # one table row per stream and instance, with its token and rows
        assert f"<td>{r['stream']}</td><td>{r['instance']}</td><td>{r['token']:,}</td><td>{r['rows']:,}</td>" in table
    cards = _cards(page)
    gaps = rep.table("gaps")
    assert cards["streams x instances"][0] == str(len(pos))
    assert cards["gaps"][0] == f"{gaps.num_rows:,}"
    assert cards["caught up"][0] == f"{d.caught_up:,} rows"
    cmds = reader.read_capture_table(files, ["direction", "command"])
    rdata = pc.sum(pc.and_(pc.equal(cmds.column("command").cast(pa.string()), "RDATA"),
                           pc.equal(cmds.column("direction"), "in")).cast(pa.int64())).as_py()
    assert cards["RDATA rows"][0] == f"{rdata:,}" and int(d.ops["RDATA"].sum()) == rdata
    assert R.TITLES["ops_synapse"] in page
