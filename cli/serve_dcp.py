"""`dcptool serve dcp`: a DCP producer serving one generated bucket, with failure scenarios
for testing consumers (protocol/dcp/producer.py over protocol/transport/dcp.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import click

from dcptool.cli.playback import check_unused, playback_options, serve_dcp_capture
from dcptool.cli.run_summary import STOP_SIGNALS
from dcptool.cli.sources import parse_duration


def _reasons(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"not a list of reason codes: {text!r} (e.g. 2,4,6)",
                                 param_hint="--end-reasons") from None


@click.command("dcp")
@click.option("--bind", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=11210, show_default=True, type=click.IntRange(0, 65535),
              help="Port (0 picks a free one).")
@click.option("--bucket", default="default", show_default=True, help="Name of the bucket served.")
@click.option("--vbuckets", default=64, show_default=True, type=click.IntRange(1, 1024),
              help="Number of vbuckets.")
@click.option("--items", default=10_000, show_default=True, type=click.IntRange(min=0),
              help="Documents generated at start (keys doc-00000000..., spread by the key hash).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of values, uuids and live updates.")
@click.option("--value-size", default=61, show_default=True, type=click.IntRange(24, 1 << 20),
              help="Bytes of each generated JSON value (61 makes 128-byte mutation frames).")
@click.option("--rate", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Live updates per second (updates, new documents, deletions, expirations).")
@click.option("--checkpoint-items", default=100, show_default=True, type=click.IntRange(min=1),
              help="Seqnos per in-memory checkpoint (a memory snapshot never crosses one).")
@click.option("--user", "users", multiple=True,
              help="Require SASL as this user (repeatable); the password is DCPTOOL_PASSWORD.")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), help="Serve TLS with this certificate.")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), help="Private key of --tls-cert.")
@click.option("--failover-at", type=click.IntRange(min=1), default=None,
              help="Scenario: after N stream frames every vbucket fails over (a new branch) and the "
                   "connection drops; a consumer that resumes gets ROLLBACK.")
@click.option("--failover-loss", default=10, show_default=True, type=click.IntRange(min=0),
              help="Seqnos each vbucket loses in that failover (rewritten on the new branch).")
@click.option("--disconnect-after", type=click.IntRange(min=1), default=None,
              help="Scenario: drop the connection after N stream frames (once).")
@click.option("--end-reasons", default=None,
              help="Scenario: the first stream of vbucket i ends mid-snapshot with the i-th reason, "
                   "e.g. 0,1,2,3,4,5,6,7,8 (7 and 8 become 0 without collections, as in Couchbase).")
@click.option("--slow", default=None, help="Scenario: pause this long between small send batches, e.g. 50ms.")
@click.option("--slow-frames", default=16, show_default=True, type=click.IntRange(min=1),
              help="Frames per batch with --slow.")
@click.option("--silent", is_flag=True, help="Scenario: after the first stream request send nothing at all.")
@click.option("--refuse-control", "refuse_controls", multiple=True,
              help="Scenario: answer this DCP_CONTROL key with NOT_SUPPORTED (repeatable).")
@playback_options
def serve_dcp(bind, port, bucket, vbuckets, items, seed, value_size, rate, checkpoint_items, users, tls_cert,
              tls_key, failover_at, failover_loss, disconnect_after, end_reasons, slow, slow_frames, silent,
              refuse_controls, from_capture, pace, disconnect_at, stall_at, corrupt_at):
    """Serve DCP for one generated bucket on BIND:PORT.

    Speaks HELLO, SASL (SCRAM-SHA512/256/SHA1, PLAIN), SELECT_BUCKET, DCP_OPEN,
    DCP_CONTROL, GET_ALL_VB_SEQNOS, STREAM_REQ (with Couchbase's rollback decision),
    GET_FAILOVER_LOG, CLOSE_STREAM, BUFFER_ACK and noops. Documents are pre-encoded, so a
    backfill runs at well over a million mutations per second. Flow control is enforced;
    a connection that leaves a noop unanswered for one interval is dropped. The first
    stdout line is {"listening": "HOST:PORT"}.

    \b
    Example:
      dcptool serve dcp --port 0 --items 100000 &
      dcptool stream couchbase://127.0.0.1:PORT/default --max-messages 20
    """
    from dcptool.protocol.dcp.producer import Scenarios, server_from_options
    from dcptool.protocol.transport.dcp import ProducerServer

    user_map = {}
    if users:
        password = os.environ.get("DCPTOOL_PASSWORD")
        if not password:
            raise click.UsageError("--user needs the password in DCPTOOL_PASSWORD")
        user_map = {u: password for u in users}
    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together")
    scenarios = Scenarios(failover_at=failover_at, failover_loss=failover_loss, disconnect_after=disconnect_after,
                          end_reasons=_reasons(end_reasons), slow=parse_duration(slow, "--slow") if slow else 0.0,
                          slow_frames=slow_frames, silent=silent, refuse_controls=tuple(refuse_controls))
    tls = None
    if tls_cert:
        import ssl
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(tls_cert, tls_key)
    check_unused(click.get_current_context(), from_capture, pace, disconnect_at, stall_at, corrupt_at)
    if from_capture:   # play a capture back (cli/playback.py); --bucket etc. come from the capture
        serve_dcp_capture(from_capture, bind=bind, port=port, users=user_map, tls=tls, pace=pace,
                          disconnect_at=disconnect_at, stall_at=stall_at, corrupt_at=corrupt_at)
        return
    model = server_from_options(bucket=bucket, vbuckets=vbuckets, items=items, seed=seed, value_size=value_size,
                                users=user_map, scenarios=scenarios, checkpoint_items=checkpoint_items)

    async def main():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # SIGINT (even when the parent ignored it), SIGTERM, SIGHUP: stopping is the normal
        # end of a server, so it closes its connections and exits 0; installed before the
        # listening line, so a signal sent as soon as it is read is never lost
        for sig in STOP_SIGNALS:
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError, ValueError):
                pass
        server = ProducerServer(model, rate=rate)
        host, p = await server.start(bind, port, tls)
        sys.stdout.write(json.dumps({"listening": f"{host}:{p}"}) + "\n")
        sys.stdout.flush()
        await stop.wait()
        await server.close()

    try:
        asyncio.run(main())
    except OSError as exc:
        from dcptool.protocol.errors import ConnectFailed
        raise ConnectFailed(f"cannot listen on {bind}:{port}: {exc.strerror or exc}") from None
