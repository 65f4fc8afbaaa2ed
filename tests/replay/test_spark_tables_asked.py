"""Spark builds and runs only the plans of the tables asked for (REPLAY.md "How the engines
run"): `replay --spark --table documents` (SQL of replay/rules/plans.py) runs no Python worker
and never builds the per-vbucket groups; `snapshots` does (so the check can fail)."""

from __future__ import annotations

import pytest

from dcptool.replay.store import reader
from tests.support import capgen

pytestmark = pytest.mark.spark

# physical plan nodes that run Python workers (pyspark's Arrow and pandas UDF operators)
PYTHON_NODES = ("FlatMapGroupsInArrow", "MapInArrow", "FlatMapGroupsInPandas", "MapInPandas",
                "ArrowEvalPython", "BatchEvalPython")


def _python_nodes(df, capsys) -> list[str]:
    capsys.readouterr()
    df.explain()
    plan = capsys.readouterr().out
    assert "== Physical Plan ==" in plan
    return [n for n in PYTHON_NODES if n in plan]


def _counted_replay(spark, path: str, seed: int):
    """A Spark replay of a generated capture, and the list that grows each time it builds
    its per-vbucket groups."""
    from dcptool.replay.spark import engine as spark_engine
    capgen.write_captures(capgen.generate("dcp", 4, n_events=150), path, seed=seed)
    rep = spark_engine.replay_spark(spark, reader.find_captures([path]))
    built = []
    groups = rep.packed_builder

    def counted():
        built.append(1)
        return groups()
    rep.packed_builder = counted
    return rep, built


def test_sql_tables_build_no_group_and_run_no_python(spark, tmp_path, capsys):
    rep, built = _counted_replay(spark, str(tmp_path), 4)
    try:
        # the one Python a capture with Snappy or xattr values runs is the bodies' cut
        # (replay/spark/bodies.py, one Arrow UDF over the surviving rows), never a group
        assert set(_python_nodes(rep.dataframe("documents"), capsys)) <= {"ArrowEvalPython"}
        assert built == []
        assert _python_nodes(rep.dataframe("snapshots"), capsys) == ["FlatMapGroupsInArrow"]
        assert built == [1]
    finally:
        rep.close()


def test_sql_registers_only_the_tables_the_query_reads(spark, tmp_path):
    """`replay --spark --sql`: the read-only check returns the tables the query reads (CTE
    names aside) and only those become views, so a query over `documents` builds no
    per-vbucket group."""
    from dcptool.replay.spark import sql as sql_guard
    rep, built = _counted_replay(spark, str(tmp_path), 5)
    try:
        joined = ("WITH d AS (SELECT vbucket FROM Documents) "
                  "SELECT count(*) FROM d JOIN vbuckets USING (vbucket)")
        assert sql_guard.check_query(spark, joined, rep.names()) == {"documents", "vbuckets"}
        used = sql_guard.check_query(spark, "WITH x AS (SELECT key FROM documents) SELECT * FROM x",
                                     rep.names())
        assert used == {"documents"}
        spark.catalog.dropTempView("vbuckets")
        rep.register_views(used)
        assert built == []
        assert spark.sql("SELECT count(*) AS n FROM documents").toArrow().column("n")[0].as_py() > 0
        assert not spark.catalog.tableExists("vbuckets")
    finally:
        rep.close()
