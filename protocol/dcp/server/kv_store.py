"""The live documents of `serve dcp`, sans-IO: per vbucket, the latest version of every key
(a tombstone after a delete or an expiry) and the durable writes in progress, kept as an
index over the vbucket's history (bucket.VBucket), so every write is one item appended to
that history and streams it to every DCP stream of the vbucket at once.

kv_engine's rules, as writes follow them here:
- seqno: each change (mutation, deletion, expiration, touch, prepare, commit) takes the
  vbucket's next seqno.
- CAS: a hybrid logical clock per vbucket: max(previous CAS + 1, wall-clock ns with the low
  16 bits cleared), so CAS grows with time and never repeats.
- rev seqno: 1 for a key never seen; the previous version's + 1 otherwise (tombstones too).
- expiry: a value up to 30 days is relative seconds, above it an absolute Unix time (0: none);
  stored absolute. An expired document is invisible; whoever finds it first (a read, a write,
  the expiry pager) deletes it with an expiration at a new seqno.

The index follows the history whatever writes it (the generated `--rate` traffic too): it
applies the items it has not seen before each operation and rebuilds itself when a failover
cut the history short. Time is an argument (`now`, monotonic seconds); the wall clock is
`now + wall_offset`.
"""

from __future__ import annotations

import time
from typing import Any

from dcptool.protocol.dcp.server.bucket import Bucket, Item, VBucket

RELATIVE_EXPIRY_MAX = 30 * 24 * 3600     # Couchbase: up to 30 days is relative
DEFAULT_PAGER_INTERVAL = 10.0            # seconds between expiry pager runs


class VbIndex:
    """The live documents of one vbucket: (collection id, key) -> latest Item."""

    def __init__(self, vb: VBucket, store: "KvStore | None" = None):
        self.vb = vb
        self.store = store                                 # counts the bucket's expiring documents
        self.docs: dict[tuple[int, bytes], Item] = {}
        self.pending: dict[tuple[int, bytes], Item] = {}   # durable writes not yet committed
        self.locks: dict[tuple[int, bytes], tuple[int, float]] = {}   # get-and-lock: (lock CAS, until)
        self.applied = 0
        self.uuid = vb.uuid
        self.hlc = 0
        self.expiring = 0                                  # live documents with an expiry

    def sync(self) -> None:
        """Apply what the history gained since the last call (rebuild after a failover)."""
        vb = self.vb
        if vb.uuid != self.uuid:
            newer = []
            for uuid, seqno in vb.failover_log:
                if uuid == self.uuid:
                    break
                newer.append(seqno)
            else:
                newer.append(-1)                            # ours is gone from the log: rebuild
            self.uuid = vb.uuid
            if min(newer) < self.applied:                   # a failover cut what we had applied
                self.docs.clear()
                self.pending.clear()
                self.locks.clear()
                self.applied = 0
                self._count_expiring(-self.expiring)
        high = vb.high_seqno
        if self.applied >= high:
            return
        start = self.applied + 1
        if start <= vb.disk_high:
            for s in range(start, vb.disk_high + 1):
                self._apply(vb.disk_item(s))
            start = vb.disk_high + 1
        for it in vb.mem[start - vb.disk_high - 1:]:
            self._apply(it)
        self.applied = high

    def _apply(self, it: Item) -> None:
        if it.cas > self.hlc:
            self.hlc = it.cas
        k = it.kind
        if k in ("sc", "sd"):
            return
        key = (it.cid, it.key)
        if k == "p":
            self.pending[key] = it
            return
        if k in ("c", "a"):
            self.pending.pop(key, None)
            if k == "a":
                return
        old = self.docs.get(key)
        if old is not None and old.expiry and old.kind in ("m", "c"):
            self._count_expiring(-1)
        self.docs[key] = it
        if it.expiry and k in ("m", "c"):
            self._count_expiring(1)

    def _count_expiring(self, delta: int) -> None:
        self.expiring += delta
        if self.store is not None:
            self.store.expiring_docs += delta

    def next_cas(self, wall: float) -> int:
        """kv_engine's HLC: max(previous + 1, wall-clock ns with the low 16 bits cleared)."""
        self.hlc = max(self.hlc + 1, int(wall * 1e9) & ~0xFFFF)
        return self.hlc

    def live(self, key: tuple[int, bytes]) -> Item | None:
        it = self.docs.get(key)
        return it if it is not None and it.kind in ("m", "c") else None

    def rev_after(self, key: tuple[int, bytes]) -> int:
        old = self.docs.get(key)
        return 1 if old is None else old.rev + 1

    def append(self, key: tuple[int, bytes], kind: str, value: bytes, *, cas: int, rev: int, flags: int = 0,
               expiry: int = 0, datatype: int = 0, prepared: int = 0) -> Item:
        """One change at the next seqno, applied to the index at once."""
        self.sync()
        vb = self.vb
        it = Item(vb.high_seqno + 1, key[1], value, rev, cas, kind, datatype, prepared, key[0], flags, expiry, True)
        vb.mem.append(it)
        self._apply(it)
        self.locks.pop(key, None)                           # a new version is not locked
        self.applied = it.seqno
        return it

    def lock_of(self, key: tuple[int, bytes], wall: float) -> int | None:
        """The lock CAS of a locked document (a lock whose time is up is gone)."""
        lock = self.locks.get(key)
        if lock is None:
            return None
        if lock[1] <= wall:
            del self.locks[key]
            return None
        return lock[0]

    def expire(self, key: tuple[int, bytes], wall: float) -> Item:
        """The document expired: an expiration at a new seqno (kv_engine keeps the CAS clock
        moving; the tombstone's rev seqno is the next one)."""
        return self.append(key, "x", b"", cas=self.next_cas(wall), rev=self.rev_after(key))

    def find(self, key: tuple[int, bytes], wall: float) -> Item | None:
        """The live document, expiring it first if its time has come."""
        self.sync()
        it = self.live(key)
        if it is not None and it.expiry and it.expiry <= wall:
            self.expire(key, wall)
            return None
        return it

    def page(self, wall: float) -> int:
        """The expiry pager's pass over this vbucket: expire what is due. Returns how many."""
        self.sync()
        if not self.expiring:
            return 0
        due = [k for k, it in self.docs.items() if it.kind in ("m", "c") and it.expiry and it.expiry <= wall]
        for k in due:
            self.expire(k, wall)
        return len(due)


