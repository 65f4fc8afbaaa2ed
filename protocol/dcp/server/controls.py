"""DCP_CONTROL on the producer side, sans-IO: which keys Couchbase Server 7.x accepts, with
which values, and what this producer does with them (DCP_DIGEST §2.6).

Honoured: connection_buffer_size, enable_noop, set_noop_interval, send_stream_end_on_client_
close_stream, enable_expiry_opcode, enable_sync_writes (prepare, commit, abort and marker
V2.0: producer_sync.py), max_marker_version (2.2), force_value_compression (snappy values),
backfill_order (sequential = one stream at a time), enable_out_of_order_snapshots (true /
true_with_seqno_advanced: as kv_engine, a stream filtered to exactly one collection gets its
initial backfill from seqno 0 as an OSO snapshot in key order, with a seqno advanced to its
end with the second value: producer_oso.py; every other stream stays in seqno order).
Accepted and true by construction here: flatbuffers_system_events (this producer sends
no system events), include_deleted_user_xattrs (no xattrs in deletions), v7_dcp_status_codes. Accepted and ignored: set_priority,
supports_cursor_dropping(_vulcan), supports_hifi_MFU, consumer_name. Refused as Couchbase
refuses them: stream_buffer_size (NOT_SUPPORTED), change_streams (NOT_SUPPORTED unless the
bucket has a history collection, producer_history.py; a couchstore bucket keeps no history). Stream ids:
enable_stream_id=true (several streams per vbucket, alt framing, producer_sid.py), refused
NOT_SUPPORTED once sync writes are enabled, as kv_engine does. Unknown keys: EINVAL.
"""

from __future__ import annotations

from typing import Any

from dcptool.protocol.dcp.server.history import control_status as history_control_status
from dcptool.protocol.dcp.wire.constants import Feature, OpenFlag, Status

MIN_NOOP_INTERVAL = 0.1           # connection_manager_interval: smaller intervals are refused
BOOLS = ("true", "false")
REFUSED = ("stream_buffer_size", "change_streams")


def control_status(conn: Any, key: str, val: str, now: float) -> int:
    """Apply one DCP_CONTROL to `conn` (a ProducerConnection); the status to answer."""
    if not key or not val:
        return Status.EINVAL
    if key in conn.server.scenarios.refuse_controls:
        return Status.NOT_SUPPORTED
    if key == "connection_buffer_size":
        if not val.isdigit() or int(val) > 0xFFFFFFFF:
            return Status.EINVAL
        conn.buffer_size = int(val)
        return Status.SUCCESS
    if key == "enable_noop":
        if val not in BOOLS:
            return Status.EINVAL
        conn.noop_enabled = val == "true"
        conn.noop_due = now + (conn.noop_interval or 20.0) if conn.noop_enabled else None
        return Status.SUCCESS
    if key == "set_noop_interval":
        try:
            interval = float(val)
        except ValueError:
            interval = -1
        if interval < MIN_NOOP_INTERVAL:
            return Status.EINVAL
        conn.noop_interval = interval
        if conn.noop_enabled:
            conn.noop_due = now + interval
        return Status.SUCCESS
    if key in ("send_stream_end_on_client_close_stream", "v7_dcp_status_codes", "enable_expiry_opcode",
               "flatbuffers_system_events"):
        return Status.SUCCESS if val == "true" else Status.EINVAL
    if key == "set_priority":
        return Status.SUCCESS if val in ("high", "medium", "low") else Status.EINVAL
    if key in ("supports_cursor_dropping", "supports_cursor_dropping_vulcan", "supports_hifi_MFU",
               "enable_sync_writes"):
        return Status.SUCCESS if val in BOOLS else Status.EINVAL
    if key == "consumer_name":
        return Status.SUCCESS
    if key == "max_marker_version":
        return Status.SUCCESS if (val == "2.2" and conn.collections) else Status.NOT_SUPPORTED
    if key == "enable_out_of_order_snapshots":
        return Status.SUCCESS if val in ("true", "true_with_seqno_advanced") else Status.EINVAL
    if key == "backfill_order":
        return Status.SUCCESS if val in ("round-robin", "sequential") else Status.EINVAL
    if key == "force_value_compression":
        if val not in BOOLS or Feature.SNAPPY not in conn.features:
            return Status.EINVAL
        return Status.SUCCESS
    if key == "enable_stream_id":
        if val != "true":
            return Status.EINVAL
        return Status.NOT_SUPPORTED if conn.sync_writes else Status.SUCCESS
    if key == "include_deleted_user_xattrs":
        if val != "true" or not conn.open_flags & OpenFlag.INCLUDE_DELETED_USER_XATTRS:
            return Status.EINVAL
        return Status.SUCCESS
    if key == "change_streams":     # only a bucket with history collections (producer_history.py)
        return history_control_status(conn, val)
    if key in REFUSED:
        return Status.NOT_SUPPORTED
    return Status.EINVAL
