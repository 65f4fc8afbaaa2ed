"""Documents with their metadata on `serve dcp`, sans-IO: GET_META, SET_WITH_META,
ADD_WITH_META and DEL_WITH_META answered as kv_engine answers them (what XDCR and
`dcptool restore` send), on the live documents of kv_store.py.

A write with meta keeps the CAS, revision seqno, flags and expiry (absolute) it was given and
takes the vbucket's next seqno, so it streams on DCP with them. Unless the options skip it,
conflict resolution decides against what the vbucket holds for the key (a tombstone too), as
the bucket's `conflict_resolution` says (`serve dcp --conflict-resolution`):
- "seqno" (kv_engine's revision-based mode, the default): the higher rev seqno wins; a tie goes
  to the higher CAS, then expiry, then flags;
- "lww" (last write wins): the higher CAS wins; a tie goes to the higher rev seqno, then
  expiry, then flags. An LWW bucket takes with-meta writes only with FORCE_ACCEPT_WITH_META_OPS.
A write that loses (or ties) is refused KEY_EEXISTS and changes nothing.

Options (the extras' fifth word): SKIP_CONFLICT_RESOLUTION (or the old FORCE_WITH_META_OP)
writes whatever the target holds; REGENERATE_CAS (only with skipping) gives the write a new
CAS from the vbucket's clock; IS_EXPIRATION makes DEL_WITH_META an expiration. The header CAS,
when not 0, must be the current document's (KEY_ENOENT / KEY_EEXISTS otherwise). Extended
attributes are refused NOT_SUPPORTED, as the rest of `serve dcp` refuses them.

kv.py routes these opcodes here (META_COMMANDS); each handler answers its own refusals.
"""

from __future__ import annotations

import struct
from typing import Any, Callable

import cramjam

from dcptool.protocol.dcp.server.kv_store import KvStore, VbIndex
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import (
    DatatypeBit,
    Feature,
    Opcode,
    Status,
    WithMetaOption,
)
from dcptool.protocol.errors import DcptoolError

MAX_KEY = 250
MAX_VALUE = 20 * 1024 * 1024
MODES = ("seqno", "lww")
_RSP = struct.Struct(">BBHBBHIIQ")
_META = struct.Struct(">IIIQ")
_SKIP = int(WithMetaOption.SKIP_CONFLICT_RESOLUTION | WithMetaOption.FORCE_WITH_META_OP)
_REGENERATE = int(WithMetaOption.REGENERATE_CAS)
_FORCE_ACCEPT = int(WithMetaOption.FORCE_ACCEPT_WITH_META_OPS)
_IS_EXPIRATION = int(WithMetaOption.IS_EXPIRATION)
_KNOWN_OPTIONS = _SKIP | _REGENERATE | _FORCE_ACCEPT | _IS_EXPIRATION
_SNAPPY, _XATTR, _JSON = int(DatatypeBit.SNAPPY), int(DatatypeBit.XATTR), int(DatatypeBit.JSON)
_KNOWN_DATATYPES = _SNAPPY | _XATTR | _JSON

# the decoded forms the producer routes to kv.py for these opcodes (a wrong layout arrives
# as the generic Request and is refused EINVAL)
META_MESSAGES = frozenset({m.GetMeta, m.SetWithMeta, m.AddWithMeta, m.DelWithMeta})
_ITEM, _ADD = m.ItemMessage, m.AddWithMeta
_MUTATION_SEQNO = int(Feature.MUTATION_SEQNO)
_LIVE = frozenset({"m", "c"})


class MetaRefused(DcptoolError):
    """A with-meta request answered with a Couchbase status."""

    def __init__(self, status: int, context: str = "", body: bytes = b""):
        super().__init__(context)
        self.status, self.context, self.body = status, context, body


def incoming_wins(mode: str, new: tuple[int, int, int, int], old: tuple[int, int, int, int]) -> bool:
    """kv_engine's conflict resolution; `new` and `old` are (rev seqno, cas, expiry, flags)."""
    if mode == "lww":
        return (new[1], new[0], new[2], new[3]) > (old[1], old[0], old[2], old[3])
    return new > old


