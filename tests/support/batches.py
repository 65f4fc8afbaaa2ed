"""Record batches of DCP rows for the store's tests (`dcp_batch`: frame_no start..start+n, one
mutation each), and `SlowWriter`, a stand-in CaptureWriter that blocks until released."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa


def dcp_batch(start: int, n: int, conn: int = 0) -> pa.RecordBatch:
    fn = np.arange(start, start + n, dtype=np.int64)
    return pa.record_batch({
        "frame_no": fn,
        "conn": pa.array(np.full(n, conn, np.int32)),
        "ts": pa.array(fn + 1_700_000_000_000_000_000, pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
        "mono_ns": fn * 1000,
        "direction": pa.array(["in"] * n),
        "raw": pa.array([b"\x80\x57" + int(i).to_bytes(8, "big") + b"v" * 22 for i in fn]),
        "op": pa.array(["mutation"] * n),
        "opcode": pa.array(np.full(n, 0x57, np.uint8)),
        "vbucket": pa.array((fn % 4).astype(np.uint16)),
        "by_seqno": fn + 1,
        "key": pa.array([b"k%d" % i for i in fn]),
    })


class SlowWriter:
    """Stands in for CaptureWriter: blocks until released, records what it got."""
    flush_interval = 1.0

    def __init__(self, fail=None):
        self.release = threading.Event()
        self.got = []
        self.fail = fail

    def write(self, batch):
        self.release.wait(30)
        if self.fail:
            raise self.fail
        self.got.append(batch)

    def tick(self):
        pass

    def close(self):
        return [{"rows": sum(b.num_rows for b in self.got)}]
