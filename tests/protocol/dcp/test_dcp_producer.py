"""The sans-IO producer: the rollback decision, the generated bucket, pre-encoded frames
against the codec, snapshots with de-duplication, flow control, noops, scenarios."""

from __future__ import annotations

import pytest

from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.bucket import vbucket_of
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import SnapshotFlag, Status
from dcptool.protocol.dcp.wire.frames import split
from tests.support.dcp_pair import Pair, cfg

LOG = [(0xCC, 200), (0xBB, 100), (0xAA, 0)]   # newest first


@pytest.mark.parametrize("start,uuid,ss,se,want", [
    (0, 0, 0, 0, None),          # fresh start
    (0, 0x99, 0, 0, None),       # start 0, not strict: never a rollback
    (50, 0x99, 50, 50, 0),       # unknown uuid -> 0
    (50, 0xAA, 50, 50, None),    # oldest branch, valid up to 100
    (150, 0xAA, 150, 150, 100),  # beyond the end of its branch -> upper
    (150, 0xBB, 150, 150, None),  # branch 0xBB is valid up to 200
    (200, 0xBB, 200, 200, None),  # exactly at the branch point
    (190, 0xBB, 180, 220, 180),  # snapshot straddles the branch: back to snap start
    (190, 0xBB, 190, 220, None),  # start == snap_start: snap_end := start
    (250, 0xBB, 250, 250, 200),  # complete snapshot above the branch
    (220, 0xBB, 190, 220, 200),  # start == snap_end -> snap_start := start -> upper
    (250, 0xCC, 250, 250, None),  # newest uuid: upper = high seqno 300
    (310, 0xCC, 300, 320, 300),  # above the high seqno inside a snapshot
])
def test_rollback_decision(start, uuid, ss, se, want):
    assert P.rollback_seqno(start=start, vb_uuid=uuid, snap_start=ss, snap_end=se,
                            failover_log=LOG, high_seqno=300) == want


def test_rollback_decision_strict_and_purge():
    assert P.rollback_seqno(start=0, vb_uuid=0x99, snap_start=0, snap_end=0, failover_log=LOG,
                            high_seqno=300, strict=True) == 0
    assert P.rollback_seqno(start=5, vb_uuid=0xCC, snap_start=5, snap_end=5, failover_log=LOG,
                            high_seqno=300, purge_seqno=10) == 0
    assert P.rollback_seqno(start=5, vb_uuid=0xCC, snap_start=5, snap_end=5, failover_log=LOG,
                            high_seqno=300, purge_seqno=10, client_purge_seqno=10) is None


def test_bucket_is_deterministic_and_hashes_keys():
    a = P.Bucket("b", 16, 500, seed=7)
    b = P.Bucket("b", 16, 500, seed=7)
    c = P.Bucket("b", 16, 500, seed=8)
    items = lambda bk: [(it.key, it.value) for vb in bk.vbuckets for it in vb.items()]
    assert items(a) == items(b) != items(c)
    assert sum(vb.high_seqno for vb in a.vbuckets) == 500
    for vb in a.vbuckets:
        for it in vb.items():
            assert vbucket_of(it.key, 16) == vb.vbid
            assert len(it.value) == 61 and it.value.startswith(b'{"n":')
    import json
    json.loads(a.vbuckets[0].disk_item(1).value)
    assert [vb.uuid for vb in a.vbuckets] == [vb.uuid for vb in b.vbuckets]


@pytest.mark.parametrize("collections,no_value,json_", [(False, False, True), (True, False, True),
                                                        (False, True, False)])
def test_pre_encoded_frames_equal_the_codec(collections, no_value, json_):
    bk = P.Bucket("default", 4, 200, seed=1)
    vb = bk.vbuckets[2]
    blob = vb.disk_records(collections, no_value, json_).tobytes()
    bounds, used = split(blob)
    assert used == len(blob) and len(bounds) == vb.high_seqno
    for (off, n), it in zip(bounds, vb.items()):
        value = b"" if no_value else it.value
        want = m.Mutation(vbucket=2, key=it.key, value=value, collection_id=0 if collections else None,
                          by_seqno=it.seqno, rev_seqno=1, cas=it.cas, datatype=1 if (json_ and value) else 0)
        assert blob[off:off + n] == m.encode(want)
    if not collections and not no_value:
        assert bounds[0][1] == 128   # the default document makes 128-byte frames


