"""`replay --sql` is read-only over the capture's tables (issue 14.11), Spark's errors are
one line (14.12), and --apply by path works on Spark (15.6). The many cases run against the
shared session (tests/conftest.py); one fresh CLI process checks what only a new JVM can
show: no credential in its environment, nothing left in the working directory, a quiet -v."""

from __future__ import annotations

import json
import os
import sys

import pytest
from click.testing import CliRunner

from dcptool.cli import cli
from dcptool.replay import apply
from dcptool.replay.local import engine as local
from dcptool.replay.spark import engine as spark_engine
from dcptool.replay.spark import sql as sql_guard
from dcptool.replay.store import reader
from tests.support import capgen, fresh_spark

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def capture_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sqlcaps") / "dcp"
    capgen.write_captures(capgen.generate("dcp", 11, n_events=200), str(d), seed=11)
    return str(d)


@pytest.fixture(scope="module")
def views(spark, capture_dir):
    rep = spark_engine.replay_spark(spark, reader.find_captures([capture_dir]))
    rep.register_views()
    yield rep
    rep.close()


ATTACKS = [
    ("SELECT * FROM text.`/etc/passwd`", "text./etc/passwd is not one of the capture's tables"),
    ("SELECT * FROM parquet.`/tmp`", "parquet./tmp"),
    ("SELECT * FROM jdbc.`x`", "jdbc.x"),
    ("SELECT * FROM global_temp.documents", "global_temp.documents"),
    ("SELECT reflect('java.lang.System', 'getenv', 'DCPTOOL_PASSWORD')", "function reflect()"),
    ("SELECT java_method('java.lang.System', 'getenv', 'HOME')", "function java_method()"),
    ("SELECT try_reflect('java.lang.System', 'getenv', 'HOME')", "function try_reflect()"),
    ("SELECT key FROM documents WHERE key = (SELECT reflect('java.lang.System','getenv','X'))",
     "function reflect()"),
    ("WITH a AS (SELECT * FROM text.`/etc/passwd`) SELECT * FROM a", "text./etc/passwd"),
    ("SELECT * FROM read_files('/etc/passwd')", "table function read_files()"),
    ("SELECT * FROM IDENTIFIER('text.`/etc/passwd`')", "text./etc/passwd"),
    ("INSERT OVERWRITE DIRECTORY '{tmp}/written' USING parquet SELECT 1", "is not a query"),
    ("CREATE TABLE t AS SELECT 1", "is not a query"),
    ("CREATE TEMPORARY VIEW j USING jdbc OPTIONS (url 'jdbc:x:y', dbtable 't')", "is not a query"),
    ("DROP VIEW documents", "is not a query"),
    ("SET spark.sql.runSQLOnFiles=true", "is not a query"),
    ("ADD JAR {tmp}/x.jar", "is not a query"),
    ("LOAD DATA LOCAL INPATH '/etc/passwd' INTO TABLE documents", "is not a query"),
    ("CACHE TABLE documents", "is not a query"),
    ("EXPLAIN SELECT 1", "is not a query"),
    ("SELECT * FROM nosuchtable", "unknown table nosuchtable"),
]


@pytest.mark.parametrize("sql, says", ATTACKS)
def test_the_fence_refuses_writes_files_and_the_jvm(spark, views, tmp_path, sql, says):
    sql = sql.format(tmp=tmp_path)
    with pytest.raises(sql_guard.UnsafeSqlError) as e:
        sql_guard.check_query(spark, sql, views.names())
    msg = str(e.value)
    assert "\n" not in msg and says in msg and "--unsafe-sql" in msg
    assert os.listdir(tmp_path) == []          # nothing was written