def _answer(conn: Any, req: Any, status: int = 0, *, extras: bytes = b"", value: bytes = b"", cas: int = 0,
            datatype: int = 0) -> None:
    conn.push(_RSP.pack(0x81, req.op_code, 0, len(extras), datatype, status, len(extras) + len(value),
                        req.opaque, cas) + extras + value)


def _guarded(fn: Callable[[Any, Any, KvStore, VbIndex, float], None]) -> Callable[..., None]:
    def run(conn: Any, req: Any, st: KvStore, ix: VbIndex, now: float) -> None:
        try:
            fn(conn, req, st, ix, now)
        except MetaRefused as bad:
            body = bad.body or (b'{"error":{"context":"%s"}}' % bad.context.encode() if bad.context else b"")
            _answer(conn, req, bad.status, value=body, datatype=1 if body and conn.json else 0)
    run.__doc__ = fn.__doc__
    return run


def _doc_key(conn: Any, req: Any) -> tuple[int, bytes]:
    """(collection id, key) of a decoded request; the collection must exist. (A request
    whose framing extras do not parse decodes as the generic form: refused here.)"""
    if not isinstance(req, _ITEM):
        raise MetaRefused(Status.EINVAL, getattr(req, "decode_error", None) or "bad request")
    key, cid = req.key, req.collection_id or 0
    if not key:
        raise MetaRefused(Status.EINVAL, "key required")
    if len(key) > MAX_KEY:
        raise MetaRefused(Status.EINVAL, f"key longer than {MAX_KEY} bytes")
    if cid:
        man = getattr(conn.bucket, "manifest", None)
        if man is None or cid not in man.live_ids():
            raise MetaRefused(Status.UNKNOWN_COLLECTION, body=man.error_body() if man is not None else b"")
    return cid, bytes(key)


def _value(req: m.SetWithMeta) -> tuple[bytes, int]:
    """(the value as stored, its datatype): Snappy undone; xattrs refused."""
    value, dt = bytes(req.value), req.datatype
    if dt & ~_KNOWN_DATATYPES:
        raise MetaRefused(Status.EINVAL, f"unknown datatype 0x{dt:02x}")
    if dt & _XATTR:
        raise MetaRefused(Status.NOT_SUPPORTED, "extended attributes are not supported by serve dcp")
    if dt & _SNAPPY:
        try:
            value = bytes(cramjam.snappy.decompress_raw(value))
        except Exception:   # noqa: BLE001 - cramjam raises its own error types
            raise MetaRefused(Status.EINVAL, "value does not decompress (Snappy)") from None
    if len(value) > MAX_VALUE:
        raise MetaRefused(Status.E2BIG)
    return value, dt & _JSON


def _options(conn: Any, req: m.SetWithMeta) -> int:
    opts = req.options or 0
    if opts & ~_KNOWN_OPTIONS:
        raise MetaRefused(Status.EINVAL, f"unknown options 0x{opts:x}")
    if opts & _REGENERATE and not opts & _SKIP:
        raise MetaRefused(Status.EINVAL, "REGENERATE_CAS needs SKIP_CONFLICT_RESOLUTION")
    if not opts & _FORCE_ACCEPT and mode_of(conn) == "lww":
        raise MetaRefused(Status.EINVAL, "an LWW bucket needs FORCE_ACCEPT_WITH_META_OPS")
    if not req.meta_cas and not opts & _REGENERATE:
        raise MetaRefused(Status.EINVAL, "the document's CAS is 0")
    return opts


def mode_of(conn: Any) -> str:
    """The bucket's conflict resolution mode ("seqno" unless set)."""
    return getattr(conn.bucket, "conflict_resolution", "seqno")


