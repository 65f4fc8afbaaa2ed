"""The DCP codec against the vector table: decode, encode (byte-exact round trip), fed
whole, one byte at a time, and followed by the next frame; the columnar decoder agrees."""

from __future__ import annotations

import numpy as np
import pytest

from dcptool.protocol.dcp.wire import columnar, leb128
from dcptool.protocol.dcp.wire import messages as M
from dcptool.protocol.dcp.wire.frames import FrameParser, split_until_error
from dcptool.protocol.errors import ErrorCode, ProtocolError, RemoteError, Side
from tests.support.dcp_vectors import GO_MUTATION_VALUE, VECTORS

IDS = [v[0] for v in VECTORS]


def _check(msg, row, typ, expected):
    assert type(msg) is typ
    for k, v in expected.items():
        assert row.get(k) == v, (k, row.get(k), v)


@pytest.mark.parametrize("name,data,coll,typ,expected", VECTORS, ids=IDS)
def test_decode_whole_and_round_trip(name, data, coll, typ, expected):
    msg = M.decode_bytes(data, collections=coll)
    _check(msg, M.to_row(msg), typ, expected)
    assert M.encode(msg) == data


@pytest.mark.parametrize("name,data,coll,typ,expected", VECTORS, ids=IDS)
def test_one_byte_at_a_time(name, data, coll, typ, expected):
    parser = FrameParser()
    got = []
    for i in range(len(data)):
        got += parser.feed(data[i:i + 1])
        if i < len(data) - 1:
            assert got == []
    assert len(got) == 1 and got[0].raw == data and parser.pending == 0
    msg = M.decode(got[0], coll)
    _check(msg, M.to_row(msg), typ, expected)


@pytest.mark.parametrize("name,data,coll,typ,expected", VECTORS, ids=IDS)
def test_followed_by_next_frame(name, data, coll, typ, expected):
    nxt = VECTORS[(IDS.index(name) + 1) % len(VECTORS)][1]
    parser = FrameParser()
    frames = parser.feed(data + nxt[:10])
    assert [f.raw for f in frames] == [data]
    frames = parser.feed(nxt[10:])
    assert [f.raw for f in frames] == [nxt]


@pytest.mark.parametrize("name,data,coll,typ,expected", VECTORS, ids=IDS)
def test_columnar_agrees_with_message_decoder(name, data, coll, typ, expected):
    buf = data * 3
    offsets, lengths, consumed, err = columnar.scan(buf)
    assert err is None and consumed == len(buf) and len(offsets) == 3
    rows = columnar.to_rows(columnar.decode_batch(buf, offsets, lengths, collections=coll))
    ref = M.to_row(M.decode_bytes(data, collections=coll))
    if ref["magic"] in (0x81, 0x18, 0x83):
        ref.pop("vbucket", None)
    for row in rows:
        assert row == ref


def test_go_mutation_value_and_stream_id():
    msg = M.decode_bytes(VECTORS[1][1], collections=True)
    assert msg.value == GO_MUTATION_VALUE
    assert msg.frame_infos == ((2, b"\x00\x01"),)
    assert msg.datatype == 0x01  # JSON


def test_go_header_alone_needs_more_data():
    hdr = (VECTORS[0][1])[:24]
    assert FrameParser().feed(hdr) == []


def test_collection_split_only_when_asked():
    data = VECTORS[1][1]
    plain = M.decode_bytes(data, collections=False)
    assert plain.collection_id is None and plain.key == b"\x08xdcrProvCollections_C29854"


@pytest.mark.parametrize("value,hexed", [
    (0x00, "00"), (0x7F, "7f"), (0x80, "8001"), (0x555, "d50a"), (0x7FFF, "ffff01"), (0xFFFF, "ffff03"),
    (0x8000, "808002"), (0x5555, "d5aa01"), (0xCAFEF00, "80debf65"), (0xCAFEF00D, "8de0fbd70c"),
    (0xFFFFFFFF, "ffffffff0f"), (555, "ab04")])
