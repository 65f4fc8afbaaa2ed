"""Where a restarted capture continues from (`dcptool capture --resume`): the state recorded
in the captures already in the output directory.

* `recover_in_progress(directory)` first turns the in-progress segments a crashed run left
  behind into normal Parquet segments, so that what follows reads finished files only.
* `dcp_resume_state(paths)`: per vbucket, the newest failover log, the last seqno received,
  the snapshot that seqno belongs to and whether it was complete, and whether the stream
  ended with reason OK. `VbResume.stream_request()` gives the arguments of the stream
  request that continues without a gap or a duplicate.
* `synapse_resume_state(paths)`: per (stream, instance), the last committed token under the
  batch-token rule of REPLAY.md.

Only `in` frames change state (REPLAY.md); outgoing stream requests only reset "ended" (and
an unfinished OSO snapshot: the stream is asked again from before it).
The passes read a few columns (never `raw`), and skip the bulk of the items with one
vectorised mask per segment, so resuming over a large directory stays cheap.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dcptool.protocol.dcp.wire.constants import Status
from dcptool.protocol.errors import LateUsageError
from dcptool.replay.store.naming import IN_PROGRESS_SUFFIX, SEGMENT_NAME_RE
from dcptool.replay.store.reader import CaptureFile, find_captures, iter_capture_tables
from dcptool.replay.store.segment import finish_in_progress

# ops whose by_seqno is a position in the vbucket's history
SEQNO_OPS = ("mutation", "deletion", "expiration", "system_event", "seqno_advanced",
             "prepare", "commit", "abort")
CONTROL_OPS = ("snapshot_marker", "stream_req", "get_failover_log", "stream_end", "oso_snapshot")
DCP_COLUMNS = ["direction", "op", "status", "vbucket", "stream_id", "by_seqno", "snap_start", "snap_end",
               "snap_flags", "stream_end_reason", "rollback_seqno", "failover_log"]
SID_SHIFT = 16      # grouping rows by stream: vbucket | stream id << 16 (0: no stream id)
OSO_START, OSO_END = 0x01, 0x02     # the flags of an oso_snapshot row (its snap_flags column)


@dataclasses.dataclass
class VbResume:
    vbucket: int
    failover_log: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # newest first
    last_seqno: int = 0
    snap_start: int = 0
    snap_end: int = 0
    snapshot_complete: bool = True
    ended: bool = False                # a stream end with reason 0 (OK) after the last request
    stream_end_reason: int | None = None
    rollbacks: int = 0
    # a marker whose snapshot becomes current once one of its items arrives
    pending_snapshot: tuple[int, int] | None = dataclasses.field(default=None, repr=False)
    # inside an OSO snapshot: the highest seqno received in it so far (last_seqno stays at
    # the seqno before its start until its end arrives: REPLAY.md)
    oso_high: int | None = dataclasses.field(default=None, repr=False)
    # a capture with stream ids (--stream-ids): the state of each of the vbucket's streams by
    # stream id; the fields above are then those of the stream that is furthest behind
    streams: dict = dataclasses.field(default_factory=dict)
    # the ends of whole snapshots received (the consumer's VbState.points, PROTOCOLS.md): a
    # rollback goes back to the newest of them at or below its seqno
    points: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def vbucket_uuid(self) -> int:
        return self.failover_log[0][0] if self.failover_log else 0

    def stream_request(self) -> dict:
        """start_seqno, vbucket_uuid, snap_start, snap_end for the stream request that
        continues after `last_seqno`: inside an unfinished snapshot the producer gets the
        snapshot's range (it resumes or asks for a rollback); after a complete one, the
        range collapses onto the last seqno."""
        if self.snapshot_complete:
            start = end = self.last_seqno
        else:
            start, end = self.snap_start, self.snap_end
        return {"start_seqno": self.last_seqno, "vbucket_uuid": self.vbucket_uuid,
                "snap_start": min(start, self.last_seqno), "snap_end": max(end, self.last_seqno)}


class Recovered(list):
    """The paths of the segments `recover_in_progress` wrote, in `damaged` one line per
    in-progress file it could not read whole (kept aside as `.arrows.damaged`), and in `torn`
    one line (information) per file whose torn tail it dropped."""

    def __init__(self, paths: Iterable[str] = (), damaged: Iterable[str] = (), torn: Iterable[str] = ()) -> None:
        super().__init__(paths)
        self.damaged: list[str] = list(damaged)
        self.torn: list[str] = list(torn)


# a recovery done earlier in this process (capture's check before the protocol's resume
# runs), handed to the next call for the same directory so that it is reported once, whole
_EARLIER: dict[str, Recovered] = {}


def recover_in_progress(directory) -> Recovered:
    """Turn every leftover `.arrows` segment in `directory` (not held by a live writer)
    into a normal Parquet segment; the paths of the segments written. A file with bytes
    that cannot be read gives its whole batches before them and is kept aside as
    `.arrows.damaged` (`Recovered.damaged` says so), never deleted."""
    directory = os.fspath(directory)
    done = _EARLIER.pop(os.path.realpath(directory), None) or Recovered()
    if not os.path.isdir(directory):
        return done
    for name in sorted(os.listdir(directory)):
        if name.endswith(IN_PROGRESS_SUFFIX) and not name.startswith("."):
            info = finish_in_progress(os.path.join(directory, name))
            if info is not None:
                if info.get("path"):
                    done.append(info["path"])
                if info.get("note"):
                    (done.torn if info.get("torn") else done.damaged).append(info["note"])
    return done


def recover_first(directory) -> Recovered:
    """recover_in_progress now, its result handed again to the next call for `directory`
    (the protocol's resume, which reports it)."""
    done = recover_in_progress(directory)
    _EARLIER[os.path.realpath(os.fspath(directory))] = done
    return done


def _files(paths, protocol: str) -> list[CaptureFile]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    if paths and all(isinstance(p, CaptureFile) for p in paths):
        files = paths
    else:
        paths = [os.fspath(p) for p in paths if os.path.exists(os.fspath(p))]
        if not paths:
            return []
        files = find_captures(paths)
    return [f for f in files if f.protocol == protocol]


def _dcp_rows_that_matter(t: pa.Table) -> pa.Table:
    """In-frames that change resume state: every control frame, and of the items only
    the last one before each control frame of its vbucket (and the last one overall), and
    the highest of them (an OSO snapshot's items come in key order)."""
    n = t.num_rows
    if n == 0:
        return t
    op = t.column("op").combine_chunks()
    op = op.dictionary_decode() if pa.types.is_dictionary(op.type) else op
    direction = t.column("direction").combine_chunks()
    direction = direction.dictionary_decode() if pa.types.is_dictionary(direction.type) else direction
    is_in = pc.fill_null(pc.equal(direction, "in"), False).to_numpy(zero_copy_only=False)
    is_out_req = pc.fill_null(pc.and_(pc.equal(direction, "out"), pc.equal(op, "stream_req")),
                              False).to_numpy(zero_copy_only=False)
    status = t.column("status")
    is_req = pc.is_null(status).to_numpy(zero_copy_only=False)
    is_ctrl = pc.fill_null(pc.is_in(op, pa.array(CONTROL_OPS)), False).to_numpy(zero_copy_only=False)
    is_ctrl |= pc.fill_null(pc.equal(status, int(Status.ROLLBACK)), False).to_numpy(zero_copy_only=False)
    is_ctrl = (is_ctrl & is_in) | is_out_req
    is_item = (pc.fill_null(pc.is_in(op, pa.array(SEQNO_OPS)), False).to_numpy(zero_copy_only=False)
               & is_in & is_req & pc.is_valid(t.column("by_seqno")).to_numpy(zero_copy_only=False))
    vb = pc.fill_null(t.column("vbucket").cast(pa.int32()), -1).to_numpy(zero_copy_only=False).astype(np.int64)
    if "stream_id" in t.column_names:   # each stream of a vbucket on its own
        sid = pc.fill_null(t.column("stream_id").cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
        vb = np.where(vb >= 0, vb | sid << SID_SHIFT, vb)
    interesting = np.nonzero(is_ctrl | is_item)[0]
    if len(interesting) == 0:
        return t.slice(0, 0)
    # stable sort by vbucket keeps frame order within a vbucket
    order = interesting[np.argsort(vb[interesting], kind="stable")]
    v, ctrl = vb[order], is_ctrl[order]
    nxt_same_vb = np.zeros(len(order), bool)
    nxt_same_vb[:-1] = v[1:] == v[:-1]
    nxt_ctrl = np.zeros(len(order), bool)
    nxt_ctrl[:-1] = ctrl[1:]
    keep = ctrl | ~nxt_same_vb | nxt_ctrl
    seqno = pc.fill_null(t.column("by_seqno"), -1).to_numpy(zero_copy_only=False)[order]
    run = np.cumsum(np.r_[True, (v[1:] != v[:-1]) | ctrl[1:] | ctrl[:-1]])   # items between two control frames
    top = np.full(run[-1] + 1, -1, np.int64)
    np.maximum.at(top, run, seqno)
    keep |= ~ctrl & (seqno == top[run])
    return t.take(pa.array(np.sort(order[keep])))


def dcp_resume_state(files, initial: dict[int, VbResume] | None = None) -> dict[int, VbResume]:
    """Resume state per vbucket from DCP captures (paths, directories or CaptureFiles),
    in capture order; with stream ids, each stream's in `streams` of its vbucket's.
    `initial`: the state before these files (the head a retention ring deleted)."""
    state: dict[tuple[int, int], VbResume] = {}     # by (vbucket, stream id; 0 without)
    for vb, head in (initial or {}).items():
        for sid, x in (head.streams.items() if head.streams else [(0, head)]):
            state[(vb, sid)] = dataclasses.replace(x, failover_log=list(x.failover_log), streams={})
    for t in iter_capture_tables(_files(files, "dcp"), DCP_COLUMNS):
        rows = _dcp_rows_that_matter(t)
        if rows.num_rows == 0:
            continue
        cols = rows.to_pydict()
        for i in range(rows.num_rows):
            vb = cols["vbucket"][i]
            if vb is None:
                continue
            key = (vb, cols["stream_id"][i] or 0)
            s = state.get(key)
            if s is None:
                s = state[key] = VbResume(vb)
            op, status, direction = cols["op"][i], cols["status"][i], cols["direction"][i]
            if direction == "out":                       # a new stream request went out
                s.ended = False
                s.oso_high = None
                continue
            if status is not None:                       # a response
                if status == int(Status.ROLLBACK) and cols["rollback_seqno"][i] is not None:
                    rb = cols["rollback_seqno"][i]
                    s.rollbacks += 1
                    below = [p for p in s.points if p <= rb]
                    s.last_seqno = below[-1] if below and rb < s.last_seqno else min(s.last_seqno, rb)
                    s.points = below
                    s.snap_start = s.snap_end = s.last_seqno
                    s.snapshot_complete = True
                elif status == 0 and op in ("stream_req", "get_failover_log") \
                        and cols["failover_log"][i]:
                    s.failover_log = [(e["vbucket_uuid"], e["seqno"]) for e in cols["failover_log"][i]]
                continue
            if op == "snapshot_marker":
                if s.last_seqno >= s.snap_end or (cols["snap_start"][i] or 0) > s.snap_end:
                    s.snapshot_complete = True
                if s.last_seqno >= s.snap_end and (not s.points or s.points[-1] < s.last_seqno):
                    s.points.append(s.last_seqno)
                    del s.points[:-32]
                s.pending_snapshot = (cols["snap_start"][i] or 0, cols["snap_end"][i] or 0)
            elif op == "stream_end":
                s.stream_end_reason = cols["stream_end_reason"][i]
                s.ended = s.stream_end_reason == 0
                s.oso_high = None
            elif op == "oso_snapshot":
                flags = cols["snap_flags"][i] or 0
                if flags & OSO_START:
                    s.oso_high = s.last_seqno
                elif flags & OSO_END and s.oso_high is not None:
                    s.last_seqno = s.snap_start = s.snap_end = max(s.last_seqno, s.oso_high)
                    s.snapshot_complete, s.pending_snapshot, s.oso_high = True, None, None
            elif s.oso_high is not None and cols["by_seqno"][i] is not None:
                s.oso_high = max(s.oso_high, cols["by_seqno"][i])
            elif cols["by_seqno"][i] is not None:
                if s.pending_snapshot is not None:
                    s.snap_start, s.snap_end = s.pending_snapshot
                    s.pending_snapshot = None
                s.last_seqno = cols["by_seqno"][i]
                s.snapshot_complete = s.last_seqno >= s.snap_end
    return _by_vbucket(state)


def _by_vbucket(state: dict[tuple[int, int], VbResume]) -> dict[int, VbResume]:
    """Streams to vbuckets: a vbucket streamed with stream ids gets its streams' states in
    `streams`, and the fields of the one furthest behind."""
    out: dict[int, VbResume] = {}
    sids: dict[int, dict[int, VbResume]] = {}
    for (vb, sid), s in state.items():
        if sid:
            sids.setdefault(vb, {})[sid] = s
        else:
            out[vb] = s
    for vb, streams in sids.items():
        low = min(streams.values(), key=lambda x: x.last_seqno)
        out[vb] = dataclasses.replace(low, streams=streams)
    return out


def dcp_resume_options(files) -> dict:
    """The `dcptool.options` of the newest DCP capture segment (what the run that wrote it
    asked for: `capture --resume` keeps its collection filter); {} when there is none."""
    import json

    from dcptool.replay.store.schema import META_OPTIONS
    found = _files(files, "dcp")
    if not found:
        return {}
    text = found[-1].metadata.get(META_OPTIONS)
    try:
        out = json.loads(text) if text else {}
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def synapse_resume_state(files, hold_gaps: bool = False) -> dict[tuple[str, str], int]:
    """Last committed token per (stream, instance): RDATA with a numeric token commits at
    that token (and commits the `batch` rows waiting before it); `batch` rows alone commit
    nothing; POSITION moves the position to its new token. With `hold_gaps` (a capture with
    --catch-up), a POSITION that showed a gap no catch-up filled (replay/rules/synapse_catchup.py)
    holds the token at the gap's start, so the resumed capture fetches the gap again (rows it then gets twice are counted
    once by replay)."""
    from dcptool.protocol.synapse.cover import CATCH_UP, Cover
    tokens: dict[tuple[str, str], int] = {}
    gaps: list[tuple[tuple[str, str], int, int]] = []
    cover = Cover()
    cols_wanted = ["direction", "command", "stream", "instance", "token", "prev_token", "new_token"]
    for t in iter_capture_tables(_files(files, "synapse"), cols_wanted):
        direction = t.column("direction")
        direction = direction.cast(pa.string()) if pa.types.is_dictionary(direction.type) else direction
        command = t.column("command").cast(pa.string())
        is_pos = pc.and_(pc.equal(command, "POSITION"), pc.is_valid(t.column("new_token")))
        keep = pc.or_(
            pc.and_(pc.equal(direction, "in"),
                    pc.or_(pc.and_(pc.equal(command, "RDATA"), pc.is_valid(t.column("token"))), is_pos)),
            pc.and_(pc.equal(direction, CATCH_UP), is_pos))
        rows = t.filter(pc.fill_null(keep, False)).select(["direction", "command", "stream", "instance",
                                                          "token", "prev_token", "new_token"]).to_pydict()
        for d, cmd, stream, inst, tok, prev, new in zip(rows["direction"], rows["command"], rows["stream"],
                                                        rows["instance"], rows["token"], rows["prev_token"],
                                                        rows["new_token"]):
            if stream is None:
                continue
            key = (stream, inst)
            if d == CATCH_UP:
                if prev is not None:
                    cover.add(key, prev, new)
                continue
            have = tokens.get(key)
            if cmd == "POSITION" and prev is not None and have is not None and have < prev:
                gaps.append((key, have, prev))
            tokens[key] = tok if cmd == "RDATA" else new
    for key, lo, hi in gaps if hold_gaps else ():
        if not cover.covers(key, lo, hi) and key in tokens:
            tokens[key] = min(tokens[key], lo)
    return tokens


# ------------------------------------------------------------------ one source per directory

class SourceMismatch(LateUsageError):
    """`capture` into a directory that holds a capture of another protocol or source (a
    usage error: the CLI exits 2)."""


_SECRET_WORDS = ("pass", "secret", "token", "key", "auth", "cred", "pwd")


def display_source(url: str) -> str:
    """A recorded source URL to show: no user name, no credential-looking query parameter."""
    import urllib.parse
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url.rpartition("@")[2] if "://" not in url else url.split("://", 1)[0] + "://?"
    netloc = parts.netloc.rpartition("@")[2]
    query = "&".join(kv for kv in parts.query.split("&")
                     if kv and not any(w in kv.partition("=")[0].lower() for w in _SECRET_WORDS))
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def same_source(a: str, b: str) -> bool:
    """Two source URLs name the same source: DCP the same bucket on a cluster they share a
    seed host of (user, ports, seed order and couchbase/couchbases aside); Synapse the same
    host, port, database and server name."""
    import urllib.parse
    try:
        pa_, pb = urllib.parse.urlsplit(a), urllib.parse.urlsplit(b)
    except ValueError:
        return a == b
    sa, sb = pa_.scheme.lower(), pb.scheme.lower()
    if sa.startswith("couchbase") and sb.startswith("couchbase"):
        return (urllib.parse.unquote(pa_.path.strip("/")) == urllib.parse.unquote(pb.path.strip("/"))
                and bool(_hosts(pa_.netloc) & _hosts(pb.netloc)))
    if sa != sb:
        return False
    qa, qb = urllib.parse.parse_qs(pa_.query), urllib.parse.parse_qs(pb.query)
    return (_hosts(pa_.netloc) == _hosts(pb.netloc) and pa_.path.strip("/") == pb.path.strip("/")
            and qa.get("server_name") == qb.get("server_name"))


def _hosts(netloc: str) -> set[str]:
    """host[:port] list of a netloc (user removed) -> {host} for DCP seeds, {host:port} else."""
    out = set()
    for part in netloc.rpartition("@")[2].split(","):
        part = part.strip().lower()
        if part.startswith("["):
            out.add(part[1:].partition("]")[0])
        else:
            out.add(part.partition(":")[0])
    return out


def recorded_sources(directory) -> list[tuple[str, str, str, str]]:
    """(protocol, source, capture_id, source_id) of each capture in `directory`, from one
    segment of each (segments are named by capture: `{protocol}-{start}-{id8}-{segment}`;
    source_id "" when it recorded none); files that are no capture are left out."""
    from dcptool.replay.store import reader
    from dcptool.replay.store.schema import META_SOURCE, META_SOURCE_ID
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    seen: set[str] = set()
    out = []
    for name in sorted(os.listdir(directory)):
        if name.startswith(".") or not name.endswith((".parquet", IN_PROGRESS_SUFFIX)):
            continue
        m = SEGMENT_NAME_RE.match(name)
        key = f"{m.group(1)}-{m.group(2)}-{m.group(3)}" if m else name
        path = os.path.join(directory, name)
        if key in seen or not os.path.isfile(path) or os.path.getsize(path) == 0:
            continue
        try:
            f = reader.describe(path)
        except reader.UnsupportedFormat:
            raise
        except (reader.CaptureError, OSError):
            continue
        seen.add(key)
        out.append((f.protocol, f.metadata.get(META_SOURCE, ""), f.capture_id, f.metadata.get(META_SOURCE_ID, "")))
    return out


def check_source(directory, protocol: str, source: str, *, resume: bool, force_new: bool,
                 source_id: str | None = None) -> None:
    """A capture directory belongs to one protocol and one source: raise SourceMismatch
    (naming both, without credentials) when `directory` holds a capture of another protocol,
    or of another source unless `force_new` (a new capture of another source next to it).
    Before connecting: `source_id` is the source's identity where the URL gives it (Synapse's
    server_name), None when only the connection will tell (check_identity then decides
    for a recorded capture with an identity whose URL differs only by host and port)."""
    for proto, recorded, _cid, rec_id in recorded_sources(directory):
        where = os.fspath(directory)
        if proto != protocol:
            raise SourceMismatch(
                f"{where} holds a {proto} capture ({display_source(recorded)}), not {protocol} "
                f"({display_source(source)}): a capture directory holds one protocol; use another --output")
        if rec_id and source_id is None and _same_but_hosts(recorded, source):
            continue        # the identity decides, once the connection is set up
        if not same_origin(recorded, rec_id, source, source_id or "") and not (force_new and not resume):
            what = "--resume continues the capture of" if resume else "it holds a capture of"
            raise SourceMismatch(
                f"{where}: {what} {display_identity(rec_id, recorded)}, not {display_identity(source_id or '', source)}; "
                f"use another --output{'' if resume else ', or --force-new for a new capture of another source there'}")


def _same_but_hosts(a: str, b: str) -> bool:
    """Two URLs that name the same source but for their hosts and ports: DCP the same bucket,
    Synapse the same scheme and database."""
    import urllib.parse
    try:
        pa_, pb = urllib.parse.urlsplit(a), urllib.parse.urlsplit(b)
    except ValueError:
        return False
    sa, sb = pa_.scheme.lower(), pb.scheme.lower()
    if sa.startswith("couchbase") and sb.startswith("couchbase"):
        return urllib.parse.unquote(pa_.path.strip("/")) == urllib.parse.unquote(pb.path.strip("/"))
    return sa == sb and pa_.path.strip("/") == pb.path.strip("/")


# ------------------------------------------------------------------ the source's identity

def bucket_identity(uuid: str) -> str:
    """The `dcptool.source_id` of a DCP source: its bucket's UUID ("" when it gave none)."""
    return f"bucket-uuid:{uuid}" if uuid else ""


def server_identity(name: str | None) -> str:
    """The `dcptool.source_id` of a Synapse source: its server name ("" when unknown)."""
    return f"server-name:{name}" if name else ""


def display_identity(source_id: str, url: str) -> str:
    """A source as an error line names it: `bucket uuid U (URL)`, `server name N (URL)`,
    or the URL alone without an identity (the server's text escaped)."""
    from dcptool.protocol.text import printable
    kind, _, value = source_id.partition(":")
    if not value:
        return display_source(url)
    return f"{kind.replace('-', ' ')} {printable(value)} ({display_source(url)})"


def same_origin(source_a: str, id_a: str, source_b: str, id_b: str) -> bool:
    """Two captures are of the same source: their identities are equal where both recorded
    one (whatever host and port each came from), else their URLs name the same source
    (`same_source`: the host rule of sources that give no identity)."""
    if id_a and id_b:
        return id_a == id_b
    return same_source(source_a, source_b)


def check_identity(directory, protocol: str, source: str, source_id: str, *,
                   resume: bool, force_new: bool) -> None:
    """After the connection is set up, before anything of it is written: raise SourceMismatch
    (one line naming both identities) when a capture in `directory` is of another source
    than `source` with identity `source_id` (`same_origin`), unless `force_new` (a new
    capture next to it; never with --resume)."""
    for proto, recorded, _cid, rec_id in recorded_sources(directory):
        if proto != protocol or same_origin(recorded, rec_id, source, source_id) or (force_new and not resume):
            continue
        what = "--resume continues the capture of" if resume else "it holds a capture of"
        raise SourceMismatch(
            f"{os.fspath(directory)}: {what} {display_identity(rec_id, recorded)}, not "
            f"{display_identity(source_id, source)}; use another --output"
            f"{'' if resume else ', or --force-new for a new capture of another source there'}")
