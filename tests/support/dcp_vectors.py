"""The byte-vector table every DCP codec test drives: (name, frame bytes, collections,
expected type, expected row values). Values are facts from the sources named in
fixtures/dcp/README.md; keep them here, not in the code under test."""

from __future__ import annotations

from dcptool.protocol.dcp.wire import messages as M
from tests.support.paths import FIXTURES

VEC = FIXTURES / "dcp"


def _go(op: str) -> bytes:
    return (VEC / f"gomemcached-header.{op}.bin").read_bytes() + (VEC / f"gomemcached-body.{op}.bin").read_bytes()


H = bytes.fromhex
GO_MUTATION_VALUE = b'{"name": "xdcrProvCollections_C29854", "age": 57, "index": "9854", "body":"0000000000"}'

VECTORS = [
    # real frames (gomemcached), flexible framing with stream id 1, vbucket 874
    ("go snapshot marker", _go("0x56"), False, M.SnapshotMarker,
     dict(magic=0x08, vbucket=874, stream_id=1, snap_version="1", snap_start=0, snap_end=24, snap_flags=0x06)),
    ("go mutation", _go("0x57"), True, M.Mutation,
     dict(magic=0x08, vbucket=874, stream_id=1, by_seqno=24, rev_seqno=1, item_flags=0, expiration=0,
          lock_time=0, collection_id=8, key=b"xdcrProvCollections_C29854", value_len=len(GO_MUTATION_VALUE))),
    ("go system event", _go("0x5f"), True, M.SystemEvent,
     dict(magic=0x08, vbucket=874, stream_id=1, by_seqno=4, system_event_id=0, key=b"col1", value_len=16)),
    # kv_engine docs, byte-exact
    ("doc mutation", H("805700051f000210000000290000121000000000000000000000000000000004000000000000000100000000000000000000000000000068656c6c6f776f726c64"),
     False, M.Mutation, dict(vbucket=528, opaque=0x1210, by_seqno=4, rev_seqno=1, key=b"hello", value_len=5)),
    ("doc stream request", H("80530000300000000000003000001000000000000000000000000000000000000000000000ffeeddffffffffffffffff00000000feeddeca0000000000ffeedd0000000000ffeeff"),
     False, M.StreamRequest, dict(vbucket=0, opaque=0x1000, req_flags=0, req_start_seqno=0xffeedd,
                                  req_end_seqno=0xFFFFFFFFFFFFFFFF, req_vbucket_uuid=0xfeeddeca,
                                  req_snap_start=0xffeedd, req_snap_end=0xffeeff)),
    ("doc rollback", H("8153000000000023000000080000100000000000000000000000000000000000"), False,
     M.StreamRequestResponse, dict(status=0x23, opaque=0x1000, rollback_seqno=0)),
    ("doc failover log", H("81530000000000000000004000001000000000000000000000000000feeddeca00000000000054320000000000decafe000000000134321400000000feedface000000000000000400000000deadbeef0000000000006524"),
     False, M.StreamRequestResponse, dict(status=0, failover_log=[
         {"vbucket_uuid": 0xfeeddeca, "seqno": 0x5432}, {"vbucket_uuid": 0xdecafe, "seqno": 0x1343214},
         {"vbucket_uuid": 0xfeedface, "seqno": 4}, {"vbucket_uuid": 0xdeadbeef, "seqno": 0x6524}])),
    ("doc get failover log", H("805400000000000000000000deadbeef0000000000000000"), False, M.GetFailoverLog,
     dict(opaque=0xdeadbeef)),
    ("doc failover log response", H("815400000000000000000040deadbeef0000000000000000") + H(
        "00000000feeddeca00000000000054320000000000decafe000000000134321400000000feedface000000000000000400000000deadbeef0000000000006524"),
     False, M.FailoverLogResponse, dict(status=0, failover_log=[
         {"vbucket_uuid": 0xfeeddeca, "seqno": 0x5432}, {"vbucket_uuid": 0xdecafe, "seqno": 0x1343214},
         {"vbucket_uuid": 0xfeedface, "seqno": 4}, {"vbucket_uuid": 0xdeadbeef, "seqno": 0x6524}])),
    ("doc stream end", H("805500000400000000000004deadbeef000000000000000000000000"), False, M.StreamEnd,
     dict(opaque=0xdeadbeef, stream_end_reason=0)),
    ("doc open", H("80500018080000000000002000000001000000000000000000000000000000006275636b657473747265616d2076625b3130302d3130355d"),
     False, M.DcpOpen, dict(key=b"bucketstream vb[100-105]", opaque=1)),
    ("doc open response", H("815000000000000000000000000000010000000000000000"), False, M.Response,
     dict(status=0, opaque=1)),
    ("doc commit", H("8062000510000210000000150000121000000000000000000000000000000004000000000000000568656c6c6f"),
     False, M.Commit, dict(vbucket=528, by_seqno=5, key=b"hello")),
    ("doc abort", H("8063000510000210000000150000121000000000000000000000000000000004000000000000000568656c6c6f"),
     False, M.Abort, dict(vbucket=528, by_seqno=5, key=b"hello")),
    ("doc seqno ack", H("8061000008000210000000080000121000000000000000000000000000000004"), False,
     M.SeqnoAcknowledged, dict(vbucket=528)),
    ("doc set vb state", H("805b00000100000000000001deadbeef000000000000000004"), False, M.SetVbucketState, {}),
    ("doc close stream", H("805200000000000500000000deadbeef0000000000000000"), False, M.CloseStream, dict(vbucket=5)),
    ("doc noop response", H("815c00000000000000000000000000050000000000000000"), False, M.Response,
     dict(op="noop", status=0, opaque=5)),
    ("doc system event", H("805f000c0d0002100000002d000012100000000000000000000000000000000400000000016d79636f6c6c656374696f6e0000000000000002000000080000000000011940"),
     False, M.SystemEvent, dict(by_seqno=4, system_event_id=0, key=b"mycollection", value_len=20)),
    ("doc hello", H("801f000c00000000000000160000000000000000000000006d6368656c6c6f2076312e3000010002000300040005"),
     False, M.Hello, dict(key=b"mchello v1.0")),
    ("doc select bucket", H("8089000b000000000000000befbeadde0000000000000000656e67696e656572696e67"), False,
     M.SelectBucket, dict(key=b"engineering", opaque=0xefbeadde)),
    ("doc sasl plain", H("802100050000000000000011000000000000000000000000504c41494e00757365720070656e63696c"), False,
     M.SaslAuth, dict(key=b"PLAIN", value_len=12)),
    # built from the documented layouts (the public pages' grids are wrong or absent)
    ("noop", H("805c00000000000000000000000000050000000000000000"), False, M.Noop, dict(opaque=5)),
    ("buffer ack", H("805d0000040000000000000400000005000000000000000000001000"), False, M.BufferAck, {}),
    ("control", H("805e000b000000000000000f000000010000000000000000656e61626c655f6e6f6f7074727565"), False,
     M.Control, dict(key=b"enable_noop", value_len=4)),
    ("deletion v1", H("80580005120002100000001700001210000000000000000000000000000000050000000000000001000068656c6c6f"),
     False, M.Deletion, dict(by_seqno=5, rev_seqno=1, key=b"hello")),
    ("deletion v2", H("80580005150002100000001a00001210000000000000000000000000000000050000000000000001000000000068656c6c6f"),
     False, M.Deletion, dict(by_seqno=5, rev_seqno=1, delete_time=0, key=b"hello")),
    ("expiration", H("805900051400021000000019000012100000000000000000000000000000000500000000000000010000000068656c6c6f"),
     False, M.Expiration, dict(by_seqno=5, rev_seqno=1, delete_time=0, key=b"hello")),
    ("seqno advanced", H("806400000800000000000008deadbeef00000000000000000000000000000004"), False,
     M.SeqnoAdvanced, dict(by_seqno=4)),
    ("oso start", H("806500000400000000000004deadbeef000000000000000000000001"), False, M.OsoSnapshot, {}),
    ("prepare", H("806000051f000210000000290000121000000000000000000000000000000004000000000000000100000000000000000000000000000168656c6c6f776f726c64"),
     False, M.Prepare, dict(by_seqno=4, rev_seqno=1, key=b"hello", value_len=5)),
    # spec erratum: V1 flags 0x01 is memory (the page says disk)
    ("snapshot v1 memory (corrected)", H("805600001400000000000014deadbeef00000000000000000000000000000000000000000000000800000001"),
     False, M.SnapshotMarker, dict(snap_version="1", snap_start=0, snap_end=8, snap_flags=0x01)),
    # spec erratum: V2.0 extras length 1, body 0x25, version 0
    ("snapshot v2.0 (corrected)", H("805600000100000000000025deadbeef000000000000000000000000000000000100000000000000080000000200000000000000080000000000000007"),
     False, M.SnapshotMarker, dict(snap_version="2.0", snap_start=1, snap_end=8, snap_flags=2,
                                   max_visible_seqno=8, high_completed_seqno=7)),
    ("snapshot ack", H("815600000000000000000000deadbeef0000000000000000"), False, M.Response, dict(status=0)),
    ("stream end alt sid 71", H("085503000400000000000007deadbeef000000000000000022004700000001"), False, M.StreamEnd,
     dict(stream_id=71, stream_end_reason=1, magic=0x08)),
    ("collection mutation cid 8", H("805700061f0002100000002a000012100000000000000000000000000000000400000000000000010000000000000000000000000000000868656c6c6f776f726c64"),
     True, M.Mutation, dict(collection_id=8, key=b"hello", value_len=5)),
]


def _snapshot_v22(hps: bool) -> bytes:
    m = M.SnapshotMarker(vbucket=3, opaque=9, snap_version="2.2", snap_start=10, snap_end=20, snap_flags=0x12,
                         max_visible_seqno=19, high_completed_seqno=18, purge_seqno=5,
                         high_prepared_seqno=17 if hps else None)
    return M.encode(m)


VECTORS += [
    ("snapshot v2.2 (44-byte value)", _snapshot_v22(False), False, M.SnapshotMarker,
     dict(snap_version="2.2", purge_seqno=5, max_visible_seqno=19, high_completed_seqno=18)),
    ("snapshot v2.2 with hps (52-byte value)", _snapshot_v22(True), False, M.SnapshotMarker,
     dict(snap_version="2.2", purge_seqno=5, high_prepared_seqno=17)),
    ("unknown opcode 0x7a", bytes.fromhex("807a000003000000000000050000000100000000000000000102036869"), False, M.Request,
     dict(op="unknown_0x7a", key=b"", value_len=2)),
    ("snapshot unknown version 1 (kept raw, flagged)", H("805600000100000000000025deadbeef0000000000000000") +
     b"\x01" + bytes(36), False, M.Request, dict(op="snapshot_marker")),
]
