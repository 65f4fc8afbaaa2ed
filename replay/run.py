"""`dcptool.replay` as a library call, as `capture()` is for capture: replay captures into
result tables without the CLI.

    from dcptool.replay import replay

    result = replay("caps/", tables=["documents"])
    print(result.tables["documents"].num_rows)

`replay()` takes the captures, the tables, the engine (None: in-process; `Spark(...)`: an
embedded session on a master, the warm server of `dcptool spark start`, or a Spark Connect
endpoint), the point in time, a SQL query (read-only unless `unsafe_sql`), an `--apply`
function, whether to checksum, and an output directory, and returns a ReplayResult (the tables,
the checksums, the files written). Behind it: the engine choice, the path where DuckDB writes
the plan tables itself (loading neither pyarrow nor numpy), the SQL fences
(replay/local/sql.py, replay/spark/sql.py) and the Spark session (replay/spark/session.py).
What it tells as it runs (a status line, the files written, notes) goes to `hooks` (Hooks:
nothing by default); `dcptool replay` (cli/replay.py) passes hooks that draw on stderr.

Errors are typed (DcptoolError): RequestError for a request that cannot run (options that do
not combine, an unknown table), ApplyLoadError / ApplyFailed for `apply`, the SQL errors of
replay/sql_common.py, CaptureError for an unreadable capture, Interrupted when a signal
stopped a query. Process-wide settings (replay/tuning.py) are the caller's choice: this call
makes none. Imports stay light here (the engines load inside the functions)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping

from dcptool.protocol.errors import DcptoolError, Interrupted, LateUsageError, one_line

__all__ = ["replay", "Spark", "Hooks", "ReplayResult", "RequestError", "ApplyLoadError", "ApplyFailed"]


class RequestError(LateUsageError):
    """A replay asked for something it cannot do: options that do not combine, an unknown table,
    an output directory that is a capture directory (exit 2)."""


class ApplyLoadError(LateUsageError):
    """The `apply` function named cannot be loaded (exit 2)."""


class ApplyFailed(DcptoolError):
    """The `apply` function raised or tried to exit: one line naming it and the group (exit 1)."""


@dataclass(frozen=True)
class Spark:
    """Run on Spark: `remote` (sc://HOST:PORT, a Spark Connect endpoint), else an embedded
    session on `master`, else (neither) the warm server of `dcptool spark start` when it
    answers, or an embedded local[*] session. `conf`: extra Spark settings."""
    master: str | None = None
    remote: str | None = None
    conf: Mapping[str, str] = field(default_factory=dict)
    verbose: bool = False


class Hooks:
    """What a replay tells as it runs; every method here says nothing."""

    def status(self, text: str) -> ContextManager[Any]:
        """A line shown while a step runs; what it yields (if not None) has update(text)."""
        return contextlib.nullcontext()

    def say(self, text: str, warning: bool = False) -> None:
        """A line about how the replay runs (which Spark, and why)."""

    def note(self, text: str) -> None:
        """A note about the capture (a retention ring deleted its oldest segments)."""

    def wrote(self, path: str, rows: int) -> None:
        """A file of the output directory was written."""


@dataclass
class ReplayResult:
    """`tables`: name -> pyarrow Table of what was computed in memory (the tables asked for;
    {"sql": ...} for a query; {"apply": ...} for a function), empty for tables that were only
    streamed to files or checksums; `checksums`: name -> (SHA-256, rows); `written`: (path,
    rows) per file; `engine`: which engine ran ("in-process", "embedded local[*] session",
    "Spark Connect sc://...", ...)."""
    tables: dict[str, Any] = field(default_factory=dict)
    checksums: dict[str, tuple[str, int]] = field(default_factory=dict)
    written: list[tuple[str, int]] = field(default_factory=list)
    engine: str = "in-process"


@dataclass
class _Request:
    paths: list[str]
    tables: tuple[str, ...]
    engine: Spark | None
    as_of: Any
    sql: str | None
    unsafe_sql: bool
    apply: Any
    checksum: bool | str
    output: str | None
    keep: bool
    hooks: Hooks


def replay(captures: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
           tables: Iterable[str] | str = (), *,
           engine: Spark | None = None, as_of: str | int | None = None,
           as_of_seqnos: Iterable[str] | Mapping[int, int] = (), sql: str | None = None,
           unsafe_sql: bool = False, apply: str | Callable[..., Any] | None = None, checksum: bool | str = False,
           output: str | os.PathLike[str] | None = None, keep: bool | None = None,
           hooks: Hooks | None = None) -> ReplayResult:
    """Replay `captures` (paths of capture files or directories) into `tables` (names, or comma
    lists, `all`; none: every table but frames).

    `as_of` (RFC 3339 text or integer nanoseconds) and `as_of_seqnos` ({vbucket: seqno} or
    "VB:SEQNO" texts): DCP tables as they were then. `sql`: one query over the tables (read-only
    unless `unsafe_sql`): its result is tables["sql"]. `apply`: a function(key, table) or
    "MODULE:FUNCTION": its result is tables["apply"]. `checksum`: the SHA-256 of each table, in
    checksums; `checksum="content"`: the content checksum (REPLAY.md, provenance columns left out). `output`: each table also written to OUTPUT/NAME.parquet. `keep`: whether the
    tables also come back in `tables` when written (None: only when there is no `output`; not
    kept, they stream to the files, never whole in memory; with `checksum` they never do)."""
    if isinstance(captures, (str, os.PathLike)):
        captures = [captures]
    req = _Request(paths=[os.fspath(c) for c in captures],
                   tables=(tables,) if isinstance(tables, str) else tuple(tables), engine=engine,
                   as_of=_as_of(as_of, as_of_seqnos), sql=sql, unsafe_sql=unsafe_sql, apply=apply,
                   checksum=checksum, output=None if output is None else os.fspath(output),
                   keep=output is None if keep is None else keep, hooks=hooks or Hooks())
    _check(req)
    with _interrupts():
        return _run(req)


def _as_of(ts: str | int | None, seqnos: Iterable[str] | Mapping[int, int]) -> Any:
    from dcptool.replay.rules.as_of import make_as_of
    if isinstance(seqnos, Mapping):
        seqnos = [f"{vb}:{seqno}" for vb, seqno in seqnos.items()]
    try:
        return make_as_of(None if ts is None else str(ts), tuple(seqnos)) or None
    except ValueError as exc:
        raise RequestError(f"--as-of / --as-of-seqno: {exc}") from None


def _check(req: _Request) -> None:
    """What the request alone tells (no capture read yet)."""
    import dcptool.replay.results as results
    if req.output and results.is_capture_dir(req.output, req.paths):   # never into a capture directory
        from dcptool.replay.store.files import shown
        raise RequestError(f"-o {shown(req.output)} is a capture directory: results never go into one "
                           "(they would be read as part of the capture); give another directory")
    spark = req.engine
    if spark is not None and spark.master and spark.remote:
        raise RequestError("choose one of --master and --remote")
    if spark is not None and spark.remote:
        from dcptool.replay.spark.session import remote_url_problem
        problem = remote_url_problem(spark.remote)
        if problem:
            raise RequestError(problem)
    if req.checksum not in (False, True, "content"):
        raise RequestError(f"checksum must be True, False or 'content', not {req.checksum!r}")
    if sum(bool(x) for x in (req.sql, req.apply, req.checksum)) > 1:
        raise RequestError("choose one of --sql, --apply, --checksum")
    if req.as_of and req.apply:
        raise RequestError("--as-of / --as-of-seqno do not combine with --apply")


def _run(req: _Request) -> ReplayResult:
    import dcptool.replay.results as results
    from dcptool.replay.store import discovery, retained
    files = discovery.find_captures(req.paths)
    if note := retained.note(req.paths):     # a retention ring deleted the oldest segments
        req.hooks.note(note)
    protocol = discovery.protocol_of(files)
    if req.as_of and protocol != "dcp":
        raise RequestError("--as-of / --as-of-seqno apply to DCP captures only")
    fn = _function(req.apply)
    try:
        names = results.table_choice(protocol, req.tables, default_all=True)
        if req.engine is None and protocol == "dcp":    # DCPTOOL_REPLAY_MEMORY must be a size
            from dcptool.replay.local.duck import doc_budget
            doc_budget()
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    if req.engine is None:
        out = ReplayResult()
        _local(req, files, names, fn, out)
        return out
    from dcptool.replay.spark import session as spark_session
    spark = req.engine
    with spark_session.opened(spark.master, spark.remote, dict(spark.conf), spark.verbose,
                              fenced_sql=bool(req.sql) and not req.unsafe_sql, hooks=req.hooks) as (session, label):
        out = ReplayResult(engine=label)
        _on_spark(req, session, files, names, fn, out)
    return out


def _function(spec: str | Callable[..., Any] | None) -> Callable[..., Any] | None:
    if spec is None or callable(spec):
        return spec
    import dcptool.replay.apply as apply
    try:
        return apply.load_function(spec)
    except Exception as exc:  # noqa: BLE001 - the user's module may raise anything on import
        raise ApplyLoadError(f"--apply {spec}: {one_line(exc)}") from exc


def _applied(run: Callable[[], Any]) -> Any:
    """The apply function's result; its failure as one line (ApplyFailed)."""
    import dcptool.replay.apply as apply
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - the user's function (or Spark quoting it) failed
        text = apply.apply_error_text(exc)
        if text is None:
            raise
        raise ApplyFailed(text) from exc


def _local(req: _Request, files: list[Any], names: list[str], fn: Callable[..., Any] | None,
           out: ReplayResult) -> None:
    import dcptool.replay.results as results
    if fn is not None:
        import dcptool.replay.apply as apply
        result = _applied(lambda: apply.apply_local(files, fn))
        return _keep(req, {"apply": result} if result is not None else {}, out)
    if not (req.sql or req.checksum or req.keep) and results.duckdb_writes(files, names, req.output):
        with req.hooks.status("replaying"):   # DuckDB writes the plan tables itself
            _wrote(req, results.write_files(files, names, req.output or ".", req.as_of), out)
        return None
    from dcptool.replay.local import engine as local
    # each table read once (written, checksummed): DuckDB's result streams through
    streamed = not req.sql and (bool(req.checksum) or not req.keep)
    with req.hooks.status("replaying"):
        rep = local.replay_local(files, tables=[] if req.sql else names, as_of=req.as_of,  # --sql: lazy
                                 stream=streamed)
    try:
        if req.sql:
            from dcptool.replay.local import sql as local_sql
            return _keep(req, {"sql": local_sql.run_query(rep, req.sql, req.unsafe_sql)}, out)
        chosen = {n: rep.stream(n) if streamed else rep.table(n) for n in names}
        return _finish(req, chosen, streamed, out)
    finally:
        rep.close()


def _on_spark(req: _Request, session: Any, files: list[Any], names: list[str], fn: Callable[..., Any] | None,
              out: ReplayResult) -> None:
    from dcptool.replay.spark import engine as spark_engine
    from dcptool.replay.spark.session import progress
    if fn is not None:
        with progress(session, "apply", req.hooks):
            result = _applied(lambda: spark_engine.apply_spark(session, files, fn))
        return _keep(req, {"apply": result} if result is not None else {}, out)
    rep = spark_engine.replay_spark(session, files, as_of=req.as_of)
    try:
        with progress(session, "replay", req.hooks):
            if req.sql:
                from dcptool.replay.spark import sql as spark_sql
                return _keep(req, {"sql": spark_sql.run_query(session, rep, req.sql, req.unsafe_sql)}, out)
            chosen = {n: rep.table(n) for n in names}
        return _finish(req, chosen, False, out)
    finally:
        rep.close()


def _finish(req: _Request, chosen: dict[str, Any], streamed: bool, out: ReplayResult) -> None:
    """The chosen tables checksummed (and written), or kept (and written)."""
    if not req.checksum:
        return _keep(req, chosen, out)
    import dcptool.replay.results as results
    with req.hooks.status("replaying") if streamed else contextlib.nullcontext():
        _wrote(req, results.write_tables(req.output, chosen, out.checksums, content=req.checksum == "content"), out)
    return None


def _keep(req: _Request, chosen: dict[str, Any], out: ReplayResult) -> None:
    """Tables computed in memory: written to the output directory when there is one, and kept."""
    if req.output:
        import dcptool.replay.results as results
        _wrote(req, results.write_tables(req.output, chosen), out)
    out.tables.update(chosen)


def _wrote(req: _Request, written: Iterable[tuple[str, int]], out: ReplayResult) -> None:
    for path, rows in written:
        out.written.append((path, rows))
        req.hooks.wrote(path, rows)


@contextlib.contextmanager
def _interrupts() -> Iterator[None]:
    """A signal during a DuckDB query (DuckDB's Python client interrupts the query when a signal
    handler raised, and raises its own error, whatever the handler raised) is Interrupted, as a
    signal anywhere else is (cli/exit_codes.py: 130 / 143 / 129)."""
    try:
        yield
    except Exception as exc:
        if "duckdb" in sys.modules:
            from dcptool.replay.local.duck import is_interrupt
            if is_interrupt(exc):
                raise Interrupted(signal.SIGINT) from exc
        raise
