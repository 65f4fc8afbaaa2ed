"""A user's Spark SQL error is one line on stderr (issue 29): pyspark's own loggers
(SQLQueryContextLogger writes the analysed plan as ~30 KB of JSON) and the JVM's stay off
the terminal; -v shows Spark's detail. Real `dcptool replay --spark --sql` commands on an
embedded local[1] session (no warm server), one small generated capture, all four in one
fresh process (tests/support/cli_batch.py): the first, the unknown column, starts the JVM
as a user's command does and pins its stderr whole; the others reuse that JVM (a new
session each), which saves three JVM starts; -v goes last (it configures logging)."""

from __future__ import annotations

import pytest

from dcptool.replay.spark import engine as spark_engine
from tests.support import capgen
from tests.support.cli_batch import Call, run_batch

pytestmark = pytest.mark.spark

UNKNOWN_COLUMN = ("SELECT nosuchcol FROM documents", "UNRESOLVED_COLUMN")
SYNTAX = ("SELEC vbucket FROM documents", "PARSE_SYNTAX_ERROR")
TYPE_MISMATCH = ("SELECT 1 + array(1) FROM documents", "DATATYPE_MISMATCH")


@pytest.fixture(scope="module")
def capture(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("spark-errors") / "captures"
    capgen.write_captures(capgen.generate("dcp", 5, n_events=60), str(d), seed=5, max_segments=1)
    return str(d)


def _call(capture: str, sql: str, *extra: str, verbose: bool = False) -> Call:
    return Call([*(["-v"] if verbose else []), "replay", "--spark", "--master", "local[1]", "--conf",
                 "spark.sql.shuffle.partitions=2", *extra, "--sql", sql, capture])


CASES = {"unknown-column": (UNKNOWN_COLUMN, ()), "syntax-unsafe": (SYNTAX, ("--unsafe-sql",)),
         "type-mismatch": (TYPE_MISMATCH, ())}


@pytest.fixture(scope="module")
def ran(capture) -> dict:
    """Each case's command and the verbose one, run in one fresh process (unknown column first)."""
    calls = {name: _call(capture, case[0], *extra) for name, (case, extra) in CASES.items()}
    calls["verbose"] = _call(capture, UNKNOWN_COLUMN[0], verbose=True)
    return dict(zip(calls, run_batch(list(calls.values()), timeout=480)))


@pytest.mark.parametrize("name", list(CASES))
def test_sql_error_is_one_short_line(ran, name):
    (_, error_class), _ = CASES[name]
    proc = ran[name]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr[:2000]
    assert len(proc.stderr.encode()) < 600
    assert lines[0].startswith("dcptool: SQL error [") and error_class in lines[0]
    assert "(line 1, pos " in lines[0]


def test_verbose_shows_sparks_detail(ran):
    _, error_class = UNKNOWN_COLUMN
    proc = ran["verbose"]
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
