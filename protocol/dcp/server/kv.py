"""KV on `serve dcp`, sans-IO: the document commands an SDK sends (get, upsert / insert /
replace with CAS, remove, touch, get-and-touch, exists, get-replica, increment / decrement,
append / prepend, get-and-lock / unlock, the collection id of a name, noop), answered as Couchbase answers them, on
the live documents of kv_store.py.

Each write is one item at the vbucket's next seqno, so it is on every DCP stream of the
vbucket at once (a stream open `--to forever` gets it live, a later one backfills it).
Durable writes (flexible framing, frame info 1: majority, majority-and-persist-on-active,
persist-to-majority; on every command kv_engine takes it on: DURABLE_COMMANDS) are refused DURABILITY_IMPOSSIBLE unless the vbucket's chain has a
majority of live nodes (`--replicas` 1 or more and enough nodes); otherwise a DCP prepare
now, its commit and the answer at the connection's next tick (`complete`): a write to the
key in between gets SYNC_WRITE_IN_PROGRESS. An acknowledged durable write raises the
vbucket's `durable_floor`: no failover loses it.

Bad requests get Couchbase's statuses (EINVAL, E2BIG, UNKNOWN_COLLECTION with the manifest
uid, NOT_MY_VBUCKET with the cluster map, ...), never a dropped connection.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Callable

from dcptool.protocol.dcp.server.bucket import Item
from dcptool.protocol.dcp.server.kv_meta import META_COMMANDS, META_MESSAGES
from dcptool.protocol.dcp.server.kv_store import KvStore, VbIndex, store_of
from dcptool.protocol.dcp.wire import leb128, snappy
from dcptool.protocol.dcp.wire.constants import (
    MAX_VALUE,
    DatatypeBit,
    Feature,
    Opcode,
    Status,
)
from dcptool.protocol.dcp.wire.message_types import Message
from dcptool.protocol.errors import DcptoolError, ProtocolError

MAX_KEY = 250                      # bytes of a key (without its collection prefix)
DEFAULT_LOCK, MAX_LOCK = 15, 30    # seconds of a get-and-lock
LOCKED_CAS = 0xFFFFFFFFFFFFFFFF    # what GET answers for a locked document
DURABILITY_FRAME = 1
LEVELS = {1: "majority", 2: "majority_and_persist_to_active", 3: "persist_to_majority"}
_RSP = struct.Struct(">BBHBBHIIQ")  # a response header
_FLAGS_EXPIRY = struct.Struct(">II")
_COUNTER = struct.Struct(">QQI")   # delta, initial, expiry
_U32 = struct.Struct(">I")
_SNAPPY, _XATTR, _JSON = int(DatatypeBit.SNAPPY), int(DatatypeBit.XATTR), int(DatatypeBit.JSON)
_KNOWN_DATATYPES = int(DatatypeBit.JSON | DatatypeBit.SNAPPY | DatatypeBit.XATTR)
_JSON_START = frozenset(b'{["-0123456789tfn \t\r\n')


class BadRequest(DcptoolError):
    """A KV request answered with a Couchbase status (never a dropped connection)."""

    def __init__(self, status: int, context: str = "", body: bytes | None = None):
        super().__init__(context)
        self.status, self.context, self.body = status, context, body


# --------------------------------------------------------------------------- request parts

def _key(conn: Any, req: Any) -> tuple[int, bytes]:
    """(collection id, key) of a document command; the collection must exist."""
    raw = req.key
    cid = 0
    if conn.collections:
        try:
            cid, used = leb128.decode(raw, 0, min(len(raw), 5))
        except ProtocolError:
            raise BadRequest(Status.EINVAL, "invalid collection id prefix") from None
        if used == 0 or used > len(raw):
            raise BadRequest(Status.EINVAL, "invalid collection id prefix")
        raw = raw[used:]
    if not raw:
        raise BadRequest(Status.EINVAL, "key required")
    if len(raw) > MAX_KEY:
        raise BadRequest(Status.EINVAL, f"key longer than {MAX_KEY} bytes")
    man = getattr(conn.bucket, "manifest", None)
    if cid and (man is None or cid not in man.live_ids()):
        raise BadRequest(Status.UNKNOWN_COLLECTION, body=man.error_body() if man is not None else b"")
    return cid, bytes(raw)


def _durability(req: Any) -> int:
    """The durability level asked in the frame infos (0: none)."""
    level = 0
    if getattr(req, "raw_framing", b""):
        raise BadRequest(Status.EINVAL, "framing extras do not parse")
    for fid, payload in req.frame_infos:
        if fid == DURABILITY_FRAME:
            if len(payload) not in (1, 3):
                raise BadRequest(Status.EINVAL, "durability frame info must be 1 or 3 bytes")
            level = payload[0]
            if level not in LEVELS:
                raise BadRequest(Status.DURABILITY_INVALID_LEVEL, f"durability level {level}")
    return level


def _value(req: Any) -> tuple[bytes, int]:
    """(the value as stored, its datatype): decompressed; JSON when it parses as JSON."""
    value = bytes(req.value)
    dt = req.datatype
    if dt & ~_KNOWN_DATATYPES:
        raise BadRequest(Status.EINVAL, f"unknown datatype 0x{dt:02x}")
    if dt & _XATTR:
        raise BadRequest(Status.NOT_SUPPORTED, "extended attributes are not supported by serve dcp")
    if dt & _SNAPPY:       # (the announced length first: a hostile one allocates nothing)
        try:
            value = snappy.decompress(value, MAX_VALUE)
        except snappy.TooLarge:
            raise BadRequest(Status.E2BIG, f"value over {MAX_VALUE} bytes once decompressed") from None
        except ValueError:
            raise BadRequest(Status.EINVAL, "value does not decompress (Snappy)") from None
    if len(value) > MAX_VALUE:
        raise BadRequest(Status.E2BIG)
    if dt & _JSON and value:    # the client (HELLO JSON) says so, as kv_engine takes it
        return value, 1
    return value, 1 if _is_json(value) else 0


def _is_json(value: bytes) -> bool:
    if not value or value[0] not in _JSON_START:
        return False
    try:
        json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def _need_extras(req: Any, *sizes: int) -> None:
    if len(req.extras) not in sizes:
        raise BadRequest(Status.EINVAL, f"extras must be {' or '.join(map(str, sizes))} bytes")


# --------------------------------------------------------------------------- answers

def _answer(conn: Any, req: Any, status: int = 0, *, extras: bytes = b"", value: bytes = b"", cas: int = 0,
            datatype: int = 0) -> None:
    """A response (magic 0x81): the header packed here, one per request (the hot path)."""
    conn.push(_RSP.pack(0x81, req.op_code, 0, len(extras), datatype, status,
                        len(extras) + len(value), req.opaque, cas) + extras + value)


def _error(conn: Any, req: Any, bad: BadRequest) -> None:
    body = bad.body
    if body is None:
        body = json.dumps({"error": {"context": bad.context}}).encode() if bad.context else b""
    _answer(conn, req, bad.status, value=body, datatype=1 if body and conn.json else 0)


def _mutation_extras(conn: Any, ix: VbIndex, seqno: int) -> bytes:
    """MUTATION_SEQNO: the vbucket uuid and the write's seqno (the SDK's mutation token)."""
    return struct.pack(">QQ", ix.vb.uuid, seqno) if Feature.MUTATION_SEQNO in conn.features else b""


def _doc_answer(conn: Any, req: Any, it: Item, cas: int | None = None) -> None:
    dt = it.datatype if conn.json else 0
    _answer(conn, req, extras=_U32.pack(it.flags), value=it.value, cas=it.cas if cas is None else cas, datatype=dt)


# --------------------------------------------------------------------------- commands

def _get(conn: Any, req: Any, st: KvStore, ix: VbIndex, now: float) -> None:
    _need_extras(req, 0)
    key = _key(conn, req)
    wall = st.wall(now)
    it = ix.find(key, wall)
    if it is None:
        raise BadRequest(Status.KEY_ENOENT)
    locked = req.opcode == Opcode.GET and ix.lock_of(key, wall) is not None
    _doc_answer(conn, req, it, LOCKED_CAS if locked else None)


def _current(ix: VbIndex, key: tuple[int, bytes], wall: float, cas: int, missing: int = Status.KEY_ENOENT) -> Item | None:
    """The live document (or None) a write applies to, after kv_engine's checks: a durable
    write in progress on the key, a lock (only its CAS opens it), the CAS (if one is given,
    the document must exist: `missing` otherwise, and have that CAS)."""
    cur = ix.find(key, wall)
    if key in ix.pending:
        raise BadRequest(Status.SYNC_WRITE_IN_PROGRESS)
    lock = ix.lock_of(key, wall) if cur is not None else None
    if lock is not None:
        if cas != lock:
            raise BadRequest(Status.LOCKED)
        return cur
    if cas:
        if cur is None:
            raise BadRequest(missing)
        if cur.cas != cas:
            raise BadRequest(Status.KEY_EEXISTS)
    return cur


def _get_locked(conn: Any, req: Any, st: KvStore, ix: VbIndex, now: float) -> None:
    """GET_LOCKED (get-and-lock): extras the lock time in seconds (0 or above 30: 15). The
    answer carries a lock CAS, the only one that writes or unlocks the document until the
    lock ends; GET answers CAS -1 meanwhile. A lock is no change: no seqno, nothing streamed."""
    _need_extras(req, 0, 4)
    key = _key(conn, req)
    wall = st.wall(now)
    it = ix.find(key, wall)
    if it is None:
        raise BadRequest(Status.KEY_ENOENT)
    if key in ix.pending or ix.lock_of(key, wall) is not None:
        raise BadRequest(Status.LOCKED)
    secs = _U32.unpack(req.extras)[0] if req.extras else 0
    secs = DEFAULT_LOCK if secs == 0 or secs > MAX_LOCK else secs
    lock = ix.next_cas(wall)
    ix.locks[key] = (lock, wall + secs)
    _doc_answer(conn, req, it, lock)


def _unlock(conn: Any, req: Any, st: KvStore, ix: VbIndex, now: float) -> None:
    """UNLOCK_KEY: the lock CAS ends the lock; NOT_LOCKED when there is none, LOCKED for
    another CAS."""
    _need_extras(req, 0)
    key = _key(conn, req)
    wall = st.wall(now)
    if ix.find(key, wall) is None:
        raise BadRequest(Status.KEY_ENOENT)
    lock = ix.lock_of(key, wall)
    if lock is None:
        raise BadRequest(Status.NOT_LOCKED)
    if req.cas != lock:
        raise BadRequest(Status.LOCKED)
    del ix.locks[key]
    _answer(conn, req)


def _store(conn: Any, req: Any, st: KvStore, ix: VbIndex, now: float) -> None:
    """SET (upsert), ADD (insert), REPLACE: flags and expiry in the extras, CAS optional
    (not for ADD)."""
    _need_extras(req, 8)
    op = req.opcode
    key = _key(conn, req)
    level = _durability(req)
    flags, expiry = _FLAGS_EXPIRY.unpack(req.extras)
    value, dt = _value(req)
    if op == Opcode.ADD and req.cas:
        raise BadRequest(Status.EINVAL, "insert takes no CAS")
    wall = st.wall(now)
    cur = _current(ix, key, wall, req.cas)
    if op == Opcode.ADD and cur is not None:
        raise BadRequest(Status.KEY_EEXISTS)
    if op == Opcode.REPLACE and cur is None:
        raise BadRequest(Status.KEY_ENOENT)
    _write(conn, req, st, ix, key, level, value=value, dt=dt, flags=flags,
           expiry=st.absolute_expiry(expiry, now), wall=wall)


def _remove(conn: Any, req: Any, st: KvStore, ix: VbIndex, now: float) -> None:
    _need_extras(req, 0)
    key = _key(conn, req)
    level = _durability(req)
    wall = st.wall(now)
    if _current(ix, key, wall, req.cas) is None:
        raise BadRequest(Status.KEY_ENOENT)
    if level:
        _check_durable(conn, ix)
    it = ix.append(key, "d", b"", cas=ix.next_cas(wall), rev=ix.rev_after(key))
    if level:   # (streamed as a plain deletion; kept through failovers as any durable write)
        ix.vb.durable_floor = it.seqno
    _written(conn, st)
    _answer(conn, req, extras=_mutation_extras(conn, ix, it.seqno), cas=it.cas)


def _touch(conn: Any, req: Any, st: KvStore, ix: VbIndex, now: float) -> None:
    """TOUCH (a new expiry) and GAT (get and touch): a new version at a new seqno, the
    same value, a new CAS; durable as any write (kv_engine takes durability on both)."""
    _need_extras(req, 4)
    key = _key(conn, req)
    level = _durability(req)
    wall = st.wall(now)
    cur = _current(ix, key, wall, req.cas)
    if cur is None:
        raise BadRequest(Status.KEY_ENOENT)
    expiry = st.absolute_expiry(_U32.unpack(req.extras)[0], now)
    _write(conn, req, st, ix, key, level, value=cur.value, dt=cur.datatype, flags=cur.flags, expiry=expiry,
           wall=wall, reply=_gat_reply if req.opcode == Opcode.GAT else _touch_reply)


def _touch_reply(conn: Any, req: Any, ix: VbIndex, it: Item) -> None:
    _answer(conn, req, cas=it.cas)


def _gat_reply(conn: Any, req: Any, ix: VbIndex, it: Item) -> None:
    _doc_answer(conn, req, it)


def _check_durable(conn: Any, ix: VbIndex) -> None:
    """DURABILITY_IMPOSSIBLE unless the vbucket's chain (active + replicas) has a majority
    of live nodes: majority = (replicas + 1) // 2 + 1 of the configured copies."""
    cl = conn.server.cluster_for(conn.bucket)
    if cl is None or cl.replicas == 0:
        raise BadRequest(Status.DURABILITY_IMPOSSIBLE)
    row = cl.vbmap[ix.vb.vbid]
    live = sum(1 for r in row if r >= 0 and cl.nodes[r].serving)
    if live < (cl.replicas + 1) // 2 + 1:
        raise BadRequest(Status.DURABILITY_IMPOSSIBLE)


