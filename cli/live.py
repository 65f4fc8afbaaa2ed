"""Options shared by `stream` and `capture` (the DCP stream controls and collection filters
taken out of the parsed options as LiveOptions fields: stream_controls, collection_filter),
and the dispatch to the protocol runners (cli/runners/dcp_live.py, cli/runners/synapse_live.py)."""

from __future__ import annotations

import importlib

import click

from dcptool.capture.options import LiveOptions, default_name
from dcptool.cli.sources import (
    parse_duration,
    parse_size,
    parse_source,
    parse_vbuckets,
    read_password,
    user_from,
)
from dcptool.protocol.errors import BadSource


def connection_options(fn):
    opts = [
        click.argument("source"),
        click.option("--user", help="User name (or DCPTOOL_USER). The password comes from "
                     "DCPTOOL_PASSWORD, --password-file, or a prompt on a TTY."),
        click.option("--password-file", type=click.Path(dir_okay=False),
                     help="File holding the password (first line)."),
        click.option("--ca-cert", type=click.Path(exists=True, dir_okay=False),
                     help="CA certificate for couchbases:// and rediss."),
        click.option("--insecure", is_flag=True, help="TLS without certificate verification."),
        click.option("--sasl-plain", is_flag=True,
                     help="Allow SASL PLAIN over plain TCP (always allowed over TLS)."),
        click.option("--vbuckets", default=None, help="DCP: vbuckets, e.g. 0-15,32 (default: all)."),
        click.option("--from", "from_", default="0", show_default=True,
                     help="DCP: start at 0, now, or a seqno."),
        click.option("--to", default="now", show_default=True,
                     help="DCP: stop at now (high seqno at stream start), forever, or a seqno."),
        click.option("--name", default=None, help="Connection name (DCP default dcptool-<host>-<pid>)."),
        click.option("--no-value", is_flag=True, help="DCP: ask the producer to leave values out."),
        click.option("--xattrs", is_flag=True, help="DCP: include extended attributes."),
        click.option("--collections", is_flag=True, help="DCP: negotiate collections."),
        click.option("--buffer-size", default="20MiB", show_default=True,
                     help="DCP: flow-control buffer (0 turns flow control off)."),
        click.option("--noop-interval", default="30s", show_default=True,
                     help="DCP: noop interval; the connection is dead after twice this silent."),
        click.option("--timeout", default="30s", show_default=True,
                     help="DCP: bound on connect + TLS, each handshake request, a stream reply "
                     "and a half-received frame; also the idle limit when noops are refused."),
        click.option("--conn-per-node", type=click.IntRange(1, 64), default=1, show_default=True,
                     help="DCP: connections per KV node of a cluster (its vbuckets split over them)."),
        click.option("--config-poll", default="2.5s", show_default=True,
                     help="DCP: how often to ask a cluster for its map (GET_CLUSTER_CONFIG)."),
        *stream_control_options(),
        *collection_filter_options(),
        click.option("--streams", default=None, help="Synapse: only these streams, e.g. events,caches."),
        click.option("--replicate/--no-replicate", default=True, show_default=True,
                     help="Synapse: send REPLICATE to obtain POSITIONs."),
        click.option("--max-messages", type=click.IntRange(min=1), default=None,
                     help="Stop after N messages received."),
        click.option("--duration", default=None, help="Stop after this long, e.g. 30s."),
        click.option("--metrics", default=None, metavar="HOST:PORT", help="Serve Prometheus metrics at "
                     "http://HOST:PORT/metrics while it runs (docs/CLI.md)."),
        click.option("--lag-interval", default="10s", show_default=True, help="DCP: poll each node's high "
                     "seqnos (GET_ALL_VB_SEQNOS) this often, and once at the end; 0 turns it off."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def stream_control_options() -> list:
    """DCP_CONTROL and flow-control options of issue 13 (--compress, --sync-writes,
    --expiry-opcode, --ack-ratio); parsed by stream_controls."""
    return [
        click.option("--compress", is_flag=True,
                     help="DCP: ask for Snappy-compressed values (force_value_compression); they are "
                     "captured as sent and shown decompressed."),
        click.option("--stream-ids", is_flag=True,
                     help="DCP: several streams per vbucket (enable_stream_id; implies --collections): one per "
                     "--collection value (SCOPE.A,SCOPE.B is one group) and per --scope, stream ids 1, 2, ..."),
        click.option("--sync-writes", is_flag=True,
                     help="DCP: receive durable writes as prepare, commit and abort (enable_sync_writes)."),
        click.option("--expiry-opcode/--no-expiry-opcode", default=None,
                     help="DCP: expirations as their own opcode (enable_expiry_opcode; default on) or "
                     "as deletions."),
        click.option("--change-streams", is_flag=True,
                     help="DCP: ask for change history (change_streams): snapshots of collections that "
                     "keep history carry every version of a key."),
        click.option("--oso", is_flag=True,
                     help="DCP: allow out-of-order backfills (enable_out_of_order_snapshots="
                     "true_with_seqno_advanced); the server uses them for a stream of one --collection."),
        click.option("--ack-ratio", default="0.5", show_default=True,
                     help="DCP: acknowledge once this share (0 < F <= 1) of --buffer-size is unacknowledged."),
    ]


def collection_filter_options() -> list:
    """--scope / --collection (repeatable; they imply --collections); parsed by collection_filter."""
    return [
        click.option("--scope", "scopes", multiple=True, metavar="NAME",
                     help="DCP: only the collections of this scope (repeatable; implies --collections)."),
        click.option("--collection", "collection_names", multiple=True, metavar="SCOPE.NAME",
                     help="DCP: only this collection (repeatable; implies --collections)."),
    ]


# option -> the DCP_CONTROL it asks for (a refusal of one given on the command line is fatal)
CONTROL_OF = {"compress": "force_value_compression", "sync_writes": "enable_sync_writes",
              "expiry_opcode": "enable_expiry_opcode", "change_streams": "change_streams",
              "oso": "enable_out_of_order_snapshots"}
CONTROL_OF["stream_ids"] = "enable_stream_id"


def stream_controls(kw: dict) -> dict:
    """--compress, --sync-writes, --expiry-opcode, --change-streams, --oso, --stream-ids and
    --ack-ratio taken out of the options `kw` as LiveOptions fields (BadSource: a bad value)."""
    text = kw.pop("ack_ratio")
    try:
        ratio = float(text)
    except ValueError:
        ratio = -1.0
    if not 0 < ratio <= 1:
        raise BadSource(f"{text!r}: a share of --buffer-size above 0 and at most 1, e.g. 0.5", "--ack-ratio")
    expiry = kw.pop("expiry_opcode")
    out = {"compress": kw.pop("compress"), "sync_writes": kw.pop("sync_writes"),
           "expiry_opcode": True if expiry is None else expiry, "ack_ratio": ratio}
    given = {"compress": out["compress"], "sync_writes": out["sync_writes"], "expiry_opcode": expiry is True}
    out["change_streams"] = given["change_streams"] = kw.pop("change_streams")
    out["oso"] = given["oso"] = kw.pop("oso")
    out["stream_ids"] = given["stream_ids"] = kw.pop("stream_ids")
    out["required_controls"] = tuple(CONTROL_OF[k] for k, on in given.items() if on)
    return out


def collection_filter(kw: dict, stream_ids: bool = False) -> dict:
    """--scope / --collection taken out of `kw` as LiveOptions fields; they (and stream ids)
    set kw["collections"] (BadSource: a --collection that is not SCOPE.NAME)."""
    scopes = tuple(kw.pop("scopes"))
    # a --collection value may name several (SCOPE.A,SCOPE.B): one group (one stream id)
    groups = [tuple(n for n in value.split(",") if n) or (value,) for value in kw.pop("collection_names")]
    names = tuple(n for g in groups for n in g)
    for name in names:
        scope, dot, coll = name.partition(".")
        if not scope or not dot or not coll:
            raise BadSource(f"{name!r} is not SCOPE.NAME (e.g. inventory.airline)", "--collection")
    if scopes or names or stream_ids:
        kw["collections"] = True
    return {"scopes": scopes, "collection_names": names,
            "stream_groups": tuple(((), g) for g in groups) + tuple(((s,), ()) for s in scopes)}


def build_options(ctx: click.Context, kw: dict) -> LiveOptions:
    source = parse_source(kw.pop("source"))
    user = user_from(kw.pop("user"), source.url)
    password_file = kw.pop("password_file")
    # synapse:// (the TCP line protocol) has no authentication: a DCPTOOL_USER in the
    # environment must not make it ask for a password
    password = read_password(password_file, user=user,
                             needed=user is not None and source.scheme != "synapse")
    vb = kw.pop("vbuckets")
    buffer_size = parse_size(kw.pop("buffer_size"), "--buffer-size")
    noop = parse_duration(kw.pop("noop_interval"), "--noop-interval")
    timeout = parse_duration(kw.pop("timeout"), "--timeout")
    if timeout <= 0:
        raise click.BadParameter("must be above 0, e.g. 30s", param_hint="--timeout")
    kw["lag_interval"] = parse_duration(kw["lag_interval"], "--lag-interval")
    config_poll = parse_duration(kw.pop("config_poll"), "--config-poll")
    if config_poll <= 0:
        raise click.BadParameter("must be above 0, e.g. 2.5s", param_hint="--config-poll")
    try:
        controls = stream_controls(kw)
        controls.update(collection_filter(kw, controls["stream_ids"]))
    except BadSource as exc:
        raise click.BadParameter(str(exc), param_hint=exc.hint) from None
    duration = kw.pop("duration")
    if duration is not None:
        duration = parse_duration(duration, "--duration")
        if duration <= 0:   # 0 is not "no limit": leave the option out for that
            raise click.UsageError("--duration must be positive, e.g. 30s (leave it out for no limit)")
    if kw.get("ca_cert"):
        check_ca_cert(kw["ca_cert"])
    streams = kw.pop("streams")
    name = kw.pop("name")
    if source.protocol == "dcp" and not name:
        name = default_name(source)
    for opt, val in (("--from", kw["from_"]), ("--to", kw["to"])):
        allowed = ("0", "now") if opt == "--from" else ("now", "forever")
        if val not in allowed and not val.isdigit():
            raise click.BadParameter(f"{val!r}: use {' or '.join(allowed)} or a seqno", param_hint=opt)
    return LiveOptions(
        source=source, user=user, password=password,
        vbuckets=parse_vbuckets(vb) if vb else None,
        buffer_size=buffer_size, noop_interval=noop, timeout=timeout, config_poll=config_poll,
        duration=duration,
        streams=[s for s in streams.split(",") if s] if streams else None,
        name=name, verbose=bool((ctx.find_root().obj or {}).get("verbose")),
        **controls, **kw,
    )


def check_ca_cert(path: str) -> None:
    """--ca-cert must hold a PEM certificate: a usage error (exit 2) now, not an OpenSSL
    message (exit 1) at connect time."""
    import ssl
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError:
        raise click.UsageError(f"--ca-cert {path}: not a PEM certificate") from None
    except OSError as exc:
        raise click.UsageError(f"--ca-cert {path}: cannot read it ({exc.strerror or exc})") from None


# (protocol, command) -> "module:function" of the runner; imported only when it runs, so a
# DCP command never loads the Synapse code and the reverse
RUNNERS = {
    ("dcp", "stream"): "dcptool.cli.runners.dcp_live:run_stream",
    ("dcp", "capture"): "dcptool.cli.runners.dcp_capture:run_capture",
    ("synapse", "stream"): "dcptool.cli.runners.synapse_live:run_stream",
    ("synapse", "capture"): "dcptool.cli.runners.synapse_live:run_capture",
}


def runner(protocol: str, command: str):
    module, _, name = RUNNERS[(protocol, command)].partition(":")
    return getattr(importlib.import_module(module), name)
