"""Row layouts of Synapse's replication streams (synapse/replication/tcp/streams/, Synapse
1.163): each RDATA row is a JSON array whose items are the attributes of the stream's row
type, in order. ``decode_row`` names them for display; captures keep the row text as sent.

On SQLite, booleans may arrive as 0/1; they are passed through as received.
"""

from __future__ import annotations

from typing import Any

from dcptool.protocol.synapse.commands import loads_bounded

# stream name -> field names of its row type, in wire order
STREAM_FIELDS: dict[str, tuple[str, ...]] = {
    "backfill": ("event_id", "room_id", "type", "state_key", "redacts", "relates_to"),
    "presence": ("user_id", "state", "last_active_ts", "last_federation_update_ts",
                 "last_user_sync_ts", "status_msg", "currently_active"),
    "presence_federation": ("destination", "user_id"),
    "typing": ("room_id", "user_ids"),
    "receipts": ("room_id", "receipt_type", "user_id", "event_id", "thread_id", "data"),
    "push_rules": ("user_id",),
    "pushers": ("user_id", "app_id", "pushkey", "deleted"),
    "caches": ("cache_func", "keys", "invalidation_ts"),
    "device_lists": ("user_id", "is_signature", "hosts_calculated"),
    "to_device": ("entity",),
    "federation": ("type", "data"),
    "account_data": ("user_id", "room_id", "data_type"),
    "profile_updates": ("user_id", "action", "affected_fields"),
    "sticky_events": ("room_id", "event_id"),
    "thread_subscriptions": ("user_id", "room_id", "event_id"),
    "un_partial_stated_room": ("room_id",),
    "un_partial_stated_event": ("event_id", "rejection_status_changed"),
    "quarantined_media": ("origin", "media_id", "quarantined"),
}

# The events stream's row is [type_id, data]; data's layout depends on type_id.
EVENT_ROW_FIELDS: dict[str, tuple[str, ...]] = {
    "ev": ("event_id", "room_id", "type", "state_key", "redacts", "relates_to", "membership",
           "rejected", "outlier"),
    "state": ("room_id", "type", "state_key", "event_id"),
    "state-all": ("room_id",),
}

STREAMS: tuple[str, ...] = ("events",) + tuple(STREAM_FIELDS)


def name_fields(names: tuple[str, ...], values: object) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not isinstance(values, list):
        return {"value": values}
    for i, v in enumerate(values):
        out[names[i] if i < len(names) else f"field{i}"] = v
    return out


def decode_row(stream: str, row_json: str) -> dict[str, Any]:
    """Named fields of one RDATA row. Unknown streams give ``field0, field1 ...``; the events
    stream gives ``row_type`` plus the fields of that row type. Raises ValueError on bad
    JSON, and on JSON nested deeper than commands.MAX_JSON_DEPTH."""
    value = loads_bounded(row_json)
    if stream == "events":
        if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
            kind, data = value
            return {"row_type": kind, **name_fields(EVENT_ROW_FIELDS.get(kind, ()), data)}
        return name_fields((), value)
    return name_fields(STREAM_FIELDS.get(stream, ()), value)
