"""`replay --sql` in-process: DuckDB runs the user's query over the replay's tables.

The query is checked with DuckDB's own parser before any table is computed: exactly one
statement (duckdb.extract_statements), of type SELECT, whose parsed tree
(json_serialize_sql) holds only query nodes and table references of an allow list (no
DESCRIBE / SUMMARIZE / SHOW), every table a one-part name of the replay's tables or a CTE
of the query (no 'file.csv', no schema- or catalog-qualified names, no Python variables),
every table function a generator (range, generate_series, unnest: no read_csv, read_parquet,
read_text, glob, query ...). Only the tables the query names are computed, and registered as
views of their Arrow tables on a fresh connection whose external access is off and whose
configuration is locked (no file, network, ATTACH, COPY, INSTALL/LOAD, SET) with
DCPTOOL_REPLAY_MEMORY as its memory limit (spilling to a private temporary directory).

`--unsafe-sql` lifts the parser check only (any statement DuckDB accepts, on that throwaway
connection): external access stays off and the configuration locked, so files, the network,
extensions and settings stay out of reach on this engine. The statements whose job is files or
extensions (EXPORT, IMPORT, COPY, ATTACH, DETACH, INSTALL, LOAD) are refused before anything
runs or binds (DuckDB binds EXPORT DATABASE by creating its directory), and the connections
that only parse have no file, network or extension access either: nothing is left on disk.
A stop signal during the query is Interrupted (exit 130), not DuckDB's "Query interrupted".

Errors are one line: `SQL error [Binder Error] Referenced column "x" not found ... (line 1,
pos 7)`. A query refused, or one DuckDB cannot parse or bind, is a usage error (exit 2); one
that fails while it runs is a runtime error (exit 1)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import tempfile
from typing import Any, Iterator

import pyarrow as pa

from dcptool.protocol.errors import Interrupted
from dcptool.protocol.text import printable
from dcptool.replay.local import duck
from dcptool.replay.sql_common import (
    RefusedSqlError,
    SqlError,
    SqlUsageError,
    UnsafeSqlError,
)

# table functions that only generate rows from their arguments
ALLOWED_TVFS = frozenset({"range", "generate_series", "unnest"})
# scalar functions that could read the process's surroundings
DENIED_FUNCTIONS = frozenset({"getenv", "current_setting", "getvariable", "query", "query_table"})
QUERY_NODES = frozenset({"SELECT_NODE", "SET_OPERATION_NODE", "RECURSIVE_CTE_NODE", "CTE_NODE"})
TABLE_REFS = frozenset({"BASE_TABLE", "JOIN", "SUBQUERY", "TABLE_FUNCTION", "EXPRESSION_LIST", "EMPTY",
                        "PIVOT"})
MAX_MESSAGE = 480


def run_query(rep, sql: str, unsafe: bool = False, memory: int | None = -1) -> pa.Table:
    """The result of `sql` over the tables of `rep` (replay/local/engine.py Replay), as Arrow.
    `memory`: DuckDB's memory limit in bytes (-1: doc_budget(); None: no limit)."""
    import duckdb
    tables = rep.names()
    try:
        named = tables_named(sql, tables)
    except UnsafeSqlError:
        if not unsafe:
            raise
        refuse_file_statements(sql)
        named = _tables_of(sql, tables)
    if memory == -1:
        memory = duck.doc_budget()
    tmp = tempfile.mkdtemp(prefix="dcptool-sql-")
    config: dict[str, Any] = {"temp_directory": tmp, "python_enable_replacements": False, **NO_EXTENSIONS}
    if memory:
        config["memory_limit"] = f"{max(int(memory), duck.MIN_MEMORY) >> 20}MiB"
    con = duckdb.connect(":memory:", config=config)
    try:
        con.execute("SET enable_progress_bar = false")
        for name in named:
            con.register(name, rep.table(name))
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        with _errors(SqlUsageError):
            rel = con.sql(sql)
        if rel is None:      # --unsafe-sql: a statement with no result
            return pa.table({})
        with _errors(SqlError):
            return (getattr(rel, "to_arrow_table", None) or rel.arrow)()
    finally:
        con.close()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _errors(cls: type[SqlError]) -> Iterator[None]:
    """DuckDB's errors as ours: a stop signal during the query is Interrupted (cli/exit_codes.py:
    130), out of memory ReplayMemoryError, any other a `cls` of one line."""
    import duckdb
    try:
        yield
    except Exception as exc:
        if duck.is_interrupt(exc):
            raise Interrupted(signal.SIGINT) from exc
        if isinstance(exc, duckdb.OutOfMemoryException):
            raise duck.ReplayMemoryError(f"replay --sql: out of memory ({duck_error(exc).args[0]}); "
                                         "raise DCPTOOL_REPLAY_MEMORY (or 0: no limit)") from None
        if isinstance(exc, duckdb.Error):
            raise duck_error(exc, cls) from None
        raise


