"""dcptool.cli: the click commands. Subcommands are imported only when invoked, so that
`dcptool --help` stays fast (no pyarrow, numpy or pyspark on that path)."""

from __future__ import annotations

import importlib
import os
import sys

import click

from dcptool import __version__
from dcptool.cli.exit_codes import handle
from dcptool.cli.process import guard_stdio, install_stop_signals

# name -> (module:attribute, one-line help shown by `dcptool --help` without importing it)
COMMANDS: dict[str, tuple[str, str]] = {
    "stream": ("dcptool.cli.stream:stream", "Print a live change stream, decoded."),
    "capture": ("dcptool.cli.capture:capture", "Record every frame or line into Parquet captures."),
    "replay": ("dcptool.cli.replay:replay", "Process captures deterministically (in-process or Spark)."),
    "inspect": ("dcptool.cli.inspect_cmd:inspect_cmd", "Summarise captures."),
    "decode": ("dcptool.cli.decode:decode", "Decode a raw byte stream of DCP frames."),
    "serve": ("dcptool.cli.serve:serve", "Run a built-in DCP producer or Synapse replication server."),
    "diff": ("dcptool.cli.diff:diff", "Documents added, changed and removed between two captures or moments."),
    "verify": ("dcptool.cli.verify:verify", "Check captures for continuity and protocol correctness."),
    "trace": ("dcptool.cli.trace_cmd:trace", "Explain DCP keys: every event that touched each, then a verdict."),
    "import": ("dcptool.cli.import_cmd:import_cmd", "Turn a tcpdump file (pcap, pcapng) into a capture."),
    "export": ("dcptool.cli.export_cmd:export_cmd", "Write captures as TCP packets for Wireshark (pcapng, pcap)."),
    "compact": ("dcptool.cli.compact_cmd:compact_cmd", "Merge a capture directory's small finished segments."),
    "report": ("dcptool.cli.report_cmd:report", "Draw captures as one self-contained HTML page of charts."),
    "restore": ("dcptool.cli.restore_cmd:restore_cmd", "Write captured documents back into a live bucket, metadata kept."),
    "spark": ("dcptool.cli.spark_cmd:spark", "Start, stop or query a warm Spark Connect server for replay."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        entry = COMMANDS.get(name)
        if entry is None:
            return None
        module, _, attr = entry[0].partition(":")
        try:
            return _with_verbose(getattr(importlib.import_module(module), attr))
        except ImportError as exc:  # a command whose module is missing must not break --help
            return _broken(name, exc)

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:   # an option of `dcptool` itself
            raise _one_line(exc)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:   # a command's (or a server's) options and arguments
            raise _one_line(exc)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except BaseException as exc:  # noqa: BLE001 - mapped to exit codes in one place
            if isinstance(exc, SystemExit):
                raise
            handle(ctx, exc)

    def format_commands(self, ctx, formatter):
        rows = [(name, help_) for name, (_, help_) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _one_line(exc: click.UsageError) -> click.UsageError:
    """`exc` shown as README.md promises: `dcptool: WHAT`, then `Try 'dcptool replay -h' for help.`
    (click's own is four lines: Usage, Try, blank, Error); a group without its subcommand keeps its help."""
    if not isinstance(exc, click.exceptions.NoArgsIsHelpError):
        hint = f"\nTry '{exc.ctx.command_path} -h' for help." if exc.ctx else ""
        exc.show = lambda file=None: click.echo(f"dcptool: {exc.format_message()}{hint}", err=True)  # type: ignore[method-assign]
    return exc


def _verbose_on(ctx: click.Context, param: object = None, value: bool = True) -> None:
    """`-v`: tracebacks (cli/exit_codes.py) and protocol-level logging on stderr, for the whole run."""
    root = ctx.find_root()
    if value and not root.ensure_object(dict).get("verbose"):
        root.obj["verbose"] = True
        import logging
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _with_verbose(cmd: click.Command) -> click.Command:
    """`cmd` (and a group's subcommands) taking a hidden `-v/--verbose` too: -v anywhere on the line."""
    if not any(p.name == "verbose" for p in cmd.params):
        cmd.params.append(click.Option(["-v", "--verbose"], is_flag=True, expose_value=False, hidden=True,
                                       callback=_verbose_on))
        if isinstance(cmd, click.Group):
            inner = cmd.get_command

            def get_command(ctx: click.Context, name: str) -> click.Command | None:
                sub = inner(ctx, name)
                return sub and _with_verbose(sub)
            cmd.get_command = get_command  # type: ignore[method-assign, assignment]
    return cmd


def _broken(name, exc):
    @click.command(name, help=f"(unavailable: {exc})")
    def cmd():
        raise click.ClickException(f"{name} is unavailable: {exc}")
    return cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="dcptool")
@click.option("-v", "--verbose", is_flag=True, help="Tracebacks and protocol-level logging on stderr (anywhere on the line).")
@click.pass_context
def cli(ctx, verbose):
    """Capture, stream and replay Couchbase DCP and Synapse replication streams.

    Sources: couchbase://HOST[:PORT]/BUCKET, couchbases://..., synapse://HOST:PORT,
    synapse+redis://HOST[:PORT][/DB]?server_name=NAME. Exit codes: 0 done, 1 runtime
    failure, 2 usage, 3 could not connect, 4 auth refused, 5 protocol error, 6 findings
    (diff, verify), 130 interrupted (143/129 on SIGTERM/SIGHUP).
    """
    ctx.ensure_object(dict)
    ctx.obj.setdefault("verbose", False)
    if verbose:
        _verbose_on(ctx)


def main(argv=None):
    # numpy's OpenBLAS would start a spinning thread per core; no command does linear
    # algebra, and on two cores those threads took 11% of a capture's CPU (perf)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    guard_stdio()            # a closed stdout is one error line, never a traceback (CLI.md)
    install_stop_signals()   # SIGINT / SIGTERM / SIGHUP end any command within 2 s
    return cli.main(args=argv, prog_name="dcptool")


if __name__ == "__main__":  # python -m dcptool.cli
    main()