GOOD = {
    "group_by": "SELECT vbucket, count(*) AS n FROM documents GROUP BY vbucket ORDER BY vbucket",
    "cte": "WITH d AS (SELECT vbucket FROM documents) SELECT count(*) AS n FROM d",
    "join": ("SELECT v.vbucket, count(d.key) AS n FROM vbuckets v LEFT JOIN documents d "
             "ON d.vbucket = v.vbucket GROUP BY v.vbucket ORDER BY v.vbucket"),
    "window": ("SELECT vbucket, by_seqno, row_number() OVER (PARTITION BY vbucket ORDER BY by_seqno) AS r "
               "FROM documents ORDER BY vbucket, by_seqno"),
    "subquery_and_range": ("SELECT id FROM range(3) WHERE id < (SELECT count(*) FROM documents) "
                           "UNION ALL SELECT explode(array(7, 8))"),
}


def test_queries_still_work(spark, views, capture_dir):
    docs = local.replay_local(reader.find_captures([capture_dir])).table("documents")
    assert docs.num_rows > 0
    results = {}
    for name, sql in GOOD.items():
        sql_guard.check_query(spark, sql, views.names())
        results[name] = spark.sql(sql).toArrow()
    per_vb: dict = {}
    for vb in docs.column("vbucket").to_pylist():
        per_vb[vb] = per_vb.get(vb, 0) + 1
    assert dict(zip(*[results["group_by"].column(c).to_pylist() for c in ("vbucket", "n")])) == per_vb
    assert results["cte"].column("n").to_pylist() == [docs.num_rows]
    joined = dict(zip(*[results["join"].column(c).to_pylist() for c in ("vbucket", "n")]))
    assert {vb: n for vb, n in joined.items() if n} == per_vb
    assert max(results["window"].column("r").to_pylist()) == max(per_vb.values())
    assert sorted(results["subquery_and_range"].column(0).to_pylist()) == [0, 1, 2, 7, 8]


def test_spark_errors_are_one_line_with_class_and_position(spark, views):
    with pytest.raises(Exception) as e:
        sql_guard.check_query(spark, "SELECT key\nFROM documents WHERE key = =", views.names())
    msg = str(e.value)
    assert isinstance(e.value, sql_guard.SqlError) and not isinstance(e.value, sql_guard.UnsafeSqlError)
    assert msg.startswith("SQL error [PARSE_SYNTAX_ERROR] Syntax error at or near '='")
    assert msg.endswith("(line 2, pos 27)") and "\n" not in msg and "SQLSTATE" not in msg
    with pytest.raises(Exception) as e:
        spark.sql("SELECT no_such_column FROM documents")
    msg = str(sql_guard.spark_error(e.value, "SELECT no_such_column FROM documents"))
    assert msg.startswith("SQL error [UNRESOLVED_COLUMN") and "no_such_column" in msg
    assert "\n" not in msg and "(line 1, pos 7" in msg and len(msg) < 600


def test_cli_refusal_and_errors_exit_2_with_one_line(spark, capture_dir, monkeypatch, tmp_path):
    """The CLI path over the shared session (a fresh one costs a JVM)."""
    monkeypatch.setattr(spark_engine, "make_session", lambda *a, **k: spark)
    monkeypatch.setattr(spark_engine, "stop_session", lambda session: None)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for sql, says in [("SELECT * FROM text.`/etc/passwd`", "--sql refused"),
                      (f"INSERT OVERWRITE DIRECTORY '{tmp_path}/w' USING csv SELECT 1", "--sql refused"),
                      ("SELEC key FROM documents", "SQL error [PARSE_SYNTAX_ERROR]"),
                      ("SELECT nope FROM documents", "SQL error [UNRESOLVED_COLUMN")]:
        r = runner.invoke(cli, ["replay", capture_dir, "--spark", "--sql", sql], catch_exceptions=False)
        assert r.exit_code == 2, (sql, r.output)
        assert r.stdout == ""
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dcptool: ") and says in lines[0], r.stderr
    r = runner.invoke(cli, ["replay", capture_dir, "--spark", "--format", "jsonl", "--sql",
                            "SELECT count(*) AS n FROM documents"], catch_exceptions=False)
    assert r.exit_code == 0 and json.loads(r.stdout)["n"] > 0
    assert os.listdir(tmp_path) == []   # no spark-warehouse/, no metastore_db/, no w/


