"""What the DCP consumer (consumer.py) takes and gives: its configuration, the state it keeps
per vbucket to resume from, and the events it emits. Kept apart so that callers and the
capture side can name them without the state machine."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

# the stream key lives in the wire (constants.py); callers of the consumer name it from here too
from dcptool.protocol.dcp.wire.constants import NUM_VB_SLOTS as NUM_VB_SLOTS
from dcptool.protocol.dcp.wire.constants import StreamEndReason
from dcptool.protocol.dcp.wire.constants import key_sid as key_sid
from dcptool.protocol.dcp.wire.constants import key_vb as key_vb
from dcptool.protocol.dcp.wire.constants import stream_key as stream_key

DEFAULT_REOPEN = frozenset({StreamEndReason.STATE_CHANGED, StreamEndReason.DISCONNECTED,
                           StreamEndReason.TOO_SLOW, StreamEndReason.BACKFILL_FAIL,
                           StreamEndReason.ROLLBACK})


# --------------------------------------------------------------------------- state

@dataclasses.dataclass
class VbState:
    """What a consumer keeps per vbucket to resume (PROTOCOLS.md "Consumer rules")."""
    failover_log: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # [(uuid, seqno)], newest first
    last_seqno: int = 0
    snap_start: int = 0
    snap_end: int = 0
    snapshot_complete: bool = True
    ended_reason: int | None = None    # the stream ended for good (not re-requested on resume)
    # with stream ids (--stream-ids): the state of each of the vbucket's streams, by stream id;
    # the fields above then summarise them (the lowest last seqno; ended when all ended)
    streams: dict[int, VbState] = dataclasses.field(default_factory=dict)
    # seqnos at which what was received equals the vbucket (the ends of whole snapshots), oldest
    # first: a rollback below the last seqno restarts at the newest of them at or below its
    # seqno, as a snapshot may be deduplicated and hold no state in between
    points: list[int] = dataclasses.field(default_factory=list)
    # every seqno from this one to last_seqno was received (-1: not known): a rollback to a
    # seqno at or above it restarts there, as nothing in between was deduplicated away
    exact_from: int = -1

    def request_seqnos(self) -> tuple[int, int, int, int]:
        """(start, vbucket uuid, snap start, snap end) of a resuming stream request."""
        uuid = self.failover_log[0][0] if self.failover_log else 0
        s = self.last_seqno
        if self.snapshot_complete or not self.snap_start <= s <= self.snap_end:
            return s, uuid, s, s
        return s, uuid, self.snap_start, self.snap_end


@dataclasses.dataclass
class ConsumerConfig:
    bucket: str
    name: str
    user: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    vbuckets: list[int] | None = None     # None: every vbucket the bucket has
    start: str = "0"                      # "0", "now" or a seqno
    to: str = "now"                       # "now", "forever" or a seqno
    no_value: bool = False
    xattrs: bool = False
    collections: bool = False
    buffer_size: int = 20 * 1024 * 1024   # 0: no flow control
    noop_interval: float = 30.0           # 0: no noops
    tls: bool = False
    allow_plain: bool = False             # PLAIN over plain TCP
    max_in_flight: int = 64
    agent: str = "dcptool"
    reopen_reasons: frozenset[int] = DEFAULT_REOPEN
    max_reopens: int = 5
    max_rollbacks: int = 20
    ack_ratio: float = 0.5
    timeout: float = 30.0                 # a request unanswered this long is a dead connection
    check_vbuckets: bool = False          # ask GET_ALL_VB_SEQNOS with vbuckets given too (ServerVbuckets)
    shard: tuple[int, int] | None = None  # (index, count): only the vbuckets with vb % count == index
    # cluster (docs/CLUSTER.md): after SELECT_BUCKET ask GET_CLUSTER_CONFIG, emit ConfigReceived
    # and wait for route(); with handoff, a stream that ends "state changed" or is refused
    # NOT_MY_VBUCKET goes back to the caller (Handoff / NotMyVbucket) instead of being
    # reopened here or failed
    fetch_config: bool = False
    handoff: bool = False
    # DCP_CONTROLs of issue 13 (handshake.py); `required` names the controls the user asked
    # for explicitly: a refusal of one of them is fatal, of any other reported and skipped
    compress: bool = False                # force_value_compression=true (needs HELLO snappy)
    sync_writes: bool = False             # enable_sync_writes=true: prepare, commit, abort
    expiry_opcode: bool = True            # enable_expiry_opcode=true
    change_streams: bool = False          # change_streams=true: history snapshots, every version
    oso: bool = False                     # enable_out_of_order_snapshots=true_with_seqno_advanced
    required: frozenset[str] = frozenset()
    # collection filter (collections.py, handshake.py): --scope / --collection names resolved
    # through GET_COLLECTIONS_MANIFEST after SELECT_BUCKET; or a filter already resolved
    # (capture --resume keeps the recorded one): the STREAM_REQ value as a dict
    scopes: tuple[str, ...] = ()
    collection_names: tuple[str, ...] = ()
    stream_filter: dict[str, Any] | None = None
    # stream ids (enable_stream_id): one stream per vbucket per group, sids 1, 2, ... in order;
    # a group is (scope names, collection names) resolved like scopes / collection_names, or
    # its filter already resolved (stream_filters, capture --resume); no group: one stream, sid 1
    stream_ids: bool = False
    stream_groups: tuple[tuple[Any, Any], ...] = ()
    stream_filters: tuple[dict[str, Any] | None, ...] | None = None


# --------------------------------------------------------------------------- events

@dataclasses.dataclass(frozen=True, slots=True)
class HandshakeComplete:
    features: tuple[int, ...]
    controls: dict[str, str]
    # the bucket's UUID from the GET_CLUSTER_CONFIG of this connection's set-up ("" when it
    # did not ask, or the server gave none): the source's identity (CAPTURE_FORMAT.md)
    bucket_uuid: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ControlRefused:
    key: str
    value: str
    status: int


@dataclasses.dataclass(frozen=True, slots=True)
class StreamOpened:
    vbucket: int
    start: int
    failover_log: tuple[tuple[int, int], ...]
    stream_id: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Rollback:
    vbucket: int
    seqno: int          # everything above it is void; the stream is re-requested from it
    stream_id: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class StreamFailed:
    vbucket: int
    status: int
    stream_id: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class StreamEnded:
    vbucket: int
    reason: int
    final: bool         # False: the consumer re-requests the stream
    stream_id: int = 0


def in_shard(vbuckets: Iterable[int], shard: tuple[int, int] | None) -> list[int]:
    """The vbuckets of a shard (index, count): vb % count == index; all without one."""
    return list(vbuckets) if shard is None else [vb for vb in vbuckets if vb % shard[1] == shard[0]]


@dataclasses.dataclass(frozen=True, slots=True)
class ServerVbuckets:
    vbuckets: tuple[int, ...]     # the vbuckets GET_ALL_VB_SEQNOS listed (with check_vbuckets and given vbuckets)


@dataclasses.dataclass(frozen=True, slots=True)
class VbSeqnos:
    """The answer to a lag poll (LagPolls.request): (vbucket, high seqno) pairs of the
    node's active vbuckets; status non-zero when the server refused it (then no pairs).
    `positions`: (vbucket, seqno) of those vbuckets this connection asked a stream of, where
    each stood as the answer was read (frames before it in wire order; CLI.md "Lag")."""
    seqnos: tuple[tuple[int, int], ...]
    status: int = 0
    positions: tuple[tuple[int, int], ...] = ()

    def lags(self) -> list[tuple[int, int, int, int]]:
        """(vbucket, high seqno, seqno, lag items) of each vbucket with a position, by vbucket:
        lag items = max(0, high seqno - seqno), the one definition of lag."""
        pos = dict(self.positions)
        return [(vb, high, pos[vb], max(0, high - pos[vb])) for vb, high in sorted(self.seqnos) if vb in pos]


@dataclasses.dataclass(frozen=True, slots=True)
class Finished:
    ended: int
    failed: int


@dataclasses.dataclass(frozen=True, slots=True)
class ConfigReceived:
    """A GET_CLUSTER_CONFIG answer. status 0 with a body: the config JSON (raw, as sent);
    anything else (UNKNOWN_COMMAND, NOT_SUPPORTED, KEY_ENOENT, an empty body): no map, a
    single node that serves every vbucket. bootstrap: the connection waits for route()."""
    raw: bytes
    status: int
    bootstrap: bool


@dataclasses.dataclass(frozen=True, slots=True)
class NotMyVbucket:
    """A stream request (or GET_FAILOVER_LOG) refused NOT_MY_VBUCKET in handoff mode; the
    vbucket left this connection (take_states) and config_raw is the body (may be empty)."""
    vbucket: int
    config_raw: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Handoff:
    """In handoff mode the stream ended with a reason that means "ask the map again" (state
    changed): the vbucket left this connection; take_states() gives its state."""
    vbucket: int
    reason: int


@dataclasses.dataclass(frozen=True, slots=True)
class FilterResolved:
    """The collection filter every stream request carries (STREAM_REQ value) and the
    manifest it was resolved from (raw JSON; empty when it came from the config)."""
    filter: dict[str, Any]
    manifest_raw: bytes
    filters: tuple[dict[str, Any] | None, ...] = ()     # with stream ids: the filter of each stream id (1, 2, ...), None = all


@dataclasses.dataclass(frozen=True, slots=True)
class FilterUnknown:
    """--scope / --collection named something the manifest does not have: the handshake
    stops here; `message` lists the names that exist."""
    message: str
