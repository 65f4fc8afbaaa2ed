"""The Spark engine: the rules of REPLAY.md on DataFrames, for captures larger than one
machine. The only module that imports pyspark (lazily, inside functions).

Frames never come to the driver. DCP `documents`, `undone`, `rollbacks`, `failover` and `history` are
the SQL of replay/rules/plans.py (no Python workers), the same definitions DuckDB runs in-process. The other tables come from groups of
`groupBy(...).applyInArrow` (vbuckets for DCP: `vbuckets` and `snapshots`, no document
tracked; (stream, instance) for Synapse); inside the group the frames are sorted by their
frame order and handed to the same functions the local engine runs (dcp_rules.DcpState,
synapse_rules.synapse_tables), so the two engines share their semantics and the result does
not depend on partitioning.

Sessions: an embedded one (make_session, py4j and a JVM in this process) or a Spark Connect
client (connect_session: the warm server of replay/spark/connect_server.py, or `--remote`); the
engine code is the same for both (no SparkContext outside make_session and ship_user_module). Results (not frames) are brought to the driver as Arrow to be
printed, written or check-summed, in the canonical form of replay/rules/tables.py.

Spark has no unsigned types and no nanosecond timestamps: inside Spark, uint8/16/32 are
widened to the next signed type, uint64 becomes decimal(20,0), and timestamps are bigint
nanoseconds since the epoch (Parquet nanosecond timestamps are read as such)."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable
from urllib.parse import urlparse

import pyarrow as pa

import dcptool.replay.apply as apply
from dcptool.replay.rules import dcp_vbuckets as dcp_rules
from dcptool.replay.rules import lag, plans, topology
from dcptool.replay.rules import synapse_tables as synapse_rules
from dcptool.replay.rules import tables as T
from dcptool.replay.spark import bodies as spark_bodies
from dcptool.replay.spark import documents as spark_documents
from dcptool.replay.spark.arrow import (
    DCP_RESULTS,
    SYN_RESULTS,
    apply_group_table,
    dcp_group,
    from_spark_arrow,
    ops_present,
    packed_schema,
    spark_arrow_schema,
    synapse_group,
    to_spark_arrow,
)
from dcptool.replay.store import reader
from dcptool.replay.store.schema import capture_schema

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

SEQ_SHIFT = plans.SEQ_SHIFT   # _seq = capture rank << SEQ_SHIFT | frame_no
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


def shuffle_partitions(master: str) -> str:
    """Shuffle partitions: one per core of a local master (local[N], local[*]: each extra
    partition is one more shuffle file per task and one more task, 0.5 s of 4.5 at 10M
    frames on 2 cores), 8 elsewhere (a cluster's own conf can say more)."""
    m = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\d+)?\])?", master.strip())
    if m is None:
        return "8"
    n = m.group(1)
    return str(os.cpu_count() or 2) if n == "*" else str(max(1, int(n or 1)))


# pyspark's own Python loggers that print to stderr: each Spark error with a query context
# is logged there as JSON (the analysed plan, ~30 KB) before dcptool prints its one line
_QUERY_CONTEXT_LOGGERS = ("SQLQueryContextLogger", "DataFrameQueryContextLogger")


