"""Writing documents with their metadata to a bucket, sans-IO (what `dcptool restore` sends;
the I/O is protocol/transport/kv_restore.py): a KV connection's handshake (HELLO, SASL,
SELECT_BUCKET, GET_CLUSTER_CONFIG, GET_COLLECTIONS_MANIFEST), the SET_WITH_META /
DEL_WITH_META frame of a document, and what each answer means for it.

A document is written as captured: CAS, revision seqno, flags, expiry and datatype kept, the
value as stored (Snappy undone: a connection that negotiated Snappy may take it either way,
one that did not must not get it; the XATTR bit and its section kept). Conflict resolution is
the target's: KEY_EEXISTS means it holds that document at a newer or equal version (skipped,
which is why a second restore writes nothing); `force` sets SKIP_CONFLICT_RESOLUTION, as
cbbackupmgr's --force-updates does."""

from __future__ import annotations

import dataclasses
import enum
import struct
import zlib
from typing import Callable, NamedTuple

from dcptool.protocol.dcp.wire import leb128, sasl
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import (
    DEFAULT_MAX_BODY,
    HEADER_LEN,
    Feature,
    Opcode,
    Status,
    WithMetaOption,
    status_name,
)
from dcptool.protocol.dcp.wire.frames import check_header
from dcptool.protocol.errors import AuthRefused, ErrorCode, RemoteError

FEATURES = (Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON, Feature.COLLECTIONS, Feature.XATTR,
            Feature.TCP_NODELAY)
# FORCE_ACCEPT_WITH_META_OPS: an LWW bucket refuses with-meta writes without it; a revision
# bucket ignores it
BASE_OPTIONS = int(WithMetaOption.FORCE_ACCEPT_WITH_META_OPS)
FORCE_OPTIONS = BASE_OPTIONS | int(WithMetaOption.SKIP_CONFLICT_RESOLUTION)
_IS_EXPIRATION = int(WithMetaOption.IS_EXPIRATION)
_SET, _DEL = int(Opcode.SET_WITH_META), int(Opcode.DEL_WITH_META)
_HEADER_EXTRAS = struct.Struct(">BBHBBHIIQIIQQI")   # request header, then the 28-byte with-meta extras


class Doc(NamedTuple):
    """One document as a capture last saw it (a tombstone when `deleted`). A named tuple:
    a restore makes one per document, and a tuple is made in a fraction of a frozen
    dataclass's time."""
    key: bytes
    collection_id: int
    rev_seqno: int
    cas: int
    flags: int
    expiry: int
    datatype: int          # JSON / XATTR bits of the value below (never Snappy)
    deleted: bool
    value: bytes           # as stored: the xattr section first when datatype has XATTR
    expired: bool = False  # a tombstone of an expiry (DEL_WITH_META with IS_EXPIRATION)


DOC_FIELDS: tuple[str, ...] = tuple(Doc.__annotations__)    # a Doc's fields in order (restore's rows)


class Verdict(enum.Enum):
    WRITTEN = "written"
    SKIPPED = "skipped"        # the target holds a newer or equal version (KEY_EEXISTS)
    REROUTE = "reroute"        # NOT_MY_VBUCKET: the map moved
    RETRY = "retry"            # temporary: try the same write again later
    FAILED = "failed"          # refused for good (the status says why)


_RETRY = frozenset({Status.ETMPFAIL, Status.EBUSY, Status.ENOMEM, Status.SYNC_WRITE_IN_PROGRESS,
                    Status.SYNC_WRITE_RECOMMIT_IN_PROGRESS, Status.LOCKED})


def verdict(status: int) -> Verdict:
    if status == Status.SUCCESS:
        return Verdict.WRITTEN
    if status == Status.KEY_EEXISTS:
        return Verdict.SKIPPED
    if status == Status.NOT_MY_VBUCKET:
        return Verdict.REROUTE
    if status in _RETRY:
        return Verdict.RETRY
    return Verdict.FAILED


def vbucket_of(key: bytes, num_vbuckets: int) -> int:
    """Couchbase's key -> vbucket: CRC32, bits 16-30, modulo the vbuckets."""
    return ((zlib.crc32(key) >> 16) & 0x7FFF) % num_vbuckets


