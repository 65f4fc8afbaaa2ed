"""`replay --sql`: the read-only fence around a user's query, and Spark's errors as one line.

A query is parsed with Spark's own parser (through the session's py4j handles, so this
module imports no pyspark) and its unresolved plan is walked before anything runs: every
plan node must be a query operator from an allow list (no command, no INSERT ... DIRECTORY,
no CTAS, no SET / ADD JAR / CACHE ...), every relation a registered table or a CTE name of
the query (one-part names only: no text.`/etc/passwd`, parquet.`...`, jdbc,
global_temp), every table-valued function a generator (no read_files), and no function
that reaches the JVM or files (reflect, java_method, try_reflect, from/to_protobuf with a
descriptor file). Subqueries in expressions and CTE bodies are walked too. The session
also runs with spark.sql.runSQLOnFiles=false, a second fence (replay/spark/engine.py).
"""

from __future__ import annotations

import re
from typing import Any

from dcptool.protocol.text import printable
from dcptool.replay.sql_common import (
    RefusedSqlError,
    SqlError,
    SqlUsageError,
    UnsafeSqlError,
)

__all__ = ["SqlError", "UnsafeSqlError", "SqlUsageError", "RefusedSqlError", "check_query", "spark_error"]

# Query operators of an unresolved plan (class simple names). Anything else is refused.
ALLOWED_NODES = frozenset({
    "Project", "Filter", "Aggregate", "Join", "LateralJoin", "SubqueryAlias", "UnresolvedRelation",
    "UnresolvedWith", "WithCTE", "CTERelationDef", "CTERelationRef", "Sort", "GlobalLimit",
    "LocalLimit", "Offset", "Tail", "Distinct", "Deduplicate", "Union", "Intersect", "Except",
    "WithWindowDefinition", "Window", "UnresolvedHaving", "OneRowRelation", "LocalRelation",
    "UnresolvedInlineTable", "Generate", "Pivot", "Unpivot", "Sample", "Expand",
    "UnresolvedSubqueryColumnAliases", "UnresolvedTableValuedFunction", "UnresolvedTVFAliases",
    "UnresolvedHint", "ResolvedHint", "RepartitionByExpression", "Repartition",
    "RebalancePartitions", "Range",
})
# Table-valued functions that only generate rows from their arguments.
ALLOWED_TVFS = frozenset({
    "range", "explode", "explode_outer", "inline", "inline_outer", "posexplode",
    "posexplode_outer", "stack", "json_tuple", "variant_explode", "variant_explode_outer",
})
# Functions that reach into the JVM or read files.
DENIED_FUNCTIONS = frozenset({
    "reflect", "java_method", "try_reflect", "from_protobuf", "to_protobuf",
})
_COMMAND = "org.apache.spark.sql.catalyst.plans.logical.Command"
_SUBQUERY = "org.apache.spark.sql.catalyst.expressions.SubqueryExpression"
_PLAN = "org.apache.spark.sql.catalyst.plans.logical.LogicalPlan"


def _seq(jseq) -> list:
    out = []
    it = jseq.iterator()
    while it.hasNext():
        out.append(it.next())
    return out


def _name(parts) -> list[str]:
    return [str(p) for p in _seq(parts)]


def run_query(spark: Any, rep: Any, sql: str, unsafe: bool = False) -> Any:
    """`sql` over the tables of `rep` (replay/spark/engine.py SparkReplay) as Arrow: the fence
    first (unless `unsafe`), then only the tables it reads registered as views. Refused,
    unparsable or unanalysable: a LateUsageError (exit 2); failing as it runs: SqlError (exit 1)."""
    try:
        used = None if unsafe else check_query(spark, sql, rep.names())
    except Exception as exc:  # noqa: BLE001 - Spark's errors come as many classes
        raise spark_error(exc, sql, SqlUsageError) from exc
    rep.register_views(used)   # only the tables the query reads are planned (all: --unsafe-sql)
    try:
        df = spark.sql(sql)
    except Exception as exc:  # noqa: BLE001 - Spark's errors come as many classes
        raise spark_error(exc, sql, SqlUsageError) from exc
    try:
        return df.toArrow()
    except Exception as exc:  # noqa: BLE001 - Spark's errors come as many classes
        raise spark_error(exc, sql) from exc