def quiet_spark_loggers(verbose: bool = False) -> None:
    """pyspark's query-context loggers (pyspark/errors/exceptions/base.py: a StreamHandler on
    stderr, JSON) log nothing unless `verbose`: a user's SQL error is dcptool's one line; -v
    gives Spark's detail. py4j's Python logger stays at WARNING even under -v."""
    import logging

    from pyspark.logger import PySparkLogger

    for name in ("py4j", "py4j.clientserver", "py4j.java_gateway"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in _QUERY_CONTEXT_LOGGERS:
        # created as pyspark creates them (a PySparkLogger takes the errorClass keyword)
        logger = PySparkLogger.getLogger(name)
        logger.setLevel(logging.WARNING if verbose else logging.CRITICAL + 1)


def make_session(master: str = "local[*]", app_name: str = "dcptool", conf: dict | None = None,
                 verbose: bool = False):
    """A SparkSession for replay. Local (and loopback) masters bind the driver to
    127.0.0.1; the UI is off; Spark's logging stays off the terminal (log4j inherits a
    /dev/null stderr; pyspark's Python loggers: quiet_spark_loggers); the catalog is
    in memory and the warehouse a temporary directory (removed by `stop_session` or at
    exit), so nothing is left in the working directory; SQL cannot query files by path
    (text.`/etc/passwd`); the JVM gets no credentials from the environment."""
    from pyspark.sql import SparkSession

    quiet_spark_loggers(verbose)
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
        "spark.sql.shuffle.partitions": shuffle_partitions(master),
        "spark.sql.catalogImplementation": "in-memory",
        "spark.sql.warehouse.dir": warehouse,
        "spark.sql.runSQLOnFiles": "false",
    }
    if master.startswith("local"):
        settings["spark.driver.memory"] = "2g"  # executors live in the driver JVM
    if _is_loopback_master(master):
        os.environ["SPARK_LOCAL_IP"] = LOOPBACK
        settings.update({"spark.driver.host": LOOPBACK, "spark.driver.bindAddress": LOOPBACK})
    archive = None
    if "spark.driver.extraJavaOptions" not in (conf or {}):
        archive = class_archive()
        if archive is not None:
            settings["spark.driver.extraJavaOptions"] = archive.java_options()
    settings.update(conf or {})
    for k, v in settings.items():
        builder = builder.config(k, v)
    # the JVM keeps the stderr it was started with: /dev/null, also under -v (its INFO log
    # is tens of thousands of lines; dcptool's own -v output is the traceback)
    with _quiet_fd2(True):
        session = builder.getOrCreate()
    if archive is not None:
        archive.started(session)
    session.sparkContext.setLogLevel("ERROR")
    _WAREHOUSES[id(session)] = warehouse
    return session


_WAREHOUSES: dict[int, str] = {}


def class_archive():
    """The driver JVM's class-data sharing archive (replay/spark/cds.py) in the state directory;
    None when the state directory cannot be used (the JVM then starts without one)."""
    from dcptool.replay.spark import cds as spark_cds
    from dcptool.replay.spark import connect_server
    try:
        return spark_cds.ClassArchive(connect_server.state_dir())
    except connect_server.StateDirError:
        return None


def connect_session(url: str, token: str | None = None, verbose: bool = False):
    """A Spark Connect client session on `url` (sc://HOST:PORT[/;params]) with the runtime
    settings of make_session (a server not started by dcptool may lack them). `token`, when
    given, authenticates (through the environment, as pyspark reads it, never the URL): it is
    the warm server of replay/spark/connect_server.py, started with those settings, and the
    replay joins the server session that replays share (connect_server.shared_session) when
    no other replay is in it. The server's log stays on the server; pyspark's client-side
    loggers: quiet_spark_loggers."""
    import logging

    from pyspark.sql import SparkSession

    for name in ("py4j", "grpc", "pyspark"):
        logging.getLogger(name).setLevel(logging.WARNING)
    quiet_spark_loggers(verbose)
    if token is not None:
        os.environ["SPARK_CONNECT_AUTHENTICATE_TOKEN"] = token
        session = _shared_session(url)
        if session is not None:
            return session
    session = SparkSession.builder.remote(url).getOrCreate()
    if token is None:   # dcptool's own server (it has a token) starts with these: no round trips
        for k, v in CONNECT_CONF.items():
            session.conf.set(k, v)
    return session


@dataclass
class _Shared:
    """A session joined by _shared_session: its lock, its settings when joined, and whether
    this replay left something in it (a view, an artifact) that the next must not see."""
    lock: int
    settings: dict
    dirty: bool = False


_SHARED: dict[int, _Shared] = {}


