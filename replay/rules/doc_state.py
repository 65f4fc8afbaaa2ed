"""The per-document state of the DCP rules: the last surviving change of each document
(vbucket, collection_id, key), kept columnar and compact.

Each document gets a dense dictionary code (0, 1, 2, ... in order of first appearance). Its
fixed-width fields live in one packed numpy record array indexed by that code (`RECORD`, 68
bytes: a change overwrites a document with one record copy), its owner (vbucket,
collection_id) and hash in a uint64 pair array (16 bytes, read together when probing), its
key in a few Arrow large_binary arrays (codes in order), and an open-addressing hash table
of int32 slots (load at most 1/4) finds a document's code from a 64-bit hash of (vbucket,
collection_id, key). The table is exact: a slot matches only when owner and the key bytes
are equal, so documents whose hashes collide keep codes of their own. No Python object
exists per document: about 120 bytes a document in all.

`prepare_changes` (any thread, no state) keeps the last change of each document of a chunk
and hashes them; `DocumentStore.apply` (in frame order) stores them; `DocumentStore.table`
builds the canonical `documents` table a range of vbuckets at a time.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dcptool.replay.rules import tables as T
from dcptool.replay.rules.columns import as_numpy, dict_codes, ts_array, ts_ns

OPS = ("mutation", "deletion", "expiration")     # a document's op code is its index here
STATES = ("live", "deleted", "expired")          # the `state` of each op code
# `owner` is (collection_id + 1, or 0 when null) << 16 | vbucket
RECORD = np.dtype([("by_seqno", "<i8"), ("rev_seqno", "<i8"), ("cas", "<u8"),
                   ("frame_no", "<i8"), ("ts", "<i8"), ("seq", "<i8"), ("item_flags", "<u4"),
                   ("expiration", "<u4"), ("value_len", "<u4"), ("capture", "<u4"), ("valid", "<u2"),
                   ("op", "u1"), ("datatype", "u1")])
_RAW = np.dtype((np.void, RECORD.itemsize))
_PAIR = np.dtype((np.void, 16))
# the nullable fields: bit i of `valid` is set when NULLABLE[i] is not null
NULLABLE = ("by_seqno", "rev_seqno", "cas", "datatype", "item_flags", "expiration", "value_len",
            "frame_no", "ts")
# documents per vbucket range when the table is built (bounds the memory of the sort)
TABLE_ROWS = 1 << 18

_rng = np.random.default_rng(0x5EED_D0C5)
# simple tabulation hashing: a random 64-bit word per (byte position mod 64, byte value)
_TAB = _rng.integers(0, 2**64 - 1, 64 * 256, dtype=np.uint64, endpoint=True)
_NULL_KEY = np.uint64(0x9E3779B97F4A7C15)
_HASH_BYTES = 1 << 21     # key bytes hashed at a time (bounds the temporaries)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit moves every output bit."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _one_array(a) -> pa.Array:
    return (a.combine_chunks() if a.num_chunks != 1 else a.chunk(0)) if isinstance(a, pa.ChunkedArray) else a


def key_hashes(keys) -> np.ndarray:
    """A 64-bit hash per binary value (null: a constant)."""
    keys = _one_array(keys).cast(pa.large_binary())
    n = len(keys)
    out = np.zeros(n, np.uint64)
    if n == 0:
        return out
    bufs = keys.buffers()
    offs = np.frombuffer(bufs[1], np.int64, n + 1, keys.offset * 8)
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None and bufs[2].size else np.zeros(0, np.uint8)
    lo = 0
    while lo < n:   # groups of keys with at most _HASH_BYTES bytes (or a single longer key)
        hi = min(max(int(np.searchsorted(offs, offs[lo] + _HASH_BYTES, "right")) - 1, lo + 1), n)
        b0, b1 = int(offs[lo]), int(offs[hi])
        starts = (offs[lo:hi] - b0).astype(np.int32)
        lens = np.diff(offs[lo:hi + 1]).astype(np.int32)
        if b1 > b0:
            ne = np.flatnonzero(lens)
            mark = np.zeros(b1 - b0, np.int32)
            mark[starts[ne]] = starts[ne]
            pos = np.arange(b1 - b0, dtype=np.int32)
            pos -= np.maximum.accumulate(mark)          # each byte's position in its key
            pos &= 63
            pos <<= 8
            pos |= data[b0:b1]
            out[lo + ne] = np.bitwise_xor.reduceat(_TAB[pos], starts[ne])
        out[lo:hi] ^= _mix(lens.astype(np.uint64))
        lo = hi
    if keys.null_count:
        out[~as_numpy(keys.is_valid(), dtype=bool)] = _NULL_KEY
    return out


def owners(vb: np.ndarray, cid: np.ndarray, cid_valid: np.ndarray) -> np.ndarray:
    return (np.where(cid_valid, cid.astype(np.int64) + 1, 0) << 16) | vb.astype(np.int64)


def doc_hashes(owner: np.ndarray, kh: np.ndarray) -> np.ndarray:
    """The hash of each document from its owner (vbucket, collection_id) and key hash."""
    return _mix(kh ^ _mix(owner))


def last_change_rows(owner: np.ndarray, kidx: np.ndarray, nkeys: int) -> np.ndarray:
    """Of rows in frame order (owner, key code; `kidx` codes keys exactly), the last row of
    each document, in frame order."""
    # a key almost always lives in one (vbucket, collection): then the key's code is the document
    seen = np.full(nkeys, -1, np.int64)
    seen[kidx] = owner
    if (seen[kidx] == owner).all():
        doc, ndocs = kidx, nkeys
    else:
        _, owner_code = np.unique(owner, return_inverse=True)
        _, doc = np.unique(kidx * (int(owner_code.max()) + 1) + owner_code, return_inverse=True)
        ndocs = int(doc.max()) + 1
    last = np.full(ndocs, -1, np.int64)
    np.maximum.at(last, doc, np.arange(len(kidx)))
    is_last = np.zeros(len(kidx), bool)
    is_last[last[last >= 0]] = True
    return np.flatnonzero(is_last)


class Changes:
    """What `prepare_changes` found in a chunk: the last change of each document, in frame
    order: records, keys, hashes, and the chunk's capture ids (`capture` holds codes into
    `cap_words`, -1 for null)."""
    __slots__ = ("rec", "owner", "keys", "h", "cap_words")


def prepare_changes(chunk: pa.Table, rows: np.ndarray) -> Changes | None:
    """The changes `rows` of `chunk` (mutation, deletion, expiration, not undone; frame
    order) reduced to the last one per document. Needs no state: any thread."""
    if len(rows) == 0:
        return None
    keycol = _one_array(chunk.column("key"))
    enc = pc.dictionary_encode(keycol)       # the other rows' keys are few or null: cheap
    nk = len(enc.dictionary) + 1
    kidx = as_numpy(enc.indices, fill=nk - 1, dtype=np.int64)[rows]
    cid_col = chunk.column("collection_id")
    owner = owners(as_numpy(chunk.column("vbucket"), dtype=np.int64)[rows],
                   as_numpy(cid_col, fill=0, dtype=np.int64)[rows], as_numpy(cid_col.is_valid(), dtype=bool)[rows])
    sel = last_change_rows(owner, kidx, nk)
    r = rows[sel]
    c = Changes()
    c.h = doc_hashes(owner[sel], np.append(key_hashes(enc.dictionary), _NULL_KEY)[kidx[sel]])
    c.keys = keycol.take(pa.array(r)).cast(pa.large_binary())
    del enc, kidx
    rec = c.rec = np.empty(len(r), RECORD)
    c.owner = owner[sel]
    valid = np.zeros(len(r), np.uint16)
    for name in NULLABLE:
        col = chunk.column(name)
        values = ts_ns(col) if name == "ts" else as_numpy(col, fill=0, dtype=RECORD[name])
        rec[name] = values[r]
        bit = np.uint16(1 << NULLABLE.index(name))
        valid |= np.where(as_numpy(col.is_valid(), dtype=bool)[r], bit, np.uint16(0)) if col.null_count else bit
    rec["valid"] = valid
    rec["seq"] = as_numpy(chunk.column("_seq"), dtype=np.int64)[r]
    ops, words = dict_codes(chunk.column("op"))
    rec["op"] = np.array([OPS.index(w) if w in OPS else 0 for w in words] + [0], np.uint8)[ops[r]]
    caps, c.cap_words = dict_codes(chunk.column("capture_id"))
    rec["capture"] = caps[r].astype(np.uint32)      # -1 (null) wraps: apply maps it
    return c


class DocumentStore:
    """The last surviving change of each document, one code per document (see the module)."""

    def __init__(self):
        self.n = 0
        self._rec = np.empty(0, RECORD)
        self._oh = np.empty((0, 2), np.uint64)       # per code: owner, hash (probed together)
        self._slots = np.zeros(1 << 10, np.int32)    # code + 1; 0 is an empty slot
        self._keys: list[pa.Array] = []              # large_binary, codes in order, sizes halving
        self.captures: list[str | None] = []         # `capture` codes
        self._capture_code: dict = {}

    def nbytes(self) -> int:
        """Bytes held for the documents (records and hashes at their capacity, keys, slots)."""
        return self._rec.nbytes + self._oh.nbytes + self._slots.nbytes + sum(k.nbytes for k in self._keys)

    # -- the hash table -------------------------------------------------------------------
    def _grow(self, need: int) -> None:
        cap = len(self._rec)
        if need > cap:
            cap = max(need, 2 * cap, 1 << 8)
            rec = np.empty(cap, RECORD)      # pages not written yet cost no memory
            rec.view(_RAW)[:self.n] = self._rec.view(_RAW)[:self.n]
            oh = np.empty((cap, 2), np.uint64)
            oh[:self.n] = self._oh[:self.n]
            self._rec, self._oh = rec, oh
        if 4 * need > len(self._slots):         # load factor at most 1/4: short probes
            size = len(self._slots)
            while 4 * need > size:
                size *= 2
            self._slots = np.zeros(size, np.int32)
            self._place(np.arange(self.n, dtype=np.int64))

    def _place(self, codes: np.ndarray) -> None:
        """Puts `codes` (distinct, not in the table) into free slots (linear probing)."""
        mask = len(self._slots) - 1
        slot = (self._oh[codes, 1] & np.uint64(mask)).astype(np.int64)
        todo = np.arange(len(codes))
        while len(todo):
            s = slot[todo]
            free = self._slots[s] == 0
            cand = todo[free]
            self._slots[s[free]] = codes[cand] + 1          # of several aiming at a slot, one wins
            won = self._slots[slot[cand]] == codes[cand] + 1
            todo = np.concatenate([todo[~free], cand[~won]])
            slot[todo] = (slot[todo] + 1) & mask

    def _add_keys(self, keys: pa.Array) -> None:
        # one big array and a tail of newer ones: a take from one array is three times faster
        # than from many; the tail joins the big one when it reaches a quarter of it (each key
        # is copied a few times in all)
        self._keys.append(keys)
        tail = sum(len(k) for k in self._keys[1:])
        if len(self._keys) > 1 and (4 * tail >= len(self._keys[0]) or len(self._keys) > 8):
            if 4 * tail >= len(self._keys[0]):
                self._keys = [pa.concat_arrays(self._keys)]
            else:
                self._keys = [self._keys[0], pa.concat_arrays(self._keys[1:])]

    def _key_array(self) -> pa.ChunkedArray:
        return pa.chunked_array(self._keys, pa.large_binary())

    def _stored_keys(self, codes: np.ndarray) -> tuple[np.ndarray, pa.Array]:
        """The keys of `codes`, in an order of their own: (that order, the keys)."""
        if len(self._keys) == 1:
            return np.arange(len(codes)), self._keys[0].take(pa.array(codes))
        n0 = len(self._keys[0])
        in_main = codes < n0
        order = np.concatenate([np.flatnonzero(in_main), np.flatnonzero(~in_main)])
        tail = pa.chunked_array(self._keys[1:], pa.large_binary()).take(pa.array(codes[~in_main] - n0))
        return order, pa.concat_arrays([self._keys[0].take(pa.array(codes[in_main])), *tail.chunks])

    def _find(self, h: np.ndarray, owner: np.ndarray, keys: pa.Array) -> np.ndarray:
        """The code of each document (-1: not in the store)."""
        found = np.full(len(h), -1, np.int64)
        if self.n == 0 or len(h) == 0:
            return found
        mask = len(self._slots) - 1
        slot = (h & np.uint64(mask)).astype(np.int64)
        rows = np.arange(len(h))
        oh = self._oh.view(_PAIR)[:, 0]
        while len(rows):
            # probe for a slot with the same hash and owner...
            todo = rows
            while len(todo):
                c = self._slots[slot[todo]].astype(np.int64) - 1
                todo, c = todo[c >= 0], c[c >= 0]         # an empty slot: not in the store
                r = oh[c].view(np.uint64).reshape(-1, 2)     # one copy of 16 bytes a row
                same = (r[:, 1] == h[todo]) & (r[:, 0] == owner[todo].view(np.uint64))
                found[todo[same]] = c[same]
                todo = todo[~same]
                slot[todo] = (slot[todo] + 1) & mask
            # ...then compare the keys of all at once; a match by hash alone probes on
            i = np.flatnonzero(found[rows] >= 0)
            order, theirs = self._stored_keys(found[rows[i]])
            i = rows[i[order]]
            mine = keys.take(pa.array(i))
            eq = pc.fill_null(pc.equal(mine, theirs), False)
            eq = pc.or_(eq, pc.and_(mine.is_null(), theirs.is_null())) if mine.null_count else eq
            rows = i[~as_numpy(eq, dtype=bool)]
            found[rows] = -1
            slot[rows] = (slot[rows] + 1) & mask
        return found

    # -- changes ------------------------------------------------------------------------
    def apply(self, c: Changes | None) -> None:
        """The documents of `c` take their changes (chunks in frame order)."""
        if c is None:
            return
        rec = c.rec
        code = self._find(c.h, c.owner, c.keys)
        new = np.flatnonzero(code < 0)
        if len(new):     # documents of a chunk are distinct: each new one gets its own code
            self._grow(self.n + len(new))
            codes = np.arange(self.n, self.n + len(new), dtype=np.int64)
            self._oh[codes, 0] = c.owner[new].view(np.uint64)
            self._oh[codes, 1] = c.h[new]
            self._add_keys(c.keys.take(pa.array(new)))
            self.n += len(new)
            self._place(codes)
            code[new] = codes
        lut = np.array([self._capture(w) for w in c.cap_words] + [self._capture(None)], np.uint32)
        rec["capture"] = lut[rec["capture"].astype(np.int32)]
        # one copy of a whole record per document (a structured assignment is 15 times slower)
        self._rec.view(_RAW)[code] = rec.view(_RAW)

    def _capture(self, word) -> int:
        if word not in self._capture_code:
            self._capture_code[word] = len(self.captures)
            self.captures.append(word)
        return self._capture_code[word]

    def lookup(self, vb: np.ndarray, cid: np.ndarray, cid_valid: np.ndarray, keys) -> np.ndarray:
        """The code of each (vbucket, collection_id, key) (-1: no such document)."""
        keys = _one_array(keys).cast(pa.large_binary())
        owner = owners(vb, cid, cid_valid)
        return self._find(doc_hashes(owner, key_hashes(keys)), owner, keys)

    def _owner(self) -> np.ndarray:
        return self._oh[:self.n, 0].view(np.int64)

    def field(self, name: str) -> np.ndarray:
        """A field of every document, by code (`vbucket`, `collection_id` or a RECORD field)."""
        owner = self._owner()
        if name == "vbucket":
            return (owner & 0xFFFF).astype(np.uint16)
        if name == "collection_id":
            return ((owner >> 16) - 1).astype(np.uint32)
        return self._rec[name][:self.n]

    def valid(self, name: str) -> np.ndarray:
        """Whether a nullable field is not null, by code."""
        if name == "collection_id":
            return (self._owner() >> 16) > 0
        return (self._rec["valid"][:self.n] & np.uint16(1 << NULLABLE.index(name))).astype(bool)

    def state_counts(self) -> dict[str, np.ndarray]:
        """Documents per vbucket (65536 counts) in each state."""
        vb, op = self.field("vbucket"), self.field("op")
        return {s: np.bincount(vb[op == i], minlength=1 << 16) for i, s in enumerate(STATES)}

    # -- the table ----------------------------------------------------------------------
    def table(self) -> pa.Table:
        """The canonical `documents` table; the store is empty afterwards. Built a range of
        vbuckets at a time (each sorted on its own), then one column at a time."""
        schema = T.DCP_TABLES["documents"][0]
        if self.n == 0:
            self.__init__()
            return schema.empty_table()
        vb = self.field("vbucket")
        order = np.argsort(vb, kind="stable")
        starts = np.searchsorted(vb[order], np.arange(1 << 16))   # where each vbucket begins
        cuts = np.unique(np.searchsorted(starts, np.arange(0, self.n, TABLE_ROWS), "right") - 1)
        bounds = [int(starts[v]) for v in cuts] + [self.n]
        keys = self._key_array()
        captures = pa.array(self.captures, pa.string())
        states = pa.array(STATES, pa.string())
        parts = []    # per range: its columns in schema order
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            t = T.canonical("dcp", "documents", self._rows(order[lo:hi], keys, captures, states))
            parts.append([t.column(i).chunk(0) for i in range(t.num_columns)])
        self.__init__()       # the state is no longer needed: free it before the copies below
        del order, keys, vb
        cols = []
        for i in range(len(schema)):   # one column at a time: the copy costs one column
            cols.append(pa.concat_arrays([p[i] for p in parts]))
            for p in parts:
                p[i] = None
        return pa.Table.from_arrays(cols, schema=schema)

    def _rows(self, idx: np.ndarray, keys: pa.ChunkedArray, captures: pa.Array, states: pa.Array) -> pa.Table:
        rec = self._rec[idx]
        owner = self._oh[idx, 0].view(np.int64)
        out = {"vbucket": pa.array((owner & 0xFFFF).astype(np.uint16))}
        cid = owner >> 16
        out["collection_id"] = pa.array((cid - 1).astype(np.uint32), mask=None if (cid > 0).all() else cid == 0)
        for name in NULLABLE:
            ok = (rec["valid"] & np.uint16(1 << NULLABLE.index(name))).astype(bool)
            values = np.ascontiguousarray(rec[name])
            out[name] = ts_array(values, ok) if name == "ts" else pa.array(values, mask=None if ok.all() else ~ok)
        out["key"] = _one_array(keys.take(pa.array(idx))).cast(pa.binary())
        out["state"] = states.take(pa.array(rec["op"]))
        out["capture_id"] = captures.take(pa.array(rec["capture"]))
        return pa.table(out)
