"""The DCP stream controls and collection filters of `stream` / `capture` as LiveOptions
fields, without the CLI: the options taken out of the parsed option dict, a bad value
BadSource with the option's name as its hint (cli/live.py turns it into a usage error)."""

from __future__ import annotations

from dcptool.protocol.errors import BadSource

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
