"""The Spark engine: the rules of REPLAY.md on DataFrames, for captures larger than one
machine. The only module that imports pyspark (lazily, inside functions).

Frames never come to the driver. DCP `documents`, `undone`, `rollbacks` and `failover` are
plain Spark SQL (no Python workers). The other tables come from groups of
`groupBy(...).applyInArrow` (vbuckets for DCP, (stream, instance) for Synapse); inside the
group the frames are sorted by their frame order and handed to the same functions the local
engine runs (dcp_rules.DcpState, synapse_rules.synapse_tables), so the two engines share their
semantics and the result does not depend on partitioning.

Sessions: an embedded one (make_session, py4j and a JVM in this process) or a Spark Connect
client (connect_session: the warm server of replay/connect_server.py, or `--remote`); the
engine code is the same for both (no SparkContext outside make_session and ship_user_module). Results (not frames) are brought to the driver as Arrow to be
printed, written or check-summed, in the canonical form of replay/tables.py.

Spark has no unsigned types and no nanosecond timestamps: inside Spark, uint8/16/32 are
widened to the next signed type, uint64 becomes decimal(20,0), and timestamps are bigint
nanoseconds since the epoch (Parquet nanosecond timestamps are read as such)."""

from __future__ import annotations

import atexit
import contextlib
import decimal
import io
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa

from dcptool.protocol.dcp.constants import Status
from dcptool.replay import apply, columns, dcp_rules, synapse_rules, tables as T, topology

from dcptool.replay.store import reader
from dcptool.replay.store.schema import capture_schema

SEQ_SHIFT = 44
VBUCKET_GROUPS = 64
LOOPBACK = "127.0.0.1"


# --- session ----------------------------------------------------------------------------

def _is_loopback_master(master: str) -> bool:
    if master.startswith("local"):
        return True
    host = urlparse(master).hostname or ""
    return host in ("127.0.0.1", "localhost", "::1")


