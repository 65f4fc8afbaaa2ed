"""`stream synapse://...` without the CLI: the capture's client and transports
(capture/synapse_capture.py) with a handler that turns every line crossing the wire into a row for
a sink (cli/view/output.py Sink): the row of the capture format with `ts` as text, RDATA
rows' fields decoded and, for tables and text, one readable `detail` cell."""

from __future__ import annotations

import json

import pyarrow as pa

from dcptool.capture import synapse_capture
from dcptool.capture.options import LiveOptions
from dcptool.live.view_filter import RowFilter
from dcptool.protocol.synapse.rows import decode_row
from dcptool.replay.store.synapse_batch import build_batch
from dcptool.replay.timestamps import iso_ns


def _detail(r: dict) -> str:
    """One readable cell: named row fields, POSITION tokens, or the arguments."""
    if r.get("decode_error"):
        return "error: " + r["decode_error"]
    if r.get("fields"):
        return " ".join(f"{k}={_short(v)}" for k, v in r["fields"].items() if v is not None)
    if r.get("command") == "POSITION":
        return f"{r['prev_token']} -> {r['new_token']}"
    text = r.get("args") or ""
    if r.get("channel"):
        text = f"[{r['channel']}] {text}"
    return text


def _short(v) -> str:
    s = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
    return s   # never cut: the table folds long cells on a terminal and keeps them whole elsewhere


def _with_text_ts(batch, ts: str):
    """The batch with `ts` as the contract's text (one instant for the whole batch): no
    datetime objects, which would need pandas for nanoseconds."""
    i = batch.schema.get_field_index("ts")
    if i < 0:
        return batch
    arrays = list(batch.columns)
    arrays[i] = pa.array([ts] * batch.num_rows, pa.string())
    return pa.RecordBatch.from_arrays(arrays, names=batch.schema.names)


class StreamHandler(synapse_capture.SynapseRun):
    """`stream`'s run: every line that crosses the wire as a row for `sink` (a received one
    counted, shown unless --streams leaves its stream out); `tell` gets gaps and reconnects."""

    def __init__(self, opts: LiveOptions, sink, tell):
        super().__init__(opts, tell)
        self.sink = sink
        self.frame_no = 0
        self.view: RowFilter | None = None   # --ops / --key / the live table's default

    def block(self, direction, scan, *, conn, ts_ns, mono_ns, channel=None):
        self.lines(direction, scan.lines(), None, conn=conn, ts_ns=ts_ns, mono_ns=mono_ns,
                   channel=channel)

    def lines(self, direction, lines, split, *, conn, ts_ns, mono_ns, channel=None, errors=None):
        batch = build_batch(lines, frame_no=self.frame_no, conn=conn, ts_ns=ts_ns, mono_ns=mono_ns,
                            direction=direction, channel=channel, split=split, errors=errors)
        self.frame_no += len(lines)
        self.observe(direction, batch)
        ts = iso_ns(ts_ns)
        rows = _with_text_ts(batch, ts).to_pylist()
        out = []
        shown = 0
        nbytes = 0
        for r, line in zip(rows, lines):
            if direction == "in" and self.stop:
                break
            shown += 1
            nbytes += len(line) + (1 if channel is None else 0)
            if self.streams is not None and r["stream"] is not None and r["stream"] not in self.streams:
                continue      # received (and counted in messages_in), not shown
            raw = r.pop("raw")
            if self.opts.raw:
                r["raw"] = raw
            r["fields"] = None
            if r["command"] == "RDATA" and r["row"] is not None:
                try:
                    r["fields"] = decode_row(r["stream"], r["row"])
                except ValueError as exc:  # bad or too deeply nested JSON: the line stays
                    r["fields"] = None
                    r["decode_error"] = r["decode_error"] or f"row: {exc}"
            if self.view is not None and not self.view.synapse_row(r):
                if direction == "in":   # received (--max-messages counts it), not printed
                    self.count_in(1)
                continue
            if r["batch"]:
                r["token"] = "batch"
            if self.sink.fmt != "jsonl":
                r["detail"] = _detail(r)
            out.append(r)
            if direction == "in":
                self.count_in(1)
        self.count(direction, conn, shown, nbytes)
        self.sink.write_many(out)
        if self.sink.fmt != "table":
            self.sink.flush()