def _mutation_reply(conn: Any, req: Any, ix: VbIndex, it: Item) -> None:
    """The answer to a write: the mutation token (HELLO MUTATION_SEQNO) and the new CAS."""
    _answer(conn, req, extras=_mutation_extras(conn, ix, it.seqno), cas=it.cas)


def _write(conn: Any, req: Any, st: KvStore, ix: VbIndex, key: tuple[int, bytes], level: int, *, value: bytes, dt: int, flags: int,
           expiry: int, wall: float, reply: Callable[..., None] = _mutation_reply) -> None:
    """One write at the next seqno, answered by `reply(conn, req, ix, item)`: now, or for a
    durable write (level > 0) a DCP prepare now and the answer with its commit (complete)."""
    rev = ix.rev_after(key)
    if level:
        _check_durable(conn, ix)
        p = ix.append(key, "p", value, cas=ix.next_cas(wall), rev=rev, flags=flags, expiry=expiry, datatype=dt)
        _written(conn, st)
        pending = getattr(conn, "kv_pending", None)
        if pending is None:
            pending = conn.kv_pending = []
        pending.append((req, ix, p, reply))
        return
    it = ix.append(key, "m", value, cas=ix.next_cas(wall), rev=rev, flags=flags, expiry=expiry, datatype=dt)
    _written(conn, st)
    reply(conn, req, ix, it)


