"""`dcptool serve synapse`: a Synapse replication server speaking the TCP line protocol,
serving a generated (or recorded) stream, for demos and for testing consumers."""

from __future__ import annotations

import sys
import time

import click

from dcptool.cli.servers.serve_from import (
    check_unused,
    playback_options,
    serve_synapse_capture,
)
from dcptool.cli.sources import parse_duration
from dcptool.serve.runner import run_server, server_stop_event

# Lazy imports: only where start-up time needs them (`serve synapse --help` loads no numpy:
# the server and its transport load when it starts).


@click.command("synapse")
@click.option("--bind", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=0, show_default=True, type=click.IntRange(0, 65535),
              help="Port (0 picks a free one).")
@click.option("--server-name", default="localhost", show_default=True,
              help="Name announced with SERVER.")
@click.option("--items", default=1000, show_default=True, type=click.IntRange(min=0),
              help="RDATA lines to generate (0: endless).")
@click.option("--seed", default=1, show_default=True, type=int, help="Seed of the generated stream.")
@click.option("--from-file", "from_file", type=click.Path(exists=True, dir_okay=False),
              help="Serve the RDATA/LOCK_RELEASED lines of a recording (vectors' TSV, a TCP "
                   "session transcript, or plain lines) instead of a generated stream.")
@click.option("--rate", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="RDATA lines per second per connection (0: as fast as the client reads).")
@click.option("--ping-interval", default="5s", show_default=True, help="PING when idle this long.")
@click.option("--timeout", default="25s", show_default=True,
              help="Close a client silent this long (after its first PING).")
@click.option("--drop-after", type=click.IntRange(min=1), default=None,
              help="Scenario: close each connection after N RDATA lines.")
@click.option("--skip-on-reconnect", type=click.IntRange(min=0), default=0,
              help="Scenario: drop N lines of the stream between connections (a gap).")
@click.option("--silent-after", type=click.IntRange(min=0), default=None,
              help="Scenario: after N RDATA lines send nothing more, not even PING.")
@click.option("--error-after", type=click.IntRange(min=0), default=None,
              help="Scenario: after N RDATA lines send ERROR and close.")
@click.option("--long-line-after", type=click.IntRange(min=0), default=None,
              help="Scenario: after N RDATA lines send a line over the 16384-byte cap.")
@click.option("--http-port", type=click.IntRange(0, 65535), default=None,
              help="Also answer Synapse's catch-up endpoint (get_repl_stream_updates) on this port "
                   "(0 picks one); secret from DCPTOOL_REPLICATION_SECRET if set.")
@click.option("--redis", "redis_url", metavar="redis://HOST:PORT[/DB]",
              help="Publish on this Redis as Synapse does (channel --server-name) instead of "
                   "listening for TCP clients.")
@playback_options
def serve_synapse(bind, port, server_name, items, seed, from_file, rate, ping_interval, timeout,
                  drop_after, skip_on_reconnect, silent_after, error_after, long_line_after, http_port,
                  redis_url, from_capture, pace, disconnect_at, stall_at, corrupt_at):
    """Serve Synapse's TCP replication protocol on BIND:PORT.

    On connect it sends SERVER and PING; on REPLICATE a POSITION for every stream, then
    the RDATA lines (with `batch` runs) of the stream; PING every --ping-interval; ERROR on
    lines it cannot accept. The stream's tokens are shared by all connections. The first
    stdout line is {"listening": "HOST:PORT"}.

    \b
    Example:
      dcptool serve synapse --items 100000 &
      dcptool stream synapse://127.0.0.1:PORT --max-messages 10
    """
    from dcptool.protocol.synapse.server import (
        Feed,
        ServerConnection,
        generated_lines,
        recorded_lines,
    )
    from dcptool.protocol.transport.synapse_tcp_redis import serve_tcp

    check_unused(click.get_current_context(), from_capture, pace, disconnect_at, stall_at, corrupt_at)
    if from_capture:   # play a capture back (cli/servers/serve_from.py)
        serve_synapse_capture(from_capture, bind=bind, port=port, server_name=server_name,
                              ping=parse_duration(ping_interval, "--ping-interval"),
                              timeout=parse_duration(timeout, "--timeout"), pace=pace,
                              disconnect_at=disconnect_at, stall_at=stall_at, corrupt_at=corrupt_at)
        return
    if from_file:
        with open(from_file, encoding="utf-8") as fh:
            feed = Feed(recorded_lines(fh.read()), keep_history=http_port is not None)
    else:
        feed = Feed(generated_lines(seed, items or None, server_name=server_name),
                    keep_history=http_port is not None)   # rows kept only to answer catch-up
    ping = parse_duration(ping_interval, "--ping-interval")
    tmo = parse_duration(timeout, "--timeout")

    def make_connection():
        return ServerConnection(server_name, feed, ping_interval=ping, timeout=tmo,
                                wall_ms=lambda: time.time_ns() // 1_000_000)

    http = {}

    def on_listening(host, p):
        extra = ', "http": "%s:%d"' % http["at"] if "at" in http else ""
        sys.stdout.write('{"listening": "%s:%d"%s}\n' % (host, p, extra))
        sys.stdout.flush()

    if redis_url:
        from dcptool.protocol.transport.synapse_redis_serve import check_url
        tcp_only = {"--drop-after": drop_after, "--skip-on-reconnect": skip_on_reconnect, "--from": from_capture,
                    "--silent-after": silent_after, "--error-after": error_after, "--long-line-after": long_line_after}
        try:
            check_url(redis_url, [name for name, v in tcp_only.items() if v])
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None

    async def main():
        from dcptool.protocol.transport.served import Served
        stop = server_stop_event()
        served, srv = Served(), None
        if http_port is not None:      # the catch-up endpoint of a writer (docs/SERVE.md)
            import os

            from dcptool.protocol.synapse.server import catch_up_answer
            from dcptool.protocol.transport.synapse_http import serve_http
            secret = os.environ.get("DCPTOOL_REPLICATION_SECRET") or None
            srv = await serve_http(bind, http_port, lambda target, auth: catch_up_answer(feed, target, auth, secret),
                                   served)
            http["at"] = srv.sockets[0].getsockname()[:2]
        try:
            await serve(stop)
        finally:
            if srv is not None:
                srv.close()
            await served.end(1.0)

    async def serve(stop):
        if redis_url:
            from dcptool.protocol.transport.synapse_redis_serve import publish

            def ready():
                extra = ', "http": "%s:%d"' % http["at"] if "at" in http else ""
                sys.stdout.write('{"publishing": "%s", "channel": "%s"%s}\n' % (redis_url, server_name, extra))
                sys.stdout.flush()
            await publish(redis_url, server_name, feed, rate=rate, stop=stop, on_ready=ready)
            return
        await serve_tcp(bind, port, make_connection, feed, on_listening=on_listening, rate=rate,
                        drop_after=drop_after, skip_on_reconnect=skip_on_reconnect,
                        silent_after=silent_after, error_after=error_after,
                        long_line_after=long_line_after, stop=stop)

    run_server(main(), bind, port)

