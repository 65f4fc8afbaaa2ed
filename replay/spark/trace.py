"""`dcptool trace --spark`: the reads of a trace on Spark (replay/check/trace.py tells the
story, the same Python rule for both engines; trace_read.py has this process's reads). The
frames DataFrame of replay/spark/engine.py is filtered with the filters pushed down to the
Parquet scan (`key IN (...)`: for a few keys Spark's Parquet reader can skip the row groups
whose key index, replay/store/key_index.py, excludes them), and only the few rows found come
to the driver, as Arrow, in the capture's types."""

from __future__ import annotations

import tempfile

import pyarrow as pa

from dcptool.replay.check import trace_read as R
from dcptool.replay.rules import topology
from dcptool.replay.spark import engine
from dcptool.replay.spark.arrow import from_spark_arrow
from dcptool.replay.store.schema import capture_schema


def _in(column: str, values) -> str:
    """`column IN (...)` in Spark SQL: binary values as X'hex', numbers and text as such."""
    out = []
    for v in values:
        if isinstance(v, bytes):
            out.append(f"X'{v.hex()}'")
        elif isinstance(v, str):
            out.append("'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'")
        else:
            out.append(str(int(v)))
    return f"{column} IN ({', '.join(out)})"


class SparkRows:
    """The reads of trace.LocalRows, on a Spark session: give `lambda cap: SparkRows(spark, cap)`
    as trace.trace's `engine`."""

    def __init__(self, spark, cap):
        self.spark, self.cap = spark, cap
        self._tmp = tempfile.TemporaryDirectory(prefix="dcptool-trace-")
        self.df = engine.read_frames(spark, cap.files, self._tmp.name)

    def close(self) -> None:
        self._tmp.cleanup()

    def _rows(self, where: str, columns: list[str]) -> list[dict]:
        full = capture_schema("dcp")
        arrow = self.df.where(where).select(*columns).toArrow()
        return R.pylist(from_spark_arrow(arrow, pa.schema([full.field(c) for c in columns])))

    def key_rows(self, keys: list[bytes], vbuckets: set[int] | None) -> list[dict]:
        where = _in("key", keys)
        if vbuckets:
            where += " AND " + _in("vbucket", sorted(vbuckets))
        return self._rows(where, R.KEY_COLUMNS)

    def vbucket_rows(self, vbuckets: set[int], anchors) -> list[dict]:
        # every snapshot marker of the vbuckets (the anchors prune reads in this process;
        # here they are filtered where the data is, and a marker more tells the same story)
        return self._rows(f"{_in('vbucket', sorted(vbuckets))} AND {_in('op', R.VB_OPS)}", R.VB_COLUMNS)

    def topology(self) -> list[dict]:
        # the candidate frames (a few cluster configs) are found by Spark and come to the
        # driver, where the rule builds the maps: no Python worker to start for so little
        full = capture_schema("dcp")
        arrow = self.df.where(topology.SPARK_FILTER).select(*topology.CANDIDATE_COLUMNS).toArrow()
        frames = from_spark_arrow(arrow, pa.schema([full.field(c) for c in topology.CANDIDATE_COLUMNS]))
        return R.pylist(topology.topology_table(frames, self.cap.ranks))

    def highest_streamed_vbucket(self) -> int | None:
        row = self.df.where(f"{_in('op', ('stream_req', 'get_failover_log'))} AND vbucket IS NOT NULL") \
                     .agg({"vbucket": "max"}).collect()
        return None if not row or row[0][0] is None else int(row[0][0])


def trace_on_spark(paths: list[str], keys: list[bytes], master: str, collection: str | None = None,
                   vbucket: int | None = None) -> list[dict]:
    """trace.trace of `keys` with its reads on a Spark session of `master`, stopped after."""
    import warnings

    from dcptool.replay.check import trace as T
    warnings.filterwarnings("ignore", module="pyspark")
    session = engine.make_session(master)
    opened: list[SparkRows] = []

    def rows_of(cap):
        opened.append(SparkRows(session, cap))
        return opened[-1]
    try:
        return T.trace(paths, keys, collection=collection, vbucket=vbucket, engine=rows_of)
    finally:
        for r in opened:
            r.close()
        engine.stop_session(session)