def _written(conn: Any, st: KvStore) -> None:
    st.writes += 1
    conn.bucket.generation += 1
    conn.server.kv_writes = getattr(conn.server, "kv_writes", 0) + 1


def complete(conn: Any) -> None:
    """The replicas acknowledged: commit the connection's durable writes in progress and
    answer them (the commit at the next seqno, the prepare's CAS)."""
    pending = getattr(conn, "kv_pending", None)
    if not pending:
        return
    conn.kv_pending = []
    for req, ix, p, reply in pending:
        key = (p.cid, p.key)
        if ix.pending.get(key) is not p:      # a failover took the prepare away
            _answer(conn, req, Status.SYNC_WRITE_AMBIGUOUS)
            continue
        c = ix.append(key, "c", p.value, cas=p.cas, rev=p.rev, flags=p.flags, expiry=p.expiry,
                      datatype=p.datatype, prepared=p.seqno)
        ix.vb.durable_floor = c.seqno
        _written(conn, store_of(conn.bucket, conn.server))
        reply(conn, req, ix, c)


def _collection_id(conn: Any, req: Any) -> None:
    """GET_COLLECTION_ID: "scope.collection" in the key (or the value) -> the manifest uid
    and the collection id in the extras; UNKNOWN_SCOPE / UNKNOWN_COLLECTION otherwise."""
    man = getattr(conn.bucket, "manifest", None)
    path = (req.key or req.value).decode("utf-8", "replace")
    scope, dot, name = path.partition(".")
    scope, name = scope or "_default", name or "_default"
    if man is None or not dot and path:
        raise BadRequest(Status.EINVAL, "the path is scope.collection")
    if man.scope_id(scope) is None:
        raise BadRequest(Status.UNKNOWN_SCOPE, body=man.error_body())
    col = man.find(scope, name)
    if col is None:
        raise BadRequest(Status.UNKNOWN_COLLECTION, body=man.error_body())
    _answer(conn, req, extras=struct.pack(">QI", man.uid, col.cid))