class KvStore:
    """The live documents of one bucket, an index per vbucket made when first used."""

    def __init__(self, bucket: Bucket, pager_interval: float = DEFAULT_PAGER_INTERVAL, wall_offset: float | None = None):
        self.bucket = bucket
        self.pager_interval = pager_interval
        self.wall_offset = time.time() - time.monotonic() if wall_offset is None else wall_offset
        self.index: list[VbIndex | None] = [None] * bucket.num_vbuckets
        self.pager_due: float | None = None
        self.writes = 0               # changes made through KV (transports wake streams on it)
        self.expiring_docs = 0        # live documents with an expiry, over every vbucket

    def vb(self, vbid: int) -> VbIndex:
        ix = self.index[vbid]
        if ix is None:
            ix = self.index[vbid] = VbIndex(self.bucket.vbuckets[vbid], self)
        ix.sync()
        return ix

    def wall(self, now: float) -> float:
        return now + self.wall_offset

    def absolute_expiry(self, expiry: int, now: float) -> int:
        """Couchbase's expiry field: 0 none, up to 30 days relative seconds, else absolute."""
        if expiry == 0:
            return 0
        if expiry <= RELATIVE_EXPIRY_MAX:
            return int(self.wall(now)) + expiry
        return expiry

    def expiring(self) -> bool:
        return self.expiring_docs > 0

    def deadline(self, now: float) -> float | None:
        """When the expiry pager next runs (None: nothing can expire)."""
        if not self.expiring():
            self.pager_due = None
            return None
        if self.pager_due is None:
            self.pager_due = now + self.pager_interval
        return self.pager_due

    def run_pager(self, now: float) -> int:
        """Expire every due document if the pager's time has come. Returns how many."""
        due = self.deadline(now)
        if due is None or now < due:
            return 0
        wall = self.wall(now)
        n = sum(ix.page(wall) for ix in self.index if ix is not None and ix.expiring)
        self.pager_due = now + self.pager_interval
        if n:
            self.writes += n
            self.bucket.generation += 1
        return n


def store_of(bucket: Any, server: Any = None) -> KvStore:
    """The bucket's KV store, made on first use (the server's `expiry_pager` interval); `bucket`: a
    generated Bucket, which gains the attribute `kv`."""
    st = getattr(bucket, "kv", None)
    if st is None:
        st = bucket.kv = KvStore(bucket, getattr(server, "expiry_pager", DEFAULT_PAGER_INTERVAL))
    return st
