"""The Spark engine gives the local engine's tables, whatever the partitioning: generated
captures (hypothesis, a handful of seeds), 1 and 17 shuffle partitions, local[1] vs
local[2] (in a subprocess), and --apply."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcptool.replay import apply
from dcptool.replay.local import engine as local
from dcptool.replay.rules import tables as T
from dcptool.replay.spark import engine as spark_engine
from dcptool.replay.store import reader
from tests.support import capgen, fresh_spark

pytestmark = pytest.mark.spark


def _files(tmp, protocol, s, n=200, in_progress=False):
    d = tmp / f"{protocol}-{s}-{in_progress}"
    capgen.write_captures(capgen.generate(protocol, s, n_events=n), str(d), seed=s,
                          in_progress_last=in_progress, truncate_bytes=13 if in_progress else 0)
    return reader.find_captures([str(d)])


def _assert_same(files, rep):
    want = local.replay_local(files)
    try:
        for name in want.names():
            assert rep.table(name).equals(want.table(name)), name
    finally:
        rep.close()


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(s=st.integers(0, 2**32 - 1), protocol=st.sampled_from(["dcp", "synapse"]), in_progress=st.booleans())
def test_spark_equals_local(spark, tmp_path_factory, s, protocol, in_progress):
    files = _files(tmp_path_factory.mktemp("s"), protocol, s, in_progress=in_progress)
    _assert_same(files, spark_engine.replay_spark(spark, files))


@pytest.mark.parametrize("dictionary", [None, True])
def test_cas_read_as_long_or_decimal(spark, tmp_path, dictionary):
    """Spark reads `cas` as the long of its bits when no file keeps it dictionary-encoded (the
    capture writer's files), as decimal(20,0) otherwise (other writers); cas values at and
    above 2**63 come out the same either way, equal to the local engine's."""
    d = tmp_path / "c"
    capgen.write_captures(capgen.generate("dcp", 7, n_events=300), str(d), seed=7, dictionary=dictionary)
    files = reader.find_captures([str(d)])
    paths = [f.path for f in files]
    assert reader.without_dictionary(paths, "cas") is (dictionary is None)
    cas = local.replay_local(files).table("documents").column("cas").to_pylist()
    assert any(c >= 2**63 for c in cas) and any(c < 2**63 for c in cas)
    _assert_same(files, spark_engine.replay_spark(spark, files))


def test_documents_in_spark_sql_follow_rollbacks(spark, tmp_path):
    """`documents` is computed by Spark SQL alone (no Python workers): on captures whose
    rollbacks undo changes it equals the local engine and the row-by-row oracle."""
    from tests.support import oracle
    undone = 0
    for s in range(6):
        files = _files(tmp_path, "dcp", s)
        want = local.replay_local(files)
        undone += sum(want.table("rollbacks").column("undone").to_pylist())
        rep = spark_engine.replay_spark(spark, files)
        try:
            assert rep.table("documents").equals(want.table("documents"))
            assert oracle.dcp(files)["documents"].equals(want.table("documents"))
        finally:
            rep.close()
    assert undone > 0   # the rollbacks really undid changes


@pytest.mark.parametrize("partitions", ["1", "17"])
def test_shuffle_partitions_do_not_matter(spark, tmp_path, partitions):
    old = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", partitions)
    try:
        for protocol in ("dcp", "synapse"):
            files = _files(tmp_path, protocol, 77, n=300)
            _assert_same(files, spark_engine.replay_spark(spark, files))
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", old)


def _apply_fn(key, table):
    return pa.table({"key": [json.dumps(key)], "frames": [table.num_rows],
                     "order": [json.dumps(table.column("frame_no").to_pylist())],
                     "captures": [len(set(table.column("capture_id").to_pylist()))]})


@pytest.mark.parametrize("protocol", ["dcp", "synapse"])
def test_apply_is_the_same_on_both_engines(spark, tmp_path, protocol):
    files = _files(tmp_path, protocol, 5)
    a = apply.apply_local(files, _apply_fn)
    b = spark_engine.apply_spark(spark, files, _apply_fn)
    assert a.num_rows > 0 and a.equals(b)


def test_local1_and_local2_give_the_same_checksums(spark, fresh_spark_cli):
    # `replay --spark --master local[1]` with 3 shuffle partitions (tests/support/fresh_spark.py:
    # a fresh process shared with two other tests) against this session's local[2] and 4
    names = fresh_spark.LOCAL1_TABLES
    files = reader.find_captures([fresh_spark_cli.captures["local1"]])
    rep = spark_engine.replay_spark(spark, files)
    try:
        in_session = {n: T.checksum(n, rep.table(n)) for n in names}
    finally:
        rep.close()
    proc = fresh_spark_cli.runs["local1"]
    assert proc.returncode == 0, proc.stderr
    sums = {r["table"]: r["sha256"] for r in map(json.loads, proc.stdout.splitlines())}
    assert sums == in_session
    assert "log4j" not in proc.stderr and "WARN" not in proc.stderr


@pytest.mark.parametrize("master,want", [("local[*]", str(os.cpu_count() or 2)), ("local[3]", "3"), ("local", "1"),
                                         ("local[2,4]", "2"), ("spark://10.0.0.1:7077", "8"), ("yarn", "8")])
def test_shuffle_partitions_follow_the_local_cores(master, want):
    assert spark_engine.shuffle_partitions(master) == want
