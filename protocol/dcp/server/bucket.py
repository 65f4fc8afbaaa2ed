"""The producer's generated bucket, sans-IO: deterministic documents spread over the
vbuckets by Couchbase's key hash, per-vbucket history (pre-encoded disk items in one numpy
record array, memory checkpoints for live updates), failover tables with branch points, and
the exact rollback decision of DCP_DIGEST §6.2. Used by producer.py and cluster.py."""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Union

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from dcptool.protocol.dcp.server.manifest import Manifest

MAX_VBUCKETS = 1024

# --------------------------------------------------------------------------- rollback

def rollback_seqno(*, start: int, vb_uuid: int, snap_start: int, snap_end: int,
                   failover_log: Sequence[tuple[int, int]], high_seqno: int, purge_seqno: int = 0,
                   client_purge_seqno: int | None = None, strict: bool = False) -> int | None:
    """The producer's decision (DCP_DIGEST §6.2, kv_engine FailoverTable::needsRollback):
    None for no rollback, else the seqno to roll back to. failover_log is newest first."""
    if start == 0 and (not strict or vb_uuid == 0):
        return None
    if start < purge_seqno and start != 0 and client_purge_seqno != purge_seqno:
        return 0
    upper = None
    for i, (uuid, _seqno) in enumerate(failover_log):
        if uuid == vb_uuid:
            upper = failover_log[i - 1][1] if i > 0 else high_seqno
            break
    if upper is None:
        return 0
    if start == snap_start:
        snap_end = start
    if snap_end <= upper:
        return None
    if start == snap_end:
        snap_start = start
    return upper if upper < snap_start else snap_start


def vbucket_of(key: bytes, num_vbuckets: int) -> int:
    """Couchbase's key -> vbucket hash (CRC32, bits 16..30)."""
    return ((zlib.crc32(key) >> 16) & 0x7FFF) % num_vbuckets


# --------------------------------------------------------------------------- bucket

@dataclasses.dataclass(slots=True)
class Item:
    seqno: int
    key: bytes
    value: bytes
    rev: int
    cas: int
    kind: str = "m"        # m mutation, d deletion, x expiration; sync writes: p prepare, c commit, a abort
    datatype: int = 1      # JSON
    prepared: int = 0      # c, a: the seqno of the prepare they complete
    cid: int = 0           # collection id; sc / sd: a collection create / drop (producer_collections.py)
    flags: int = 0         # the client's item flags (KV writes, kv.py)
    expiry: int = 0        # absolute Unix time, 0 for none (KV writes)
    kv: bool = False       # written by a KV client: a failover never rewrites it (fail_over)


def _mutation_dtype(key_len: int, value_len: int) -> np.dtype:
    fields = [("magic", "u1"), ("opcode", "u1"), ("keylen", ">u2"), ("extlen", "u1"),
              ("datatype", "u1"), ("vbucket", ">u2"), ("bodylen", ">u4"), ("opaque", ">u4"),
              ("cas", ">u8"), ("by_seqno", ">u8"), ("rev_seqno", ">u8"), ("flags", ">u4"),
              ("expiration", ">u4"), ("lock_time", ">u4"), ("nmeta", ">u2"), ("nru", "u1"),
              ("key", f"V{key_len}")]
    if value_len:
        fields.append(("value", f"V{value_len}"))
    return np.dtype(fields)


# VBucket.encoded: per connection variant, its disk mutations pre-encoded (a record array,
# disk_records) or Snappy-compressed (blob, frame starts) under ("snappy", ...) (compress.py)
Encoded = Union[np.ndarray, tuple[bytes, npt.NDArray[np.int64]]]


