"""`replay --table lag` (replay/rules/lag.py) on real captures of the built-in producer:
a `--to now` capture ends at lag 0 on every vbucket; a capture stopped by --max-messages
ends with the lag of its last poll, which must be what the frames themselves say (an oracle
computed here from the `frames` table); both engines give the same table; `inspect` names
the largest lag."""

from __future__ import annotations

import json
import struct

import pyarrow as pa
import pytest

from dcptool.protocol.dcp.server import producer as P
from dcptool.replay.local import engine as local
from dcptool.replay.rules import tables as T
from tests.support.cli_util import capture_files, run
from tests.support.threaded_server import ThreadedServer

VBUCKETS, ITEMS = 8, 2000


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    """(a --to now capture, a capture stopped after 300 frames), of the same seeded bucket."""
    base = tmp_path_factory.mktemp("lag")
    model = P.server_from_options(vbuckets=VBUCKETS, items=ITEMS, seed=5)
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        done = capture_files(url, base / "done")
        cut = capture_files(url, base / "cut", "--max-messages", "300", "--buffer-size", "64KiB")
        streamed = run("stream", url, "--json")
    assert streamed.returncode == 0, streamed.stderr
    (base / "stream.json").write_text(streamed.stdout)
    return base, done, cut


def _oracle(frames: pa.Table) -> list[dict]:
    """The lag rows, the slow way: walk the frames in order, remember each vbucket's last
    seqno (change or stream request start), read each answered active-state poll."""
    rows, last, asked = [], {}, set()
    for f in frames.to_pylist():
        conv = (f["conn"], f["opaque"])
        if f["opcode"] == 0x48:
            raw = f["raw"]
            if f["direction"] == "out" and raw[4] == 4 and raw[24:28] == b"\0\0\0\1":
                asked.add(conv)
            elif f["direction"] == "in" and f["status"] == 0 and conv in asked:
                asked.discard(conv)
                for vb, high in struct.iter_unpack(">HQ", raw[24:]):
                    if vb in last:
                        rows.append(dict(vbucket=vb, high_seqno=high, seqno=last[vb],
                                         lag_items=max(0, high - last[vb]), frame_no=f["frame_no"]))
        elif f["direction"] == "in" and f["magic"] == 0x80 and f["by_seqno"] is not None and f["vbucket"] is not None:
            last[f["vbucket"]] = f["by_seqno"]
        elif f["direction"] == "out" and f["op"] == "stream_req" and f["req_start_seqno"] is not None:
            last[f["vbucket"]] = f["req_start_seqno"]
    return sorted(rows, key=lambda r: (r["frame_no"], r["vbucket"]))


def _rows(table: pa.Table) -> list[dict]:
    return sorted(({k: r[k] for k in ("vbucket", "high_seqno", "seqno", "lag_items", "frame_no")}
                   for r in table.to_pylist()), key=lambda r: (r["frame_no"], r["vbucket"]))


def test_to_now_capture_ends_at_lag_zero(captures):
    _, done, _ = captures
    rep = local.replay_local(done)
    lag = rep.table("lag")
    last = {}
    for r in lag.to_pylist():
        last[r["vbucket"]] = r
    assert sorted(last) == list(range(VBUCKETS))
    highs = {r["vbucket"]: r["high_seqno"] for r in rep.table("vbuckets").to_pylist()}
    assert all(r["lag_items"] == 0 and r["seqno"] == r["high_seqno"] == highs[vb] for vb, r in last.items())
    assert _rows(lag) == _oracle(rep.table("frames"))


def test_stream_summary_names_the_largest_lag(captures):
    """The largest lag of any poll, the first included: that one goes out as the streams open,
    so what it sees depends on how far the producer got meanwhile (0 on a quiet host, 250, a
    whole vbucket, once on a loaded one); never more than the vbucket's high seqno."""
    base, done, _ = captures
    summary = json.loads((base / "stream.json").read_text())
    highs = {r["vbucket"]: r["high_seqno"] for r in local.replay_local(done).table("vbuckets").to_pylist()}
    vb = summary["largest_lag_vbucket"]
    assert vb in range(VBUCKETS)
    assert 0 <= summary["largest_lag_items"] <= highs[vb]
    assert summary["largest_lag_at"].endswith("Z")