def _counter(conn: Any, req: Any, st: KvStore, ix: VbIndex, now: float) -> None:
    """INCREMENT / DECREMENT: extras delta u64, initial u64, expiry u32. A missing document
    is created with `initial` (unless expiry is 0xffffffff: KEY_ENOENT); the value is ASCII
    decimal (DELTA_BADVAL otherwise); increment wraps at 2^64, decrement stops at 0. The
    answer's value is the new count, 8 bytes big-endian."""
    _need_extras(req, 20)
    key = _key(conn, req)
    level = _durability(req)
    delta, initial, expiry = _COUNTER.unpack(req.extras)
    wall = st.wall(now)
    cur = _current(ix, key, wall, req.cas)
    if cur is None:
        if expiry == 0xFFFFFFFF:
            raise BadRequest(Status.KEY_ENOENT)
        count, flags, exp = initial, 0, st.absolute_expiry(expiry, now)
    else:
        text = cur.value.strip()
        if not text.isdigit() or len(text) > 20 or int(text) >= 1 << 64:
            raise BadRequest(Status.DELTA_BADVAL, "the value is not a number")
        count, flags, exp = int(text), cur.flags, cur.expiry
        count = (count + delta) % (1 << 64) if req.opcode == Opcode.INCREMENT else max(0, count - delta)
    answer = struct.pack(">Q", count)

    def reply(conn: Any, req: Any, ix: VbIndex, it: Item) -> None:
        _answer(conn, req, extras=_mutation_extras(conn, ix, it.seqno), value=answer, cas=it.cas)

    _write(conn, req, st, ix, key, level, value=b"%d" % count, dt=1, flags=flags, expiry=exp, wall=wall,
           reply=reply)