def test_memory_snapshots_deduplicate():
    srv = P.server_from_options(vbuckets=1, items=10, seed=1, checkpoint_items=1000)
    vb = srv.buckets["default"].vbuckets[0]
    keys = [b"doc-%08d" % i for i in range(10)]
    for i in range(30):
        vb.append(keys[i % 3], b'{"i":%d}' % i, "m", 1000 + i)
    vb.append(keys[4], b"", "d", 2000)
    vb.append(keys[5], b"", "x", 2001)
    pair = Pair(srv, cfg(to="now")).run()
    msgs = [m.decode_bytes(f) for f in pair.inbound]
    markers = [x for x in msgs if isinstance(x, m.SnapshotMarker)]
    assert markers[0].snap_flags == SnapshotFlag.DISK | SnapshotFlag.CHECKPOINT
    assert (markers[0].snap_start, markers[0].snap_end) == (0, 10)
    assert markers[1].snap_flags & SnapshotFlag.MEMORY and (markers[1].snap_start, markers[1].snap_end) == (11, 42)
    mem = [x for x in msgs if isinstance(x, (m.Mutation, m.Deletion, m.Expiration)) and x.by_seqno > 10]
    assert [x.by_seqno for x in mem] == [38, 39, 40, 41, 42]     # last version of each key only
    assert isinstance(mem[-2], m.Deletion) and mem[-2].delete_time == 0   # V2: delete times asked for
    assert isinstance(mem[-1], m.Expiration)                             # expiry opcode accepted
    assert pair.cons.finished


def test_snapshot_marker_versions():
    srv = P.server_from_options(vbuckets=1, items=5)
    pair = Pair(srv, cfg(collections=True)).run()
    markers = [m.decode_bytes(f, True) for f in pair.inbound if f[1] == 0x56]
    assert markers[0].snap_version == "2.2" and markers[0].purge_seqno == 0
    pair = Pair(srv, cfg()).run()
    markers = [m.decode_bytes(f) for f in pair.inbound if f[1] == 0x56]
    assert markers[0].snap_version == "1"


def test_flow_control_holds_the_window():
    srv = P.server_from_options(vbuckets=8, items=5000, seed=2)
    pair = Pair(srv, cfg(buffer_size=10_000))
    pair.run()
    st = pair.prod.stats
    assert pair.cons.finished
    assert st["flow_blocked"] > 0
    # may overshoot by less than one frame, never more (kv_engine sends while below the size)
    assert st["max_outstanding"] < 10_000 + 128


def test_noop_not_answered_drops_the_connection():
    srv = P.server_from_options(vbuckets=1, items=5)
    conn = srv.connect(0.0)
    for msg in (m.SelectBucket(bucket=b"default"), m.DcpOpen(name=b"x", flags=1),
                m.Control(key=b"set_noop_interval", value=b"0.5"), m.Control(key=b"enable_noop", value=b"true")):
        conn.receive(m.encode(msg), 0.0)
    rsps = [m.decode_bytes(bytes(f)) for f in conn.pull(0.0)]
    assert [r.status for r in rsps] == [0, 0, 0, 0]
    conn.tick(0.5)
    out = b"".join(bytes(x) for x in conn.pull(0.5))
    assert isinstance(m.decode_bytes(out), m.Noop) and conn.closed is None
    conn.tick(1.0)
    assert conn.closed == "noop not answered"


def test_control_validation():
    srv = P.server_from_options(vbuckets=1, items=1)
    conn = srv.connect(0.0)
    conn.receive(m.encode(m.Control(key=b"enable_noop", value=b"true")), 0.0)   # before DCP_OPEN
    for msg in (m.SelectBucket(bucket=b"default"), m.DcpOpen(name=b"x", flags=1),
                m.Control(key=b"set_noop_interval", value=b"0.05"), m.Control(key=b"bogus", value=b"1"),
                m.Control(key=b"stream_buffer_size", value=b"1024"), m.DcpOpen(name=b"x", flags=1)):
        conn.receive(m.encode(msg), 0.0)
    rsps = [m.decode_bytes(bytes(f)).status for f in conn.pull(0.0)]
    assert rsps == [Status.EINVAL, 0, 0, Status.EINVAL, Status.EINVAL, Status.NOT_SUPPORTED, Status.EINVAL]


