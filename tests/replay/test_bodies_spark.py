"""Bodies on Spark (REPLAY.md "Bodies"): the same `documents` and `history`, body columns and
checksums included, as the in-process engine, with the Python UDF (Snappy, xattrs, a commit,
a tombstone with xattrs, a rollback, --as-of) and without it (plain values: SQL alone); a JSON
field read with Spark's own functions equals DuckDB's. Few examples: each costs Spark jobs."""

from __future__ import annotations

import pytest

from dcptool.replay.local import engine as local
from dcptool.replay.local import sql as local_sql
from dcptool.replay.rules import tables as T
from dcptool.replay.rules.as_of import AsOf
from dcptool.replay.spark import engine as spark_engine
from dcptool.replay.store import reader
from tests.support import body_caps

pytestmark = pytest.mark.spark


def _files(tmp_path, built, name):
    d = tmp_path / name
    body_caps.write(built, str(d), cuts=(30,))
    return reader.find_captures([str(d)])


def test_spark_bodies_equal_local(spark, tmp_path):
    coded = body_caps.generate(7, True)
    coded.rows.extend(body_caps.sync_capture().rows[2:])        # a prepare and commit, a tombstone with xattrs, a rollback
    for i, r in enumerate(coded.rows):
        r["ts"] = body_caps.TS0 + 1000 * (i + 1)
    plain = body_caps.generate(8, False)
    for r in plain.rows:                                # no xattrs: SQL alone, no UDF
        if (r.get("datatype") or 0) & 4:
            r["datatype"] = 0
    cases = [(_files(tmp_path, coded, "coded"), None), (_files(tmp_path, plain, "plain"), None)]
    cases.append((cases[0][0], AsOf(ts_ns=body_caps.TS0 + 1000 * (len(coded.rows) // 2))))
    # no commit, rollback or drop: `documents` by the window carrying `raw`, with the UDF
    cases.append((_files(tmp_path, body_caps.generate(10, True), "coded-plain"), None))
    for files, as_of in cases:
        want = local.replay_local(files, as_of=as_of, tables=["documents", "history"])
        rep = spark_engine.replay_spark(spark, files, as_of=as_of)
        try:
            for name in ("documents", "history"):
                got = rep.table(name)
                assert got.equals(want.table(name)), name
                assert T.checksum(name, got) == T.checksum(name, want.table(name))
            assert want.table("documents").column("xattrs").null_count < want.table("documents").num_rows \
                or files is cases[1][0]
            assert want.table("documents").num_rows > 10
        finally:
            rep.close()


def test_a_json_field_by_spark_sql_equals_duckdb(spark, tmp_path):
    files = _files(tmp_path, body_caps.generate(9, True), "j")
    duck = local_sql.run_query(local.replay_local(files), "SELECT key, value_json->>'$.type' AS t, "
                               "CAST(json_extract(value_json, '$.n') AS BIGINT) AS n FROM documents "
                               "WHERE value_json IS NOT NULL ORDER BY key, t, n")
    rep = spark_engine.replay_spark(spark, files)
    try:
        rep.register_views({"documents"})
        got = spark.sql("SELECT key, get_json_object(value_json, '$.type') AS t, "
                        "from_json(value_json, 'n BIGINT').n AS n FROM documents "
                        "WHERE value_json IS NOT NULL ORDER BY key, t, n").toArrow()
    finally:
        rep.close()
    assert got.num_rows == duck.num_rows > 5
    assert [tuple(r.values()) for r in got.to_pylist()] == [tuple(r.values()) for r in duck.to_pylist()]


def test_spark_picks_documents_by_a_window_only_when_the_changes_are_plain():
    """The window carrying `raw` stands for the aggregate only where the changes are a filter of
    the frames: a rollback, a commit or a collection drop keeps the aggregate and the join."""
    from dcptool.replay.rules import plans
    ops = frozenset({"mutation", "deletion"})
    plain = plans.table_sql(plans.SPARK, "documents", "{vb}", plans.PlanFacts({"c": 0}, False, ops, False))
    assert "row_number()" in plain and "JOIN" not in plain
    for facts in (plans.PlanFacts({"c": 0}, True, ops, False),
                  plans.PlanFacts({"c": 0}, False, ops | {"commit"}, False),
                  plans.PlanFacts({"c": 0}, False, ops | {"system_event"}, False)):
        sql = plans.table_sql(plans.SPARK, "documents", "{vb}", facts)
        assert "row_number()" not in sql and "max_by(" in sql and "_r ON _r._r_seq = _b._bseq" in sql
    duck = plans.table_sql(plans.DUCKDB, "documents", "{vb}", plans.PlanFacts({"c": 0}, False, ops, False))
    assert "row_number()" not in duck and "SEMI JOIN _pick" in duck