# statements whose job is the file system or extensions: refused before they run, also with
# --unsafe-sql (DuckDB binds EXPORT DATABASE by creating its directory, before any check)
FILE_STATEMENTS = frozenset({"EXPORT", "COPY", "COPY_DATABASE", "ATTACH", "DETACH", "LOAD", "EXTENSION"})
# PRAGMA statements of that kind (DuckDB parses IMPORT DATABASE and COPY FROM DATABASE as PRAGMA)
FILE_PRAGMAS = frozenset({"IMPORT", "COPY"})
# every connection of ours: no extension installed or loaded behind the query's back (DuckDB
# would download one from the network to bind, say, CREATE SECRET)
NO_EXTENSIONS = {"autoinstall_known_extensions": False, "autoload_known_extensions": False}


def refuse_file_statements(sql: str) -> None:
    """RefusedSqlError when a statement of `sql` reads or writes files or extensions (EXPORT,
    IMPORT, COPY, ATTACH, DETACH, INSTALL, LOAD, UPDATE EXTENSIONS), or is of a kind DuckDB's
    Python client cannot name: what --unsafe-sql still refuses, before anything runs."""
    import duckdb
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise duck_error(exc, SqlUsageError) from None
    for statement in statements:
        kind = _file_kind(statement)
        if kind:
            raise RefusedSqlError(f"SQL error [Permission Error] {kind} is refused before it runs: DuckDB "
                                  "in-process has no file system, network or extension access, "
                                  "--unsafe-sql included")


def _kind(statement: Any) -> str:
    """The statement's type name; UNNAMED for a type this Python client has no name for
    (UPDATE EXTENSIONS: its `type` raises ValueError)."""
    try:
        return str(statement.type.name)
    except ValueError:
        return "UNNAMED"


def _file_kind(statement: Any) -> str | None:
    kind = _kind(statement)
    if kind == "UNNAMED":
        return "a statement of a kind this DuckDB cannot name"
    if kind in FILE_STATEMENTS:
        return kind
    if kind == "PRAGMA":
        words = _COMMENTS.sub(" ", statement.query).split()
        if words and words[0].upper() in FILE_PRAGMAS:
            return words[0].upper()
    return None


_COMMENTS = re.compile(r"/\*.*?\*/|--[^\n]*", re.S)


def _fenced() -> Any:
    """A connection that only parses: no file, network or extension access, locked."""
    import duckdb
    return duckdb.connect(":memory:", config={"enable_external_access": False, "lock_configuration": True,
                                              **NO_EXTENSIONS})


