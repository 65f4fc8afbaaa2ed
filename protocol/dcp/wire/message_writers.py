"""Encoding DCP messages: WRITERS, a table from message class to the parts of its frame
(vbucket or status, extras, key, value), and `encode`. The decoder is message_codec.py; both
use the layouts of layouts.py."""

from __future__ import annotations

from typing import Callable, TypeVar, cast

from dcptool.protocol.dcp.wire import layouts as L
from dcptool.protocol.dcp.wire import message_types as T
from dcptool.protocol.dcp.wire.frames import encode_frame, encode_frame_infos

_M = TypeVar("_M", bound=T.Message)


# --------------------------------------------------------------------------- encode

def _snapshot_parts(m: T.SnapshotMarker) -> L.Parts:
    if m.snap_version == "1":
        return m.vbucket, L.SNAP_V1.pack(m.snap_start, m.snap_end, m.snap_flags), b"", b""
    if m.snap_version == "2.0":
        return m.vbucket, b"\x00", b"", L.SNAP_V20.pack(m.snap_start, m.snap_end, m.snap_flags,
                                                      m.max_visible_seqno or 0, m.high_completed_seqno or 0)
    if m.snap_version == "2.2":
        base = (m.snap_start, m.snap_end, m.snap_flags, m.max_visible_seqno or 0,
                m.high_completed_seqno or 0, m.purge_seqno or 0)
        if m.high_prepared_seqno is None:
            return m.vbucket, b"\x02", b"", L.SNAP_V22.pack(*base)
        return m.vbucket, b"\x02", b"", L.SNAP_V22_HPS.pack(*base, m.high_prepared_seqno)
    raise ValueError(f"snapshot marker version {m.snap_version!r}")


def _deletion_parts(m: T.Deletion) -> L.Parts:
    if m.delete_time is None:
        ex = L.DELETION_V1.pack(m.by_seqno, m.rev_seqno, m.nmeta)
    else:
        ex = L.DELETION_V2.pack(m.by_seqno, m.rev_seqno, m.delete_time, m.unused)
    return m.vbucket, ex, L.join_key(m), m.value


def _stream_response_parts(m: T.StreamRequestResponse | T.FailoverLogResponse) -> L.Parts:
    if m.failover_log is not None:
        return m.status, b"", b"", b"".join(L.PAIR.pack(u, s) for u, s in m.failover_log)
    if isinstance(m, T.StreamRequestResponse) and m.rollback_seqno is not None:
        return m.status, b"", b"", L.U64.pack(m.rollback_seqno)
    return m.status, b"", b"", m.value


def _with_meta_parts(m: T.SetWithMeta | T.AddWithMeta | T.DelWithMeta) -> L.Parts:
    ex = L.WITH_META.pack(m.item_flags, m.expiration, m.rev_seqno, m.meta_cas)
    if m.options is not None:
        ex += L.U32.pack(m.options)
    if m.ext_meta is None:
        return m.vbucket, ex, L.join_key(m), m.value
    return m.vbucket, ex + L.U16.pack(len(m.ext_meta)), L.join_key(m), m.value + m.ext_meta


def _bare_parts(m: T.Noop | T.CloseStream | T.GetFailoverLog | T.SaslListMechs) -> L.Parts:
    return m.vbucket, b"", b"", b""


# message class -> (vbucket or status, extras, key, value) of its frame; the generic
# T.Request / T.Response (and their subclasses) carry their parts as fields
def _by_class(cls: type[_M], write: Callable[[_M], L.Parts]) -> tuple[type[T.Message], Callable[[T.Message], L.Parts]]:
    """A WRITERS entry: `_parts` looks writers up by the exact class of the message, so the
    writer of `cls` only ever sees a `cls` (the cast says what the checker cannot follow)."""
    return cls, cast(Callable[[T.Message], L.Parts], write)