def test_scrub_environment_drops_credentials():
    env = {"DCPTOOL_PASSWORD": "p", "DCPTOOL_USER": "u", "AWS_SECRET_ACCESS_KEY": "s", "GITHUB_TOKEN": "t",
           "MY_API_KEY": "k", "PATH": "/bin", "JAVA_HOME": "/j", "SPARK_LOCAL_IP": "127.0.0.1"}
    gone = spark_engine.scrub_environment(env)
    assert sorted(env) == ["JAVA_HOME", "PATH", "SPARK_LOCAL_IP"]
    assert "DCPTOOL_PASSWORD" in gone


APPLY_MODULE = '''
import pyarrow as pa

def per_vbucket(key, table):
    return pa.table({"vbucket": [key], "frames": [table.num_rows]})
'''


def test_apply_by_path_on_spark_ships_the_file(spark, capture_dir, tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "cs_spark_apply_mod.py").write_text(APPLY_MODULE)
    monkeypatch.chdir(tmp_path)
    saved = list(sys.path)
    try:
        fn = apply.load_function("./lib/cs_spark_apply_mod.py:per_vbucket")
        files = reader.find_captures([capture_dir])
        got = spark_engine.apply_spark(spark, files, fn)
        assert got is not None and got.num_rows > 0
        assert got.equals(apply.apply_local(files, fn))
    finally:
        sys.path[:] = saved
        sys.modules.pop("cs_spark_apply_mod", None)