def tables_named(sql: str, tables) -> list[str]:
    """The replay tables `sql` reads; UnsafeSqlError unless it is one read-only SELECT over
    `tables`, SqlUsageError when DuckDB cannot parse it."""
    import duckdb
    allowed = {t.lower(): t for t in tables}

    def refuse(what: str):
        raise RefusedSqlError(f"--sql refused: {what}; only read-only queries over the capture's "
                              f"tables ({', '.join(sorted(tables))}) are allowed (--unsafe-sql lifts this "
                              "check, never the file and network fence)")

    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise duck_error(exc, SqlUsageError) from None
    if len(statements) != 1:
        refuse(f"{len(statements)} statements, not one query")
    kind = _kind(statements[0])
    if kind != "SELECT":
        refuse(f"{'a statement of a kind this DuckDB cannot name' if kind == 'UNNAMED' else kind} is not a query")
    con = _fenced()
    try:
        tree = json.loads(con.execute("SELECT json_serialize_sql(?)", [sql]).fetchall()[0][0])
    finally:
        con.close()
    if tree.get("error"):
        refuse(f"{tree.get('error_message', 'a statement')} (not a query)")
    refs: list[list[str]] = []
    ctes: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        kind = node.get("type")
        if "class" in node:          # an expression
            name = str(node.get("function_name", "")).lower()
            if node.get("class") == "FUNCTION" and (name in DENIED_FUNCTIONS or name.startswith("read_")):
                refuse(f"function {name}() reads outside the capture")
        elif isinstance(kind, str) and kind.endswith("_NODE") and kind not in QUERY_NODES:
            refuse(f"{kind} is not a query")
        elif "sample" in node and "alias" in node:   # a table reference
            if kind not in TABLE_REFS:
                refuse(f"{'DESCRIBE / SUMMARIZE / SHOW' if kind == 'SHOW_REF' else kind} is not a query")
            if kind == "BASE_TABLE":
                refs.append([str(p) for p in node.get("qualified_name", {}).get("path", [node["table_name"]])])
            elif kind == "TABLE_FUNCTION":
                fn = str((node.get("function") or {}).get("function_name", "")).lower()
                if fn not in ALLOWED_TVFS:
                    refuse(f"table function {fn}() is not allowed")
        for entry in (node.get("cte_map") or {}).get("map", []):
            ctes.add(str(entry.get("key", "")).lower())
        for value in node.values():
            walk(value)

    walk(tree.get("statements", []))
    named = []
    for parts in refs:
        if len(parts) != 1:
            refuse(f"{'.'.join(parts)} is not one of the capture's tables")
        low = parts[0].lower()
        if low in allowed:
            named.append(allowed[low])
        elif low not in ctes:
            refuse(f"unknown table {parts[0]}")
    return sorted(set(named))


def _tables_of(sql: str, tables) -> list[str]:
    """--unsafe-sql: the tables DuckDB's parser finds in `sql` (every table when it cannot tell,
    e.g. for several statements)."""
    import duckdb
    con = _fenced()     # binding EXPORT DATABASE creates its directory unless access is off
    try:
        found = {n.lower() for n in con.get_table_names(sql)}
    except duckdb.Error:
        return list(tables)
    finally:
        con.close()
    return [t for t in tables if t.lower() in found]


_LINE = re.compile(r"^LINE (\d+): ")


def duck_error(exc: BaseException, cls: type = SqlError) -> SqlError:
    """A DuckDB error as one line: `SQL error [Parser Error] syntax error at or near "=" (line
    1, pos 39)` (the position from DuckDB's caret, when it shows one)."""
    text = str(exc).strip()
    lines = text.splitlines() or [type(exc).__name__]
    kind, sep, message = lines[0].partition(": ")
    if not sep or not kind.endswith("Error"):
        kind, message = type(exc).__name__, lines[0]
    where = ""
    for i, line in enumerate(lines):
        m = _LINE.match(line)
        if m and i + 1 < len(lines) and "^" in lines[i + 1] and "..." not in line:
            where = f" (line {m.group(1)}, pos {lines[i + 1].index('^') - m.end()})"
            break
    message = printable(message.strip())
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + "..."
    return cls(f"SQL error [{kind}] {message}{where}", error_class=kind)
