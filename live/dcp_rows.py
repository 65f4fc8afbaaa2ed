"""The rows of `dcptool stream couchbase://...`: capture/dcp_tap.py's tap (the one `capture`
uses: numbering, counts, --max-messages, the watch) with every frame, both directions, as a
CAPTURE_FORMAT row plus `direction` and `ts` for a sink (cli/view/output.py Sink). Each
receive batch is decoded at once by the columnar decoder (replay/rows.py), as `decode` does.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import numpy as np

from dcptool.capture.dcp_tap import Buffer, DcpTap
from dcptool.capture.run import RunStats
from dcptool.live.view_filter import RowFilter, pick
from dcptool.protocol.dcp.wire.constants import Status
from dcptool.replay.rows import frame_columns, jsonl_of, row_columns, rows_of
from dcptool.replay.timestamps import iso_ns

_ONE_OFFSET = np.zeros(1, np.int64)   # a frame we send is a batch of one


class RowTap(DcpTap):
    """Turns every frame into a row for the sink (every row carries every column of
    row_columns(), absent fields None); shows exactly max_messages received frames and counts
    what it showed in `stats` (this run's summary). `say(line)` gets the collection system
    events worth a line on stderr (`notes`, collections.EventNotes, when collections are on)."""

    cut = True

    def __init__(self, sink: Any, *, values: bool, raw: bool, max_messages: int | None,
                 on_limit: Callable[[], None] | None = None, stats: RunStats | None = None,
                 say: Callable[[str], None] | None = None):
        super().__init__(max_messages=max_messages, on_limit=on_limit, stats=stats)
        self.sink = sink
        self.values = values
        self.raw = raw
        self.say = say or (lambda line: None)
        self.template = dict.fromkeys(row_columns(values, raw))
        # DCP-specific counts of the rows shown
        self.items = 0
        self.streams_ended = 0
        self.rollbacks = 0
        self.ops: dict[str, int] = {}
        self.notes: Any = None         # collections.EventNotes when collections are on
        self.view: RowFilter | None = None   # which rows are printed (counted all the same)

    def columns(self, buf: Buffer, offsets: np.ndarray, lengths: np.ndarray, ts: str | None, direction: str,
                mono_ns: int | None = None) -> tuple[dict[str, Any], int]:
        """Display columns of whole frames (replay/rows.py: the columnar decoder), numbered
        from the tap's next frame number."""
        return frame_columns(buf, offsets, lengths, template=self.template, collections=self.collections,
                             opaque_vbuckets=self.opaque_vb, values=self.values, raw=self.raw,
                             extra={"conn": self.conn, "node": self.node, "ts": ts, "mono_ns": mono_ns,
                                    "direction": direction},
                             first_frame_no=self.frame_no)

    def rows(self, buf: Buffer, offsets: np.ndarray, lengths: np.ndarray, ts: str | None, direction: str,
             mono_ns: int | None = None) -> list[dict[str, Any]]:
        cols, n = self.columns(buf, offsets, lengths, ts, direction, mono_ns)
        return rows_of(cols, n, self.template)

    def write_rows(self, cols: dict[str, Any], n: int) -> None:
        """Counts what is shown (this run's summary) and writes it."""
        counts = Counter(cols["op"])     # counted in C, not per row in Python
        ops = self.ops
        for op, k in counts.items():
            ops[op] = ops.get(op, 0) + k
        self.items += counts["mutation"] + counts["deletion"] + counts["expiration"]
        self.streams_ended += counts["stream_end"]
        if counts["stream_req"]:
            self.rollbacks += sum(1 for op, status, direction in zip(cols["op"], cols.get("status") or [None] * n,
                                                                     cols["direction"])
                                  if op == "stream_req" and status == Status.ROLLBACK and direction == "in")
        keep = self.view.dcp_rows(cols, n) if self.view is not None else None
        if keep is not None and len(keep) < n:   # --ops / --key / the live table's default
            cols, n = pick(cols, keep), len(keep)
            if n == 0:
                return
        fmt = getattr(self.sink, "fmt", None)
        if fmt == "none":      # stream --json without --format: counted only
            self.sink.count += n
        elif fmt == "jsonl":
            self.sink.write_jsonl(jsonl_of(cols, n, self.template), n)
        else:
            self.sink.write_many(rows_of(cols, n, self.template))

    def write_received(self, buf: Buffer, offsets: np.ndarray, lengths: np.ndarray, ts_ns: int, mono_ns: int,
                       nbytes: int) -> None:
        self.write_rows(*self.columns(buf, offsets, lengths, iso_ns(ts_ns), "in", mono_ns))
        if self.notes is not None:    # collection system events, told once each
            for line in self.notes.lines(buf, offsets, lengths):
                self.say(line)

    def write_sent(self, frame: bytes, ts_ns: int, mono_ns: int) -> None:
        self.write_rows(*self.columns(frame, _ONE_OFFSET, np.array([len(frame)]), iso_ns(ts_ns), "out", mono_ns))
