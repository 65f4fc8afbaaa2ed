"""Change history on the producer side, sans-IO: which collections keep history, the
`change_streams` DCP_CONTROL, and what a history snapshot holds (DCP_DIGEST §2.6, §5.3).

As on a Magma bucket with history retention, a collection can keep every version of its
keys (`serve dcp --history-collections`; its manifest entry says `"history": true`). A
connection that enabled `change_streams=true` then gets, in a memory snapshot that holds
items of such a collection, every version of each of those keys (no de-duplication) and
the marker flags History | MayContainDuplicates; the items of the other collections are
de-duplicated among themselves as before. A disk backfill whose range holds history items
gets the same two flags (this model's disk keeps one version per key, so it never actually
repeats one). Without change_streams, or with no history collection in the range, the
stream is what it was. A bucket with no history collection refuses change_streams with
NOT_SUPPORTED, as a couchstore bucket does. Used by producer_streams.py and
producer_controls.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from dcptool.protocol.dcp.server.sync_writes import SYNC_KINDS, VISIBLE, snapshot_items
from dcptool.protocol.dcp.wire.constants import SnapshotFlag, Status

if TYPE_CHECKING:
    from dcptool.protocol.dcp.server.bucket import Bucket, Item, VBucket
    from dcptool.protocol.dcp.server.manifest import Manifest

HISTORY_FLAGS = SnapshotFlag.HISTORY | SnapshotFlag.MAY_CONTAIN_DUPLICATES


class ProducerConnection(Protocol):
    """What this module reads of a connection (producer.ProducerConnection, which imports it)."""
    @property
    def controls(self) -> dict[str, str]: ...
    @property
    def bucket(self) -> Bucket | None: ...
    @property
    def sync_writes(self) -> bool: ...


def enable_history(manifest: Manifest, names: Iterable[str]) -> None:
    """Mark the collections named `SCOPE.NAME` (or every one, also those created later, for
    "all") as keeping history. ValueError naming the first unknown one."""
    names = [n.strip() for n in names if n.strip()]
    if "all" in names:
        manifest.history_default = True
        for col in manifest.collections.values():
            col.history = True
        return
    for text in names:
        scope, dot, name = text.partition(".")
        found = manifest.find(scope, name) if dot else None
        if found is None:
            have = ", ".join(f"{manifest.scopes[c.sid]}.{c.name}" for c in manifest.collections.values()
                             if not c.dropped)
            raise ValueError(f"{text!r} is not a collection of the bucket (it has: {have}; or 'all')")
        found.history = True


def history_ids(manifest: Manifest | None) -> frozenset[int]:
    """Ids of the collections that keep history (dropped ones included: their events)."""
    if manifest is None:
        return frozenset()
    return frozenset(c.cid for c in manifest.collections.values() if c.history)


def has_history(bucket: object) -> bool:
    manifest: Manifest | None = getattr(bucket, "manifest", None)
    return manifest is not None and (bool(history_ids(manifest)) or manifest.history_default)


def _manifest(conn: ProducerConnection) -> Manifest | None:
    """The manifest of the connection's bucket (a connection with streams has one)."""
    return conn.bucket.manifest if conn.bucket is not None else None


def control_status(conn: ProducerConnection, val: str) -> int:
    """DCP_CONTROL change_streams: accepted only by a bucket that keeps history."""
    if val not in ("true", "false"):
        return Status.EINVAL
    return Status.SUCCESS if has_history(conn.bucket) else Status.NOT_SUPPORTED


def enabled(conn: ProducerConnection) -> bool:
    return conn.controls.get("change_streams") == "true"


def memory_snapshot(conn: ProducerConnection, items: list[Item]) -> tuple[list[Item], int | None, int]:
    """(the items of a memory snapshot the connection gets, the seqno of its last visible
    item or None, the extra marker flags). Without change_streams or history items this is
    producer_sync.snapshot_items with no extra flags."""
    sync = conn.sync_writes
    ids = history_ids(_manifest(conn)) if enabled(conn) else frozenset()
    if not ids or not any(it.cid in ids for it in items):
        plain, last_visible = snapshot_items(items, sync)
        return plain, last_visible, 0
    # every version of a history key; the other collections de-duplicated among themselves
    rest, _ = snapshot_items([it for it in items if it.cid not in ids], sync)
    keep = {it.seqno for it in rest}
    out: list[Item] = []
    mvs: int | None = None
    for it in items:
        if it.kind in VISIBLE:
            mvs = it.seqno
        if it.cid in ids:
            if it.kind not in SYNC_KINDS or sync or it.kind == "c":
                out.append(it)
        elif it.seqno in keep:
            out.append(it)
    return out, mvs, int(HISTORY_FLAGS)


def disk_flags(conn: ProducerConnection, vb: VBucket, first: int, last: int) -> int:
    """Extra flags of a disk snapshot over seqnos first..last: History | MayContainDuplicates
    when change_streams is on and the range holds items of a history collection."""
    if not enabled(conn):
        return 0
    ids = history_ids(_manifest(conn))
    if not ids:
        return 0
    cids = vb.disk_cids[first - 1:last]
    return int(HISTORY_FLAGS) if np.isin(cids, np.array(sorted(ids), dtype=cids.dtype)).any() else 0
