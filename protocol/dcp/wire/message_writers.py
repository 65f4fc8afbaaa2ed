"""Encoding DCP messages: WRITERS, a table from message class to the parts of its frame
(vbucket or status, extras, key, value), and `encode`. The decoder is message_codec.py; both
use the layouts of layouts.py."""

from __future__ import annotations

from typing import Callable, TypeVar, cast

from dcptool.protocol.dcp.wire.frames import encode_frame, encode_frame_infos
from dcptool.protocol.dcp.wire.layouts import (
    DELETION_V1 as _DELETION_V1,
)
from dcptool.protocol.dcp.wire.layouts import (
    DELETION_V2 as _DELETION_V2,
)
from dcptool.protocol.dcp.wire.layouts import (
    EXPIRATION as _EXPIRATION,
)
from dcptool.protocol.dcp.wire.layouts import (
    META as _META,
)
from dcptool.protocol.dcp.wire.layouts import (
    MUTATION as _MUTATION,
)
from dcptool.protocol.dcp.wire.layouts import (
    OPEN as _OPEN,
)
from dcptool.protocol.dcp.wire.layouts import (
    PAIR as _PAIR,
)
from dcptool.protocol.dcp.wire.layouts import (
    PREPARE as _PREPARE,
)
from dcptool.protocol.dcp.wire.layouts import (
    SNAP_V1 as _SNAP_V1,
)
from dcptool.protocol.dcp.wire.layouts import (
    SNAP_V20 as _SNAP_V20,
)
from dcptool.protocol.dcp.wire.layouts import (
    SNAP_V22 as _SNAP_V22,
)
from dcptool.protocol.dcp.wire.layouts import (
    SNAP_V22_HPS as _SNAP_V22_HPS,
)
from dcptool.protocol.dcp.wire.layouts import (
    STREAM_REQ as _STREAM_REQ,
)
from dcptool.protocol.dcp.wire.layouts import (
    SYSTEM_EVENT as _SYSTEM_EVENT,
)
from dcptool.protocol.dcp.wire.layouts import (
    TWO_SEQNOS as _TWO_SEQNOS,
)
from dcptool.protocol.dcp.wire.layouts import (
    U16 as _U16,
)
from dcptool.protocol.dcp.wire.layouts import (
    U32 as _U32,
)
from dcptool.protocol.dcp.wire.layouts import (
    U64 as _U64,
)
from dcptool.protocol.dcp.wire.layouts import (
    VB_SEQNO as _VB_SEQNO,
)
from dcptool.protocol.dcp.wire.layouts import (
    WITH_META as _WITH_META,
)
from dcptool.protocol.dcp.wire.layouts import (
    Parts as _Parts,
)
from dcptool.protocol.dcp.wire.layouts import (
    join_key as _join_key,
)
from dcptool.protocol.dcp.wire.message_types import (
    Abort,
    AddStream,
    AddWithMeta,
    BufferAck,
    CloseStream,
    Commit,
    Control,
    DcpOpen,
    Deletion,
    DelWithMeta,
    Expiration,
    FailoverLogResponse,
    GetAllVbSeqnos,
    GetAllVbSeqnosResponse,
    GetErrorMap,
    GetFailoverLog,
    GetMeta,
    GetMetaResponse,
    Hello,
    HelloResponse,
    Message,
    Mutation,
    Noop,
    OsoSnapshot,
    Prepare,
    Request,
    Response,
    SaslAuth,
    SaslListMechs,
    SaslStep,
    SelectBucket,
    SeqnoAcknowledged,
    SeqnoAdvanced,
    SetVbucketState,
    SetWithMeta,
    SnapshotMarker,
    StreamEnd,
    StreamRequest,
    StreamRequestResponse,
    SystemEvent,
)

_M = TypeVar("_M", bound=Message)


# --------------------------------------------------------------------------- encode