def _shared_session(url: str):
    """The warm server's shared session (connect_server.shared_session), or None (another
    replay is in it, or the state directory cannot be used). Its settings are read as it is
    joined: the first round trip, which also finds a session the server has closed (then a
    new id is taken, once)."""
    from pyspark.sql import SparkSession

    from dcptool.replay.spark import connect_server
    for renew in (False, True):
        try:
            held = connect_server.shared_session(renew)
        except connect_server.StateDirError:
            return None
        if held is None:
            return None
        sid, lock = held
        session = SparkSession.builder.remote(url + ("" if "/;" in url else "/") + f";session_id={sid}").getOrCreate()
        # stop() closes this client; the server keeps the session (`remote` gives a Spark Connect
        # session, which has this flag; pyspark types the builder's result as the classic one)
        session.release_session_on_close = False  # type: ignore[attr-defined]
        try:
            settings = dict(session.conf.getAll)
        except Exception:  # noqa: BLE001 - closed on the server (SESSION_CLOSED): take a new id
            with contextlib.suppress(Exception):
                session.stop()
            connect_server.leave_shared_session(lock, kept=False)
            continue
        _SHARED[id(session)] = _Shared(lock, settings)
        return session
    return None


def _leaves_state(session) -> None:
    """Mark a shared session as holding something of this replay's (a temporary view, a
    module sent as an artifact): stop_session releases it on the server, so the next replay
    starts a clean one."""
    shared = _SHARED.get(id(session))
    if shared is not None:
        shared.dirty = True


def connect_answers(url: str, deadline: float) -> bool:
    """The Spark Connect endpoint of `url` completes a gRPC (HTTP/2) connection before
    `deadline` (time.monotonic()): a port of another protocol (DCP, Synapse) never does, and
    the client would retry it forever."""
    import time

    import grpc
    from pyspark.sql.connect.client import DefaultChannelBuilder
    channel = DefaultChannelBuilder(url).toChannel()
    try:
        grpc.channel_ready_future(channel).result(timeout=max(0.5, deadline - time.monotonic()))
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


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
    """Stop a session from make_session and remove its warehouse directory. A shared Connect
    session (_shared_session) stays on the server for the next replay unless this one
    changed it (a setting, `--conf`; a view; an artifact): then it is released there too."""
    shared = _SHARED.pop(id(session), None)
    changed = True
    try:
        if shared is not None:
            try:
                changed = shared.dirty or dict(session.conf.getAll) != shared.settings
            except Exception:  # noqa: BLE001 - the server is gone: nothing to keep
                changed = True
            session.release_session_on_close = changed
        session.stop()   # a Connect session: releases it on the server, which keeps running
    finally:
        if shared is not None:
            from dcptool.replay.spark import connect_server
            connect_server.leave_shared_session(shared.lock, kept=not changed)
        warehouse = _WAREHOUSES.pop(id(session), None)
        if warehouse:
            shutil.rmtree(warehouse, ignore_errors=True)


def spark_schema(schema: pa.Schema):
    """The pyspark StructType for an Arrow schema (after spark_arrow_schema)."""
    from pyspark.sql.pandas.types import from_arrow_schema
    return from_arrow_schema(spark_arrow_schema(schema))


# --- reading ----------------------------------------------------------------------------