def _admit(conn: Any, req: m.SetWithMeta, ix: VbIndex, key: tuple[int, bytes], wall: float, opts: int) -> None:
    """kv_engine's checks before a with-meta write: a durable write in progress, a lock, the
    header CAS, ADD on a live document, then conflict resolution against what is held. (The
    index is in sync: kv.handle took it from KvStore.vb; a key never seen, the restore's
    common case, costs two lookups.)"""
    held = ix.docs.get(key)
    if held is None and not ix.pending:
        if req.cas:
            raise MetaRefused(Status.KEY_ENOENT)
        return
    live = ix.find(key, wall)
    if key in ix.pending:
        raise MetaRefused(Status.SYNC_WRITE_IN_PROGRESS)
    lock = ix.lock_of(key, wall) if live is not None else None
    if lock is not None and req.cas != lock:
        raise MetaRefused(Status.LOCKED)
    if req.cas and lock is None:
        if live is None:
            raise MetaRefused(Status.KEY_ENOENT)
        if live.cas != req.cas:
            raise MetaRefused(Status.KEY_EEXISTS)
    held = ix.docs.get(key)
    if isinstance(req, _ADD) and live is not None:
        raise MetaRefused(Status.KEY_EEXISTS)
    if held is None or opts & _SKIP:
        return
    new = (req.rev_seqno, req.meta_cas, req.expiration, req.item_flags)
    if not incoming_wins(mode_of(conn), new, (held.rev, held.cas, held.expiry, held.flags)):
        raise MetaRefused(Status.KEY_EEXISTS)


def _done(conn: Any, req: Any, st: KvStore, ix: VbIndex, seqno: int, cas: int) -> None:
    st.writes += 1
    conn.bucket.generation += 1
    conn.server.kv_writes = getattr(conn.server, "kv_writes", 0) + 1
    if _MUTATION_SEQNO in conn.features:
        _answer(conn, req, extras=struct.pack(">QQ", ix.vb.uuid, seqno), cas=cas)
    else:           # (the hot path: a restore asks no mutation tokens)
        conn.push(_RSP.pack(0x81, req.op_code, 0, 0, 0, 0, 0, req.opaque, cas))


@_guarded
def _set_with_meta(conn: Any, req: Any, st: KvStore, ix: VbIndex, now: float) -> None:
    """SET_WITH_META / ADD_WITH_META: the document at the next seqno with the given metadata."""
    key = _doc_key(conn, req)
    opts = _options(conn, req)
    value, dt = _value(req)
    wall = st.wall(now)
    _admit(conn, req, ix, key, wall, opts)
    cas = ix.next_cas(wall) if opts & _REGENERATE else req.meta_cas
    it = ix.append(key, "m", value, cas=cas, rev=req.rev_seqno, flags=req.item_flags, expiry=req.expiration,
                   datatype=dt)
    _done(conn, req, st, ix, it.seqno, it.cas)


@_guarded
def _del_with_meta(conn: Any, req: Any, st: KvStore, ix: VbIndex, now: float) -> None:
    """DEL_WITH_META: a tombstone with the given metadata (an expiration with IS_EXPIRATION),
    stored even when the key was never seen, so the deletion replicates."""
    key = _doc_key(conn, req)
    opts = _options(conn, req)
    if req.value and not req.datatype & _XATTR:
        raise MetaRefused(Status.EINVAL, "a deletion carries no body")
    _value(req)
    wall = st.wall(now)
    _admit(conn, req, ix, key, wall, opts)
    cas = ix.next_cas(wall) if opts & _REGENERATE else req.meta_cas
    it = ix.append(key, "x" if opts & _IS_EXPIRATION else "d", b"", cas=cas, rev=req.rev_seqno,
                   flags=req.item_flags, expiry=req.expiration)
    _done(conn, req, st, ix, it.seqno, it.cas)


@_guarded
def _get_meta(conn: Any, req: Any, st: KvStore, ix: VbIndex, now: float) -> None:
    """GET_META: deleted, flags, expiry, rev seqno (+ datatype with version 2) and the CAS in
    the header; a tombstone answers too (deleted = 1), a key never seen KEY_ENOENT."""
    key = _doc_key(conn, req)
    if req.version not in (None, 1, 2):
        raise MetaRefused(Status.EINVAL, f"get meta version {req.version}")
    ix.find(key, st.wall(now))
    it = ix.docs.get(key)
    if it is None:
        raise MetaRefused(Status.KEY_ENOENT)
    deleted = 0 if it.kind in ("m", "c") else 1
    extras = _META.pack(deleted, it.flags, it.expiry, it.rev)
    if req.version == 2:
        extras += bytes([it.datatype])
    _answer(conn, req, extras=extras, cas=it.cas)


META_COMMANDS: dict[int, Callable[..., None]] = {
    Opcode.GET_META: _get_meta,
    Opcode.SET_WITH_META: _set_with_meta,
    Opcode.ADD_WITH_META: _set_with_meta,
    Opcode.DEL_WITH_META: _del_with_meta,
}
