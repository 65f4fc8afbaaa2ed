"""OSO backfills on the producer side, sans-IO (DCP_DIGEST §5.9, kv_engine
docs/dcp/documentation/commands/oso_snapshot.md).

A connection that enabled `enable_out_of_order_snapshots` (`true`, or
`true_with_seqno_advanced`) gets its initial backfill out of sequence order when the stream
is filtered to exactly one collection and starts at seqno 0 (kv_engine 7.0 uses OSO only then:
it reads the collection through the by-key index instead of the by-seqno one). The backfill
is then, instead of a disk snapshot marker and the items in seqno order:

    OSO_SNAPSHOT (0x65, flags 0x01 start)
    the collection's disk items, in key order
    SEQNO_ADVANCED to the backfill's end seqno, when that seqno is not one of those items
        (with `true_with_seqno_advanced` only)
    OSO_SNAPSHOT (flags 0x02 end)

Memory snapshots after it keep their normal markers and seqno order. Used by
producer_streams.py (the disk branch of Stream.refill)."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Literal, Protocol, Union

import numpy as np
import numpy.typing as npt

from dcptool.protocol.dcp.wire import messages as m

if TYPE_CHECKING:
    from dcptool.protocol.dcp.server.bucket import VBucket
    from dcptool.protocol.dcp.server.manifest import Filter

# a piece of a backfill: ("frames", encoded frames) or ("records", fixed-size mutation records)
Segment = Union[tuple[Literal["frames"], list[bytes]], tuple[Literal["records"], npt.NDArray[np.void]]]



class Stream(Protocol):
    """What this module reads of a stream (streams.Stream, which imports it)."""
    @property
    def conn(self) -> Any: ...          # producer.ProducerConnection
    @property
    def vb(self) -> VBucket: ...
    @property
    def opaque(self) -> int: ...
    @property
    def cursor(self) -> int: ...
    @property
    def first_marker(self) -> bool: ...
    @property
    def flt(self) -> Filter | None: ...


OSO_START, OSO_END = 0x01, 0x02
MODES = ("true", "true_with_seqno_advanced")


def uses_oso(stream: Stream) -> bool:
    """Whether this stream's next backfill is sent as an OSO snapshot."""
    c = stream.conn
    flt = stream.flt
    return (c.controls.get("enable_out_of_order_snapshots") in MODES and c.collections
            and flt is not None and not flt.legacy and flt.cids is not None and len(flt.cids) == 1
            and stream.cursor == 0 and stream.first_marker)


def key_order(vb: VBucket, last: int, allowed: Collection[int]) -> npt.NDArray[np.intp]:
    """Seqnos (1-based) of the disk items up to `last` in the allowed collections, sorted by
    key (the by-key index order; a stable sort keeps equal keys in seqno order)."""
    cids = vb.disk_cids[:last]
    idx = np.flatnonzero(np.isin(cids, np.array(sorted(allowed), dtype=cids.dtype)))
    if len(idx) == 0:
        return idx
    keys = vb.disk_keys[idx]
    order = np.lexsort(keys.T[::-1]) if keys.shape[1] else np.arange(len(idx))
    return idx[order] + 1


def oso_backfill(stream: Stream, last: int) -> list[Segment]:
    """The segments of the OSO backfill of `stream` over seqnos 1..last: a list of
    (kind, payload) with kind "frames" (a list of encoded frames) or "records" (pre-encoded
    fixed-size mutation records, opaque patched in)."""
    c, vb, opaque = stream.conn, stream.vb, stream.opaque
    flt = stream.flt
    assert flt is not None, "uses_oso: a stream filtered to one collection"
    allowed = flt.allowed_ids(c.bucket.manifest)
    seqnos = key_order(vb, last, allowed)
    out: list[Segment] = [("frames", [m.encode(m.OsoSnapshot(vbucket=vb.vbid, opaque=opaque, flags=OSO_START))])]
    if len(seqnos):
        if c.compress:      # values differ in size once compressed: through the codec
            out.append(("frames", [c.encode_item(vb.vbid, opaque, vb.disk_item(int(s))) for s in seqnos]))
        else:
            recs = vb.disk_records(c.collections, c.no_value, c.json)[seqnos - 1]
            recs["opaque"] = opaque
            out.append(("records", recs))
    tail: list[bytes] = []
    top = int(seqnos.max()) if len(seqnos) else 0
    if c.controls.get("enable_out_of_order_snapshots") == "true_with_seqno_advanced" and top != last and last:
        tail.append(m.encode(m.SeqnoAdvanced(vbucket=vb.vbid, opaque=opaque, by_seqno=last)))
    tail.append(m.encode(m.OsoSnapshot(vbucket=vb.vbid, opaque=opaque, flags=OSO_END)))
    out.append(("frames", tail))
    return out
