"""`dcptool spark start|stop|status`: the warm Spark Connect server that `replay --spark` uses
when it runs (replay/spark/connect_server.py launches and tracks it)."""

from __future__ import annotations

import json
import sys

import click

from dcptool.cli.sources import parse_duration
from dcptool.cli.view.console import err_console
from dcptool.replay.spark import connect_server


def _console():
    return err_console()


def _print_status(info: dict, as_json: bool) -> None:
    if as_json or not sys.stdout.isatty():
        sys.stdout.write(json.dumps(info, sort_keys=True) + "\n")
        sys.stdout.flush()
        return
    if not info.get("running"):
        sys.stdout.write("no Spark Connect server running\n")
        return
    stops = info.get("stops_in_s")
    sys.stdout.write(f"{info['url']}  pid {info['pid']}  {'answers' if info.get('answers') else 'NOT answering'}  "
                     f"idle {info['idle_s']:.0f}s" + (f", stops in {stops:.0f}s" if stops is not None else "")
                     + f"  log {info['log']}\n")


@click.group("spark")
def spark():
    """A warm local Spark Connect server for `replay --spark` (no JVM start per replay).

    \b
    Examples:
      dcptool spark start                    # 127.0.0.1:15002, stops after 30m without a replay
      dcptool replay captures/ --spark       # uses it (else an embedded local[*] session)
      dcptool spark status --json
      dcptool spark stop
    """


@spark.command("start")
@click.option("--port", type=click.IntRange(1, 65535), default=15002, show_default=True,
              help="The server's gRPC port.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="The address the server listens on (only loopback unless you say otherwise).")
@click.option("--idle-timeout", default="30m", show_default=True,
              help="Stop after this long without a replay using it (0: never), e.g. 90s, 2h. "
                   "On a running server, replaces its idle timeout.")
@click.option("--json", "as_json", is_flag=True, help="Print the server's status as JSON on stdout.")
def start(port, host, idle_timeout, as_json):
    """Start the server (or reuse the running one) and wait until it answers."""
    idle = parse_duration(idle_timeout, "--idle-timeout")
    console = _console()
    state = connect_server.state_dir()   # ServerError: one `dcptool:` line, exit 1 (cli/exit_codes.py)
    if host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]dcptool:[/] listening on {host}: anyone who reaches it with the token "
                      f"(in {state}) can run code as you", highlight=False)
    with console.status("starting the Spark Connect server", spinner="dots"):
        rec, started = connect_server.start(host=host, port=port, idle_timeout=idle)   # ServerError: exit 1
    console.print(f"Spark Connect server {'started' if started else 'already running'}: {rec.url} "
                  f"(pid {rec.pid}, log {rec.log})", highlight=False)
    if as_json:
        _print_status(connect_server.status(), True)


@spark.command("stop")
def stop():
    """Stop the server and its idle watchdog."""
    rec, running = connect_server.stop()
    if rec is None:
        text = "no Spark Connect server running"
    elif running:
        text = f"stopped the Spark Connect server (pid {rec.pid})"
    else:   # its pid is gone or another program's now: nothing was signalled
        text = (f"no Spark Connect server running: removed a stale record (pid {rec.pid} is not "
                f"the server it recorded)")
    _console().print(text, highlight=False)


@spark.command("status")
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout (also the default in a pipe).")
def status(as_json):
    """Whether the server runs and answers, its address, pid, log and idle time."""
    _print_status(connect_server.status(), as_json)