def _snapshot_parts(m: SnapshotMarker) -> _Parts:
    if m.snap_version == "1":
        return m.vbucket, _SNAP_V1.pack(m.snap_start, m.snap_end, m.snap_flags), b"", b""
    if m.snap_version == "2.0":
        return m.vbucket, b"\x00", b"", _SNAP_V20.pack(m.snap_start, m.snap_end, m.snap_flags,
                                                      m.max_visible_seqno or 0, m.high_completed_seqno or 0)
    if m.snap_version == "2.2":
        base = (m.snap_start, m.snap_end, m.snap_flags, m.max_visible_seqno or 0,
                m.high_completed_seqno or 0, m.purge_seqno or 0)
        if m.high_prepared_seqno is None:
            return m.vbucket, b"\x02", b"", _SNAP_V22.pack(*base)
        return m.vbucket, b"\x02", b"", _SNAP_V22_HPS.pack(*base, m.high_prepared_seqno)
    raise ValueError(f"snapshot marker version {m.snap_version!r}")


def _deletion_parts(m: Deletion) -> _Parts:
    if m.delete_time is None:
        ex = _DELETION_V1.pack(m.by_seqno, m.rev_seqno, m.nmeta)
    else:
        ex = _DELETION_V2.pack(m.by_seqno, m.rev_seqno, m.delete_time, m.unused)
    return m.vbucket, ex, _join_key(m), m.value


def _stream_response_parts(m: StreamRequestResponse | FailoverLogResponse) -> _Parts:
    if m.failover_log is not None:
        return m.status, b"", b"", b"".join(_PAIR.pack(u, s) for u, s in m.failover_log)
    if isinstance(m, StreamRequestResponse) and m.rollback_seqno is not None:
        return m.status, b"", b"", _U64.pack(m.rollback_seqno)
    return m.status, b"", b"", m.value


def _with_meta_parts(m: SetWithMeta | AddWithMeta | DelWithMeta) -> _Parts:
    ex = _WITH_META.pack(m.item_flags, m.expiration, m.rev_seqno, m.meta_cas)
    if m.options is not None:
        ex += _U32.pack(m.options)
    if m.ext_meta is None:
        return m.vbucket, ex, _join_key(m), m.value
    return m.vbucket, ex + _U16.pack(len(m.ext_meta)), _join_key(m), m.value + m.ext_meta


def _bare_parts(m: Noop | CloseStream | GetFailoverLog | SaslListMechs) -> _Parts:
    return m.vbucket, b"", b"", b""


# message class -> (vbucket or status, extras, key, value) of its frame; the generic
# Request / Response (and their subclasses) carry their parts as fields
def _by_class(cls: type[_M], write: Callable[[_M], _Parts]) -> tuple[type[Message], Callable[[Message], _Parts]]:
    """A WRITERS entry: `_parts` looks writers up by the exact class of the message, so the
    writer of `cls` only ever sees a `cls` (the cast says what the checker cannot follow)."""
    return cls, cast(Callable[[Message], _Parts], write)