def test_fresh_process_has_no_credentials_no_warehouse_and_a_quiet_verbose(fresh_spark_cli):
    """One new JVM (the expensive part, shared: tests/support/fresh_spark.py, where this
    command runs first and so starts the JVM): started with DCPTOOL_PASSWORD in the
    environment, it cannot see it even with --unsafe-sql and reflect; -v stays short; the
    working directory stays empty (also after the other commands of that process)."""
    proc = fresh_spark_cli.runs["sql-safety"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    # reflect gives String.valueOf(getenv(...)): "null" when the variable is absent
    assert json.loads(proc.stdout) == {"pw": "null", "other": "null", "has_path": True}
    assert os.listdir(fresh_spark_cli.cwd) == []
    assert len(proc.stderr.splitlines()) < 200, proc.stderr[-3000:]
    assert "py4j" not in proc.stderr.lower() or "DEBUG" not in proc.stderr
    assert fresh_spark.PASSWORD not in proc.stderr


# --sql in-process (issue 29): DuckDB, checked with DuckDB's own parser before any table is
# computed; the engine's file and network access off and locked whatever the check says
DUCK_ATTACKS = [
    ("SELECT * FROM read_csv('/etc/passwd')", "table function read_csv() is not allowed"),
    ("SELECT * FROM read_parquet('{tmp}/*.parquet')", "table function read_parquet() is not allowed"),
    ("SELECT * FROM read_text('/etc/passwd')", "table function read_text() is not allowed"),
    ("SELECT * FROM glob('/*')", "table function glob() is not allowed"),
    ("SELECT * FROM query('SELECT 1')", "table function query() is not allowed"),
    ("SELECT key FROM documents WHERE key IN (SELECT * FROM read_blob('/etc/passwd'))",
     "table function read_blob() is not allowed"),
    ("WITH a AS (SELECT * FROM read_csv_auto('/etc/passwd')) SELECT * FROM a", "read_csv_auto()"),
    ("SELECT * FROM '/etc/passwd'", "unknown table /etc/passwd"),
    ("SELECT * FROM main.documents", "main.documents is not one of the capture's tables"),
    ("SELECT * FROM sqlite_master", "unknown table sqlite_master"),
    ("SELECT getenv('HOME')", "function getenv() reads outside the capture"),
    ("SELECT current_setting('temp_directory')", "function current_setting()"),
    ("SUMMARIZE documents", "DESCRIBE / SUMMARIZE / SHOW is not a query"),
    ("SELECT 1; SELECT 2", "2 statements, not one query"),
    ("ATTACH '{tmp}/x.db'", "ATTACH is not a query"),
    ("COPY documents TO '{tmp}/x.csv'", "COPY is not a query"),
    ("COPY (SELECT 1) TO '{tmp}/x.csv'", "COPY is not a query"),
    ("INSTALL httpfs", "LOAD is not a query"),
    ("LOAD httpfs", "LOAD is not a query"),
    ("SET memory_limit = '64GB'", "SET is not a query"),
    ("PRAGMA enable_profiling", "PRAGMA is not a query"),
    ("CREATE TABLE t AS SELECT 1", "CREATE is not a query"),
    ("EXPORT DATABASE '{tmp}/db'", "EXPORT is not a query"),
    ("EXPLAIN SELECT 1", "EXPLAIN is not a query"),
    ("SELECT * FROM nosuchtable", "unknown table nosuchtable"),
]


def _duck(capture_dir, *args):
    return CliRunner().invoke(cli, ["replay", capture_dir, "--format", "jsonl", *args], catch_exceptions=False)


@pytest.mark.parametrize("sql, says", DUCK_ATTACKS)
def test_in_process_sql_refuses_files_commands_and_settings(capture_dir, tmp_path, sql, says):
    r = _duck(capture_dir, "--sql", sql.format(tmp=tmp_path))
    assert r.exit_code == 2 and r.stdout == "", r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcptool: --sql refused: ") and says in lines[0], r.stderr
    assert "--unsafe-sql" in lines[0] and len(lines[0].encode()) < 600
    assert os.listdir(tmp_path) == []


def test_in_process_unsafe_sql_still_has_no_file_access(capture_dir, tmp_path):
    """--unsafe-sql lifts the parser check on DuckDB, never the engine's own fence."""
    for sql in (f"COPY documents TO '{tmp_path}/x.csv'", "SELECT * FROM read_csv('/etc/passwd')",
                f"ATTACH '{tmp_path}/x.db'", "SET enable_external_access = true"):
        r = _duck(capture_dir, "--unsafe-sql", "--sql", sql)
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1, (sql, r.output)
        assert ("Permission Error" in lines[0] or "configuration has been locked" in lines[0]), lines[0]
    assert os.listdir(tmp_path) == []
    r = _duck(capture_dir, "--unsafe-sql", "--sql", "SELECT 1 AS one; SELECT count(*) AS n FROM documents")
    assert r.exit_code == 0 and json.loads(r.stdout)["n"] > 0, r.output


@pytest.mark.parametrize("sql, says, code", [
    ("SELECT key\nFROM documents WHERE key = =", 'SQL error [Parser Error] syntax error at or near "=" (line 2, pos 27)', 2),
    ("SELECT nosuchcol FROM documents", 'SQL error [Binder Error] Referenced column "nosuchcol" not found', 2),
    ("SELECT key + 1 FROM documents", "SQL error [Binder Error] No function matches", 2),
    ("SELECT CAST(key AS INTEGER) FROM documents", "SQL error [Conversion Error]", 1),
])
def test_in_process_sql_errors_are_one_short_line(capture_dir, sql, says, code):
    r = _duck(capture_dir, "--sql", sql)
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == code and r.stdout == "", r.output
    assert len(lines) == 1 and lines[0].startswith("dcptool: " + says) and len(lines[0].encode()) < 600, r.stderr


def test_in_process_sql_computes_only_the_tables_it_names(capture_dir):
    from dcptool.replay.local import sql as local_sql
    rep = local.replay_local(reader.find_captures([capture_dir]), tables=[])
    asked = []
    table = rep.table
    rep.table = lambda name: (asked.append(name), table(name))[1]
    got = local_sql.run_query(rep, "WITH v AS (SELECT vbucket FROM vbuckets) SELECT count(*) AS n FROM documents "
                                   "WHERE vbucket IN (SELECT vbucket FROM v)")
    assert asked == ["documents", "vbuckets"] and got.column("n").to_pylist() == [table("documents").num_rows]


def test_in_process_sql_gives_the_rows_spark_gives(spark, views, capture_dir):
    """The same simple SELECTs run on both engines."""
    r = _duck(capture_dir, "--sql", GOOD["group_by"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) > 1 and rows == spark.sql(GOOD["group_by"]).toArrow().to_pylist()