def test_leb128_vectors(value, hexed):
    assert leb128.encode(value).hex() == hexed
    assert leb128.decode(bytes.fromhex(hexed) + b"k") == (value, len(hexed) // 2)


def test_leb128_rejects_non_canonical_and_truncated():
    for bad in ("8000", "80", "ffffffff1f"):
        with pytest.raises(ProtocolError) as exc:
            leb128.decode(bytes.fromhex(bad))
        assert exc.value.code == ErrorCode.BAD_LEB128


def test_columnar_multibyte_collection_ids():
    frames = [M.encode(M.Mutation(vbucket=1, key=b"k%d" % i, collection_id=cid, value=b"v", by_seqno=i + 1))
              for i, cid in enumerate([0, 0x7F, 0x80, 0xCAFEF00D, 9])]
    buf = b"".join(frames)
    o, ln, _, _ = columnar.scan(buf)
    rows = columnar.to_rows(columnar.decode_batch(buf, o, ln, collections=True))
    assert [r["collection_id"] for r in rows] == [0, 0x7F, 0x80, 0xCAFEF00D, 9]
    assert [r["key"] for r in rows] == [b"k0", b"k1", b"k2", b"k3", b"k4"]


def test_bad_magic_is_a_coded_remote_error_after_good_frames():
    good = VECTORS[3][1]
    buf = good + b"\x42" + bytes(30)
    bounds, consumed, err = split_until_error(buf)
    assert bounds == [(0, len(good))] and consumed == len(good)
    assert err.code == ErrorCode.BAD_MAGIC and err.side == Side.REMOTE
    o, ln, consumed2, err2 = columnar.scan(buf)
    assert list(o) == [0] and consumed2 == len(good) and err2.code == ErrorCode.BAD_MAGIC


def test_hostile_length_is_refused_without_allocating():
    hostile = bytes.fromhex("80570000000000000000") + b"\xff\xff\xff\xf0" + bytes(12)
    parser = FrameParser(max_body=1024)
    with pytest.raises(RemoteError) as exc:
        parser.feed(hostile)
    assert exc.value.code == ErrorCode.BODY_TOO_LARGE
    _, _, _, err = columnar.scan(hostile, 1024)
    assert err.code == ErrorCode.BODY_TOO_LARGE


def test_inconsistent_lengths_are_refused():
    # key length 100 in a 10-byte body
    bad = bytes.fromhex("8057006400000000") + (10).to_bytes(4, "big") + bytes(12) + bytes(10)
    with pytest.raises(RemoteError) as exc:
        FrameParser().feed(bad)
    assert exc.value.code == ErrorCode.BAD_LENGTHS


def test_wrong_extras_are_kept_and_flagged():
    # a mutation with 20 extras bytes: decoded generically, error says why, round trip exact
    bad = M.encode(M.Request(opcode=0x57, vbucket=3, extras=bytes(20), key=b"k", value=b"v"))
    msg = M.decode_bytes(bad)
    assert type(msg) is M.Request and msg.decode_error.startswith("bad_extras")
    assert M.encode(msg) == bad
    o, ln, _, _ = columnar.scan(bad)
    row = columnar.to_rows(columnar.decode_batch(bad, o, ln))[0]
    assert row["decode_error"].startswith("bad_extras") and row["op"] == "mutation"


def test_snappy_value_is_decompressed_on_request():
    import cramjam
    body = b'{"x": "' + b"a" * 200 + b'"}'
    comp = bytes(cramjam.snappy.compress_raw(body))
    msg = M.Mutation(vbucket=1, key=b"k", value=comp, datatype=0x03, by_seqno=1)
    again = M.decode_bytes(M.encode(msg))
    assert again.value == comp and M.value_bytes(again) == body


def test_responses_take_the_vbucket_of_their_request():
    req = M.encode(M.StreamRequest(vbucket=77, opaque=0xAB, start_seqno=0, end_seqno=10))
    rsp = M.encode(M.StreamRequestResponse(opaque=0xAB, status=0x23, rollback_seqno=4))
    buf = req + rsp
    o, ln, _, _ = columnar.scan(buf)
    rows = columnar.to_rows(columnar.decode_batch(buf, o, ln, opaque_vbuckets={}))
    assert rows[1]["vbucket"] == 77 and rows[1]["rollback_seqno"] == 4 and rows[1]["status"] == 0x23


def test_every_opcode_has_a_name():
    from dcptool.protocol.dcp.wire.constants import op_name
    assert op_name(0x57) == "mutation" and op_name(0xEE) == "unknown_0xee"
    assert all(op_name(i) for i in range(256))


def test_batch_round_trips_to_arrow():
    from dcptool.replay.store.dcp_batch import frames_to_record_batch
    buf = b"".join(v[1] for v in VECTORS if not v[2])
    rb, consumed, err = frames_to_record_batch(buf, opaque_vbuckets={})
    assert err is None and consumed == len(buf)
    rb.validate(full=True)
    assert rb.column("raw").to_pylist() == [v[1] for v in VECTORS if not v[2]]
    ops = rb.column("op").to_pylist()
    assert ops[0] == "snapshot_marker" and "unknown_0x7a" in ops
    assert np.all(np.asarray(rb.column("frame_no")) == np.arange(rb.num_rows))