def test_cluster_polls_each_node_for_its_active_vbuckets(tmp_path):
    model = P.server_from_options(vbuckets=VBUCKETS, items=400, seed=6, nodes=2, replicas=1)
    with ThreadedServer(model) as srv:
        files = capture_files(f"couchbase://{srv.host}:{srv.port}/default", tmp_path / "c")
    rep = local.replay_local(files)
    active = {r["vbucket"]: r["active"] for r in rep.table("topology").to_pylist()}
    last = {r["vbucket"]: r for r in rep.table("lag").to_pylist()}
    assert sorted(last) == list(range(VBUCKETS)) and len(set(active.values())) == 2
    assert all(r["node"] == active[vb] and r["lag_items"] == 0 for vb, r in last.items())
    assert _rows(rep.table("lag")) == _oracle(rep.table("frames"))


def test_stopped_capture_records_its_lag(captures):
    _, _, cut = captures
    rep = local.replay_local(cut)
    lag = rep.table("lag")
    assert _rows(lag) == _oracle(rep.table("frames"))
    assert max(lag.column("lag_items").to_pylist()) > 0     # stopped early: behind the server
    assert set(lag.column("node").to_pylist()) == {rep.table("frames").column("node")[0].as_py()}


def test_inspect_names_the_largest_lag(captures):
    from dcptool.replay.check.summary import summarize
    base, _, cut = captures
    rows = local.replay_local(cut).table("lag").to_pylist()
    want = max(rows, key=lambda r: r["lag_items"])
    largest = summarize([str(base / "cut")])["largest_lag"]
    assert largest["lag_items"] == want["lag_items"] > 0 and largest["polls"] >= 1
    res = run("inspect", str(base / "cut"), "--format", "table")
    assert res.returncode == 0, res.stderr
    assert f"largest lag: {want['lag_items']:,} items, vbucket {largest['vbucket']}" in res.stdout


@pytest.mark.spark
def test_spark_lag_equals_local(spark, captures):
    from dcptool.replay.spark import engine as spark_engine
    _, _, cut = captures
    want = local.replay_local(cut).table("lag")
    rep = spark_engine.replay_spark(spark, cut)
    try:
        got = rep.table("lag")
        assert want.num_rows and T.checksum("lag", got) == T.checksum("lag", want)
    finally:
        rep.close()


def _synapse_oracle(frames: pa.Table, ranks: dict) -> list[dict]:
    rows, last = [], {}
    for f in sorted(frames.to_pylist(), key=lambda f: (ranks[f["capture_id"]], f["frame_no"])):
        if f["direction"] != "in" or f["decode_error"] is not None or f["stream"] is None:
            continue
        key = (f["stream"], f["instance"])
        if f["command"] == "RDATA" and f["token"] is not None and not f["batch"]:
            last[key] = f["token"]
        elif f["command"] == "POSITION" and f["new_token"] is not None:
            rd = last.get(key)
            rows.append(dict(stream=f["stream"], instance=f["instance"], position=f["new_token"], rdata_token=rd,
                             lag_tokens=None if rd is None else max(0, f["new_token"] - rd),
                             capture_id=f["capture_id"], frame_no=f["frame_no"]))
    return sorted(rows, key=lambda r: (r["capture_id"], r["frame_no"]))


@pytest.mark.parametrize("seed", [7, 8])
def test_synapse_lag_against_a_walk_of_the_frames(tmp_path, seed):
    from dcptool.replay.store import reader
    from tests.support import capgen
    capgen.write_captures(capgen.generate("synapse", seed=seed, n_events=300), str(tmp_path), seed=seed)
    files = reader.find_captures([str(tmp_path)])
    rep = local.replay_local(files)
    got = sorted(({k: v for k, v in r.items() if k not in ("ts", "node")} for r in rep.table("lag").to_pylist()),
                 key=lambda r: (r["capture_id"], r["frame_no"]))
    want = _synapse_oracle(rep.table("frames"), reader.capture_ranks(files))
    assert got == want and any(r["lag_tokens"] for r in got)


def test_playback_takes_each_connections_setup_answer_not_its_polls(captures):
    """`serve dcp --from` answers the n-th connection's GET_ALL_VB_SEQNOS with the n-th
    connection's recorded set-up answer: a lag poll of connection 1 is not connection 2's."""
    from dcptool.replay.playback_source import load_dcp
    base, _, cut = captures
    frames = local.replay_local(cut).table("frames")
    answers = [r for r in frames.to_pylist() if r["opcode"] == 0x48 and r["direction"] == "in"]
    # set-up + the first poll (the streams open) + the last poll
    assert len(answers) == 3 and len({r["conn"] for r in answers}) == 1
    assert len(load_dcp([str(base / "cut")]).vb_seqnos) == 1
