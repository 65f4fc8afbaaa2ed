"""The names of the DCP rules (REPLAY.md) that the SQL engines and the Python rules share, with
no pyarrow or numpy: which ops belong to a vbucket's stream, the state each change op leaves a
document in, the system event of a collection drop. replay/rules/dcp_vbuckets.py re-exports them."""

from __future__ import annotations

DOC_STATES = {"mutation": "live", "deletion": "deleted", "expiration": "expired"}
# ops that belong to a vbucket's stream; `in` frames with these ops and a vbucket are the
# "vbucket frames" the DCP state is built from
VB_OPS = ("stream_req", "get_failover_log", "stream_end", "snapshot_marker", "mutation",
          "deletion", "expiration", "seqno_advanced", "system_event", "oso_snapshot", "prepare",
          "commit", "abort")
COLLECTION_DROP = 1      # system_event_id of a collection drop (kv_engine system_event.md)