def write_message(doc: Doc, *, vbucket: int, opaque: int, force: bool, collections: bool) -> m.SetWithMeta:
    """The SET_WITH_META (or DEL_WITH_META) request of a document."""
    options = FORCE_OPTIONS if force else BASE_OPTIONS
    cls: type[m.SetWithMeta] = m.SetWithMeta
    if doc.deleted:
        cls = m.DelWithMeta
        if doc.expired:
            options |= int(WithMetaOption.IS_EXPIRATION)
    return cls(vbucket=vbucket, opaque=opaque, key=doc.key, collection_id=doc.collection_id if collections else None,
               value=doc.value, datatype=doc.datatype, item_flags=doc.flags, expiration=doc.expiry,
               rev_seqno=doc.rev_seqno, meta_cas=doc.cas, options=options)


def write_frame(doc: Doc, *, vbucket: int, opaque: int, force: bool, collections: bool) -> bytes:
    """m.encode(write_message(...)), packed at once (every document of a restore comes here;
    tests/cli/test_restore_lib.py checks the two agree)."""
    options = FORCE_OPTIONS if force else BASE_OPTIONS
    opcode = Opcode.SET_WITH_META
    if doc.deleted:
        opcode = Opcode.DEL_WITH_META
        if doc.expired:
            options |= _IS_EXPIRATION
    key = leb128.encode(doc.collection_id) + doc.key if collections else doc.key
    body = 28 + len(key) + len(doc.value)
    return _HEADER_EXTRAS.pack(0x80, opcode, len(key), 28, doc.datatype, vbucket, body, opaque, 0, doc.flags,
                               doc.expiry, doc.rev_seqno, doc.cas, options) + key + doc.value


def write_frames(writes: list[tuple[Doc, int]], first_opaque: int, *, force: bool, collections: bool) -> bytes:
    """write_frame() of each (document, vbucket) of `writes`, opaques `first_opaque`,
    `first_opaque` + 1, ... (within 32 bits), joined: the pump's batch, one Python loop with
    no call per document but the header's pack."""
    base = FORCE_OPTIONS if force else BASE_OPTIONS
    pack, parts = _HEADER_EXTRAS.pack, []
    prefixes: dict[int, bytes] = {}
    opaque = first_opaque
    for doc, vb in writes:
        key = doc.key
        if collections:
            cid = doc.collection_id
            prefix = prefixes.get(cid)
            if prefix is None:
                prefix = prefixes[cid] = leb128.encode(cid)
            key = prefix + key
        if doc.deleted:
            opcode, options = _DEL, (base | _IS_EXPIRATION) if doc.expired else base
        else:
            opcode, options = _SET, base
        value = doc.value
        parts.append(pack(0x80, opcode, len(key), 28, doc.datatype, vb, 28 + len(key) + len(value), opaque, 0,
                          doc.flags, doc.expiry, doc.rev_seqno, doc.cas, options))
        parts.append(key)
        parts.append(value)
        opaque = (opaque + 1) & 0xFFFFFFFF
    return b"".join(parts)


_HEAD = struct.Struct(">BBHBBHII")     # magic, opcode, key length, extras length, datatype, status, body, opaque
ANSWER_MAGICS = frozenset({0x81, 0x18})   # a response, classic or flexible: status and opaque at the same place


def split_answers(buf: bytes | bytearray, max_body: int = DEFAULT_MAX_BODY) -> tuple[
        list[tuple[int, int, int, int]], int, RemoteError | None]:
    """The whole frames at the start of `buf`: ([(offset, length, opaque, status), ...],
    bytes consumed, the error of a bad header or None), as frames.split_until_error splits
    them; a classic response (the pump's answers) is checked from its one unpacked header,
    any other frame by frames.check_header (its status: that field of its header)."""
    out: list[tuple[int, int, int, int]] = []
    pos, n, unpack = 0, len(buf), _HEAD.unpack_from
    try:
        while pos + HEADER_LEN <= n:
            magic, _op, kl, el, _dt, status, bl, opaque = unpack(buf, pos)
            if magic == 0x81 and bl <= max_body and el + kl <= bl:
                length = HEADER_LEN + bl
            else:
                length = check_header(buf, pos, max_body)
            if pos + length > n:
                break
            out.append((pos, length, opaque, status))
            pos += length
    except RemoteError as exc:
        return out, pos, exc
    return out, pos, None


