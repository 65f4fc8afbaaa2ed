"""`dcptool verify`: captures broken on purpose are caught with the right check and place
(dropped rows, a resumed stream with a gap, a forged rollback, a missing segment, a Synapse
token out of order, a damaged Parquet file, unreadable input), and real captures are clean:
seeded clean runs, the built-in producer with a failover, captures killed and resumed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dcptool.cli import cli
from dcptool.replay.check import findings as verify_findings
from dcptool.replay.check import verify as V
from tests.support import capgen
from tests.support.capture_rows import UUID_A, UUID_B, Run, checks, write
from tests.support.live_capture import data_on_disk, served, stop_live_updates
from tests.support.paths import DCPTOOL
from tests.support.synapse_serve import ServeSynapse


def run_cli(*args):
    return CliRunner().invoke(cli, ["verify", *args])


# ----------------------------------------------------------------------------- clean input

@pytest.mark.parametrize("seed", [1, 2, 3])
def test_clean_runs_have_no_findings_and_exit_0(tmp_path, seed):
    rows = Run(seed).clean().rows
    write(rows, tmp_path / "c", cuts=(len(rows) // 3, 2 * len(rows) // 3))
    report = V.verify([str(tmp_path / "c")])
    assert report.findings == [] and report.rows == len(rows) and report.captures == 1
    res = run_cli(str(tmp_path / "c"), "--format", "jsonl")
    assert res.exit_code == 0, res.output
    assert res.stdout == ""


def test_capgen_captures_have_sound_files_and_only_the_irregularities_capgen_makes(tmp_path):
    # capgen writes replay fodder with deliberate protocol oddities (overlapping markers,
    # repeated seqnos in history snapshots, rollbacks it ignores, fresh uuids, captures cut in
    # the middle of a connection, decode errors, POSITION gaps, reconnects that drop batches);
    # verify must find nothing wrong with the files and nothing outside those
    allowed = {"dcp.decode_error", "dcp.marker_bad_range", "dcp.marker_overlap", "dcp.forged_rollback",
               "dcp.seqno_not_increasing", "dcp.item_outside_snapshot", "dcp.unknown_vbucket_uuid",
               "dcp.resume_gap", "dcp.frame_without_stream", "dcp.snapshot_incomplete",
               "synapse.decode_error", "synapse.position_gap", "synapse.batch_dropped"}
    for proto in ("dcp", "synapse"):
        for seed in range(6):
            d = tmp_path / f"{proto}{seed}"
            capgen.write_captures(capgen.generate(proto, seed, 200), str(d), seed=seed,
                                  in_progress_last=seed == 5)
            report = V.verify([str(d)])
            got = set(report.counts)
            assert got <= allowed | {"file.in_progress"}, (proto, seed, got - allowed)
            assert ("file.in_progress" in got) == (seed == 5)


# ----------------------------------------------------------------------------- broken on purpose

def test_dropped_rows_are_found_with_their_frame_range(tmp_path):
    rows = Run(4).clean().rows
    paths = write(rows, tmp_path / "c", cuts=(60,))
    t = pq.read_table(paths[0])
    kept = t.filter(pa.compute.invert(pa.compute.is_in(t.column("frame_no"), pa.array(range(20, 25)))))
    pq.write_table(kept, paths[0], compression="zstd")
    report = V.verify([str(tmp_path / "c")])
    f = report.findings[0]
    assert (f.check, f.frame_no, f.segment, f.file) == ("file.frames_missing", 20, 0, paths[0])
    assert "20..24" in f.message
    res = run_cli(str(tmp_path / "c"), "--format", "jsonl")
    assert res.exit_code == 6
    first = json.loads(res.stdout.splitlines()[0])
    assert first["check"] == "file.frames_missing" and first["severity"] == "error"
    assert set(first) == set(verify_findings.FINDING_COLUMNS)


def test_resumed_stream_with_a_gap(tmp_path):
    r = Run(5, vbuckets=(7,))
    r.request(7)
    r.snapshot(7, 4)
    r.conn += 1
    r.request(7, start=9, snap=(9, 9))          # last received was 4: 5..9 never arrived
    r.last[7] = 9
    r.snapshot(7, 2)
    write(r.rows, tmp_path / "c")
    report = V.verify([str(tmp_path / "c")])
    assert checks(report) == ["dcp.resume_gap"]
    f = report.findings[0]
    assert (f.vbucket, f.seqno, f.frame_no) == (7, 9, 7)
    assert "5..9" in f.message


def test_resume_across_captures_must_start_at_the_last_seqno(tmp_path):
    r = Run(6, vbuckets=(3,))
    r.request(3)
    r.snapshot(3, 5)
    write(r.rows, tmp_path / "c", cid="c0ffee00-0000-4000-8000-00000000000a")
    r2 = Run(6, vbuckets=(3,))
    r2.request(3, start=5)
    r2.last[3] = 5
    r2.snapshot(3, 3)            # a second capture resuming correctly from 5
    write(r2.rows, tmp_path / "c", cid="c0ffee00-0000-4000-8000-00000000000b",
          name_started="2025-11-22T02:00:00.000000Z")
    assert V.verify([str(tmp_path / "c")]).findings == []
    r3 = Run(6, vbuckets=(3,))
    r3.request(3, start=2)       # a third that rewinds: 3..5 come again
    write(r3.rows, tmp_path / "c", cid="c0ffee00-0000-4000-8000-00000000000c",
          name_started="2025-11-22T03:00:00.000000Z")
    report = V.verify([str(tmp_path / "c")])
    assert checks(report) == ["dcp.resume_rewind"]
    assert report.findings[0].capture_id.endswith("0c")


def test_forged_rollback_above_the_request_and_outside_the_failover_log(tmp_path):
    r = Run(7, vbuckets=(1,))
    r.log[1] = [(UUID_B, 10), (UUID_A, 0)]
    r.request(1)
    r.snapshot(1, 20)
    r.conn += 1
    r.request(1, answer="rollback", rollback_to=25)        # above the requested start 20
    r.last[1] = 20
    r.request(1, uuid=UUID_A, answer="rollback", rollback_to=15)   # A's history ended at 10
    write(r.rows, tmp_path / "c")
    report = V.verify([str(tmp_path / "c")])
    assert checks(report) == ["dcp.forged_rollback", "dcp.unknown_vbucket_uuid", "dcp.forged_rollback"] or \
        checks(report) == ["dcp.forged_rollback", "dcp.forged_rollback"]
    forged = [f for f in report.findings if f.check == "dcp.forged_rollback"]
    assert [f.seqno for f in forged] == [25, 15] and forged[0].vbucket == 1
    assert "above the requested start seqno 20" in forged[0].message
    assert "ended" in forged[1].message


def test_request_with_a_uuid_not_in_the_failover_log(tmp_path):
    r = Run(8, vbuckets=(2,))
    r.request(2)
    r.snapshot(2, 3)
    r.conn += 1
    r.request(2, uuid=0xDEAD)
    write(r.rows, tmp_path / "c")
    assert checks(V.verify([str(tmp_path / "c")])) == ["dcp.unknown_vbucket_uuid"]


def test_snapshot_and_stream_rules(tmp_path):
    r = Run(9, vbuckets=(0,))
    r.request(0)
    r.snapshot(0, 3)
    r.add("in", op="mutation", vbucket=0, by_seqno=3, key=b"again")           # not increasing
    r.add("in", op="snapshot_marker", vbucket=0, snap_start=3, snap_end=8)    # overlaps [1, 3]
    r.add("in", op="mutation", vbucket=0, by_seqno=9, key=b"out")             # outside [3, 8]
    r.add("in", op="stream_end", vbucket=0, stream_end_reason=77)
    r.add("in", op="mutation", vbucket=0, by_seqno=10, key=b"late")           # stream ended
    write(r.rows, tmp_path / "c")
    assert checks(V.verify([str(tmp_path / "c")])) == [
        "dcp.seqno_not_increasing", "dcp.marker_overlap", "dcp.item_outside_snapshot",
        "dcp.stream_end_unknown_reason", "dcp.frame_without_stream"]


def test_missing_segment(tmp_path):
    rows = Run(10).clean().rows
    paths = write(rows, tmp_path / "c", cuts=(30, 60, 90))
    os.remove(paths[1])
    report = V.verify([str(tmp_path / "c")])
    assert checks(report) == ["file.segment_missing"]
    f = report.findings[0]
    assert f.segment == 2 and f.file == paths[2] and "segment 1 " in f.message


def test_name_and_capture_id_consistency(tmp_path):
    rows = Run(11).clean().rows
    paths = write(rows, tmp_path / "c")
    bad = paths[0].replace("-c0ffee00-", "-deadbeef-")
    os.rename(paths[0], bad)
    assert checks(V.verify([str(tmp_path / "c")])) == ["file.name_mismatch"]


def test_damaged_parquet_is_the_first_finding_and_the_rest_is_verified(tmp_path):
    r = Run(12, vbuckets=(0,))
    r.request(0)
    for _ in range(20):
        r.snapshot(0, 5)
    r.conn += 1
    r.request(0, start=r.last[0] + 3)       # a gap after the damaged part: still found
    r.last[0] += 3
    r.snapshot(0, 2)
    r.last[0] += 3
    r.snapshot(0, 2)
    paths = write(r.rows, tmp_path / "c", row_group_size=20, write_page_checksum=True)
    md = pq.ParquetFile(paths[0]).metadata
    col = md.schema.to_arrow_schema().get_field_index("by_seqno")
    at = md.row_group(2).column(col).data_page_offset + 30
    data = bytearray(open(paths[0], "rb").read())
    for i in range(at, at + 8):
        data[i] ^= 0xFF
    open(paths[0], "wb").write(bytes(data))
    report = V.verify([str(tmp_path / "c")])
    assert report.findings[0].check == "file.damaged"
    assert report.findings[0].file == paths[0] and "row group 2" in report.findings[0].message
    assert "dcp.resume_gap" in checks(report)
    assert report.rows == len(r.rows) - 20
    res = run_cli(str(tmp_path / "c"), "--format", "jsonl")
    assert res.exit_code == 6 and json.loads(res.stdout.splitlines()[0])["check"] == "file.damaged"


def test_unreadable_only_input_exits_1(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / "dcp-20251122T010203.000000Z-c0ffee00-000000.parquet").write_bytes(b"not parquet at all")
    report = V.verify([str(d)])
    assert not report.readable and checks(report) == ["file.unreadable"]
    res = run_cli(str(d), "--format", "jsonl")
    assert res.exit_code == 1
    assert json.loads(res.stdout.splitlines()[0])["check"] == "file.unreadable"
    assert "nothing could be read" in res.stderr and "Traceback" not in res.stderr
    res = run_cli(str(tmp_path / "nope"))
    assert res.exit_code == 1 and "no such file" in res.stderr


def test_synapse_token_out_of_order_and_position_gap(tmp_path):
    rows = []

    def add(command, **cols):
        rows.append(dict(conn=1, ts=capgen.BASE_TS + len(rows), mono_ns=len(rows), direction="in",
                         command=command, raw=command.encode(), **cols))
    add("POSITION", stream="events", instance="master", prev_token=10, new_token=10)
    add("RDATA", stream="events", instance="master", batch=True, row="{}")
    add("RDATA", stream="events", instance="master", token=12, batch=False, row="{}")
    add("RDATA", stream="events", instance="master", token=11, batch=False, row="{}")   # back
    add("POSITION", stream="events", instance="master", prev_token=15, new_token=16)    # 12..15 unseen
    add("RDATA", stream="caches", instance="w1", token=3, batch=False, row="{}")
    write(rows, tmp_path / "s", protocol="synapse")
    report = V.verify([str(tmp_path / "s")])
    assert checks(report) == ["synapse.token_out_of_order", "synapse.position_gap"]
    f = report.findings[0]
    assert (f.stream, f.instance, f.token, f.frame_no) == ("events", "master", 11, 3)
    assert report.findings[1].token == 15


def test_summary_json_and_table_output(tmp_path):
    rows = Run(13).clean().rows
    write(rows, tmp_path / "c")
    out = tmp_path / "summary.json"
    res = run_cli(str(tmp_path / "c"), "--format", "table", "--summary-json", str(out))
    assert res.exit_code == 0 and res.stdout == ""
    s = json.loads(out.read_text())
    assert s["findings"] == 0 and s["rows"] == len(rows) and s["protocol"] == "dcp"
    assert "no findings" in res.stderr


# ----------------------------------------------------------------------------- real captures

@pytest.mark.integration
def test_producer_failover_capture_and_killed_resumed_captures_are_clean(tmp_path):
    from dcptool.protocol.dcp.server import producer as P
    from tests.support.threaded_server import ThreadedServer
    model = P.server_from_options(vbuckets=16, items=4000, seed=21,
                                  scenarios=P.Scenarios(failover_at=2500, failover_loss=12))
    with ThreadedServer(model) as srv:
        res = subprocess.run([DCPTOOL, "capture", f"couchbase://{srv.host}:{srv.port}/default",
                              "-o", str(tmp_path / "a"), "--quiet"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    t = pq.read_table(str(tmp_path / "a"), columns=["op", "status"]).to_pylist()
    assert any(r["op"] == "stream_req" and r["status"] == 0x23 for r in t)   # rollbacks were checked
    report = V.verify([str(tmp_path / "a")])
    assert report.findings == [], report.findings[:3]

    model = P.server_from_options(vbuckets=8, items=4000, seed=11, checkpoint_items=50)
    rng = random.Random(20261125)
    out = tmp_path / "b"
    with ThreadedServer(model, rate=4000) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        for _ in range(3):
            before = set(os.listdir(out)) if out.exists() else set()
            resume = ["--resume"] if out.exists() else []   # the first run starts the directory
            p = subprocess.Popen([DCPTOOL, "capture", url, "-o", str(out), *resume, "--to", "forever",
                                  "--quiet", "--noop-interval", "2s"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            data_on_disk(out, before, p)   # this run has rows on disk, then the seeded kill point:
            served(model, model.stream_frames + rng.randrange(1, 2000), p)
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        killed = V.verify([str(out)])
        assert set(killed.counts) <= {"file.in_progress"}, killed.findings[:3]
        stop_live_updates(srv)   # the bucket stops changing
        res = subprocess.run([DCPTOOL, "capture", url, "-o", str(out), "--resume", "--to", "now", "--quiet"],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
    report = V.verify([str(out)])
    assert report.captures >= 4 and report.findings == [], report.findings[:3]
    res = subprocess.run([DCPTOOL, "verify", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout == "", res.stderr


@pytest.mark.integration
def test_synapse_capture_with_reconnects_and_resume_is_clean(tmp_path):
    """Two runs (the second `--resume`s the first), each dropped by the server after 100 RDATA
    lines and reconnected: both captures verify clean. 400 items leave the second run more
    than 150 messages (the first takes at most two connections' worth), so each run ends at
    --max-messages (--duration is only a bound) after at least one reconnect."""
    with ServeSynapse("--items", "400", "--drop-after", "100", "--seed", "4") as srv:
        for extra in ([], ["--resume"]):
            res = subprocess.run([DCPTOOL, "capture", f"synapse://{srv.address}", "-o", str(tmp_path / "s"),
                                  "--quiet", "--json", "--max-messages", "150", "--duration", "60s", *extra],
                                 capture_output=True, text=True, timeout=90)
            assert res.returncode == 0, res.stderr
            summary = json.loads(res.stdout)
            assert summary["stopped"] == "max-messages" and summary["connections"] >= 2, summary
    report = V.verify([str(tmp_path / "s")])
    assert report.captures == 2 and report.findings == [], report.findings[:3]