def test_stream_request_checks():
    srv = P.server_from_options(vbuckets=2, items=20, seed=1)
    conn = srv.connect(0.0)
    for msg in (m.SelectBucket(bucket=b"default"), m.DcpOpen(name=b"x", flags=1)):
        conn.receive(m.encode(msg), 0.0)
    conn.pull(0.0)
    vb = srv.buckets["default"].vbuckets[0]
    cases = [
        (m.StreamRequest(vbucket=9, opaque=1), Status.NOT_MY_VBUCKET),
        (m.StreamRequest(vbucket=0, opaque=2, start_seqno=5, end_seqno=4, snap_start=5, snap_end=5), Status.ERANGE),
        (m.StreamRequest(vbucket=0, opaque=3, start_seqno=5, snap_start=6, snap_end=9), Status.ERANGE),
        (m.StreamRequest(vbucket=0, opaque=4, start_seqno=5, vbucket_uuid=vb.uuid, snap_start=5, snap_end=5), 0),
        (m.StreamRequest(vbucket=0, opaque=5), Status.KEY_EEXISTS),
        (m.StreamRequest(vbucket=1, opaque=6, start_seqno=5, vbucket_uuid=123, snap_start=5, snap_end=5),
         Status.ROLLBACK),
        (m.StreamRequest(vbucket=1, opaque=7, start_seqno=999, vbucket_uuid=srv.buckets["default"].vbuckets[1].uuid,
                         snap_start=999, snap_end=999), Status.ROLLBACK),
    ]
    for req, _ in cases:
        conn.receive(m.encode(req), 0.0)
    rsps = [m.decode_bytes(bytes(f)) for f in conn.pull(0.0)[:len(cases)]]
    assert [r.status for r in rsps] == [want for _, want in cases]
    assert rsps[3].failover_log == ((vb.uuid, 0),)
    assert rsps[5].rollback_seqno == 0
    assert rsps[6].rollback_seqno == srv.buckets["default"].vbuckets[1].high_seqno


def test_noop_mandatory_with_collections():
    srv = P.server_from_options(vbuckets=1, items=1)
    pair = Pair(srv, cfg(collections=True, noop_interval=0))
    with pytest.raises(Exception) as info:
        pair.run()
    assert getattr(info.value, "status", None) == Status.NOT_SUPPORTED


def test_failover_scenario_and_same_name_replaces():
    srv = P.server_from_options(vbuckets=4, items=400, seed=3, scenarios=P.Scenarios(failover_at=300))
    pair = Pair(srv, cfg())
    pair.run()
    assert pair.prod.closed.startswith("scenario: failover")
    assert pair.prod.stats["stream_frames"] == 300
    assert all(len(vb.failover_log) == 2 for vb in srv.buckets["default"].vbuckets)
    a = srv.connect(0.0)
    b = srv.connect(0.0)
    for c in (a, b):
        for msg in (m.SelectBucket(bucket=b"default"), m.DcpOpen(name=b"same", flags=1)):
            c.receive(m.encode(msg), 0.0)
    assert a.closed and not b.closed


def test_silent_and_slow():
    srv = P.server_from_options(vbuckets=1, items=100, scenarios=P.Scenarios(silent=True))
    pair = Pair(srv, cfg(to="now")).run(max_steps=50)
    assert pair.data() == {} and pair.of(P_c().StreamOpened)
    srv = P.server_from_options(vbuckets=1, items=100, scenarios=P.Scenarios(slow=0.5, slow_frames=10))
    pair = Pair(srv, cfg(to="now"))
    pair.run(max_steps=50)
    assert sum(len(v) for v in pair.data().values()) == 9     # one batch of 10 frames: marker + 9
    pair.run(advance=0.5)
    assert pair.cons.finished and sum(len(v) for v in pair.data().values()) == 100


def P_c():
    from dcptool.protocol.dcp.client import consumer
    return consumer
