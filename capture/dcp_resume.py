"""capture --resume of a DCP capture: the per-vbucket state the captures already in the
directory recorded (finishing any segment a killed capture left in progress first), and
the collection filter and stream ids they were made with, which a resumed capture keeps."""

from __future__ import annotations

import os

from dcptool.capture.options import LiveOptions
from dcptool.capture.shard import in_shard
from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.wire.constants import StreamEndReason
from dcptool.protocol.errors import LateUsageError
from dcptool.replay.store import retained
from dcptool.replay.store.reader import find_captures
from dcptool.replay.store.resume import (
    dcp_resume_options,
    dcp_resume_state,
    recover_in_progress,
)


def keep_filter(opts: LiveOptions, directory: str) -> None:
    """capture --resume keeps the collection filter (ids and manifest uid) the capture in
    `directory` recorded; other --scope / --collection names than it had are a usage error."""
    rec = dcp_resume_options(directory) if os.path.isdir(directory) else {}
    if rec and bool(rec.get("stream_ids")) != bool(opts.stream_ids) and (opts.stream_ids or _named(opts)):
        raise LateUsageError(f"--resume keeps the streams of the capture in {directory} (with"
                             f"{'' if rec.get('stream_ids') else 'out'} --stream-ids); give the same options or none")
    if rec.get("stream_ids"):
        _keep_stream_groups(opts, rec, directory)
        return
    flt = rec.get("collection_filter")
    given = (tuple(opts.scopes), tuple(opts.collection_names))
    recorded = (tuple(rec.get("scopes") or ()), tuple(rec.get("collection_names") or ()))
    if not rec or given == recorded and flt is None:
        return
    if flt is None or (any(given) and given != recorded):
        had = " ".join([*(f"--scope {x}" for x in recorded[0]), *(f"--collection {x}" for x in recorded[1])])
        raise LateUsageError(f"--resume keeps the collection filter of the capture in {directory} "
                             f"({had or 'none: every collection'}); give the same options or none")
    opts.scopes, opts.collection_names = recorded
    opts.stream_filter = dict(flt)
    opts.collections = True


def _named(opts: LiveOptions) -> bool:
    return bool(opts.scopes or opts.collection_names)


def _keep_stream_groups(opts: LiveOptions, rec: dict, directory: str) -> None:
    """capture --resume of a capture made with --stream-ids: the same stream ids, groups and
    resolved filters (each stream continues from its own recorded position)."""
    groups = tuple((tuple(sc), tuple(co)) for sc, co in rec.get("stream_groups") or ())
    if _named(opts) and tuple(opts.stream_groups) != groups:
        raise LateUsageError(f"--resume keeps the stream ids of the capture in {directory} "
                             f"({_describe_groups(groups)}); give the same options or none")
    opts.stream_ids, opts.collections, opts.stream_groups = True, True, groups
    opts.scopes = tuple(rec.get("scopes") or ())
    opts.collection_names = tuple(rec.get("collection_names") or ())
    if rec.get("stream_filters") is not None:
        opts.stream_filters = [dict(f) if f else None for f in rec["stream_filters"]]
    if rec.get("collection_filter") is not None:
        opts.stream_filter = dict(rec["collection_filter"])


def _describe_groups(groups: tuple) -> str:
    parts = [" ".join([*(f"--scope {x}" for x in sc), *(f"--collection {x}" for x in ([",".join(co)] if co else []))])
             for sc, co in groups]
    return "--stream-ids " + " ".join(parts) if parts else "--stream-ids"


def resume_from(directory: str, shard: str | None = None) -> tuple[dict[int, dcp_consumer.VbState], list[str]]:
    """Per-vbucket state recorded by earlier captures in directory (finishing any segment a
    killed capture left in progress first), after the head a retention ring deleted (its
    retained-state record); with --shard, of that shard's vbuckets only."""
    if not os.path.isdir(directory):
        return {}, []
    recovered = recover_in_progress(directory)
    files = [f for f in find_captures([directory]) if f.protocol == "dcp"] if any(
        n.endswith((".parquet", ".arrows")) for n in os.listdir(directory)) else []
    initial = retained.vb_states(retained.load(os.path.join(directory, retained.record_name(shard))))
    if not files and not initial:
        return {}, recovered
    state = {}
    for vb, r in dcp_resume_state(files, initial=initial).items():
        if not in_shard(vb, shard):
            continue
        if not r.failover_log and not r.last_seqno:
            continue
        state[vb] = _vb_state(r)
    return state, recovered


def _vb_state(r) -> dcp_consumer.VbState:
    """A recorded VbResume as the consumer's VbState (with its streams' for stream ids). A
    stream that reached its end continues from there: the new run's end is later."""
    return dcp_consumer.VbState(failover_log=list(r.failover_log), last_seqno=r.last_seqno,
                                snap_start=r.snap_start, snap_end=r.snap_end, snapshot_complete=r.snapshot_complete,
                                # "filter empty": every filtered collection was dropped; not reopened
                                ended_reason=r.stream_end_reason if r.stream_end_reason == StreamEndReason.FILTER_EMPTY
                                else None,
                                streams={sid: _vb_state(x) for sid, x in r.streams.items()},
                                points=list(r.points))