def read_frames(spark, files: list, tmpdir: str):
    """All frames as a DataFrame (capture columns in Spark types) plus `_rank` (the
    capture's rank in frame order) and `_seq` (rank << 44 | frame_no)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as ST

    protocol = reader.protocol_of(files)
    # absolute: a path the user typed means what it means in the user's working directory, and
    # a Spark Connect server (warm or --remote) resolves relative paths against its own
    paths = [os.path.abspath(p) for p in reader.parquet_paths(files, tmpdir)]
    schema = spark_schema(capture_schema(protocol))
    cas_long = protocol == "dcp" and reader.without_dictionary(paths, "cas")
    if cas_long:   # the vectorised reader takes plain uint64 pages as longs of the same bits
        schema = ST.StructType([ST.StructField(f.name, ST.LongType()) if f.name == "cas" else f for f in schema])
    df = spark.read.schema(schema).parquet(*paths)
    # the added columns in one withColumns: an embedded session analyses the whole plan at each
    # call (a fresh JVM: 0.2-0.5 s each)
    cols = {}
    if protocol == "dcp":   # `_cas_bits`: cas as a long of its bits; `cas` the decimal(20,0) it was
        if cas_long:
            cols = {"_cas_bits": F.col("cas"), "cas": spark_documents.cas_decimal(F, F.col("cas"))}
        else:
            cols = {"_cas_bits": spark_documents.cas_bits(F, F.col("cas"))}
    ranks = reader.capture_ranks(files)
    if len(ranks) == 1:   # one capture: a constant, and capture_id is not read at all
        rank = F.lit(0).cast("long")
    else:
        pairs = [x for cid, r in ranks.items() for x in (F.lit(cid), F.lit(r))]
        rank = F.element_at(F.create_map(*pairs), F.col("capture_id")).cast("long")
    cols.update({"_rank": rank, "_seq": F.shiftleft(rank, SEQ_SHIFT) + F.col("frame_no")})
    return df.withColumns(cols)


# --- the engine -------------------------------------------------------------------------

@dataclass
class SparkReplay:
    """Result of a Spark replay: DataFrames by name (Spark types), and canonical Arrow
    tables on demand (`table(name)`), equal to the local engine's.

    Each table's plan is built when it is first asked for: building a DataFrame costs
    round trips to the JVM (analysis), and a replay usually wants one or two tables."""
    protocol: str
    frames_df: DataFrame
    result_names: list[str]
    builders: dict = field(default_factory=dict)   # name -> () -> DataFrame computed without groups
    packed_builder: Callable[[], DataFrame] | None = None   # the grouped (applyInArrow) output
    _frames: dict = field(default_factory=dict)
    _packed: DataFrame | None = None
    _results: dict = field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def names(self) -> list[str]:
        return T.table_names(self.protocol)

    @property
    def packed_df(self):
        """The packed output of the Python groups, persisted (several tables come from it)."""
        if self._packed is None:
            from pyspark import StorageLevel
            self._packed = self.packed_builder().persist(StorageLevel.MEMORY_AND_DISK)
        return self._packed

    def dataframe(self, name: str):
        from pyspark.sql import functions as F
        if name == "frames":
            return self.frames_df
        if name in self.builders:
            if name not in self._frames:
                self._frames[name] = self.builders[name]()
            return self._frames[name]
        i = self.result_names.index(name)
        return self.packed_df.filter(F.col("_t") == i).select(
            [F.col(f"{name}__{f.name}").alias(f.name) for f in T.schema_of(self.protocol, name)])

    def register_views(self, only: set[str] | None = None) -> None:
        """Each table (or each of `only`, lower-case names) as a temporary view."""
        _leaves_state(self.frames_df.sparkSession)
        for name in self.names():
            if only is None or name.lower() in only:
                self.dataframe(name).createOrReplaceTempView(name)

    def table(self, name: str) -> pa.Table:
        if name not in self._results:
            # one table's columns at a time: the packed rows are wide and mostly null
            schema = T.schema_of(self.protocol, name)
            arrow = self.dataframe(name).toArrow()
            self._results[name] = T.canonical(self.protocol, name, from_spark_arrow(arrow, schema))
        return self._results[name]

    def close(self) -> None:
        if self._packed is not None:
            with contextlib.suppress(Exception):
                self._packed.unpersist()
        if self._tmp is not None:
            self._tmp.cleanup()


def as_of_filter(as_of):
    """The Column that keeps the frames `as_of` (replay/rules/as_of.py) keeps: the same comparisons
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
    """`as_of` (replay/rules/as_of.py, DCP): only the frames it keeps count, `frames` included.
    Nothing runs here: each table's plan is built, and run, when it is asked for."""
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

        def packed():
            # several vbuckets per group (a pure function of the vbucket, so the result cannot
            # depend on partitioning): DcpState keeps vbuckets apart, and fewer, larger groups
            # save the per-call overhead of the Python worker
            grouped = (vb_frames.select(dcp_rules.DCP_STATE_COLUMNS + ["_seq"])
                       .withColumn("_g", F.col("vbucket") % VBUCKET_GROUPS).groupBy("_g"))
            return grouped.applyInArrow(dcp_group, spark_schema(packed_schema("dcp", DCP_RESULTS)))

        ranks = reader.capture_ranks(files)
        facts = plans.PlanFacts.of(files, ops_present(files), spark_bodies.prepare(spark, files, F))

        def planned(name):
            # the SQL of replay/rules/plans.py: the text DuckDB runs in-process
            cas = "cas" in T.schema_of("dcp", name).names
            return lambda: _planned(vb_frames, plans.table_sql(plans.SPARK, name, "{vb}", facts), cas)
        rep = SparkReplay(protocol, frames, DCP_RESULTS, packed_builder=packed, _tmp=tmp, builders={
            **{name: planned(name) for name in plans.PLAN_TABLES},   # and the states alone (no bodies):
            "_states": lambda: _planned(vb_frames, plans.table_sql(plans.SPARK, "documents", "{vb}", facts, False), False),
            "topology": lambda: topology.spark_dataframe(df, spark_schema, to_spark_arrow, ranks),
            "lag": lambda: lag.spark_dataframe(df, spark_schema, to_spark_arrow, ranks)})
        rep.builders["vbuckets"] = lambda: spark_documents.vbuckets_with_counts(rep, F)
        return rep
    conn_key = F.shiftleft(F.col("_rank"), 32) + F.col("conn").cast("long")
    df = df.withColumn("_conn", conn_key)

    def packed_synapse():
        max_conn = df.agg(F.max("_conn")).first()[0]  # one number, not frames
        max_conn = -1 if max_conn is None else int(max_conn)
        group_frames = df.filter(F.col("direction").isin(*synapse_rules.GROUP_DIRECTIONS) & F.col("stream").isNotNull()
                                 & F.col("decode_error").isNull()
                                 & F.col("command").isin(*synapse_rules.SYN_GROUP_COMMANDS))
        grouped = group_frames.select(synapse_rules.SYN_STATE_COLUMNS + ["_seq", "_conn"]).groupBy("stream", "instance")

        def one_group(table):
            return synapse_group(max_conn, table)

        return grouped.applyInArrow(one_group, spark_schema(packed_schema("synapse", SYN_RESULTS)))

    def commands():
        return (df.filter(F.col("command").isNotNull()).groupBy("command")
                  .agg(F.count(F.lit(1)).alias("count"), F.min("ts").alias("first_ts"),
                       F.max("ts").alias("last_ts")))
    ranks = reader.capture_ranks(files)
    return SparkReplay(protocol, frames, SYN_RESULTS, packed_builder=packed_synapse, _tmp=tmp, builders={
        "commands": commands,
        "lag": lambda: lag.spark_synapse_dataframe(df, spark_schema, to_spark_arrow, ranks)})


def _planned(vb_frames, sql: str, cas: bool):
    """One plan of replay/rules/plans.py over the vbucket frames; its `cas` (when the table
    has one: the 64 bits as a long, plans.py) back to the decimal(20,0) Spark reads uint64 as.
    The table's schema says whether there is one: asking the DataFrame (`df.columns`) is an
    analysis of the whole plan, a round trip to a Connect server (0.2 s at 1M frames)."""
    from pyspark.sql import functions as F
    df = vb_frames.sparkSession.sql(sql, vb=vb_frames)
    if cas:
        df = df.withColumn("cas", spark_documents.cas_decimal(F, F.col("cas")))
    return df


# --- user code ----------------------------------------------------------------------------

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
        _leaves_state(spark)
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
            return apply_group_table(protocol, fn, key, table)

        out = frames.groupBy(*keys).applyInArrow(apply_group, out_schema).toArrow()
    results = []
    for row in out.to_pylist():
        key = row["vbucket"] if protocol == "dcp" else (row["stream"], row["instance"])
        table = pa.ipc.open_stream(row["ipc"]).read_all() if row["ipc"] is not None else None
        results.append((key, table))
    return apply.concat_results(results)
