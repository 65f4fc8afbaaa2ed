"""A user's Spark SQL error is one line on stderr (issue 29): pyspark's own loggers
(SQLQueryContextLogger writes the analysed plan as ~30 KB of JSON) and the JVM's stay off
the terminal; -v shows Spark's detail. Real `dcptool replay --spark --sql` subprocesses on
an embedded local[1] session (no warm server), one small generated capture."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dcptool.replay.spark import engine as spark_engine
from tests.support import capgen
from tests.support.paths import ROOT

pytestmark = pytest.mark.spark

UNKNOWN_COLUMN = ("SELECT nosuchcol FROM documents", "UNRESOLVED_COLUMN")
SYNTAX = ("SELEC vbucket FROM documents", "PARSE_SYNTAX_ERROR")
TYPE_MISMATCH = ("SELECT 1 + array(1) FROM documents", "DATATYPE_MISMATCH")


@pytest.fixture(scope="module")
def capture(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("spark-errors") / "captures"
    capgen.write_captures(capgen.generate("dcp", 5, n_events=60), str(d), seed=5, max_segments=1)
    return str(d)


def _replay(capture: str, sql: str, *extra: str, verbose: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    argv = [sys.executable, "-m", "dcptool.cli", *(["-v"] if verbose else []), "replay", "--spark",
            "--master", "local[1]", "--conf", "spark.sql.shuffle.partitions=2", *extra, "--sql", sql, capture]
    return subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.parametrize("case,extra", [(UNKNOWN_COLUMN, ()), (SYNTAX, ("--unsafe-sql",)), (TYPE_MISMATCH, ())],
                         ids=["unknown-column", "syntax-unsafe", "type-mismatch"])
def test_sql_error_is_one_short_line(capture, case, extra):
    sql, error_class = case
    proc = _replay(capture, sql, *extra)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr[:2000]
    assert len(proc.stderr.encode()) < 600
    assert lines[0].startswith("dcptool: SQL error [") and error_class in lines[0]
    assert "(line 1, pos " in lines[0]


def test_verbose_shows_sparks_detail(capture):
    sql, error_class = UNKNOWN_COLUMN
    proc = _replay(capture, sql, verbose=True)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert lines[-1].startswith("dcptool: SQL error [") and error_class in lines[-1]
    # pyspark's query-context log (the analysed plan) and the traceback
    assert "SQLQueryContextLogger" in proc.stderr and "Traceback" in proc.stderr
    assert len(proc.stderr.encode()) > 2000


def test_session_logs_nothing_for_a_bad_query(spark):
    """In-process too (the shared session): Spark's error is raised, pyspark's query-context
    logger prints nothing; verbose turns it back on. Its stderr handler is pointed at a
    buffer for the test (it keeps the stderr of its creation, not pytest's capture)."""
    import io
    import logging

    logger = logging.getLogger("SQLQueryContextLogger")
    handlers = [h for h in logger.handlers if isinstance(h, logging.StreamHandler)]
    assert handlers   # pyspark's own handler, still attached: quiet by level, not removed
    buf = io.StringIO()
    saved = [h.setStream(buf) for h in handlers]
    try:
        with pytest.raises(Exception, match="UNRESOLVED_COLUMN"):
            spark.sql("SELECT nosuchcol FROM range(3)").collect()
        assert buf.getvalue() == ""
        spark_engine.quiet_spark_loggers(verbose=True)
        with pytest.raises(Exception, match="UNRESOLVED_COLUMN"):
            spark.sql("SELECT nosuchcol FROM range(3)").collect()
        assert "UNRESOLVED_COLUMN" in buf.getvalue()
    finally:
        spark_engine.quiet_spark_loggers(verbose=False)
        for h, stream in zip(handlers, saved):
            h.setStream(stream)


class _Context:
    def startIndex(self):
        return 7

    def fragment(self):
        return "nosuchcol"


class _ConnectError(Exception):
    """What a Spark Connect client raises for an unknown column: its message carries
    Spark's own "; line 1 pos 7;" besides the query context."""

    def getCondition(self):
        return "UNRESOLVED_COLUMN.WITH_SUGGESTION"

    def getMessage(self):
        return ("[UNRESOLVED_COLUMN.WITH_SUGGESTION] A column, variable, or function parameter with name "
                "`nosuchcol` cannot be resolved. Did you mean one of the following? [`cas`].; line 1 pos 7; "
                "SQLSTATE: 42703")

    def getQueryContext(self):
        return [_Context()]


def test_connect_error_names_its_position_once():
    from dcptool.replay.spark import sql as sql_guard
    text = str(sql_guard.spark_error(_ConnectError(), "SELECT nosuchcol FROM documents"))
    assert text == ("SQL error [UNRESOLVED_COLUMN.WITH_SUGGESTION] A column, variable, or function parameter "
                    "with name `nosuchcol` cannot be resolved. Did you mean one of the following? [`cas`]. "
                    "(line 1, pos 7: 'nosuchcol')")
