"""Snappy-compressed disk mutations for connections with `force_value_compression`,
sans-IO: built once per vbucket and connection variant, as a blob of frames with their
start offsets, so a compressed backfill is a slice of bytes with the stream's opaque
patched in, like the fixed-size frames of producer_bucket.disk_records."""

from __future__ import annotations

from typing import TYPE_CHECKING

import cramjam
import numpy as np
import numpy.typing as npt
from numpy.lib.recfunctions import repack_fields

if TYPE_CHECKING:
    from dcptool.protocol.dcp.server.bucket import VBucket

OPAQUE_AT = 12      # the opaque's offset in a frame header


def compressed_disk_frames(vb: VBucket, collections: bool, no_value: bool, json: bool
                           ) -> tuple[bytes, npt.NDArray[np.int64]]:
    """(blob, starts) of the vbucket's disk mutations with Snappy values (datatype | 0x02),
    opaque 0; frame i (seqno i + 1) is blob[starts[i]:starts[i + 1]]."""
    key = ("snappy", collections, no_value, json)
    hit = vb.encoded.get(key)      # (blob, starts) under this key; record arrays under the others
    if isinstance(hit, tuple) and len(hit[1]) == vb.disk_high + 1:
        return (hit[0], hit[1])
    recs: npt.NDArray[np.void] = vb.disk_records(collections, no_value, json)
    n = len(recs)
    if no_value or n == 0:   # nothing to compress: the plain frames
        blob = recs.tobytes()
        starts = np.arange(n + 1, dtype=np.int64) * recs.dtype.itemsize
    else:
        head = repack_fields(recs[[f for f in recs.dtype.names or () if f != "value"]])   # packed, no padding
        values = [bytes(cramjam.snappy.compress_raw(bytes(v))) for v in vb.disk_values[:n]]
        sizes = np.fromiter((len(v) for v in values), np.int64, n)
        head["bodylen"] = head["bodylen"] - recs.dtype["value"].itemsize + sizes
        head["datatype"] = head["datatype"] | 0x02
        heads = np.ascontiguousarray(head).view(np.uint8).reshape(n, -1)
        hb = head.dtype.itemsize
        blob = b"".join(x for pair in zip((bytes(h) for h in heads), values) for x in pair)
        starts = np.zeros(n + 1, np.int64)
        np.cumsum(sizes + hb, out=starts[1:])
    vb.encoded[key] = (blob, starts)
    return blob, starts


def with_opaque(blob: bytes, starts: npt.NDArray[np.int64], lo: int, hi: int, opaque: int) -> tuple[bytearray, list[int]]:
    """Frames lo..hi-1 of a blob with `opaque` written in, and their starts from 0."""
    base = int(starts[lo])
    data = bytearray(blob[base:int(starts[hi])])
    rel = starts[lo:hi + 1] - base
    view = np.frombuffer(data, np.uint8)
    ob = np.frombuffer(int(opaque).to_bytes(4, "big"), np.uint8)
    for j in range(4):
        view[rel[:-1] + OPAQUE_AT + j] = ob[j]
    return data, rel.tolist()