def check_query(spark, sql: str, tables) -> set[str]:
    """Raise RefusedSqlError (an UnsafeSqlError) unless `sql` is one read-only query over
    `tables` (names of the replay's tables); SqlUsageError when Spark cannot parse it. Returns the tables it reads (lower
    case), so only those need to be registered as views."""
    jvm = spark._jvm
    try:
        plan = spark._jsparkSession.sessionState().sqlParser().parsePlan(sql)
    except Exception as exc:  # noqa: BLE001 - py4j wraps Spark's ParseException
        raise spark_error(exc, sql, SqlUsageError) from None
    command = jvm.java.lang.Class.forName(_COMMAND)
    subquery = jvm.java.lang.Class.forName(_SUBQUERY)
    plan_class = jvm.java.lang.Class.forName(_PLAN)
    allowed = {t.lower() for t in tables}
    ctes: set[str] = set()
    relations: list[list[str]] = []

    def refuse(what: str):
        raise RefusedSqlError(f"--sql refused: {what}; only read-only queries over the capture's "
                             f"tables ({', '.join(sorted(tables))}) are allowed "
                             "(--unsafe-sql lifts this)")

    def walk_plan(node) -> None:
        kind = str(node.nodeName())
        if command.isInstance(node) or kind not in ALLOWED_NODES:
            refuse(f"{_describe(kind)} is not a query")
        if kind == "UnresolvedRelation":
            relations.append(_name(node.multipartIdentifier()))
        elif kind == "UnresolvedWith":
            for pair in _seq(node.cteRelations()):
                ctes.add(str(pair._1()).lower())
        elif kind == "UnresolvedTableValuedFunction":
            fn = ".".join(_name(node.name())).lower()
            if fn not in ALLOWED_TVFS:
                refuse(f"table function {fn}() is not allowed")
        for child in _seq(node.children()) + _seq(node.innerChildren()):
            if plan_class.isInstance(child):
                walk_plan(child)
            else:
                walk_expr(child)
        for expr in _seq(node.expressions()):
            walk_expr(expr)

    def walk_expr(expr) -> None:
        kind = str(expr.nodeName())
        if kind == "UnresolvedFunction":
            parts = _name(expr.nameParts())
            if parts and parts[-1].lower() in DENIED_FUNCTIONS:
                refuse(f"function {parts[-1].lower()}() reaches into the JVM or files")
        if subquery.isInstance(expr):
            walk_plan(expr.plan())
        for child in _seq(expr.children()):
            walk_expr(child)

    walk_plan(plan)
    for parts in relations:
        if len(parts) != 1:
            refuse(f"{'.'.join(parts)} is not one of the capture's tables")
        if parts[0].lower() not in allowed and parts[0].lower() not in ctes:
            refuse(f"unknown table {parts[0]}")
    return {parts[0].lower() for parts in relations} & allowed


def _describe(kind: str) -> str:
    words = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", kind).replace("Command", "").strip()
    return f"{words or kind} ({kind})"


# a Spark Connect message ends with its own "; line 1 pos 7;"
_CONNECT_POSITION = re.compile(r";\s*line \d+ pos \d+;?$")
_SQLSTATE = re.compile(r"\s*SQLSTATE: \w+\.?")
_CLASS_PREFIX = re.compile(r"^\[[A-Z0-9_.]+\]\s*")


def spark_error(exc: BaseException, sql: str | None = None, cls: type[SqlError] = SqlError) -> SqlError:
    """A Spark (or py4j) exception as a `cls` of one line:
    `SQL error [PARSE_SYNTAX_ERROR] Syntax error at or near 'FORM' (line 1, pos 9)`."""
    if isinstance(exc, SqlError):
        return exc
    kind = _call(exc, "getCondition") or _call(exc, "getErrorClass")
    message = _call(exc, "getMessage") or ""
    origin = getattr(exc, "java_exception", None)
    if not kind and origin is not None:
        # a Py4JJavaError straight from the parser: ask the JVM exception itself
        try:
            kind = str(origin.getCondition())
            message = str(origin.getMessage())
        except Exception:  # noqa: BLE001 - not a SparkThrowable
            message = message or str(origin.toString())
    if not message:
        message = str(exc) or type(exc).__name__
    first = message.strip().splitlines()[0] if message.strip() else type(exc).__name__
    first = _SQLSTATE.sub("", _CLASS_PREFIX.sub("", first)).strip()
    where = _position(exc, origin, message, sql)
    if where:   # ours follows, with the fragment: not Spark Connect's "; line 1 pos 7;" too
        first = _CONNECT_POSITION.sub("", first).strip()
    if where and where not in first:
        first = f"{first} {where}"
    text = f"SQL error [{kind}] {first}" if kind else f"SQL error: {first}"
    return cls(printable(text), kind)


def _call(exc, name):
    fn = getattr(exc, name, None)
    if fn is None:
        return None
    try:
        return fn()
    except Exception:  # noqa: BLE001 - no JVM behind it any more, or not a Spark error
        return None


def _position(exc, origin, message: str, sql: str | None) -> str | None:
    texts = [message, str(exc)]
    java = getattr(exc, "_origin", None) or origin
    if java is not None:
        try:
            texts.append(str(java.getMessage()))
        except Exception:  # noqa: BLE001 - the JVM is gone: no position then
            pass
    for text in texts:
        m = re.search(r"\(line \d+, pos \d+\)", text or "")
        if m:
            return m.group(0)
    for q in _call(exc, "getQueryContext") or []:
        start = _call(q, "startIndex")
        if isinstance(start, int) and start >= 0 and sql:
            line = sql.count("\n", 0, start) + 1
            pos = start - (sql.rfind("\n", 0, start) + 1)
            frag = _call(q, "fragment")
            return f"(line {line}, pos {pos}" + (f": {frag!r})" if frag else ")")
    return None