@dataclasses.dataclass
class Bootstrap:
    """What the handshake learnt: the features granted, the cluster config and the
    collections manifest bodies (b"" when the server has none)."""
    features: frozenset[int] = frozenset()
    config: bytes = b""
    manifest: bytes = b""


class Handshake:
    """A KV connection's set-up, one request at a time: `start()` gives the first frame,
    `feed(answer)` the next one (None: done, `result` filled). Raises AuthRefused /
    RemoteError with the reason."""

    def __init__(self, bucket: str, user: str | None, password: str | None, allow_plain: bool):
        self.bucket, self.user, self.password, self.allow_plain = bucket, user, password, allow_plain
        self.result = Bootstrap()
        self._opaque = 0
        self._next: Callable[[m.Message], bytes | None] = self._on_hello
        self._scram: sasl.ScramClient | None = None
        self._mech = ""
        self._rounds = 0
        self.done = False

    def _send(self, msg: m.Message, then: Callable[[m.Message], bytes | None]) -> bytes:
        self._opaque += 1
        self._next = then
        frame = bytearray(m.encode(msg))
        frame[12:16] = self._opaque.to_bytes(4, "big")     # the header's opaque
        return bytes(frame)

    def start(self) -> bytes:
        return self._send(m.Hello(agent=b"dcptool-restore", features=FEATURES), self._on_hello)

    def feed(self, answer: m.Message) -> bytes | None:
        if not answer.IS_RESPONSE or answer.opaque != self._opaque:
            return b""          # not ours (a server push, a late answer): nothing to send
        return self._next(answer)

    def _on_hello(self, rsp: m.Message) -> bytes | None:
        if isinstance(rsp, m.HelloResponse):
            self.result.features = frozenset(rsp.features)
        if self.user is None:
            return self._select()
        return self._send(m.SaslListMechs(), self._on_mechs)

    def _on_mechs(self, rsp: m.Message) -> bytes | None:
        self._mech = sasl.choose_mechanism(getattr(rsp, "value", b""), allow_plain=self.allow_plain)
        if self._mech == "PLAIN":
            data = sasl.plain_message(self.user or "", self.password or "")
        else:
            self._scram = sasl.ScramClient(self._mech, self.user or "", self.password or "")
            data = self._scram.first()
        return self._send(m.SaslAuth(mechanism=self._mech.encode(), data=data), self._on_sasl)

    def _on_sasl(self, rsp: m.Message) -> bytes | None:
        st = getattr(rsp, "status", 0)
        self._rounds += 1
        if st == Status.AUTH_CONTINUE and self._scram is not None and self._rounds < sasl.MAX_SASL_ROUNDS:
            data = self._scram.final(getattr(rsp, "value", b""))
            return self._send(m.SaslStep(mechanism=self._mech.encode(), data=data), self._on_sasl)
        if st != Status.SUCCESS:
            raise AuthRefused(f"authentication as {self.user!r} refused ({self._mech}): {status_name(st)}; "
                              "check the user and DCPTOOL_PASSWORD", st)
        if self._scram is not None:
            self._scram.verify(getattr(rsp, "value", b""))
        return self._select()

    def _select(self) -> bytes:
        return self._send(m.SelectBucket(bucket=self.bucket.encode()), self._on_select)

    def _on_select(self, rsp: m.Message) -> bytes | None:
        st = getattr(rsp, "status", 0)
        if st in (Status.EACCESS, Status.AUTH_ERROR, Status.AUTH_STALE):
            raise AuthRefused(f"access to bucket {self.bucket!r} denied: {status_name(st)}", st)
        if st != Status.SUCCESS:
            raise RemoteError(ErrorCode.STATUS, f"bucket {self.bucket!r}: SELECT_BUCKET {status_name(st)}", st)
        return self._send(m.Request(opcode=Opcode.GET_CLUSTER_CONFIG), self._on_config)

    def _on_config(self, rsp: m.Message) -> bytes | None:
        if getattr(rsp, "status", 1) == Status.SUCCESS:
            self.result.config = bytes(getattr(rsp, "value", b""))
        return self._send(m.Request(opcode=Opcode.GET_COLLECTIONS_MANIFEST), self._on_manifest)

    def _on_manifest(self, rsp: m.Message) -> bytes | None:
        if getattr(rsp, "status", 1) == Status.SUCCESS:
            self.result.manifest = bytes(getattr(rsp, "value", b""))
        self.done = True
        return None