def _concat(conn: Any, req: Any, st: KvStore, ix: VbIndex, now: float) -> None:
    """APPEND / PREPEND: the value joined to the document's; NOT_STORED when it is missing."""
    _need_extras(req, 0)
    key = _key(conn, req)
    level = _durability(req)
    value, _ = _value(req)
    wall = st.wall(now)
    cur = _current(ix, key, wall, req.cas, Status.NOT_STORED)
    if cur is None:
        raise BadRequest(Status.NOT_STORED)
    joined = cur.value + value if req.opcode == Opcode.APPEND else value + cur.value
    if len(joined) > MAX_VALUE:
        raise BadRequest(Status.E2BIG)
    _write(conn, req, st, ix, key, level, value=joined, dt=1 if _is_json(joined) else 0, flags=cur.flags,
           expiry=cur.expiry, wall=wall)


DOCUMENT_COMMANDS = {
    Opcode.GET: _get, Opcode.GET_REPLICA: _get,
    Opcode.SET: _store, Opcode.ADD: _store, Opcode.REPLACE: _store, Opcode.DELETE: _remove,
    Opcode.TOUCH: _touch, Opcode.GAT: _touch, Opcode.INCREMENT: _counter, Opcode.DECREMENT: _counter,
    Opcode.APPEND: _concat, Opcode.PREPEND: _concat, Opcode.GET_LOCKED: _get_locked, Opcode.UNLOCK_KEY: _unlock,
    **META_COMMANDS,    # GET_META and the writes with meta: kv_meta.py
}
# decoded forms routed here besides the generic Request (kv_meta's set infers as frozenset[type])
TYPED_REQUESTS: frozenset[type[Message]] = frozenset(c for c in META_MESSAGES if issubclass(c, Message))
OPCODES = frozenset(DOCUMENT_COMMANDS) | {Opcode.NOOP_CLIENT, Opcode.GET_COLLECTION_ID}
# The commands kv_engine takes durability on (its is_durability_supported, sub-document
# commands aside); any other with a durability frame info is EINVAL, as kv_engine answers.
DURABLE_COMMANDS = frozenset({Opcode.SET, Opcode.ADD, Opcode.REPLACE, Opcode.DELETE, Opcode.INCREMENT,
                              Opcode.DECREMENT, Opcode.APPEND, Opcode.PREPEND, Opcode.TOUCH, Opcode.GAT})


