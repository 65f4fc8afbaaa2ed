"""Frames from our encoder decode in Wireshark's couchbase dissector (tshark) exactly as in
our decoder, for the fields tshark decodes correctly (see tests/support/tshark_util.py)."""

from __future__ import annotations

import random

from dcptool.protocol.dcp.wire import messages as M
from tests.support.dcp_vectors import VECTORS
from tests.support.tshark_util import compare, tshark_frames


def _generated(seed: int, n: int) -> list[tuple[bool, bytes, bool]]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        vb = rnd.randrange(1024)
        sid = ((2, rnd.randrange(1, 60000).to_bytes(2, "big")),) if rnd.random() < 0.3 else ()
        kind = rnd.randrange(6)
        coll = rnd.random() < 0.5
        cid = rnd.choice([0, 8, 0x80, 0xCAFE]) if coll else None
        key = b"key-%d" % rnd.randrange(10**6)
        if kind == 0:
            m = M.Mutation(vbucket=vb, opaque=rnd.getrandbits(32), cas=rnd.getrandbits(64), key=key,
                           collection_id=cid, value=b'{"n":%d}' % i, datatype=1, by_seqno=rnd.getrandbits(40),
                           rev_seqno=rnd.randrange(1, 9), item_flags=rnd.getrandbits(32),
                           expiration=rnd.getrandbits(31), lock_time=0, frame_infos=sid)
        elif kind == 1:
            m = M.Deletion(vbucket=vb, opaque=rnd.getrandbits(32), key=key, collection_id=cid,
                           by_seqno=rnd.getrandbits(40), rev_seqno=3, delete_time=rnd.getrandbits(31),
                           frame_infos=sid)
        elif kind == 2:
            m = M.SnapshotMarker(vbucket=vb, opaque=rnd.getrandbits(32), snap_start=i, snap_end=i + 50,
                                 snap_flags=rnd.choice([1, 2, 6, 0x22]), frame_infos=sid)
        elif kind == 3:
            coll = False
            m = M.StreamRequest(vbucket=vb, opaque=rnd.getrandbits(32), flags=rnd.choice([0, 4, 0x10]),
                                start_seqno=i, end_seqno=rnd.choice([2**64 - 1, i + 100]),
                                vbucket_uuid=rnd.getrandbits(48), snap_start=i, snap_end=i)
        elif kind == 4:
            coll = False
            m = M.StreamRequestResponse(opaque=rnd.getrandbits(32), status=0,
                                        failover_log=((rnd.getrandbits(48), i), (rnd.getrandbits(48), 0)))
        else:
            coll = False
            m = M.Noop(opaque=rnd.getrandbits(32))
        out.append((kind != 3, M.encode(m), coll))
    return out


def _check(frames):
    pdus = tshark_frames([(srv, raw) for srv, raw, _ in frames])
    assert len(pdus) == len(frames)
    problems = []
    for (srv, raw, coll), ts in zip(frames, pdus):
        row = M.to_row(M.decode_bytes(raw, collections=coll))
        problems += [f"{row['op']}: {d}" for d in compare(row, raw, ts)]
    assert problems == []


def test_generated_frames_agree_with_tshark():
    _check([(srv, raw, coll) for srv, raw, coll in _generated(seed=20261122, n=300)])


def test_golden_vectors_agree_with_tshark():
    _check([(True, v[1], v[2]) for v in VECTORS if not v[0].startswith("unknown")])
