"""`dcptool serve dcp`: a DCP producer serving one generated bucket, with failure scenarios
for testing consumers (protocol/dcp/server/producer.py over protocol/transport/dcp_server.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import click

from dcptool.cli.exit_codes import error_line
from dcptool.cli.servers.serve_from import (
    check_unused,
    playback_options,
    serve_dcp_capture,
)
from dcptool.cli.sources import parse_duration
from dcptool.protocol.dcp.server.manifest import Manifest, parse_events
from dcptool.protocol.errors import ConnectFailed, LateUsageError
from dcptool.serve.runner import server_stop_event

# Lazy imports: only where start-up time needs them (`serve dcp --help` loads no numpy: the
# producer, its transport and the chaos schedules load when the server starts).
SCHEDULE_LINE_MAX = 1 << 20     # characters of a --schedule line read at most


def _reasons(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"not a list of reason codes: {text!r} (e.g. 2,4,6)",
                                 param_hint="--end-reasons") from None


def _topology(failover_at, rebalance_at, add_node_at, nodes):
    """(--failover-at N without a node, the cluster's scripted events)."""
    from dcptool.protocol.dcp.server.cluster import Event
    failover_all, events = None, []
    for text in failover_at:
        at, sep, node = text.partition(":")
        if not at.isdigit() or int(at) < 1 or (sep and not node.isdigit()):
            raise click.BadParameter(f"{text!r} is not N or N:NODE (e.g. 5000 or 5000:1)", param_hint="--failover-at")
        if not sep:
            if failover_all is not None:
                raise click.BadParameter("N without a node is given once only", param_hint="--failover-at")
            failover_all = int(at)
            continue
        if int(node) >= nodes + len(add_node_at):
            raise click.BadParameter(f"node {node} does not exist (nodes are 0..{nodes + len(add_node_at) - 1})",
                                     param_hint="--failover-at")
        events.append(Event(int(at), "failover", int(node)))
    events += [Event(at, "rebalance") for at in rebalance_at] + [Event(at, "add-node") for at in add_node_at]
    return failover_all, tuple(events)


def _schedule(chaos_seed, schedule_file, nodes, replicas, items, failover_loss, events):
    """The random topology schedule of --chaos SEED or --schedule FILE (chaos.py), or None."""
    if chaos_seed is None and schedule_file is None:
        return None
    from dcptool.protocol.dcp.server import chaos
    if chaos_seed is not None and schedule_file is not None:
        raise click.UsageError("--chaos and --schedule go alone: a schedule is drawn or read")
    if events:
        raise click.UsageError("--chaos / --schedule replace --rebalance-at, --failover-at N:NODE and --add-node-at")
    if chaos_seed is not None:
        return chaos.draw(chaos_seed, nodes, replicas, max(items, 1000), failover_loss)
    try:
        with open(schedule_file, encoding="utf-8") as f:
            line = f.readline(SCHEDULE_LINE_MAX + 1)
        if len(line) > SCHEDULE_LINE_MAX:
            raise chaos.ScheduleError(f"the first line is longer than {SCHEDULE_LINE_MAX} characters "
                                      "(a schedule is one short JSON line)")
        sched = chaos.from_json(line)
    except (OSError, UnicodeDecodeError, chaos.ScheduleError) as exc:
        raise LateUsageError(f"--schedule {schedule_file}: {exc}") from None
    if (sched.nodes, sched.replicas) != (nodes, replicas):
        raise LateUsageError(f"--schedule {schedule_file} was drawn for --nodes {sched.nodes} --replicas "
                             f"{sched.replicas}, not --nodes {nodes} --replicas {replicas}")
    try:       # every event checked now, before listening, not when it fires (exit 2, one line)
        chaos.validate(sched, failover_loss)
    except chaos.ScheduleError as exc:
        raise LateUsageError(f"--schedule {schedule_file}: {exc}") from None
    return sched


def _manifest(scopes, per_scope, create_at, drop_at):
    """The bucket's collections manifest (protocol/dcp/server/manifest.py)."""
    try:
        events = parse_events(create_at, drop_at)
    except ValueError as exc:
        hint = "--create-collection-at" if any(t in str(exc) for t in create_at) else "--drop-collection-at"
        raise click.BadParameter(str(exc), param_hint=hint) from None
    if scopes * per_scope > 120:
        raise click.BadParameter("at most 120 collections at start (--scopes x --collections-per-scope)",
                                 param_hint="--scopes")
    try:
        return Manifest(scopes, per_scope, events)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--create-collection-at / --drop-collection-at") from None


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
@click.option("--handshake-timeout", default="10s", show_default=True, metavar="DURATION",
              help="With --tls-cert: a client that has not completed its TLS handshake this long after "
                   "connecting is closed.")
@click.option("--failover-at", "failover_at", multiple=True, metavar="N[:NODE]",
              help="Scenario: N alone: after N stream frames every vbucket fails over (a new branch) and "
                   "the connection drops; a consumer that resumes gets ROLLBACK. N:NODE (with --nodes): "
                   "after N stream frames cluster-wide NODE stops answering and its vbuckets' replicas, "
                   "--failover-loss seqnos behind, are promoted (repeatable).")
@click.option("--nodes", default=1, show_default=True, type=click.IntRange(1, 16),
              help="Serve a cluster of this many KV nodes, each on its own port (node 0 on --port, the "
                   "others on free ports); GET_CLUSTER_CONFIG gives the map.")
@click.option("--replicas", default=0, show_default=True, type=click.IntRange(0, 3),
              help="Replicas of each vbucket in the cluster map.")
@click.option("--rebalance-at", "rebalance_at", multiple=True, type=click.IntRange(min=1), metavar="N",
              help="Topology event: after N stream frames cluster-wide, a quarter of the vbuckets (or what "
                   "fills a node just added) move by takeover; old streams end 'state changed' (repeatable).")
@click.option("--add-node-at", "add_node_at", multiple=True, type=click.IntRange(min=1), metavar="N",
              help="Topology event: after N stream frames cluster-wide a new node joins the map (its port is "
                   "listed in the first stdout line from the start; repeatable).")
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
@click.option("--sync-write-ratio", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="Share of live mutations (--rate) made durable: a prepare, then at the next seqno its "
                   "commit (4 in 5, seeded) or abort. Connections without enable_sync_writes get only the "
                   "committed mutations.")
@click.option("--corrupt-value-at", type=click.IntRange(min=1), default=None, metavar="N",
              help="Scenario: the N-th Snappy-compressed value sent (force_value_compression) is cut short, "
                   "so it does not decompress.")
@click.option("--scopes", default=0, show_default=True, type=click.IntRange(0, 20),
              help="Collections: user scopes besides _default (inventory, tenants, sales, ...); documents are "
                   "spread over _default._default and every collection (doc-N: N modulo their count).")
@click.option("--collections-per-scope", default=2, show_default=True, type=click.IntRange(1, 20),
              help="Collections in each user scope (airline, route, hotel, ...; ids from 0x8).")
@click.option("--create-collection-at", "create_collection_at", multiple=True, metavar="N:SCOPE.NAME",
              help="Scenario: after N stream frames a collection is created (a system event in every "
                   "vbucket, the manifest uid moves on; repeatable).")
@click.option("--drop-collection-at", "drop_collection_at", multiple=True, metavar="N:SCOPE.NAME",
              help="Scenario: after N stream frames a collection is dropped (a system event in every vbucket; "
                   "its items are gone; a stream whose filter named only dropped collections ends "
                   "'filter empty'; repeatable).")
@click.option("--history-collections", "history_collections", default=None, metavar="SCOPE.NAME[,...]|all",
              help="Change history: these collections (or all, also those created later) keep every "
                   "version of their keys, as a Magma bucket with history retention: their manifest entry "
                   "says \"history\": true, a connection with change_streams=true gets History|"
                   "MayContainDuplicates snapshots with every version. Without it change_streams is refused.")
@click.option("--expiry-pager", default="10s", show_default=True, metavar="DURATION",
              help="KV: how often the expiry pager deletes expired documents (an expiration each); a "
                   "read finds an expired document gone at once whatever this says.")
@click.option("--conflict-resolution", "conflict_resolution", type=click.Choice(["seqno", "lww"]), default="seqno",
              show_default=True,
              help="KV: how SET/ADD/DEL_WITH_META decide against the document held: seqno (the higher "
                   "revision wins) or lww (the higher CAS wins; writes need FORCE_ACCEPT_WITH_META_OPS).")
@click.option("--chaos", "chaos_seed", type=int, default=None, metavar="SEED",
              help="Random topology schedule drawn from SEED (rebalances in, out, swap and stopped half "
                   "way, graceful and hard failovers, recoveries, a node that stops answering, a restart "
                   "that lost its memory, revEpoch changes), printed as the first stdout line "
                   "(docs/SERVE.md).")
@click.option("--schedule", "schedule_file", type=click.Path(exists=True, dir_okay=False), default=None,
              metavar="FILE", help="Replay a schedule (the JSON line --chaos printed).")
@playback_options
def serve_dcp(bind, port, bucket, vbuckets, items, seed, value_size, rate, checkpoint_items, users, tls_cert,
              tls_key, handshake_timeout, failover_at, failover_loss, disconnect_after, end_reasons, slow, slow_frames, silent,
              refuse_controls, sync_write_ratio, corrupt_value_at, nodes, replicas, rebalance_at, add_node_at, from_capture, pace, disconnect_at, stall_at, corrupt_at,
              scopes, collections_per_scope, create_collection_at, drop_collection_at, history_collections,
              expiry_pager, conflict_resolution="seqno", chaos_seed=None, schedule_file=None):
    """Serve DCP for one generated bucket on BIND:PORT.

    Speaks HELLO, SASL (SCRAM-SHA512/256/SHA1, PLAIN), SELECT_BUCKET, DCP_OPEN,
    DCP_CONTROL, GET_ALL_VB_SEQNOS, STREAM_REQ (with Couchbase's rollback decision),
    GET_FAILOVER_LOG, CLOSE_STREAM, BUFFER_ACK and noops, and the KV commands of the
    Couchbase SDKs (get, upsert, insert, replace, remove, touch, counters, append, durable
    writes: docs/SERVE.md).
    Documents are pre-encoded, so a
    backfill runs at well over a million mutations per second. Flow control is enforced;
    a connection that leaves a noop unanswered for one interval is dropped. With --nodes N
    it serves a cluster: GET_CLUSTER_CONFIG returns the map, a vbucket asked of the wrong
    node gets NOT_MY_VBUCKET with the map. The first stdout line is
    {"listening": "HOST:PORT", "nodes": ["HOST:PORT", ...]} (listening = node 0); with
    --chaos SEED or --schedule FILE a random topology schedule runs and is printed first.

    \b
    Example:
      dcptool serve dcp --port 0 --items 100000 &
      dcptool stream couchbase://127.0.0.1:PORT/default --max-messages 20
    """
    from dcptool.protocol.dcp.server.producer import Scenarios, server_from_options
    from dcptool.protocol.transport.dcp_server import ProducerServer

    user_map = {}
    if users:
        password = os.environ.get("DCPTOOL_PASSWORD")
        if not password:
            raise click.UsageError("--user needs the password in DCPTOOL_PASSWORD")
        user_map = {u: password for u in users}
    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together")
    failover_all, events = _topology(failover_at, rebalance_at, add_node_at, nodes)
    schedule = _schedule(chaos_seed, schedule_file, nodes, replicas, items, failover_loss, events)
    scenarios = Scenarios(failover_at=failover_all, failover_loss=failover_loss, disconnect_after=disconnect_after,
                          end_reasons=_reasons(end_reasons), slow=parse_duration(slow, "--slow") if slow else 0.0,
                          slow_frames=slow_frames, silent=silent, refuse_controls=tuple(refuse_controls),
                          corrupt_value_at=corrupt_value_at)
    handshake = parse_duration(handshake_timeout, "--handshake-timeout")
    if not handshake > 0:
        raise click.BadParameter(f"{handshake_timeout!r}: use a duration above 0 (e.g. 10s)",
                                 param_hint="--handshake-timeout")
    tls = None
    if tls_cert:
        import ssl
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(tls_cert, tls_key)
    check_unused(click.get_current_context(), from_capture, pace, disconnect_at, stall_at, corrupt_at)
    if from_capture:   # play a capture back (cli/servers/serve_from.py); --bucket etc. come from the capture
        serve_dcp_capture(from_capture, bind=bind, port=port, users=user_map, tls=tls, pace=pace,
                          disconnect_at=disconnect_at, stall_at=stall_at, corrupt_at=corrupt_at,
                          handshake_timeout=handshake)
        return
    manifest = _manifest(scopes, collections_per_scope, create_collection_at, drop_collection_at)
    if history_collections:
        from dcptool.protocol.dcp.server.history import enable_history
        try:
            enable_history(manifest, history_collections.split(","))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--history-collections") from None
    model = server_from_options(bucket=bucket, vbuckets=vbuckets, items=items, seed=seed, value_size=value_size,
                                users=user_map, scenarios=scenarios, checkpoint_items=checkpoint_items,
                                nodes=nodes, replicas=replicas, events=events, manifest=manifest)
    for b in model.buckets.values():
        b.sync_ratio = sync_write_ratio
        b.conflict_resolution = conflict_resolution
    model.expiry_pager = parse_duration(expiry_pager, "--expiry-pager")
    if model.expiry_pager <= 0:
        raise click.BadParameter("must be more than 0", param_hint="--expiry-pager")

    broken: list[str] = []
    if schedule is not None:
        from dcptool.protocol.dcp.server.chaos import install
        install(model, schedule, seed, failover_loss)
        sys.stdout.write(schedule.to_json() + "\n")

    async def main():
        stop = server_stop_event()
        if schedule is not None:    # a broken invariant stops the server loudly
            model.cluster.on_broken = lambda msg: (broken.append(msg), stop.set())
        server = ProducerServer(model, rate=rate, handshake_timeout=handshake, freeze_heap=True, on_warning=error_line)
        host, p = await server.start(bind, port, tls)
        sys.stdout.write(json.dumps({"listening": f"{host}:{p}",
                                     "nodes": [f"{h}:{q}" for h, q in server.addresses]}) + "\n")
        sys.stdout.flush()
        await stop.wait()
        await server.close()

    try:
        asyncio.run(main())
    except OSError as exc:
        raise ConnectFailed(f"cannot listen on {bind}:{port}: {exc.strerror or exc}") from None
    if broken:
        from dcptool.protocol.dcp.server.chaos import InvariantBroken
        raise InvariantBroken(broken[0])
