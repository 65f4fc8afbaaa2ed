"""Columnar decoding of a batch of DCP frames for captures: frame boundaries in one tight
loop, then every fixed-offset header and extras field gathered with numpy for the whole
batch. The common data frames (mutation, deletion, expiration, snapshot marker V1, seqno
advanced, system event, stream end, noop) never become Python objects; every other frame
takes the message decoder (messages.decode + to_row), so both paths give the same columns.

Output: a dict of column name -> numpy values with a validity mask, plus slices
(start, length) into the buffer for the binary columns, ready for zero-copy Arrow arrays.
"""

from __future__ import annotations

import array
import struct
from typing import Any

import numpy as np
import numpy.typing as npt

from dcptool.protocol.dcp.wire import messages
from dcptool.protocol.dcp.wire.constants import (
    ALL_MAGICS,
    DEFAULT_MAX_BODY,
    HEADER_LEN,
    Opcode,
)
from dcptool.protocol.dcp.wire.frames import parse_frame
from dcptool.protocol.errors import ErrorCode, RemoteError

_Arr = npt.NDArray[Any]                     # a column, mask, offsets or positions array
_Buf = bytes | bytearray | memoryview       # a receive buffer (or a capture's bytes)
# the header fields of a batch (_header): magic, flex, framing extras, key, extras, body lengths
_Fields = tuple[_Arr, _Arr, _Arr, _Arr, _Arr, _Arr]

_BODYLEN = struct.Struct(">I").unpack_from
_MAGIC_OK = bytes(1 if i in ALL_MAGICS else 0 for i in range(256))

# numeric capture columns produced here, with their numpy dtypes
NUMERIC = {
    "magic": np.uint8, "opcode": np.uint8, "status": np.uint16, "vbucket": np.uint16,
    "opaque": np.uint32, "cas": np.uint64, "datatype": np.uint8, "stream_id": np.uint16,
    "collection_id": np.uint32, "value_len": np.uint32, "by_seqno": np.int64,
    "rev_seqno": np.int64, "item_flags": np.uint32, "expiration": np.uint32,
    "lock_time": np.uint32, "delete_time": np.uint32, "snap_start": np.int64,
    "snap_end": np.int64, "snap_flags": np.uint32, "max_visible_seqno": np.int64,
    "high_completed_seqno": np.int64, "purge_seqno": np.int64, "high_prepared_seqno": np.int64,
    "stream_end_reason": np.uint32, "rollback_seqno": np.int64, "req_flags": np.uint32,
    "req_start_seqno": np.int64, "req_end_seqno": np.uint64, "req_vbucket_uuid": np.uint64,
    "req_snap_start": np.int64, "req_snap_end": np.int64, "system_event_id": np.uint32,
}
OBJECT = ("snap_version", "decode_error", "failover_log")


# A backfill is long runs of frames of one length (same key and value sizes). After
# _RUN_MIN equal lengths in a row the scan stops reading length fields one at a time and
# compares the whole run at once through a strided view of the length field (no copy);
# mixed lengths never get there and pay one counter per frame.
_RUN_MIN = 16
_RUN_FIRST = 64


def _run_length(buf: _Buf, pos: int, length: int, most: int) -> int:
    """How many frames of `length` bytes follow one another from pos (at most `most`)."""
    body = length - HEADER_LEN
    done, step = 0, _RUN_FIRST
    while done < most:
        k = min(step, most - done)
        lens = np.ndarray(shape=(k,), dtype=">u4", buffer=buf, offset=pos + done * length + 8,
                          strides=(length,))
        same = lens == body
        if not same.all():
            return done + int(same.argmin())
        done += k
        step *= 4
    return done


