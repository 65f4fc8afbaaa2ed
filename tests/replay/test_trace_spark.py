"""`dcptool trace --spark`: the reads on Spark (replay/spark/trace.py, filters pushed down to
the Parquet scan) feed the same story as in-process, so the output is the same row for row:
on the shared failover capture, keys whose changes a rollback undid, keys left live, and a
key never seen."""

from __future__ import annotations

import pytest

from dcptool.replay.check import trace as T
from dcptool.replay.spark.trace import SparkRows

pytestmark = pytest.mark.spark


def test_trace_on_spark_equals_in_process(spark, failover_capture):
    model, files = failover_capture
    paths = sorted({f.path for f in files})
    keys = sorted(k for vb in model.buckets["default"].vbuckets for k in vb.latest())[::150] + [b"never-seen"]
    expected = T.trace(paths, keys)
    verdicts = {r["verdict"] for r in expected if r["event"] == "verdict"}
    assert {"live", "not_seen"} <= verdicts, verdicts
    assert any(r["event"] == "rollback" for r in expected)
    opened: list = []

    def on_spark(cap):
        opened.append(SparkRows(spark, cap))
        return opened[-1]
    try:
        assert T.trace(paths, keys, engine=on_spark) == expected
    finally:
        for r in opened:
            r.close()