def _serves(conn: Any, req: Any) -> bool:
    """The node holds the vbucket in the state the command needs: active, or a replica for
    GET_REPLICA (a single node is active for every vbucket and has no replicas)."""
    if req.op_code != Opcode.GET_REPLICA:
        return bool(conn.owned(req.vbucket))
    cl = conn.server.cluster_for(conn.bucket)
    return cl is not None and conn.node in cl.vbmap[req.vbucket][1:]


def handle(conn: Any, req: Any, now: float) -> None:
    """Answer one KV request (req: a generic messages.Request or one of TYPED_REQUESTS, opcode
    in OPCODES)."""
    op = req.op_code
    try:
        if req.frame_infos and op not in DURABLE_COMMANDS and any(fid == DURABILITY_FRAME for fid, _ in req.frame_infos):
            raise BadRequest(Status.EINVAL, "the command does not support durability requirements")
        if op == Opcode.NOOP_CLIENT:                      # NOOP (an SDK's ping)
            _answer(conn, req)
            return
        if conn.bucket is None:
            _answer(conn, req, Status.NO_BUCKET)
            return
        if op == Opcode.GET_COLLECTION_ID:
            _collection_id(conn, req)
            return
        if not hasattr(conn.bucket, "vbuckets"):   # a capture played back: read-only
            _answer(conn, req, Status.NOT_SUPPORTED)
            return
        if req.vbucket >= conn.bucket.num_vbuckets or not _serves(conn, req):
            conn.not_my_vbucket(req)
            return
        st = store_of(conn.bucket, conn.server)
        DOCUMENT_COMMANDS[op](conn, req, st, st.vb(req.vbucket), now)
    except BadRequest as bad:
        _error(conn, req, bad)


def tick(conn: Any, now: float) -> None:
    """The connection's timer: durable writes complete, the expiry pager runs when due."""
    complete(conn)
    st = getattr(conn.bucket, "kv", None) if conn.bucket is not None else None
    if st is not None and st.run_pager(now):
        conn.server.kv_writes = getattr(conn.server, "kv_writes", 0) + 1


def deadline(conn: Any, now: float) -> float | None:
    """When tick() next has KV work to do (None: nothing)."""
    if getattr(conn, "kv_pending", None):
        return now
    st = getattr(conn.bucket, "kv", None) if conn.bucket is not None else None
    return st.deadline(now) if st is not None else None