WRITERS: dict[type[Message], Callable[[Message], _Parts]] = dict([
    _by_class(Mutation, lambda m: (m.vbucket, _MUTATION.pack(m.by_seqno, m.rev_seqno, m.item_flags, m.expiration,
                                                             m.lock_time, m.nmeta, m.nru), _join_key(m), m.value)),
    _by_class(SnapshotMarker, _snapshot_parts),
    _by_class(Deletion, _deletion_parts),
    _by_class(Expiration, lambda m: (m.vbucket, _EXPIRATION.pack(m.by_seqno, m.rev_seqno, m.delete_time), _join_key(m),
                                     m.value)),
    _by_class(Noop, _bare_parts),
    _by_class(CloseStream, _bare_parts),
    _by_class(GetFailoverLog, _bare_parts),
    _by_class(SaslListMechs, _bare_parts),
    _by_class(StreamEnd, lambda m: (m.vbucket, _U32.pack(m.reason), b"", b"")),
    _by_class(StreamRequest, lambda m: (m.vbucket, _STREAM_REQ.pack(m.flags, m.reserved, m.start_seqno, m.end_seqno,
                                                                    m.vbucket_uuid, m.snap_start, m.snap_end), b"", m.value)),
    _by_class(StreamRequestResponse, _stream_response_parts),
    _by_class(FailoverLogResponse, _stream_response_parts),
    _by_class(BufferAck, lambda m: (m.vbucket, _U32.pack(m.bytes_acked), b"", b"")),
    _by_class(Control, lambda m: (m.vbucket, b"", m.key, m.value)),
    _by_class(SystemEvent, lambda m: (m.vbucket, _SYSTEM_EVENT.pack(m.by_seqno, m.event_id, m.version), m.key, m.value)),
    _by_class(SeqnoAdvanced, lambda m: (m.vbucket, _U64.pack(m.by_seqno), b"", b"")),
    _by_class(OsoSnapshot, lambda m: (m.vbucket, _U32.pack(m.flags), b"", b"")),
    _by_class(Prepare, lambda m: (m.vbucket, _PREPARE.pack(m.by_seqno, m.rev_seqno, m.item_flags, m.expiration, m.lock_time,
                                                           m.nru, m.deleted, m.durability), _join_key(m), m.value)),
    _by_class(Commit, lambda m: (m.vbucket, _TWO_SEQNOS.pack(m.prepared_seqno, m.commit_seqno), _join_key(m), m.value)),
    _by_class(Abort, lambda m: (m.vbucket, _TWO_SEQNOS.pack(m.prepared_seqno, m.abort_seqno), _join_key(m), m.value)),
    _by_class(SeqnoAcknowledged, lambda m: (m.vbucket, _U64.pack(m.prepared_seqno), b"", b"")),
    _by_class(SetVbucketState, lambda m: (m.vbucket, bytes([m.state]), b"", b"")),
    _by_class(DcpOpen, lambda m: (m.vbucket, _OPEN.pack(m.seqno, m.flags), m.name, m.value)),
    _by_class(AddStream, lambda m: (m.vbucket, _U32.pack(m.flags), b"", b"")),
    _by_class(Hello, lambda m: (m.vbucket, b"", m.agent, b"".join(_U16.pack(x) for x in m.features))),
    _by_class(HelloResponse, lambda m: (m.status, b"", b"", b"".join(_U16.pack(x) for x in m.features))),
    _by_class(SaslAuth, lambda m: (m.vbucket, b"", m.mechanism, m.data)),
    _by_class(SaslStep, lambda m: (m.vbucket, b"", m.mechanism, m.data)),
    _by_class(SelectBucket, lambda m: (m.vbucket, b"", m.bucket, b"")),
    _by_class(GetErrorMap, lambda m: (m.vbucket, b"", b"", _U16.pack(m.version))),
    _by_class(GetAllVbSeqnos, lambda m: (m.vbucket, m.extras, b"", b"")),
    _by_class(GetAllVbSeqnosResponse, lambda m: (m.status, b"", b"", b"".join(_VB_SEQNO.pack(v, s) for v, s in m.seqnos))),
    _by_class(GetMeta, lambda m: (m.vbucket, b"" if m.version is None else bytes([m.version]), _join_key(m), b"")),
    _by_class(GetMetaResponse, lambda m: (m.status, _META.pack(m.deleted, m.item_flags, m.expiration, m.rev_seqno)
                                          + (b"" if m.item_datatype is None else bytes([m.item_datatype])), b"", b"")),
    _by_class(SetWithMeta, _with_meta_parts),
    _by_class(AddWithMeta, _with_meta_parts),
    _by_class(DelWithMeta, _with_meta_parts),
])


def _parts(m: Message) -> _Parts:
    """(vbucket or status, extras, key, value) of a message."""
    write = WRITERS.get(type(m))
    if write is not None:
        return write(m)
    if isinstance(m, Request):
        return m.vbucket, m.extras, m.key, m.value
    if isinstance(m, Response):
        return m.status, m.extras, m.key, m.value
    raise TypeError(f"cannot encode {type(m).__name__}")


def encode(m: Message) -> bytes:
    vs, extras, key, value = _parts(m)
    fe = encode_frame_infos(m.frame_infos) if m.frame_infos else getattr(m, "raw_framing", b"")
    magic = m.wire_magic()
    return encode_frame(magic, m.op_code, vbucket_or_status=vs, opaque=m.opaque, cas=m.cas,
                        datatype=m.datatype, framing_extras=fe, extras=extras, key=key, value=value)