@contextlib.contextmanager
def _quiet_fd2(enabled: bool):
    """Point file descriptor 2 at /dev/null while the JVM starts: it inherits that stderr,
    so log4j's console output never reaches the terminal."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# Environment variables the Spark JVM (and its Python workers) never get: dcptool's own
# credentials and anything named like a secret. A query could read them (reflect, java_method),
# and replay needs none of them.
_SECRET_ENV = re.compile(r"PASS|SECRET|TOKEN|CREDENTIAL|API_?KEY|PRIVATE_?KEY|ACCESS_?KEY|AUTH",
                         re.IGNORECASE)


def scrub_environment(environ=None) -> list[str]:
    """Remove DCPTOOL_USER, DCPTOOL_PASSWORD and secret-looking variables from `environ`
    (os.environ) before the JVM starts: it inherits them. The names removed."""
    environ = os.environ if environ is None else environ
    gone = [k for k in list(environ)
            if k in ("DCPTOOL_USER", "DCPTOOL_PASSWORD", "DCPTOOL_PASSWORD_FILE") or _SECRET_ENV.search(k)]
    for k in gone:
        environ.pop(k, None)
    return gone


def make_session(master: str = "local[*]", app_name: str = "dcptool", conf: dict | None = None,
                 verbose: bool = False):
    """A SparkSession for replay. Local (and loopback) masters bind the driver to
    127.0.0.1; the UI is off; Spark's logging stays off the terminal (log4j inherits a
    /dev/null stderr; py4j's Python logger stays at WARNING even under -v); the catalog is
    in memory and the warehouse a temporary directory (removed by `stop_session` or at
    exit), so nothing is left in the working directory; SQL cannot query files by path
    (text.`/etc/passwd`); the JVM gets no credentials from the environment."""
    import logging

    from pyspark.sql import SparkSession

    for name in ("py4j", "py4j.clientserver", "py4j.java_gateway"):
        logging.getLogger(name).setLevel(logging.WARNING)
    scrub_environment()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    warehouse = tempfile.mkdtemp(prefix="dcptool-spark-warehouse-")
    atexit.register(shutil.rmtree, warehouse, True)
    builder = SparkSession.builder.master(master).appName(app_name)
    settings = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.legacy.parquet.nanosAsLong": "true",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.shuffle.partitions": "8",
        "spark.sql.catalogImplementation": "in-memory",
        "spark.sql.warehouse.dir": warehouse,
        "spark.sql.runSQLOnFiles": "false",
    }
    if master.startswith("local"):
        settings["spark.driver.memory"] = "2g"  # executors live in the driver JVM
    if _is_loopback_master(master):
        os.environ["SPARK_LOCAL_IP"] = LOOPBACK
        settings.update({"spark.driver.host": LOOPBACK, "spark.driver.bindAddress": LOOPBACK})
    settings.update(conf or {})
    for k, v in settings.items():
        builder = builder.config(k, v)
    # the JVM keeps the stderr it was started with: /dev/null, also under -v (its INFO log
    # is tens of thousands of lines; dcptool's own -v output is the traceback)
    with _quiet_fd2(True):
        session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    _WAREHOUSES[id(session)] = warehouse
    return session


_WAREHOUSES: dict[int, str] = {}


def connect_session(url: str, token: str | None = None):
    """A Spark Connect client session on `url` (sc://HOST:PORT[/;params]) with the runtime
    settings of make_session (a server not started by dcptool may lack them). `token`, when
    given, authenticates (through the environment, as pyspark reads it, never the URL)."""
    import logging

    from pyspark.sql import SparkSession

    for name in ("py4j", "grpc", "pyspark"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if token is not None:
        os.environ["SPARK_CONNECT_AUTHENTICATE_TOKEN"] = token
    session = SparkSession.builder.remote(url).getOrCreate()
    for k, v in CONNECT_CONF.items():
        session.conf.set(k, v)
    return session


# runtime settings every session needs (a Connect server's static ones are set at its start)
CONNECT_CONF = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.legacy.parquet.nanosAsLong": "true",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.runSQLOnFiles": "false",
}


def is_connect(session) -> bool:
    """A Spark Connect client session (no SparkContext, no JVM in this process)."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def stop_session(session) -> None:
    """Stop a session from make_session and remove its warehouse directory."""
    try:
        session.stop()   # a Connect session: releases it on the server, which keeps running
    finally:
        warehouse = _WAREHOUSES.pop(id(session), None)
        if warehouse:
            shutil.rmtree(warehouse, ignore_errors=True)


# --- types between Arrow-as-captured and Arrow-as-Spark-sees-it -----------------------------

def spark_arrow_type(t: pa.DataType) -> pa.DataType:
    if pa.types.is_dictionary(t):
        return spark_arrow_type(t.value_type)
    if t == pa.uint8():
        return pa.int16()
    if t == pa.uint16():
        return pa.int32()
    if t == pa.uint32():
        return pa.int64()
    if t == pa.uint64():
        return pa.decimal128(20, 0)
    if pa.types.is_timestamp(t):
        return pa.int64()
    if pa.types.is_list(t):
        return pa.list_(spark_arrow_type(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, spark_arrow_type(f.type)) for f in t])
    return t


def spark_arrow_schema(schema: pa.Schema) -> pa.Schema:
    return pa.schema([pa.field(f.name, spark_arrow_type(f.type)) for f in schema])


def to_spark_arrow(table: pa.Table) -> pa.Table:
    return table.cast(spark_arrow_schema(table.schema))


