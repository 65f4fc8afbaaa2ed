"""The DCP messages (and the memcached commands a DCP connection uses) as frozen, slotted
dataclasses: one per message, reserved and unused wire fields kept as fields. Their wire
codec is message_codec.py, their capture rows message_rows.py; messages.py is the one name
callers import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dcptool.protocol.dcp.wire.constants import FrameInfoId, Opcode

# --------------------------------------------------------------------------- bases

@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    opaque: int = 0
    cas: int = 0
    datatype: int = 0
    frame_infos: tuple[tuple[int, bytes], ...] = ()  # flexible-framing (id, payload) pairs, unknown ids kept
    magic: int | None = None     # None: 0x80 / 0x81, or 0x08 / 0x18 when frame_infos is set

    OPCODE: ClassVar[int] = -1   # an Opcode member in each message class, kept as a plain int
    IS_RESPONSE: ClassVar[bool] = False

    def __init_subclass__(cls) -> None:
        cls.OPCODE = int(cls.OPCODE)    # rows and reprs show the number, as on the wire

    @property
    def op_code(self) -> int:
        return self.OPCODE

    @property
    def stream_id(self) -> int | None:
        for fid, payload in self.frame_infos:
            if fid == FrameInfoId.DCP_STREAM_ID and len(payload) == 2:
                return int.from_bytes(payload, "big")
        return None

    def wire_magic(self) -> int:
        if self.magic is not None:
            return self.magic
        if self.frame_infos:
            return 0x18 if self.IS_RESPONSE else 0x08
        return 0x81 if self.IS_RESPONSE else 0x80


@dataclass(frozen=True, slots=True, kw_only=True)
class Request(Message):
    """A request; also the generic form of any request we do not model (or that failed to
    decode: then `decode_error` says why and the parts are kept as sent)."""
    vbucket: int = 0
    opcode: int = -1
    extras: bytes = b""
    key: bytes = b""
    value: bytes = b""
    decode_error: str | None = None
    raw_framing: bytes = b""     # framing extras that did not parse, kept as sent

    @property
    def op_code(self) -> int:
        return self.opcode


@dataclass(frozen=True, slots=True, kw_only=True)
class Response(Message):
    """A response; also the generic form of responses without a special layout."""
    status: int = 0
    opcode: int = -1
    extras: bytes = b""
    key: bytes = b""
    value: bytes = b""
    decode_error: str | None = None
    raw_framing: bytes = b""
    IS_RESPONSE: ClassVar[bool] = True

    @property
    def op_code(self) -> int:
        return self.opcode


# --------------------------------------------------------------------------- requests

@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Message):
    OPCODE: ClassVar[int] = Opcode.HELLO
    vbucket: int = 0
    agent: bytes = b""
    features: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class HelloResponse(Message):
    OPCODE: ClassVar[int] = Opcode.HELLO
    IS_RESPONSE: ClassVar[bool] = True
    status: int = 0
    features: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SaslListMechs(Message):
    OPCODE: ClassVar[int] = Opcode.SASL_LIST_MECHS
    vbucket: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SaslAuth(Message):
    OPCODE: ClassVar[int] = Opcode.SASL_AUTH
    vbucket: int = 0
    mechanism: bytes = b""
    data: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class SaslStep(SaslAuth):
    OPCODE: ClassVar[int] = Opcode.SASL_STEP


@dataclass(frozen=True, slots=True, kw_only=True)
class SelectBucket(Message):
    OPCODE: ClassVar[int] = Opcode.SELECT_BUCKET
    vbucket: int = 0
    bucket: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class GetErrorMap(Message):
    OPCODE: ClassVar[int] = Opcode.GET_ERROR_MAP
    vbucket: int = 0
    version: int = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpOpen(Message):
    OPCODE: ClassVar[int] = Opcode.DCP_OPEN
    vbucket: int = 0
    name: bytes = b""
    flags: int = 0
    seqno: int = 0          # reserved, sent as 0
    value: bytes = b""      # optional JSON (consumer_name)


@dataclass(frozen=True, slots=True, kw_only=True)
class AddStream(Message):
    OPCODE: ClassVar[int] = Opcode.DCP_ADD_STREAM
    vbucket: int = 0
    flags: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseStream(Message):
    OPCODE: ClassVar[int] = Opcode.DCP_CLOSE_STREAM
    vbucket: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamRequest(Message):
    OPCODE: ClassVar[int] = Opcode.DCP_STREAM_REQ
    vbucket: int = 0
    flags: int = 0
    reserved: int = 0
    start_seqno: int = 0
    end_seqno: int = 0xFFFFFFFFFFFFFFFF
    vbucket_uuid: int = 0
    snap_start: int = 0
    snap_end: int = 0
    value: bytes = b""      # optional JSON filter (collections)


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamRequestResponse(Message):
    """Success carries the failover log; ROLLBACK (0x23) the seqno to roll back to."""
    OPCODE: ClassVar[int] = Opcode.DCP_STREAM_REQ
    IS_RESPONSE: ClassVar[bool] = True
    status: int = 0
    failover_log: tuple[tuple[int, int], ...] | None = None  # (vbucket_uuid, seqno), newest first
    rollback_seqno: int | None = None
    value: bytes = b""      # kept for other statuses (error text, or nothing)


@dataclass(frozen=True, slots=True, kw_only=True)
class GetFailoverLog(Message):
    OPCODE: ClassVar[int] = Opcode.DCP_GET_FAILOVER_LOG
    vbucket: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class FailoverLogResponse(Message):
    OPCODE: ClassVar[int] = Opcode.DCP_GET_FAILOVER_LOG
    IS_RESPONSE: ClassVar[bool] = True
    status: int = 0
    failover_log: tuple[tuple[int, int], ...] | None = None
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamEnd(Message):
    OPCODE: ClassVar[int] = Opcode.DCP_STREAM_END
    vbucket: int = 0
    reason: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotMarker(Message):
    """V1: 20-byte extras. V2.x: a 1-byte version extra and the fields in the value
    (V2.0 36 bytes; V2.2 44 bytes, or 52 with the high prepared seqno)."""
    OPCODE: ClassVar[int] = Opcode.DCP_SNAPSHOT_MARKER
    vbucket: int = 0
    snap_version: str = "1"
    snap_start: int = 0
    snap_end: int = 0
    snap_flags: int = 0
    max_visible_seqno: int | None = None
    high_completed_seqno: int | None = None
    purge_seqno: int | None = None
    high_prepared_seqno: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemMessage(Message):
    vbucket: int = 0
    key: bytes = b""
    collection_id: int | None = None  # None: the key carries no collection prefix
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class Mutation(ItemMessage):
    OPCODE: ClassVar[int] = Opcode.DCP_MUTATION
    by_seqno: int = 0
    rev_seqno: int = 0
    item_flags: int = 0
    expiration: int = 0
    lock_time: int = 0
    nmeta: int = 0
    nru: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Deletion(ItemMessage):
    """delete_time None: the V1 layout (nmeta); otherwise V2 (delete time, unused byte)."""
    OPCODE: ClassVar[int] = Opcode.DCP_DELETION
    by_seqno: int = 0
    rev_seqno: int = 0
    delete_time: int | None = None
    nmeta: int = 0
    unused: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Expiration(ItemMessage):
    OPCODE: ClassVar[int] = Opcode.DCP_EXPIRATION
    by_seqno: int = 0
    rev_seqno: int = 0
    delete_time: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SetVbucketState(Message):
    OPCODE: ClassVar[int] = Opcode.DCP_SET_VBUCKET_STATE
    vbucket: int = 0
    state: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Noop(Message):
    OPCODE: ClassVar[int] = Opcode.DCP_NOOP
    vbucket: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferAck(Message):
    OPCODE: ClassVar[int] = Opcode.DCP_BUFFER_ACK
    vbucket: int = 0
    bytes_acked: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Control(Message):
    OPCODE: ClassVar[int] = Opcode.DCP_CONTROL
    vbucket: int = 0
    key: bytes = b""
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class SystemEvent(Message):
    OPCODE: ClassVar[int] = Opcode.DCP_SYSTEM_EVENT
    vbucket: int = 0
    by_seqno: int = 0
    event_id: int = 0
    version: int = 0
    key: bytes = b""        # the event's name; never collection-prefixed
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepare(ItemMessage):
    OPCODE: ClassVar[int] = Opcode.DCP_PREPARE
    by_seqno: int = 0
    rev_seqno: int = 0
    item_flags: int = 0
    expiration: int = 0
    lock_time: int = 0
    nru: int = 0
    deleted: int = 0
    durability: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SeqnoAcknowledged(Message):
    OPCODE: ClassVar[int] = Opcode.DCP_SEQNO_ACK
    vbucket: int = 0
    prepared_seqno: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Commit(ItemMessage):
    OPCODE: ClassVar[int] = Opcode.DCP_COMMIT
    prepared_seqno: int = 0
    commit_seqno: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort(ItemMessage):
    OPCODE: ClassVar[int] = Opcode.DCP_ABORT
    prepared_seqno: int = 0
    abort_seqno: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SeqnoAdvanced(Message):
    OPCODE: ClassVar[int] = Opcode.DCP_SEQNO_ADVANCED
    vbucket: int = 0
    by_seqno: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class OsoSnapshot(Message):
    OPCODE: ClassVar[int] = Opcode.DCP_OSO_SNAPSHOT
    vbucket: int = 0
    flags: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class GetAllVbSeqnos(Message):
    OPCODE: ClassVar[int] = Opcode.GET_ALL_VB_SEQNOS
    vbucket: int = 0
    extras: bytes = b""     # optional state (4) or state + collection (8)


@dataclass(frozen=True, slots=True, kw_only=True)
class GetAllVbSeqnosResponse(Message):
    OPCODE: ClassVar[int] = Opcode.GET_ALL_VB_SEQNOS
    IS_RESPONSE: ClassVar[bool] = True
    status: int = 0
    seqnos: tuple[tuple[int, int], ...] = ()  # (vbucket, high seqno)


# --------------------------------------------------------------------------- documents with metadata
# (XDCR and restores: kv_engine's GET_META, SET/ADD/DEL_WITH_META; the server side is
# protocol/dcp/server/kv_meta.py, the client's requests protocol/dcp/client/kv_writer.py)

@dataclass(frozen=True, slots=True, kw_only=True)
class GetMeta(ItemMessage):
    """GET_META: `version` None sends no extras; 1 or 2 one byte (2: the answer carries the
    document's datatype)."""
    OPCODE: ClassVar[int] = Opcode.GET_META
    version: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GetMetaResponse(Message):
    """A successful GET_META answer (other statuses are the generic Response); the header CAS
    is the document's."""
    OPCODE: ClassVar[int] = Opcode.GET_META
    IS_RESPONSE: ClassVar[bool] = True
    status: int = 0
    deleted: int = 0
    item_flags: int = 0
    expiration: int = 0
    rev_seqno: int = 0
    item_datatype: int | None = None   # version 2 only


@dataclass(frozen=True, slots=True, kw_only=True)
class SetWithMeta(ItemMessage):
    """SET_WITH_META: the document with the metadata it is to keep. The header `cas` is the
    expected CAS of what the target holds (0: any); `meta_cas` is the document's own CAS.
    `options` None: no options word; `ext_meta` None: no meta length field, else the extended
    meta section, sent after the value."""
    OPCODE: ClassVar[int] = Opcode.SET_WITH_META
    item_flags: int = 0
    expiration: int = 0
    rev_seqno: int = 0
    meta_cas: int = 0
    options: int | None = None
    ext_meta: bytes | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AddWithMeta(SetWithMeta):
    """ADD_WITH_META: SET_WITH_META that fails KEY_EEXISTS on a live document."""
    OPCODE: ClassVar[int] = Opcode.ADD_WITH_META


@dataclass(frozen=True, slots=True, kw_only=True)
class DelWithMeta(SetWithMeta):
    """DEL_WITH_META: a tombstone with its metadata (its value: nothing, or xattrs only)."""
    OPCODE: ClassVar[int] = Opcode.DEL_WITH_META