WRITERS: dict[type[T.Message], Callable[[T.Message], L.Parts]] = dict([
    _by_class(T.Mutation, lambda m: (m.vbucket, L.MUTATION.pack(m.by_seqno, m.rev_seqno, m.item_flags, m.expiration,
                                                             m.lock_time, m.nmeta, m.nru), L.join_key(m), m.value)),
    _by_class(T.SnapshotMarker, _snapshot_parts),
    _by_class(T.Deletion, _deletion_parts),
    _by_class(T.Expiration, lambda m: (m.vbucket, L.EXPIRATION.pack(m.by_seqno, m.rev_seqno, m.delete_time), L.join_key(m),
                                     m.value)),
    _by_class(T.Noop, _bare_parts),
    _by_class(T.CloseStream, _bare_parts),
    _by_class(T.GetFailoverLog, _bare_parts),
    _by_class(T.SaslListMechs, _bare_parts),
    _by_class(T.StreamEnd, lambda m: (m.vbucket, L.U32.pack(m.reason), b"", b"")),
    _by_class(T.StreamRequest, lambda m: (m.vbucket, L.STREAM_REQ.pack(m.flags, m.reserved, m.start_seqno, m.end_seqno,
                                                                    m.vbucket_uuid, m.snap_start, m.snap_end), b"", m.value)),
    _by_class(T.StreamRequestResponse, _stream_response_parts),
    _by_class(T.FailoverLogResponse, _stream_response_parts),
    _by_class(T.BufferAck, lambda m: (m.vbucket, L.U32.pack(m.bytes_acked), b"", b"")),
    _by_class(T.Control, lambda m: (m.vbucket, b"", m.key, m.value)),
    _by_class(T.SystemEvent, lambda m: (m.vbucket, L.SYSTEM_EVENT.pack(m.by_seqno, m.event_id, m.version), m.key, m.value)),
    _by_class(T.SeqnoAdvanced, lambda m: (m.vbucket, L.U64.pack(m.by_seqno), b"", b"")),
    _by_class(T.OsoSnapshot, lambda m: (m.vbucket, L.U32.pack(m.flags), b"", b"")),
    _by_class(T.Prepare, lambda m: (m.vbucket, L.PREPARE.pack(m.by_seqno, m.rev_seqno, m.item_flags, m.expiration, m.lock_time,
                                                           m.nru, m.deleted, m.durability), L.join_key(m), m.value)),
    _by_class(T.Commit, lambda m: (m.vbucket, L.TWO_SEQNOS.pack(m.prepared_seqno, m.commit_seqno), L.join_key(m), m.value)),
    _by_class(T.Abort, lambda m: (m.vbucket, L.TWO_SEQNOS.pack(m.prepared_seqno, m.abort_seqno), L.join_key(m), m.value)),
    _by_class(T.SeqnoAcknowledged, lambda m: (m.vbucket, L.U64.pack(m.prepared_seqno), b"", b"")),
    _by_class(T.SetVbucketState, lambda m: (m.vbucket, bytes([m.state]), b"", b"")),
    _by_class(T.DcpOpen, lambda m: (m.vbucket, L.OPEN.pack(m.seqno, m.flags), m.name, m.value)),
    _by_class(T.AddStream, lambda m: (m.vbucket, L.U32.pack(m.flags), b"", b"")),
    _by_class(T.Hello, lambda m: (m.vbucket, b"", m.agent, b"".join(L.U16.pack(x) for x in m.features))),
    _by_class(T.HelloResponse, lambda m: (m.status, b"", b"", b"".join(L.U16.pack(x) for x in m.features))),
    _by_class(T.SaslAuth, lambda m: (m.vbucket, b"", m.mechanism, m.data)),
    _by_class(T.SaslStep, lambda m: (m.vbucket, b"", m.mechanism, m.data)),
    _by_class(T.SelectBucket, lambda m: (m.vbucket, b"", m.bucket, b"")),
    _by_class(T.GetErrorMap, lambda m: (m.vbucket, b"", b"", L.U16.pack(m.version))),
    _by_class(T.GetAllVbSeqnos, lambda m: (m.vbucket, m.extras, b"", b"")),
    _by_class(T.GetAllVbSeqnosResponse, lambda m: (m.status, b"", b"", b"".join(L.VB_SEQNO.pack(v, s) for v, s in m.seqnos))),
    _by_class(T.GetMeta, lambda m: (m.vbucket, b"" if m.version is None else bytes([m.version]), L.join_key(m), b"")),
    _by_class(T.GetMetaResponse, lambda m: (m.status, L.META.pack(m.deleted, m.item_flags, m.expiration, m.rev_seqno)
                                          + (b"" if m.item_datatype is None else bytes([m.item_datatype])), b"", b"")),
    _by_class(T.SetWithMeta, _with_meta_parts),
    _by_class(T.AddWithMeta, _with_meta_parts),
    _by_class(T.DelWithMeta, _with_meta_parts),
])


def _parts(m: T.Message) -> L.Parts:
    """(vbucket or status, extras, key, value) of a message."""
    write = WRITERS.get(type(m))
    if write is not None:
        return write(m)
    if isinstance(m, T.Request):
        return m.vbucket, m.extras, m.key, m.value
    if isinstance(m, T.Response):
        return m.status, m.extras, m.key, m.value
    raise TypeError(f"cannot encode {type(m).__name__}")


def encode(m: T.Message) -> bytes:
    vs, extras, key, value = _parts(m)
    fe = encode_frame_infos(m.frame_infos) if m.frame_infos else getattr(m, "raw_framing", b"")
    magic = m.wire_magic()
    return encode_frame(magic, m.op_code, vbucket_or_status=vs, opaque=m.opaque, cas=m.cas,
                        datatype=m.datatype, framing_extras=fe, extras=extras, key=key, value=value)
