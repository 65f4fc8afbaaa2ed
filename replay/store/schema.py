"""The capture schema (CAPTURE_FORMAT.md, version 2): the one source of truth for column
names, Arrow types and key-value metadata keys. Everything that writes or reads captures
takes its columns from here."""

from __future__ import annotations

import pyarrow as pa

from dcptool.replay.store.naming import (  # noqa: F401 (the names callers use)
    FORMAT_VERSION,
    META_CAPTURE_ID,
    META_FORMAT,
    META_KEYS,
    META_OPTIONS,
    META_PROTOCOL,
    META_SEGMENT,
    META_SOURCE,
    META_SOURCE_ID,
    META_STARTED_AT,
    META_VERSION,
    PROTOCOLS,
    READABLE_VERSIONS,
    tool_version,
)

DICT_STR = pa.dictionary(pa.int32(), pa.string())

FAILOVER_ENTRY = pa.struct([("vbucket_uuid", pa.uint64()), ("seqno", pa.int64())])

COMMON_FIELDS: list[tuple[str, pa.DataType]] = [
    ("capture_id", DICT_STR),
    ("frame_no", pa.int64()),
    ("conn", pa.int32()),
    ("node", DICT_STR),  # "host:port" the connection went to (version 2)
    ("ts", pa.timestamp("ns", tz="UTC")),
    ("mono_ns", pa.int64()),
    ("direction", DICT_STR),
    ("raw", pa.binary()),
    ("decode_error", pa.string()),
]

DCP_FIELDS: list[tuple[str, pa.DataType]] = [
    ("magic", pa.uint8()),
    ("opcode", pa.uint8()),
    ("op", DICT_STR),
    ("status", pa.uint16()),
    ("vbucket", pa.uint16()),
    ("opaque", pa.uint32()),
    ("cas", pa.uint64()),
    ("datatype", pa.uint8()),
    ("stream_id", pa.uint16()),
    ("collection_id", pa.uint32()),
    ("key", pa.binary()),
    ("value_len", pa.uint32()),
    ("by_seqno", pa.int64()),
    ("rev_seqno", pa.int64()),
    ("item_flags", pa.uint32()),
    ("expiration", pa.uint32()),
    ("lock_time", pa.uint32()),
    ("delete_time", pa.uint32()),
    ("snap_version", DICT_STR),
    ("snap_start", pa.int64()),
    ("snap_end", pa.int64()),
    ("snap_flags", pa.uint32()),
    ("max_visible_seqno", pa.int64()),
    ("high_completed_seqno", pa.int64()),
    ("purge_seqno", pa.int64()),
    ("high_prepared_seqno", pa.int64()),
    ("stream_end_reason", pa.uint32()),
    ("rollback_seqno", pa.int64()),
    ("failover_log", pa.list_(FAILOVER_ENTRY)),
    ("req_flags", pa.uint32()),
    ("req_start_seqno", pa.int64()),
    ("req_end_seqno", pa.uint64()),
    ("req_vbucket_uuid", pa.uint64()),
    ("req_snap_start", pa.int64()),
    ("req_snap_end", pa.int64()),
    ("system_event_id", pa.uint32()),
]

SYNAPSE_FIELDS: list[tuple[str, pa.DataType]] = [
    ("channel", DICT_STR),
    ("command", DICT_STR),
    ("stream", DICT_STR),
    ("instance", DICT_STR),
    ("token", pa.int64()),
    ("batch", pa.bool_()),
    ("prev_token", pa.int64()),
    ("new_token", pa.int64()),
    ("row", pa.string()),
    ("args", pa.string()),
]



def fields(protocol: str) -> list[tuple[str, pa.DataType]]:
    if protocol == "dcp":
        return COMMON_FIELDS + DCP_FIELDS
    if protocol == "synapse":
        return COMMON_FIELDS + SYNAPSE_FIELDS
    raise ValueError(f"unknown protocol {protocol!r}")


def capture_schema(protocol: str, metadata: dict[str, str] | None = None) -> pa.Schema:
    """The Arrow schema of a capture of ``protocol`` ('dcp' or 'synapse')."""
    schema = pa.schema([pa.field(name, typ) for name, typ in fields(protocol)])
    if metadata:
        schema = schema.with_metadata({k: str(v) for k, v in metadata.items()})
    return schema


def column_names(protocol: str) -> list[str]:
    return [name for name, _ in fields(protocol)]

