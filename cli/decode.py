"""`dcptool decode [FILE|-]`: decode a raw byte stream of DCP frames without a network."""

from __future__ import annotations

import sys

import click

from dcptool.cli.view.output import FORMATS, Sink, default_format
from dcptool.protocol.dcp.wire.constants import DEFAULT_MAX_BODY
from dcptool.replay.display import VALUE_COLUMNS, with_key_base64
from dcptool.replay.rows import bulk_rows, decode_stream

# what a person wants to see per frame; JSON lines carry every column
TABLE_COLUMNS = ["op", "magic", "status", "vbucket", "opaque", "stream_id", "collection_id", "key",
                 "value_len", "by_seqno", "rev_seqno", "snap_version", "snap_start", "snap_end",
                 "snap_flags", "stream_end_reason", "rollback_seqno", "failover_log", "req_start_seqno",
                 "req_end_seqno", "decode_error"]


@click.command()
@click.argument("file", default="-", type=click.File("rb"))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="jsonl in a pipe (default), table on a TTY.")
@click.option("--collections", is_flag=True, help="Keys carry a LEB128 collection-id prefix.")
@click.option("--raw", is_flag=True, help="Add each whole frame (base64).")
@click.option("--values", is_flag=True,
              help="Add each value: JSON datatype as JSON, anything else as value_base64.")
@click.option("--max-body", type=click.IntRange(min=0), default=None,
              help="Refuse frames whose body length is above this (default 20 MiB).")
def decode(file, fmt, collections, raw, values, max_body):
    """Decode concatenated DCP frames (as they crossed the wire) from FILE or stdin.

    One JSON object per frame with the column names of the capture format, every column
    in every row (null when the frame has no such field); keys as text (`key_base64` when
    not UTF-8). A response's
    vbucket comes from the earlier request with the same opaque. A truncated last frame or a
    hostile length is reported (exit 5) after every whole frame before it was printed.

    \b
    Example:
      dcptool decode frames.bin | jq -c '{op, vbucket, by_seqno}'
    """

    cap = DEFAULT_MAX_BODY if max_body is None else max_body
    fmt = default_format(fmt)
    table_cols = with_key_base64(TABLE_COLUMNS)
    if values:
        at = table_cols.index("value_len") + 1
        table_cols[at:at] = VALUE_COLUMNS
    sink = Sink(fmt, columns=table_cols + (["raw"] if raw else []))
    try:
        with bulk_rows():
            decode_stream(file, sink, cap, collections=collections, raw=raw, values=values)
    finally:
        sink.close()
    sys.stdout.flush()