def from_spark_arrow(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Columns of `table` named in `schema`, cast back to its types."""
    cols = [table.column(f.name).cast(f.type) if table.column(f.name).type != f.type else table.column(f.name)
            for f in schema]
    return pa.Table.from_arrays(cols, schema=schema)


def spark_schema(schema: pa.Schema):
    """The pyspark StructType for an Arrow schema (after spark_arrow_schema)."""
    from pyspark.sql.pandas.types import from_arrow_schema
    return from_arrow_schema(spark_arrow_schema(schema))


# --- reading ----------------------------------------------------------------------------

def read_frames(spark, files: list, tmpdir: str):
    """All frames as a DataFrame (capture columns in Spark types) plus `_rank` (the
    capture's rank in frame order) and `_seq` (rank << 44 | frame_no)."""
    from pyspark.sql import functions as F

    protocol = reader.protocol_of(files)
    paths = reader.parquet_paths(files, tmpdir)
    df = spark.read.schema(spark_schema(capture_schema(protocol))).parquet(*paths)
    ranks = reader.capture_ranks(files)
    pairs = [x for cid, r in ranks.items() for x in (F.lit(cid), F.lit(r))]
    rank = F.element_at(F.create_map(*pairs), F.col("capture_id")).cast("long")
    return (df.withColumn("_rank", rank)
              .withColumn("_seq", F.shiftleft(F.col("_rank"), SEQ_SHIFT) + F.col("frame_no")))


def _dense_seq(t: pa.Table) -> pa.Table:
    """Replace _seq (rank << 44 | frame_no) by its rank in the group, which fits the local
    engine's 44 bits whatever the frame numbers are."""
    seq = columns.as_numpy(t.column("_seq"), dtype=np.int64)
    order = np.argsort(seq, kind="stable")
    t = t.take(order)
    return t.set_column(t.column_names.index("_seq"), "_seq", pa.array(np.arange(t.num_rows, dtype=np.int64)))


# --- packing several result tables into one grouped output ------------------------------

def _packed_schema(protocol: str, names: list[str]) -> pa.Schema:
    fields = [pa.field("_t", pa.int32())]
    for name in names:
        for f in T.schema_of(protocol, name):
            fields.append(pa.field(f"{name}__{f.name}", spark_arrow_type(f.type)))
    return pa.schema(fields)


def _pack(protocol: str, names: list[str], results: dict[str, pa.Table]) -> pa.Table:
    schema = _packed_schema(protocol, names)
    parts = []
    for i, name in enumerate(names):
        t = to_spark_arrow(results[name])
        n = t.num_rows
        cols = []
        for f in schema:
            if f.name == "_t":
                cols.append(pa.array(np.full(n, i, np.int32)))
            elif f.name.startswith(name + "__"):
                cols.append(t.column(f.name[len(name) + 2:]))
            else:
                cols.append(pa.nulls(n, f.type))
        parts.append(pa.Table.from_arrays(cols, schema=schema))
    return pa.concat_tables(parts)


DCP_RESULTS = ["documents", "vbuckets", "snapshots", "rollbacks", "failover", "undone"]
SYN_RESULTS = ["positions", "rows", "gaps"]


def _state_schema(protocol: str, cols: list[str], extra: list[str]) -> pa.Schema:
    cap = capture_schema(protocol)
    return pa.schema([cap.field(c) for c in cols] + [pa.field(c, pa.int64()) for c in extra])


def _dcp_group(table: pa.Table) -> pa.Table:
    t = from_spark_arrow(table, _state_schema("dcp", dcp_rules.DCP_STATE_COLUMNS, ["_seq"]))
    return _pack("dcp", DCP_RESULTS, dcp_rules.dcp_group_tables(_dense_seq(t)))


def _synapse_group(max_conn: int, table: pa.Table) -> pa.Table:
    t = from_spark_arrow(table, _state_schema("synapse", synapse_rules.SYN_STATE_COLUMNS, ["_seq", "_conn"]))
    return _pack("synapse", SYN_RESULTS, synapse_rules.synapse_tables(_dense_seq(t), max_conn))


# --- the engine -------------------------------------------------------------------------

@dataclass
class SparkReplay:
    """Result of a Spark replay: DataFrames by name (Spark types), and canonical Arrow
    tables on demand (`table(name)`), equal to the local engine's."""
    protocol: str
    frames_df: object
    packed_df: object
    result_names: list[str]
    extra: dict = field(default_factory=dict)   # name -> DataFrame computed without groups
    _results: dict = field(default_factory=dict)
    _tmp: object = None

    def names(self) -> list[str]:
        return T.table_names(self.protocol)

    def dataframe(self, name: str):
        from pyspark.sql import functions as F
        if name == "frames":
            return self.frames_df
        if name in self.extra:
            return self.extra[name]
        i = self.result_names.index(name)
        return self.packed_df.filter(F.col("_t") == i).select(
            [F.col(f"{name}__{f.name}").alias(f.name) for f in T.schema_of(self.protocol, name)])

    def register_views(self) -> None:
        for name in self.names():
            self.dataframe(name).createOrReplaceTempView(name)

    def table(self, name: str) -> pa.Table:
        if name not in self._results:
            # one table's columns at a time: the packed rows are wide and mostly null
            schema = T.schema_of(self.protocol, name)
            arrow = self.dataframe(name).toArrow()
            self._results[name] = T.canonical(self.protocol, name, from_spark_arrow(arrow, schema))
        return self._results[name]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.packed_df.unpersist()
        if self._tmp is not None:
            self._tmp.cleanup()


def as_of_filter(as_of):
    """The Column that keeps the frames `as_of` (replay/as_of.py) keeps: the same comparisons
    as AsOf.mask, null-safe (a null comparison drops a row in Spark, keeps nothing in numpy)."""
    from pyspark.sql import functions as F
    cond = F.lit(True)
    if as_of.ts_ns is not None:
        cond = cond & F.coalesce(F.col("ts") <= F.lit(as_of.ts_ns), F.lit(False))
    lowest = F.lit(-(1 << 63)).cast("long")
    marker = F.coalesce(F.col("op") == "snapshot_marker", F.lit(False))
    start = F.when(marker, F.coalesce(F.col("snap_start"), lowest)).otherwise(lowest)
    for vb, seqno in as_of.seqnos:
        drop = ((F.coalesce(F.col("vbucket"), F.lit(-1)) == vb)
                & ((F.coalesce(F.col("by_seqno"), lowest) > F.lit(seqno)) | (start > F.lit(seqno))))
        cond = cond & ~drop
    return cond


def replay_spark(spark, files: list, as_of=None) -> SparkReplay:
    """`as_of` (replay/as_of.py, DCP): only the frames it keeps count, `frames` included."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    protocol = reader.protocol_of(files)
    if as_of and protocol != "dcp":
        raise ValueError("a point in time (--as-of) applies to DCP captures only")
    tmp = tempfile.TemporaryDirectory(prefix="dcptool-replay-")
    df = read_frames(spark, files, tmp.name)
    if as_of:
        df = df.filter(as_of_filter(as_of))
    frames = df.select(T.frames_schema(protocol).names)
    if protocol == "dcp":
        vb_frames = df.filter((F.col("direction") == "in") & F.col("vbucket").isNotNull()
                              & F.col("decode_error").isNull() & F.col("op").isin(*dcp_rules.VB_OPS))
        # several vbuckets per group (a pure function of the vbucket, so the result cannot
        # depend on partitioning): DcpState keeps vbuckets apart, and fewer, larger groups
        # save the per-call overhead of the Python worker
        grouped = (vb_frames.select(dcp_rules.DCP_STATE_COLUMNS + ["_seq"])
                   .withColumn("_g", F.col("vbucket") % VBUCKET_GROUPS).groupBy("_g"))
        packed = grouped.applyInArrow(_dcp_group, spark_schema(_packed_schema("dcp", DCP_RESULTS)))
        ranks = reader.capture_ranks(files)
        any_rollback = reader.may_have_values(files, "rollback_seqno")
        result = SparkReplay(protocol, frames, packed, DCP_RESULTS,
                             extra={"documents": _dcp_documents(vb_frames, ranks, any_rollback),
                                    "undone": _dcp_undone(vb_frames, ranks, any_rollback),
                                    "rollbacks": _dcp_rollbacks(vb_frames, ranks, any_rollback),
                                    "failover": _dcp_failover(vb_frames),
                                    "topology": topology.spark_dataframe(df, spark_schema, to_spark_arrow, ranks)},
                             _tmp=tmp)
    else:
        conn_key = F.shiftleft(F.col("_rank"), 32) + F.col("conn").cast("long")
        df = df.withColumn("_conn", conn_key)
        max_conn = df.agg(F.max("_conn")).first()[0]  # one number, not frames
        max_conn = -1 if max_conn is None else int(max_conn)
        group_frames = df.filter((F.col("direction") == "in") & F.col("stream").isNotNull()
                                 & F.col("decode_error").isNull()
                                 & F.col("command").isin(*synapse_rules.SYN_GROUP_COMMANDS))
        grouped = group_frames.select(synapse_rules.SYN_STATE_COLUMNS + ["_seq", "_conn"]).groupBy("stream", "instance")
        def synapse_group(table):
            return _synapse_group(max_conn, table)

        packed = grouped.applyInArrow(synapse_group,
                                      spark_schema(_packed_schema("synapse", SYN_RESULTS)))
        commands = (df.filter(F.col("command").isNotNull()).groupBy("command")
                      .agg(F.count(F.lit(1)).alias("count"), F.min("ts").alias("first_ts"),
                           F.max("ts").alias("last_ts")))
        result = SparkReplay(protocol, frames, packed, SYN_RESULTS, extra={"commands": commands}, _tmp=tmp)
    result.packed_df = packed.persist(StorageLevel.MEMORY_AND_DISK)
    return result


def _dcp_documents(vb_frames, ranks: dict[str, int], rollbacks: bool = True):
    """`documents` in Spark SQL alone (no Python workers): the same rules as DcpState.

    A change (mutation, deletion, expiration) is undone when a later ROLLBACK answer of its
    vbucket rolls back below its by_seqno (a null by_seqno counts as -1, as in DcpState);
    each document keeps its last change that was not undone. `rollbacks=False` (the Parquet
    statistics show none) saves the scan that looks for them."""
    from pyspark.sql import functions as F

    changes = vb_frames.filter(F.col("op").isin(*dcp_rules.DOC_STATES))
    alive = changes
    if rollbacks:
        found = (vb_frames.filter((F.col("op") == "stream_req") & (F.col("status") == Status.ROLLBACK)
                                  & F.col("rollback_seqno").isNotNull())
                 .select(F.col("vbucket").alias("_r_vb"), F.col("_seq").alias("_r_seq"),
                         F.col("rollback_seqno").alias("_r_seqno")))
        alive = changes.join(F.broadcast(found),
                             (F.col("vbucket") == F.col("_r_vb")) & (F.col("_r_seq") > F.col("_seq"))
                             & (F.coalesce(F.col("by_seqno"), F.lit(-1)) > F.col("_r_seqno")), "left_anti")
    # each document's last change in one hash aggregate: max_by of every column alone, all
    # of them numbers (a struct, or a string, would make Spark sort every change instead)
    ops = list(dcp_rules.DOC_STATES)   # op -> state, coded by position
    state = F.element_at(F.create_map(*[x for i, op in enumerate(ops) for x in (F.lit(op), F.lit(i))]),
                         F.col("op"))
    two63 = F.lit(decimal.Decimal(2**63)).cast("decimal(20,0)")
    numeric = {"by_seqno": F.col("by_seqno"), "rev_seqno": F.col("rev_seqno"),
               "cas": (F.col("cas") - two63).cast("long"),          # uint64 as a long, shifted
               "state": state, "datatype": F.col("datatype"), "item_flags": F.col("item_flags"),
               "expiration": F.col("expiration"), "value_len": F.col("value_len"),
               "capture_id": F.col("_rank"), "frame_no": F.col("frame_no"), "ts": F.col("ts")}
    last = alive.groupBy("vbucket", "collection_id", "key").agg(
        *[F.max_by(col, F.col("_seq")).alias(name) for name, col in numeric.items()])
    by_rank = F.create_map(*[x for cid, r in ranks.items() for x in (F.lit(r).cast("long"), F.lit(cid))])
    out = {"cas": (F.col("cas").cast("decimal(20,0)") + two63).cast("decimal(20,0)"),
           "state": F.element_at(F.create_map(*[x for i, op in enumerate(ops)
                                                for x in (F.lit(i), F.lit(dcp_rules.DOC_STATES[op]))]), F.col("state")),
           "capture_id": F.element_at(by_rank, F.col("capture_id"))}
    return last.select([out.get(f.name, F.col(f.name)).alias(f.name) for f in T.schema_of("dcp", "documents")])


def _rollback_answers(vb_frames):
    from pyspark.sql import functions as F
    return vb_frames.filter((F.col("op") == "stream_req") & (F.col("status") == Status.ROLLBACK)
                            & F.col("rollback_seqno").isNotNull())


def _dcp_undone(vb_frames, ranks: dict[str, int], rollbacks: bool = True, pairs_only: bool = False):
    """`undone` in Spark SQL alone, the same rules as DcpState: the pairs (change, later
    ROLLBACK answer of its vbucket rolling back below its by_seqno), of which the earliest
    rollback undoes the change; `restored` when the document's current change (its last one
    not undone, as in `documents`) came after that rollback."""
    from pyspark.sql import Window, functions as F

    changes = vb_frames.filter(F.col("op").isin(*dcp_rules.DOC_STATES))
    found = _rollback_answers(vb_frames)
    if not rollbacks:
        found = found.filter(F.lit(False))
    found = found.select(F.col("vbucket").alias("_r_vb"), F.col("_seq").alias("_r_seq"),
                         F.col("rollback_seqno").alias("_r_seqno"), F.col("_rank").alias("_r_rank"),
                         F.col("frame_no").alias("_r_frame_no"), F.col("ts").alias("_r_ts"))
    hits = ((F.col("vbucket") == F.col("_r_vb")) & (F.col("_r_seq") > F.col("_seq"))
            & (F.coalesce(F.col("by_seqno"), F.lit(-1)) > F.col("_r_seqno")))
    pairs = changes.select("vbucket", "collection_id", "key", "by_seqno", "op", "_rank", "frame_no", "ts",
                           "_seq").join(F.broadcast(found), hits, "inner")
    first = F.row_number().over(Window.partitionBy("_seq").orderBy("_r_seq"))
    undone = pairs.withColumn("_n", first).filter(F.col("_n") == 1)
    if pairs_only:   # each undone change with the rollback that undid it (_r_*)
        return undone
    alive = changes.join(F.broadcast(found), hits, "left_anti")
    current = alive.groupBy(F.col("vbucket").alias("_d_vb"), F.col("collection_id").alias("_d_cid"),
                            F.col("key").alias("_d_key")).agg(
        F.max("_seq").alias("_d_seq"), F.max_by("by_seqno", "_seq").alias("_d_seqno"))
    same_doc = ((F.col("vbucket") == F.col("_d_vb")) & F.col("collection_id").eqNullSafe(F.col("_d_cid"))
                & F.col("key").eqNullSafe(F.col("_d_key")))
    joined = undone.join(current, same_doc, "left")
    restored = F.coalesce(F.col("_d_seq") > F.col("_r_seq"), F.lit(False))
    by_rank = F.create_map(*[x for cid, r in ranks.items() for x in (F.lit(r).cast("long"), F.lit(cid))])
    out = {"capture_id": F.element_at(by_rank, F.col("_r_rank")), "frame_no": F.col("_r_frame_no"),
           "ts": F.col("_r_ts"), "rollback_seqno": F.col("_r_seqno"),
           "change_capture_id": F.element_at(by_rank, F.col("_rank")), "change_frame_no": F.col("frame_no"),
           "change_ts": F.col("ts"), "restored": restored,
           "restored_seqno": F.when(restored, F.col("_d_seqno"))}
    return joined.select([out.get(f.name, F.col(f.name)).alias(f.name) for f in T.schema_of("dcp", "undone")])


def _dcp_rollbacks(vb_frames, ranks: dict[str, int], rollbacks: bool = True):
    """`rollbacks` in Spark SQL alone: each ROLLBACK answer with the number of changes it
    undid (those of `undone` whose earliest rollback it is)."""
    from pyspark.sql import functions as F

    found = _rollback_answers(vb_frames)
    if not rollbacks:
        found = found.filter(F.lit(False))
    counts = (_dcp_undone(vb_frames, ranks, rollbacks, pairs_only=True)
              .groupBy(F.col("_r_seq").alias("_c_seq")).agg(F.count(F.lit(1)).alias("_c_undone")))
    by_rank = F.create_map(*[x for cid, r in ranks.items() for x in (F.lit(r).cast("long"), F.lit(cid))])
    joined = found.join(counts, F.col("_seq") == F.col("_c_seq"), "left")
    out = {"capture_id": F.element_at(by_rank, F.col("_rank")),
           "undone": F.coalesce(F.col("_c_undone"), F.lit(0)).cast("long")}
    return joined.select([out.get(f.name, F.col(f.name)).alias(f.name) for f in T.schema_of("dcp", "rollbacks")])


def _dcp_failover(vb_frames):
    """`failover` in Spark SQL alone: the failover log of each vbucket's last stream-request
    success, one row per entry, position 0 = the newest entry as on the wire."""
    from pyspark.sql import functions as F

    ok = vb_frames.filter((F.col("op") == "stream_req") & (F.col("status") == Status.SUCCESS)
                          & F.col("failover_log").isNotNull())
    last = ok.groupBy("vbucket").agg(F.max_by("failover_log", "_seq").alias("_log"))
    entries = last.select("vbucket", F.posexplode("_log").alias("position", "_e"))
    return entries.select(F.col("vbucket"), F.col("position").cast("int").alias("position"),
                          F.col("_e.vbucket_uuid").alias("vbucket_uuid"), F.col("_e.seqno").alias("seqno"))


# --- user code ----------------------------------------------------------------------------

def _apply_group(protocol: str, fn, key, table: pa.Table) -> pa.Table:
    schema = capture_schema(protocol)
    t = from_spark_arrow(table, pa.schema(list(schema) + [pa.field("_seq", pa.int64())]))
    t = t.take(np.argsort(columns.as_numpy(t.column("_seq"), dtype=np.int64), kind="stable")).drop_columns(["_seq"])
    k = tuple(x.as_py() for x in key)
    k = k[0] if protocol == "dcp" else k
    result = fn(k, t)
    sink = io.BytesIO()
    if result is not None:
        with pa.ipc.new_stream(sink, result.schema) as w:
            w.write_table(result)
    keys = {"vbucket": [k]} if protocol == "dcp" else {"stream": [k[0]], "instance": [k[1]]}
    types = {"vbucket": pa.int32(), "stream": pa.string(), "instance": pa.string()}
    cols = {c: pa.array(v, types[c]) for c, v in keys.items()}
    cols["ipc"] = pa.array([sink.getvalue() if result is not None else None], pa.binary())
    return pa.table(cols)


def ship_user_module(spark, fn) -> str | None:
    """Send the file of fn's module to the workers (SparkContext.addPyFile, or a Connect
    session's artifacts) when it is a top-level module outside the installed packages
    (`--apply mymodule:fn` from the working directory, `--apply ./fn.py:fn`): cloudpickle refers to its functions by module name,
    and the workers import it. The path shipped, or None."""
    import sysconfig
    name = getattr(fn, "__module__", None) or ""
    mod = sys.modules.get(name)
    path = getattr(mod, "__file__", None)
    if not path or "." in name or name == "__main__" or not path.endswith(".py"):
        return None
    path = os.path.abspath(path)
    installed = {os.path.abspath(p) for p in (sysconfig.get_paths().get("purelib"),
                                                sysconfig.get_paths().get("platlib"),
                                                sysconfig.get_paths().get("stdlib")) if p}
    if any(path.startswith(p + os.sep) for p in installed):
        return None
    if is_connect(spark):
        spark.addArtifacts(path, pyfile=True)   # to this session's Python workers on the server
    else:
        spark.sparkContext.addPyFile(path)
    return path


def apply_spark(spark, files: list, fn) -> pa.Table | None:
    """`fn(key, table)` per group of `in` frames, in capture order; the results come to
    the driver (they are the user's output, not frames) and are concatenated by key."""
    from pyspark.sql import functions as F

    ship_user_module(spark, fn)
    protocol = reader.protocol_of(files)
    with tempfile.TemporaryDirectory(prefix="dcptool-apply-") as tmp:
        df = read_frames(spark, files, tmp)
        key_col = "vbucket" if protocol == "dcp" else "stream"
        frames = df.filter((F.col("direction") == "in") & F.col(key_col).isNotNull())
        frames = frames.select(capture_schema(protocol).names + ["_seq"])
        keys = ["vbucket"] if protocol == "dcp" else ["stream", "instance"]
        out_schema = "vbucket int, ipc binary" if protocol == "dcp" else "stream string, instance string, ipc binary"

        def apply_group(key, table):
            return _apply_group(protocol, fn, key, table)

        out = frames.groupBy(*keys).applyInArrow(apply_group, out_schema).toArrow()
    results = []
    for row in out.to_pylist():
        key = row["vbucket"] if protocol == "dcp" else (row["stream"], row["instance"])
        table = pa.ipc.open_stream(row["ipc"]).read_all() if row["ipc"] is not None else None
        results.append((key, table))
    return apply.concat_results(results)