class VBucket:
    """One vbucket: seqno == position + 1 over disk items then memory items."""

    def __init__(self, vbid: int, uuid: int, disk_keys: np.ndarray, disk_values: np.ndarray,
                 cas_base: int, checkpoint_items: int, disk_cids: np.ndarray | None = None):
        self.vbid = vbid
        self.failover_log: list[tuple[int, int]] = [(uuid, 0)]
        self.disk_keys = disk_keys            # (n, key_len) uint8
        self.disk_values = disk_values        # (n, value_len) uint8
        self.disk_high = len(disk_keys)
        # collection id of each disk item (all < 0x80: a one-byte LEB128 key prefix)
        self.disk_cids = disk_cids if disk_cids is not None else np.zeros(len(disk_keys), np.uint8)
        self.cas_base = cas_base
        self.mem: list[Item] = []             # seqnos disk_high+1 ... high
        self.checkpoint_items = checkpoint_items
        self.purge_seqno = 0
        self.durable_floor = 0                # last acknowledged durable write: never lost (kv.py)
        self.encoded: dict[tuple[object, ...], Encoded] = {}
        # each document's last rev seqno up to seqno `_revs_at` (rev_after), built when first asked
        self._revs: dict[tuple[int, bytes], int] | None = None
        self._revs_at = 0

    @property
    def high_seqno(self) -> int:
        return self.disk_high + len(self.mem)

    @property
    def uuid(self) -> int:
        return self.failover_log[0][0]

    def disk_item(self, seqno: int) -> Item:
        i = seqno - 1
        return Item(seqno, bytes(self.disk_keys[i]), bytes(self.disk_values[i]), 1, self.cas_base + seqno,
                    cid=int(self.disk_cids[i]))

    def items(self) -> Iterator[Item]:
        """Every item of the history, in seqno order (tests and tools)."""
        for s in range(1, self.disk_high + 1):
            yield self.disk_item(s)
        yield from self.mem

    def latest(self) -> dict[bytes, Item]:
        out = {}
        for it in self.items():
            out[it.key] = it
        return out

    def disk_records(self, collections: bool, no_value: bool, json: bool) -> np.ndarray:
        """The pre-encoded disk mutations (opaque 0) for one connection variant."""
        variant = (collections, no_value, json)
        hit = self.encoded.get(variant)
        if isinstance(hit, np.ndarray) and len(hit) >= self.disk_high:
            return hit[:self.disk_high]
        n = self.disk_high
        keys = self.disk_keys[:n]
        if collections:  # the collection id as a one-byte LEB128 prefix
            keys = np.concatenate([self.disk_cids[:n, None].astype(np.uint8), keys], axis=1)
        kl = keys.shape[1]
        vl = 0 if no_value else self.disk_values.shape[1]
        recs = np.zeros(n, dtype=_mutation_dtype(kl, vl))
        recs["magic"] = 0x80
        recs["opcode"] = 0x57
        recs["keylen"] = kl
        recs["extlen"] = 31
        recs["datatype"] = 1 if (json and not no_value) else 0
        recs["vbucket"] = self.vbid
        recs["bodylen"] = 31 + kl + vl
        seqnos = np.arange(1, n + 1, dtype=np.uint64)
        recs["cas"] = np.uint64(self.cas_base) + seqnos
        recs["by_seqno"] = seqnos
        recs["rev_seqno"] = 1
        if n:
            recs["key"] = np.ascontiguousarray(keys).view(f"V{kl}").reshape(n)
            if vl:
                recs["value"] = np.ascontiguousarray(self.disk_values[:n]).view(f"V{vl}").reshape(n)
        self.encoded[variant] = recs
        return recs

    def fail_over(self, new_uuid: int, keep: int, rng: random.Random, now_cas: int) -> int:
        """Promote a replica that had only `keep` seqnos: a new branch at R = keep; the lost
        tail is rewritten (same keys, new values) on the new branch. Returns R.
        An acknowledged durable write is on a majority of nodes, so the promoted replica
        has it: R is never below `durable_floor`. What KV clients wrote and lost is lost
        (their documents go back to the version before), never rewritten."""
        r = max(0, min(max(keep, self.durable_floor), self.high_seqno))
        # (a lost collection event is not rewritten: the manifest change stays made)
        lost = [(it.key, it.cid) for it in self.items() if it.seqno > r and it.kind not in ("sc", "sd")
                and not it.kv]
        if r < self.disk_high:
            self.disk_high = r
            self.mem = []
        else:
            self.mem = self.mem[: r - self.disk_high]
        self._revs = None     # the lost versions' rev seqnos go with them
        # kv_engine FailoverTable::createEntry: branches diverged from (entries above R) go
        self.failover_log = [e for e in self.failover_log if e[1] <= r]
        self.failover_log.insert(0, (new_uuid, r))
        del self.failover_log[25:]
        for key, cid in lost:
            self.append(key, b'{"branch":%d,"r":%d}' % (len(self.failover_log), rng.randrange(1 << 30)),
                        "m", now_cas, cid)
        return r

    def turn_active(self, new_uuid: int) -> None:
        """Takeover: kv_engine adds a failover entry at the high seqno whenever a vbucket
        turns active from another state; nothing is lost, so nobody rolls back."""
        self.failover_log.insert(0, (new_uuid, self.high_seqno))
        del self.failover_log[25:]

    def rev_after(self, key: bytes, cid: int = 0) -> int:
        """The rev seqno of the next change of (cid, key), as kv_engine gives it: 1 for a key
        this vbucket never held, else the last version's + 1 (a tombstone's too). The index
        follows every item appended since it was last asked (KV writes append directly)."""
        revs = self._revs
        if revs is None:
            revs = {}
            cids = self.disk_cids
            for i in range(self.disk_high):     # every disk item is its key's first version
                revs[(int(cids[i]), bytes(self.disk_keys[i]))] = 1
            self._revs, self._revs_at = revs, self.disk_high
        if self._revs_at < self.high_seqno:
            for it in self.mem[max(0, self._revs_at - self.disk_high):]:
                if it.kind in ("m", "d", "x", "c"):   # a prepare or an abort leaves the document as it was
                    revs[(it.cid, it.key)] = it.rev
            self._revs_at = self.high_seqno
        return revs.get((cid, key), 0) + 1

    def append(self, key: bytes, value: bytes, kind: str, cas: int, cid: int = 0) -> Item:
        rev = self.rev_after(key, cid) if kind in ("m", "d", "x") else 1
        it = Item(self.high_seqno + 1, key, value if kind in ("m", "sc", "sd") else b"", rev, cas, kind,
                  1 if kind == "m" else 0, cid=cid)
        self.mem.append(it)
        return it

    def append_sync(self, key: bytes, value: bytes, cas: int, commit: bool, cid: int = 0) -> None:
        """A durable write: a prepare, then (at the next seqno) its commit or abort. The
        commit carries the prepare's value, cas and rev seqno (what a consumer without sync
        writes gets as the mutation at the commit seqno)."""
        rev = self.rev_after(key, cid)
        p = Item(self.high_seqno + 1, key, value, rev, cas, "p", 1, cid=cid)
        self.mem.append(p)
        self.mem.append(Item(p.seqno + 1, key, value if commit else b"", rev, cas, "c" if commit else "a",
                             1 if commit else 0, p.seqno, cid=cid))

    def checkpoint_end(self, seqno: int) -> int:
        """Last seqno of the memory checkpoint holding seqno."""
        c = self.checkpoint_items
        return self.disk_high + ((seqno - self.disk_high - 1) // c + 1) * c


class Bucket:
    """A generated bucket: `items` documents spread over `num_vbuckets` by the key hash,
    values deterministic from `seed`. Frames of disk documents are `value_size` + 67 bytes
    (128 with the default 61)."""

    def __init__(self, name: str = "default", num_vbuckets: int = 64, items: int = 10_000,
                 seed: int = 0, value_size: int = 61, checkpoint_items: int = 100, manifest: Manifest | None = None):
        if not 1 <= num_vbuckets <= MAX_VBUCKETS:
            raise ValueError(f"vbuckets must be 1..{MAX_VBUCKETS}")
        value_size = max(value_size, 24)
        from dcptool.protocol.dcp.server.manifest import Manifest
        self.manifest = manifest if manifest is not None else Manifest()
        self.name = name
        self.num_vbuckets = num_vbuckets
        self.seed = seed
        self.rng = random.Random(seed)
        self.next_doc = items
        keys = np.frombuffer(b"".join(b"doc-%08d" % i for i in range(items)), np.uint8).reshape(items, 12)
        vbs = np.array([vbucket_of(bytes(keys[i]), num_vbuckets) for i in range(items)], dtype=np.int64) \
            if items else np.zeros(0, np.int64)
        values = self._values(items, value_size)
        order = np.argsort(vbs, kind="stable")
        bounds = np.searchsorted(vbs[order], np.arange(num_vbuckets + 1))
        self.cas_base = 0x1800_0000_0000_0000 + (seed % 1000) * 1_000_000_000
        self.vbuckets: list[VBucket] = []
        start_ids = np.array(self.manifest.start_ids, np.uint8)
        cids = start_ids[np.arange(items) % len(start_ids)]
        for vb in range(num_vbuckets):
            sel = order[bounds[vb]:bounds[vb + 1]]
            uuid = self.rng.randrange(1, 1 << 48)
            self.vbuckets.append(VBucket(vb, uuid, keys[sel], values[sel],
                                         self.cas_base + vb * 10_000_000_000, checkpoint_items, cids[sel]))
        self.live_keys: list[list[bytes]] | None = None
        self.sync_ratio = 0.0      # share of live mutations made as sync writes (producer_sync.py)
        self.cas_clock = self.cas_base + (1 << 58)
        self.generation = 0        # bumps when items are added (wakes idle streams)

    def _values(self, n: int, size: int) -> np.ndarray:
        """`{"n":"NNNNNNNN","r":"<hex>"}` exactly `size` bytes, hex from the seeded RNG."""
        out = np.zeros((n, size), np.uint8)
        if n == 0:
            return out
        gen = np.random.default_rng(self.seed)
        out[:, 0:6] = np.frombuffer(b'{"n":"', np.uint8)
        digits = np.arange(n, dtype=np.int64)
        for j in range(8):
            out[:, 13 - j] = 48 + (digits // 10 ** j) % 10
        out[:, 14:21] = np.frombuffer(b'","r":"', np.uint8)
        hexchars = np.frombuffer(b"0123456789abcdef", np.uint8)
        out[:, 21:size - 2] = hexchars[gen.integers(0, 16, size=(n, size - 23))]
        out[:, size - 2:] = np.frombuffer(b'"}', np.uint8)
        return out

    def next_cas(self) -> int:
        self.cas_clock += 1
        return self.cas_clock

    def mutate_random(self, count: int) -> None:
        """Live traffic: updates of existing documents (most), new documents, deletions and
        expirations, on vbuckets chosen by the seeded RNG."""
        if self.live_keys is None:
            self.live_keys = [[bytes(k) for k in vb.disk_keys[:vb.disk_high]] for vb in self.vbuckets]
        rng = self.rng
        for _ in range(count):
            roll = rng.random()
            if roll < 0.15:
                key = b"doc-%08d" % self.next_doc
                self.next_doc += 1
                vb = vbucket_of(key, self.num_vbuckets)
                self.live_keys[vb].append(key)
                kind = "m"
            else:
                vb = rng.randrange(self.num_vbuckets)
                keys = self.live_keys[vb]
                if not keys:
                    continue
                key = keys[rng.randrange(len(keys))]
                kind = "m" if roll < 0.85 else ("d" if roll < 0.95 else "x")
            value = b'{"u":%d,"r":"%08x"}' % (self.vbuckets[vb].high_seqno + 1, rng.randrange(1 << 32))
            cid = self.manifest.cid_of_key(key)
            if cid and cid not in self.manifest.live_ids():
                continue    # its collection was dropped: nothing is written to it any more
            if kind == "m" and self.sync_ratio and rng.random() < self.sync_ratio:
                self.vbuckets[vb].append_sync(key, value, self.next_cas(), rng.random() < 0.8, cid)
                continue
            self.vbuckets[vb].append(key, value, kind, self.next_cas(), cid)
        self.generation += 1

    def fail_over_all(self, loss: int) -> dict[int, int]:
        """Every vbucket fails over, losing its last `loss` seqnos: {vb: branch seqno}."""
        out = {}
        for vb in self.vbuckets:
            out[vb.vbid] = vb.fail_over(self.rng.randrange(1, 1 << 48), vb.high_seqno - loss, self.rng,
                                        self.next_cas())
        self.generation += 1
        return out
