"""Wire constants of the memcached binary protocol as DCP uses it. Unknown values are
tolerated everywhere: use the `name_of` helpers, never Enum(value) on wire data."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

# an int, or a numpy array of them (the stream-key helpers work elementwise on both)
_Ints = TypeVar("_Ints", int, "npt.NDArray[np.integer[Any]]")


class Magic(enum.IntEnum):
    REQUEST = 0x80          # client request; also every DCP message the producer sends
    RESPONSE = 0x81         # response to a 0x80 request, in either direction
    SERVER_REQUEST = 0x82   # server-initiated request (needs HELLO Duplex)
    SERVER_RESPONSE = 0x83  # client's response to a 0x82
    ALT_REQUEST = 0x08      # request with flexible-framing extras
    ALT_RESPONSE = 0x18     # response with flexible-framing extras


REQUEST_MAGICS = frozenset({0x80, 0x82, 0x08})
RESPONSE_MAGICS = frozenset({0x81, 0x83, 0x18})
FLEX_MAGICS = frozenset({0x08, 0x18})
ALL_MAGICS = REQUEST_MAGICS | RESPONSE_MAGICS


class Opcode(enum.IntEnum):
    NOOP_CLIENT = 0x0A          # plain memcached NOOP (client keep-alive)
    HELLO = 0x1F                # feature negotiation
    SASL_LIST_MECHS = 0x20      # list SASL mechanisms
    SASL_AUTH = 0x21            # first SASL message
    SASL_STEP = 0x22            # further SASL messages
    GET_ALL_VB_SEQNOS = 0x48    # high seqno of every vbucket
    DCP_OPEN = 0x50             # open a DCP connection
    DCP_ADD_STREAM = 0x51       # ns_server -> server-side consumer only
    DCP_CLOSE_STREAM = 0x52     # consumer asks to close a vbucket stream
    DCP_STREAM_REQ = 0x53       # consumer asks for a vbucket stream
    DCP_GET_FAILOVER_LOG = 0x54  # failover log of a vbucket
    DCP_STREAM_END = 0x55       # producer ends a stream, with a reason
    DCP_SNAPSHOT_MARKER = 0x56  # start of a snapshot
    DCP_MUTATION = 0x57         # document created or changed
    DCP_DELETION = 0x58         # document deleted
    DCP_EXPIRATION = 0x59       # document expired
    DCP_FLUSH = 0x5A            # unsupported
    DCP_SET_VBUCKET_STATE = 0x5B  # takeover only
    DCP_NOOP = 0x5C             # producer keep-alive; the consumer must answer
    DCP_BUFFER_ACK = 0x5D       # consumer acknowledges processed bytes
    DCP_CONTROL = 0x5E          # connection setting
    DCP_SYSTEM_EVENT = 0x5F     # collection / scope event
    DCP_PREPARE = 0x60          # sync-write prepare
    DCP_SEQNO_ACK = 0x61        # consumer acknowledges a prepare (replicas)
    DCP_COMMIT = 0x62           # sync-write commit
    DCP_ABORT = 0x63            # sync-write abort
    DCP_SEQNO_ADVANCED = 0x64   # seqno moved past items not sent
    DCP_OSO_SNAPSHOT = 0x65     # out-of-sequence-order snapshot start/end
    SELECT_BUCKET = 0x89        # choose the bucket of the connection
    GET_FAILOVER_LOG = 0x96     # non-DCP failover log
    GET_CLUSTER_CONFIG = 0xB5   # cluster map
    GET_COLLECTIONS_MANIFEST = 0xBA  # the bucket's collections manifest (JSON)
    GET_ERROR_MAP = 0xFE        # extended error map
    # KV (documents), as `serve dcp` answers them (protocol/dcp/server/kv.py)
    GET = 0x00
    SET = 0x01                  # upsert
    ADD = 0x02                  # insert
    REPLACE = 0x03
    DELETE = 0x04               # remove
    INCREMENT = 0x05
    DECREMENT = 0x06
    APPEND = 0x0E
    PREPEND = 0x0F
    TOUCH = 0x1C
    GAT = 0x1D                  # get and touch
    GET_REPLICA = 0x83
    GET_META = 0xA0             # exists
    GET_LOCKED = 0x94           # get and lock
    UNLOCK_KEY = 0x95
    GET_COLLECTION_ID = 0xBB
    # writes with metadata (XDCR, restore): protocol/dcp/server/kv_meta.py
    SET_WITH_META = 0xA2
    ADD_WITH_META = 0xA4
    DEL_WITH_META = 0xA8


OP_NAMES: dict[int, str] = {
    0x0A: "noop_client", 0x1F: "hello", 0x20: "sasl_list_mechs", 0x21: "sasl_auth",
    0x22: "sasl_step", 0x48: "get_all_vb_seqnos", 0x50: "open", 0x51: "add_stream",
    0x52: "close_stream", 0x53: "stream_req", 0x54: "get_failover_log", 0x55: "stream_end",
    0x56: "snapshot_marker", 0x57: "mutation", 0x58: "deletion", 0x59: "expiration",
    0x5A: "flush", 0x5B: "set_vbucket_state", 0x5C: "noop", 0x5D: "buffer_ack",
    0x5E: "control", 0x5F: "system_event", 0x60: "prepare", 0x61: "seqno_acknowledged",
    0x62: "commit", 0x63: "abort", 0x64: "seqno_advanced", 0x65: "oso_snapshot",
    0x89: "select_bucket", 0x96: "get_failover_log_nondcp", 0xB5: "get_cluster_config",
    0xBA: "get_collections_manifest", 0xA0: "get_meta", 0xA2: "set_with_meta", 0xA4: "add_with_meta",
    0xA8: "del_with_meta",
    0xFE: "get_error_map",
}
# server requests (magic 0x82) and their answers (0x83) have their own opcode space
SERVER_OP_CLUSTERMAP_CHANGE_NOTIFICATION = 0x01
SERVER_OP_NAMES: dict[int, str] = {0x01: "clustermap_change_notification", 0x02: "authenticate",
                                   0x03: "active_external_users", 0x04: "get_authorization"}
# index opcode, or SERVER_OP_BASE + opcode for magic 0x82 / 0x83 (op_index)
SERVER_OP_BASE = 256
OP_NAME_TABLE: list[str] = ([OP_NAMES.get(i, f"unknown_0x{i:02x}") for i in range(256)]
                            + [SERVER_OP_NAMES.get(i, f"server_unknown_0x{i:02x}") for i in range(256)])


def op_name(opcode: int, magic: int = 0x80) -> str:
    return OP_NAME_TABLE[(opcode & 0xFF) + (SERVER_OP_BASE if magic in (0x82, 0x83) else 0)]


def op_index(magic: npt.NDArray[np.integer[Any]], opcode: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.int32]:
    """OP_NAME_TABLE indexes (int32) of numpy magic / opcode arrays."""
    idx = opcode.astype("int32")
    server = (magic | 1) == 0x83          # 0x82 or 0x83
    if server.any():
        idx[server] += SERVER_OP_BASE
    return idx


class Status(enum.IntEnum):
    SUCCESS = 0x00
    KEY_ENOENT = 0x01
    KEY_EEXISTS = 0x02
    E2BIG = 0x03
    EINVAL = 0x04
    NOT_STORED = 0x05
    DELTA_BADVAL = 0x06
    NOT_MY_VBUCKET = 0x07
    NO_BUCKET = 0x08
    LOCKED = 0x09
    DCP_STREAM_NOT_FOUND = 0x0A
    OPAQUE_NO_MATCH = 0x0B
    NOT_LOCKED = 0x0E
    AUTH_STALE = 0x1F
    AUTH_ERROR = 0x20
    AUTH_CONTINUE = 0x21
    ERANGE = 0x22
    ROLLBACK = 0x23
    EACCESS = 0x24
    NOT_INITIALIZED = 0x25
    UNKNOWN_COMMAND = 0x81
    ENOMEM = 0x82
    NOT_SUPPORTED = 0x83
    EINTERNAL = 0x84
    EBUSY = 0x85
    ETMPFAIL = 0x86
    UNKNOWN_COLLECTION = 0x88
    UNKNOWN_SCOPE = 0x8C
    DCP_STREAM_ID_INVALID = 0x8D
    DURABILITY_INVALID_LEVEL = 0xA0
    DURABILITY_IMPOSSIBLE = 0xA1
    SYNC_WRITE_IN_PROGRESS = 0xA2
    SYNC_WRITE_AMBIGUOUS = 0xA3
    SYNC_WRITE_RECOMMIT_IN_PROGRESS = 0xA4


def status_name(status: int) -> str:
    try:
        return Status(status).name.lower()
    except ValueError:
        return f"unknown_0x{status:04x}"


class DatatypeBit(enum.IntFlag):
    JSON = 0x01
    SNAPPY = 0x02
    XATTR = 0x04


class WithMetaOption(enum.IntFlag):
    """The options word of SET/ADD/DEL_WITH_META (the extras' optional fifth field)."""
    FORCE_WITH_META_OP = 0x01           # old name of skipping conflict resolution
    FORCE_ACCEPT_WITH_META_OPS = 0x02   # required by LWW buckets
    REGENERATE_CAS = 0x04               # the server makes a new CAS (needs SKIP_CONFLICT_RESOLUTION)
    SKIP_CONFLICT_RESOLUTION = 0x08     # write whatever the target holds
    IS_EXPIRATION = 0x10                # DEL_WITH_META of an expiry


class Feature(enum.IntEnum):
    DATATYPE = 0x01             # obsolete; harmless
    TLS = 0x02
    TCP_NODELAY = 0x03
    MUTATION_SEQNO = 0x04
    TCP_DELAY = 0x05
    XATTR = 0x06                # receive extended attributes
    XERROR = 0x07               # extended error codes instead of disconnects
    SELECT_BUCKET = 0x08
    SNAPPY = 0x0A               # values may arrive Snappy-compressed
    JSON = 0x0B                 # server marks JSON values
    DUPLEX = 0x0C               # server-initiated requests
    CLUSTERMAP_CHANGE_NOTIFICATION = 0x0D   # with Duplex: the server pushes each new config
    UNORDERED_EXECUTION = 0x0E  # never on DCP connections
    TRACING = 0x0F
    ALT_REQUEST_SUPPORT = 0x10  # flexible framing
    SYNC_REPLICATION = 0x11
    COLLECTIONS = 0x12          # LEB128 collection prefix on keys
    SNAPPY_EVERYWHERE = 0x13
    PRESERVE_TTL = 0x14
    VATTR = 0x15
    CLUSTERMAP_CHANGE_NOTIFICATION_BRIEF = 0x1F   # with Duplex: only (revEpoch, rev) pushed


class OpenFlag(enum.IntFlag):
    PRODUCER = 0x001                 # "you produce, I consume"
    NOTIFIER = 0x002                 # obsolete; refused
    INCLUDE_XATTRS = 0x004
    NO_VALUE = 0x008
    INCLUDE_DELETE_TIMES = 0x020     # deletions use the V2 layout
    NO_VALUE_WITH_DATATYPE = 0x040
    INCLUDE_DELETED_USER_XATTRS = 0x100
    SKIP_DELETES_IN_BACKFILL = 0x200


class StreamRequestFlag(enum.IntFlag):
    TAKEOVER = 0x01
    DISK_ONLY = 0x02
    TO_LATEST = 0x04
    NO_VALUE = 0x08                  # removed; refused
    ACTIVE_VB_ONLY = 0x10
    STRICT_VB_UUID = 0x20
    FROM_LATEST = 0x40
    IGNORE_PURGED_TOMBSTONES = 0x80
    CACHE_TRANSFER = 0x100


class StreamEndReason(enum.IntEnum):
    OK = 0               # reached the requested end seqno
    CLOSED = 1           # closed by the consumer
    STATE_CHANGED = 2    # vbucket state changed
    DISCONNECTED = 3     # connection going down
    TOO_SLOW = 4         # cursor dropped
    BACKFILL_FAIL = 5    # backfill failed
    ROLLBACK = 6         # vbucket rolled back
    FILTER_EMPTY = 7     # every filtered collection dropped
    LOST_PRIVILEGES = 8  # access lost


def stream_end_reason_name(reason: int) -> str:
    try:
        return StreamEndReason(reason).name.lower()
    except ValueError:
        return f"unknown_{reason}"


class SnapshotFlag(enum.IntFlag):
    MEMORY = 0x01
    DISK = 0x02
    CHECKPOINT = 0x04
    ACK = 0x08
    HISTORY = 0x10
    MAY_CONTAIN_DUPLICATES = 0x20


class VbucketState(enum.IntEnum):
    ACTIVE = 1
    REPLICA = 2
    PENDING = 3
    DEAD = 4


class FrameInfoId(enum.IntEnum):
    BARRIER = 0
    DURABILITY = 1
    DCP_STREAM_ID = 2
    IMPERSONATE = 4
    PRESERVE_TTL = 5


# ---- the key of a stream: one per (vbucket, stream id); sid 0 = no stream id, so without
# stream ids the key is the vbucket. Dense (vbucket + 1024 x sid), so per-stream state can be
# a flat array; the consumer, the producer and the replay rules all key streams with it.
# Works elementwise on numpy arrays too.
NUM_VB_SLOTS = 1024       # vbucket ids a bucket can have (0-1023); anything above is hostile


def stream_key(vb: _Ints, sid: _Ints) -> _Ints:
    return vb + NUM_VB_SLOTS * sid


def key_vb(key: _Ints) -> _Ints:
    return key % NUM_VB_SLOTS


def key_sid(key: _Ints) -> _Ints:
    return key // NUM_VB_SLOTS


SEQNO_INFINITY = 0xFFFFFFFFFFFFFFFF
HEADER_LEN = 24
# kv_engine's two limits (its docs/DocumentSizeLimits.md): a document's value is at most
# MAX_VALUE (max_item_size: a larger one is answered E2BIG, the connection stays), and a frame
# is at most MAX_PACKET (max_packet_size: a server drops a connection that sends a larger one).
# A frame carrying a 20 MiB value (a KV request or answer, a DCP mutation) is that plus its key,
# extras and header, so the body cap is the packet's; a larger length field is hostile or corrupt.
MAX_VALUE = 20 * 1024 * 1024
MAX_PACKET = 30 * 1024 * 1024
DEFAULT_MAX_BODY = MAX_PACKET - HEADER_LEN
