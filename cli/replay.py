"""`dcptool replay CAPTURE...`: the deterministic offline processing of REPLAY.md, in-process
(default) or on Spark (`--spark`). Tables and checksums go to stdout; progress and Spark's
own chatter go to stderr (Spark's only with -v)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import click

from dcptool.capture.process import tune_for_replay
from dcptool.cli.sources import capture_paths, output_dir_option
from dcptool.protocol.errors import one_line
from dcptool.replay import results


@contextlib.contextmanager
def _spark_progress(session, label: str):
    """A status line on stderr with Spark's stage progress while a job runs (a Connect
    session has no status tracker in this process: the line says `working`)."""
    from dcptool.cli.view.console import err_console
    from dcptool.replay.spark import engine as spark_engine
    console = err_console()
    if spark_engine.is_connect(session):
        with console.status(f"{label}: working", spinner="dots"):
            yield
        return
    stop = threading.Event()
    with console.status(f"{label}: starting", spinner="dots") as status:
        def poll():
            tracker = session.sparkContext.statusTracker()
            while not stop.wait(0.5):
                try:
                    done = total = 0
                    for sid in tracker.getActiveStageIds():
                        info = tracker.getStageInfo(sid)
                        if info is not None:
                            done += info.numCompletedTasks
                            total += info.numTasks
                    status.update(f"{label}: {done}/{total} tasks" if total else f"{label}: working")
                except Exception:  # noqa: BLE001 - progress must never break the replay
                    pass
        t = threading.Thread(target=poll, daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join(timeout=2)


@click.command("replay")
@click.argument("captures", nargs=-1, required=True)
@click.option("--spark", "use_spark", is_flag=True, help="Run on a Spark session instead of in-process.")
@click.option("--master", default="local[*]", show_default=True,
              help="Spark master URL (local[N], spark://HOST:PORT, yarn, k8s://...). Implies --spark.")
@click.option("--remote", metavar="sc://HOST:PORT",
              help="Run on this Spark Connect endpoint (any server or cluster; token from "
                   "SPARK_CONNECT_AUTHENTICATE_TOKEN). Implies --spark.")
@click.option("--conf", "spark_conf", multiple=True, metavar="KEY=VALUE", help="Extra Spark setting (repeatable).")
@output_dir_option("Write each chosen table to DIR/NAME.parquet (created).")
@click.option("--format", "fmt", type=click.Choice(["table", "jsonl"]), default=None,
              help="How tables print: table on a TTY, jsonl in a pipe (default).")
@click.option("--table", "tables", multiple=True, metavar="NAME",
              help="Tables to print or write (repeatable or comma list; `all` adds frames). Default: every table but frames.")
@click.option("--sql", help="A read-only SQL query over the tables as views (DuckDB in-process; Spark SQL with --spark).")
@click.option("--unsafe-sql", is_flag=True,
              help="Let --sql run any statement the engine accepts (Spark: files, JDBC, reflect, writes, SET ...; "
                   "DuckDB: still no files, network, extensions or settings).")
@click.option("--apply", "apply_spec", metavar="MODULE:FUNCTION",
              help="Run function(key, table) per vbucket / (stream, instance) over its in frames. "
                   "MODULE is found in the working directory or on the Python path, or is a file: ./fn.py:name.")
@click.option("--checksum", is_flag=True, help="Print SHA-256 of each chosen table in canonical form.")
@click.option("--as-of", "as_of_ts", metavar="TIMESTAMP",
              help="DCP: the tables as they were at this moment (RFC 3339 or integer nanoseconds): "
                   "only frames received at or before it count.")
@click.option("--as-of-seqno", "as_of_seqnos", multiple=True, metavar="VB:SEQNO",
              help="DCP: for vbucket VB only changes up to SEQNO count (repeatable).")
@click.pass_context
def replay(ctx, captures, use_spark, master, remote, spark_conf, output, output_alias, fmt, tables, sql, unsafe_sql,
           apply_spec, checksum, as_of_ts, as_of_seqnos):
    """Replay captures (files, directories, or - for paths on stdin) into result tables.

    \b
    DCP tables: documents vbuckets snapshots rollbacks failover undone frames
    Synapse tables: positions rows gaps commands frames

    \b
    Examples:
      dcptool replay captures/ --table documents --format jsonl | jq .key
      dcptool replay captures/ --checksum
      dcptool replay captures/ --spark --checksum          # same checksums
      dcptool spark start; dcptool replay captures/ --spark # on the warm server
      dcptool replay captures/ --remote sc://10.0.0.5:15002 --checksum
      dcptool replay captures/ --sql "SELECT vbucket, count(*) FROM documents GROUP BY 1"
      dcptool replay captures/ -o results/
      ls captures/*.parquet | dcptool replay -
      dcptool replay captures/ --as-of 2026-01-02T03:04:05Z --table documents
    """
    out_dir = output or output_alias
    if out_dir and results.is_capture_dir(out_dir, captures):   # -o never writes into a capture directory
        from dcptool.replay.store.files import shown
        raise click.UsageError(f"-o {shown(out_dir)} is a capture directory: results never go into one "
                               "(they would be read as part of the capture); give another directory")
    verbose = bool((ctx.find_root().obj or {}).get("verbose"))
    source = ctx.get_parameter_source("master")
    master_given = source is not None and source.name != "DEFAULT"
    if master_given and remote:
        raise click.UsageError("choose one of --master and --remote")
    if master_given or remote:
        use_spark = True
    if remote:
        _check_remote_url(remote)
    tune_for_replay(in_process=not (use_spark or apply_spec))
    from dcptool.cli.view.console import err_console, status_console
    from dcptool.replay.store import discovery, retained

    if sum(bool(x) for x in (sql, apply_spec, checksum)) > 1:
        raise click.UsageError("choose one of --sql, --apply, --checksum")
    from dcptool.replay.rules.as_of import make_as_of
    try:
        as_of = make_as_of(as_of_ts, as_of_seqnos)
    except ValueError as exc:
        raise click.UsageError(f"--as-of / --as-of-seqno: {exc}") from None
    if as_of and apply_spec:
        raise click.UsageError("--as-of / --as-of-seqno do not combine with --apply")
    conf = {}
    for item in spark_conf:
        k, sep, v = item.partition("=")
        if not sep:
            raise click.UsageError(f"--conf wants KEY=VALUE, got {item!r}")
        conf[k] = v
    files = discovery.find_captures(paths := capture_paths(captures))
    if note := retained.note(paths):     # a retention ring deleted the oldest segments
        click.echo(f"dcptool: note: {note}", err=True)
    protocol = discovery.protocol_of(files)
    if as_of and protocol != "dcp":
        raise click.UsageError("--as-of / --as-of-seqno apply to DCP captures only")
    fn = None
    if apply_spec:
        from dcptool.replay import apply
        try:
            fn = apply.load_function(apply_spec)
        except Exception as exc:  # noqa: BLE001 - the user's module may raise anything on import
            _usage_line(ctx, f"--apply {apply_spec}: {one_line(exc)}", exc, verbose)
    try:
        names = results.table_choice(protocol, tables, default_all=True)
        if not use_spark and protocol == "dcp":    # DCPTOOL_REPLAY_MEMORY must be a size
            from dcptool.replay.local.duck import doc_budget
            doc_budget()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    console = err_console() if use_spark else status_console()   # rich only when it draws something

    session = None
    keep_alive = contextlib.nullcontext()
    if use_spark:
        import warnings
        if not verbose:
            warnings.filterwarnings("ignore", module="pyspark")
            warnings.filterwarnings("ignore", category=FutureWarning)
        session, keep_alive, label = _open_session(ctx, console, master, master_given, remote, conf, verbose,
                                                   fenced_sql=bool(sql) and not unsafe_sql)
    with keep_alive:
        _run(ctx, session, files, names, fn, sql, unsafe_sql, checksum, as_of, fmt, out_dir, console, verbose)
    if session is not None:   # after the output, and only on success: an error stays one line
        console.print(f"spark: {label}", highlight=False, style="dim")


def _run(ctx, session, files, names, fn, sql, unsafe_sql, checksum, as_of, fmt, out_dir, console, verbose):
    if session is not None:
        from dcptool.replay.spark import engine as spark_engine
    # in-process, each table read once (written, checksummed): DuckDB's result streams through
    streamed = session is None and not sql and bool(checksum or (out_dir and fmt is None))
    try:
        if fn is not None:
            from dcptool.replay import apply
            try:
                if session is not None:
                    with _spark_progress(session, "apply"):
                        result = spark_engine.apply_spark(session, files, fn)
                else:
                    result = apply.apply_local(files, fn)
            except Exception as exc:  # noqa: BLE001 - the user's function (or Spark quoting it) failed
                text = apply.apply_error_text(exc)
                if text is None:
                    raise
                _usage_line(ctx, text, exc, verbose, code=1)
            _emit(ctx, {"apply": result} if result is not None else {}, fmt, out_dir)
            return
        if session is None and not (sql or checksum or fmt) and results.duckdb_writes(files, names, out_dir):
            with console.status("replaying", spinner="dots"):   # DuckDB writes the plan tables itself
                return _write(results.write_files(files, names, out_dir, as_of or None), console)
        if session is not None:
            rep = spark_engine.replay_spark(session, files, as_of=as_of or None)
        else:
            from dcptool.replay.local import engine as local
            with console.status("replaying", spinner="dots"):
                rep = local.replay_local(files, tables=[] if sql else names, as_of=as_of or None,  # --sql: lazy
                                         stream=streamed)
        progress = _spark_progress(session, "replay") if session is not None else contextlib.nullcontext()
        with progress:
            if sql:
                result = _run_sql(ctx, session, rep, sql, unsafe_sql, verbose)
                _emit(ctx, {"sql": result}, fmt, out_dir)
                return
            chosen = {n: rep.stream(n) if streamed else rep.table(n) for n in names}
        if checksum:
            with console.status("replaying", spinner="dots") if streamed else contextlib.nullcontext():
                _write(results.write_tables(out_dir, chosen, sums := {}), console)
            sys.stdout.writelines(results.checksum_lines(sums, fmt))
            return sys.stdout.flush()
        _emit(ctx, chosen, fmt, out_dir)
    finally:
        with contextlib.suppress(Exception):
            rep.close()  # noqa: F821 - bound when the replay ran
        if session is not None:
            spark_engine.stop_session(session)


def _check_remote_url(url: str) -> None:
    """sc://HOST[:PORT][/;param=value...], without a token: a credential never goes on the
    command line (pyspark reads SPARK_CONNECT_AUTHENTICATE_TOKEN)."""
    from urllib.parse import urlparse
    parsed = urlparse(url)
    if parsed.scheme != "sc" or not parsed.hostname:
        raise click.UsageError(f"--remote wants sc://HOST:PORT, got {url!r}")
    if "token=" in url.lower():
        raise click.UsageError("--remote: a token does not go on the command line; "
                               "set SPARK_CONNECT_AUTHENTICATE_TOKEN instead")
    try:
        parsed.port
    except ValueError:
        raise click.UsageError(f"--remote: bad port in {url!r}") from None


def _open_session(ctx, console, master, master_given, remote, conf, verbose, fenced_sql):
    """The Spark session of this replay and a context that keeps a warm server marked as
    used while it runs: --remote's endpoint (unreachable: exit 3); else with --spark alone
    the warm server of `dcptool spark start` when it answers (else the embedded session,
    with a warning when one is recorded); else an embedded session on `master`. The label
    says which (printed after a successful run)."""
    import socket
    from urllib.parse import urlparse

    from dcptool.cli.errors import EXIT_CONNECT, EXIT_USAGE
    from dcptool.replay.spark import connect_server
    from dcptool.replay.spark import engine as spark_engine
    keep_alive = contextlib.nullcontext()
    url = token = None
    if remote:
        parsed = urlparse(remote)
        port = parsed.port or connect_server.DEFAULT_PORT
        deadline = time.monotonic() + REMOTE_WAIT
        try:
            socket.create_connection((parsed.hostname, port), timeout=REMOTE_WAIT).close()
        except OSError as exc:
            _usage_line(ctx, f"--remote {remote}: cannot reach the Spark Connect server "
                             f"({exc.strerror or exc})", exc, verbose, code=EXIT_CONNECT)
        if not spark_engine.connect_answers(remote, deadline):
            _usage_line(ctx, f"--remote {remote}: no Spark Connect (gRPC) server answers there within "
                             f"{REMOTE_WAIT:.0f}s (the port accepts connections: another kind of server?)",
                        code=EXIT_CONNECT)
        url, label = remote, f"Spark Connect {remote}"
    elif not master_given:
        rec, warning = connect_server.warm()
        if warning:
            console.print(f"[yellow]dcptool:[/] {warning}; using an embedded local[*] session",
                          highlight=False)
        elif rec is not None and fenced_sql:
            console.print("dcptool: --sql's read-only check needs Spark's parser in this process: "
                          "an embedded local[*] session, not the warm server (--unsafe-sql uses it)",
                          highlight=False)
        elif rec is not None:
            url, token, label = rec.url, rec.token, f"warm Spark Connect server {rec.url} (pid {rec.pid})"
            keep_alive = connect_server.keep_alive(rec)
    if url is None:
        label = f"embedded {master} session"
        with console.status(f"starting Spark ({master})", spinner="dots"):
            session = spark_engine.make_session(master, app_name="dcptool-replay", conf=conf, verbose=verbose)
    else:
        if fenced_sql:
            _usage_line(ctx, "--sql over --remote cannot be checked read-only (the check needs Spark's "
                             "parser in this process); add --unsafe-sql to run it as is", code=EXIT_USAGE)
        if token:
            connect_server.touch()   # before the session: the watchdog must not stop it now
        try:
            session = spark_engine.connect_session(url, token, verbose=verbose)
        except Exception as exc:  # noqa: BLE001 - gRPC and Spark errors come as many classes
            _usage_line(ctx, f"cannot use the Spark Connect server at {url}: {one_line(exc)}", exc, verbose,
                        code=EXIT_CONNECT)
        for k, v in conf.items():
            try:
                session.conf.set(k, v)
            except Exception as exc:  # noqa: BLE001 - static settings cannot change on a running server
                spark_engine.stop_session(session)
                _usage_line(ctx, f"--conf {k}: {one_line(exc)}", exc, verbose)
    return session, keep_alive, label


REMOTE_WAIT = 10.0   # seconds --remote may take to accept a connection and answer as gRPC (CLI.md)


def _usage_line(ctx, message: str, exc: BaseException | None = None, verbose: bool = False,
                code: int = 2):
    """One error line on stderr and the exit code (2: usage), the traceback under -v."""
    from dcptool.cli.errors import error_line
    if verbose and exc is not None:
        import traceback
        traceback.print_exception(exc)
    error_line(message)
    ctx.exit(code)


def _run_sql(ctx, session, rep, sql, unsafe, verbose):
    """--sql: the fence of replay/spark/sql.py (unless --unsafe-sql), then the query over the
    tables it reads. Refused, unparsable or unanalysable: exit 2; failing as it runs: exit 1."""
    if session is None:   # in-process: DuckDB, its own check and one-line errors (exit 2 / 1)
        from dcptool.replay.local import sql as local_sql
        return local_sql.run_query(rep, sql, unsafe)
    from dcptool.replay.spark import sql as sql_guard
    try:
        used = None if unsafe else sql_guard.check_query(session, sql, rep.names())
    except Exception as exc:  # noqa: BLE001 - Spark's errors come as many classes
        _usage_line(ctx, str(sql_guard.spark_error(exc, sql)), exc, verbose)
    rep.register_views(used)   # only the tables the query reads are planned (all: --unsafe-sql)
    try:
        df = session.sql(sql)
    except Exception as exc:  # noqa: BLE001 - Spark's errors come as many classes
        _usage_line(ctx, str(sql_guard.spark_error(exc, sql)), exc, verbose)
    try:
        return df.toArrow()
    except Exception as exc:  # noqa: BLE001
        _usage_line(ctx, str(sql_guard.spark_error(exc, sql)), exc, verbose, code=1)


def _write(written, console):
    for path, n in written:
        console.print(f"wrote {path} ({n} rows)", highlight=False)


def _print_tables(chosen, fmt):
    from dcptool.cli.view.output import Sink, default_format
    fmt = default_format(fmt)
    several = len(chosen) > 1
    for name, table in chosen.items():
        if fmt == "jsonl":
            sink = Sink("jsonl")
            for rows in results.table_rows(table):
                sink.write_many(({"table": name, **r} for r in rows) if several else rows)
        else:
            sink = Sink("table", columns=results.display_columns(table), title=f"{name} ({table.num_rows} rows)")
            for rows in results.table_rows(table):
                sink.write_many(rows)
            if table.num_rows == 0:
                from dcptool.cli.view.console import err_console
                err_console().print(f"{name}: no rows", highlight=False)
        sink.close()


def _emit(ctx, chosen, fmt, out_dir):
    from dcptool.cli.view.console import status_console
    if out_dir:
        _write(results.write_tables(out_dir, chosen), status_console())
        if fmt is None:
            return
    _print_tables(chosen, fmt)
