"""GET_META, SET/ADD/DEL_WITH_META on the wire: byte-exact round trips (whole, one byte at a
time, followed by the next frame), the extras layouts kv_engine's binary protocol documents,
wrong layouts kept as generic requests, and Wireshark's couchbase dissector (tshark) reading
the same fields as our decoder."""

from __future__ import annotations

import pytest

from dcptool.protocol.dcp.wire import messages as M
from dcptool.protocol.dcp.wire.constants import Opcode, WithMetaOption
from dcptool.protocol.dcp.wire.frames import FrameParser
from tests.support.tshark_util import tshark_frames

SKIP = int(WithMetaOption.SKIP_CONFLICT_RESOLUTION)
# (message, collections, request?)
CASES = [
    (M.SetWithMeta(vbucket=3, key=b"mykey", value=b"myvalue", item_flags=7, expiration=10, rev_seqno=20,
                   meta_cas=30), False),
    (M.SetWithMeta(vbucket=3, opaque=9, key=b"k", value=b'{"a":1}', datatype=1, item_flags=1, expiration=0,
                   rev_seqno=2, meta_cas=0x1234_5678_9ABC_0000, options=SKIP), False),
    (M.SetWithMeta(vbucket=1023, key=b"doc", collection_id=8, value=b"v", item_flags=0, rev_seqno=1, meta_cas=5,
                   ext_meta=b"\x01\x02\x00\x01\x01"), True),
    (M.AddWithMeta(vbucket=7, cas=77, key=b"x", value=b"\x00\xff", rev_seqno=9, meta_cas=99, options=2,
                   ext_meta=b""), False),
    (M.DelWithMeta(vbucket=5, key=b"gone", rev_seqno=4, meta_cas=44, options=0x12), False),
    (M.DelWithMeta(vbucket=5, key=b"gone", collection_id=0x80, rev_seqno=4, meta_cas=44), True),
    (M.GetMeta(vbucket=2, opaque=3, key=b"k"), False),
    (M.GetMeta(vbucket=2, opaque=3, key=b"k", collection_id=9, version=2), True),
    (M.GetMetaResponse(opaque=3, cas=0xAB, deleted=1, item_flags=3, expiration=4, rev_seqno=5, item_datatype=1), False),
    (M.GetMetaResponse(opaque=3, cas=0xAB, deleted=0, item_flags=3, expiration=4, rev_seqno=5), False),
]
IDS = [f"{type(m).__name__}-{i}" for i, (m, _) in enumerate(CASES)]


@pytest.mark.parametrize("msg,coll", CASES, ids=IDS)
def test_round_trip_whole_bytewise_and_followed(msg, coll):
    data = M.encode(msg)
    assert M.decode_bytes(data, collections=coll) == msg
    parser = FrameParser()
    got = []
    for i in range(len(data)):
        got += parser.feed(data[i:i + 1])
        assert got == [] or i == len(data) - 1
    assert [f.raw for f in got] == [data] and M.decode(got[0], coll) == msg
    nxt = M.encode(M.Noop(opaque=1))
    frames = FrameParser().feed(data + nxt)
    assert [f.raw for f in frames] == [data, nxt]


def test_kv_engine_documented_layout():
    """kv_engine's docs/protocol/set_with_meta.md example: flags 7, expiration 10, seqno 20,
    cas 30 on vbucket 3, key mykey, value myvalue (with the 2-byte meta length, 0)."""
    data = bytes.fromhex("80a200051a00000300000026000000000000000000000000"
                         "000000070000000a0000000000000014000000000000001e0000") + b"mykeymyvalue"
    msg = M.decode_bytes(data)
    assert isinstance(msg, M.SetWithMeta)
    assert (msg.item_flags, msg.expiration, msg.rev_seqno, msg.meta_cas, msg.ext_meta) == (7, 10, 20, 30, b"")
    assert msg.key == b"mykey" and msg.value == b"myvalue" and M.encode(msg) == data
    answer = bytes.fromhex("81a0000015000000000000150000000000000000000000010000000000000001"
                           "000000070000000000000009" "01")
    meta = M.decode_bytes(answer)
    assert isinstance(meta, M.GetMetaResponse)
    assert (meta.deleted, meta.item_flags, meta.expiration, meta.rev_seqno, meta.item_datatype, meta.cas) == \
        (0, 1, 7, 9, 1, 1)


@pytest.mark.parametrize("extras", [b"\x00" * 23, b"\x00" * 25, b"\x00" * 32])
def test_wrong_extras_decode_to_a_generic_request(extras):
    from dcptool.protocol.dcp.wire.frames import encode_frame
    data = encode_frame(0x80, Opcode.SET_WITH_META, extras=extras, key=b"k", value=b"v")
    msg = M.decode_bytes(data)
    assert isinstance(msg, M.Request) and "extras" in msg.decode_error and M.encode(msg) == data


def test_meta_longer_than_the_value_is_refused():
    from dcptool.protocol.dcp.wire.frames import encode_frame
    extras = bytes(24) + b"\x00\x09"
    data = encode_frame(0x80, Opcode.DEL_WITH_META, extras=extras, key=b"k", value=b"abc")
    msg = M.decode_bytes(data)
    assert isinstance(msg, M.Request) and "extended meta" in msg.decode_error


def test_error_answers_stay_generic():
    data = M.encode(M.Response(opcode=Opcode.GET_META, status=1))
    assert type(M.decode_bytes(data)) is M.Response


def test_tshark_reads_the_same_fields():
    """(tshark reads the 24- and 28-byte extras only, not those with the meta length field)"""
    sent = [m for m, coll in CASES if not coll and not m.IS_RESPONSE and getattr(m, "ext_meta", None) is None]
    answers = [m for m, _ in CASES if m.IS_RESPONSE]
    pdus = tshark_frames([(False, M.encode(m)) for m in sent] + [(True, M.encode(m)) for m in answers])
    assert len(pdus) == len(sent) + len(answers)

    def num(d, k):
        return int(d[k], 16)
    for m, d in zip(sent, pdus):
        assert num(d, "couchbase.opcode") == m.OPCODE and d["couchbase.key"] == m.key.decode()
        if isinstance(m, M.SetWithMeta):
            assert num(d, "couchbase.extras.flags") == m.item_flags
            assert num(d, "couchbase.extras.expiration") == m.expiration
            assert num(d, "couchbase.extras.revseqno") == m.rev_seqno
            assert num(d, "couchbase.extras.cas") == m.meta_cas
            if m.options is not None:
                assert num(d, "couchbase.extras.options") == m.options
                assert d["couchbase.extras.options.skip_conflict_resolution"] == str(int(bool(m.options & SKIP)))
        else:
            assert d.get("couchbase.extras.reqextmeta") in (None, "0x%02x" % (m.version or 0))
    for m, d in zip(answers, pdus[len(sent):]):
        assert num(d, "couchbase.extras.deleted") == m.deleted and num(d, "couchbase.extras.flags") == m.item_flags
        assert num(d, "couchbase.extras.expiry") == m.expiration
        assert num(d, "couchbase.extras.meta.seqno") == m.rev_seqno
        if m.item_datatype is not None:     # tshark still calls the datatype byte "confres"
            assert num(d, "couchbase.extras.confres") == m.item_datatype
