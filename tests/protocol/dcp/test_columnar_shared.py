"""The network loop's shared work (issue 26): the decoder and the consumer take the headers the
scan of the same receive gathered (keyed by scan's own offsets array), a column every frame
carries is its values, and all-null Arrow columns are slices of one cached array: the same
columns, bytes and Arrow batches as gathering everything again."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dcptool.protocol.dcp.wire import columnar
from dcptool.protocol.dcp.wire.constants import Opcode
from dcptool.protocol.dcp.wire.frames import encode_frame
from dcptool.replay.store import dcp_batch
from tests.support.dcp_vectors import VECTORS


def _buf(rounds: int, skip: int = 0) -> bytes:
    frames = [v[1] for v in VECTORS if not v[2]]        # frames without collection prefixes
    return b"".join(frames[(i + skip) % len(frames)] for i in range(rounds * len(frames)))


def _mutations(count: int) -> bytes:
    return b"".join(encode_frame(0x80, Opcode.DCP_MUTATION, vbucket_or_status=i % 8, opaque=1, cas=i,
                                 extras=(i + 1).to_bytes(8, "big") + bytes(23), key=b"k%d" % i, value=b"v")
                    for i in range(count))


def _columns(b: columnar.Batch) -> dict:
    out = {name: (vals.tolist(), valid.tolist()) for name, (vals, valid) in b.numeric.items()}
    out["key"] = [x.tolist() for x in b.key]
    out["objects"] = b.objects
    return out


def test_decoding_with_scans_headers_is_decoding_with_a_fresh_gather():
    buf_a, buf_b = _buf(3), _buf(3, skip=1)        # the same number of frames, other bytes
    offs_a, lens_a, used, err = columnar.scan(buf_a)
    assert err is None and used == len(buf_a) and len(offs_a) > 20
    shared = columnar.decode_batch(buf_a, offs_a, lens_a, opaque_vbuckets={})
    fresh = columnar.decode_batch(buf_a, offs_a.copy(), lens_a.copy(), opaque_vbuckets={})
    assert _columns(shared) == _columns(fresh)
    # a later scan of other bytes: the first batch's offsets still decode the first batch
    offs_b, lens_b, _, _ = columnar.scan(buf_b)
    assert len(offs_b) == len(offs_a)
    again = columnar.decode_batch(buf_a, offs_a, lens_a, opaque_vbuckets={})
    assert _columns(again) == _columns(fresh)
    assert _columns(columnar.decode_batch(buf_b, offs_b, lens_b, opaque_vbuckets={})) != _columns(fresh)
    # what scan hands on is read-only: nobody downstream can change what another reads
    h, fields = columnar.headers(buf_b, offs_b)
    assert not offs_b.flags.writeable and not h.flags.writeable and not any(a.flags.writeable for a in fields)


def test_all_null_columns_are_cached_slices_equal_to_fresh_nulls():
    for count in (1000, dcp_batch.NULL_ROWS + 10):     # cached slices; beyond the cache, built
        buf = _mutations(count)
        rb, used, err = dcp_batch.frames_to_record_batch(buf, node=None)
        n = rb.num_rows
        assert err is None and used == len(buf) and n > 0
        expected = [pa.nulls(n, f.type) if rb.column(i).null_count == n else rb.column(i)
                    for i, f in enumerate(rb.schema)]
        assert rb.equals(pa.RecordBatch.from_arrays(expected, schema=rb.schema))
        assert sum(rb.column(i).null_count == n for i in range(rb.num_columns)) >= 10
    for n in (0, 5, dcp_batch.NULL_ROWS, dcp_batch.NULL_ROWS + 1):
        col = dcp_batch.nulls(n, pa.int64())
        assert len(col) == n and col.null_count == n and col.type == pa.int64()


def test_a_column_every_frame_carries_is_the_values():
    b = columnar.Batch(b"", 4)
    b.set("by_seqno", np.arange(4), np.array([1, 2, 2**64 - 1, 4], dtype=np.uint64))
    vals, valid = b.numeric["by_seqno"]
    assert vals.dtype == np.int64 and vals.tolist() == [1, 2, -1, 4] and valid.all()
    b.set("cas", np.array([1, 3]), np.array([7, 9], dtype=np.uint64))
    assert b.numeric["cas"][0].tolist() == [0, 7, 0, 9] and b.numeric["cas"][1].tolist() == [False, True, False, True]
