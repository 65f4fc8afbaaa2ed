"""`dcptool replay CAPTURE...`: the deterministic offline processing of REPLAY.md, in-process
(default) or on Spark (`--spark`). Options are parsed here; the replay itself is the library
call of replay/run.py. Tables and checksums go to stdout; progress and Spark's own chatter go
to stderr (Spark's only with -v)."""

from __future__ import annotations

import sys
from typing import Any

import click

from dcptool.cli.sources import capture_paths, output_dir_option
from dcptool.replay.rules.table_types import tables_help
from dcptool.replay.run import Hooks, RequestError, Spark
from dcptool.replay.run import replay as run_replay
from dcptool.replay.tuning import tune_for_replay


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
@click.option("--checksum", flag_value="full", default=None, help="Print SHA-256 of each chosen table in canonical form.")
@click.option("--content-checksum", "checksum", flag_value="content", help="Print SHA-256 of each chosen table's "
              "content: capture_id, frame_no, ts ... left out; two captures of the same data agree.")
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
    {tables}

    \b
    Examples:
      dcptool replay captures/ --table documents --format jsonl | jq .key
      dcptool replay captures/ --checksum
      dcptool replay captures/ --content-checksum          # compare two captures
      dcptool replay captures/ --spark --checksum          # same checksums
      dcptool spark start; dcptool replay captures/ --spark # on the warm server
      dcptool replay captures/ --remote sc://10.0.0.5:15002 --checksum
      dcptool replay captures/ --sql "SELECT vbucket, count(*) FROM documents GROUP BY 1"
      dcptool replay captures/ -o results/
      ls captures/*.parquet | dcptool replay -
      dcptool replay captures/ --as-of 2026-01-02T03:04:05Z --table documents
    """
    out_dir = output or output_alias
    source = ctx.get_parameter_source("master")
    master_given = source is not None and source.name != "DEFAULT"
    conf = {}
    for item in spark_conf:
        k, sep, v = item.partition("=")
        if not sep:
            raise click.UsageError(f"--conf wants KEY=VALUE, got {item!r}")
        conf[k] = v
    engine = None
    if use_spark or master_given or remote:
        verbose = bool((ctx.find_root().obj or {}).get("verbose"))
        engine = Spark(master=master if master_given else None, remote=remote, conf=conf, verbose=verbose)
    tune_for_replay(in_process=engine is None and not apply_spec)
    from dcptool.cli.view.console import err_console, status_console
    shown = _Shown(err_console() if engine is not None else status_console())   # rich only when it draws
    try:
        result = run_replay(capture_paths(captures), tables, engine=engine, as_of=as_of_ts,
                            as_of_seqnos=as_of_seqnos, sql=sql, unsafe_sql=unsafe_sql, apply=apply_spec,
                            checksum={"full": True, "content": "content"}.get(checksum, False), output=out_dir, keep=fmt is not None or not out_dir,
                            hooks=shown)
    except RequestError as exc:   # what the options ask for cannot run: the usage text
        raise click.UsageError(str(exc)) from None
    if checksum:
        from dcptool.replay import results
        sys.stdout.writelines(results.checksum_lines(result.checksums, fmt))
        sys.stdout.flush()
    elif fmt is not None or not out_dir:
        _print_tables(result.tables, fmt)
    if engine is not None:   # after the output, and only on success: an error stays one line
        shown.console.print(f"spark: {result.engine}", highlight=False, style="dim")


replay.help = (replay.help or "").replace("{tables}", tables_help("    "))


class _Shown(Hooks):
    """What the replay tells, on stderr: a spinner line on a terminal, plain lines elsewhere."""

    def __init__(self, console: Any) -> None:
        self.console = console

    def status(self, text: str) -> Any:
        return self.console.status(text, spinner="dots")

    def say(self, text: str, warning: bool = False) -> None:
        self.console.print(f"[yellow]dcptool:[/] {text}" if warning else f"dcptool: {text}", highlight=False)

    def note(self, text: str) -> None:
        click.echo(f"dcptool: note: {text}", err=True)

    def wrote(self, path: str, rows: int) -> None:
        self.console.print(f"wrote {path} ({rows} rows)", highlight=False)


def _print_tables(chosen: dict[str, Any], fmt: str | None) -> None:
    from dcptool.cli.view.output import Sink, default_format
    from dcptool.replay import results
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
