"""`serve dcp|synapse --from CAPTURE`: play a capture back as a live server, with --pace and
fault injection (--disconnect-at, --stall-at, --corrupt-at). The options are declared
here and added to both serve commands (the servers run in serve/runner.py); the capture is read (replay/playback_source.py) before
anything listens, so an unreadable capture is one error line and exit 1, and a DCP capture
without the `raw` column (nothing to send) one line and exit 2; recorded frames shorter than
their header says are left out, counted in one warning line."""

from __future__ import annotations

import json
import sys

import click

from dcptool.cli.sources import parse_duration
from dcptool.cli.view.console import err_console
from dcptool.protocol.errors import LateUsageError
from dcptool.serve.runner import serve_dcp_recording, serve_synapse_recording

# Lazy imports: only where start-up time needs them (`serve ... --help` loads no pyarrow: a
# recording is read by replay/playback_source.py when --from is given).


def parse_pace(text: str | None) -> float | None:
    """`max` -> None (as fast as the client reads), `original` -> 1.0, FACTOR -> FACTOR."""
    if text is None or text == "max":
        return None
    if text == "original":
        return 1.0
    try:
        factor = float(text)
    except ValueError:
        factor = -1.0
    if not factor > 0 or factor != factor or factor == float("inf"):
        raise click.BadParameter(f"{text!r}: use original, max or a factor above 0 (e.g. 2)",
                                 param_hint="--pace")
    return factor


def parse_stall(text: str | None) -> tuple[int | None, float]:
    """`N[:SECONDS]` -> (N, seconds); seconds default to 5 and take units (500ms, 2s)."""
    if text is None:
        return None, 5.0
    count, _, secs = text.partition(":")
    try:
        n = int(count)
    except ValueError:
        n = -1
    if n < 0:
        raise click.BadParameter(f"{text!r}: use N or N:SECONDS (e.g. 1000:2s)", param_hint="--stall-at")
    seconds = parse_duration(secs, "--stall-at") if secs else 5.0
    return n, seconds


def playback_options(f):
    """The --from/--pace/fault options shared by `serve dcp` and `serve synapse`."""
    opts = [
        click.option("--from", "from_capture", multiple=True, metavar="CAPTURE",
                     help="Play this capture back (file or directory; repeatable) instead of a generated "
                          "stream."),
        click.option("--pace", default="max", show_default=True,
                     help="With --from: original (the recorded timing), max (as fast as the client reads) "
                          "or a speed factor (2 = twice as fast)."),
        click.option("--disconnect-at", type=click.IntRange(min=1), default=None,
                     help="With --from: drop the connection after N served stream frames / lines (once)."),
        click.option("--stall-at", default=None, metavar="N[:SECONDS]",
                     help="With --from: after N served frames / lines send no stream data for SECONDS "
                          "(default 5s), once."),
        click.option("--corrupt-at", type=click.IntRange(min=0), default=None,
                     help="With --from: after N served frames / lines send one damaged one (DCP: a frame "
                          "with a bad magic; Synapse: an RDATA line with broken JSON), once."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def check_unused(ctx: click.Context, from_capture, pace, disconnect_at, stall_at, corrupt_at) -> None:
    if from_capture:
        return
    used = [name for name, v in (("--disconnect-at", disconnect_at), ("--stall-at", stall_at),
                                 ("--corrupt-at", corrupt_at)) if v is not None]
    if pace != "max":
        used.append("--pace")
    if used:
        raise click.UsageError(f"{', '.join(used)} need(s) --from CAPTURE")


def _listening(host, port) -> None:
    sys.stdout.write(json.dumps({"listening": f"{host}:{port}"}) + "\n")
    sys.stdout.flush()


def serve_dcp_capture(paths, *, bind: str, port: int, users: dict, tls, pace: str, disconnect_at,
                      stall_at, corrupt_at, handshake_timeout: float = 10.0) -> None:
    from dcptool.replay.playback_source import NotPlayable, load_dcp

    factor = parse_pace(pace)
    stall_n, stall_s = parse_stall(stall_at)
    try:
        recording = load_dcp(list(paths))
    except NotPlayable as exc:
        raise LateUsageError(str(exc)) from None
    if recording.skipped:
        err_console().print(f"[yellow]dcptool:[/] warning: {recording.skipped:,} recorded stream frame(s) shorter "
                            "than a header or than their header says are left out of the playback",
                            highlight=False, markup=True, soft_wrap=True)
    serve_dcp_recording(recording, users, bind=bind, port=port, tls=tls, pace=factor, disconnect_at=disconnect_at,
                        stall_at=stall_n, stall_seconds=stall_s, corrupt_at=corrupt_at, on_listening=_listening,
                        handshake_timeout=handshake_timeout)


def serve_synapse_capture(paths, *, bind: str, port: int, server_name: str, ping: float, timeout: float,
                          pace: str, disconnect_at, stall_at, corrupt_at) -> None:
    from dcptool.replay.playback_source import load_synapse

    factor = parse_pace(pace)
    stall_n, stall_s = parse_stall(stall_at)
    serve_synapse_recording(load_synapse(list(paths)), bind=bind, port=port, server_name=server_name, ping=ping,
                            timeout=timeout, pace=factor, disconnect_at=disconnect_at, stall_at=stall_n,
                            stall_seconds=stall_s, corrupt_at=corrupt_at, on_listening=_listening)
