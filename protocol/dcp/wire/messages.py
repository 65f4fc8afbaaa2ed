"""Every DCP message (and the memcached commands a DCP connection uses) as a frozen,
slotted dataclass, with decode(frame) -> message, encode(message) -> bytes and
to_row(message) -> dict of CAPTURE_FORMAT columns: the one module callers import. The
classes live in message_types.py, the wire codec in message_codec.py, the rows in
message_rows.py.

encode(decode(b)) == b for every valid frame: reserved and unused wire fields are kept as
fields. A frame of a known opcode whose layout is wrong decodes to a generic Request or
Response carrying `decode_error`; nothing raises on bad input except framing errors.
"""

from __future__ import annotations

from dcptool.protocol.dcp.wire.frames import parse_frame
from dcptool.protocol.dcp.wire.message_codec import (
                                                SNAPSHOT_VERSIONS,
                                                decode,
                                                decode_bytes,
)
from dcptool.protocol.dcp.wire.message_rows import to_row, value_bytes
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
                                                ItemMessage,
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
from dcptool.protocol.dcp.wire.message_writers import encode

__all__ = ["parse_frame", "SNAPSHOT_VERSIONS", "decode", "decode_bytes", "encode", "to_row",
           "value_bytes", "Message", "Request", "Response", "Hello", "HelloResponse",
           "SaslListMechs", "SaslAuth", "SaslStep", "SelectBucket", "GetErrorMap", "DcpOpen",
           "AddStream", "CloseStream", "StreamRequest", "StreamRequestResponse", "GetFailoverLog",
           "FailoverLogResponse", "StreamEnd", "SnapshotMarker", "ItemMessage", "Mutation", "Deletion",
           "Expiration", "SetVbucketState", "Noop", "BufferAck", "Control", "SystemEvent",
           "Prepare", "SeqnoAcknowledged", "Commit", "Abort", "SeqnoAdvanced", "OsoSnapshot",
           "GetAllVbSeqnos", "GetAllVbSeqnosResponse", "GetMeta", "GetMetaResponse", "SetWithMeta",
           "AddWithMeta", "DelWithMeta"]