def scan(buf: _Buf, max_body: int = DEFAULT_MAX_BODY, start: int = 0) -> tuple[_Arr, _Arr, int, RemoteError | None]:
    """Boundaries of the whole frames in buf[start:]: (offsets, lengths, consumed, error).

    A short tail is not consumed; a bad magic, a length above max_body or inconsistent
    lengths stop the scan with a RemoteError and every frame before it returned."""
    offs = array.array("q")   # becomes the numpy offsets without a copy
    append = offs.append
    pos, n = start, len(buf)
    err: RemoteError | None = None
    last, same = -1, 0
    while pos + HEADER_LEN <= n:
        bl = _BODYLEN(buf, pos + 8)[0]
        if bl > max_body:
            err = RemoteError(ErrorCode.BODY_TOO_LARGE,
                              f"body length {bl} above the cap of {max_body} bytes at byte {pos}")
            break
        end = pos + HEADER_LEN + bl
        if end > n:
            break
        if bl != last:
            last, same = bl, 0
        elif same < _RUN_MIN:
            same += 1
        else:
            size = end - pos
            k = _run_length(buf, pos, size, (n - pos) // size)
            offs.frombytes(np.arange(pos, pos + k * size, size, dtype=np.int64).tobytes())
            pos += k * size
            same = 0
            continue
        append(pos)
        pos = end
    if pos + HEADER_LEN <= n and not _MAGIC_OK[buf[pos]]:
        # the scan stopped on a header that is no header: that, not its length, is the error
        err = RemoteError(ErrorCode.BAD_MAGIC, f"bad magic 0x{buf[pos]:02x} at byte {pos}")
    offsets = np.frombuffer(offs, dtype=np.int64) if len(offs) else np.zeros(0, dtype=np.int64)
    lengths = np.diff(np.append(offsets, pos)) if len(offsets) else np.zeros(0, dtype=np.int64)
    if len(offsets):
        # the loop trusted every length field; the first bad magic or inconsistent header
        # ends the batch there, and its error replaces any later one
        h = records(_u8(buf), offsets, HEADER)
        bad_magic = np.nonzero(np.frombuffer(_MAGIC_OK, np.uint8)[h["magic"]] == 0)[0]
        fields = _header(h)
        _, _, fe, kl, el, bl = fields
        bad = np.nonzero(fe + el + kl > bl)[0]
        bad_len = int(bad[0]) if len(bad) else None
        candidates = ([int(bad_magic[0])] if len(bad_magic) else []) + ([bad_len] if bad_len is not None else [])
        first = min(candidates, default=None)
        if first is not None:
            p = int(offsets[first])
            if len(bad_magic) and int(bad_magic[0]) == first:
                err = RemoteError(ErrorCode.BAD_MAGIC, f"bad magic 0x{buf[p]:02x} at byte {p}")
            else:
                err = RemoteError(ErrorCode.BAD_LENGTHS,
                                  f"extras, key and framing extras exceed the body at byte {p}")
            offsets, lengths, pos = offsets[:first], lengths[:first], p
        else:
            _remember(offsets, h, fields)
    return offsets, lengths, pos - start, err


# The headers scan gathered, for the decoder and the consumer that get the same frames next
# (the transport hands both scan's own `offsets` array): one gather of the 24-byte headers per
# receive, not three. Keyed by the identity of that array, which the entry keeps alive; its
# arrays are read-only. A batch with other offsets gathers its own.
_last_headers: tuple[_Arr, _Arr, _Fields] | None = None


def _remember(offsets: _Arr, h: _Arr, fields: _Fields) -> None:
    global _last_headers
    offsets.flags.writeable = False
    h.flags.writeable = False
    for a in fields:
        a.flags.writeable = False
    _last_headers = (offsets, h, fields)


def headers(buf: _Buf, offsets: _Arr) -> tuple[_Arr, _Fields]:
    """(records of HEADER, _header fields) of the frames at offsets of buf: scan's when
    `offsets` is the array scan returned for buf, else gathered now."""
    last = _last_headers
    if last is not None and last[0] is offsets:
        return last[1], last[2]
    h = records(_u8(buf), offsets, HEADER)
    return h, _header(h)


def _u8(buf: _Buf) -> npt.NDArray[np.uint8]:
    return np.frombuffer(buf, dtype=np.uint8)


def be_uint(u8: _Arr, pos: _Arr, width: int) -> _Arr:
    """Big-endian unsigned ints of `width` bytes at byte positions pos: one gather from a
    view that has an int starting at every byte of the buffer (stride 1)."""
    if width == 1:
        gathered: _Arr = u8[pos]     # numpy's stubs type fancy indexing as Any
        return gathered
    n = len(u8) - width + 1
    if n <= 0 or len(pos) == 0:
        return np.zeros(len(pos), dtype=f"u{width}")
    view = np.ndarray(shape=(n,), dtype=f">u{width}", buffer=u8.data, offset=0, strides=(1,))
    native: _Arr = view[pos].astype(f"u{width}")
    return native


# The 24-byte header as a record (big-endian fields); bytes 2-3 are the key length, or
# framing extras length and key length with flexible framing (magic 0x08 / 0x18).
HEADER = np.dtype([("magic", "u1"), ("opcode", "u1"), ("b2", "u1"), ("b3", "u1"), ("el", "u1"),
                   ("datatype", "u1"), ("vbucket_or_status", ">u2"), ("bl", ">u4"),
                   ("opaque", ">u4"), ("cas", ">u8")])
assert HEADER.itemsize == HEADER_LEN


def _extras(*fields: str) -> np.dtype[np.void]:
    return np.dtype([(name, ">u8" if name in _U64 else ">u4") for name in fields])


_U64 = {"by_seqno", "rev_seqno", "snap_start", "snap_end"}
_ITEM_EXTRAS = _extras("by_seqno", "rev_seqno")                                  # 16 bytes
_MUTATION_EXTRAS = _extras("by_seqno", "rev_seqno", "item_flags", "expiration", "lock_time")
_DELETE_TIME_EXTRAS = _extras("by_seqno", "rev_seqno", "delete_time")
_SNAPSHOT_EXTRAS = _extras("snap_start", "snap_end", "snap_flags")
_SYSTEM_EVENT_EXTRAS = _extras("by_seqno", "system_event_id")


def records(u8: _Arr, pos: _Arr, dtype: np.dtype[Any]) -> _Arr:
    """Records of `dtype` (fixed-width, big-endian fields) starting at byte positions pos,
    in one gather of dtype.itemsize bytes each from a view with a record at every byte.
    Every pos + itemsize must be within u8."""
    width = dtype.itemsize
    n = len(u8) - width + 1
    if n <= 0 or len(pos) == 0:
        return np.zeros(len(pos), dtype=dtype)
    view = np.ndarray(shape=(n,), dtype=f"V{width}", buffer=u8.data, offset=0, strides=(1,))
    gathered: _Arr = view[pos].view(dtype)     # numpy's stubs type fancy indexing as Any
    return gathered


def _header(h: _Arr) -> _Fields:
    magic = h["magic"]
    flex = (magic == 0x08) | (magic == 0x18)
    b2 = h["b2"].astype(np.int64)
    b3 = h["b3"].astype(np.int64)
    fe = np.where(flex, b2, 0)
    kl = np.where(flex, b3, (b2 << 8) | b3)
    el = h["el"].astype(np.int64)
    bl = h["bl"].astype(np.int64)
    return magic.copy(), flex, fe, kl, el, bl


class Batch:
    """Columns of one batch. `numeric[name] = (values, valid)`; `key` and `raw` are
    (starts, lengths, valid) slices into `buf`; `objects[name]` a list or None."""

    __slots__ = ("buf", "n", "numeric", "key", "raw", "objects")

    def __init__(self, buf: _Buf, n: int):
        self.buf = buf
        self.n = n
        self.numeric: dict[str, tuple[_Arr, _Arr]] = {}
        self.objects: dict[str, list[Any] | None] = {name: None for name in OBJECT}
        self.key: tuple[_Arr, _Arr, _Arr] | None = None    # decode_batch sets both
        self.raw: tuple[_Arr, _Arr] | None = None

    def set(self, name: str, idx: int | _Arr, values: int | _Arr) -> None:
        col = self.numeric.get(name)
        if col is None and not isinstance(idx, int) and len(idx) == self.n and self.n:
            # every frame has it (idx: distinct rows, in order): the values are the column
            self.numeric[name] = (np.asarray(values).astype(NUMERIC[name]), np.ones(self.n, dtype=bool))
            return
        if col is None:
            col = (np.zeros(self.n, dtype=NUMERIC[name]), np.zeros(self.n, dtype=bool))
            self.numeric[name] = col
        if isinstance(values, int) and col[0].dtype == np.int64 and values >= 1 << 63:
            values -= 1 << 64  # seqnos are int64 in the capture (as in Couchbase); the raw frame keeps all 64 bits
        col[0][idx] = values
        col[1][idx] = True

    def set_all(self, name: str, values: _Arr) -> None:
        """Every row has the column: the values become it (one conversion, no mask)."""
        self.numeric[name] = (np.asarray(values).astype(NUMERIC[name]), np.ones(self.n, dtype=bool))

    def set_object(self, name: str, i: int, value: object) -> None:
        col = self.objects[name]
        if col is None:
            col = self.objects[name] = [None] * self.n
        col[i] = value


# opcode -> (expected extras length) for the vectorised path
# plain ints, not Opcode members: numpy compares an IntEnum member through the enum class's
# attribute lookups, dozens per batch (issue 26: a fixed cost of every receive)
_MUT, _DEL, _EXP = int(Opcode.DCP_MUTATION), int(Opcode.DCP_DELETION), int(Opcode.DCP_EXPIRATION)
_MARKER, _NOOP, _END = int(Opcode.DCP_SNAPSHOT_MARKER), int(Opcode.DCP_NOOP), int(Opcode.DCP_STREAM_END)
_ADVANCED, _EVENT = int(Opcode.DCP_SEQNO_ADVANCED), int(Opcode.DCP_SYSTEM_EVENT)
_FAST = {_MUT: 31, _DEL: (18, 21), _EXP: 20, _MARKER: 20, _ADVANCED: 8, _EVENT: 13, _END: 4, _NOOP: 0}
_ITEM_OPS = (_MUT, _DEL, _EXP)
_REQUEST_MAGICS = np.array([0x80, 0x82, 0x08], dtype=np.uint8)


class _Layout:
    """Where each frame's parts are: the header fields the two paths share."""

    __slots__ = ("u8", "offsets", "lengths", "opcode", "vs", "el", "kl", "ex", "key_start", "key_len",
                 "value_len", "key_valid")

    def __init__(self, u8: _Arr, offsets: _Arr, lengths: _Arr, h: _Arr, fe: _Arr, kl: _Arr, el: _Arr,
                 bl: _Arr):
        self.u8, self.offsets, self.lengths = u8, offsets, lengths
        self.opcode = h["opcode"].copy()
        self.vs = h["vbucket_or_status"].astype(np.uint16)
        self.el, self.kl = el, kl
        self.ex = offsets + HEADER_LEN + fe
        self.key_start = self.ex + el
        self.key_len = kl.copy()
        self.value_len = bl - fe - el - kl
        self.key_valid = np.zeros(len(offsets), dtype=bool)


def decode_batch(buf: _Buf, offsets: _Arr, lengths: _Arr, *, collections: bool = False,
                 opaque_vbuckets: dict[int, int | tuple[int, int]] | None = None) -> Batch:
    """Decode the whole frames at offsets/lengths in buf into columns.

    opaque_vbuckets maps a request's opaque to its vbucket; it is updated from the requests
    in this batch (in order) and gives responses their `vbucket`."""
    u8 = _u8(buf)
    n = len(offsets)
    b = Batch(buf, n)
    b.raw = (offsets, lengths)
    if n == 0:
        b.key = (offsets, lengths, np.zeros(0, dtype=bool))
        return b
    h, fields = headers(buf, offsets)
    magic, flex, fe, kl, el, bl = fields
    lay = _Layout(u8, offsets, lengths, h, fe, kl, el, bl)
    b.set_all("magic", magic)
    b.set_all("opcode", lay.opcode)
    b.set_all("datatype", h["datatype"])
    b.set_all("opaque", h["opaque"])
    b.set_all("cas", h["cas"])
    fast = _fast_frames(b, lay, np.isin(magic, _REQUEST_MAGICS), flex, fe, collections)
    _fast_columns(b, lay, np.nonzero(fast)[0])
    # everything else: one frame at a time through the message decoder, in frame order
    _slow_columns(b, lay, np.nonzero(~fast)[0], collections, {} if opaque_vbuckets is None else opaque_vbuckets)
    b.key = (lay.key_start, lay.key_len, lay.key_valid)
    return b


def _fast_frames(b: Batch, lay: _Layout, is_req: _Arr, flex: _Arr, fe: _Arr, collections: bool) -> _Arr:
    """Which frames the vectorised path can take (sets their stream ids and one-byte
    collection prefixes on the way)."""
    u8, offsets, opcode, el, kl = lay.u8, lay.offsets, lay.opcode, lay.el, lay.kl
    fast = np.zeros(len(offsets), dtype=bool)
    for op, size in _FAST.items():
        m = opcode == op
        m &= np.isin(el, size) if isinstance(size, tuple) else (el == size)
        fast |= m
    fast &= is_req
    # a flexible frame is fast only with exactly the 3-byte stream-id element
    if flex.any():
        fx = np.nonzero(flex & fast)[0]
        ok = (fe[fx] == 3) & (u8[offsets[fx] + HEADER_LEN] == 0x22)
        fast[fx[~ok]] = False
        sid = fx[ok]
        b.set("stream_id", sid, be_uint(u8, offsets[sid] + HEADER_LEN + 1, 2))
    snap_v1 = (opcode == _MARKER) & fast
    fast[snap_v1 & (lay.value_len != 0)] = False
    noop = (opcode == _NOOP) & fast
    fast[noop & ((kl != 0) | (lay.value_len != 0))] = False
    # collection prefixes: the one-byte form inline, longer ones through the slow path
    if collections:
        items = np.nonzero(fast & np.isin(opcode, _ITEM_OPS))[0]
        first = np.where(kl[items] > 0, u8[np.minimum(lay.key_start[items], len(u8) - 1)], 0x80)
        one = first < 0x80
        fast[items[~one]] = False
        it1 = items[one]
        b.set("collection_id", it1, first[one])
        lay.key_start[it1] += 1
        lay.key_len[it1] -= 1
    return fast


def _fast_columns(b: Batch, lay: _Layout, fidx: _Arr) -> None:
    """The columns of the frames of the vectorised path, gathered per layout."""
    u8, value_len = lay.u8, lay.value_len
    b.set("vbucket", fidx, lay.vs[fidx])
    fop = lay.opcode[fidx]
    fex = lay.ex[fidx]

    def sel(mask: _Arr) -> tuple[_Arr, _Arr]:
        return fidx[mask], fex[mask]

    def set_fields(idx: _Arr, ex_pos: _Arr, dtype: np.dtype[np.void]) -> None:
        # the vectorised path only takes frames whose extras are this long, or longer
        rec = records(u8, ex_pos, dtype)
        for name in dtype.names or ():
            b.set(name, idx, rec[name].astype(NUMERIC[name]))   # native first: a fast scatter

    mut, mex = sel(fop == _MUT)
    set_fields(mut, mex, _MUTATION_EXTRAS)
    dt, dex = sel(((fop == _DEL) & (lay.el[fidx] == 21)) | (fop == _EXP))
    set_fields(dt, dex, _DELETE_TIME_EXTRAS)
    d18, d18ex = sel((fop == _DEL) & (lay.el[fidx] != 21))
    set_fields(d18, d18ex, _ITEM_EXTRAS)
    items = np.sort(np.concatenate([mut, dt, d18]))
    b.set("value_len", items, value_len[items])
    sn, sex = sel(fop == _MARKER)
    set_fields(sn, sex, _SNAPSHOT_EXTRAS)
    sa, saex = sel(fop == _ADVANCED)
    b.set("by_seqno", sa, be_uint(u8, saex, 8))
    se, seex = sel(fop == _EVENT)
    set_fields(se, seex, _SYSTEM_EVENT_EXTRAS)
    b.set("value_len", se, value_len[se])
    if len(se):   # a collection event (create, drop, modify; value version 0/1): its collection id
        ce = np.isin(be_uint(u8, seex + 8, 4), (0, 1, 5)) & (u8[seex + 12] < 2) & (value_len[se] >= 16)
        b.set("collection_id", se[ce], be_uint(u8, seex[ce] + 13 + lay.key_len[se[ce]] + 12, 4))
    en, enex = sel(fop == _END)
    b.set("stream_end_reason", en, be_uint(u8, enex, 4))
    lay.key_valid[items] = True
    lay.key_valid[se] = True
    if len(sn):
        versions: list[Any] = [None] * b.n
        b.objects["snap_version"] = versions
        for i in sn.tolist():
            versions[i] = "1"


def _slow_columns(b: Batch, lay: _Layout, slow: _Arr, collections: bool,
                  opaque_vbuckets: dict[int, int | tuple[int, int]]) -> None:
    """The columns of every other frame, one frame at a time through the message decoder."""
    raw_bytes = b.buf
    key_start, key_len, kl = lay.key_start, lay.key_len, lay.kl
    for i in slow.tolist():
        off = int(lay.offsets[i])
        frame = parse_frame(raw_bytes, off, int(lay.lengths[i]))
        msg = messages.decode(frame, collections)
        row = messages.to_row(msg)
        if frame.magic in (0x80, 0x82, 0x08):
            # a stream request's answer belongs to its stream id too
            sid = row.get("stream_id") if row.get("op") == "stream_req" else None
            opaque_vbuckets[frame.opaque] = frame.vbucket_or_status if sid is None else \
                (frame.vbucket_or_status, sid)
        else:
            vb = opaque_vbuckets.get(frame.opaque)
            if type(vb) is tuple:
                row["vbucket"], row["stream_id"] = vb
            elif vb is not None:
                row["vbucket"] = vb
        for name, v in row.items():
            if name in NUMERIC:
                if name not in ("magic", "opcode", "datatype", "opaque", "cas"):
                    b.set(name, i, v)
            elif name in OBJECT:
                b.set_object(name, i, v)
            elif name == "key":
                lay.key_valid[i] = True
                # the key is a slice of the frame: its last len(key) bytes before the value
                klen = len(v)
                kend = int(key_start[i] + kl[i])
                key_start[i] = kend - klen
                key_len[i] = klen


# capture column order of the per-frame columns (CAPTURE_FORMAT.md)
ROW_ORDER = ("magic", "opcode", "op", "status", "vbucket", "opaque", "cas", "datatype",
             "stream_id", "collection_id", "key", "value_len", "by_seqno", "rev_seqno",
             "item_flags", "expiration", "lock_time", "delete_time", "snap_version",
             "snap_start", "snap_end", "snap_flags", "max_visible_seqno",
             "high_completed_seqno", "purge_seqno", "high_prepared_seqno",
             "stream_end_reason", "rollback_seqno", "failover_log", "req_flags",
             "req_start_seqno", "req_end_seqno", "req_vbucket_uuid", "req_snap_start",
             "req_snap_end", "system_event_id", "decode_error")


class _BytesSlicer:
    """Slices of a buffer as bytes (a memoryview's slices are memoryviews)."""
    __slots__ = ("mv",)

    def __init__(self, buf: _Buf):
        self.mv = memoryview(buf)

    def __getitem__(self, s: slice) -> bytes:
        return self.mv[s].tobytes()


def _present_columns(batch: Batch, raw: bool) -> tuple[list[str], list[_Arr], list[_Arr]]:
    """(names, columns, valid masks) of the columns some frame of the batch carries, in
    ROW_ORDER (then `raw`): numeric columns as numpy arrays, the rest as object arrays."""
    from dcptool.protocol.dcp.wire.constants import OP_NAME_TABLE, op_index
    n = batch.n
    assert batch.key is not None and batch.raw is not None, "a batch decode_batch made"
    names: list[str] = []
    cols: list[_Arr] = []
    valids: list[_Arr] = []
    # a receive buffer handed on (memoryview): values as bytes
    buf = batch.buf if type(batch.buf) is bytes else _BytesSlicer(batch.buf)
    for name in ROW_ORDER:
        if name == "op":
            names.append(name)
            cols.append(np.asarray(OP_NAME_TABLE, dtype=object)[op_index(batch.numeric["magic"][0],
                                                                          batch.numeric["opcode"][0])])
            valids.append(np.ones(n, dtype=bool))
        elif name == "key":
            starts, lens, valid = batch.key
            if valid.any():
                keys = np.empty(n, dtype=object)
                for i, s, ln in zip(np.nonzero(valid)[0].tolist(), starts[valid].tolist(), lens[valid].tolist()):
                    keys[i] = buf[s:s + ln]
                names.append(name)
                cols.append(keys)
                valids.append(valid)
        elif name in NUMERIC:
            col = batch.numeric.get(name)
            if col is not None and col[1].any():
                names.append(name)
                cols.append(col[0])
                valids.append(col[1])
        else:
            vals = batch.objects.get(name)
            if vals is not None:
                arr = np.empty(n, dtype=object)
                arr[:] = vals
                names.append(name)
                cols.append(arr)
                valids.append(np.array([v is not None for v in vals], dtype=bool))
    if raw:
        offs, lens = batch.raw
        arr = np.empty(n, dtype=object)
        arr[:] = [buf[o:o + ln] for o, ln in zip(offs.tolist(), lens.tolist())]
        names.append("raw")
        cols.append(arr)
        valids.append(np.ones(n, dtype=bool))
    return names, cols, valids


def to_columns(batch: Batch, *, raw: bool = False) -> dict[str, list[Any]]:
    """Every column some frame of the batch carries, as a Python list per column with None
    where a frame does not carry it: the shape for rows that carry every column (the
    output contract), built column-wise."""
    out: dict[str, list[Any]] = {}
    for name, col, valid in zip(*_present_columns(batch, raw)):
        values = col.tolist()
        if not valid.all():
            for i in np.flatnonzero(~valid).tolist():
                values[i] = None
        out[name] = values
    return out


def to_rows(batch: Batch, *, raw: bool = False) -> list[dict[str, Any]]:
    """One dict per frame with the columns it carries (the same dicts messages.to_row
    gives). Rows that carry the same set of columns are built together, column-wise."""
    n = batch.n
    if n == 0:
        return []
    names, cols, valids = _present_columns(batch, raw)
    bits = np.packbits(np.stack(valids, axis=1), axis=1, bitorder="little")
    sig8 = np.zeros((n, 8), dtype=np.uint8)
    sig8[:, :bits.shape[1]] = bits
    sig = sig8.view(np.uint64).ravel()
    out: list[Any] = [None] * n
    for s in np.unique(sig).tolist():
        idx = np.nonzero(sig == s)[0]
        present = [j for j in range(len(names)) if (s >> j) & 1]
        keys = [names[j] for j in present]
        lists = [cols[j][idx].tolist() for j in present]
        for i, values in zip(idx.tolist(), zip(*lists)):
            out[i] = dict(zip(keys, values))
    return out
