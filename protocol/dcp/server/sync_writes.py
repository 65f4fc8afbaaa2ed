"""Durable writes (sync writes) on the producer side, sans-IO: which items of a memory
snapshot a connection gets, and the frames of prepares, commits and aborts.

The generated bucket makes a share of its live mutations durable (`serve dcp
--sync-write-ratio`): a prepare at one seqno, its commit or abort at the next
(producer_bucket.VBucket.append_sync). As on Couchbase, a connection that enabled
`enable_sync_writes` gets DCP_PREPARE (0x60), DCP_COMMIT (0x62) and DCP_ABORT (0x63) and
snapshot markers V2.0 (max visible seqno: the last committed item); any other connection
gets only what was committed: the commit as a DCP_MUTATION at the commit seqno with the
prepare's value, and its snapshots end at the last seqno it can see (a snapshot with
nothing visible is not sent). Prepares, commits and aborts are never de-duplicated (a
checkpoint keeps every step of a durable write); plain changes are, among themselves.
"""

from __future__ import annotations

from typing import Any

from dcptool.protocol.dcp.server.bucket import Item
from dcptool.protocol.dcp.wire import messages as m

SYNC_KINDS = ("p", "c", "a")
VISIBLE = ("m", "d", "x", "c", "sc", "sd")   # what a consumer sees (sc, sd: collection events)
DURABILITY_MAJORITY = 1


def snapshot_items(items: list[Item], sync: bool) -> tuple[list[Item], int | None]:
    """(the items a connection gets from a memory snapshot, in seqno order; the seqno of
    its last visible item, None when none is)."""
    latest: dict[bytes, int] = {}
    for it in items:
        if it.kind not in SYNC_KINDS or (it.kind == "c" and not sync):
            latest[it.key] = it.seqno
    out = []
    mvs = None
    for it in items:
        k = it.kind
        if k in VISIBLE:
            mvs = it.seqno
        if k in SYNC_KINDS:
            if sync:
                out.append(it)
            elif k == "c" and latest.get(it.key) == it.seqno:
                out.append(it)
        elif latest[it.key] == it.seqno:
            out.append(it)
    return out, mvs


def sync_frame(c: Any, vbid: int, opaque: int, it: Item, cid: int | None) -> bytes:
    """A prepare, commit or abort as the connection `c` gets it (sync writes enabled)."""
    if it.kind == "p":
        value = b"" if c.no_value else it.value
        dt = it.datatype if (c.json and value) else 0
        if value and c.compress:     # force_value_compression applies to prepares too
            import cramjam
            value = bytes(cramjam.snappy.compress_raw(value))
            dt |= 0x02
        return m.encode(m.Prepare(vbucket=vbid, opaque=opaque, cas=it.cas, datatype=dt, key=it.key,
                                  collection_id=cid, value=value, by_seqno=it.seqno, rev_seqno=it.rev,
                                  durability=DURABILITY_MAJORITY))
    if it.kind == "c":
        return m.encode(m.Commit(vbucket=vbid, opaque=opaque, key=it.key, collection_id=cid,
                                 prepared_seqno=it.prepared, commit_seqno=it.seqno))
    return m.encode(m.Abort(vbucket=vbid, opaque=opaque, key=it.key, collection_id=cid, prepared_seqno=it.prepared,
                            abort_seqno=it.seqno))
